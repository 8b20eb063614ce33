"""The roofline of a benchmark run: the least time the device could do the run's work in, and the
share of that limit the run reached.

The work of a request is its prefill (2 FLOPs per parameter and prompt token) and its decode steps
(each reads every weight once for the whole batch, plus each request's K and V of its context, and
does 2 FLOPs per parameter and request). Each phase takes the longer of its FLOPs at the device's
FLOP/s and its bytes at the device's bandwidth; the run is *prefill-dominated* (a share of the FLOP
limit) when the FLOP-bound phases take most of the roofline's time, else *decode-dominated* (a share
of the bandwidth limit). Attention's FLOPs and activations are left out, so the true limit is a
little lower; weights count whole, the embedding table too.

The device figures come from ``DEVICES`` (each says where its figures come from) or, for the CPU,
from a short probe run at start (``measure_cpu``). bench/run_gpu.py's limit column is computed here
too, so the two agree.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvik.config import kv_cache_torch_dtype


@dataclass(frozen=True)
class DeviceLimits:
    name: str
    bytes_per_s: float  # memory bandwidth the roofline uses
    flop_per_s: float  # dense bf16 matrix FLOP/s the roofline uses (the CPU: the model's dtype)
    source: str  # where both figures come from


#: (words that must all appear in the device's name, its limits), most specific first. The H200's
#: figures are the ones measured on the GPU machine (what the recorded limit columns used); the
#: others are the vendors' datasheet figures, dense (half the "with sparsity" ones).
DEVICES: tuple[tuple[tuple[str, ...], DeviceLimits], ...] = (
    (
        ("H200", "NVL"),
        DeviceLimits(
            "NVIDIA H200 NVL", 4.8e12, 835e12,
            "NVIDIA H200 datasheet (NVL): 4.8 TB/s HBM3e, 1,671 TFLOP/s BF16 with sparsity",
        ),
    ),
    (
        ("H200",),
        DeviceLimits(
            "NVIDIA H200", 4.3e12, 790e12,
            "measured on an nvidia-h200 machine (docs/benchmarks.md): a device-to-device copy "
            "4.28 TB/s, taken as 4.3; a bf16 8192^3 matmul 796 TFLOP/s, taken as 790 (datasheet, "
            "SXM: 4.8 TB/s, 989 TFLOP/s dense BF16)",
        ),
    ),
    (
        ("H100", "PCIe"),
        DeviceLimits(
            "NVIDIA H100 PCIe", 2.0e12, 756e12,
            "NVIDIA H100 datasheet (PCIe): 2 TB/s HBM2e, 1,513 TFLOP/s BF16 with sparsity",
        ),
    ),
    (
        ("H100", "NVL"),
        DeviceLimits(
            "NVIDIA H100 NVL", 3.9e12, 835e12,
            "NVIDIA H100 datasheet (NVL): 3.9 TB/s HBM3, 1,671 TFLOP/s BF16 with sparsity",
        ),
    ),
    (
        ("H100",),
        DeviceLimits(
            "NVIDIA H100 SXM", 3.35e12, 989e12,
            "NVIDIA H100 datasheet (SXM): 3.35 TB/s HBM3, 1,979 TFLOP/s BF16 with sparsity",
        ),
    ),
    (
        ("B200",),
        DeviceLimits(
            "NVIDIA B200", 8.0e12, 2250e12,
            "NVIDIA HGX B200 datasheet (per GPU, 1000 W): 8 TB/s HBM3e, 4,500 TFLOP/s BF16 with "
            "sparsity",
        ),
    ),
    (
        ("MI300X",),
        DeviceLimits(
            "AMD Instinct MI300X", 5.3e12, 1307.4e12,
            "AMD Instinct MI300X datasheet: 5.3 TB/s HBM3, 1,307.4 TFLOP/s BF16 dense",
        ),
    ),
)  # fmt: skip


def device_limits(device_name: str | None) -> DeviceLimits | None:
    """The table's entry for a device as torch names it ("NVIDIA H200", "NVIDIA H100 80GB HBM3",
    "AMD Instinct MI300X"), or None for a device the table does not hold."""
    if not device_name:
        return None
    words = device_name.upper()
    for needed, limits in DEVICES:
        if all(word.upper() in words for word in needed):
            return limits
    return None


def measure_cpu(name: str, dtype: Any = None, seconds: float = 0.5) -> DeviceLimits:
    """The host's memory bandwidth (the best of several copies of a 128 MiB buffer, counting the
    read and the write) and matrix FLOP/s (the best of several 1024^3 products in ``dtype``,
    default float32), on torch's threads, in about ``seconds``."""
    import torch

    dtype = dtype or torch.float32
    src = torch.ones(32 * 1024 * 1024, dtype=torch.float32)  # 128 MiB, touched once
    dst = torch.empty_like(src)
    copy_s = _best_time(lambda: dst.copy_(src), seconds / 2)
    bytes_per_s = 2 * src.numel() * src.element_size() / copy_s
    n = 1024
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    matmul_s = _best_time(lambda: torch.mm(a, b), seconds / 2)
    flop_per_s = 2 * n**3 / matmul_s
    dtype_name = str(dtype).removeprefix("torch.")
    source = (
        f"measured at start on {torch.get_num_threads()} threads: a 128 MiB copy "
        f"{bytes_per_s / 1e9:.1f} GB/s, a {dtype_name} {n}^3 matmul {flop_per_s / 1e9:.1f} GFLOP/s"
    )
    return DeviceLimits(name, bytes_per_s, flop_per_s, source)


def _best_time(work: Any, budget_s: float, min_runs: int = 3) -> float:
    """The fastest of repeated calls of ``work`` (after one warm-up), until ``budget_s`` is spent
    and at least ``min_runs`` have run."""
    work()
    best, runs, start = math.inf, 0, time.perf_counter()
    while runs < min_runs or time.perf_counter() - start < budget_s:
        t = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - t)
        runs += 1
    return best


@dataclass(frozen=True)
class ModelCost:
    """What a decoder costs per token, from its config: weights read once per step, 2 FLOPs per
    active parameter and token, and the K and V bytes a decode token reads per token of its
    context. A sparse mixture-of-experts model reads its routed experts only where a step's tokens
    go (``weight_bytes_read``); ``weight_bytes`` is every weight once."""

    num_parameters: int
    weight_bytes: int
    flop_per_token: int
    kv_bytes_per_token: int
    #: Routed experts: the bytes of one expert of one layer (its three projections), the experts
    #: of a MoE layer, how many each token uses, and the MoE layers. Zero for a dense model.
    expert_bytes: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    num_moe_layers: int = 0

    @classmethod
    def from_config(
        cls, config: Any, dtype_bytes: int = 2, kv_dtype_bytes: int | None = None
    ) -> ModelCost:
        """``config``: a config.json's dict or a transformers config (a Llama-family decoder, or
        its sparse-MoE form: Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE; Qwen3's q/k norms are counted).
        A checkpoint quantized to 8-bit weights (its ``quantization_config``) reads a byte per
        decoder-layer projection weight, experts included; embeddings, LM head, norms and routers
        stay at ``dtype_bytes``. ``kv_dtype_bytes``: the KV cache's element size (default
        ``dtype_bytes``; 1 for an FP8 cache)."""
        c = config if isinstance(config, Mapping) else config.to_dict()
        params = parameter_count(c)
        heads = c["num_attention_heads"]
        kv_heads = c.get("num_key_value_heads") or heads
        head = c.get("head_dim") or c["hidden_size"] // heads
        kv = 2 * c["num_hidden_layers"] * kv_heads * head * (kv_dtype_bytes or dtype_bytes)
        weight_bytes = params * dtype_bytes
        projection_bytes = dtype_bytes
        if quantized_weight_bits(c) == 8:
            weight_bytes -= projection_parameter_count(c) * (dtype_bytes - 1)
            projection_bytes = 1
        flop_per_token = 2 * parameter_count(c, active=True)
        moe = moe_shape(c)
        if moe is None:
            return cls(params, weight_bytes, flop_per_token, kv)
        experts, per_token, expert_size, moe_layers = moe
        expert_bytes = 3 * c["hidden_size"] * expert_size * projection_bytes
        return cls(
            params, weight_bytes, flop_per_token, kv, expert_bytes, experts, per_token, moe_layers
        )

    def weight_bytes_read(self, tokens: int) -> float:
        """The weight bytes a step of ``tokens`` tokens reads: every weight of a dense model; of a
        MoE model, the always-read part and, per MoE layer, the routed experts its tokens are
        expected to touch if routing were uniform, ``E * (1 - (1 - k / E) ** tokens)`` (k experts a
        token at batch 1, all of them within a few hundred tokens)."""
        if not self.num_experts:
            return self.weight_bytes
        unused = 1 - self.experts_per_token / self.num_experts
        untouched = self.num_experts * unused ** max(tokens, 1)
        return self.weight_bytes - self.num_moe_layers * untouched * self.expert_bytes


def moe_shape(config: Mapping[str, Any]) -> tuple[int, int, int, int] | None:
    """(routed experts a MoE layer, experts a token, an expert's intermediate size, MoE layers) of
    a sparse-MoE config, or None for a dense one. Qwen-MoE's dense layers (``mlp_only_layers``,
    ``decoder_sparse_step``) are not MoE layers; Mixtral and OLMoE size experts by
    ``intermediate_size``."""
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    if not experts:
        if config.get("n_routed_experts"):
            raise KeyError("DeepSeek-style MoE configs are not described by kvik.bench.roofline")
        return None
    size = config.get("moe_intermediate_size") or config["intermediate_size"]
    step = config.get("decoder_sparse_step") or 1
    dense = set(config.get("mlp_only_layers") or [])
    layers = sum(
        1 for i in range(config["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0
    )
    return experts, config["num_experts_per_tok"], size, layers


def quantized_weight_bits(config: Mapping[str, Any]) -> int | None:
    """The bits of a quantized checkpoint's projection weights (8 for the FP8 formats kvik
    reads), or None for an unquantized or unknown one."""
    quant = config.get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower()
    if method == "fp8" or (method == "modelopt" and "FP8" in str(quant.get("quant_algo", ""))):
        return 8
    if method == "compressed-tensors":
        bits = {
            (group.get("weights") or {}).get("num_bits")
            for group in (quant.get("config_groups") or {}).values()
        }
        return bits.pop() if len(bits) == 1 else None
    return None


def projection_parameter_count(config: Mapping[str, Any]) -> int:
    """The parameters of the decoder layers' q/k/v/o and MLP projections, every routed and shared
    expert's included (what quantization formats store in fewer bits; routers stay)."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head = config.get("head_dim") or hidden // heads
    attention = hidden * head * (2 * heads + 2 * kv_heads)
    return sum(
        attention + 3 * hidden * _mlp_width(config, layer)[0]
        for layer in range(config["num_hidden_layers"])
    )


def _mlp_width(config: Mapping[str, Any], layer: int, active: bool = False) -> tuple[int, int]:
    """(the summed intermediate size of the MLP projections of ``layer`` -- every expert's, or
    only a token's when ``active`` -- and its router's outputs, 0 for a dense layer)."""
    moe = moe_shape(config)
    dense = set(config.get("mlp_only_layers") or [])
    step = config.get("decoder_sparse_step") or 1
    if moe is None or layer in dense or (layer + 1) % step:
        return config["intermediate_size"], 0
    experts, per_token, size, _ = moe
    width = (per_token if active else experts) * size
    shared = config.get("shared_expert_intermediate_size") or 0
    return width + shared, experts + (1 if shared else 0)  # Qwen2-MoE: the shared expert's gate


def parameter_count(config: Mapping[str, Any], active: bool = False) -> int:
    """A Llama-family decoder's parameters, from its config.json: all of them, or with ``active``
    those one token uses (of a MoE layer's routed experts only ``num_experts_per_tok``)."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head = config.get("head_dim") or hidden // heads
    attention = hidden * head * (2 * heads + 2 * kv_heads)
    kind = config.get("model_type")
    if config.get("attention_bias") or kind in ("qwen2", "qwen2_moe"):  # Qwen2's q/k/v biases
        attention += head * (heads + 2 * kv_heads)
    if kind in ("qwen3", "qwen3_moe"):
        attention += 2 * head  # q_norm and k_norm, one head wide
    if kind == "olmoe":
        attention += head * (heads + kv_heads)  # q_norm and k_norm, all heads wide
    layers = 0
    for layer in range(config["num_hidden_layers"]):
        width, router = _mlp_width(config, layer, active)
        layers += attention + 3 * hidden * width + hidden * router + 2 * hidden
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return layers + embeddings + hidden


@dataclass(frozen=True)
class Roofline:
    """The least time a workload takes on a device, and how much of it is FLOP-bound."""

    device: DeviceLimits
    seconds: float
    flop_bound_seconds: float
    num_output_tokens: int
    num_total_tokens: int
    concurrency: int

    @property
    def bound(self) -> str:
        """``flops`` when the FLOP-bound phases (prefill) take most of the time, else
        ``bandwidth``."""
        return "flops" if self.flop_bound_seconds > self.seconds / 2 else "bandwidth"

    @property
    def limit_output_tok_s(self) -> float:
        return self.num_output_tokens / self.seconds

    @property
    def limit_total_tok_s(self) -> float:
        return self.num_total_tokens / self.seconds

    def fraction(self, elapsed_s: float) -> float:
        """The share of the limit a run that took ``elapsed_s`` reached."""
        return self.seconds / elapsed_s

    def to_json(self, elapsed_s: float | None = None) -> dict[str, Any]:
        result = {
            "device": self.device.name,
            "bytes_per_s": self.device.bytes_per_s,
            "flop_per_s": self.device.flop_per_s,
            "source": self.device.source,
            "bound": self.bound,
            "concurrency": self.concurrency,
            "limit_s": round(self.seconds, 6),
            "limit_output_tok_s": round(self.limit_output_tok_s, 1),
            "limit_total_tok_s": round(self.limit_total_tok_s, 1),
        }
        if elapsed_s is not None:
            result["fraction"] = float(f"{self.fraction(elapsed_s):.4g}")
        return result

    def describe(self, elapsed_s: float) -> str:
        """One line for a benchmark's report."""
        d = self.device
        kind = (
            "prefill-dominated: a share of the FLOP limit"
            if self.bound == "flops"
            else "decode-dominated: a share of the bandwidth limit"
        )
        return (
            f"roofline on {d.name} ({d.bytes_per_s / 1e12:.3g} TB/s, "
            f"{d.flop_per_s / 1e12:.4g} TFLOP/s): limit {self.limit_output_tok_s:,.1f} output "
            f"tok/s ({self.limit_total_tok_s:,.1f} total); this run "
            f"{100 * self.fraction(elapsed_s):.1f}% of it ({kind})"
        )


def workload_roofline(
    cost: ModelCost,
    device: DeviceLimits,
    num_prompts: int,
    input_len: int,
    output_len: int,
    concurrency: int | None = None,
) -> Roofline:
    """The roofline of ``num_prompts`` requests of ``input_len`` prompt tokens and ``output_len``
    output tokens, run ``concurrency`` at a time (default: all at once): each group's prefill, then
    its ``output_len - 1`` decode steps (the first output token comes with the prefill)."""
    if min(num_prompts, input_len, output_len) < 1:
        raise ValueError("num_prompts, input_len and output_len must be >= 1")
    batch = max(1, min(concurrency or num_prompts, num_prompts))
    bandwidth, flops = device.bytes_per_s, device.flop_per_s
    seconds = flop_bound = 0.0

    def phase(flop: float, read: float) -> None:
        nonlocal seconds, flop_bound
        compute_s, memory_s = flop / flops, read / bandwidth
        seconds += max(compute_s, memory_s)
        if compute_s >= memory_s:
            flop_bound += compute_s

    left = num_prompts
    while left:
        n = min(batch, left)
        left -= n
        phase(n * input_len * cost.flop_per_token, cost.weight_bytes_read(n * input_len))
        for step in range(1, output_len):
            kv_read = n * (input_len + step) * cost.kv_bytes_per_token
            phase(n * cost.flop_per_token, cost.weight_bytes_read(n) + kv_read)
    return Roofline(
        device,
        seconds,
        flop_bound,
        num_prompts * output_len,
        num_prompts * (input_len + output_len),
        batch,
    )


def across_ranks(limits: DeviceLimits, ranks: int) -> DeviceLimits:
    """The limits of ``ranks`` such devices run as one by tensor parallelism, which splits every
    weight and KV-head read and every product over them: their summed bandwidth and FLOP/s (the
    collectives counted free, so the limit stays an upper bound)."""
    if ranks == 1:
        return limits
    return replace(
        limits,
        name=f"{ranks} x {limits.name}",
        bytes_per_s=ranks * limits.bytes_per_s,
        flop_per_s=ranks * limits.flop_per_s,
    )


def engine_device_limits(llm: Any) -> DeviceLimits | None:
    """The limits of the devices an offline ``LLM`` runs on: the table's entry (times the
    tensor-parallel ranks, one device each), or for the CPU a probe run now (before the timed
    run), whose figure is the whole machine's however many ranks share it."""
    from kvik.bench.common import device_name

    platform = llm.engine.platform
    name = device_name(platform.device_type)
    if platform.device_type == "cpu":
        return measure_cpu(name, llm.config.model.dtype)
    limits = device_limits(name)
    if limits is None:
        return None
    return across_ranks(limits, llm.config.parallel.tensor_parallel_size)


def engine_model_cost(llm: Any) -> ModelCost | None:
    """The model's cost from the engine's loaded config, or None for one the formula does not
    describe (a config without a Llama-family decoder's keys)."""
    model = llm.config.model
    cache_dtype = kv_cache_torch_dtype(llm.config.cache.cache_dtype, model.dtype)
    try:
        return ModelCost.from_config(model.hf_config, model.dtype.itemsize, cache_dtype.itemsize)
    except (KeyError, TypeError, AttributeError):
        return None


def roofline_fields(
    cost: ModelCost | None,
    device: DeviceLimits | None,
    num_prompts: int,
    input_len: int,
    output_len: int,
    elapsed_s: float,
    concurrency: int | None = None,
) -> tuple[dict[str, Any], str]:
    """The ``roofline`` JSON of a run and its report line (a reason when there is none)."""
    if cost is None:
        return {"roofline": None}, "roofline: none (the model's config is not a Llama-family one)"
    if device is None:
        return {"roofline": None}, "roofline: none (the device is not in kvik.bench.roofline)"
    roofline = workload_roofline(cost, device, num_prompts, input_len, output_len, concurrency)
    return {"roofline": roofline.to_json(elapsed_s)}, roofline.describe(elapsed_s)


__all__ = [
    "DEVICES",
    "DeviceLimits",
    "ModelCost",
    "Roofline",
    "across_ranks",
    "device_limits",
    "engine_device_limits",
    "engine_model_cost",
    "measure_cpu",
    "moe_shape",
    "parameter_count",
    "roofline_fields",
    "workload_roofline",
]
