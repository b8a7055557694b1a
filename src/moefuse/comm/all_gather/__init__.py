"""The all-gather family: all-gather of token shards fused with RMSNorm, its FP8 / NVFP4
quantized forms and the gated-residual next-layer norm (``moefuse.all_gather_*``).

Faces: ``api``, ``ops``, ``kernels`` (the gather launcher and kernel), ``decode`` (one launch
for decode sizes), ``persistent`` (the persistent gather + norm kernel of large M),
``norm_tiles`` (the device code both run: a tile's push / receive and the op's row tile),
``reference``. The row code of the norm and quant families is reused through their public
device functions (``moefuse.norm.triton``, ``moefuse.norm.gated``, ``moefuse.quant.fused``);
it imports only the shared core of :mod:`moefuse.comm`, never another comm family."""
