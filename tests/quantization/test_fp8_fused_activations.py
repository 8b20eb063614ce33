"""Norms, SiLU-and-mul and attention that write the quantized input of the block-FP8 projection
they feed (kvik.quantization.activation), through the engine on the CPU: which producers get
linked (the CPU's attention backends then hand o_proj their output unquantized), and
that linking changes no bit of what the model computes (teacher-forced logprobs of every prompt
token and greedy generations, eager and compiled), on the Llama, Qwen3 and Qwen3-MoE checkpoints
of Hugging Face's fine-grained FP8 format."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fp8_checkpoints import make_compressed_tensors_fp8, make_hf_block_fp8
from fp8_reference import GREEDY_PROMPTS, scored_sequences

from kvik import LLM, SamplingParams
from kvik.layers.activation import SiluAndMul
from kvik.layers.attention import Attention
from kvik.layers.linear import MergedColumnLinear
from kvik.layers.norm import RMSNorm
from kvik.quantization.activation import FP8_PER_TOKEN_GROUP
from kvik_cpu.platform import CpuPlatform

#: Producers linked per decoder layer: a dense layer's two norms, its SiLU-and-mul and its
#: attention; a MoE layer's input norm and attention only (its MoE block reads the other norm's
#: output in router and experts).
LINKS_PER_LAYER = {"llama": 4, "qwen3": 4, "qwen3moe": 2}
#: Whose dense MLPs then run gate/up, SiLU-and-mul and down's quantization as one op
#: (``torch.ops.kvik.fp8_block_silu_and_mul_quantized``).
FUSED_GATE_UP = {"llama": True, "qwen3": True, "qwen3moe": False}
PRODUCERS = RMSNorm | SiluAndMul | Attention


def llm_on(folder: Path, **options) -> LLM:
    options = {"enforce_eager": True} | options
    return LLM(
        str(folder), dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=256, **options
    )


def outputs(llm: LLM) -> tuple[torch.Tensor, list[list[int]]]:
    """Teacher-forced logprobs of each scored sequence's tokens, and greedy continuations."""
    sequences = scored_sequences()
    prompts = [{"prompt_token_ids": s.tolist()} for s in sequences]
    scored = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)  # fmt: skip
    logprobs = torch.tensor(
        [
            [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], seq[1:])]
            for seq, out in zip(sequences.tolist(), scored)
        ],
        dtype=torch.float64,
    )
    greedy = llm.generate(
        [{"prompt_token_ids": p} for p in GREEDY_PROMPTS],
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    return logprobs, [list(o.outputs[0].token_ids) for o in greedy]


def linked_producers(llm: LLM) -> list[str]:
    model = llm.engine.runner.model
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, PRODUCERS) and module.quantize_output is not None
    ]


def count_fused_gate_up(llm: LLM) -> list[int]:
    """Counts, from now on, the calls of the gate/up layers' one-op path (one counter for all)."""
    calls = [0]
    for module in llm.engine.runner.model.modules():
        if isinstance(module, MergedColumnLinear) and len(module.shards) == 2:
            kernel = module.quant_method.kernel

            def counted(*args, original=kernel.silu_and_mul_function):
                calls[0] += 1
                return original(*args)

            kernel.silu_and_mul_function = counted
    return calls


@pytest.fixture
def unfused(monkeypatch: pytest.MonkeyPatch):
    """Within the test, the CPU platform leaves every projection to quantize its own input."""

    def off() -> None:
        monkeypatch.setattr(
            CpuPlatform, "fuses_activation_quantization", classmethod(lambda cls, kind: False)
        )

    return off


@pytest.mark.parametrize("kind", list(LINKS_PER_LAYER))
def test_linked_producers_change_no_bit(kind, fp8_originals, tmp_path, unfused) -> None:
    folder = make_hf_block_fp8(fp8_originals[kind], tmp_path / kind)
    fused = llm_on(folder)
    layers = fused.config.model.hf_config.num_hidden_layers
    linked = linked_producers(fused)
    assert fused.engine.runner.quantizing_producers == len(linked)
    assert len(linked) == LINKS_PER_LAYER[kind] * layers, linked
    assert all(
        module.quantize_output == FP8_PER_TOKEN_GROUP
        for module in fused.engine.runner.model.modules()
        if isinstance(module, PRODUCERS) and module.quantize_output is not None
    )
    fused_gate_up = count_fused_gate_up(fused)
    fused_logprobs, fused_greedy = outputs(fused)
    assert (fused_gate_up[0] > 0) == FUSED_GATE_UP[kind], fused_gate_up
    del fused
    unfused()
    plain = llm_on(folder)
    assert plain.engine.runner.quantizing_producers == 0 and not linked_producers(plain)
    plain_gate_up = count_fused_gate_up(plain)
    plain_logprobs, plain_greedy = outputs(plain)
    assert plain_gate_up == [0]
    assert torch.equal(fused_logprobs, plain_logprobs)
    assert fused_greedy == plain_greedy


def test_compiled_forward_takes_the_quantized_activations(
    fp8_originals, tmp_path, unfused, monkeypatch: pytest.MonkeyPatch
):
    """torch.compile (mode 3, split at attention) traces the producers' ops and the quantized
    activations they hand on, and computes the eager engine's bits."""
    # Inductor's caches in this test's folder, and the variable put back after it: the engine sets
    # it for the process on its first compile, where later tests choose their own.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    folder = make_hf_block_fp8(fp8_originals["llama"], tmp_path / "llama")
    compiled = llm_on(folder, enforce_eager=False, compilation_config='{"mode": 3}')
    assert compiled.engine.runner.quantizing_producers > 0
    compiled_outputs = outputs(compiled)
    del compiled
    unfused()
    eager = outputs(llm_on(folder))
    assert torch.equal(compiled_outputs[0], eager[0]) and compiled_outputs[1] == eager[1]


def test_only_block_fp8_projections_take_quantized_input(fp8_originals, tmp_path) -> None:
    """An unquantized model and a per-channel FP8 one link nothing: their kernels quantize
    nothing or per token (``LinearKernel.quantized_input`` None)."""
    assert linked_producers(llm_on(fp8_originals["llama"])) == []
    folder = make_compressed_tensors_fp8(fp8_originals["qwen3"], tmp_path / "ct", "FP8_DYNAMIC")
    assert linked_producers(llm_on(folder)) == []
