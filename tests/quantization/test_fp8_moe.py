"""Block-FP8 mixture of experts (issue 16): a random Qwen3-MoE quantized to Qwen3-30B-A3B-FP8's
layout (per-expert ``experts.N.gate_proj.weight`` e4m3 with ``weight_scale_inv`` tile scales,
attention projections block-FP8 too, routers and lm_head unquantized), read by kvik in fp32
activations on the CPU, against the float64 emulation (fp8_reference: the experts dequantized,
each expert product's input rounded per token group of 128), by issue 14's rules: kvik's
teacher-forced mean |delta logprob| against the original within 1.5x the emulation's, greedy
agreement outside near-ties, and a planted bug (the experts' tile scales transposed) past the
bar."""

from __future__ import annotations

import json

import pytest
import torch
from fp8_checkpoints import MOE_PLANTED_BUGS, is_quantized_projection
from fp8_reference import (
    BAR,
    GREEDY_PROMPTS,
    GREEDY_TOKENS,
    ReferenceModel,
    greedy_disagreement,
    mean_abs_delta,
    teacher_forced_logprobs,
)
from safetensors import safe_open
from test_fp8_accuracy import kvik_llm, kvik_logprobs

from kvik import SamplingParams
from kvik.layers.moe import FusedMoE
from kvik.quantization.fp8 import Fp8Config
from kvik.quantization.fp8_moe import Fp8BlockMoeMethod
from kvik.quantization.moe_methods import UnquantizedMoeMethod

NAME = "hf-block-qwen3moe"


@pytest.fixture(scope="module")
def moe_llm(fp8_case):
    return kvik_llm(fp8_case(NAME).folder)


def test_moe_checkpoint_layout(fp8_case):
    """Per-expert e4m3 projections with [N/128, K/128] fp32 tile scales; routers unquantized."""
    case = fp8_case(NAME)
    config = json.loads((case.folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    shapes = {}
    for file in case.folder.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                t = f.get_slice(key)
                shapes[key] = (t.get_dtype(), tuple(t.get_shape()))
    experts = [k for k in shapes if ".experts." in k and k.endswith(".weight")]
    assert len(experts) == 2 * 8 * 3  # layers x experts x projections
    for key in experts:
        dtype, (n, k) = shapes[key]
        assert dtype == "F8_E4M3"
        assert shapes[key.removesuffix("weight") + "weight_scale_inv"] == ("F32", (n // 128, k // 128))  # fmt: skip
    assert shapes["model.layers.0.mlp.gate.weight"][0] == "BF16"
    assert not is_quantized_projection("model.layers.0.mlp.gate")


def test_moe_reference_error_is_what_fp8_rounding_costs(fp8_case):
    case = fp8_case(NAME)
    weights_error = mean_abs_delta(case.weights_only, case.original)
    error = mean_abs_delta(case.emulation, case.original)
    print(f"{NAME}: weights only {weights_error:.4f}, weights and activations {error:.4f}")
    assert 0.01 < weights_error < error < 0.3


def test_kvik_builds_block_fp8_experts(moe_llm):
    model = moe_llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(layers) == 2
    for layer in layers:
        assert isinstance(layer.quant_method, Fp8BlockMoeMethod)
        assert layer.gate_up_proj.dtype == torch.float8_e4m3fn
        assert layer.gate_up_proj_scale.shape == (8, 4, 2)
        assert layer.down_proj_scale.shape == (8, 2, 2)


def test_moe_logprob_error_within_the_bar(fp8_case, moe_llm):
    case = fp8_case(NAME)
    got = kvik_logprobs(moe_llm, case.sequences)
    error = mean_abs_delta(got, case.original)
    report = (
        f"{NAME}: kvik's mean |delta logprob| against the original {error:.4f}, the "
        f"reference's {case.reference_error:.4f} (bar {BAR}x); kvik against the reference "
        f"{mean_abs_delta(got, case.reference):.4f}"
    )
    print(report)
    assert error <= BAR * case.reference_error, report


def test_moe_greedy_agrees_but_at_near_ties(fp8_case, moe_llm):
    case = fp8_case(NAME)
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outputs = moe_llm.generate(GREEDY_PROMPTS, params, use_tqdm=False)
    problems = []
    for prompt, expected, out in zip(GREEDY_PROMPTS, case.reference_greedy(), outputs):
        problem = greedy_disagreement(
            case.reference_model, prompt, expected, list(out.outputs[0].token_ids),
            case.near_tie_tolerance,
        )  # fmt: skip
        if problem:
            problems.append(f"prompt of {len(prompt)} tokens: {problem}")
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("bug", list(MOE_PLANTED_BUGS))
def test_moe_planted_bug_fails_the_bar(bug, planted_bug):
    """Transposed expert tile scales: far past the bar in the reference, and past it in kvik."""
    case, folder = planted_bug(bug)
    clean = mean_abs_delta(case.emulation, case.original)
    in_reference = mean_abs_delta(teacher_forced_logprobs(ReferenceModel(folder), case.sequences), case.original)  # fmt: skip
    assert in_reference > 2 * BAR * clean, f"{bug}: {in_reference:.4f} against {clean:.4f}"
    got = kvik_logprobs(kvik_llm(folder), case.sequences)
    error = mean_abs_delta(got, case.original)
    assert error > BAR * case.reference_error, (
        f"{bug}: kvik's error {error:.4f} is within the bar of the reference's {case.reference_error:.4f}"  # fmt: skip
    )


def _layer(config, intermediate: int = 256) -> FusedMoE:
    return FusedMoE(8, 2, 256, intermediate, True, quant_config=config, prefix="model.layers.0.mlp.experts")  # fmt: skip


def test_moe_quant_methods_follow_the_config():
    block = Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert isinstance(_layer(block).quant_method, Fp8BlockMoeMethod)
    assert isinstance(_layer(None).quant_method, UnquantizedMoeMethod)
    skip_mlp = Fp8Config.from_config(
        {
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["model.layers.0.mlp"],
        }
    )
    assert isinstance(_layer(skip_mlp).quant_method, UnquantizedMoeMethod)


def test_unsupported_fp8_experts_are_clear_errors():
    block = Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match="multiple of the 128-row weight blocks"):
        _layer(block, intermediate=192)
    with pytest.raises(ValueError, match="per-tensor FP8 experts are not supported"):
        _layer(Fp8Config.from_config({"quant_method": "fp8"}))
    with pytest.raises(ValueError, match="online FP8"):
        _layer(Fp8Config.from_flag())
    partial = Fp8Config.from_config(
        {
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["model.layers.0.mlp.experts.3.up_proj"],
        }
    )
    with pytest.raises(ValueError, match="some but not all expert projections"):
        _layer(partial)
