"""Independent float64 references for the FP8 checkpoint formats, and the accuracy metrics.

``ReferenceModel`` reads a quantized checkpoint's files itself (no kvik code, no quantization
library), dequantizes every FP8 weight as its format defines, and runs transformers' own
Llama/Qwen3 modelling code in float64 with each quantized linear layer's input rounded to e4m3
as the format's activation scheme says (dynamic per token group of 128, dynamic per token, or a
static per-tensor scale). Only the rounding is emulated; everything else is exact to float64,
so the emulation's error against the unquantized original is the format's own.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
#: Smallest scale a dynamic activation scale takes (an all-zero row gives zeros, never NaN).
MIN_DYNAMIC_SCALE = 1e-10
#: kvik's mean |delta logprob| may be at most this many times the reference's.
BAR = 1.5

# --- e4m3 rounding --------------------------------------------------------------------------

_E4M3_MIN_NORMAL_EXPONENT = -6
_E4M3_MANTISSA_BITS = 3


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e4m3 value, ties to even, after clamping to [-448, 448]; in x's own
    (float64) precision. torch's float64 -> float8 cast goes through float32 and so rounds twice
    on values near a tie; this does not."""
    x = x.clamp(-FP8_MAX, FP8_MAX)
    # frexp: |x| = m * 2**e with m in [0.5, 1), exactly; x's binary exponent is e - 1, its ulp
    # in e4m3 2**(e - 1 - 3). Subnormals share the smallest normal exponent's ulp.
    _, exponent = torch.frexp(x)
    minimum = _E4M3_MIN_NORMAL_EXPONENT + 1
    ulp = torch.exp2(exponent.clamp_(min=minimum).sub_(1 + _E4M3_MANTISSA_BITS).to(x.dtype))
    return x.div(ulp).round_().mul_(ulp)  # round() is half to even; x / ulp is exact


def fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x rounded through e4m3 with ``scale`` (broadcast against x): round(x / s) * s."""
    return round_to_e4m3(x / scale) * scale


def dynamic_scale(x: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """Per-token (``group_size`` None) or per-token-group activation scales, broadcastable
    against x (or against x viewed as groups)."""
    if group_size is None:
        return (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_DYNAMIC_SCALE)
    groups = x.unflatten(-1, (-1, group_size))
    return (groups.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_DYNAMIC_SCALE)


@dataclass(frozen=True)
class ActivationScheme:
    """How a quantized linear layer rounds its input: ``dynamic`` per token (``group_size``
    None) or per token group, else static with ``input_scale``."""

    dynamic: bool
    group_size: int | None = None
    input_scale: float | None = None

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if not self.dynamic:
            return fake_quantize(x, torch.tensor(self.input_scale, dtype=x.dtype))
        if self.group_size is None:
            return fake_quantize(x, dynamic_scale(x, None))
        if x.shape[-1] % self.group_size:
            raise ValueError(f"input width {x.shape[-1]} is not a multiple of {self.group_size}")
        groups = x.unflatten(-1, (-1, self.group_size))
        return fake_quantize(groups, dynamic_scale(x, self.group_size)).flatten(-2)


# --- reading a checkpoint in each format ----------------------------------------------------


@dataclass
class QuantizedLayer:
    dense_weight: torch.Tensor  # float64, dequantized
    activations: ActivationScheme


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    if not tensors:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    return tensors


def _block_scales_to_weight_grid(scale: torch.Tensor, shape, block) -> torch.Tensor:
    n, k = shape
    bn, bk = block
    expected = (-(-n // bn), -(-k // bk))
    if tuple(scale.shape) != expected:
        raise ValueError(f"block scales of shape {tuple(scale.shape)} for a {n}x{k} weight; expected {expected}")  # fmt: skip
    return scale.double().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def _hf_block_layers(tensors, qc) -> dict[str, QuantizedLayer]:
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise NotImplementedError("static activations in fine-grained FP8 are not emulated")
    block = tuple(qc["weight_block_size"])
    layers = {}
    for key in [k for k in tensors if k.endswith(".weight_scale_inv")]:
        module = key.removesuffix(".weight_scale_inv")
        q = tensors.pop(f"{module}.weight")
        grid = _block_scales_to_weight_grid(tensors.pop(key), q.shape, block)
        layers[module] = QuantizedLayer(q.double() * grid, ActivationScheme(True, block[1]))
    return layers


def _compressed_tensors_layers(tensors, qc) -> dict[str, QuantizedLayer]:
    if qc.get("format") != "float-quantized":
        raise NotImplementedError(f"compressed-tensors format {qc.get('format')!r} is not emulated")
    (group,) = qc["config_groups"].values()
    weights, inputs = group["weights"], group["input_activations"]
    if weights["num_bits"] != 8 or weights["type"] != "float" or not weights["symmetric"]:
        raise NotImplementedError(f"weights {weights} are not FP8")
    if weights["strategy"] not in ("tensor", "channel"):
        raise NotImplementedError(f"weight strategy {weights['strategy']!r} is not emulated")
    layers = {}
    for key in [k for k in tensors if k.endswith(".weight_scale")]:
        module = key.removesuffix(".weight_scale")
        q = tensors.pop(f"{module}.weight")
        scale = tensors.pop(key).double()
        if inputs["dynamic"]:
            if inputs["strategy"] != "token":
                raise NotImplementedError(f"dynamic {inputs['strategy']} activations")
            activations = ActivationScheme(True)
        else:
            activations = ActivationScheme(False, input_scale=float(tensors.pop(f"{module}.input_scale")))  # fmt: skip
        layers[module] = QuantizedLayer(q.double() * scale.reshape(-1, 1), activations)
    return layers


def _modelopt_layers(tensors, qc) -> dict[str, QuantizedLayer]:
    if qc.get("quant_algo") != "FP8":
        raise NotImplementedError(f"ModelOpt quant_algo {qc.get('quant_algo')!r} is not emulated")
    layers = {}
    for key in [k for k in tensors if k.endswith(".weight_scale")]:
        module = key.removesuffix(".weight_scale")
        q = tensors.pop(f"{module}.weight")
        scale = tensors.pop(key).double()
        input_scale = float(tensors.pop(f"{module}.input_scale"))
        layers[module] = QuantizedLayer(q.double() * scale, ActivationScheme(False, input_scale=input_scale))  # fmt: skip
    return layers


_READERS = {
    "fp8": _hf_block_layers,
    "compressed-tensors": _compressed_tensors_layers,
    "modelopt": _modelopt_layers,
}


def read_checkpoint(folder: Path):
    """(config without its quantization_config, dense tensors, quantized layers by module name).
    For an unquantized checkpoint the last is empty."""
    from transformers import AutoConfig

    raw = json.loads((folder / "config.json").read_text())
    qc = raw.get("quantization_config")
    config = AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    tensors = _read_tensors(folder)
    layers = {}
    if qc is not None:
        method = qc.get("quant_method")
        if method not in _READERS:
            raise NotImplementedError(f"quant_method {method!r} has no emulation")
        layers = _READERS[method](tensors, qc)
    leftover = [k for k, v in tensors.items() if v.dtype == FP8 or "scale" in k]
    if leftover:
        raise ValueError(f"tensors the {qc and qc.get('quant_method')} reader did not consume: {leftover[:5]}")  # fmt: skip
    return config, tensors, layers


class ReferenceModel:
    """transformers' model of the checkpoint's architecture in float64, FP8 weights dequantized,
    FP8 activation rounding emulated (``round_activations=False``: weights only). On an
    unquantized checkpoint: the original in float64."""

    def __init__(self, folder: Path, round_activations: bool = True) -> None:
        from transformers import AutoModelForCausalLM

        config, tensors, layers = read_checkpoint(Path(folder))
        # Eager experts: transformers' grouped-GEMM experts take no float64.
        extra = {"experts_implementation": "eager"} if hasattr(config, "num_experts") else {}
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float64, attn_implementation="eager", **extra
        )
        state = {k: v.double() for k, v in tensors.items()}
        state.update({f"{name}.weight": layer.dense_weight for name, layer in layers.items()})
        expert_schemes = stack_experts(state, layers)
        missing, unexpected = model.load_state_dict(state, strict=False)
        # Tied or derived buffers (rotary inv_freq) may be absent; no weight may be.
        if unexpected or [m for m in missing if m.endswith("weight")]:
            raise ValueError(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")  # fmt: skip
        if round_activations:
            for name, layer in layers.items():
                model.get_submodule(name).register_forward_pre_hook(
                    lambda _m, args, scheme=layer.activations: (scheme.apply(args[0]),)
                )
            for name, scheme in expert_schemes.items():
                experts = model.get_submodule(name)
                experts.forward = _rounding_experts_forward(experts, scheme)
        self.model = model.eval()
        self.layers = layers

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids).logits


_PER_EXPERT = re.compile(r"^(?P<experts>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)$")  # fmt: skip


def stack_experts(
    state: dict[str, torch.Tensor], layers: dict[str, QuantizedLayer]
) -> dict[str, ActivationScheme]:
    """Per-expert weights (``<experts>.N.gate_proj.weight`` ..., dense or dequantized) in
    ``state`` -> transformers' stacked ``<experts>.gate_up_proj`` [E, 2I, H] and ``down_proj``
    [E, H, I]. The quantized experts leave ``layers``; returns each quantized experts module's
    activation scheme (one per module: a checkpoint rounds all its experts alike)."""
    per_module: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for key in list(state):
        match = _PER_EXPERT.match(key.removesuffix(".weight"))
        if key.endswith(".weight") and match:
            part = (int(match["expert"]), match["proj"])
            per_module.setdefault(match["experts"], {})[part] = state.pop(key)
    schemes = {}
    for experts, parts in per_module.items():
        count = len(parts) // 3
        if set(parts) != {(e, p) for e in range(count) for p in ("gate_proj", "up_proj", "down_proj")}:  # fmt: skip
            raise ValueError(f"{experts}: the checkpoint's experts are incomplete")
        state[f"{experts}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[e, "gate_proj"], parts[e, "up_proj"]]) for e in range(count)]
        )
        state[f"{experts}.down_proj"] = torch.stack([parts[e, "down_proj"] for e in range(count)])
        quantized = [layers.pop(f"{experts}.{e}.{p}", None) for e, p in parts]
        if None in quantized and any(quantized):
            raise ValueError(f"{experts}: some experts are quantized and some are not")
        if None not in quantized:
            (scheme,) = {layer.activations for layer in quantized}
            schemes[experts] = scheme
    return schemes


def _rounding_experts_forward(experts: torch.nn.Module, scheme: ActivationScheme):
    """transformers' experts forward (each token through its top-k experts, weighted, summed)
    with the input of both of each expert's products rounded as ``scheme`` says."""

    def forward(hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in range(experts.gate_up_proj.shape[0]):
            token, k = torch.where(top_k_index == e)
            if token.numel() == 0:
                continue
            gate, up = F.linear(scheme.apply(hidden[token]), experts.gate_up_proj[e]).chunk(2, -1)
            act = scheme.apply(experts.act_fn(gate) * up)
            y = F.linear(act, experts.down_proj[e]) * top_k_weights[token, k, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    return forward


class TransformersModel:
    """A checkpoint as transformers' own loader runs it, in fp32 on the CPU: for
    compressed-tensors its quantizer decompresses the weights and compressed-tensors' forward
    rounds each input through FP8 as the scheme says (the format's library as the reference);
    fine-grained FP8 a CPU runs as dequantized weights only."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        self.logits(torch.tensor([[3, 4, 5]]))  # compressed-tensors decompresses on the first call

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids).logits


def independent_reference(folder: Path) -> ReferenceModel | TransformersModel:
    """The reference the accuracy bar is measured against: transformers' own loader where it
    runs the format with its activation rounding on a CPU (compressed-tensors), else the float64
    emulation (fine-grained FP8, whose CPU path in transformers skips activation rounding, and
    ModelOpt, which transformers does not read)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    if config["quantization_config"]["quant_method"] == "compressed-tensors":
        return TransformersModel(folder)
    return ReferenceModel(folder)


# --- metrics --------------------------------------------------------------------------------


@torch.no_grad()
def teacher_forced_logprobs(model, sequences: torch.Tensor) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) for every position of every sequence: [n, length - 1]."""
    logprobs = model.logits(sequences).double().log_softmax(-1)
    return logprobs[:, :-1].gather(-1, sequences[:, 1:, None]).squeeze(-1)


def scored_sequences(count: int = 4, length: int = 128, seed: int = 7, vocab: int = 256):
    """The fixed token sequences the accuracy tests score (ids 0-2 are special and left out)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=g)


#: Greedy prompts: a few short random prompts, continued for GREEDY_TOKENS tokens.
GREEDY_PROMPTS = [
    torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(60 + i)).tolist()
    for i, n in enumerate((7, 12, 19, 26))
]
GREEDY_TOKENS = 16


def mean_abs_delta(logprobs: torch.Tensor, original: torch.Tensor) -> float:
    return float((logprobs.double() - original.double()).abs().mean())


@torch.no_grad()
def greedy(
    model: ReferenceModel | TransformersModel, prompt: list[int], max_new_tokens: int
) -> list[int]:
    """The reference's greedy continuation, one token a step through transformers' KV cache
    (every activation scale is per token or static, so that is exactly the full recomputation)."""
    from transformers import DynamicCache

    from kvik.spec_decode.eagle3_eval import cache_kwargs

    cache = cache_kwargs(model.model, DynamicCache())  # the cache argument's name by release
    out = model.model(torch.tensor([prompt]), **cache)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < max_new_tokens:
        out = model.model(torch.tensor([tokens[-1:]]), **cache)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@torch.no_grad()
def greedy_disagreement(
    model, prompt: list[int], expected: list[int], got: list[int], tolerance: float
) -> str | None:
    """None when ``got`` (another implementation's greedy tokens) agrees with ``expected`` (the
    reference's), or diverges only at a near-tie: where the reference scores the token ``got``
    chose less than ``tolerance`` below its own choice. Else what went wrong."""
    if len(got) != len(expected):
        return f"{len(got)} tokens, expected {len(expected)}"
    if got == expected:
        return None
    i = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
    logprobs = model.logits(torch.tensor([prompt + expected[:i]]))[0, -1].double().log_softmax(-1)
    gap = float(logprobs[expected[i]] - logprobs[got[i]])
    if gap < tolerance:
        return None
    rank = int((logprobs > logprobs[got[i]]).sum()) + 1
    return (
        f"diverges at output {i}: {got[i]} (the reference's choice number {rank}) against the "
        f"reference's {expected[i]}, {gap:.4f} apart in logprob, not a near-tie (below "
        f"{tolerance:.4f})"
    )
