"""Developer tools that ship with the package (run with ``python -m moefuse.tools.<name>``; each
answers ``--help``). Nothing here is imported by ``import moefuse``.

* ``loopback_gpu_check``: the communication ops as two loopback ranks on ONE GPU (or, with
  ``--device cpu``, in the Triton interpreter): correctness against the references, bitwise
  across algorithms and ranks, optional CUDA-graph timings and a first-call stress check;
  ``loopback_families`` holds its op families.
* ``audit_reduce_trees``: offline (no GPU) comparison of the row-sum layouts of kernels that
  must give the same bits.
* ``compile_check_allgather``: offline sm_90a compile of the all-gather + norm kernels:
  registers, spills, CTAs per SM.
* ``ptxas``: the offline compile helpers they share (and scripts/ptx_check.py).
"""
