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
