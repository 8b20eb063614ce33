"""Small random-weight Llama and Qwen3 checkpoints, quantized to FP8 in each format kvik reads.

Each format is written by its own library where one exists: Hugging Face fine-grained FP8 with
transformers' own block quantizer (``Fp8Quantize``, what ``save_pretrained`` of an FP8 model
runs), compressed-tensors with the compressed-tensors library (scheme presets,
``apply_quantization_config``, ``calculate_qparams``, ``ModelCompressor``). NVIDIA ModelOpt has
no CPU library here, so its documented layout is written directly.

The originals are random, but not i.i.d.: every 128 x 128 block of every linear weight, and
every output row, gets its own magnitude (a power of two drawn per block and a smaller factor
per row), and the shards of each fused projection overall scales four times apart. With i.i.d. weights all block and shard
scales come out nearly equal, so a loader that transposes block scales or swaps the scales of
two fused shards would compute almost the right thing and no accuracy test could catch it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
MODEL_KINDS = ("llama", "qwen3", "qwen3moe")

#: Dims are multiples of 128 so every projection, and every shard of the fused q/k/v and
#: gate/up projections, is a whole number of 128 x 128 weight blocks.
_COMMON = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
    initializer_range=0.06,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
#: The projections each format quantizes; the embeddings, norms and lm_head stay unquantized.
QUANTIZED_PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
#: Each original is saved in the dtype real checkpoints of its family ship in: Llama in fp32,
#: Qwen3 in bf16 (so compressed-tensors writes bf16 scales for it, as it does for real models).
ORIGINAL_DTYPES = {"llama": torch.float32, "qwen3": torch.bfloat16, "qwen3moe": torch.bfloat16}


#: The mixture of experts: Qwen3-30B-A3B's layout (renormalised top-k, q/k norms) at a small
#: size whose experts are whole 128 x 128 blocks.
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True)


def original_config(kind: str):
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    if kind == "llama":
        return LlamaConfig(**_COMMON, rope_theta=10000.0)
    if kind == "qwen3":
        return Qwen3Config(**_COMMON, rope_theta=1000000.0)
    if kind == "qwen3moe":
        return Qwen3MoeConfig(**_COMMON, **_MOE, rope_theta=1000000.0)
    raise ValueError(f"unknown model kind {kind!r}; expected one of {MODEL_KINDS}")


def is_quantized_projection(name: str) -> bool:
    """Whether ``name`` (a module name) is a linear layer the FP8 formats quantize."""
    return name.rsplit(".", 1)[-1] in QUANTIZED_PROJECTIONS and ".layers." in f".{name}"


#: Each projection's overall weight scale: the shards of each fused layer (q/k/v, gate/up)
#: four times apart, so that a per-tensor scale in the wrong shard is a large error.
_PROJECTION_SCALES = {"q_proj": 1.0, "k_proj": 2.0, "v_proj": 0.5, "o_proj": 1.0, "gate_proj": 2.0, "up_proj": 0.5, "down_proj": 1.0}  # fmt: skip


def _block_magnitudes(w: torch.Tensor, overall: float, generator: torch.Generator) -> None:
    n, k = w.shape
    blocks = 2.0 ** torch.empty(n // BLOCK, k // BLOCK).uniform_(-1.5, 1.5, generator=generator)
    rows = 2.0 ** torch.empty(n, 1).uniform_(-0.5, 0.5, generator=generator)
    grid = blocks.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    w.mul_(grid * rows * overall)


@torch.no_grad()
def _give_blocks_distinct_magnitudes(model: torch.nn.Module, generator: torch.Generator) -> None:
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and is_quantized_projection(name):
            overall = _PROJECTION_SCALES[name.rsplit(".", 1)[-1]]
            _block_magnitudes(module.weight, overall, generator)
        elif name.endswith(".mlp.experts"):  # transformers' stacked experts
            half = module.gate_up_proj.shape[1] // 2
            for e in range(module.gate_up_proj.shape[0]):
                _block_magnitudes(module.gate_up_proj[e, :half], _PROJECTION_SCALES["gate_proj"], generator)  # fmt: skip
                _block_magnitudes(module.gate_up_proj[e, half:], _PROJECTION_SCALES["up_proj"], generator)  # fmt: skip
                _block_magnitudes(module.down_proj[e], _PROJECTION_SCALES["down_proj"], generator)


def build_original(kind: str, folder: Path, seed: int = 0) -> Path:
    """Save a random-weight ``kind`` model ('llama' or 'qwen3') with transformers' save_pretrained."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(original_config(kind), dtype=torch.float32)
    _give_blocks_distinct_magnitudes(model, torch.Generator().manual_seed(seed + 1))
    model.to(ORIGINAL_DTYPES[kind]).save_pretrained(folder)
    return folder


def calibration_sequences(count: int = 4, length: int = 96, seed: int = 100) -> torch.Tensor:
    """Random token ids for calibrating static activation scales (never the test sequences)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, _COMMON["vocab_size"], (count, length), generator=g)


@torch.no_grad()
def calibrate_input_absmax(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The largest |input| each quantized projection sees on the calibration sequences, as the
    static-range observers of llm-compressor and ModelOpt record it."""
    absmax: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and is_quantized_projection(name):

            def record(_module, args, name=name):
                seen = args[0].detach().abs().amax().float()
                absmax[name] = torch.maximum(absmax.get(name, seen), seen)

            hooks.append(module.register_forward_pre_hook(record))
    try:
        model(calibration_sequences())
    finally:
        for hook in hooks:
            hook.remove()
    return absmax


def _load_original_state(original: Path) -> dict[str, torch.Tensor]:
    """The original's tensors, stacked experts (``experts.gate_up_proj`` [E, 2I, H], as
    transformers 5 may save them) split per expert (``experts.N.gate_proj.weight``), the layout
    FP8 MoE releases (Qwen3-30B-A3B-FP8) ship."""
    files = sorted(original.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {original}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    for key in [k for k in state if k.endswith(".experts.gate_up_proj")]:
        experts = key.removesuffix(".gate_up_proj")
        gate_up, down = state.pop(key), state.pop(f"{experts}.down_proj")
        for e in range(gate_up.shape[0]):
            gate, up = gate_up[e].chunk(2)
            state[f"{experts}.{e}.gate_proj.weight"] = gate
            state[f"{experts}.{e}.up_proj.weight"] = up
            state[f"{experts}.{e}.down_proj.weight"] = down[e]
    return state


def _write_checkpoint(
    original: Path, folder: Path, tensors: dict[str, torch.Tensor], quantization_config: dict
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((original / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if (original / "generation_config.json").exists():
        shutil.copy(original / "generation_config.json", folder / "generation_config.json")
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    return folder


# --- Hugging Face fine-grained FP8 ----------------------------------------------------------

#: The ``quantization_config`` Qwen's own FP8 releases (Qwen3-*-FP8) ship: the minimal form.
QWEN_FP8_RELEASE_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [BLOCK, BLOCK],
}


def make_hf_block_fp8(original: Path, folder: Path, config_style: str = "transformers") -> Path:
    """128 x 128 block FP8 weights with ``weight_scale_inv``, dynamic activations, the lm_head
    unquantized. ``config_style``: 'transformers' writes ``FineGrainedFP8Config``'s own
    serialization, 'qwen-release' the minimal dict Qwen's FP8 releases carry."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    fp8_config = FineGrainedFP8Config(
        activation_scheme="dynamic",
        weight_block_size=(BLOCK, BLOCK),
        modules_to_not_convert=["lm_head"],
    )
    quantize = Fp8Quantize(FineGrainedFP8HfQuantizer(fp8_config))
    tensors: dict[str, torch.Tensor] = {}
    for key, value in _load_original_state(original).items():
        if key.endswith(".weight") and is_quantized_projection(key.removesuffix(".weight")):
            tensors.update(quantize.convert({key: value}))
        else:
            tensors[key] = value
    if config_style == "transformers":
        quantization_config = json.loads(fp8_config.to_json_string())
    elif config_style == "qwen-release":
        quantization_config = dict(QWEN_FP8_RELEASE_CONFIG)
    else:
        raise ValueError(f"unknown config_style {config_style!r}")
    return _write_checkpoint(original, folder, tensors, quantization_config)


# --- compressed-tensors ---------------------------------------------------------------------

#: compressed-tensors' preset schemes: per-tensor weights with a static per-tensor activation
#: scale, and per-channel weights with dynamic per-token activations.
COMPRESSED_TENSORS_PRESETS = ("FP8", "FP8_DYNAMIC")


def _weight_ranges(weight: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The min and max an observer reports for ``weight`` under ``strategy``."""
    w = weight.detach().float()
    if strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if strategy == "channel":
        return w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    raise ValueError(f"no weight observer here for strategy {strategy!r}")


@torch.no_grad()
def make_compressed_tensors_fp8(
    original: Path, folder: Path, preset: str, max_shard_size: str | None = None
) -> Path:
    """Quantize with compressed-tensors' ``preset`` scheme ('FP8' or 'FP8_DYNAMIC') on every
    Linear but the lm_head, and save as ``float-quantized`` the way llm-compressor does:
    ``ModelCompressor.compress_model``, ``save_pretrained``, ``update_config``.

    The scales are compressed-tensors' own ``calculate_qparams`` of the ranges an observer
    would report (observers are llm-compressor's, which is not installed here): the weight's
    min/max per tensor or per output channel, and for static activations the largest |input|
    on the calibration sequences."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    if preset not in COMPRESSED_TENSORS_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {COMPRESSED_TENSORS_PRESETS}")
    model = AutoModelForCausalLM.from_pretrained(original, dtype="auto").eval()
    input_absmax = calibrate_input_absmax(model)
    config = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, ignore=["lm_head"]
    )
    apply_quantization_config(model, config)
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        if not is_quantized_projection(name):
            raise AssertionError(f"compressed-tensors quantized an unexpected module {name}")
        low, high = _weight_ranges(module.weight, scheme.weights.strategy)
        scale, _ = calculate_qparams(low, high, scheme.weights)
        module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
        activations = scheme.input_activations
        if activations is not None and not activations.dynamic:
            amax = input_absmax[name].reshape(1)
            scale, _ = calculate_qparams(-amax, amax, activations)
            module.input_scale.copy_(scale.reshape(module.input_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    compressor.update_config(str(folder))
    return folder


# --- NVIDIA ModelOpt ------------------------------------------------------------------------

#: ModelOpt's FP8 export: per-tensor e4m3 weights, a 0-dim fp32 ``weight_scale`` and a 0-dim
#: fp32 static ``input_scale`` per projection (q, k, v and gate, up each their own), the
#: lm_head excluded; config.json's ``quantization_config`` in the llm-compressor-like form the
#: exporter writes, and ``hf_quant_config.json`` in ModelOpt's own form.
MODELOPT_PRODUCER = {"name": "modelopt", "version": "0.29.0"}


def _per_tensor_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.float()
    scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-12)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@torch.no_grad()
def make_modelopt_fp8(original: Path, folder: Path) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(original, dtype="auto").eval()
    input_absmax = calibrate_input_absmax(model)
    tensors: dict[str, torch.Tensor] = {}
    for key, value in _load_original_state(original).items():
        module = key.removesuffix(".weight")
        if key.endswith(".weight") and is_quantized_projection(module):
            weight, scale = _per_tensor_fp8(value)
            tensors[key] = weight
            tensors[f"{module}.weight_scale"] = scale.reshape(())
            tensors[f"{module}.input_scale"] = (input_absmax[module] / FP8_MAX).reshape(())
        else:
            tensors[key] = value
    group = {"dynamic": False, "num_bits": 8, "type": "float"}
    quantization_config = {
        "quant_method": "modelopt",
        "quant_algo": "FP8",
        "config_groups": {
            "group_0": {"input_activations": group, "weights": group, "targets": ["Linear"]}
        },
        "ignore": ["lm_head"],
        "producer": MODELOPT_PRODUCER,
    }
    _write_checkpoint(original, folder, tensors, quantization_config)
    hf_quant_config = {
        "producer": MODELOPT_PRODUCER,
        "quantization": {
            "quant_algo": "FP8",
            "kv_cache_quant_algo": None,
            "exclude_modules": ["lm_head"],
        },
    }
    (folder / "hf_quant_config.json").write_text(json.dumps(hf_quant_config, indent=2))
    return folder


# --- every format by name -------------------------------------------------------------------

#: format name -> (model kind, maker(original folder, output folder)).
FORMATS: dict[str, tuple[str, Callable[[Path, Path], Path]]] = {
    "hf-block-llama": ("llama", make_hf_block_fp8),
    "hf-block-qwen3": ("qwen3", lambda o, f: make_hf_block_fp8(o, f, "qwen-release")),
    "ct-tensor-static-llama": (
        "llama",
        # Sharded, as large releases are: the index file and scales apart from their weights.
        lambda o, f: make_compressed_tensors_fp8(o, f, "FP8", max_shard_size="600KB"),
    ),
    "ct-channel-dynamic-qwen3": (
        "qwen3",
        lambda o, f: make_compressed_tensors_fp8(o, f, "FP8_DYNAMIC"),
    ),
    "modelopt-tensor-llama": ("llama", make_modelopt_fp8),
}
#: The mixture-of-experts formats (their own tests: test_fp8_moe.py), by the same rules.
MOE_FORMATS: dict[str, tuple[str, Callable[[Path, Path], Path]]] = {
    # Qwen3-30B-A3B-FP8's layout: per-expert block-FP8 projections, the routers unquantized.
    "hf-block-qwen3moe": ("qwen3moe", lambda o, f: make_hf_block_fp8(o, f, "qwen-release")),
}
ALL_FORMATS = {**FORMATS, **MOE_FORMATS}


# --- planted bugs ---------------------------------------------------------------------------


def _rewrite_tensors(
    src: Path, dst: Path, change: Callable[[dict[str, torch.Tensor]], None]
) -> Path:
    """Copy checkpoint ``src`` to ``dst`` with ``change`` applied to its tensors (in memory,
    file by file, so a sharded checkpoint keeps its index)."""
    shutil.copytree(src, dst)
    tensors = {}
    files = sorted(dst.glob("*.safetensors"))
    owner = {}
    for file in files:
        for key, value in load_file(file).items():
            tensors[key] = value
            owner[key] = file
    change(tensors)
    for file in files:
        part = {k: v.contiguous() for k, v in tensors.items() if owner[k] == file}
        save_file(part, file, metadata={"format": "pt"})
    return dst


def plant_transposed_block_scales(src: Path, dst: Path) -> Path:
    """Every ``weight_scale_inv`` grid read as if stored transposed: what a loader that indexes
    it ``[k_block, n_block]`` computes (same shape, the grid's elements in transposed order)."""

    def change(tensors):
        for key in [k for k in tensors if k.endswith(".weight_scale_inv")]:
            scale = tensors[key]
            tensors[key] = scale.t().contiguous().reshape(scale.shape)

    return _rewrite_tensors(src, dst, change)


def plant_swapped_shard_scales(src: Path, dst: Path, scale_name: str = "weight_scale") -> Path:
    """The ``scale_name`` of k_proj and v_proj swapped, and of gate_proj and up_proj: a loader
    that puts a fused layer's per-shard scales in the wrong shard."""

    def change(tensors):
        pairs = [("self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")]
        prefixes = {k.rsplit(".self_attn.", 1)[0] for k in tensors if ".self_attn." in k}
        for prefix in prefixes:
            for a, b in pairs:
                ka, kb = f"{prefix}.{a}.{scale_name}", f"{prefix}.{b}.{scale_name}"
                if ka not in tensors or kb not in tensors:
                    raise KeyError(f"{ka} or {kb} not in the checkpoint")
                if tensors[ka].shape != tensors[kb].shape:
                    raise ValueError(f"{ka} and {kb} differ in shape; swapping is no planted bug")
                tensors[ka], tensors[kb] = tensors[kb], tensors[ka]

    return _rewrite_tensors(src, dst, change)


def plant_transposed_expert_block_scales(src: Path, dst: Path) -> Path:
    """As ``plant_transposed_block_scales``, on the experts' scales only: a MoE loader or kernel
    that indexes an expert's tile scales ``[k_block, n_block]``."""

    def change(tensors):
        for key in [k for k in tensors if ".experts." in k and k.endswith(".weight_scale_inv")]:
            scale = tensors[key]
            tensors[key] = scale.t().contiguous().reshape(scale.shape)

    return _rewrite_tensors(src, dst, change)


#: bug name -> (the format it is planted in, planter(clean folder, output folder)).
PLANTED_BUGS: dict[str, tuple[str, Callable[[Path, Path], Path]]] = {
    "block-scales-transposed": ("hf-block-llama", plant_transposed_block_scales),
    "per-tensor-shard-scales-swapped": ("ct-tensor-static-llama", plant_swapped_shard_scales),
    "per-channel-shard-scales-swapped": ("ct-channel-dynamic-qwen3", plant_swapped_shard_scales),
    # Not the input scales: the shards of a fused layer share their input, and so its scale.
    "modelopt-shard-scales-swapped": ("modelopt-tensor-llama", plant_swapped_shard_scales),
}

MOE_PLANTED_BUGS: dict[str, tuple[str, Callable[[Path, Path], Path]]] = {
    "expert-block-scales-transposed": ("hf-block-qwen3moe", plant_transposed_expert_block_scales),
}
ALL_PLANTED_BUGS = {**PLANTED_BUGS, **MOE_PLANTED_BUGS}
