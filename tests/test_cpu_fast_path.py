"""The CPU's fast path (compiled forward, C++ paged decode attention, prepacked bf16 weights)
computes what the eager reference path does. The default model's bf16 check against transformers
is in test_default_model.py."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from test_engine_vs_transformers import assert_greedy_equal
from tiny_models import load_hf, ragged_prompts

from kvik import LLM, SamplingParams
from kvik_cpu.linear import PackedLinear, packed_linear_supported
from kvik_cpu.paged_attention import CpuPagedBackend
from kvik_cpu.platform import CpuPlatform

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def test_compiled_engine_equals_transformers(tiny_model):
    """fp32, so the compiled forward must give transformers' tokens as the eager one does; a
    sliding-window model, ragged prompts and batched decodes (C++ decode attention)."""
    folder = tiny_model("mistral")
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=256)
    runner = llm.engine.runner
    assert runner.compiled_forward is not None, "the CPU engine should run compiled by default"
    assert runner.backend is CpuPagedBackend
    prompts = ragged_prompts(6, seed=11)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert_greedy_equal(prompts, outputs, load_hf(folder), GREEDY.max_tokens)


def test_failed_compile_falls_back_to_eager(tiny_model, monkeypatch, caplog):
    def broken_compiler(model, config):
        def forward(input_ids, positions):
            raise RuntimeError("no C++ compiler here")

        return forward

    monkeypatch.setattr(
        CpuPlatform, "compile_model", classmethod(lambda cls, m, c: broken_compiler(m, c))
    )
    folder = tiny_model("llama")
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(folder), dtype="float32", num_kv_blocks=256)
    assert llm.engine.runner.compiled_forward is None
    assert "compiling the forward pass failed" in caplog.text
    prompts = ragged_prompts(3, seed=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert_greedy_equal(prompts, outputs, load_hf(folder), GREEDY.max_tokens)


@pytest.mark.skipif(
    not packed_linear_supported(torch.bfloat16), reason="no oneDNN bf16 on this CPU"
)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_packed_linear_equals_f_linear(rows):
    torch.manual_seed(rows)
    weight = torch.randn(96, 80, dtype=torch.bfloat16)
    bias = torch.randn(96, dtype=torch.bfloat16)
    x = torch.randn(rows, 80, dtype=torch.bfloat16)
    for b in (None, bias):
        assert torch.equal(PackedLinear(weight, b)(x), F.linear(x, weight, b))
    assert PackedLinear(weight, None)(x[:0]).shape == (0, 96)


@pytest.mark.skipif(
    not packed_linear_supported(torch.bfloat16), reason="no oneDNN bf16 on this CPU"
)
def test_eager_bf16_packs_every_matmul_and_keeps_the_embedding(tiny_model):
    folder = tiny_model("qwen2")
    eager = LLM(str(folder), dtype="bfloat16", num_kv_blocks=64, enforce_eager=True)
    model = eager.engine.runner.model
    kernels = [m.kernel for m in model.modules() if hasattr(m, "kernel")]
    assert kernels and all(isinstance(k, PackedLinear) for k in kernels)
    assert model.model.embed_tokens.weight.numel() > 0  # still looked up
    prompts = ragged_prompts(3, seed=2)
    hf = load_hf(folder).to(torch.bfloat16)
    got = eager.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for prompt, output in zip(prompts, got):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0, -1].float()
        # The first token from the prompt alone: kvik's pick is transformers' best or a near-tie.
        first = output.outputs[0].token_ids[0]
        assert logits[first] >= logits.max() - 0.05 * logits.abs().max()
