"""Every Triton kernel against its PyTorch reference, on one device chosen by KVIK_KERNEL_DEVICE.

Not collected by itself (no ``test_`` prefix): test_kernels_interpreter.py runs it in a
pytest process of its own with ``TRITON_INTERPRET=1`` on the CPU at small shapes,
kvik_cuda's test_kernels_gpu.py on CUDA at full sizes (with kvik_cuda's launch configurations). The launchers are called directly, since CPU tensors would dispatch
``torch.ops.kvik.*`` to the references. References run on the CPU in float64.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl
from torch import Tensor

from kvik import ops
from kvik.attention.backend import AttentionMetadata, AttentionSpec
from kvik.attention.kv_quant import FP8_E4M3, quantize_kv
from kvik.layers.attention import Attention
from kvik.layers.rotary import RotaryEmbedding
from kvik.quantization.activation import FP8_PER_TOKEN_GROUP, QuantizedActivation
from kvik.triton_kernels.activation import silu_and_mul
from kvik.triton_kernels.argmax import argmax_rows
from kvik.triton_kernels.attention import (
    MIN_DECODES_APART,
    TritonAttentionBackend,
    attention_config,
    device_arch,
    register_decode_plans,
)
from kvik.triton_kernels.eagle3_indices import eagle3_indices
from kvik.triton_kernels.fp8_quant import empty_group_scales, per_token_group_quant_fp8
from kvik.triton_kernels.fused_moe import (
    ROUTE_ALIGN_MAX_TOKENS,
    MoeConfig,
    OneTokenRouting,
    align_to_blocks,
    fused_moe,
    grouped_gemm,
    max_row_blocks,
    route,
    route_and_align,
    route_and_count,
    routing_rows,
)
from kvik.triton_kernels.fused_moe_tma import _tile_coordinates, moe_gate_up_tma
from kvik.triton_kernels.gemv import GemvConfig, OneRowLinear, gemv
from kvik.triton_kernels.kv_cache import reshape_and_cache
from kvik.triton_kernels.paged_attention import num_kv_splits, paged_attention
from kvik.triton_kernels.rms_norm import embed_rms_norm_cat, fused_add_rms_norm, rms_norm
from kvik.triton_kernels.rotary import rotary_and_cache, rotary_embedding
from kvik.worker.forward_context import ForwardContext, forward_context
from kvik_cpu.attention import TorchSdpaBackend

DEVICE = torch.device(os.environ.get("KVIK_KERNEL_DEVICE", "cpu"))
ON_GPU = DEVICE.type == "cuda"
if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "CPU tensors reach the kernels only under TRITON_INTERPRET=1", allow_module_level=True
    )
if ON_GPU:
    # Launch configurations are the platform's choice: take those of the platform owning this GPU.
    importlib.import_module(
        "kvik_rocm.registration" if torch.version.hip else "kvik_cuda.registration"
    ).register_kernels()
else:
    from triton.runtime import interpreter

    _patch_lang_tensor = interpreter._patch_lang_tensor

    def _patch_lang_tensor_index(tensor, scope) -> None:
        # The interpreter's scalars are shape-(1,) arrays, and numpy >= 2.4 refuses int() of them,
        # which loops with run-time bounds (range(lo, hi)) need. Triton 3.6 still calls int().
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = _patch_lang_tensor_index

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
# The interpreter's bf16 tl.dot is wrong (../shared/KERNELS.md): bf16 is checked on the GPU only.
DOT_DTYPES = (
    [torch.float32, torch.float16, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
)
ELEMENTWISE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCK_SIZE = 16


@pytest.fixture(autouse=True)
def fresh_seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(hash(request.node.name) % 2**31)


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape, dtype=torch.float64).to(dtype=dtype, device=DEVICE)


def poison_allocator() -> None:
    """Fill freed device memory with NaN, so launcher-allocated outputs start poisoned."""
    if ON_GPU:
        torch.full((1 << 28,), float("nan"), device=DEVICE)
        torch.cuda.synchronize()


def check(out: Tensor, ref: Tensor, dtype: torch.dtype) -> None:
    out, ref = out.cpu().double(), ref.cpu().double()
    assert out.shape == ref.shape
    assert not out.isnan().any(), "unwritten or NaN outputs"
    err = ((out - ref).norm() / ref.norm()).item()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


def cpu64(x: Tensor) -> Tensor:
    return x.cpu().double()


# --- elementwise kernels ------------------------------------------------------------------------

ROWS = [(300, 4096), (77, 5120)] if ON_GPU else [(5, 96), (3, 64)]


@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
@pytest.mark.parametrize(("tokens", "hidden"), ROWS)
def test_rms_norm(dtype: torch.dtype, tokens: int, hidden: int) -> None:
    x, w = randn(tokens, hidden, dtype=dtype), randn(hidden, dtype=dtype)
    poison_allocator()
    check(rms_norm(x, w, 1e-6), ops.rms_norm(cpu64(x), cpu64(w), 1e-6), dtype)


@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
@pytest.mark.parametrize(("tokens", "hidden"), ROWS)
def test_fused_add_rms_norm(dtype: torch.dtype, tokens: int, hidden: int) -> None:
    x, res, w = (
        randn(tokens, hidden, dtype=dtype),
        randn(tokens, hidden, dtype=dtype),
        randn(hidden),
    )
    w = w.to(dtype)
    poison_allocator()
    out, summed = fused_add_rms_norm(x, res, w, 1e-5)
    ref_out, ref_summed = ops.fused_add_rms_norm(cpu64(x), cpu64(res), cpu64(w), 1e-5)
    check(out, ref_out, dtype)
    check(summed, ref_summed, dtype)


@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
@pytest.mark.parametrize(("tokens", "hidden"), ROWS)
def test_embed_rms_norm_cat(dtype: torch.dtype, tokens: int, hidden: int) -> None:
    vocab = 1000
    embedding, hidden_states = randn(vocab, hidden, dtype=dtype), randn(tokens, hidden, dtype=dtype)
    w_embed, w_hidden = randn(hidden).to(dtype), randn(hidden).to(dtype)
    token_ids = torch.randint(0, vocab, (tokens,), device=DEVICE)
    poison_allocator()
    out = embed_rms_norm_cat(token_ids, embedding, hidden_states, w_embed, w_hidden, 1e-5)
    ref = ops.embed_rms_norm_cat(
        token_ids.cpu(), cpu64(embedding), cpu64(hidden_states), cpu64(w_embed), cpu64(w_hidden),
        1e-5,
    )  # fmt: skip
    check(out, ref, dtype)
    # Each half is rms_norm of its input.
    check(out[:, hidden:], ops.rms_norm(cpu64(hidden_states), cpu64(w_hidden), 1e-5), dtype)


def eagle3_index_case(verified: bool, num_hidden: int, steps: int, columns: int) -> dict:
    """Inputs of an EAGLE-3 proposal's indices over 3 scheduled requests (the first two sample,
    the third is a prompt chunk), and its output buffers filled with sentinels."""
    requests, max_blocks, max_model_len = 3, 8, 100
    long = dict(dtype=torch.int64, device=DEVICE)
    case = {
        "sample_index": torch.tensor([0, 1, -1], **long),
        "base_rows": torch.tensor([0, 5, 9], **long),
        "prompt_next": torch.tensor([0, 0, 77], **long),
        "table_rows": torch.tensor([1, 0, 2, 0][:num_hidden], **long),
        # Request 1 has 8 blocks, 0 has 2 (its later draft slots fall outside them), a padding row 0.
        "num_blocks": torch.tensor([8, 2, 1, 0][:num_hidden], **long),
        "num_accepted": torch.tensor([2, 3], **long) if verified else None,
        "verified_tokens": torch.randint(0, 1000, (2, 4), **long) if verified else None,
        "input_ids": torch.randint(0, 1000, (12,), **long),
        "positions": torch.tensor([30, 31, 32, 33, 50, 51, 52, 53, 60, 98, 61, 62], **long),
        "block_table": torch.randperm(64, device=DEVICE)[: requests * max_blocks]
        .view(requests, max_blocks)
        .to(torch.int32),
    }
    buffers = {
        "last_rows": torch.full((requests,), -7, **long),
        "next_ids": torch.full((requests,), -7, **long),
        "rows": torch.full((num_hidden,), -7, **long),
        "pass_tokens": torch.full((11,), -7, **long),
        "draft_positions": torch.full((3, 4), -7, **long)[:steps, :num_hidden],
        "draft_slots": torch.full((3, 4), -7, **long)[:steps, :num_hidden],
        "draft_seq_lens": torch.full((3, 4), -7, dtype=torch.int32, device=DEVICE)[
            :steps, :num_hidden
        ],
        "draft_block_table": torch.full((4, max_blocks), -7, dtype=torch.int32, device=DEVICE)[
            :num_hidden, :columns
        ],
    }
    return case | buffers | {"block_size": 16, "max_model_len": max_model_len}


@pytest.mark.parametrize("verified", [True, False], ids=["verified", "prompt-only"])
@pytest.mark.parametrize(
    ("num_hidden", "steps", "columns"), [(4, 2, 5), (3, 3, 8), (1, 0, 0), (0, 0, 0)]
)
def test_eagle3_indices(verified: bool, num_hidden: int, steps: int, columns: int) -> None:
    case = eagle3_index_case(verified, num_hidden, steps, columns)
    reference = {
        name: value.cpu().clone() if isinstance(value, Tensor) else value
        for name, value in case.items()
    }
    eagle3_indices(**case)
    ops.eagle3_indices(**reference)
    for name, value in reference.items():
        if isinstance(value, Tensor):
            assert case[name].cpu().tolist() == value.tolist(), name
    if num_hidden and steps:
        # The case reaches slots inside a request's blocks and past them.
        slots = reference["draft_slots"]
        assert (slots == -1).any() and (slots >= 0).any()
        if num_hidden > 2 and steps > 1:  # and a position held at max_model_len - 1
            assert reference["draft_positions"][-1, 2] == reference["max_model_len"] - 1
    # The whole views were written (the sentinels were in every entry), and nothing else.
    assert (reference["pass_tokens"] != -7).all()


# Rows of a sampler's logits (fp32) and of an EAGLE-3 head's (its dtype); lengths around CHUNK.
ARGMAX_SHAPES = [(1, 128256), (7, 32000), (3, 2048)] if ON_GPU else [(1, 5000), (3, 2048), (2, 7)]


@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
@pytest.mark.parametrize(("rows", "vocab"), ARGMAX_SHAPES)
def test_argmax_rows(dtype: torch.dtype, rows: int, vocab: int) -> None:
    # Few distinct values, so that most rows hold their maximum several times, across chunks:
    # the first index must win, as torch's max(dim) gives it.
    logits = torch.randint(0, 50, (rows, vocab)).to(dtype=dtype, device=DEVICE)
    out = torch.full((rows,), -1, dtype=torch.int64, device=DEVICE)
    argmax_rows(logits, None, out)
    assert out.tolist() == logits.cpu().double().max(dim=-1).indices.tolist()
    # Through an id map, into a strided view (an EAGLE-3 head's drafts column of a [k, r] table).
    index_map = torch.randperm(vocab, device=DEVICE) + 7
    table = torch.zeros(rows, 3, dtype=torch.int64, device=DEVICE)
    argmax_rows(logits, index_map, table[:, 1])
    assert table[:, 1].tolist() == index_map.cpu()[out.cpu()].tolist()
    assert not table[:, [0, 2]].any()


def test_argmax_rows_edges() -> None:
    vocab = 5000 if not ON_GPU else 128256
    logits = torch.randn(4, vocab, device=DEVICE)
    logits[0] = float("-inf")  # every entry -inf: the first
    logits[1, vocab - 1] = 1e30  # the last entry, in the last (partial) chunk
    logits[2, 3000] = float("nan")  # NaN ranks highest, as in torch
    logits[3, 2047] = logits[3, 2048] = 1e30  # a tie across a chunk boundary
    out = torch.empty(4, dtype=torch.int64, device=DEVICE)
    argmax_rows(logits, None, out)
    assert out.tolist() == [0, vocab - 1, 3000, 2047]
    assert out.tolist() == logits.cpu().max(dim=-1).indices.tolist()


@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_fraction", [1.0, 0.5])
def test_rotary_embedding(dtype: torch.dtype, is_neox: bool, rot_fraction: float) -> None:
    tokens, heads, kv_heads, head_size = (257, 32, 8, 128) if ON_GPU else (5, 3, 1, 32)
    rot_dim = int(head_size * rot_fraction)
    max_pos = 4096 if ON_GPU else 64
    # A llama3-scaled table is still a plain [max_pos, rot_dim] table: random angles cover it.
    angles = torch.rand(max_pos, rot_dim // 2, dtype=torch.float64) * 100
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1).float().to(DEVICE)
    positions = torch.randint(0, max_pos, (tokens,)).to(DEVICE)
    # Query and key as strided views of one fused QKV output, as the models hand them over.
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_size, dtype=dtype)
    q, k = qkv[:, : heads * head_size], qkv[:, heads * head_size : (heads + kv_heads) * head_size]
    poison_allocator()
    q_out, k_out = rotary_embedding(positions, q, k, head_size, cache, is_neox)
    ref_q, ref_k = ops.rotary_embedding(
        positions.cpu(), cpu64(q), cpu64(k), head_size, cache.cpu().double(), is_neox
    )
    check(q_out, ref_q, dtype)
    check(k_out, ref_k, dtype)


@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    x = randn(*((130, 2 * 11008) if ON_GPU else (4, 2 * 1500)), dtype=dtype)
    poison_allocator()
    check(silu_and_mul(x), ops.silu_and_mul(cpu64(x)), dtype)


# (N, K, config): Llama-3.1-8B's qkv and gate_up with the H200's configurations on the GPU; sizes
# that are no multiple of the blocks everywhere.
GEMV_CASES = (
    [
        (6144, 4096, GemvConfig(8, 512, 4, 3)),
        (28672, 4096, GemvConfig(32, 256, 4, 4)),
        (1000, 1500, GemvConfig(8, 512, 4, 3)),
    ]
    if ON_GPU
    else [(37, 300, GemvConfig(8, 128, 1, 1)), (20, 64, GemvConfig(32, 256, 1, 1))]
)


@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
@pytest.mark.parametrize(("n", "k", "config"), GEMV_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv(dtype: torch.dtype, n: int, k: int, config: GemvConfig, bias: bool) -> None:
    x, weight = randn(1, k, dtype=dtype), randn(n, k, dtype=dtype)
    b = randn(n, dtype=dtype) if bias else None
    poison_allocator()
    out = gemv(x, weight, b, config)
    ref = torch.nn.functional.linear(cpu64(x), cpu64(weight), None if b is None else cpu64(b))
    check(out, ref, dtype)


def test_one_row_linear_takes_the_gemv_for_one_row_only() -> None:
    """One row: the GEMV's result; any other shape: F.linear's, bit for bit."""
    weight, bias = randn(24, 40), randn(24)
    kernel = OneRowLinear(weight, bias, GemvConfig(8, 16, 1, 1))
    one = randn(1, 40)
    check(
        kernel(one),
        torch.nn.functional.linear(cpu64(one), cpu64(weight), cpu64(bias)),
        torch.float32,
    )
    assert torch.equal(kernel(one), gemv(one, weight, bias, kernel.config))
    for rows in (0, 3):
        x = randn(rows, 40)
        assert torch.equal(kernel(x), torch.nn.functional.linear(x, weight, bias))


@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
def test_reshape_and_cache_skips_negative_slots(dtype: torch.dtype) -> None:
    tokens, kv_heads, head_size, num_blocks = (500, 8, 128, 64) if ON_GPU else (9, 3, 64, 4)
    cache = randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_size, dtype=dtype)
    kv = randn(tokens, 2, kv_heads, head_size, dtype=dtype)  # strided key and value views
    slots = torch.randperm(num_blocks * BLOCK_SIZE)[:tokens]
    slots[::4] = -1
    expected = cache.cpu().clone()
    ops.reshape_and_cache(kv[:, 0].cpu(), kv[:, 1].cpu(), expected, slots)
    reshape_and_cache(kv[:, 0], kv[:, 1], cache, slots.to(DEVICE))
    assert torch.equal(cache.cpu(), expected)


def assert_same_fp8(got: Tensor, want: Tensor) -> None:
    """The same e4m3 bits (PyTorch compares no float8 tensors)."""
    got, want = got.cpu().contiguous(), want.cpu().contiguous()
    assert got.dtype == want.dtype == FP8_E4M3
    differ = got.view(torch.uint8) != want.view(torch.uint8)
    assert not differ.any(), (
        f"{int(differ.sum())} of {differ.numel()} e4m3 values differ, e.g. "
        f"{got[differ][:4].float().tolist()} for {want[differ][:4].float().tolist()}"
    )


def assert_fp8_close(got: Tensor, want: Tensor, max_fraction: float) -> None:
    """e4m3 values at most one step apart (neighbouring codes of one sign), and at most
    ``max_fraction`` of them apart at all."""
    got, want = (x.cpu().contiguous().view(torch.uint8).long() for x in (got, want))
    same_sign = (got >> 7) == (want >> 7)
    steps = torch.where(
        same_sign, ((got & 0x7F) - (want & 0x7F)).abs(), (got & 0x7F) + (want & 0x7F)
    )
    assert steps.max() <= 1, f"e4m3 values {int(steps.max())} steps apart"
    assert (steps > 0).float().mean() <= max_fraction, f"{int((steps > 0).sum())} values differ"


def fp8_probe_values(count: int, dtype: torch.dtype) -> Tensor:
    """``count`` values in ``dtype`` for quantizing with a scale of 1: every e4m3 value, the
    midpoints between neighbours (ties, which go to the even one) and their neighbours in
    ``dtype``, values past ±448 (saturating), then random ones of every magnitude."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_E4M3).float()
    grid = codes[codes.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    fine = torch.finfo(dtype).eps
    special = torch.cat(
        (grid, mids, mids * (1 + fine), mids * (1 - fine), torch.tensor([500.0, -1e4]))
    )
    noise = torch.randn(count) * torch.logspace(-4, 3, count)
    return torch.cat((special, noise))[:count].to(dtype)


@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
@pytest.mark.parametrize("kv_scales", [(1.0, 1.0), (0.37, 2.5), (0.004, 1e-3)])
def test_reshape_and_cache_quantizes_into_an_fp8_cache(
    dtype: torch.dtype, kv_scales: tuple[float, float]
) -> None:
    """Into an e4m3 cache: key / k_scale and value / v_scale, clamped and rounded to nearest even,
    the same bits as the reference (torch's own cast), nothing at negative slots."""
    tokens, kv_heads, head_size, num_blocks = (500, 8, 128, 64) if ON_GPU else (12, 3, 64, 4)
    n = tokens * kv_heads * head_size
    keys = fp8_probe_values(n, dtype).view(tokens, kv_heads, head_size)
    values = fp8_probe_values(n, dtype).flip(0).view(tokens, kv_heads, head_size)
    k_scale, v_scale = (torch.tensor(s, dtype=torch.float32) for s in kv_scales)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_size).to(FP8_E4M3)
    slots = torch.randperm(num_blocks * BLOCK_SIZE)[:tokens]
    slots[::5] = -1
    expected = cache.clone()
    ops.reshape_and_cache(keys, values, expected, slots, k_scale, v_scale)
    cache = cache.to(DEVICE)
    reshape_and_cache(
        keys.to(DEVICE), values.to(DEVICE), cache, slots.to(DEVICE), k_scale.to(DEVICE),
        v_scale.to(DEVICE),
    )  # fmt: skip
    assert_same_fp8(cache, expected)


def test_an_fp8_cache_without_scales_is_refused() -> None:
    cache = torch.zeros(2, 1, BLOCK_SIZE, 1, 32).to(FP8_E4M3).to(DEVICE)
    kv = randn(1, 1, 32)
    with pytest.raises(ValueError, match="needs k_scale"):
        reshape_and_cache(kv, kv, cache, torch.zeros(1, dtype=torch.int64, device=DEVICE))


def random_cos_sin(max_pos: int, rot_dim: int) -> Tensor:
    # A llama3-scaled table is still a plain [max_pos, rot_dim] table: random angles cover it.
    angles = torch.rand(max_pos, rot_dim // 2, dtype=torch.float64) * 100
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


def assert_unwritten_slots_kept(cache: Tensor, expected: Tensor, slots: Tensor) -> None:
    """The slots a launch did not write (not in ``slots``, or negative there) hold what they held
    (``expected`` is the reference cache, written only at the slots)."""
    kv_heads, head_size = cache.shape[-2:]
    kept = cache.cpu().view(2, -1, kv_heads, head_size)
    unwritten = torch.ones(kept.shape[1], dtype=torch.bool)
    unwritten[slots[slots >= 0]] = False
    before = expected.view(2, -1, kv_heads, head_size)
    assert torch.equal(kept[:, unwritten].double(), before[:, unwritten])


@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_fraction", [1.0, 0.5])
def test_rotary_and_cache(dtype: torch.dtype, is_neox: bool, rot_fraction: float) -> None:
    """The fused launch equals rotary_embedding, then reshape_and_cache: rotated queries out,
    rotated keys and the values in the cache, nothing written at negative slots."""
    tokens, heads, kv_heads, head_size, num_blocks = (
        (300, 32, 8, 128, 40) if ON_GPU else (7, 3, 1, 32, 2)
    )
    rot_dim = int(head_size * rot_fraction)
    max_pos = 4096 if ON_GPU else 64
    cos_sin = random_cos_sin(max_pos, rot_dim)
    positions = torch.randint(0, max_pos, (tokens,))
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_size, dtype=dtype)
    q, k, v = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=-1)
    cache = randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_size, dtype=dtype)
    slots = torch.randperm(num_blocks * BLOCK_SIZE)[:tokens]
    slots[::3] = -1
    ref_q, ref_k = ops.rotary_embedding(
        positions, cpu64(q), cpu64(k), head_size, cos_sin.double(), is_neox
    )
    expected = cache.cpu().double()
    ops.reshape_and_cache(
        ref_k.view(tokens, kv_heads, head_size), cpu64(v).view(tokens, kv_heads, head_size),
        expected, slots,
    )  # fmt: skip
    poison_allocator()
    q_out = rotary_and_cache(
        positions.to(DEVICE), q, k, v, cache, slots.to(DEVICE), head_size, cos_sin.to(DEVICE),
        is_neox,
    )  # fmt: skip
    check(q_out, ref_q, dtype)
    check(cache, expected, dtype)
    assert_unwritten_slots_kept(cache, expected, slots)


@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_fraction", [1.0, 0.5])
def test_rotary_and_cache_with_head_norms(dtype, is_neox: bool, rot_fraction: float) -> None:
    """With Qwen3's per-head q/k RMSNorms in the launch: what rms_norm over each head, then
    rotary_embedding, then reshape_and_cache give; a head's scale matters (large heads and a
    zero head), and the tail past rot_dim is normalised too."""
    from kvik.layers.rotary import HeadNorms

    tokens, heads, kv_heads, head_size, num_blocks = (
        (300, 32, 8, 128, 40) if ON_GPU else (6, 3, 2, 32, 2)
    )
    rot_dim = int(head_size * rot_fraction)
    cos_sin = random_cos_sin(64, rot_dim)
    positions = torch.randint(0, 64, (tokens,))
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_size, dtype=torch.float32)
    qkv[:, :head_size] *= 40  # one query head far larger than the others
    qkv[1, :head_size] = 0  # and a zero head: eps keeps it finite
    qkv = qkv.to(dtype)
    q, k, v = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=-1)
    q_weight = (torch.rand(head_size) + 0.5).to(dtype)
    k_weight = (torch.rand(head_size) + 0.5).to(dtype)
    eps = 1e-6
    cache = randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_size, dtype=dtype)
    slots = torch.randperm(num_blocks * BLOCK_SIZE)[:tokens]
    slots[::3] = -1

    def normed(x: Tensor, weight: Tensor) -> Tensor:
        heads_view = cpu64(x).view(tokens, -1, head_size)
        return ops.rms_norm(heads_view, cpu64(weight), eps).view(tokens, -1)

    ref_q, ref_k = ops.rotary_embedding(
        positions, normed(q, q_weight), normed(k, k_weight), head_size, cos_sin.double(), is_neox
    )
    expected = cache.cpu().double()
    ops.reshape_and_cache(
        ref_k.view(tokens, kv_heads, head_size), cpu64(v).view(tokens, kv_heads, head_size),
        expected, slots,
    )  # fmt: skip
    poison_allocator()
    norms = HeadNorms(q_weight.to(DEVICE), k_weight.to(DEVICE), eps)
    q_out = rotary_and_cache(
        positions.to(DEVICE), q, k, v, cache, slots.to(DEVICE), head_size, cos_sin.to(DEVICE),
        is_neox, head_norms=norms,
    )  # fmt: skip
    assert not q_out.isnan().any()
    check(q_out, ref_q, dtype)
    check(cache, expected, dtype)
    assert_unwritten_slots_kept(cache, expected, slots)
    with pytest.raises(ValueError, match="head norm weights"):
        rotary_and_cache(
            positions.to(DEVICE), q, k, v, cache, slots.to(DEVICE), head_size,
            cos_sin.to(DEVICE), is_neox, head_norms=HeadNorms(q_weight[:-1], k_weight, eps),
        )  # fmt: skip


@pytest.mark.parametrize("dtype", ELEMENTWISE_DTYPES)
@pytest.mark.parametrize("rot_fraction", [1.0, 0.5])
def test_rotary_and_cache_into_an_fp8_cache(dtype: torch.dtype, rot_fraction: float) -> None:
    """Into an e4m3 cache the fused launch stores what rotary_embedding (keys rounded to their
    dtype) then reshape_and_cache with the scales store: the same bits."""
    tokens, heads, kv_heads, head_size, num_blocks = (
        (300, 32, 8, 128, 40) if ON_GPU else (7, 3, 2, 32, 2)
    )
    rot_dim = int(head_size * rot_fraction)
    cos_sin = random_cos_sin(64, rot_dim)
    positions = torch.randint(0, 64, (tokens,))
    qkv = (randn(tokens, (heads + 2 * kv_heads) * head_size) * 4).to(dtype)
    q, k, v = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=-1)
    k_scale, v_scale = torch.tensor(0.37), torch.tensor(2.5)
    cache = torch.zeros(2, num_blocks, BLOCK_SIZE, kv_heads, head_size).to(FP8_E4M3)
    slots = torch.randperm(num_blocks * BLOCK_SIZE)[:tokens]
    slots[::3] = -1
    ref_q, ref_k = ops.rotary_embedding(positions, q.cpu(), k.cpu(), head_size, cos_sin, True)
    expected = cache.clone()
    shape = (tokens, kv_heads, head_size)
    ops.reshape_and_cache(ref_k.view(shape), v.cpu().view(shape), expected, slots, k_scale, v_scale)
    cache = cache.to(DEVICE)
    q_out = rotary_and_cache(
        positions.to(DEVICE), q, k, v, cache, slots.to(DEVICE), head_size, cos_sin.to(DEVICE),
        True, k_scale.to(DEVICE), v_scale.to(DEVICE),
    )  # fmt: skip
    check(q_out, cpu64(ref_q), dtype)
    # A rotated key may differ from the reference's in its last bit now and then: the GPU may
    # fuse the rotation's multiply and subtract (an fp32 key; on the H200, 1 e4m3 value in 1.3M
    # moved), and a bf16 or fp16 key rounds to its dtype before it is quantized, where the
    # interpreter truncates and torch rounds to nearest. An e4m3 value moves with it by one step
    # at most, rarely. The values are not rotated: the same bits.
    if dtype == torch.float32 and not ON_GPU:
        assert_same_fp8(cache, expected)
    else:
        assert_fp8_close(cache[0], expected[0], max_fraction=0.01)
        assert_same_fp8(cache[1], expected[1])


# --- paged attention ----------------------------------------------------------------------------


def build_batch(
    requests: list[tuple[int, int]],
    kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    kv_scales: tuple[Tensor, Tensor] | None = None,
    block_size: int = BLOCK_SIZE,
) -> tuple[AttentionMetadata, Tensor]:
    """Requests as (cached context, new query tokens), blocks of ``block_size`` slots shuffled
    over a cache whose unused slots hold NaN. Returns CPU metadata and the device cache with the
    cached contexts written (with ``kv_scales``, an FP8 cache holding them quantized)."""
    seq_lens = [c + q for c, q in requests]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    ids = torch.randperm(num_blocks)
    block_table = torch.zeros(len(requests), max(blocks_per_req), dtype=torch.int32)
    slot_mapping, context_slots = [], []
    used = 0
    for r, ((context, query), n) in enumerate(zip(requests, blocks_per_req)):
        block_table[r, :n] = ids[used : used + n]
        used += n
        slots = block_table[r].long()[torch.arange(context + query) // block_size] * block_size
        slots += torch.arange(context + query) % block_size
        context_slots.append(slots[:context])
        slot_mapping.append(slots[context:])
    cache_dtype = dtype if kv_scales is None else FP8_E4M3
    shape = (2, num_blocks, block_size, kv_heads, head_size)
    cache = torch.full(shape, float("nan"), dtype=torch.float32).to(cache_dtype)
    flat = cache.view(2, -1, kv_heads, head_size)
    context_slots = torch.cat(context_slots)
    context = torch.randn(2, len(context_slots), kv_heads, head_size).to(dtype)
    if kv_scales is None:
        flat[:, context_slots] = context
    else:
        flat[0, context_slots] = quantize_kv(context[0], kv_scales[0])
        flat[1, context_slots] = quantize_kv(context[1], kv_scales[1])
    query_lens = torch.tensor([q for _, q in requests], dtype=torch.int32)
    query_start_loc = torch.zeros(len(requests) + 1, dtype=torch.int32)
    torch.cumsum(query_lens, 0, out=query_start_loc[1:])
    metadata = AttentionMetadata(
        num_actual_tokens=int(query_lens.sum()),
        num_reqs=len(requests),
        query_start_loc=query_start_loc,
        query_lens=query_lens,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.cat(slot_mapping),
        max_query_len=int(query_lens.max()),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        num_leading_decodes=next((r for r, (_, q) in enumerate(requests) if q != 1), len(requests)),
    )
    return metadata, cache.to(DEVICE)


def on_device(metadata: AttentionMetadata) -> AttentionMetadata:
    fields = {k: v.to(DEVICE) if isinstance(v, Tensor) else v for k, v in vars(metadata).items()}
    return AttentionMetadata(**fields)


def run_attention(
    requests: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
    splits: int | None = None,
    rotary: bool = False,
    kv_scales: tuple[float, float] | None = None,
    decodes_apart: int = 0,
    merged_in_kernel: bool = False,
    block_size: int = BLOCK_SIZE,
) -> None:
    """Write the new keys and attend, through the backend (splits None; with ``rotary``, its
    fused rotary-and-cache path) or the launchers with ``splits`` segments (``merged_in_kernel``:
    their last segment merges them, through counters it must leave at zero); compare output and
    cache with the CPU SDPA backend in float64 (after the reference rotation). With ``kv_scales``
    (k_scale, v_scale) the cache is FP8: both sides store the same e4m3 bits, and the reference
    attends over them dequantized."""
    fp8 = kv_scales is not None
    scales = tuple(torch.tensor(s, dtype=torch.float32) for s in kv_scales) if fp8 else None
    k_scale, v_scale = scales or (None, None)
    metadata, cache = build_batch(requests, kv_heads, head_size, dtype, scales, block_size)
    t = metadata.num_actual_tokens
    q = randn(t, heads * head_size, dtype=dtype)
    k, v = randn(t, kv_heads * head_size, dtype=dtype), randn(t, kv_heads * head_size, dtype=dtype)
    scale = head_size**-0.5
    if fp8:  # the reference quantizes the new keys itself; unused slots' NaN become zeros
        ref_cache = cache.cpu().clone()
        ref_cache.view(torch.uint8)[ref_cache.float().isnan()] = 0
    else:
        ref_cache = cache.cpu().double().nan_to_num()
    ref_out = torch.empty(t, heads * head_size, dtype=torch.float64)
    ref_q, ref_k = cpu64(q), cpu64(k)
    if rotary:
        cos_sin = random_cos_sin(max(c + n for c, n in requests), head_size)
        positions = torch.cat([torch.arange(c, c + n) for c, n in requests])
        if fp8:  # keys rounded to their dtype before they are quantized, as the kernel does
            ref_q, ref_k = map(cpu64, ops.rotary_embedding(
                positions, q.cpu(), k.cpu(), head_size, cos_sin, True
            ))  # fmt: skip
        else:
            ref_q, ref_k = ops.rotary_embedding(
                positions, ref_q, ref_k, head_size, cos_sin.double(), True
            )
    reference = TorchSdpaBackend.impl_class()(
        heads, head_size, scale, kv_heads, sliding_window, k_scale, v_scale
    )
    reference.forward(
        ref_q, ref_k, cpu64(v), ref_cache, TorchSdpaBackend.build_metadata(metadata), ref_out
    )
    out = torch.full_like(q, float("nan"))
    dev = on_device(metadata)
    if splits is None:
        dev_scales = (
            {} if not fp8 else {"k_scale": k_scale.to(DEVICE), "v_scale": v_scale.to(DEVICE)}
        )
        impl = TritonAttentionBackend.impl_class()(
            heads, head_size, scale, kv_heads, sliding_window, **dev_scales
        )
        spec = AttentionSpec(
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_size=head_size,
            dtype=dtype,
            block_size=block_size,
            max_num_seqs=len(requests),
            max_num_tokens=t,
            max_model_len=max(c + q for c, q in requests),
            device=torch.device(DEVICE),
            kv_cache_dtype=cache.dtype,
        )
        builder = TritonAttentionBackend.builder_class()(TritonAttentionBackend, spec)
        assert builder.build(dev).decodes_apart == decodes_apart
        if rotary:
            rotary_emb = RotaryEmbedding(head_size, cos_sin.to(DEVICE), is_neox=True)
            impl.forward_with_rotary(
                positions.to(DEVICE), rotary_emb, q, k, v, cache, builder.build(dev), out
            )
        else:
            impl.forward(q, k, v, cache, builder.build(dev), out)
    else:
        dev_scales = (
            {} if not fp8 else {"k_scale": k_scale.to(DEVICE), "v_scale": v_scale.to(DEVICE)}
        )
        reshape_and_cache(
            k.view(t, kv_heads, head_size), v.view(t, kv_heads, head_size), cache, dev.slot_mapping,
            **dev_scales,
        )  # fmt: skip
        config = attention_config(
            device_arch(DEVICE)[0], head_size, heads // kv_heads, dev.max_query_len, dtype
        )
        counters = None
        if merged_in_kernel:
            counters = torch.zeros(t * kv_heads, dtype=torch.int32, device=DEVICE)
        paged_attention(
            q.view(t, heads, head_size), cache[0], cache[1], out.view(t, heads, head_size),
            dev.query_start_loc, dev.seq_lens, dev.block_table, scale, sliding_window, config,
            splits, **dev_scales, split_counters=counters,
        )  # fmt: skip
        if counters is not None:
            assert not counters.any(), "the last segments left their counters set"
    check(out, ref_out, dtype)
    written = cache.cpu().view(2, -1, kv_heads * head_size)[:, metadata.slot_mapping]
    if fp8:  # the same e4m3 bits as the reference's quantization (of the rotated keys)
        if rotary and dtype != torch.float32:  # see test_rotary_and_cache_into_an_fp8_cache
            assert_fp8_close(written[0], quantize_kv(ref_k, k_scale), max_fraction=0.01)
        else:
            assert_same_fp8(written[0], quantize_kv(ref_k if rotary else k.cpu(), k_scale))
        assert_same_fp8(written[1], quantize_kv(v.cpu(), v_scale))
    elif rotary:
        check(written[0], ref_k, dtype)
        assert torch.equal(written[1], v.cpu())
    else:
        assert torch.equal(written, torch.stack((k, v)).cpu())


# (cached context, new tokens): a prefill, a prefix-hit chunk, decodes; none a multiple of 16.
MIXED = (
    [(0, 203), (300, 77), (1000, 1), (4100, 1), (17, 130), (45, 1), (2500, 1), (0, 5)]
    if ON_GPU
    else [(0, 13), (20, 7), (37, 1), (5, 1), (0, 1), (3, 9)]
)
KV_HEADS = 2


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_mixed_batch(dtype: torch.dtype, head_size: int, group: int) -> None:
    run_attention(MIXED, KV_HEADS * group, KV_HEADS, head_size, dtype)


# Many decodes ahead of prompt chunks (a prefill-heavy step at high concurrency), and a decode
# among the chunks after them: the backend attends to the leading ones in a launch of their own.
LEADING_DECODES = [(c, 1) for c in ((300, 1000, 4100, 45, 2500, 17, 64, 129) * 4)] + [
    (0, 203), (300, 77), (77, 1), (17, 130)
] if ON_GPU else [(c, 1) for c in (37, 5, 0, 16, 20, 3, 64, 9) * 2] + [(0, 13), (20, 7), (4, 1)]  # fmt: skip


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("window", [None, 12])
def test_mixed_batch_with_leading_decodes(dtype: torch.dtype, group: int, window) -> None:
    apart = next(r for r, (_, q) in enumerate(LEADING_DECODES) if q != 1)
    assert apart >= MIN_DECODES_APART
    run_attention(
        LEADING_DECODES, KV_HEADS * group, KV_HEADS, 128, dtype, window, decodes_apart=apart
    )


def test_mixed_batch_with_leading_decodes_over_an_fp8_cache() -> None:
    apart = next(r for r, (_, q) in enumerate(LEADING_DECODES) if q != 1)
    run_attention(
        LEADING_DECODES, 8, KV_HEADS, 64, torch.float16, kv_scales=(0.5, 2.0), decodes_apart=apart
    )


@pytest.mark.parametrize("dtype", DOT_DTYPES)
def test_mixed_batch_with_fused_rotary(dtype: torch.dtype) -> None:
    run_attention(MIXED, KV_HEADS * 3, KV_HEADS, 64, dtype, rotary=True)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("window", [8, 100])
def test_sliding_window(dtype: torch.dtype, window: int) -> None:
    run_attention(MIXED, KV_HEADS * 3, KV_HEADS, 64, dtype, sliding_window=window)


DECODES = [(4200, 1), (5000, 1), (3001, 1), (37, 1)] if ON_GPU else [(150, 1), (70, 1), (3, 1)]


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("window", [None, 50])
def test_decode_only_batch(dtype: torch.dtype, group: int, window: int | None) -> None:
    """One token per request: the decode variant (a program per request, no search)."""
    run_attention(DECODES, KV_HEADS * group, KV_HEADS, 128, dtype, sliding_window=window)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("splits", [2, 3, 8])
def test_split_kv_decode(dtype: torch.dtype, group: int, splits: int) -> None:
    run_attention(DECODES, KV_HEADS * group, KV_HEADS, 128, dtype, splits=splits)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("splits", [2, 3, 8])
def test_split_kv_decode_merged_by_its_last_segment(
    dtype: torch.dtype, group: int, splits: int
) -> None:
    run_attention(
        DECODES, KV_HEADS * group, KV_HEADS, 128, dtype, splits=splits, merged_in_kernel=True
    )


def test_split_kv_merge_in_kernel_equals_the_reduction_launch() -> None:
    """The same segments merged by the last one and by reduce_splits_kernel: equal to fp32
    rounding (one merges online, the other against the largest maximum), an FP8 cache included."""
    q_heads, group, head_size, splits = KV_HEADS * 4, 4, 128, 4
    for kv_scales in (None, KV_SCALES):
        scales = (
            tuple(torch.tensor(x, dtype=torch.float32) for x in kv_scales) if kv_scales else None
        )
        metadata, cache = build_batch(DECODES, KV_HEADS, head_size, torch.float16, scales)
        dev = on_device(metadata)
        t = metadata.num_actual_tokens
        q = randn(t, q_heads, head_size, dtype=torch.float16)
        k, v = (randn(t, KV_HEADS, head_size, dtype=torch.float16) for _ in range(2))
        dev_scales = (
            {}
            if scales is None
            else {"k_scale": scales[0].to(DEVICE), "v_scale": scales[1].to(DEVICE)}
        )
        reshape_and_cache(k, v, cache, dev.slot_mapping, **dev_scales)
        config = attention_config(device_arch(DEVICE)[0], head_size, group, 1, cache.dtype)
        outs = []
        for counters in (None, torch.zeros(t * KV_HEADS, dtype=torch.int32, device=DEVICE)):
            out = torch.full_like(q, float("nan"))
            paged_attention(
                q, cache[0], cache[1], out, dev.query_start_loc, dev.seq_lens, dev.block_table,
                head_size**-0.5, None, config, splits, **dev_scales, split_counters=counters,
            )  # fmt: skip
            outs.append(out.float())
        torch.testing.assert_close(outs[1], outs[0], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", DOT_DTYPES if ON_GPU else [torch.float32])
@pytest.mark.parametrize("splits", [1, 4])
def test_verification_rows_as_decodes(dtype: torch.dtype, splits: int) -> None:
    """A speculative verification's rows (the newest token and its drafts, per request) through
    the decode variant with a request per row (``row_requests``): each row's output has exactly
    the bits of that row decoded on its own (its request's keys up to its position, the same
    split-KV segments), and all are close to the chunked (prompt-style) computation."""
    kv_heads, group, head_size, block = KV_HEADS, 3, 64, 16
    heads = kv_heads * group
    contexts = [150, 40] if ON_GPU else [37, 20]  # keys already cached, per request
    rows = 4  # 1 + k scored rows a request
    blocks_per_req = -(-(max(contexts) + rows) // block)
    num_blocks = len(contexts) * blocks_per_req + 1
    cache = randn(2, num_blocks, block, kv_heads, head_size, dtype=dtype)
    table = torch.randperm(num_blocks - 1)[: len(contexts) * blocks_per_req] + 1
    table = table.view(len(contexts), blocks_per_req).to(torch.int32).to(DEVICE)
    t = rows * len(contexts)
    q = randn(t, heads, head_size, dtype=dtype)
    row_requests = torch.arange(t, dtype=torch.int32, device=DEVICE) // rows
    positions = torch.tensor([c + i for c in contexts for i in range(rows)], device=DEVICE)
    row_seq_lens = (positions + 1).to(torch.int32)
    scale = head_size**-0.5
    config = attention_config(device_arch(DEVICE)[0], head_size, group, 1, cache.dtype)
    as_decodes = torch.empty_like(q)
    paged_attention(
        q, cache[0], cache[1], as_decodes, torch.arange(t + 1, dtype=torch.int32, device=DEVICE),
        row_seq_lens, table, scale, None, config, splits, row_requests=row_requests,
    )  # fmt: skip
    # Each request's first and last rows (all of them on a GPU; the interpreter is slow).
    for row in range(t) if ON_GPU else sorted({0, rows - 1, rows, t - 1}):
        alone = torch.empty_like(q[row : row + 1])
        paged_attention(
            q[row : row + 1], cache[0], cache[1], alone,
            torch.arange(2, dtype=torch.int32, device=DEVICE), row_seq_lens[row : row + 1],
            table[row // rows : row // rows + 1], scale, None, config, splits,
        )  # fmt: skip
        assert torch.equal(as_decodes[row : row + 1], alone), row
    # The same rows as chunks of their requests (the general variant).
    chunked = torch.empty_like(q)
    starts = torch.arange(0, t + 1, rows, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([c + rows for c in contexts], dtype=torch.int32, device=DEVICE)
    chunk_config = attention_config(device_arch(DEVICE)[0], head_size, group, rows, cache.dtype)
    paged_attention(
        q, cache[0], cache[1], chunked, starts, seq_lens, table, scale, None, chunk_config
    )
    check(as_decodes, cpu64(chunked), dtype)


@pytest.mark.parametrize(
    ("requests", "head_size", "group", "splits", "fp8_cache"),
    [
        (DECODES, 128, 4, 1, False),
        (DECODES, 128, 4, 4, False),  # segments merged by the last one, in the launch
        (DECODES, 256, 3, 2, True),
        (MIXED, 128, 1, 1, False),
        (MIXED, 256, 4, 1, True),
        (DECODES, 64, 2, 1, False),  # heads of 64: two a group
        (DECODES, 64, 4, 4, True),
        (MIXED, 64, 6, 1, False),  # six heads a group, padded to eight rows
    ],
)
def test_output_quantized_for_o_proj(
    requests: list[tuple[int, int]], head_size: int, group: int, splits: int, fp8_cache: bool
) -> None:
    """With ``output_scales`` the launch writes its result as o_proj's block-FP8 input: the very
    e4m3 bytes and scales that quantizing its unquantized output per group of 128 gives
    (kvik.quantization.activation's rule), for one segment, split-KV segments merged in the
    launch, and prompt chunks; heads of 128 and 256, and of 64 two a group."""
    dtype = DOT_DTYPES[-1]
    heads = KV_HEADS * group
    scales = tuple(torch.tensor(x) for x in KV_SCALES) if fp8_cache else None
    metadata, cache = build_batch(requests, KV_HEADS, head_size, dtype, scales)
    dev = on_device(metadata)
    t = metadata.num_actual_tokens
    q = randn(t, heads, head_size, dtype=dtype)
    k, v = (randn(t, KV_HEADS, head_size, dtype=dtype) for _ in range(2))
    dev_scales = {} if scales is None else {"k_scale": scales[0].to(DEVICE), "v_scale": scales[1].to(DEVICE)}  # fmt: skip
    reshape_and_cache(k, v, cache, dev.slot_mapping, **dev_scales)
    config = attention_config(
        device_arch(DEVICE)[0], head_size, group, dev.max_query_len, cache.dtype
    )
    counters = None
    if splits > 1:
        counters = torch.zeros(t * KV_HEADS, dtype=torch.int32, device=DEVICE)
    launch = (
        dev.query_start_loc, dev.seq_lens, dev.block_table, head_size**-0.5, None, config, splits,
    )  # fmt: skip
    plain = torch.full_like(q, float("nan"))
    paged_attention(q, cache[0], cache[1], plain, *launch, **dev_scales, split_counters=counters)
    values = torch.empty(t, heads, head_size, dtype=torch.float8_e4m3fn, device=DEVICE)
    out_scales = empty_group_scales(t, heads * head_size // 128, DEVICE)
    paged_attention(
        q, cache[0], cache[1], values, *launch, **dev_scales, split_counters=counters,
        output_scales=out_scales,
    )  # fmt: skip
    expected_values, expected_scales = per_token_group_quant_fp8(plain.view(t, -1))
    assert torch.equal(
        values.view(t, -1).view(torch.uint8).cpu(), expected_values.view(torch.uint8).cpu()
    )
    assert torch.equal(out_scales.cpu(), expected_scales.cpu())


@pytest.mark.parametrize(
    ("requests", "head_size", "group"),
    [(DECODES, 128, 4), (LEADING_DECODES, 128, 4), (MIXED, 256, 4), (MIXED, 64, 4), (MIXED, 64, 3)],
    ids=["decodes", "decodes-apart", "mixed", "head-64", "head-64-odd-group"],
)
def test_attention_layer_hands_o_proj_its_quantized_input(
    requests: list[tuple[int, int]], head_size: int, group: int
) -> None:
    """The attention layer as a producer (``quantize_output``) through the Triton backend, rotary
    fused: the QuantizedActivation its launches write is the unquantized output quantized per
    token group, bit for bit; with heads of 64 in odd groups (a group of 128 features split
    between programs) it hands o_proj the output as is."""
    dtype, kv_heads = DOT_DTYPES[-1], KV_HEADS
    heads = kv_heads * group
    metadata, cache = build_batch(requests, kv_heads, head_size, dtype)
    dev, t = on_device(metadata), metadata.num_actual_tokens
    spec = AttentionSpec(
        num_heads=heads, num_kv_heads=kv_heads, head_size=head_size, dtype=dtype,
        block_size=BLOCK_SIZE, max_num_seqs=len(requests), max_num_tokens=t,
        max_model_len=max(c + q for c, q in requests), device=torch.device(DEVICE),
    )  # fmt: skip
    layer = Attention(heads, head_size, head_size**-0.5, kv_heads, "layers.0.attn")
    layer.impl = TritonAttentionBackend.impl_class()(heads, head_size, head_size**-0.5, kv_heads)
    layer.impl.quantizes_o_proj_input = True  # off by default (KVIK_FUSED_ATTENTION_QUANT)
    layer.kv_cache = cache
    built = TritonAttentionBackend.builder_class()(TritonAttentionBackend, spec).build(dev)
    cos_sin = random_cos_sin(max(c + n for c, n in requests), head_size)
    rotary_emb = RotaryEmbedding(head_size, cos_sin.to(DEVICE), is_neox=True)
    positions = torch.cat([torch.arange(c, c + n) for c, n in requests]).to(DEVICE)
    q = randn(t, heads * head_size, dtype=dtype)
    k, v = (randn(t, kv_heads * head_size, dtype=dtype) for _ in range(2))
    outs = []
    with forward_context(ForwardContext(built, {layer.layer_name: layer})):
        for kind in (None, FP8_PER_TOKEN_GROUP):
            layer.quantize_output = kind
            outs.append(layer(q, k, v, positions, rotary_emb))
    plain, produced = outs
    if group % 2 and head_size < 128:
        assert isinstance(produced, Tensor) and torch.equal(produced, plain)
        return
    assert isinstance(produced, QuantizedActivation) and produced.dtype == dtype
    values, scales = per_token_group_quant_fp8(plain)
    assert torch.equal(produced.values.view(torch.uint8).cpu(), values.view(torch.uint8).cpu())
    assert torch.equal(produced.scales.cpu(), scales.cpu())
    assert produced.scales.stride(0) == 1  # the producers' layout: tokens contiguous


def test_output_quantization_refuses_what_it_cannot_write() -> None:
    """A head of 64 (half a group) and split-KV segments merged by a reduction launch: refused
    with a message, never a wrong result."""
    metadata, cache = build_batch(DECODES, KV_HEADS, 64, torch.float32)
    dev = on_device(metadata)
    t = metadata.num_actual_tokens
    q = randn(t, KV_HEADS, 64)
    config = attention_config(device_arch(DEVICE)[0], 64, 1, 1, cache.dtype)
    values = torch.empty(t, KV_HEADS, 64, dtype=torch.float8_e4m3fn, device=DEVICE)
    launch = (dev.query_start_loc, dev.seq_lens, dev.block_table, 0.125, None, config)
    with pytest.raises(ValueError, match="head size 64"):
        paged_attention(
            q, cache[0], cache[1], values, *launch, output_scales=empty_group_scales(t, 1, DEVICE)
        )
    q = randn(t, KV_HEADS, 128)
    metadata, cache = build_batch(DECODES, KV_HEADS, 128, torch.float32)
    values = torch.empty(t, KV_HEADS, 128, dtype=torch.float8_e4m3fn, device=DEVICE)
    with pytest.raises(ValueError, match="reduction launch"):
        paged_attention(
            q, cache[0], cache[1], values, *launch[:-1],
            attention_config(device_arch(DEVICE)[0], 128, 1, 1, cache.dtype), 4,
            output_scales=empty_group_scales(t, KV_HEADS, DEVICE),
        )  # fmt: skip


@pytest.mark.parametrize("window", [None, 700])
def test_split_kv_with_window_and_mixed_batch(window: int | None) -> None:
    run_attention(MIXED, KV_HEADS * 4, KV_HEADS, 64, torch.float16, window, splits=4)


KV_SCALES = (0.37, 1.9)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("group", [1, 3])
def test_mixed_batch_over_an_fp8_cache(dtype: torch.dtype, group: int) -> None:
    run_attention(MIXED, KV_HEADS * group, KV_HEADS, 64, dtype, kv_scales=KV_SCALES)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
def test_fused_rotary_over_an_fp8_cache(dtype: torch.dtype) -> None:
    run_attention(MIXED, KV_HEADS * 3, KV_HEADS, 64, dtype, rotary=True, kv_scales=KV_SCALES)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("window", [None, 50])
def test_decode_only_batch_over_an_fp8_cache(dtype: torch.dtype, window: int | None) -> None:
    run_attention(DECODES, KV_HEADS * 4, KV_HEADS, 128, dtype, window, kv_scales=KV_SCALES)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
def test_split_kv_decode_over_an_fp8_cache(dtype: torch.dtype) -> None:
    run_attention(DECODES, KV_HEADS * 3, KV_HEADS, 128, dtype, splits=4, kv_scales=KV_SCALES)


# Cache blocks against key tiles (the interpreter's tiles hold 16 keys, the GPU's 16 to 128):
# blocks of 64 or 128 slots hold whole tiles, each read through one table entry from an offset
# within its block (paged_attention's ONE_BLOCK_A_TILE); blocks of 8 fewer keys than a tile,
# each key looked up. Prompt chunks, prefix hits, decodes, split decodes; bf16 and e4m3 caches.
@pytest.mark.parametrize("block_size", [8, 64, 128])
@pytest.mark.parametrize("fp8", [False, True])
def test_cache_blocks_around_a_key_tile(block_size: int, fp8: bool) -> None:
    scales = KV_SCALES if fp8 else None
    run_attention(MIXED, KV_HEADS * 4, KV_HEADS, 64, torch.float16, kv_scales=scales,
                  block_size=block_size)  # fmt: skip
    run_attention(DECODES, KV_HEADS * 4, KV_HEADS, 128, torch.float16, splits=3,
                  kv_scales=scales, block_size=block_size)  # fmt: skip


@pytest.fixture
def decode_plan_in_three():
    """A decode planner on this device's architecture: three split segments (not a power of two,
    so the reduction pads) with another key tile than the chooser's. Removed afterwards."""
    arch = device_arch(DEVICE)[0]
    planned = []

    def planner(arch_, head_size, group, dtype, programs, num_sms):
        config = attention_config(arch_, head_size, group, 1, dtype)
        plan = (replace(config, tile_n=32 if config.tile_n != 32 else 16), 3)
        planned.append(plan)
        return plan

    register_decode_plans(arch, planner)
    yield planned
    register_decode_plans(arch, None)


@pytest.mark.parametrize("kv_scales", [None, KV_SCALES], ids=["16-bit", "fp8"])
def test_decode_plan_from_the_platform(decode_plan_in_three, kv_scales) -> None:
    """A platform's decode plan (kvik.triton_kernels.attention.register_decode_plans) decides
    the backend's decode launches: its split count and tiles, with the same outputs. Decode steps
    and the leading decodes a mixed step attends to apart both take it."""
    run_attention(DECODES, KV_HEADS * 4, KV_HEADS, 128, torch.float16, kv_scales=kv_scales)
    assert decode_plan_in_three and all(splits == 3 for _, splits in decode_plan_in_three)
    apart = next(r for r, (_, q) in enumerate(LEADING_DECODES) if q != 1)
    run_attention(LEADING_DECODES, KV_HEADS * 4, KV_HEADS, 128, torch.float16, decodes_apart=apart)


@pytest.mark.skipif(not ON_GPU, reason="the heuristic needs the GPU's multiprocessor count")
def test_backend_splits_long_decodes() -> None:
    """The backend's own choice for a small batch of long decodes is a split-KV launch."""
    assert num_kv_splits(len(DECODES), KV_HEADS, 5001, device_arch(DEVICE)[1]) > 1
    run_attention(DECODES, KV_HEADS * 4, KV_HEADS, 128, torch.bfloat16)


# --- fused mixture of experts -------------------------------------------------------------------

# (tokens, experts, hidden, intermediate, top_k, renormalize, experts left without tokens)
CASES = (
    [
        (1, 128, 2048, 768, 8, True, 0),
        (16, 128, 2048, 768, 8, True, 0),
        (64, 128, 2048, 768, 8, True, 64),
        (512, 128, 2048, 768, 8, True, 0),
        (100, 8, 4096, 14336 // 8, 2, True, 0),
        (37, 60, 2048, 1408, 4, False, 10),
    ]
    if ON_GPU
    else [
        (1, 8, 64, 32, 2, True, 0),
        (7, 8, 80, 40, 1, False, 0),
        (2, 8, 64, 32, 3, True, 0),
        (33, 16, 96, 32, 4, True, 6),
        (20, 6, 64, 48, 6, False, 0),
    ]
)


def router_logits(tokens: int, experts: int, unused: int, dtype: torch.dtype) -> Tensor:
    """Random logits; the first ``unused`` experts far below the rest, so they get no token."""
    logits = torch.randn(tokens, experts, dtype=torch.float64)
    logits[:, :unused] -= 1e3
    return logits.to(dtype=dtype, device=DEVICE)


def untied_router_logits(tokens: int, experts: int, unused: int, dtype: torch.dtype) -> Tensor:
    """``router_logits`` distinct within each row in ``dtype`` (each row a random order of a grid
    over [-2, 2), coarser than bf16's steps there): random bf16 logits over 128 experts tie at the
    top-8 boundary in ~6% of rows, where the kernel and ``torch.topk`` may each pick a different
    expert (test_routing allows either), and a whole op's output then differs in that token."""
    if experts > 256:
        raise ValueError("a grid over [-2, 2) distinct in bf16 holds at most 256 experts")
    ranks = torch.stack([torch.randperm(experts) for _ in range(tokens)]).double()
    logits = ranks * (4.0 / experts) - 2.0
    logits[:, :unused] -= 1e3
    return logits.to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 8, 2), (9, 128, 8), (5, 6, 1)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_routing(dtype, tokens: int, experts: int, top_k: int, renormalize: bool) -> None:
    logits = router_logits(tokens, experts, 0, dtype)
    weights, ids = route(logits, top_k, renormalize)
    ref_weights, ref_ids = ops.moe_routing(logits.cpu(), top_k, renormalize)
    ids = ids.cpu().long()
    # The same experts, except where two are equally probable (bf16 logits tie): either may go.
    probs = torch.softmax(logits.cpu().float(), dim=-1)
    assert torch.allclose(probs.gather(1, ids), probs.gather(1, ref_ids), rtol=1e-6, atol=0)
    assert all(len(set(row)) == top_k for row in ids.tolist())
    assert torch.allclose(weights.cpu(), ref_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_keeps_every_id_a_real_expert_on_nan_and_inf_logits(renormalize: bool) -> None:
    """A padded row of a CUDA graph routes whatever its buffer held: NaN and infinite logits give
    ids among the experts, distinct per row, in both routing launches, and the alignment still
    places every pair once (an id past the experts indexed the weights out of bounds)."""
    experts, top_k = 6, 2
    logits = router_logits(5, experts, 0, torch.float32)
    logits[1] = float("nan")
    logits[2, 3] = float("inf")
    logits[3, 0] = float("nan")
    logits[4, :2] = float("-inf")
    weights, ids = route(logits, top_k, renormalize)
    one_launch = route_and_align(logits, top_k, renormalize, experts, 16)
    assert torch.equal(one_launch[1], ids)
    for routed in (ids, one_launch[1]):
        routed = routed.cpu()
        assert ((routed >= 0) & (routed < experts)).all(), routed
        assert all(len(set(row)) == top_k for row in routed.tolist())
    # The finite rows keep their routing; the -inf experts of row 4 are never picked.
    ref_weights, ref_ids = ops.moe_routing(logits[[0, 4]].cpu(), top_k, renormalize)
    assert torch.equal(ids.cpu()[[0, 4]].long(), ref_ids)
    assert torch.allclose(weights.cpu()[[0, 4]], ref_weights, rtol=1e-6, atol=1e-7)
    sorted_pairs = one_launch[2][0].cpu()
    real = sorted_pairs[sorted_pairs < ids.numel()].long()
    assert torch.equal(real.sort().values, torch.arange(ids.numel()))
    # One token (routed inside its gate/up GEMM, by rank): route()'s experts and weights, NaN
    # rows (all-equal probabilities: the lowest ids) included.
    w13 = randn(experts, 64, 32) * 0.2
    for row in range(5):
        one = OneTokenRouting(
            torch.empty(1, top_k, dtype=torch.int32, device=DEVICE),
            torch.empty(1, top_k, dtype=torch.float32, device=DEVICE),
            logits[row : row + 1].contiguous(),
            renormalize,
        )
        act = torch.empty(top_k, 32, device=DEVICE)
        grouped_gemm(
            randn(1, 32), w13, act, None, None, top_k, True, MoeConfig(16, 32, 32, 1, 4, 1),
            top_k=top_k, one_token=one,
        )  # fmt: skip
        assert torch.equal(one.ids, ids[row : row + 1])
        torch.testing.assert_close(
            one.weights, weights[row : row + 1], rtol=1e-6, atol=1e-7, equal_nan=True
        )


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k"),
    [(1, 8, 2), (31, 60, 4), (33, 128, 8), (100, 6, 1), (1100, 16, 2)],  # 8, then 32 a program
)
def test_routing_counts_each_programs_pairs(tokens: int, experts: int, top_k: int) -> None:
    """route_and_count's ids and weights are route()'s, and its partial counts add up, per
    expert, to the pairs routed there (rows past the tokens count nothing)."""
    logits = router_logits(tokens, experts, experts // 4, torch.float32)
    weights, ids, counts = route_and_count(logits, top_k, True)
    ref_weights, ref_ids = route(logits, top_k, True)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)
    rows = routing_rows(tokens)
    assert counts.shape == (-(-tokens // rows), triton.next_power_of_2(experts))
    expected = torch.bincount(ids.cpu().flatten().long(), minlength=counts.shape[1])
    assert torch.equal(counts.cpu().sum(0).long(), expected)
    first = ids[:rows].cpu().flatten().long()  # the first program's own pairs
    assert torch.equal(counts[0].cpu().long(), torch.bincount(first, minlength=counts.shape[1]))


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "block_m"),
    [(1, 8, 2, 16), (50, 16, 4, 16), (300, 128, 8, 64), (300, 60, 4, 16)],
)
@pytest.mark.parametrize("counted", ["by-alignment", "by-routing"])
def test_align_groups_every_pair_once(
    tokens: int, experts: int, top_k: int, block_m: int, counted: str
) -> None:
    # Only the odd experts get pairs: half of them stay empty.
    ids = (torch.randint(0, experts // 2, (tokens, top_k)) * 2 + 1).to(torch.int32).to(DEVICE)
    counts = None
    if counted == "by-routing":  # route_and_count's layout: a row per routing program
        e_bins = triton.next_power_of_2(experts)
        rows = ids.cpu().long().split(routing_rows(tokens))
        counts = torch.stack([torch.bincount(r.flatten(), minlength=e_bins) for r in rows])
        counts = counts.to(torch.int32).to(DEVICE)
    aligned = align_to_blocks(ids, experts, block_m, counts)
    sorted_pairs, block_expert, total = (t.cpu() for t in aligned)
    num_pairs = tokens * top_k
    counts = torch.bincount(ids.cpu().flatten().long(), minlength=experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert int(total) == int(padded.sum())
    assert block_expert.numel() == max_row_blocks(num_pairs, experts, block_m)
    used = int(total) // block_m
    assert (block_expert[used:] == -1).all()
    flat = ids.cpu().flatten()
    for b in range(used):
        rows = sorted_pairs[b * block_m : (b + 1) * block_m]
        real = rows[rows < num_pairs].long()
        assert real.numel() > 0 and (flat[real] == block_expert[b]).all()
    assert (sorted_pairs[int(total) :] == num_pairs).all()
    real = sorted_pairs[sorted_pairs < num_pairs].long()
    assert torch.equal(real.sort().values, torch.arange(num_pairs))


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "block_m", "renormalize"),
    [(2, 8, 2, 16, True), (2, 128, 8, 16, True), (5, 60, 4, 32, False), (16, 128, 8, 16, True),
     (ROUTE_ALIGN_MAX_TOKENS, 6, 1, 64, False)],
)  # fmt: skip
def test_route_and_align_in_one_launch(tokens, experts, top_k, block_m, renormalize) -> None:
    """The decode steps' single launch gives route()'s ids, its weights to fp32's rounding (on
    the H200 a [16, 128] tile's sums may add in another order than route()'s rows, one ulp
    apart), and the alignment align_to_blocks gives: the same runs (the order inside a run is
    free)."""
    logits = router_logits(tokens, experts, experts // 4, torch.float32)
    weights, ids, (sorted_pairs, block_expert, total) = route_and_align(
        logits, top_k, renormalize, experts, block_m
    )
    ref_weights, ref_ids = route(logits, top_k, renormalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-7)
    ref_sorted, ref_block_expert, ref_total = align_to_blocks(ref_ids, experts, block_m)
    assert torch.equal(total, ref_total) and sorted_pairs.shape == ref_sorted.shape
    assert block_expert.shape == ref_block_expert.shape

    def runs(sorted_pairs: Tensor, block_expert: Tensor) -> dict[int, list[int]]:
        """Each expert's rows (sorted; padding included), from the blocks in use."""
        rows: dict[int, list[int]] = {}
        for b in range(int(total) // block_m):
            block = sorted_pairs[b * block_m : (b + 1) * block_m].tolist()
            rows.setdefault(int(block_expert[b]), []).extend(block)
        return {expert: sorted(pairs) for expert, pairs in rows.items()}

    assert runs(sorted_pairs, block_expert) == runs(ref_sorted, ref_block_expert)
    unused = block_expert[int(total) // block_m :]
    assert torch.equal(unused, ref_block_expert[int(total) // block_m :])
    for refused in (1, ROUTE_ALIGN_MAX_TOKENS + 1):
        with pytest.raises(ValueError, match="tokens"):
            route_and_align(router_logits(refused, 8, 0, torch.float32), 2, True, 8, 16)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(
    ("tokens", "experts", "hidden", "inter", "top_k", "renormalize", "unused"), CASES
)
def test_fused_moe(dtype, tokens, experts, hidden, inter, top_k, renormalize, unused) -> None:
    x = randn(tokens, hidden, dtype=dtype)
    logits = untied_router_logits(tokens, experts, unused, dtype)
    w13 = randn(experts, 2 * inter, hidden, dtype=dtype) * hidden**-0.5
    w2 = randn(experts, hidden, inter, dtype=dtype) * inter**-0.5
    poison_allocator()
    out = fused_moe(x, logits, w13, w2, top_k, renormalize)
    ref = ops._fused_moe(cpu64(x), cpu64(logits), cpu64(w13), cpu64(w2), top_k, renormalize)
    check(out, ref, dtype)


def routing_that_ends_runs_both_ways(
    tokens: int, experts: int, top_k: int, block_heights: set[int]
) -> Tensor:
    """Router logits for the half_rows tiles: two experts take nearly every token, so their runs
    hold full row blocks, a third takes the first 60% of the tokens, so some run ends in a block
    padded in its second half only (which the full tile must take), and the others' runs end in
    half-padded blocks: both copies of the tile run, for every block height given. The routing
    is random, so a draw that misses one of those cases (the third expert also picked by enough
    of the other tokens to fill its block past half: CI saw it once) is drawn again."""

    def ends_runs_both_ways(counts: Tensor, block_m: int) -> bool:
        tail = counts % block_m
        return bool(
            ((tail > 0) & (tail <= block_m // 2)).any()
            and (tail > block_m // 2).any()
            and (counts > block_m // 2).any()
        )

    for _ in range(100):
        logits = router_logits(tokens, experts, 3, torch.float32)
        logits[:, 3:5] += 4.0
        logits[: tokens * 3 // 5, 5] += 4.0
        counts = torch.bincount(logits.topk(top_k).indices.flatten().cpu(), minlength=experts)
        if all(ends_runs_both_ways(counts, block_m) for block_m in block_heights):
            return logits
    raise AssertionError("no routing in 100 draws ends the runs both ways")


@pytest.mark.parametrize(
    "configs",
    [
        (MoeConfig(16, 32, 32, 4, 4, 2), MoeConfig(32, 16, 64, 2, 4, 2)),
        (MoeConfig(64, 64, 64, 8, 4, 3), MoeConfig(16, 64, 32, 3, 4, 3)),
        (MoeConfig(16, 64, 32, 2, 4, 2, 1), MoeConfig(32, 64, 64, 1, 4, 2, 1)),
        (MoeConfig(16, 32, 32, 2, 4, 2, 0, 1), MoeConfig(32, 16, 64, 2, 4, 2)),
        (MoeConfig(16, 64, 32, 2, 4, 2, 1, 1), MoeConfig(16, 64, 32, 2, 4, 2, 1, 1)),
        (MoeConfig(32, 32, 32, 2, 4, 2, 0, 0, 1), MoeConfig(32, 16, 64, 2, 4, 2, 0, 0, 1)),
        (MoeConfig(32, 32, 32, 2, 4, 2, 0, 1, 1), MoeConfig(64, 32, 32, 1, 4, 2, 1, 0, 1)),
        (MoeConfig(16, 32, 32, 2, 4, 2), MoeConfig(16, 32, 32, 2, 4, 2, 0, 0, 0, 1)),
        (MoeConfig(32, 32, 32, 4, 4, 2, 0, 1, 1), MoeConfig(32, 32, 64, 1, 4, 2, 0, 0, 0, 1)),
        (MoeConfig(32, 16, 32, 2, 4, 2, 0, 1, 1, 1), MoeConfig(16, 16, 64, 2, 4, 2)),
        (MoeConfig(32, 16, 64, 4, 4, 2, 0, 0, 0, 1), MoeConfig(32, 32, 32, 1, 4, 2, 0, 0, 0, 1)),
    ],
    ids=["grouped", "tall", "swapped", "paired", "swapped-paired", "half-rows",
         "half-rows-paired-swapped", "tma", "tma-half-rows-paired", "tma-gate-up",
         "tma-both"],
)  # fmt: skip
def test_fused_moe_with_other_tiles(configs) -> None:
    """Row blocks swept in groups, the down GEMM on row blocks of another height (the pairs
    aligned twice), tiles computed transposed (swap_ab), gate and up as one product (paired),
    an expert's last row block multiplied as half a block where its second half is padding
    (half_rows), the down GEMM persistent with TMA loads of the gate/up output stored in the
    aligned order (tma; its padding rows poisoned on the GPU), and the gate/up GEMM persistent
    with its weights by TMA (tma in the gate/up row, which passes over its paired and half_rows;
    alone, and storing in the aligned order for the TMA down GEMM), as the platforms'
    configurations do."""
    tokens, experts, hidden, inter, top_k = (
        (40, 16, 96, 48, 4) if not ON_GPU else (300, 64, 1024, 512, 6)
    )
    x = randn(tokens, hidden)
    logits = router_logits(tokens, experts, 3, torch.float32)
    half_rows_blocks = {config.block_m for config in configs if config.half_rows}
    if half_rows_blocks:
        logits = routing_that_ends_runs_both_ways(tokens, experts, top_k, half_rows_blocks)
    w13 = randn(experts, 2 * inter, hidden) * hidden**-0.5
    w2 = randn(experts, hidden, inter) * inter**-0.5
    poison_allocator()
    out = fused_moe(x, logits, w13, w2, top_k, True, configs)
    ref = ops._fused_moe(cpu64(x), cpu64(logits), cpu64(w13), cpu64(w2), top_k, True)
    check(out, ref, torch.float32)


@pytest.mark.parametrize("paired,tma", [(0, 0), (1, 0), (0, 1)])
def test_gate_up_by_slot_reads_only_the_tokens_and_leaves_the_padding(paired, tma) -> None:
    """The gate/up GEMM storing at aligned slots (``out_by_slot``, for ``moe_down_tma``): each
    pair's SiLU-and-mul row lands at its slot, the padding slots stay unwritten, and no row of A
    past the tokens is read. A padding slot holds the pair count, the index of a pair one token
    past A's end; counted against out's rows (one a slot), it passed for a pair, and on an H100
    that read past A faulted (docs/benchmarks.md, the forty-ninth session). Here A is a view
    whose next row is NaN, which would reach the padding slots."""
    tokens, experts, hidden, inter, top_k = 21, 6, 64, 32, 3
    config = MoeConfig(16, 32, 32, 1, 4, 2, 0, paired)
    if tma:  # moe_gate_up_tma: weight tiles by TMA, a tile's N within one expert's gate rows
        config = MoeConfig(16, 16, 32, 1, 4, 2, 0, 0, 0, 1)
    storage = randn(tokens + 1, hidden)
    storage[tokens] = float("nan")
    x = storage[:tokens]
    w13 = randn(experts, 2 * inter, hidden) * hidden**-0.5
    _, ids = route(router_logits(tokens, experts, 0, torch.float32), top_k, True)
    aligned = align_to_blocks(ids, experts, config.block_m)
    slots = aligned[1].shape[0] * config.block_m
    out = torch.full((slots, inter), 7.0, device=DEVICE)
    if tma:
        moe_gate_up_tma(x, w13, out, aligned, top_k, config, out_by_slot=True)
    else:
        grouped_gemm(x, w13, out, aligned, None, top_k, True, config, top_k=top_k, out_by_slot=True)
    out, sorted_pairs = out.cpu().double(), aligned[0].cpu().long()
    total = int(aligned[2].item())
    pairs = sorted_pairs[:total]
    is_pair = pairs < tokens * top_k
    assert (out[:total][~is_pair] == 7.0).all() and (out[total:] == 7.0).all()
    token, expert = pairs[is_pair] // top_k, ids.cpu().flatten().long()[pairs[is_pair]]
    gate_up = torch.einsum("ph,pnh->pn", cpu64(x)[token], cpu64(w13)[expert])
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    check(out[:total][is_pair], gate * torch.sigmoid(gate) * up, torch.float32)


@triton.jit
def _tile_coordinates_probe(out_ptr, first, blocks_m, blocks_n, GROUP_M: tl.constexpr):
    # Elementwise over 256 tile indices from ``first``: the helper's scalar arithmetic, vectorised.
    tile = first + tl.arange(0, 256)
    pid_m, pid_n = _tile_coordinates(tile, blocks_m, blocks_n, GROUP_M)
    tl.store(out_ptr + tl.arange(0, 256) * 2, pid_m)
    tl.store(out_ptr + tl.arange(0, 256) * 2 + 1, pid_n)


@pytest.mark.parametrize("group_m", [1, 4, 8])
@pytest.mark.parametrize("blocks_m,blocks_n", [(8, 3), (7, 4), (1, 1), (12, 16), (0, 2)])
def test_tma_down_tiles_past_the_last_stay_in_the_grid(blocks_m, blocks_n, group_m) -> None:
    """``moe_down_tma_kernel``'s tile index -> (row block, column block): the tiles the loop runs
    cover the grid once each, in GROUP_M-row sweeps, and the indices past the last one (which
    the flattened loop computes ahead of time, triton-lang/triton#11601) stay inside it, even
    where the last group is empty (blocks_m a multiple of GROUP_M: a division by zero)."""
    out = torch.empty(256, 2, dtype=torch.int32, device=DEVICE)
    _tile_coordinates_probe[(1,)](out, 0, blocks_m, blocks_n, GROUP_M=group_m)
    got = [tuple(pair) for pair in out.cpu().tolist()]
    tiles = blocks_m * blocks_n
    want = []
    for first_m in range(0, blocks_m, group_m):
        size = min(group_m, blocks_m - first_m)
        want += [(first_m + i % size, i // size) for i in range(size * blocks_n)]
    assert got[:tiles] == want and sorted(want) == sorted(
        (m, n) for m in range(blocks_m) for n in range(blocks_n)
    )
    assert all(0 <= m < max(blocks_m, 1) and 0 <= n < blocks_n for m, n in got)


def test_tma_down_comes_from_the_row_or_is_forced(monkeypatch) -> None:
    """``use_tma_down``: a down row's ``tma`` asks for the TMA form, ``KVIK_MOE_TMA=1`` forces it
    and ``0`` never runs it; a one-token step, or gate/up rows of another block_m, never do."""
    from kvik.triton_kernels import fused_moe as fused_moe_module

    up, wider_up = MoeConfig(32, 64, 64, 1, 4, 2), MoeConfig(64, 64, 64, 1, 4, 2)
    plain, asks = MoeConfig(32, 64, 64, 1, 4, 2), MoeConfig(32, 64, 64, 1, 4, 2, 0, 0, 0, 1)
    hidden = torch.empty(20, 256, dtype=torch.bfloat16, device=DEVICE)
    w2 = torch.empty(8, 256, 128, dtype=torch.bfloat16, device=DEVICE)
    monkeypatch.setattr("kvik.triton_kernels.fused_moe_tma.tma_supported", lambda device: True)

    def chosen(setting: str, down: MoeConfig, tokens: int = 20, up: MoeConfig = up) -> bool:
        monkeypatch.setattr(fused_moe_module, "TMA_DOWN", setting)
        return fused_moe_module.use_tma_down(up, down, hidden, w2, tokens)

    assert chosen("table", asks) and not chosen("table", plain)
    assert chosen("1", plain) and chosen("1", asks)
    assert not chosen("0", asks) and not chosen("0", plain)
    assert not chosen("table", asks, tokens=1) and not chosen("1", plain, up=wider_up)


def test_tma_gate_up_comes_from_the_row_or_is_forced(monkeypatch) -> None:
    """``use_tma_gate_up``: a gate/up row's ``tma`` asks for ``moe_gate_up_tma``,
    ``KVIK_MOE_TMA_UP=1`` forces it and ``0`` never runs it; a one-token step never does (it
    routes inside the pointer form), nor tiles whose block_n does not divide the experts' N."""
    from kvik.triton_kernels import fused_moe as fused_moe_module

    plain, asks = MoeConfig(32, 64, 64, 1, 4, 2), MoeConfig(32, 64, 64, 1, 4, 2, 0, 0, 0, 1)
    too_wide = MoeConfig(32, 256, 64, 1, 4, 2, 0, 0, 0, 1)
    hidden = torch.empty(20, 256, dtype=torch.bfloat16, device=DEVICE)
    w13 = torch.empty(8, 2 * 192, 256, dtype=torch.bfloat16, device=DEVICE)
    monkeypatch.setattr("kvik.triton_kernels.fused_moe_tma.tma_supported", lambda device: True)

    def chosen(setting: str, up: MoeConfig, tokens: int = 20) -> bool:
        monkeypatch.setattr(fused_moe_module, "TMA_UP", setting)
        return fused_moe_module.use_tma_gate_up(up, hidden, w13, tokens)

    assert chosen("table", asks) and not chosen("table", plain)
    assert chosen("1", plain) and chosen("1", asks)
    assert not chosen("0", asks) and not chosen("0", plain)
    assert not chosen("table", asks, tokens=1) and not chosen("1", too_wide)


def test_fused_moe_with_tma_gate_up_at_two_tokens(monkeypatch) -> None:
    """Two tokens, the gate/up GEMM's TMA form forced: a step that would add its top-k rows in
    the down GEMM's last programs (SUM_LAST, whose counters the pointer form of the gate/up GEMM
    zeroes) sums in its own launch instead, and matches the reference."""
    from kvik.triton_kernels import fused_moe as fused_moe_module

    monkeypatch.setattr(fused_moe_module, "TMA_UP", "1")
    tokens, experts, hidden, inter, top_k = 2, 8, 64, 32, 3
    x = randn(tokens, hidden)
    logits = router_logits(tokens, experts, 0, torch.float32)
    w13 = randn(experts, 2 * inter, hidden) * hidden**-0.5
    w2 = randn(experts, hidden, inter) * inter**-0.5
    config = MoeConfig(16, 16, 32, 1, 4, 2)
    out = fused_moe(x, logits, w13, w2, top_k, True, (config, config))
    ref = ops._fused_moe(cpu64(x), cpu64(logits), cpu64(w13), cpu64(w2), top_k, True)
    check(out, ref, torch.float32)


def test_fused_moe_without_tokens() -> None:
    x, logits = randn(0, 64), randn(0, 8)
    out = fused_moe(x, logits, randn(8, 64, 64), randn(8, 64, 32), 2, True)
    assert out.shape == (0, 64)


def test_fused_moe_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="w2"):
        fused_moe(randn(3, 64), randn(3, 8), randn(8, 64, 64), randn(8, 64, 16), 2, True)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe(randn(3, 64), randn(3, 8), randn(8, 64, 64), randn(8, 64, 32), 9, True)
