"""The attention backend interface: what a platform's paged attention implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor


@dataclass
class AttentionMetadata:
    """What every backend gets for one step; the runner builds it from the SchedulerOutput.

    Requests are laid out one after another in the flat token dimension T: request r owns tokens
    ``query_start_loc[r]:query_start_loc[r+1]``, which sit at positions
    ``seq_lens[r] - query_lens[r] ... seq_lens[r] - 1`` of its sequence. A request's context is its
    first ``seq_lens[r]`` tokens, read from the paged cache through ``block_table[r]``.
    """

    num_actual_tokens: int
    num_reqs: int
    query_start_loc: Tensor  # [R + 1] int32
    query_lens: Tensor  # [R] int32
    seq_lens: Tensor  # [R] int32
    block_table: Tensor  # [R, max_blocks_per_req] int32
    slot_mapping: Tensor  # [T] int64
    max_query_len: int
    max_seq_len: int
    block_size: int
    #: [R] bool on the host: requests whose query tokens are each to be computed as a decode token
    #: is (a speculative verification: the newest token and its drafts), so that greedy outputs do
    #: not depend on whether speculation is on. None: just the requests of one query token. A
    #: backend whose kernels round prompt chunks and decodes alike may ignore it.
    decode_requests: Tensor | None = None
    #: [T] int32 on the device, given with ``decode_requests``: each token row's request and the
    #: keys it attends to (its position + 1), for a backend that computes a verification's rows
    #: as decodes of their own (the Triton backend, when every request is one).
    token_requests: Tensor | None = None
    token_seq_lens: Tensor | None = None
    #: How many requests at the front of the batch have one query token each (decodes), known
    #: on the host: a backend may attend to them in a launch of their own, apart from the
    #: step's prompt chunks (the Triton backend, where many decodes meet prompts).
    num_leading_decodes: int = 0


@dataclass(frozen=True)
class AttentionSpec:
    """What a metadata builder may size its persistent buffers by (the model's first attention
    layer and the engine's limits)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int
    max_num_seqs: int
    max_num_tokens: int
    max_model_len: int
    device: torch.device
    #: The paged cache's dtype (float8_e4m3fn for ``--kv-cache-dtype fp8``); None: ``dtype``.
    kv_cache_dtype: torch.dtype | None = None


class AttentionMetadataBuilder:
    """One per model runner: turns each step's common metadata into the backend's. A backend
    whose kernels need scratch memory allocates it here once, so a step allocates nothing and a
    captured graph keeps pointing at the same buffers."""

    def __init__(self, backend: type[AttentionBackend], spec: AttentionSpec) -> None:
        self.backend = backend
        self.spec = spec

    def build(self, common: AttentionMetadata) -> Any:
        return self.backend.build_metadata(common)


class AttentionImpl(ABC):
    """One layer's attention. ``forward`` writes the new keys and values into the paged cache and
    attends each query token over its request's context, causally (and within the sliding window).

    ``k_scale`` and ``v_scale`` are the layer's fp32 scalars (``Attention.k_scale``/``v_scale``,
    on the device): where the cache is FP8 (``kv_cache.dtype``), keys and values are stored
    divided by them and multiplied back when read (kvik.attention.kv_quant). The runner sets them
    on each impl it builds."""

    k_scale: Tensor | None = None
    v_scale: Tensor | None = None

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        k_scale: Tensor | None = None,
        v_scale: Tensor | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.k_scale = k_scale
        self.v_scale = v_scale

    #: Whether ``forward_with_rotary`` rotates while it writes the cache (one launch where the
    #: default makes two): compiled models then hand it the rotation instead of rotating first.
    fuses_rotary: ClassVar[bool] = False
    #: Whether ``forward_with_rotary`` applies per-head RMSNorms (``head_norms``, Qwen3's q/k
    #: norms) in the same pass: models then hand them over instead of normalising first.
    fuses_head_norms: ClassVar[bool] = False

    def quantizes_output(self, metadata: Any) -> bool:
        """Whether this step's ``forward`` can write its output as block-FP8 activations for
        o_proj (kvik.quantization.activation): e4m3 ``output`` and fp32 ``output_scales`` [T,
        H * D / 128], the values and scales quantizing its unquantized output per group of 128
        would give. Only then is ``output_scales`` passed; by default never."""
        return False

    @abstractmethod
    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        metadata: Any,
        output: Tensor,
        output_scales: Tensor | None = None,
    ) -> None:
        """query [T, H*D], key/value [T, Hk*D], kv_cache as ``kv_cache_shape``; fills output [T, H*D]
        (quantized, with ``output_scales``, where ``quantizes_output`` said so)."""

    def forward_with_rotary(
        self,
        positions: Tensor,
        rotary_emb: Any,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        metadata: Any,
        output: Tensor,
        head_norms: Any = None,
        output_scales: Tensor | None = None,
    ) -> None:
        """``forward`` after rotating query and key with ``rotary_emb`` (a
        ``kvik.layers.rotary.RotaryEmbedding`` or ``Rotation``) at ``positions [T]``, each head
        RMS-normalised first where ``head_norms`` (a ``kvik.layers.rotary.HeadNorms``) is given.
        A backend that can rotate while it writes the cache overrides this to save a pass over
        the keys and a launch."""
        if head_norms is not None:
            query, key = head_norms(query, key, self.head_size)
        query, key = rotary_emb(positions, query, key)
        if output_scales is None:
            self.forward(query, key, value, kv_cache, metadata, output)
        else:
            self.forward(query, key, value, kv_cache, metadata, output, output_scales)


class AttentionBackend(ABC):
    """A paged-attention implementation, registered by a platform plugin under ``name``."""

    name: ClassVar[str]
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.float32,
        torch.float16,
        torch.bfloat16,
    )
    #: None means any head size.
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = None
    #: KV cache dtypes beyond the model's own (which every backend stores), e.g. FP8 e4m3.
    supported_kv_cache_dtypes: ClassVar[tuple[torch.dtype, ...]] = ()

    @classmethod
    def unsupported_reason(cls, dtype: torch.dtype, head_size: int, block_size: int) -> str | None:
        if dtype not in cls.supported_dtypes:
            return f"dtype {dtype} not in {cls.supported_dtypes}"
        if cls.supported_head_sizes is not None and head_size not in cls.supported_head_sizes:
            return f"head size {head_size} not in {cls.supported_head_sizes}"
        return None

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def build_metadata(cls, common: AttentionMetadata) -> Any:
        """Turn the common metadata into this backend's (once per step, shared by all layers)."""
        return common

    @classmethod
    def builder_class(cls) -> type[AttentionMetadataBuilder]:
        """The per-runner metadata builder; the default calls ``build_metadata``."""
        return AttentionMetadataBuilder

    @classmethod
    @abstractmethod
    def impl_class(cls) -> type[AttentionImpl]: ...
