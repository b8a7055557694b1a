"""The expert-norm family: the MoE finalize with a per-expert RMSNorm, tensor-parallel
(``moefuse.tp_moe_finalize_rmsnorm``: the partial rows are summed over ranks before the norm) and
expert-parallel (``moefuse.moe_finalize_rmsnorm_allreduce``: normed locally, then all-reduced).

Faces: ``api``, ``workspace`` (:class:`ExpertNormWorkspace` and its registry), ``ops``,
``tp_kernels`` (with ``slot_oneshot``, ``token_owner`` and the shared device functions of
``slot_math``), ``ep_kernels``, ``reference``. It imports only the shared core of
:mod:`moefuse.comm`, never another family."""

#: The all-reduce launcher (``moefuse.comm.all_reduce.kernels.launch_allreduce_fusion``) that the
#: expert-parallel op's two-shot and torch.distributed paths run on the locally normed partial
#: rows. A family never imports another one, so ``moefuse/comm/__init__.py``, which imports every
#: family, installs it here (a lazy wrapper: importing moefuse imports no Triton).
ALLREDUCE: list = [None]
