"""The mixture-of-experts models and the fused MoE op on a CUDA GPU; skipped without CUDA.

The four MoE architectures (tests/tiny_moe_models.py, at head size 64) decode the same greedy
tokens eagerly and under FULL CUDA graphs, synchronously and asynchronously, equal to transformers
in fp32 (the near-tie rule); the fused MoE op alone replays under a CUDA graph with new inputs and
gives the eager result bit for bit. bf16 runs stay within transformers' top 5 (bf16 on the GPU). The kernel's own cases (core's triton_kernel_cases.py, at
Qwen3-30B-A3B's shapes) run in test_kernels_gpu.py.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

sys.path[:0] = [
    str(Path(__file__).resolve().parent),
    str(Path(__file__).resolve().parents[3] / "tests"),
]
from test_engine_vs_transformers import assert_greedy_equal  # noqa: E402
from test_gpu_e2e import assert_greedy_in_top5, make_llm  # noqa: E402
from test_gpu_graphs import MODES, _Output, shrinking_batch  # noqa: E402
from tiny_models import load_hf  # noqa: E402
from tiny_moe_models import MOE_KINDS, build_tiny_moe  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            folder = tmp_path_factory.mktemp(f"gpu-{kind}")
            made[kind] = build_tiny_moe(kind, folder, hidden_size=256)
        return made[kind]

    return make


def hf_model(folder: Path, dtype: str):
    """transformers' reference: fp32 on the CPU (exact), bf16 on the GPU (kvik's precision)."""
    if dtype == "float32":
        return load_hf(folder)
    model = load_hf(folder).to("cuda", torch.bfloat16)
    return model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_greedy_identical_across_graphs_and_async(kind, dtype, moe_models):
    """fp32: the same tokens in every mode, equal to transformers (near-tie rule). bf16: every
    mode within transformers' top 5 (bf16 on the GPU) where it leaves transformers' tokens."""
    prompts, params = shrinking_batch()
    results = {}
    for name, kwargs in MODES.items():
        llm = make_llm(moe_models(kind), dtype, **kwargs)
        step_runner = llm.engine.runner.step_runner
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results[name] = outputs
        if name.startswith("full"):
            assert step_runner.name == "cuda_graphs" and step_runner.num_replays > 0, name
        del llm
        gc.collect()
    reference = [o.outputs[0].token_ids for o in results["eager-sync"]]
    if dtype == "float32":
        for name, outputs in results.items():
            assert [o.outputs[0].token_ids for o in outputs] == reference, name
    hf = hf_model(moe_models(kind), dtype)
    short = min(p.max_tokens for p in params)
    for outputs in results.values():
        outputs = [_Output(o.outputs[0].token_ids[:short]) for o in outputs]
        if dtype == "float32":
            assert_greedy_equal(prompts, outputs, hf, short)
        else:
            assert_greedy_in_top5(prompts, outputs, hf, short)


@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_fused_moe_replays_under_a_cuda_graph(tokens: int) -> None:
    from kvik_cuda.registration import register_kernels

    register_kernels()
    experts, hidden, inter, top_k = 128, 2048, 768, 8
    g = torch.Generator("cuda").manual_seed(tokens)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(*shape, device="cuda", generator=g) * scale
        return x.to(torch.bfloat16)

    x, logits = randn(tokens, hidden), randn(tokens, experts)
    w13 = randn(experts, 2 * inter, hidden, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, scale=inter**-0.5)
    op = torch.ops.kvik.fused_moe
    op(x, logits, w13, w2, top_k, True)  # compiles every kernel before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(x, logits, w13, w2, top_k, True)
    for _ in range(3):  # new tokens routed elsewhere, through the same graph
        x.copy_(randn(tokens, hidden))
        logits.copy_(randn(tokens, experts))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, op(x, logits, w13, w2, top_k, True))
