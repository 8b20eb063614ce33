"""kvik's Triton kernels, shared by the GPU platforms that run Triton (kvik_cuda, kvik_rocm).

One module per kernel beside the ``kvik.ops`` reference it is tested against, the Triton
attention backend (``attention``, registered as "TRITON_ATTN" by each GPU platform plugin) and the
ahead-of-time compile helper (``aot``). The launchers take tensors on the GPU, or on the CPU under
``TRITON_INTERPRET=1``.

Importing ``kvik`` never imports this package, and this package's ``__init__`` imports no triton:
``triton`` is a dependency of the GPU platform packages, not of core. A platform imports these
modules when it is selected, and passes its own choices to them: which kernels it registers for
which op, and the launch configurations for its architectures
(``attention.register_attention_configs``).
"""

#: What every Triton platform registers as "TRITON_ATTN": one target, so that two platforms
#: installed side by side register the same backend rather than conflicting ones.
TRITON_ATTENTION_BACKEND = "kvik.triton_kernels.attention:TritonAttentionBackend"
