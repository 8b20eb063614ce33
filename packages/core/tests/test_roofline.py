"""kvik.bench.roofline: the arithmetic against figures worked out by hand for Llama-3.1-8B's shapes
(bench/models/llama-3.1-8b/config.json), the device table, the CPU probe, and the roofline line
that `kvik bench throughput` and `latency` print."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvik.bench.roofline import (
    DEVICES,
    DeviceLimits,
    ModelCost,
    across_ranks,
    device_limits,
    measure_cpu,
    roofline_fields,
    workload_roofline,
)
from kvik.cli.main import main

ROOT = Path(__file__).resolve().parents[3]
LLAMA_8B = json.loads((ROOT / "bench" / "models" / "llama-3.1-8b" / "config.json").read_text())
H200 = DeviceLimits("NVIDIA H200", 4.3e12, 790e12, "test")

# By hand, Llama-3.1-8B (hidden 4096, 32 layers, 32 query and 8 KV heads of 128, MLP 14336,
# vocabulary 128256, untied embeddings):
#   a layer: attention 4096 * 128 * (2*32 + 2*8) = 41,943,040; MLP 3 * 4096 * 14336 = 176,160,768;
#   two norms 8,192: 218,112,000. 32 layers: 6,979,584,000. Embedding and LM head
#   2 * 128256 * 4096 = 1,050,673,152; the final norm 4,096. In all 8,030,261,248.
PARAMS = 8_030_261_248
WEIGHT_BYTES = 2 * PARAMS  # bf16: 16,060,522,496
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 heads of 128, bf16: 131,072


def test_model_cost_of_llama_8b() -> None:
    cost = ModelCost.from_config(LLAMA_8B)
    assert cost.num_parameters == PARAMS
    assert cost.weight_bytes == WEIGHT_BYTES == 16_060_522_496
    assert cost.flop_per_token == 2 * PARAMS
    assert cost.kv_bytes_per_token == KV_BYTES_PER_TOKEN == 131_072
    fp32 = ModelCost.from_config(LLAMA_8B, dtype_bytes=4)
    assert (fp32.weight_bytes, fp32.kv_bytes_per_token) == (4 * PARAMS, 262_144)
    # A transformers config gives the same figures as its dict.
    from transformers import LlamaConfig

    assert ModelCost.from_config(LlamaConfig(**LLAMA_8B)) == cost


def test_batch_one_decode_is_bandwidth_bound() -> None:
    """1 prompt of 128 tokens, 2 output tokens on the H200's 4.3 TB/s and 790 TFLOP/s."""
    cost = ModelCost.from_config(LLAMA_8B)
    roofline = workload_roofline(cost, H200, 1, 128, 2)
    # Prefill: 128 * 2 * PARAMS = 2.056e12 FLOPs, 2.602 ms at 790 TFLOP/s; reading the weights
    # takes longer, 16.0605e9 / 4.3e12 = 3.7350 ms. The one decode step reads the weights and
    # 129 tokens of K and V: (16,060,522,496 + 129 * 131,072) / 4.3e12 = 3.7389 ms.
    prefill = WEIGHT_BYTES / 4.3e12
    decode = (WEIGHT_BYTES + 129 * KV_BYTES_PER_TOKEN) / 4.3e12
    assert prefill == pytest.approx(3.73500e-3, rel=1e-5)
    assert decode == pytest.approx(3.73894e-3, rel=1e-5)
    assert roofline.seconds == pytest.approx(prefill + decode, rel=1e-12)
    assert roofline.limit_output_tok_s == pytest.approx(267.6, abs=0.05)
    assert roofline.limit_total_tok_s == pytest.approx(130 / (prefill + decode))
    assert roofline.bound == "bandwidth" and roofline.flop_bound_seconds == 0
    # A run that took twice the limit's time reached half of it.
    assert roofline.fraction(2 * roofline.seconds) == pytest.approx(0.5)


def test_tensor_parallel_ranks_add_their_devices() -> None:
    """Two H200s under tensor parallelism read each weight once between them: batch 1's limit
    doubles (the collectives are counted free), and one rank is the device itself."""
    cost = ModelCost.from_config(LLAMA_8B)
    two = across_ranks(H200, 2)
    assert two.name == "2 x NVIDIA H200"
    assert (two.bytes_per_s, two.flop_per_s) == (2 * H200.bytes_per_s, 2 * H200.flop_per_s)
    assert across_ranks(H200, 1) is H200
    one_rank = workload_roofline(cost, H200, 1, 128, 256).limit_output_tok_s
    two_ranks = workload_roofline(cost, two, 1, 128, 256).limit_output_tok_s
    assert two_ranks == pytest.approx(2 * one_rank)


def test_long_prompts_are_flop_bound() -> None:
    """4 prompts of 4096 tokens, one output token each: prefill only."""
    cost = ModelCost.from_config(LLAMA_8B)
    roofline = workload_roofline(cost, H200, 4, 4096, 1)
    flops = 4 * 4096 * 2 * PARAMS  # 2.6315e14
    assert roofline.seconds == pytest.approx(flops / 790e12, rel=1e-12)
    assert roofline.seconds == pytest.approx(0.33311, rel=1e-4)
    assert roofline.bound == "flops"
    assert roofline.limit_total_tok_s == pytest.approx(4 * 4097 / roofline.seconds)


def test_concurrency_splits_the_work_into_batches() -> None:
    cost = ModelCost.from_config(LLAMA_8B)
    # Two batches of one are exactly twice one request; a batch of two shares the weight reads.
    one = workload_roofline(cost, H200, 1, 128, 16)
    apart = workload_roofline(cost, H200, 2, 128, 16, concurrency=1)
    together = workload_roofline(cost, H200, 2, 128, 16)
    assert apart.seconds == pytest.approx(2 * one.seconds)
    assert together.seconds < 0.6 * apart.seconds
    assert (apart.concurrency, together.concurrency) == (1, 2)
    # A concurrency above the number of prompts is the number of prompts.
    assert workload_roofline(cost, H200, 2, 128, 16, concurrency=64).seconds == together.seconds
    with pytest.raises(ValueError, match=">= 1"):
        workload_roofline(cost, H200, 0, 128, 16)


def test_issue_workloads_say_which_limit() -> None:
    """The issue's two workloads: 1000 x (1024, 128) is prefill-dominated (256 at a time, the
    default max_num_seqs); 16 req/s of (1024, 256) with ~40 in flight is decode-dominated."""
    cost = ModelCost.from_config(LLAMA_8B)
    throughput = workload_roofline(cost, H200, 1000, 1024, 128, concurrency=256)
    assert throughput.bound == "flops"
    # The prefill's FLOPs alone take 1000 * 1024 * 2 * PARAMS / 790e12 = 20.82 s.
    assert throughput.seconds > 1000 * 1024 * 2 * PARAMS / 790e12
    serve = workload_roofline(cost, H200, 960, 1024, 256, concurrency=40)
    assert serve.bound == "bandwidth"


def test_device_table() -> None:
    assert device_limits("NVIDIA H200").bytes_per_s == 4.3e12
    assert device_limits("NVIDIA H200").flop_per_s == 790e12
    assert device_limits("NVIDIA H200 NVL").name == "NVIDIA H200 NVL"
    assert device_limits("NVIDIA H100 80GB HBM3").name == "NVIDIA H100 SXM"
    assert device_limits("NVIDIA H100 PCIe").bytes_per_s == 2.0e12
    assert device_limits("NVIDIA B200").flop_per_s == 2250e12
    assert device_limits("AMD Instinct MI300X").bytes_per_s == 5.3e12
    assert device_limits("h200") is device_limits("NVIDIA H200")  # a short name, any case
    assert device_limits("Intel(R) Xeon(R) Platinum") is None and device_limits(None) is None
    for _, limits in DEVICES:  # every figure says where it comes from
        assert limits.source and limits.bytes_per_s > 1e11 and limits.flop_per_s > 1e13


def test_cpu_probe_measures_this_machine() -> None:
    import torch

    limits = measure_cpu("this CPU", torch.float32, seconds=0.2)
    assert limits.name == "this CPU"
    assert 1e8 < limits.bytes_per_s < 1e13 and 1e8 < limits.flop_per_s < 1e14
    assert "measured at start" in limits.source and "float32" in limits.source


def test_no_roofline_says_why() -> None:
    cost = ModelCost.from_config(LLAMA_8B)
    fields, line = roofline_fields(cost, None, 1, 8, 8, 1.0)
    assert fields == {"roofline": None} and "not in kvik.bench.roofline" in line
    fields, line = roofline_fields(None, H200, 1, 8, 8, 1.0)
    assert fields == {"roofline": None} and "Llama-family" in line
    fields, line = roofline_fields(cost, H200, 1, 128, 2, 2 * 7.47394e-3)
    assert fields["roofline"]["fraction"] == pytest.approx(0.5, abs=1e-4)
    assert fields["roofline"]["bound"] == "bandwidth"
    assert "50.0% of it (decode-dominated: a share of the bandwidth limit)" in line


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> Path:
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("tiny-config")
    LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(folder)  # fmt: skip
    return folder


@pytest.mark.parametrize("command", ["throughput", "latency"])
def test_bench_commands_print_the_roofline(command, tiny_config, tmp_path, capsys) -> None:
    out = tmp_path / "result.json"
    argv = ["bench", command, "--model", str(tiny_config), "--load-format", "dummy"]
    argv += ["--dtype", "float32", "--enforce-eager", "--input-len", "8", "--output-len", "4"]
    argv += ["--output-json", str(out)]
    argv += ["--num-prompts", "2"] if command == "throughput" else ["--num-iters", "1"]
    assert main(argv) == 0
    printed = capsys.readouterr().err
    result = json.loads(out.read_text())
    roofline = result["roofline"]
    # On the CPU the device's figures are the probe's, measured at start.
    assert roofline["source"].startswith("measured at start")
    assert roofline["bound"] in ("flops", "bandwidth") and 0 < roofline["fraction"]
    hand = ModelCost.from_config(json.loads((tiny_config / "config.json").read_text()), 4)
    limits = DeviceLimits("cpu", roofline["bytes_per_s"], roofline["flop_per_s"], "")
    prompts = 2 if command == "throughput" else 1
    expected = workload_roofline(hand, limits, prompts, 8, 4)
    assert roofline["limit_output_tok_s"] == pytest.approx(expected.limit_output_tok_s, rel=1e-3)
    assert roofline["fraction"] == pytest.approx(
        result["output_tok_s"] / expected.limit_output_tok_s, rel=0.01
    )
    assert "roofline on " in printed and "% of it (" in printed
    assert "tok/s" in printed


MOE_CONFIGS = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=96),
    "olmoe": dict(num_experts=16, num_experts_per_tok=4, intermediate_size=64),
    "qwen2_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
        intermediate_size=128,
        decoder_sparse_step=2,
        mlp_only_layers=[0],
    ),
    "qwen3_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        intermediate_size=128,
        mlp_only_layers=[1],
        head_dim=16,
    ),
}


@pytest.mark.parametrize("model_type", sorted(MOE_CONFIGS))
def test_moe_parameter_count_equals_transformers(model_type) -> None:
    """Every parameter of transformers' own model of each MoE family kvik runs (built on the
    meta device), dense layers, shared experts and q/k norms included."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        **MOE_CONFIGS[model_type],
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert ModelCost.from_config(config).num_parameters == sum(
        p.numel() for p in model.parameters()
    )


def test_moe_reads_the_experts_its_tokens_touch() -> None:
    """Qwen3-30B-A3B (bench/models/qwen3-30b-a3b): 30.5 G parameters, 3.35 G active; batch 1
    reads 6.7 GB of bf16 weights (issue 16's ~650 tok/s at the H200's bandwidth), a step of
    hundreds of tokens nearly all 61 GB; FLOPs count active parameters only."""
    config = json.loads((ROOT / "bench" / "models" / "qwen3-30b-a3b" / "config.json").read_text())
    cost = ModelCost.from_config(config)
    active = cost.flop_per_token  # bf16 bytes of the active parameters: 2 a parameter
    assert cost.num_parameters == pytest.approx(30.53e9, rel=1e-3)
    assert cost.flop_per_token == pytest.approx(2 * 3.353e9, rel=1e-3)
    assert cost.weight_bytes_read(1) == pytest.approx(active, rel=1e-9)
    assert cost.weight_bytes_read(1) < cost.weight_bytes_read(8) < cost.weight_bytes_read(64)
    assert cost.weight_bytes_read(4096) == pytest.approx(cost.weight_bytes, rel=1e-9)
    expert = 3 * 2048 * 768 * 2
    assert cost.expert_bytes == expert and cost.num_moe_layers == 48
    # 8 of 128 experts a token; 2 tokens touch 128 * (1 - (120/128)^2) = 15.5 experts a layer.
    assert cost.weight_bytes_read(2) - cost.weight_bytes_read(1) == pytest.approx(
        48 * (128 * (1 - (120 / 128) ** 2) - 8) * expert
    )
    # Batch 1: the 128-token prefill reads nearly every expert (61 GB, 14 ms), then each decode
    # step the active 6.7 GB and its context's K and V.
    prefill = cost.weight_bytes_read(128) / 4.3e12
    decode = sum(
        (active + (128 + step) * cost.kv_bytes_per_token) / 4.3e12 for step in range(1, 256)
    )
    batch_one = workload_roofline(cost, H200, 1, 128, 256)
    assert batch_one.seconds == pytest.approx(prefill + decode, rel=1e-9)
    assert 600 < batch_one.limit_output_tok_s < 4.3e12 / active
    # A block-FP8 checkpoint stores its experts at a byte, the routers in bf16.
    fp8 = dict(config, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert ModelCost.from_config(fp8).expert_bytes == expert // 2


def test_deepseek_style_moe_is_not_guessed() -> None:
    config = dict(LLAMA_8B, n_routed_experts=64, num_experts_per_tok=6)
    with pytest.raises(KeyError, match="DeepSeek"):
        ModelCost.from_config(config)
