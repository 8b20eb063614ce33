"""kvik's NVIDIA platform: Hopper and Blackwell, Triton kernels."""
