"""The CPU's packed experts (kvik_cpu.moe) in bf16: each path's kernels against the fused MoE op's
reference, and a bf16 MoE engine that packs its experts and agrees with transformers."""

from __future__ import annotations

import cpu_paths
import pytest
import torch
from test_engine_vs_transformers import GREEDY
from tiny_models import load_hf, ragged_prompts
from tiny_moe_models import build_tiny_moe

import kvik.ops as ops
from kvik import LLM
from kvik.layers.moe import FusedMoE
from kvik_cpu import extension
from kvik_cpu.isa import CpuIsa
from kvik_cpu.linear import Avx512Bf16Linear, packed_linear_supported
from kvik_cpu.moe import PackedExperts, expert_product, pack_expert_weights

cpu_path = cpu_paths.cpu_path  # the fixture: each kernel path this CPU runs


def packing_path(path: CpuIsa) -> None:
    """Skip where ``path`` packs no weights (the plain path keeps F.linear)."""
    if path < CpuIsa.AVX512BF16 or not packed_linear_supported(torch.bfloat16):
        pytest.skip(f"the {path.label} path packs no bf16 weights on this CPU")
    if extension.load() is not None:
        pytest.skip(f"kvik_cpu's C++ ops did not build: {extension.load()}")


@pytest.mark.parametrize("tokens", [1, 8, 37])
def test_packed_experts_equal_the_reference(cpu_path, tokens: int) -> None:
    packing_path(cpu_path)
    experts, hidden, inter, top_k = 16, 128, 96, 4
    layer = FusedMoE(experts, top_k, hidden, inter, renormalize=True).to(torch.bfloat16)
    layer.gate_up_proj.data.normal_(0, hidden**-0.5)
    layer.down_proj.data.normal_(0, inter**-0.5)
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    logits = torch.randn(tokens, experts).to(torch.bfloat16)
    logits[:, :5] -= 100  # experts 0-4 get no token
    w13, w2 = layer.gate_up_proj.detach().clone(), layer.down_proj.detach().clone()
    expected = ops._fused_moe(x, logits, w13, w2, top_k, True)
    assert pack_expert_weights(layer, cpu_path) == 1
    assert isinstance(layer.kernel, PackedExperts) and layer.gate_up_proj.numel() == 0
    assert all(
        type(p) is expert_product(cpu_path) for p in layer.kernel.gate_up + layer.kernel.down
    )
    got = layer(x, logits)
    # Each product rounds to bf16 as F.linear does; AMX sums in another order.
    err = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
    assert err < 1e-2, f"relative error {err:.2e}"


def test_experts_in_one_call_equal_the_per_expert_loop() -> None:
    """The AVX512-BF16 experts' one C++ call (bf16_moe_experts; bf16_moe with the grouping and
    weighted sum around it) runs the per-expert loop's kernels in its order: the same bits; and
    counts that do not cover the rows, or expert ids out of range, are refused."""
    if extension.load() is not None or expert_product(CpuIsa.AVX512BF16) is not Avx512Bf16Linear:
        pytest.skip("kvik_cpu's C++ ops did not build with AVX512-BF16 here")
    experts, hidden, inter, top_k = 8, 96, 64, 3
    layer = FusedMoE(experts, top_k, hidden, inter, renormalize=False).to(torch.bfloat16)
    layer.gate_up_proj.data.normal_(0, hidden**-0.5)
    layer.down_proj.data.normal_(0, inter**-0.5)
    pack_expert_weights(layer, CpuIsa.AVX512BF16)
    kernel = layer.kernel
    assert kernel.in_one_call
    x = torch.randn(11, hidden).to(torch.bfloat16)
    logits = torch.randn(11, experts).to(torch.bfloat16)
    logits[:, 0] -= 100  # an expert without rows
    loop = ops.grouped_experts(x, logits, top_k, False, kernel.expert)
    assert torch.equal(kernel(x, logits), loop)  # bf16_moe: routing's aftermath in C++ too
    in_one_call = ops.grouped_experts(x, logits, top_k, False, all_experts=kernel.all_experts)
    assert torch.equal(in_one_call, loop)
    assert kernel(x[:0], logits[:0]).shape == (0, hidden)
    weights, ids = ops.moe_routing(logits, top_k, False)
    with pytest.raises(RuntimeError, match="is not in"):
        torch.ops.kvik_cpu.bf16_moe(
            x, weights, ids + experts, kernel.gate_up_packed, kernel.down_packed, inter
        )
    rows = torch.randn(5, hidden).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="cover"):
        kernel.all_experts(rows, [2, 2] + [0] * (experts - 2))


def test_bf16_moe_engine_packs_its_experts(cpu_path, tmp_path) -> None:
    folder = build_tiny_moe("qwen2_moe", tmp_path)
    llm = LLM(str(folder), dtype="bfloat16", num_kv_blocks=64)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE)]
    assert layers
    packs = cpu_path >= CpuIsa.AVX512BF16 and packed_linear_supported(torch.bfloat16)
    assert all(isinstance(m.kernel, PackedExperts) == packs for m in layers)
    prompts = ragged_prompts(3, seed=2)
    hf = load_hf(folder).to(torch.bfloat16)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0, -1].float()
        # The first token from the prompt alone: transformers' best, or within a bf16 near-tie.
        first = output.outputs[0].token_ids[0]
        assert logits[first] >= logits.max() - 0.05 * logits.abs().max()
