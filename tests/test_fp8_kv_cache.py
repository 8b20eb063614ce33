"""``--kv-cache-dtype fp8`` end to end on the CPU: checkpoint scales under every naming in use,
the cache's size, and greedy tokens against the same engine with a cache of the model's dtype."""

from __future__ import annotations

import inspect
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import load_hf, ragged_prompts

from kvik import LLM, SamplingParams
from kvik.attention.kv_quant import FP8_E4M3
from kvik.config import ModelConfig
from kvik.layers.attention import Attention
from kvik.model_loader.loader import load_model, load_model_config
from kvik_cpu.attention import TorchSdpaBackend
from kvik_cpu.paged_attention import CpuPagedBackend
from kvik_cpu.platform import CpuPlatform

NUM_LAYERS = 2  # tiny_models' configs


def with_tensors(source: Path, folder: Path, extra: dict[str, torch.Tensor]) -> Path:
    """A copy of the model folder ``source`` whose checkpoint also holds ``extra``."""
    shutil.copytree(source, folder)
    file = folder / "model.safetensors"
    save_file(load_file(file) | extra, file, metadata={"format": "pt"})
    return folder


def layer_scales(k: float, v: float, layer: int) -> tuple[float, float]:
    return k * (layer + 1), v * (layer + 2)


# How each tool names layer N's scales (N filled in), and which it sets.
NAMINGS = {
    "compressed-tensors": {"self_attn.k_scale": "k", "self_attn.v_scale": "v"},
    "modelopt": {"self_attn.k_proj.k_scale": "k", "self_attn.v_proj.v_scale": "v"},
    "output-scale": {"self_attn.k_proj.output_scale": "k", "self_attn.v_proj.output_scale": "v"},
    "fused-qkv": {"self_attn.qkv_proj.k_scale": "k", "self_attn.qkv_proj.v_scale": "v"},
    "vllm": {"self_attn.attn.k_scale": "k", "self_attn.attn.v_scale": "v"},
    "kv-scale": {"self_attn.kv_scale": "kv"},
}


def scale_tensors(naming: str, k: float = 0.25, v: float = 0.5) -> dict[str, torch.Tensor]:
    tensors = {}
    for n in range(NUM_LAYERS):
        ks, vs = layer_scales(k, v, n)
        for name, which in NAMINGS[naming].items():
            value = vs if which == "v" else ks
            # Tools save a scalar or a one-element vector.
            shape = () if n % 2 else (1,)
            tensors[f"model.layers.{n}.{name}"] = torch.full(shape, value, dtype=torch.float32)
    return tensors


def attention_layers(model) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def load(folder: Path, kv_cache_fp8: bool):
    config: ModelConfig = load_model_config(str(folder), dtype="float32")
    return load_model(config, "cpu", kv_cache_fp8=kv_cache_fp8)


@pytest.mark.parametrize("naming", list(NAMINGS))
def test_checkpoint_scales_reach_every_layer(tiny_model, tmp_path, naming, caplog):
    folder = with_tensors(tiny_model("llama"), tmp_path / "m", scale_tensors(naming))
    layers = attention_layers(load(folder, kv_cache_fp8=True))
    assert len(layers) == NUM_LAYERS
    for n, layer in enumerate(layers):
        k, v = layer_scales(0.25, 0.5, n)
        if naming == "kv-scale":  # one scale for both
            v = k
        assert layer.k_scale.dtype == layer.v_scale.dtype == torch.float32
        assert (float(layer.k_scale), float(layer.v_scale)) == (k, v)
    # With the model's dtype in the cache the scales load without error and are not used.
    caplog.set_level(logging.INFO, logger="kvik.model_loader.kv_scales")
    layers = attention_layers(load(folder, kv_cache_fp8=False))
    assert all(float(x.k_scale) == float(x.v_scale) == 1.0 for x in layers)
    assert "kv_cache_dtype is auto" in caplog.text


def test_the_scales_compressed_tensors_attaches_load(tiny_model, tmp_path):
    """compressed-tensors' own kv_cache_scheme puts its scales where kvik looks for them."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        apply_quantization_config,
    )

    hf = load_hf(tiny_model("llama"))
    fp8_per_tensor = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True)
    apply_quantization_config(
        hf, QuantizationConfig(config_groups={}, kv_cache_scheme=fp8_per_tensor)
    )
    scales = {k: v for k, v in hf.state_dict().items() if k.endswith(("k_scale", "v_scale"))}
    attention_forward = inspect.signature(hf.model.layers[0].self_attn.forward).parameters
    if not scales and "past_key_values" not in attention_forward:
        # compressed-tensors (0.20.1, the newest on 2026-12-05) takes for attention only a module
        # whose forward has a past_key_value(s) parameter, which transformers renamed to cache
        # after 5.17 (5.25 has cache): kv_cache_scheme then silently attaches no scales, and
        # there is nothing here to read back.
        pytest.skip("compressed-tensors attaches no KV cache scales: attention takes `cache`")
    assert len(scales) == 2 * NUM_LAYERS
    for n, name in enumerate(sorted(scales)):
        scales[name] = torch.full_like(scales[name], 0.01 * (n + 1), dtype=torch.float32)
    folder = with_tensors(tiny_model("llama"), tmp_path / "m", scales)
    for n, layer in enumerate(attention_layers(load(folder, kv_cache_fp8=True))):
        prefix = f"model.layers.{n}.self_attn."
        assert float(layer.k_scale) == float(scales[prefix + "k_scale"])
        assert float(layer.v_scale) == float(scales[prefix + "v_scale"])


def test_a_checkpoint_without_scales_gives_one(tiny_model):
    layers = attention_layers(load(tiny_model("llama"), kv_cache_fp8=True))
    assert all(float(x.k_scale) == float(x.v_scale) == 1.0 for x in layers)


@pytest.mark.parametrize(
    ("value", "message"),
    [(torch.ones(4), r"shape \(4,\).*per-tensor"), (torch.tensor(0.0), "must be positive")],
)
def test_a_bad_scale_is_a_clear_error(tiny_model, tmp_path, value, message):
    extra = {"model.layers.1.self_attn.k_scale": value}
    folder = with_tensors(tiny_model("llama"), tmp_path / "m", extra)
    with pytest.raises(ValueError, match=message):
        load(folder, kv_cache_fp8=True)


def test_attention_quantization_scales_are_read_past(tiny_model, tmp_path, caplog):
    """Query and probability scales (FP8 attention) are not kvik's to use: loaded past, logged."""
    extra = {f"model.layers.{n}.self_attn.q_scale": torch.tensor(0.5) for n in range(2)}
    folder = with_tensors(tiny_model("llama"), tmp_path / "m", extra)
    caplog.set_level(logging.INFO, logger="kvik.model_loader.kv_scales")
    load(folder, kv_cache_fp8=True)
    assert "query/probability scales" in caplog.text


@pytest.mark.parametrize(("dtype", "ratio"), [("bfloat16", 2), ("float32", 4)])
def test_an_fp8_cache_holds_more_blocks_in_the_same_memory(tiny_model, dtype, ratio):
    """One byte an element: twice the blocks of a bf16 cache, four times an fp32 one's."""
    budget = 1 << 20
    blocks = {}
    for cache_dtype in ("auto", "fp8"):
        llm = LLM(
            str(tiny_model("llama")), dtype=dtype, kv_cache_memory_bytes=budget,
            kv_cache_dtype=cache_dtype,
        )  # fmt: skip
        blocks[cache_dtype] = llm.engine.num_kv_blocks
        caches = [layer.kv_cache for layer in llm.engine.runner.attention_layers.values()]
        assert all(
            c.dtype == (FP8_E4M3 if cache_dtype == "fp8" else getattr(torch, dtype)) for c in caches
        )
    assert blocks["fp8"] == ratio * blocks["auto"]


def test_a_backend_that_cannot_store_fp8_is_passed_over_with_a_reason(tiny_model, monkeypatch):
    for backend in (CpuPagedBackend, TorchSdpaBackend):
        monkeypatch.setattr(backend, "supported_kv_cache_dtypes", ())
    with pytest.raises(ValueError, match=r"KV cache dtype torch.float8_e4m3fn not in"):
        LLM(str(tiny_model("llama")), dtype="float32", num_kv_blocks=64, kv_cache_dtype="fp8")


def test_fp8_and_fp8_e4m3_are_one_format(tiny_model):
    llm = LLM(str(tiny_model("llama")), num_kv_blocks=64, kv_cache_dtype="fp8_e4m3")
    assert llm.engine.runner.kv_cache_dtype == FP8_E4M3


def calibrated_scales(folder: Path) -> dict[str, torch.Tensor]:
    """Per-layer k and v scales as a calibration would set them: each layer's largest key and
    value on some prompts (times sqrt 2: rotation mixes a key's pairs) over e4m3's 448,
    under compressed-tensors' names."""
    hf = load_hf(folder)
    amax: dict[str, float] = {}
    hooks = []
    for n, layer in enumerate(hf.model.layers):
        for proj, scale in (("k_proj", "k_scale"), ("v_proj", "v_scale")):
            name = f"model.layers.{n}.self_attn.{scale}"

            def record(module, inputs, output, name=name) -> None:
                amax[name] = max(amax.get(name, 0.0), float(output.abs().max()))

            hooks.append(getattr(layer.self_attn, proj).register_forward_hook(record))
    with torch.no_grad():
        for prompt in ragged_prompts(6, seed=11):
            hf(torch.tensor([prompt]))
    for hook in hooks:
        hook.remove()
    return {name: torch.tensor(a * 2**0.5 / 448) for name, a in amax.items()}


#: The most an FP8 cache may move the logprob of a token both runs chose from the same context.
#: e4m3 keeps 3 mantissa bits (a relative rounding error up to 1/16 per element); on these tiny
#: random models that moves logprobs by up to about a tenth of a nat.
MAX_LOGPROB_SHIFT = 0.25


def fp8_logprob_shifts(reference, fp8_outputs) -> tuple[list[float], list[float]]:
    """How far the FP8 cache moves the logprob of each token both runs chose from the same
    context, and, where a prompt's tokens part, the reference's gap between its best two."""
    shifts, divergences = [], []
    for ref, got in zip(reference, fp8_outputs):
        ref, got = ref.outputs[0], got.outputs[0]
        for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)):
            if a != b:
                best = sorted((lp.logprob for lp in ref.logprobs[i].values()), reverse=True)
                divergences.append(best[0] - best[1])
                break
            shifts.append(abs(ref.logprobs[i][a].logprob - got.logprobs[i][a].logprob))
    return shifts, divergences


def assert_tokens_within_fp8_rounding(
    reference, fp8_outputs, max_shift: float = MAX_LOGPROB_SHIFT
) -> None:
    """Greedy tokens equal the reference's until a step where the reference's two best tokens
    are closer than twice the largest logprob shift the FP8 cache causes, which is itself small
    (measured on every step where both runs chose the same token from the same context)."""
    shifts, divergences = fp8_logprob_shifts(reference, fp8_outputs)
    largest = max(shifts)
    assert largest <= max_shift, f"the FP8 cache moves a logprob by {largest:.3f}"
    assert sum(shifts) / len(shifts) <= max_shift / 5
    for gap in divergences:
        assert gap < 2 * largest, f"diverged where the best two are {gap:.3f} apart"
    assert len(divergences) < len(reference), "no prompt kept the reference's tokens"


@pytest.mark.parametrize(
    ("kind", "backend", "dtype"),
    [
        ("llama", "CPU_PAGED", "float32"),
        ("llama", "TORCH_SDPA", "float32"),
        ("mistral", "CPU_PAGED", "float32"),  # a sliding window, GQA
        ("qwen3", "TORCH_SDPA", "float32"),
        ("llama", "CPU_PAGED", "bfloat16"),
    ],
)
def test_fp8_cache_generates_the_tokens_of_the_model_dtype_cache(
    tiny_model, tmp_path, monkeypatch, kind, backend, dtype
):
    """Calibrated per-layer scales from the checkpoint; prompts chunked so that later chunks
    read earlier chunks' FP8 keys; decodes through the backend's decode path."""
    if backend == "CPU_PAGED" and CpuPagedBackend.unsupported_reason(torch.float32, 16, 16):
        pytest.skip("CPU_PAGED is not available here")
    monkeypatch.setattr(CpuPlatform, "attention_backends", (backend,))
    source = tiny_model(kind)
    folder = with_tensors(source, tmp_path / kind, calibrated_scales(source))
    prompts = [{"prompt_token_ids": p} for p in ragged_prompts(8, seed=2)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    outputs = {}
    for cache_dtype in ("auto", "fp8"):
        llm = LLM(
            str(folder), dtype=dtype, num_kv_blocks=256, max_num_batched_tokens=32,
            kv_cache_dtype=cache_dtype,
        )  # fmt: skip
        assert llm.engine.runner.backend.name == backend
        layers = list(llm.engine.runner.attention_layers.values())
        scales = [float(layer.impl.k_scale) for layer in layers]
        assert (scales[0] != 1.0) == (cache_dtype == "fp8")  # the checkpoint's, where used
        outputs[cache_dtype] = llm.generate(prompts, params, use_tqdm=False)
    assert_tokens_within_fp8_rounding(outputs["auto"], outputs["fp8"])
