"""The MoE-reduction family: the MoE reduction (dense expert rows) and the MoE finalize
(permuted expert rows through an index map) fused with the all-reduce, the residual add,
RMSNorm and an optional FP8 / NVFP4 quantization (``moefuse.moe_allreduce_residual_rmsnorm``,
``moefuse.moe_finalize_allreduce_residual_rmsnorm``).

Faces: ``api``, ``ops``, ``workspace`` (its optional peer regions), ``kernels`` (launch policy
and launcher), ``oneshot`` / ``twoshot`` / ``torch_path`` (the kernels), ``producer`` (the device
functions that compute a rank's partial row and finish a summed one), ``reference``.
It imports only the shared core of :mod:`moefuse.comm`, never another family."""
