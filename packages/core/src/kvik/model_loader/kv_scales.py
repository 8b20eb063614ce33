"""The KV cache scales of a checkpoint: found among its weights and set on the attention layers.

Checkpoints quantized for an FP8 KV cache carry, per layer, a key scale and a value scale (fp32,
one element each). Their names differ by the tool that made them; relative to the attention block
(``model.layers.N.self_attn``, the parent module of kvik's ``Attention``):

- ``k_scale``, ``v_scale``: compressed-tensors' ``kv_cache_scheme`` (llm-compressor), transformers;
- ``k_proj.k_scale``, ``v_proj.v_scale``: NVIDIA ModelOpt;
- ``k_proj.output_scale``, ``v_proj.output_scale``: older compressed-tensors and Quark, which
  quantized the outputs of the k and v projections;
- ``qkv_proj.k_scale``, ``qkv_proj.v_scale``: checkpoints saved with a fused qkv projection;
- ``attn.k_scale``, ``attn.v_scale``: vLLM's own module names;
- ``kv_scale``: older checkpoints, one scale for both.

``q_scale``, ``prob_scale`` (and ``q_proj.output_scale``) quantize queries and attention
probabilities for FP8 attention; kvik keeps those in the model's dtype, so they are read past.

The loader passes the checkpoint's weights through ``take_kv_scales``, which keeps these out of
the model's ``load_weights`` (no model declares them) and, when the KV cache is FP8, copies them
into the ``k_scale`` and ``v_scale`` buffers of the layer they name. With ``kv_cache_dtype`` auto
they are ignored, said once in the log.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator

from torch import Tensor, nn

from kvik.layers.attention import Attention
from kvik.model_loader.weight_slice import CheckpointSlice, materialize

logger = logging.getLogger(__name__)

#: Name within the attention block -> the scales it sets.
_KV_SCALE_SUFFIXES: dict[str, tuple[str, ...]] = {
    "k_scale": ("k_scale",),
    "v_scale": ("v_scale",),
    "k_proj.k_scale": ("k_scale",),
    "v_proj.v_scale": ("v_scale",),
    "k_proj.output_scale": ("k_scale",),
    "v_proj.output_scale": ("v_scale",),
    "qkv_proj.k_scale": ("k_scale",),
    "qkv_proj.v_scale": ("v_scale",),
    "kv_scale": ("k_scale", "v_scale"),
}
#: Attention-quantization scales kvik has no use for (queries and probabilities stay unquantized).
_UNUSED_SUFFIXES = ("q_scale", "prob_scale", "q_proj.output_scale", "qkv_proj.q_scale")


def _attention_blocks(model: nn.Module) -> dict[str, tuple[Attention, str]]:
    """Attention block path -> (its Attention layer, the layer's name within the block)."""
    blocks = {}
    for path, module in model.named_modules():
        if isinstance(module, Attention):
            parent, _, own = path.rpartition(".")
            blocks[parent] = (module, own)
    return blocks


def _split(name: str, blocks: dict[str, tuple[Attention, str]]) -> tuple[str, str] | None:
    """(attention block path, the rest of ``name``) where ``name`` lies in an attention block."""
    block = name
    while "." in block:
        block = block.rpartition(".")[0]
        if block in blocks:
            return block, name[len(block) + 1 :]
    return None


def _scale_value(name: str, tensor: Tensor | CheckpointSlice) -> float:
    if tensor.numel() != 1:
        raise ValueError(
            f"checkpoint KV cache scale {name!r} has shape {tuple(tensor.shape)}; kvik reads one "
            "scale per layer (per-tensor), not per head or per channel"
        )
    value = float(materialize(tensor).float().reshape(()))
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"checkpoint KV cache scale {name!r} is {value}: it must be positive")
    return value


def take_kv_scales(
    model: nn.Module, weights: Iterable[tuple[str, Tensor]], use_scales: bool
) -> Iterator[tuple[str, Tensor]]:
    """``weights`` without the KV cache scales, which are set on ``model``'s attention layers
    where ``use_scales`` (the KV cache is FP8) and otherwise ignored."""
    blocks = _attention_blocks(model)
    found = {"k_scale": 0, "v_scale": 0}  # layers each was read for
    unused_kv: list[str] = []  # KV scales under kv_cache_dtype auto
    unused_attention: list[str] = []  # query and probability scales
    for name, tensor in weights:
        where = _split(name, blocks) if name.endswith("_scale") else None
        if where is None:
            yield name, tensor
            continue
        block, rest = where
        layer, own = blocks[block]
        if rest.startswith(own + "."):
            rest = rest[len(own) + 1 :]  # vLLM's names: self_attn.attn.k_scale
        if rest in _UNUSED_SUFFIXES:
            unused_attention.append(name)
            continue
        targets = _KV_SCALE_SUFFIXES.get(rest)
        if targets is None:
            yield name, tensor  # another scale in the block: a quantized projection's
            continue
        value = _scale_value(name, tensor)
        if not use_scales:
            unused_kv.append(name)
            continue
        for target in targets:
            getattr(layer, target).fill_(value)
            found[target] += 1
    if unused_kv:
        logger.info(
            "the checkpoint has FP8 KV cache scales (%d, e.g. %s), not used: kv_cache_dtype is "
            "auto, so the KV cache keeps the model's dtype",
            len(unused_kv),
            unused_kv[0],
        )
    if unused_attention:
        logger.info(
            "the checkpoint has query/probability scales for FP8 attention (%d, e.g. %s), not "
            "used: kvik attends in the model's dtype",
            len(unused_attention),
            unused_attention[0],
        )
    if use_scales:
        logger.info(
            "FP8 KV cache: k scales of %d and v scales of %d of the %d attention layers from the "
            "checkpoint, 1.0 for the others",
            found["k_scale"],
            found["v_scale"],
            len(blocks),
        )
