"""The Triton attention backend ("TRITON_ATTN"): the paged KV cache write and mixed-batch paged
attention as Triton kernels, over the same cache layout as the CPU backend.

An FP8 KV cache (``--kv-cache-dtype fp8``) goes through the same kernels, each taking the layer's
``k_scale`` and ``v_scale`` as device tensors.

Every GPU platform that runs Triton registers this one class under the same name (kvik_cuda,
kvik_rocm). The launch configuration is the platform's: when selected, it registers a chooser for
the architectures it owns (``register_attention_configs("sm", ...)``), looked up by the device's
architecture name at each launch. Choosers and decode planners see the KV cache's dtype and, where
they take a ``query_dtype`` keyword, the queries' (fp32 queries over an e4m3 cache want other tiles
than 16-bit ones: docs/benchmarks.md, "fp32 attention on Hopper"); those without it are called as
before.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from kvik.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionSpec,
)
from kvik.triton_kernels.kv_cache import reshape_and_cache
from kvik.triton_kernels.paged_attention import (
    MAX_KV_SPLITS,
    AttentionConfig,
    interpreter_config,
    num_kv_splits,
    paged_attention,
    quantizes_output_in_kernel,
)
from kvik.triton_kernels.rotary import rotary_and_cache

#: (arch, head_size, group, max_query_len, KV cache dtype[, query_dtype=...]) -> the launch
#: configuration on ``arch``.
ConfigChooser = Callable[..., AttentionConfig]

#: (arch, head_size, group, KV cache dtype, programs, num_sms[, query_dtype=...]) ->
#: (configuration, split count) for a decode launch of ``programs`` (request, KV head) pairs, or
#: None where the platform has no measured choice (then its chooser's configuration and
#: ``num_kv_splits``).
DecodePlanner = Callable[..., tuple[AttentionConfig, int] | None]


def accepting_query_dtype(chooser: Callable) -> Callable:
    """``chooser`` where it takes a ``query_dtype`` keyword (or any keyword), else ``chooser``
    called without it: a platform's chooser or planner written before the keyword came still
    registers and runs unchanged."""
    try:
        parameters = inspect.signature(chooser).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): call it as it was
        parameters = ()
    if any(p.name == "query_dtype" or p.kind is p.VAR_KEYWORD for p in parameters):
        return chooser

    @functools.wraps(chooser)
    def without_query_dtype(*args, query_dtype: torch.dtype | None = None):
        return chooser(*args)

    return without_query_dtype


#: Architecture-name prefix ("sm", "gfx") -> its platform's chooser; the interpreter's is built in.
_CHOOSERS: dict[str, ConfigChooser] = {"interpreter": accepting_query_dtype(interpreter_config)}
#: Architecture-name prefix -> its platform's decode planner (none built in).
_DECODE_PLANNERS: dict[str, DecodePlanner] = {}


def _registered_for(registry: dict, arch: str):
    """The entry of the longest prefix of ``arch`` in ``registry``, or None."""
    prefixes = sorted((p for p in registry if arch.startswith(p)), key=len, reverse=True)
    return registry[prefixes[0]] if prefixes else None


def register_attention_configs(arch_prefix: str, chooser: ConfigChooser) -> None:
    """Make ``chooser`` pick the launch configuration on every architecture whose name starts with
    ``arch_prefix``; a GPU platform calls this from ``on_selected()`` for the architectures it owns
    (registering again replaces, so a platform's choice is always its latest)."""
    if not arch_prefix:
        raise ValueError("an architecture prefix must be non-empty, e.g. 'sm' or 'gfx'")
    _CHOOSERS[arch_prefix] = accepting_query_dtype(chooser)
    attention_config.cache_clear()
    decode_launch.cache_clear()  # its default takes the chooser's configuration


@functools.cache
def attention_config(
    arch: str,
    head_size: int,
    group: int,
    max_query_len: int,
    dtype: torch.dtype,
    query_dtype: torch.dtype | None = None,
) -> AttentionConfig:
    """The launch configuration on ``arch`` from the chooser registered for it (the longest
    matching prefix) for a ``dtype`` KV cache under ``query_dtype`` queries (None: the cache's
    dtype); cached, since every layer of every step asks."""
    chooser = _registered_for(_CHOOSERS, arch)
    if chooser is None:
        raise RuntimeError(
            f"no Triton attention launch configuration is registered for architecture {arch!r} "
            f"(registered: {', '.join(sorted(_CHOOSERS))}); the platform that owns this GPU "
            "registers one when it is selected: run through the engine, or call its "
            "registration (e.g. kvik_cuda.registration.register_kernels())"
        )
    return chooser(arch, head_size, group, max_query_len, dtype, query_dtype=query_dtype or dtype)


def register_decode_plans(arch_prefix: str, planner: DecodePlanner | None) -> None:
    """Let ``planner`` pick decode launches' configuration and split count together on the
    architectures whose names start with ``arch_prefix`` (None removes it). Where a decode batch
    fills the GPU with a fraction of a wave more, the best tiling and the best split count move
    together (on the H200, 40 requests of Llama-8B's heads: 15% less time split in two with 2-stage
    tiles, slower split with the default's 3 stages; docs/benchmarks.md), so a platform with
    measurements says both."""
    if not arch_prefix:
        raise ValueError("an architecture prefix must be non-empty, e.g. 'sm' or 'gfx'")
    if planner is None:
        _DECODE_PLANNERS.pop(arch_prefix, None)
    else:
        _DECODE_PLANNERS[arch_prefix] = accepting_query_dtype(planner)
    decode_launch.cache_clear()


@functools.cache
def decode_launch(
    arch: str,
    head_size: int,
    group: int,
    dtype: torch.dtype,
    num_reqs: int,
    num_kv_heads: int,
    max_model_len: int,
    num_sms: int,
    query_dtype: torch.dtype | None = None,
) -> tuple[AttentionConfig, int]:
    """(configuration, split count) of a decode launch of ``num_reqs`` requests over a ``dtype``
    cache under ``query_dtype`` queries (None: the cache's dtype): the platform's decode planner's
    where it has one for this shape, else its chooser's decode configuration and
    ``num_kv_splits``. From the (padded) request count and max_model_len only, never the step's
    lengths, so a captured graph's choice holds on replay."""
    query_dtype = query_dtype or dtype
    planner = _registered_for(_DECODE_PLANNERS, arch)
    plan = (
        planner(
            arch,
            head_size,
            group,
            dtype,
            num_reqs * num_kv_heads,
            num_sms,
            query_dtype=query_dtype,
        )
        if planner
        else None
    )
    if plan is not None:
        config, splits = plan
        if not 1 <= splits <= MAX_KV_SPLITS:
            raise ValueError(
                f"a decode plan's split count must be in 1..{MAX_KV_SPLITS}, got {splits}"
            )
        return config, splits
    return (
        attention_config(arch, head_size, group, 1, dtype, query_dtype),
        num_kv_splits(num_reqs, num_kv_heads, max_model_len, num_sms),
    )


@functools.cache
def device_arch(device: torch.device) -> tuple[str, int]:
    """(architecture, multiprocessor count): ("sm90", 132) on an H200, ("gfx942", 304) on an
    MI300X; CPU tensors only reach the kernels under the Triton interpreter."""
    if device.type == "cpu":
        return "interpreter", 1
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip is not None:
        return props.gcnArchName.split(":")[0], props.multi_processor_count
    return f"sm{props.major}{props.minor}", props.multi_processor_count


@dataclass
class TritonMetadata:
    """The common metadata, and the launch choices that depend only on the step's shape."""

    common: AttentionMetadata
    arch: str
    #: Split-KV segments for a decode-only step: from the (padded) request count and
    #: max_model_len, never from this step's sequence lengths, so a replayed graph's choice holds.
    num_splits: int
    #: fp32 scratch views for split-KV partial results, from buffers allocated once (None: 1 split).
    part_acc: Tensor | None
    part_max: Tensor | None
    part_sum: Tensor | None
    #: A verification step whose every request is a decode (``decode_requests``): each token row
    #: runs as a decode of its own (``token_requests``, ``token_seq_lens``), with the split-KV
    #: segments a decode step of as many requests gets, so its rows round as decode rows do and
    #: greedy outputs do not depend on speculation.
    rows_as_decodes: bool = False
    #: A mixed step's leading decodes attended to in a launch of their own (the decode variant:
    #: 16-row programs and split-KV, ``num_splits`` and the scratch are this launch's), the rest
    #: in a second; 0: one launch. In one launch every request's programs take the prompt
    #: chunks' 64 rows, of which a decode fills its group's heads (4 or 8 of 64), and on the H200
    #: a step of 500 decodes and 7 prompts (Qwen3-30B-A3B) ran its attention at ~46% of the
    #: K/V-read floor where decode steps reach 93% (docs/benchmarks.md).
    decodes_apart: int = 0
    #: With ``decodes_apart``: each launch's request metadata (query_start_loc, seq_lens,
    #: block_table), sliced once a step rather than once a layer: a PIECEWISE step runs attention
    #: from Python between its graphs, and every slice is host time there.
    decodes_metadata: tuple[Tensor, Tensor, Tensor] | None = None
    rest_metadata: tuple[Tensor, Tensor, Tensor] | None = None
    #: The decode launch's configuration (``decode_launch``, with ``num_splits``): a decode-only
    #: step's, the rows as decodes', or the decodes' apart; None when the step has no decode
    #: launch (its launch takes the chooser's configuration for its longest query).
    decode_config: AttentionConfig | None = None
    #: With split-KV decodes: the zeroed counters by which each (row, KV head)'s last segment
    #: merges the segments in the attention launch itself (None: a reduction launch follows).
    split_counters: Tensor | None = None


#: ``KVIK_ATTENTION_REDUCE_LAST=0`` merges split-KV segments in a launch of its own, as before the
#: in-kernel merge (read at import).
REDUCE_LAST = os.environ.get("KVIK_ATTENTION_REDUCE_LAST", "1") == "1"


#: The fewest leading decodes a mixed step attends to apart: a few decodes beside a prompt are a
#: small share of its attention, and the second launch has a cost of its own (a guess, not yet
#: timed; packages/platform-cuda/tests/sweep_mixed_attention.py times the 500-decode case).
MIN_DECODES_APART = 16


class TritonMetadataBuilder(AttentionMetadataBuilder):
    """Owns the split-KV scratch, sized for ``max_num_seqs`` decode tokens at the largest split
    count, shared by every layer (they run one after another)."""

    def __init__(self, backend: type[AttentionBackend], spec: AttentionSpec) -> None:
        super().__init__(backend, spec)
        self.arch, self.num_sms = device_arch(spec.device)
        self.cache_dtype = spec.kv_cache_dtype or spec.dtype
        head_pad = 1 << (spec.head_size - 1).bit_length()
        f32 = {"dtype": torch.float32, "device": spec.device}
        rows = spec.max_num_seqs * spec.num_heads * MAX_KV_SPLITS
        self.part_acc = torch.empty(rows * head_pad, **f32)
        self.part_max = torch.empty(rows, **f32)
        self.part_sum = torch.empty(rows, **f32)
        self.head_pad = head_pad
        # One a (row, KV head) of a split launch; zeros, and every launch leaves them so.
        self.split_counters = (
            torch.zeros(
                spec.max_num_seqs * MAX_KV_SPLITS * spec.num_kv_heads,
                dtype=torch.int32,
                device=spec.device,
            )
            if REDUCE_LAST
            else None
        )

    def build(self, common: AttentionMetadata) -> TritonMetadata:
        t, h = common.num_actual_tokens, self.spec.num_heads
        rows_as_decodes = (
            common.max_query_len > 1
            and common.token_requests is not None
            and bool(common.decode_requests[: common.num_reqs].all())
        )
        splits, decode_config = 1, None
        if common.max_query_len == 1 or rows_as_decodes:
            decode_config, splits = self._decode_launch(common.num_reqs)
        if rows_as_decodes and t * splits > self.spec.max_num_seqs * MAX_KV_SPLITS:
            # More rows than the scratch holds: as a chunk.
            rows_as_decodes, splits, decode_config = False, 1, None
        apart = common.num_leading_decodes
        if (
            rows_as_decodes
            or common.max_query_len == 1
            or not (MIN_DECODES_APART <= apart < common.num_reqs)
        ):
            apart = 0
        else:  # the decodes' launch has their rows only, and their split count
            t = apart
            decode_config, splits = self._decode_launch(apart)
        decodes = rest = None
        if apart:
            starts, lens, table = common.query_start_loc, common.seq_lens, common.block_table
            decodes = (starts[: apart + 1], lens[:apart], table[:apart])
            rest = (starts[apart:], lens[apart:], table[apart:])
        if splits == 1:
            return TritonMetadata(
                common, self.arch, 1, None, None, None, rows_as_decodes, apart, decodes, rest,
                decode_config,
            )  # fmt: skip
        n = t * h * splits
        return TritonMetadata(
            common,
            self.arch,
            splits,
            self.part_acc[: n * self.head_pad].view(t, h, splits, self.head_pad),
            self.part_max[:n].view(t, h, splits),
            self.part_sum[:n].view(t, h, splits),
            rows_as_decodes,
            apart,
            decodes,
            rest,
            decode_config,
            self.split_counters,
        )

    def _decode_launch(self, num_reqs: int) -> tuple[AttentionConfig, int]:
        spec = self.spec
        return decode_launch(
            self.arch, spec.head_size, spec.num_heads // spec.num_kv_heads, self.cache_dtype,
            num_reqs, spec.num_kv_heads, spec.max_model_len, self.num_sms, spec.dtype,
        )  # fmt: skip


class TritonAttentionImpl(AttentionImpl):
    fuses_rotary = True
    #: Qwen3's q/k norms inside the rotary launch (two launches fewer a layer; Qwen3-30B-A3B
    #: batch 1 on the H200: 268.4 -> 274.8 tok/s). ``KVIK_FUSED_HEAD_NORMS=0`` turns it off
    #: (read at import).
    fuses_head_norms = os.environ.get("KVIK_FUSED_HEAD_NORMS", "1") == "1"
    #: Whether the attention launch writes o_proj's block-FP8 input itself (one launch fewer a
    #: layer where o_proj is block FP8). Off by default: the launch that quantizes is slower than
    #: the one it saves (Llama-3.1-8B block FP8 at batch 1 on the H100: 269.0 output tok/s without,
    #: 260.0 with; docs/benchmarks.md). ``KVIK_FUSED_ATTENTION_QUANT=1`` turns it on (read at
    #: import).
    quantizes_o_proj_input = os.environ.get("KVIK_FUSED_ATTENTION_QUANT", "0") == "1"

    def quantizes_output(self, metadata: TritonMetadata) -> bool:
        # Every launch of the step writes its rows itself: one segment, or split-KV segments
        # merged by their last one (not a reduction launch), which paged_attention does for
        # launches of one row a request only (a decode step, rows as decodes, decodes apart).
        c = metadata.common
        one_row_each = (
            metadata.rows_as_decodes
            or metadata.decodes_apart > 0
            or c.num_actual_tokens == c.num_reqs
        )
        merged = metadata.num_splits == 1 or (metadata.split_counters is not None and one_row_each)
        group = self.num_heads // self.num_kv_heads
        return self.quantizes_o_proj_input and quantizes_output_in_kernel(
            self.head_size, group, merged
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        metadata: TritonMetadata,
        output: Tensor,
        output_scales: Tensor | None = None,
    ) -> None:
        c = metadata.common
        t, hk, d = c.num_actual_tokens, self.num_kv_heads, self.head_size
        reshape_and_cache(
            key[:t].view(t, hk, d), value[:t].view(t, hk, d), kv_cache, c.slot_mapping,
            self.k_scale, self.v_scale,
        )  # fmt: skip
        self._attend(query, kv_cache, metadata, output, output_scales)

    def forward_with_rotary(
        self,
        positions: Tensor,
        rotary_emb,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        kv_cache: Tensor,
        metadata: TritonMetadata,
        output: Tensor,
        head_norms=None,
        output_scales: Tensor | None = None,
    ) -> None:
        # One launch rotates the queries and writes the rotated keys and the values to the cache
        # (normalising each head first, with head_norms).
        t = metadata.common.num_actual_tokens
        rotated = rotary_and_cache(
            positions[:t], query[:t], key[:t], value[:t], kv_cache,
            metadata.common.slot_mapping, rotary_emb.head_size, rotary_emb.cos_sin_cache,
            rotary_emb.is_neox, self.k_scale, self.v_scale, head_norms,
        )  # fmt: skip
        self._attend(rotated, kv_cache, metadata, output, output_scales)

    def _attend(
        self,
        query: Tensor,
        kv_cache: Tensor,
        metadata: TritonMetadata,
        output: Tensor,
        output_scales: Tensor | None,
    ) -> None:
        c = metadata.common
        t, h, hk, d = c.num_actual_tokens, self.num_heads, self.num_kv_heads, self.head_size
        if metadata.decodes_apart:
            self._attend_decodes_apart(query, kv_cache, metadata, output, output_scales)
            return
        as_decodes = metadata.rows_as_decodes
        paged_attention(
            query[:t].view(t, h, d),
            kv_cache[0],
            kv_cache[1],
            output[:t].view(t, h, d),
            c.query_start_loc,
            c.token_seq_lens if as_decodes else c.seq_lens,
            c.block_table,
            self.scale,
            self.sliding_window,
            metadata.decode_config
            or attention_config(
                metadata.arch, d, h // hk, c.max_query_len, kv_cache.dtype, query.dtype
            ),
            metadata.num_splits,
            metadata.part_acc,
            metadata.part_max,
            metadata.part_sum,
            self.k_scale,
            self.v_scale,
            row_requests=c.token_requests if as_decodes else None,
            split_counters=metadata.split_counters,
            output_scales=None if output_scales is None else output_scales[:t],
        )

    def _attend_decodes_apart(
        self,
        query: Tensor,
        kv_cache: Tensor,
        metadata: TritonMetadata,
        output: Tensor,
        output_scales: Tensor | None,
    ) -> None:
        """The leading decodes' rows in the decode variant, then the other requests over the
        whole step's rows (their tokens start past the decodes')."""
        c, n = metadata.common, metadata.decodes_apart
        t, h, hk, d = c.num_actual_tokens, self.num_heads, self.num_kv_heads, self.head_size
        keys, values = kv_cache[0], kv_cache[1]
        group = h // hk
        paged_attention(
            query[:n].view(n, h, d), keys, values, output[:n].view(n, h, d),
            *metadata.decodes_metadata, self.scale, self.sliding_window,
            metadata.decode_config, metadata.num_splits, metadata.part_acc, metadata.part_max,
            metadata.part_sum, self.k_scale, self.v_scale, split_counters=metadata.split_counters,
            output_scales=None if output_scales is None else output_scales[:n],
        )  # fmt: skip
        paged_attention(
            query[:t].view(t, h, d), keys, values, output[:t].view(t, h, d),
            *metadata.rest_metadata, self.scale, self.sliding_window,
            attention_config(
                metadata.arch, d, group, c.max_query_len, kv_cache.dtype, query.dtype
            ), 1,
            k_scale=self.k_scale, v_scale=self.v_scale,
            output_scales=None if output_scales is None else output_scales[:t],
        )  # fmt: skip


class TritonAttentionBackend(AttentionBackend):
    name = "TRITON_ATTN"
    supported_kv_cache_dtypes = (torch.float8_e4m3fn,)

    @classmethod
    def builder_class(cls) -> type[AttentionMetadataBuilder]:
        return TritonMetadataBuilder

    @classmethod
    def impl_class(cls) -> type[AttentionImpl]:
        return TritonAttentionImpl
