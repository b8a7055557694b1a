"""The all-reduce family: all-reduce of an ``[M, H]`` input, optionally fused with the residual add,
RMSNorm and an FP8 / NVFP4 quantization of the normed row (``moefuse.allreduce*``).

Faces: ``api`` (validation, allocation, choice), ``ops`` (custom ops), ``kernels`` (launcher
and the gathered kernel), ``oneshot`` and ``twoshot`` (the peer kernels), ``rows`` (their shared
device functions), ``reference`` (PyTorch). It imports only the shared core of
:mod:`moefuse.comm`, never another family."""
