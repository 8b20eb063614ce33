"""kvik's Triton kernels, one module each beside the ``kvik.ops`` reference it is tested against.

The launchers take tensors on the GPU, or on the CPU under ``TRITON_INTERPRET=1``.
"""
