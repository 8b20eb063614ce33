"""The CPU attention backends against dense attention computed per request, on mixed batches; the
paged kernel's bf16 code on each kernel path this CPU runs (kvik_cpu.isa, tests/cpu_paths.py)."""

from __future__ import annotations

import cpu_paths
import pytest
import torch

from kvik.attention.backend import AttentionMetadata
from kvik.attention.kv_quant import FP8_E4M3, dequantize_kv, quantize_kv
from kvik_cpu import isa
from kvik_cpu.attention import TorchSdpaBackend
from kvik_cpu.isa import CpuIsa

BLOCK = 16

cpu_path = cpu_paths.cpu_path  # the fixture: each kernel path this CPU runs


def dense_reference(q, k, v, scale, window):
    """q [Q, H, D] at the last Q positions of a context k, v [S, Hk, D]; causal, windowed."""
    s, h, hk = k.shape[0], q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(h // hk, dim=1), v.repeat_interleave(h // hk, dim=1)
    q_pos = torch.arange(s - q.shape[0], s).unsqueeze(1)
    k_pos = torch.arange(s)
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


MIXED = [(37, 37), (50, 9), (23, 1), (64, 1), (17, 17)]  # a prompt, a chunk after a hit, decodes
DECODES = [(23, 1), (64, 1), (40, 1)]
SINGLE_DECODE = [(45, 1)]


def backends() -> list:
    from kvik_cpu.paged_attention import CpuPagedBackend

    found = [TorchSdpaBackend]
    if CpuPagedBackend.unsupported_reason(torch.float32, 32, BLOCK) is None:
        found.append(CpuPagedBackend)
    return found


@pytest.mark.parametrize("backend", backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "requests", [MIXED, DECODES, SINGLE_DECODE], ids=["mixed", "decodes", "one"]
)
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (8, 1)])
def test_batch_matches_dense_attention(backend, dtype, requests, heads, kv_heads, window):
    """(context length, new tokens) per request; fresh random inputs, shuffled block ids."""
    check_against_dense(backend, dtype, requests, heads, kv_heads, window, d=32)


# (k_scale, v_scale): 1.0 (no scales in the checkpoint), a checkpoint's, and a k_scale so small
# that many keys saturate at e4m3's 448.
KV_SCALES = [(1.0, 1.0), (0.37, 1.9), (0.004, 0.5)]


@pytest.mark.parametrize("backend", backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("requests", [MIXED, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("kv_scales", KV_SCALES, ids=lambda s: f"k{s[0]}-v{s[1]}")
def test_fp8_kv_cache_matches_dense_attention_over_dequantized_keys(
    backend, dtype, requests, window, kv_scales
):
    """An FP8 cache: the new keys and values stored as kv_quant quantizes them (bit for bit), and
    attention equal to dense attention over the quantized-then-dequantized context."""
    check_against_dense(backend, dtype, requests, 9, 3, window, d=32, kv_scales=kv_scales)


def test_the_cpu_kernel_takes_fp8_with_its_scales_and_refuses_it_without():
    """The C++ kernel's FP8 path through its op (the one-call decode loop calls the same
    function): a missing scale is a clear error, not a crash."""
    from kvik_cpu import extension

    if (failure := extension.load()) is not None:
        pytest.skip(f"kvik_cpu's C++ ops did not build: {failure}")
    cache = torch.zeros(2, 4, BLOCK, 1, 32, dtype=FP8_E4M3)
    q, k, v, out = (torch.ones(1, 32) for _ in range(4))
    slots, table = torch.tensor([0]), torch.zeros(1, 4, dtype=torch.int32)
    request, position = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    args = (q, k, v, cache, slots, table, request, position, 1.0, 0, 0, out)
    with pytest.raises(RuntimeError, match="an fp8 KV cache needs k_scale"):
        torch.ops.kvik_cpu.paged_attention(*args)
    with pytest.raises(RuntimeError, match="it must be positive"):
        torch.ops.kvik_cpu.paged_attention(*args, torch.tensor(0.0), torch.tensor(1.0))
    torch.ops.kvik_cpu.paged_attention(*args, torch.tensor(0.5), torch.tensor(0.25))
    assert torch.equal(cache[0, 0, 0, 0].float(), torch.full((32,), 2.0))  # 1 / 0.5
    assert torch.equal(out, torch.ones(1, 32))  # one key: its value, 4 * 0.25


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_cpu_kernel_reads_every_e4m3_value_exactly(dtype):
    """One key per request: the output is its value, so every e4m3 code (subnormals, both
    zeros, 448) written and read back through the kernel comes out as torch reads it."""
    from kvik_cpu import extension

    if (failure := extension.load()) is not None:
        pytest.skip(f"kvik_cpu's C++ ops did not build: {failure}")
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_E4M3).float()
    values = torch.where(codes.isnan(), 0.0, codes).view(8, 32)  # 8 requests, head size 32
    cache = torch.zeros(2, 8, BLOCK, 1, 32, dtype=FP8_E4M3)
    q = torch.randn(8, 32).to(dtype)
    out = torch.empty_like(q)
    table = torch.arange(8, dtype=torch.int32).view(8, 1)
    slots = torch.arange(8) * BLOCK
    args = (q, q, values.to(dtype), cache, slots, table, torch.arange(8, dtype=torch.int32))
    one = torch.tensor(1.0)
    torch.ops.kvik_cpu.paged_attention(
        *args, torch.zeros(8, dtype=torch.int32), 1.0, 0, 0, out, one, one
    )
    if dtype == torch.float32:
        assert torch.equal(out, values)
    else:  # bf16 holds every e4m3 value
        assert torch.equal(out.float(), values)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("in_order", [True, False], ids=["blocks-in-order", "shuffled"])
def test_long_bf16_decodes_of_every_head_size_match_dense_attention(d, in_order, cpu_path):
    """The bf16 decode kernel's cases on each kernel path: 16 keys read in place (consecutive
    blocks) or staged (the next block elsewhere, the last partial run), 1 to 8 chunks of 32
    dimensions."""
    from kvik_cpu.paged_attention import CpuPagedBackend

    if CpuPagedBackend.unsupported_reason(torch.bfloat16, d, BLOCK) is not None:
        pytest.skip("CPU_PAGED is not available here")
    requests = [(150, 1), (33, 1), (300, 1), (16, 1)]
    impl = check_against_dense(CpuPagedBackend, torch.bfloat16, requests, 12, 3, None, d, in_order)
    assert impl.path is cpu_path


def test_the_forced_path_reaches_the_kernel(monkeypatch):
    """Each path the CPU runs computes its own bits (the paths sum and exponentiate differently),
    all close to dense attention: the path forced in Python is the one the C++ code takes. (The
    paths part only by fp32 rounding, so few bf16 outputs differ: the step holds many of them.)"""
    from kvik_cpu.paged_attention import CpuPagedBackend

    if CpuPagedBackend.unsupported_reason(torch.bfloat16, 64, BLOCK) is not None:
        pytest.skip("CPU_PAGED is not available here")
    outputs = {}
    for path in isa.runnable_isas():
        if path > CpuIsa(torch.ops.kvik_cpu.built_isa()):
            continue  # AMX flags without the tiles' permission: test_isa.py covers the refusal
        monkeypatch.setenv(isa.ENV_VAR, path.label)
        impl, outputs[path] = check_against_dense(
            CpuPagedBackend, torch.bfloat16, [(300, 1)] * 16, 16, 4, None, 128, with_output=True
        )
        assert impl.path is path
    for faster in outputs:
        if faster is not CpuIsa.PLAIN:
            assert not torch.equal(outputs[faster], outputs[CpuIsa.PLAIN]), faster.label
    if len(outputs) == 1:
        pytest.skip("only the plain path runs on this CPU: nothing to tell it from")


def test_the_kernel_refuses_a_path_its_build_lacks():
    from kvik_cpu import extension

    if (failure := extension.load()) is not None:
        pytest.skip(f"kvik_cpu's C++ ops did not build: {failure}")
    built = torch.ops.kvik_cpu.built_isa()
    cache = torch.zeros(2, 4, BLOCK, 1, 32, dtype=torch.bfloat16)
    q, k, v, out = (torch.zeros(1, 32, dtype=torch.bfloat16) for _ in range(4))
    slots, table = torch.tensor([0]), torch.zeros(1, 4, dtype=torch.int32)
    request, position = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    for bad in (built + 1, -1):
        with pytest.raises(RuntimeError, match="is not in this build"):
            torch.ops.kvik_cpu.paged_attention(
                q, k, v, cache, slots, table, request, position, 1.0, 0, bad, out
            )


def check_against_dense(
    backend,
    dtype,
    requests,
    heads,
    kv_heads,
    window,
    d,
    in_order=False,
    with_output=False,
    kv_scales=None,
    decode_requests=None,
    with_state=False,
):
    """Runs ``backend`` on one step of ``requests`` against ``dense_reference``; returns the impl
    (and, ``with_output``, the output). With ``kv_scales`` (k_scale, v_scale) the cache is FP8,
    and the reference attends over the keys and values quantized and dequantized with them."""
    torch.manual_seed(d)
    scale = d**-0.5
    num_blocks = sum(-(-seq_len // BLOCK) for seq_len, _ in requests) + 8
    cache_dtype = dtype if kv_scales is None else FP8_E4M3
    kv_cache = torch.zeros(2, num_blocks, BLOCK, kv_heads, d, dtype=cache_dtype)
    k_scale, v_scale = (None, None) if kv_scales is None else map(torch.tensor, kv_scales)

    def stored(x, scale):  # what the cache holds for x (bf16 or fp32 keys or values)
        return x if kv_scales is None else quantize_kv(x, scale)

    def read_back(x, scale):  # what attention sees of x: through the cache and back, in float64
        return x if kv_scales is None else dequantize_kv(stored(x, scale), scale, torch.float64)

    free = list(range(num_blocks))[::-1] if in_order else torch.randperm(num_blocks).tolist()
    tables, contexts, qs, ks, vs, slots = [], [], [], [], [], []
    for seq_len, new in requests:
        blocks = [free.pop() for _ in range(-(-seq_len // BLOCK))]
        tables.append(blocks)
        k_all = torch.randn(seq_len, kv_heads, d).to(dtype)
        v_all = torch.randn(seq_len, kv_heads, d).to(dtype)
        for pos in range(seq_len - new):  # the cached context, written before this step
            b, o = blocks[pos // BLOCK], pos % BLOCK
            kv_cache[0, b, o] = stored(k_all[pos], k_scale)
            kv_cache[1, b, o] = stored(v_all[pos], v_scale)
        contexts.append((k_all, v_all))
        qs.append(torch.randn(new, heads, d).to(dtype))
        ks.append(k_all[seq_len - new :])
        vs.append(v_all[seq_len - new :])
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(seq_len - new, seq_len)]
    query_lens = torch.tensor([n for _, n in requests], dtype=torch.int32)
    seq_lens = torch.tensor([s for s, _ in requests], dtype=torch.int32)
    block_table = torch.zeros(len(requests), max(map(len, tables)), dtype=torch.int32)
    for row, blocks in enumerate(tables):
        block_table[row, : len(blocks)] = torch.tensor(blocks)
    metadata = backend.build_metadata(
        AttentionMetadata(
            num_actual_tokens=int(query_lens.sum()),
            num_reqs=len(requests),
            query_start_loc=torch.cat(
                (torch.zeros(1, dtype=torch.int32), query_lens.cumsum(0))
            ).int(),
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=torch.tensor(slots),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=BLOCK,
            decode_requests=decode_requests,
        )
    )
    impl = backend.impl_class()(heads, d, scale, kv_heads, window, k_scale, v_scale)
    q = torch.cat(qs).flatten(1)
    out = torch.full_like(q, float("nan"))
    impl.forward(q, torch.cat(ks).flatten(1), torch.cat(vs).flatten(1), kv_cache, metadata, out)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    start = 0
    for (k_all, v_all), q_r in zip(contexts, qs):
        k_seen, v_seen = read_back(k_all, k_scale), read_back(v_all, v_scale)
        want = dense_reference(q_r, k_seen, v_seen, scale, window).float().flatten(1)
        got = out[start : start + q_r.shape[0]].float()
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        start += q_r.shape[0]
    # The new keys and values landed in their slots.
    flat = kv_cache.view(2, num_blocks * BLOCK, kv_heads, d)
    if kv_scales is None:
        torch.testing.assert_close(flat[0, torch.tensor(slots)], torch.cat(ks))
        torch.testing.assert_close(flat[1, torch.tensor(slots)], torch.cat(vs))
    else:  # quantized as kvik.attention.kv_quant does, to the bit
        for half, new, s in ((0, ks, k_scale), (1, vs, v_scale)):
            got = flat[half, torch.tensor(slots)].view(torch.uint8)
            assert torch.equal(got, stored(torch.cat(new), s).view(torch.uint8))
    if with_state:  # and what a test needs to run more steps over the same cache
        return impl, out, (q, kv_cache, block_table, seq_lens, query_lens)
    return (impl, out) if with_output else impl


# A prompt, a verification of 4 drafts (5 tokens), a decode, a verification of 3 drafts.
VERIFICATIONS = [(37, 37), (50, 5), (23, 1), (30, 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [None, 7])
def test_verification_tokens_are_computed_as_decodes(dtype, window):
    """Speculative verifications (``decode_requests``): each token attends up to its own
    position, and gets the very bits it would get as a one-token decode step."""
    from kvik_cpu.paged_attention import CpuPagedBackend

    if CpuPagedBackend not in backends():
        pytest.skip("the paged kernel is not built here")
    flags = torch.tensor([False, True, True, True])
    impl, out, (q, kv_cache, block_table, seq_lens, query_lens) = check_against_dense(
        CpuPagedBackend, dtype, VERIFICATIONS, 9, 3, window, d=32, with_state=True,
        decode_requests=flags,
    )  # fmt: skip
    starts = torch.cat((torch.zeros(1, dtype=torch.int64), query_lens.cumsum(0)))
    for r in (1, 3):
        for i in range(int(query_lens[r])):
            row = int(starts[r]) + i
            position = int(seq_lens[r] - query_lens[r]) + i
            decode = CpuPagedBackend.build_metadata(
                AttentionMetadata(
                    num_actual_tokens=1,
                    num_reqs=1,
                    query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                    query_lens=torch.ones(1, dtype=torch.int32),
                    seq_lens=torch.tensor([position + 1], dtype=torch.int32),
                    block_table=block_table[r : r + 1],
                    slot_mapping=torch.tensor([-1]),  # the key is in the cache already
                    max_query_len=1,
                    max_seq_len=position + 1,
                    block_size=BLOCK,
                )
            )
            alone = torch.empty_like(q[row : row + 1])
            empty = q.new_empty(1, 3 * 32)
            impl.forward(q[row : row + 1], empty, empty, kv_cache, decode, alone)
            assert torch.equal(alone[0], out[row]), (r, i)
