"""Every shared Triton kernel compiles ahead of time for each GPU platform's targets (kvik_cuda's
Hopper and Blackwell, kvik_rocm's MI300X) at the configurations that platform picks, within the
target's shared memory, with wgmma on Hopper where a dot can use it. A platform not installed
contributes no targets."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")

from kvik.triton_kernels.activation import (  # noqa: E402
    SILU_BLOCK,
    SILU_WARPS,
    silu_and_mul_kernel,
)
from kvik.triton_kernels.aot import (  # noqa: E402
    compile_as_launched,
    compile_kernel,
    first_global_access,
)
from kvik.triton_kernels.argmax import BLOCK as ARGMAX_BLOCK  # noqa: E402
from kvik.triton_kernels.argmax import CHUNK as ARGMAX_CHUNK  # noqa: E402
from kvik.triton_kernels.argmax import CHUNK_WARPS as ARGMAX_CHUNK_WARPS  # noqa: E402
from kvik.triton_kernels.argmax import MERGE_WARPS as ARGMAX_MERGE_WARPS  # noqa: E402
from kvik.triton_kernels.argmax import (  # noqa: E402
    argmax_chunks_kernel,
    argmax_merge_kernel,
)
from kvik.triton_kernels.attention import accepting_query_dtype  # noqa: E402
from kvik.triton_kernels.eagle3_indices import BLOCK as EAGLE3_INDICES_BLOCK  # noqa: E402
from kvik.triton_kernels.eagle3_indices import WARPS as EAGLE3_INDICES_WARPS  # noqa: E402
from kvik.triton_kernels.eagle3_indices import eagle3_indices_kernel  # noqa: E402
from kvik.triton_kernels.fused_moe import (  # noqa: E402
    ALIGN_BLOCKS_CHUNK,
    ALIGN_WARPS,
    COUNT_CHUNK,
    ROUTE_ALIGN_MAX_TOKENS,
    ROUTE_ALIGN_WARPS,
    ROUTING_ROWS_FEW,
    ROUTING_ROWS_MANY,
    ROUTING_WARPS,
    SCATTER_BLOCK,
    SCATTER_WARPS,
    SUM_BLOCK_N,
    SUM_LAST_MAX_TOKENS,
    SUM_WARPS,
    align_constexprs,
    even_tiles,
    moe_align_kernel,
    moe_count_kernel,
    moe_gemm_kernel,
    moe_route_align_kernel,
    moe_routing_kernel,
    moe_scatter_kernel,
    moe_sum_kernel,
    step_constexprs,
)
from kvik.triton_kernels.fused_moe_tma import (  # noqa: E402
    moe_down_tma_kernel,
    moe_gate_up_tma_kernel,
)
from kvik.triton_kernels.gemv import GemvConfig, gemv_kernel  # noqa: E402
from kvik.triton_kernels.kv_cache import (  # noqa: E402
    reshape_and_cache_config,
    reshape_and_cache_kernel,
)
from kvik.triton_kernels.paged_attention import (  # noqa: E402
    REDUCE_WARPS,
    attention_constexprs,
    paged_attention_kernel,
    reduce_constexprs,
    reduce_splits_kernel,
)
from kvik.triton_kernels.rms_norm import (  # noqa: E402
    embed_rms_norm_cat_kernel,
    rms_norm_config,
    rms_norm_kernel,
)
from kvik.triton_kernels.rotary import (  # noqa: E402
    ROTARY_WARPS,
    rotary_and_cache_kernel,
    rotary_constexprs,
    rotary_kernel,
)


def platform_targets() -> dict[str, tuple[Any, int, Any]]:
    """arch -> (GPUTarget, shared memory limit, the platform's attention_config)."""
    targets = {}
    for package in ("kvik_cuda", "kvik_rocm"):
        try:
            aot = importlib.import_module(f"{package}.aot")
            tuning = importlib.import_module(f"{package}.tuning")
        except ImportError:
            continue
        for arch, target in aot.TARGETS.items():
            chooser = accepting_query_dtype(tuning.attention_config)
            targets[arch] = (target, aot.SHARED_MEMORY_LIMIT[arch], chooser)
    return targets


TARGETS = platform_targets()
ARCHS = list(TARGETS)
TRITON_TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.int64: "i64",
}
#: The KV cache scales (fp32 scalars, read only where the cache is FP8).
KV_SCALES = {"k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}


def types(kernel, dtype: torch.dtype, **overrides: str) -> dict[str, str]:
    """Pointers of ``dtype``, 32-bit integers, except where ``overrides`` says otherwise."""
    ptr = f"*{TRITON_TYPES[dtype]}"
    return {n: overrides.get(n, ptr if n.endswith("_ptr") else "i32") for n in kernel.arg_names}


#: Run-time arguments every launch passes as 1 (the caches' values are contiguous), which
#: Triton's JIT turns into constants: compiled so, a test's variant is the one that runs (left
#: generic, the attention kernel's value loads compile to scalar ones).
RUNTIME_ONES = {paged_attention_kernel: {"v_stride_d": 1}}


def pointers_and_strides(kernel, skip: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The kernel's pointer and stride arguments less ``skip`` and ``RUNTIME_ONES``'s."""
    ones = RUNTIME_ONES.get(kernel, {})
    names = (n for n in kernel.arg_names if n.endswith("_ptr") or "stride" in n)
    return tuple(n for n in names if n not in ones and n not in skip)


#: Run-time arguments that are multiples of 16 at the launches these tests stand for, which
#: Triton's JIT specializes for at a launch (wider loads, folded address arithmetic): pointers to
#: whole tensors; the strides of heads of 64 to 256 over 8 KV heads, of a cache's blocks of 16
#: tokens and of a block table of cdiv(max_model_len, 16) columns; o_proj's scale strides, zeros
#: where attention does not quantize its output (``compile_kernel`` leaves those the kernel keeps
#: generic, such as the request metadata's pointers, generic). Compiled without them, the
#: attention kernel was not the one that runs: sm_90's ptxas kept a 16-bit decode (16 x 64 tiles,
#: 2 warps) at 32 registers and a 3.7 KB stack a thread, where the launched variant takes 226 and
#: no stack.
ALIGNED_AT_LAUNCH = {
    paged_attention_kernel: pointers_and_strides(paged_attention_kernel),
    reduce_splits_kernel: pointers_and_strides(reduce_splits_kernel),
}


def launch_aligned(kernel, **ints: int) -> tuple[str, ...]:
    """The pointers of ``kernel`` and those of ``ints`` (sizes and strides a launch at the
    test's shape passes) that are multiples of 16, as the JIT specializes them."""
    pointers = tuple(n for n in kernel.arg_names if n.endswith("_ptr"))
    return pointers + tuple(name for name, value in ints.items() if value % 16 == 0)


def compiled_ok(kernel, arch: str, aligned: tuple[str, ...] | None = None, **kwargs):
    """``kernel`` compiled for ``arch`` as a launch there builds it (``compile_as_launched``:
    once, with PDL on NVIDIA's targets; ``ALIGNED_AT_LAUNCH``'s arguments unless ``aligned``
    names others), within its shared memory."""
    target, shared_memory_limit, _ = TARGETS[arch]
    kwargs["constexprs"] = {**RUNTIME_ONES.get(kernel, {}), **kwargs["constexprs"]}
    kwargs["aligned"] = ALIGNED_AT_LAUNCH.get(kernel, ()) if aligned is None else aligned
    compiled = compile_as_launched(kernel, target, **kwargs)
    assert compiled.metadata.shared <= shared_memory_limit
    return compiled


def test_first_global_access_reads_instructions_not_substrings() -> None:
    """``check_pdl_variant``'s scan: sm_100's attention reads shared memory (``ld.shared.b32``,
    whose "red." is no reduction) before its wait; a predicated global load is an access."""
    head = "\tmov.u32 %r1, %tid.x;\n\tld.shared.b32 %r2, [global_smem];\n\tgriddepcontrol.wait;\n"
    assert first_global_access(head) == len(head)
    for access in ("\t@%p3 ld.global.b32 %r4, [%rd1];", "\tred.global.add.f32 [%rd2], %f1;"):
        ptx = head.replace("\tgriddepcontrol", access + "\n\tgriddepcontrol")
        assert first_global_access(ptx) < ptx.index("griddepcontrol.wait")


@triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["index_ptr"])
def _gather_kernel(x_ptr, index_ptr, out_ptr, n, BLOCK: triton.language.constexpr):
    offsets = triton.language.program_id(0) * BLOCK + triton.language.arange(0, BLOCK)
    mask = offsets < n
    index = triton.language.load(index_ptr + offsets, mask=mask, other=0)
    triton.language.store(out_ptr + offsets, triton.language.load(x_ptr + index), mask=mask)


@pytest.mark.parametrize("arch", ARCHS)
def test_compile_kernel_keeps_generic_what_a_launch_keeps_generic(arch: str) -> None:
    """``aligned`` specializes the arguments it names, except those the kernel declares
    ``do_not_specialize`` or ``do_not_specialize_on_alignment``: a launch never does."""
    target = TARGETS[arch][0]
    signature = {"x_ptr": "*fp32", "index_ptr": "*i32", "out_ptr": "*fp32", "n": "i32"}

    def compiled_hash(*aligned: str) -> str:
        return compile_kernel(
            _gather_kernel, target, signature, {"BLOCK": 128}, num_warps=4, aligned=aligned
        ).hash

    as_launched = compiled_hash("x_ptr", "out_ptr")
    assert compiled_hash("x_ptr", "out_ptr", "index_ptr", "n") == as_launched
    assert compiled_hash() != as_launched


def rounds_in_software_on(arch: str) -> bool:
    """The ROUND_IN_SOFTWARE a launch on ``arch`` takes (kvik.triton_kernels.fp8_quant's
    rounds_in_software): NVIDIA from sm_89 lets the cast round."""
    return not (arch.startswith("sm") and int(arch[2:]) >= 89)


#: The quantizing variants write e4m3 values and fp32 scales (kvik.quantization.activation).
QUANTIZED_OUT = {"out_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("hidden", [2048, 8192])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("quantize", [False, True], ids=["bf16-out", "fp8-out"])
def test_rms_norm(arch: str, hidden: int, residual: bool, quantize: bool) -> None:
    block, num_warps = rms_norm_config(hidden)
    overrides = QUANTIZED_OUT if quantize else {}
    compiled = compiled_ok(
        rms_norm_kernel,
        arch,
        aligned=launch_aligned(
            rms_norm_kernel, x_stride=hidden, residual_stride=hidden, hidden=hidden
        ),
        types=types(rms_norm_kernel, torch.bfloat16, eps="fp32", **overrides),
        constexprs={
            "HAS_RESIDUAL": residual,
            "QUANTIZE": quantize,
            "BLOCK": block,
            "GROUP": 128,
            "ROUND_IN_SOFTWARE": rounds_in_software_on(arch),
        },  # fmt: skip
        num_warps=num_warps,
    )
    # Quantized: IEEE division for the scales and the values (as per_token_group_quant_kernel).
    if "ptx" in compiled.asm:
        assert ("div.rn.f32" in compiled.asm["ptx"]) == quantize


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("verified", [False, True])
def test_eagle3_indices(arch: str, verified: bool) -> None:
    signature = types(
        eagle3_indices_kernel, torch.int64, block_table_ptr="*i32", draft_seq_lens_ptr="*i32",
        draft_table_ptr="*i32",
    )  # fmt: skip
    compiled_ok(
        eagle3_indices_kernel,
        arch,
        types=signature,
        constexprs={"HAS_VERIFIED": verified, "BLOCK": EAGLE3_INDICES_BLOCK},
        num_warps=EAGLE3_INDICES_WARPS,
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_embed_rms_norm_cat(arch: str) -> None:
    block, num_warps = rms_norm_config(4096)
    compiled_ok(
        embed_rms_norm_cat_kernel,
        arch,
        aligned=launch_aligned(embed_rms_norm_cat_kernel, embedding_stride=4096, hidden=4096),
        types=types(embed_rms_norm_cat_kernel, torch.bfloat16, token_ids_ptr="*i64", eps="fp32"),
        constexprs={"BLOCK": block},
        num_warps=num_warps,
    )


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [128256, 32000])
def test_argmax_rows(arch: str, dtype: torch.dtype, vocab: int) -> None:
    chunks = -(-vocab // ARGMAX_CHUNK)
    compiled_ok(
        argmax_chunks_kernel,
        arch,
        aligned=launch_aligned(argmax_chunks_kernel, vocab=vocab, x_stride=vocab),
        types=types(argmax_chunks_kernel, dtype, part_val_ptr="*fp32", part_idx_ptr="*i32"),
        constexprs={"NUM_CHUNKS": chunks, "CHUNK": ARGMAX_CHUNK, "BLOCK": ARGMAX_BLOCK},
        num_warps=ARGMAX_CHUNK_WARPS,
    )
    for has_map in (False, True):
        compiled_ok(
            argmax_merge_kernel,
            arch,
            types=types(
                argmax_merge_kernel, torch.float32, part_idx_ptr="*i32", index_map_ptr="*i64",
                out_ptr="*i64",
            ),
            constexprs={
                "NUM_CHUNKS": chunks, "CHUNKS_PAD": 1 << (chunks - 1).bit_length(),
                "HAS_MAP": has_map,
            },
            num_warps=ARGMAX_MERGE_WARPS,
        )  # fmt: skip


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("quantize", [False, True], ids=["bf16-out", "fp8-out"])
def test_silu_and_mul(arch: str, quantize: bool) -> None:
    compiled = compiled_ok(
        silu_and_mul_kernel,
        arch,
        types=types(silu_and_mul_kernel, torch.bfloat16, **(QUANTIZED_OUT if quantize else {})),
        constexprs={
            "QUANTIZE": quantize,
            "BLOCK": SILU_BLOCK,
            "GROUP": 128,
            "ROUND_IN_SOFTWARE": rounds_in_software_on(arch),
        },  # fmt: skip
        num_warps=SILU_WARPS,
    )
    if "ptx" in compiled.asm:
        assert ("div.rn.f32" in compiled.asm["ptx"]) == quantize


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("heads", "head_size"), [(8, 128), (3, 64), (1, 256)])
@pytest.mark.parametrize("kv_fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
def test_reshape_and_cache(arch: str, heads: int, head_size: int, kv_fp8: bool) -> None:
    constexprs, num_warps = reshape_and_cache_config(heads, head_size)
    signature = types(
        reshape_and_cache_kernel, torch.bfloat16, slot_ptr="*i64", half_cache="i64", **KV_SCALES,
        cache_ptr="*fp8e4nv" if kv_fp8 else "*bf16",
    )  # fmt: skip
    # k and v cut from the step's q/k/v rows; each 16-bit cache half a whole allocation.
    stride = (heads + 2 * heads) * head_size
    compiled_ok(
        reshape_and_cache_kernel,
        arch,
        aligned=launch_aligned(
            reshape_and_cache_kernel,
            key_stride=stride,
            value_stride=stride,
            head_stride_k=head_size,
            head_stride_v=head_size,
            half_cache=1024 * 16 * heads * head_size,
        ),  # fmt: skip
        types=signature,
        constexprs=constexprs | {"KV_FP8": kv_fp8},
        num_warps=num_warps,
    )


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "config", [GemvConfig(8, 512, 4, 3), GemvConfig(32, 256, 4, 4)], ids=["narrow", "wide"]
)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv(arch: str, config: GemvConfig, bias: bool) -> None:
    compiled_ok(
        gemv_kernel,
        arch,
        aligned=launch_aligned(gemv_kernel, N=4096, x_stride=4096, w_stride=4096, out_stride=4096),
        types=types(gemv_kernel, torch.bfloat16),
        constexprs={
            "K": 4096,
            "HAS_BIAS": bias,
            "M_PAD": 1,
            "BLOCK_N": config.block_n,
            "BLOCK_K": config.block_k,
        },
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary(arch: str, is_neox: bool) -> None:
    # SmolLM2-135M's 9 query and 3 KV heads of 64: neither a power of two.
    signature = types(rotary_kernel, torch.bfloat16, positions_ptr="*i64", cache_ptr="*fp32")
    compiled_ok(
        rotary_kernel,
        arch,
        aligned=launch_aligned(rotary_kernel, q_stride=15 * 64, k_stride=15 * 64, cache_stride=64),
        types=signature,
        constexprs=rotary_constexprs(9, 3, 64, 64) | {"IS_NEOX": is_neox},
        num_warps=ROTARY_WARPS,
    )


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_size", "rot_dim"), [(9, 3, 64, 64), (32, 8, 128, 64)]
)
@pytest.mark.parametrize("kv_fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("head_norm", [False, True], ids=["", "head-norms"])
def test_rotary_and_cache(
    arch: str, heads: int, kv_heads: int, head_size: int, rot_dim: int, kv_fp8: bool,
    head_norm: bool,
) -> None:  # fmt: skip
    signature = types(
        rotary_and_cache_kernel, torch.bfloat16, positions_ptr="*i64", slot_ptr="*i64",
        cos_sin_ptr="*fp32", half_cache="i64", norm_eps="fp32", **KV_SCALES,
        kv_cache_ptr="*fp8e4nv" if kv_fp8 else "*bf16",
    )  # fmt: skip
    constexprs = rotary_constexprs(heads, kv_heads, head_size, rot_dim) | {
        "HEAD_PAD": head_size, "IS_NEOX": True, "KV_FP8": kv_fp8, "HEAD_NORM": head_norm,
    }  # fmt: skip
    stride = (heads + 2 * kv_heads) * head_size  # q, k and v cut from one row
    ints = {"q_stride": stride, "k_stride": stride, "v_stride": stride}
    ints |= {"cos_sin_stride": rot_dim, "half_cache": 1024 * 16 * kv_heads * head_size}
    compiled_ok(
        rotary_and_cache_kernel, arch, aligned=launch_aligned(rotary_and_cache_kernel, **ints),
        types=signature, constexprs=constexprs, num_warps=ROTARY_WARPS,
    )  # fmt: skip


def attention_types(
    kernel, dtype: torch.dtype, cache_dtype: torch.dtype | None = None
) -> dict[str, str]:
    fp32 = {
        n: "*fp32"
        for n in ("part_acc_ptr", "part_max_ptr", "part_sum_ptr", "out_scale_ptr")
        if n in kernel.arg_names
    }
    index = {
        n: "*i32"
        for n in (
            "query_start_loc_ptr",
            "seq_lens_ptr",
            "block_table_ptr",
            "row_request_ptr",
            "counter_ptr",
        )  # fmt: skip
        if n in kernel.arg_names
    }
    cache = {
        n: f"*{TRITON_TYPES[cache_dtype or dtype]}"
        for n in ("k_cache_ptr", "v_cache_ptr")
        if n in kernel.arg_names
    }
    scales = {n: t for n, t in KV_SCALES.items() if n in kernel.arg_names}
    return types(kernel, dtype, scale_log2="fp32", **fp32, **index, **cache, **scales)


# (dtype, head size, group, max query len, splits): prefills (64-row tiles), decodes (16 rows),
# split-KV decodes; every head size, group sizes that are and are not powers of two.
ATTENTION_CASES = [
    (torch.bfloat16, 64, 3, 512, 1),
    (torch.bfloat16, 128, 1, 512, 1),
    (torch.bfloat16, 256, 8, 512, 1),
    (torch.float32, 128, 3, 512, 1),
    (torch.float32, 256, 1, 512, 1),
    (torch.bfloat16, 128, 8, 1, 1),
    (torch.bfloat16, 128, 4, 1, 8),
    (torch.bfloat16, 256, 3, 1, 1),
    (torch.float32, 256, 8, 1, 8),
    (torch.float32, 128, 4, 1, 1),
    (torch.float16, 64, 1, 1, 2),
    (torch.bfloat16, 128, 4, 1, 3),  # a split count the reduction pads to a power of two
]
# The same launches over an FP8 cache (--kv-cache-dtype fp8): prefills, decodes, split-KV decodes.
FP8_ATTENTION_CASES = [
    (torch.bfloat16, 128, 4, 512, 1),
    (torch.bfloat16, 64, 3, 512, 1),
    (torch.bfloat16, 128, 4, 1, 1),
    (torch.bfloat16, 128, 8, 1, 8),
    (torch.bfloat16, 256, 1, 1, 2),
    (torch.float16, 128, 4, 512, 1),
    (torch.float32, 128, 3, 1, 1),
    (torch.float32, 128, 4, 512, 1),
    (torch.float32, 256, 2, 512, 1),
    (torch.float32, 256, 4, 1, 1),
]


def known_register_fallback(
    arch: str, dtype: torch.dtype, head_size: int, max_query_len: int, kv_fp8: bool
) -> bool:
    """The launches that ptxas compiles in its 32-register fallback today (``aot``'s
    ``check_register_allocation`` refuses any other): fp32 heads of 256 in prompt programs, on
    sm_100 over a 32-bit cache and on sm_90 over an e4m3 one (every candidate compiled at groups 1
    to 8 fell into it at group 1 or at every group; not timed on a GPU). The test fails once one
    compiles otherwise, to be struck from here."""
    wide_fp32_prompt = dtype == torch.float32 and head_size == 256 and max_query_len > 1
    return wide_fp32_prompt and arch == ("sm90" if kv_fp8 else "sm100")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    ("dtype", "head_size", "group", "max_query_len", "splits", "kv_fp8"),
    [(*case, False) for case in ATTENTION_CASES] + [(*case, True) for case in FP8_ATTENTION_CASES],
)
def test_paged_attention(
    arch: str,
    dtype: torch.dtype,
    head_size: int,
    group: int,
    max_query_len: int,
    splits: int,
    kv_fp8: bool,
) -> None:
    kv_heads = 8
    attention_config = TARGETS[arch][2]
    cache_dtype = torch.float8_e4m3fn if kv_fp8 else dtype
    config = attention_config(arch, head_size, group, max_query_len, cache_dtype, query_dtype=dtype)
    # NVIDIA targets widen an e4m3 cache's value pairs in PTX, as the launcher does on their GPUs.
    pair_asm = kv_fp8 and arch.startswith("sm")
    constexprs = attention_constexprs(
        kv_heads * group, kv_heads, head_size, 16, config, None, splits, max_query_len == 1,
        kv_fp8, pair_asm=pair_asm,
    )  # fmt: skip
    launch = dict(
        types=attention_types(paged_attention_kernel, dtype, cache_dtype),
        constexprs=constexprs,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if known_register_fallback(arch, dtype, head_size, max_query_len, kv_fp8):
        with pytest.raises(AssertionError, match="32-register fallback"):
            compiled_ok(paged_attention_kernel, arch, **launch)
        return
    compiled = compiled_ok(paged_attention_kernel, arch, **launch)
    ptx = compiled.asm["ptx"] if arch.startswith("sm") else ""
    if arch == "sm90" and config.block_m >= 64 and dtype != torch.float32:
        # 64-row tiles run on Hopper's warpgroup MMA; fp32 in IEEE precision cannot.
        assert "wgmma" in ptx
    if arch.startswith("sm") and constexprs["V_PAIRS"] and dtype != torch.float32:
        # e4m3 values as 16-bit pairs: transposed by ldmatrix, no byte reads of shared memory,
        # their bytes widened by the PTX of _pair_bytes_to_f16.
        assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx
        assert "ld.shared.b8" not in ptx
        assert (", 0, 0x0031;" in ptx) == pair_asm  # the odd bytes' selector
    if splits > 1:
        compiled_ok(
            reduce_splits_kernel,
            arch,
            types=attention_types(reduce_splits_kernel, dtype),
            constexprs=reduce_constexprs(constexprs),
            num_warps=REDUCE_WARPS,
        )
    if splits > 1 and max_query_len == 1:
        # The decode launch whose last segment merges the segments (no reduction launch).
        compiled_ok(
            paged_attention_kernel,
            arch,
            types=attention_types(paged_attention_kernel, dtype, cache_dtype),
            constexprs={**constexprs, "REDUCE_LAST": True},
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )


@pytest.mark.parametrize("arch", [arch for arch in ARCHS if arch.startswith("sm")])
@pytest.mark.parametrize(
    ("head_size", "max_query_len", "splits", "kv_fp8"),
    [(128, 1, 1, False), (128, 1, 16, False), (128, 1, 8, True), (128, 512, 1, False),
     (256, 1, 1, True), (256, 512, 1, False), (64, 1, 4, False), (64, 512, 1, True)],
)  # fmt: skip
def test_paged_attention_writes_o_proj_input(
    arch: str, head_size: int, max_query_len: int, splits: int, kv_fp8: bool
) -> None:
    """The launches that write o_proj's block-FP8 input (QUANTIZE_OUT: e4m3 values and fp32
    scales, rounding as the target's cast allows): decodes, split-KV decodes merged by their last
    segment, prompt chunks, an FP8 cache; heads of 64 two a group."""
    kv_heads, group, dtype = 8, 4, torch.bfloat16
    cache_dtype = torch.float8_e4m3fn if kv_fp8 else dtype
    config = TARGETS[arch][2](arch, head_size, group, max_query_len, cache_dtype)
    constexprs = attention_constexprs(
        kv_heads * group, kv_heads, head_size, 16, config, None, splits, max_query_len == 1,
        kv_fp8, False, False, splits > 1, kv_fp8, True, rounds_in_software_on(arch),
    )  # fmt: skip
    signature = attention_types(paged_attention_kernel, dtype, cache_dtype)
    compiled = compiled_ok(
        paged_attention_kernel,
        arch,
        # The scales' strides are the caller's layout's (tokens-contiguous or not): generic.
        aligned=pointers_and_strides(paged_attention_kernel, skip=("os_stride_t", "os_stride_g")),
        types=signature | {"out_ptr": "*fp8e4nv"},
        constexprs=constexprs,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    # The scales' IEEE division (as per_token_group_quant_kernel's), and e4m3 stores.
    assert "div.rn.f32" in compiled.asm["ptx"]
    assert "e4m3" in compiled.asm["ptx"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("splits", [1, 16])
def test_paged_attention_verification_rows_as_decodes(arch: str, splits: int) -> None:
    """The decode variant with a request per token row (ROW_REQUESTS), split-KV or not."""
    kv_heads, group, head_size, dtype = 8, 4, 128, torch.bfloat16
    config = TARGETS[arch][2](arch, head_size, group, 1, dtype)
    constexprs = attention_constexprs(
        kv_heads * group, kv_heads, head_size, 16, config, None, splits, True, False, True
    )
    compiled_ok(
        paged_attention_kernel,
        arch,
        types=attention_types(paged_attention_kernel, dtype),
        constexprs=constexprs,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def decode_plans() -> list[tuple[Any, int, bool]]:
    """kvik_cuda's measured H200 decode launches (configuration, split count, e4m3 cache), if
    installed."""
    try:
        tuning = importlib.import_module("kvik_cuda.tuning")
    except ImportError:
        return []
    plans = {(*plan, False) for plan in tuning.H200_DECODE_PLANS.values()}
    plans |= {(*plan, True) for plan in tuning.H200_FP8_DECODE_PLANS.values()}
    return sorted(plans, key=str)


@pytest.mark.skipif("sm90" not in TARGETS, reason="kvik_cuda is not installed")
@pytest.mark.parametrize(("config", "splits", "kv_fp8"), decode_plans(), ids=str)
def test_h200_decode_plans(config, splits: int, kv_fp8: bool) -> None:
    """Each planned decode launch (kvik_cuda.tuning.H200_DECODE_PLANS, and H200_FP8_DECODE_PLANS
    over an e4m3 cache) of Llama-8B's heads compiles for Hopper within its shared memory, with its
    reduction when split."""
    kv_heads, group, head_size, dtype = 8, 4, 128, torch.bfloat16
    constexprs = attention_constexprs(
        kv_heads * group, kv_heads, head_size, 16, config, None, splits, True, kv_fp8,
        pair_asm=kv_fp8,
    )  # fmt: skip
    cache_dtype = torch.float8_e4m3fn if kv_fp8 else dtype
    compiled_ok(
        paged_attention_kernel,
        "sm90",
        types=attention_types(paged_attention_kernel, dtype, cache_dtype),
        constexprs=constexprs,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if splits > 1:
        compiled_ok(
            reduce_splits_kernel,
            "sm90",
            types=attention_types(reduce_splits_kernel, dtype),
            constexprs=reduce_constexprs(constexprs),
            num_warps=REDUCE_WARPS,
        )


def moe_chooser(arch: str):
    """The platform's fused MoE configurations for ``arch``, or None where it registers none."""
    package = "kvik_cuda" if arch.startswith("sm") else "kvik_rocm"
    try:
        return importlib.import_module(f"{package}.moe_tuning").fused_moe_config
    except ImportError:
        return None


MOE_ARCHS = [arch for arch in ARCHS if moe_chooser(arch) is not None]
# Qwen3-30B-A3B's experts (128 of 768 over 2048, top-8) at decode and prefill token counts, and
# Mixtral's (8 of 14336 over 4096, top-2), which no table holds (the default rule).
MOE_SHAPES = [(1, 128, 768, 2048, 8), (64, 128, 768, 2048, 8), (4096, 128, 768, 2048, 8),
              (16, 8, 14336, 4096, 2), (4096, 8, 14336, 4096, 2)]  # fmt: skip


@pytest.mark.parametrize("arch", [arch for arch in MOE_ARCHS if arch.startswith("sm")])
@pytest.mark.parametrize("tokens", [4096, 8192])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_fused_moe_down_tma(arch: str, tokens: int, dtype: torch.dtype) -> None:
    """The persistent TMA down GEMM (``moe_down_tma``) at Qwen3-30B-A3B's prefill sizes with the
    table's down tiles, and the gate/up GEMM storing in the aligned order for it (OUT_BY_SLOT):
    both build, the first on TMA's bulk tensor copies and, on Hopper, wgmma."""
    experts, inter, hidden, top_k = 128, 768, 2048, 8
    fp8 = dtype == torch.float8_e4m3fn
    up, down = moe_chooser(arch)(arch, tokens, experts, inter, hidden, top_k, dtype)
    if fp8:
        down = dataclasses.replace(down, block_k=min(down.block_k, 128))
    operand = TRITON_TYPES[dtype]
    signature = types(
        moe_down_tma_kernel, torch.bfloat16, sorted_ptr="*i32", block_expert_ptr="*i32",
        total_ptr="*i32", weights_ptr="*fp32", a_scale_ptr="*fp32", w_scale_ptr="*fp32",
        a_desc=f"tensordesc<{operand}[{down.block_m}, {down.block_k}]>",
        w_desc=f"tensordesc<{operand}[{down.block_n}, {down.block_k}]>",
    )  # fmt: skip
    ints = {"N": hidden, "K": inter, "stride_om": hidden, "stride_asm": 8 if fp8 else 0,
            "stride_wse": 16 * 6 if fp8 else 0, "stride_wsn": 6 if fp8 else 0}  # fmt: skip
    compiled = compiled_ok(
        moe_down_tma_kernel,
        arch,
        aligned=launch_aligned(moe_down_tma_kernel, **ints),
        types=signature,
        constexprs={
            "WEIGHTED": True,
            "FP8_BLOCK": fp8,
            "BLOCK_M": down.block_m,
            "BLOCK_N": down.block_n,
            "BLOCK_K": down.block_k,
            "GROUP_M": down.group_m,
        },  # fmt: skip
        num_warps=down.num_warps,
        num_stages=down.num_stages,
    )
    ptx = compiled.asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx
    if arch == "sm90":
        assert "wgmma.mma_async" in ptx
    gate_up_types = types(moe_gemm_kernel, torch.bfloat16, sorted_ptr="*i32",
                          block_expert_ptr="*i32", total_ptr="*i32", weights_ptr="*fp32",
                          ids_ptr="*i32", counter_ptr="*i32", a_ptr=f"*{operand}",
                          w_ptr=f"*{operand}", a_scale_ptr="*fp32", w_scale_ptr="*fp32")  # fmt: skip
    compiled_ok(
        moe_gemm_kernel,
        arch,
        aligned=launch_aligned(moe_gemm_kernel, N=inter, K=hidden, stride_am=hidden),
        types=gate_up_types,
        constexprs={
            **step_constexprs(False, True, False, False, top_k, experts, True, tokens),
            "A_ROW_DIV": top_k,
            "GATED": True,
            "WEIGHTED": False,
            "FP8_BLOCK": fp8,
            "SWAP_AB": bool(up.swap_ab),
            "PAIRED": bool(up.paired),
            "BLOCK_M": up.block_m,
            "BLOCK_N": up.block_n,
            "BLOCK_K": up.block_k,
            "GROUP_M": up.group_m,
            "HALF_ROWS": bool(up.half_rows),
            **even_tiles(inter, hidden, up),
            "OUT_BY_SLOT": True,
        },  # fmt: skip
        num_warps=up.num_warps,
        num_stages=up.num_stages,
    )


@pytest.mark.parametrize("arch", [arch for arch in MOE_ARCHS if arch.startswith("sm")])
@pytest.mark.parametrize("tokens", [4096, 8192])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("out_by_slot", [False, True], ids=["by-pair", "by-slot"])
def test_fused_moe_gate_up_tma(arch: str, tokens: int, dtype, out_by_slot: bool) -> None:
    """The persistent gate/up GEMM with TMA weight loads (``moe_gate_up_tma``) at Qwen3-30B-A3B's
    prefill sizes with the table's gate/up tiles, storing per pair or in the aligned order (for
    the TMA down GEMM): it builds, within the shared memory, on TMA's bulk tensor copies and, on
    Hopper, wgmma."""
    experts, inter, hidden, top_k = 128, 768, 2048, 8
    fp8 = dtype == torch.float8_e4m3fn
    up, _ = moe_chooser(arch)(arch, tokens, experts, inter, hidden, top_k, dtype)
    operand = TRITON_TYPES[dtype]
    signature = types(
        moe_gate_up_tma_kernel, torch.bfloat16, a_ptr=f"*{operand}", sorted_ptr="*i32",
        block_expert_ptr="*i32", total_ptr="*i32", a_scale_ptr="*fp32", w_scale_ptr="*fp32",
        w_desc=f"tensordesc<{operand}[{up.block_n}, {up.block_k}]>",
    )  # fmt: skip
    ints = {"N": inter, "K": hidden, "stride_am": hidden, "stride_om": inter,
            "stride_asm": 16 if fp8 else 0, "stride_wse": 12 * 16 if fp8 else 0,
            "stride_wsn": 16 if fp8 else 0}  # fmt: skip
    compiled = compiled_ok(
        moe_gate_up_tma_kernel,
        arch,
        aligned=launch_aligned(moe_gate_up_tma_kernel, **ints),
        types=signature,
        constexprs={
            "A_ROW_DIV": top_k,
            "FP8_BLOCK": fp8,
            "OUT_BY_SLOT": out_by_slot,
            "EVEN_K": hidden % up.block_k == 0,
            "BLOCK_M": up.block_m,
            "BLOCK_N": up.block_n,
            "BLOCK_K": up.block_k,
            "GROUP_M": up.group_m,
            "HALF_ROWS": bool(up.half_rows),
        },  # fmt: skip
        num_warps=up.num_warps,
        num_stages=up.num_stages,
    )
    ptx = compiled.asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx
    if arch == "sm90":
        assert "wgmma.mma_async" in ptx


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize(("tokens", "experts", "inter", "hidden", "top_k"), MOE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("paired", [False, True], ids=["as-chosen", "paired"])
def test_fused_moe(arch, tokens, experts, inter, hidden, top_k, dtype, paired) -> None:
    """The grouped GEMMs at the platform's configurations, and with gate and up as one product
    (paired): on Hopper with wgmma from 64 rows, paired of twice the width."""
    up, down = moe_chooser(arch)(arch, tokens, experts, inter, hidden, top_k, dtype)
    if paired:
        up = dataclasses.replace(up, paired=1)
    signature = types(moe_gemm_kernel, dtype, sorted_ptr="*i32", block_expert_ptr="*i32",
                      total_ptr="*i32", weights_ptr="*fp32", ids_ptr="*i32",
                      counter_ptr="*i32")  # fmt: skip
    decode = top_k > 1 and tokens <= SUM_LAST_MAX_TOKENS
    for config, gated in ((up, True), (down, False)):
        # The sizes and strides a launch passes at this shape (gate/up's output SiLU'd, inter
        # wide; no FP8 scales: their strides 0): those that are multiples of 16 specialized so.
        n, k = (inter, hidden) if gated else (hidden, inter)
        ints = {
            "N": n, "K": k, "num_experts": experts, "stride_am": k,
            "stride_we": (2 * inter if gated else hidden) * k, "stride_wn": k, "stride_om": n,
            "stride_asm": 0, "stride_wse": 0, "stride_wsn": 0,
        }  # fmt: skip
        compiled = compiled_ok(
            moe_gemm_kernel,
            arch,
            aligned=launch_aligned(moe_gemm_kernel, **ints),
            types=signature,
            constexprs={
                **step_constexprs(
                    tokens == 1,
                    gated,
                    decode and not gated,
                    decode and gated,
                    top_k,
                    experts,
                    True,
                    tokens,
                ),
                "A_ROW_DIV": top_k if gated else 1,
                "GATED": gated,
                "WEIGHTED": not gated,
                "FP8_BLOCK": False,  # block-FP8 experts: test_fp8_kernels_compile.py
                "SWAP_AB": bool(config.swap_ab),
                "PAIRED": bool(gated and config.paired),
                "BLOCK_M": config.block_m,
                "BLOCK_N": config.block_n,
                "BLOCK_K": config.block_k,
                "GROUP_M": config.group_m,
                "HALF_ROWS": bool(config.half_rows) and tokens > 1,
                **even_tiles(n, k, config),
            },  # fmt: skip
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        if arch == "sm90" and config.block_m >= 64 and dtype != torch.float32:
            assert "wgmma" in compiled.asm["ptx"]
            if config.half_rows and tokens > 1:
                # The half block's copy of the tile runs on wgmma too: a second shape, or the
                # same shape issued twice as often.
                assert compiled.asm["ptx"].count("wgmma.mma_async") > 1
            if gated and config.paired:
                # Warpgroups split the rows in 64s first, then the 2 * block_n columns.
                groups = config.num_warps // 4
                width = 2 * config.block_n // (groups // min(groups, config.block_m // 64))
                if width <= 256:
                    assert f"m64n{width}k16" in compiled.asm["ptx"]


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize(("experts", "top_k", "block_m"), [(128, 8, 16), (8, 2, 64), (60, 4, 32)])
def test_fused_moe_routing_and_alignment(arch: str, experts: int, top_k: int, block_m: int) -> None:
    for rows in (ROUTING_ROWS_FEW, ROUTING_ROWS_MANY):
        compiled_ok(
            moe_routing_kernel,
            arch,
            types=types(
                moe_routing_kernel, torch.bfloat16, weights_ptr="*fp32", ids_ptr="*i32",
                counts_ptr="*i32",
            ),
            constexprs={
                "TOP_K": top_k, "TOP_K_PAD": triton.next_power_of_2(top_k),
                "E_PAD": triton.next_power_of_2(experts), "RENORMALIZE": True, "ROWS": rows,
                "COUNT": True,
            },
            num_warps=ROUTING_WARPS,
        )  # fmt: skip
    compiled_ok(
        moe_count_kernel,
        arch,
        types=types(moe_count_kernel, torch.float32, ids_ptr="*i32", counts_ptr="*i32"),
        constexprs={"E_BINS": triton.next_power_of_2(experts), "CHUNK": COUNT_CHUNK},
        num_warps=ALIGN_WARPS,
    )
    int_types = {n: "*i32" for n in moe_route_align_kernel.arg_names if n.endswith("_ptr")}
    tokens_pad = triton.next_power_of_2(ROUTE_ALIGN_MAX_TOKENS)
    compiled_ok(
        moe_route_align_kernel,
        arch,
        types=types(
            moe_route_align_kernel, torch.bfloat16,
            **int_types | {"logits_ptr": "*bf16", "weights_ptr": "*fp32"},
        ),
        constexprs={
            "TOP_K": top_k, "TOP_K_PAD": triton.next_power_of_2(top_k),
            "E_PAD": triton.next_power_of_2(experts), "RENORMALIZE": True,
            "TOKENS_PAD": tokens_pad, "PAIRS_PAD": triton.next_power_of_2(tokens_pad * top_k),
            "BLOCK_M": block_m, "BLOCKS_CHUNK": ALIGN_BLOCKS_CHUNK,
        },
        num_warps=ROUTE_ALIGN_WARPS,
    )  # fmt: skip
    compiled_ok(
        moe_sum_kernel,
        arch,
        types=types(moe_sum_kernel, torch.bfloat16),
        constexprs={"TOP_K": top_k, "BLOCK_N": SUM_BLOCK_N},
        num_warps=SUM_WARPS,
    )  # fmt: skip
    int_types = {n: "*i32" for n in moe_align_kernel.arg_names if n.endswith("_ptr")}
    compiled_ok(
        moe_align_kernel,
        arch,
        types=types(moe_align_kernel, torch.float32, **int_types),
        constexprs=align_constexprs(experts, block_m),
        num_warps=ALIGN_WARPS,
    )
    int_types = {n: "*i32" for n in moe_scatter_kernel.arg_names if n.endswith("_ptr")}
    compiled_ok(
        moe_scatter_kernel,
        arch,
        types=types(moe_scatter_kernel, torch.float32, **int_types),
        constexprs={"BLOCK": SCATTER_BLOCK},
        num_warps=SCATTER_WARPS,
    )
