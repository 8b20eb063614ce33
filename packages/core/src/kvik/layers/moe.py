"""A sparse mixture of gated SiLU experts, its weights stacked over the experts.

``FusedMoE`` holds every expert's gate and up projections as one ``gate_up_proj`` [E, 2I, H] (gate
rows first) and the down projections as ``down_proj`` [E, H, I], the names and orientation
transformers 5 gives its stacked experts, so such a checkpoint loads as it is. Checkpoints with a
tensor per expert (``experts.N.gate_proj.weight`` ..., Mixtral's ``experts.N.w1/w2/w3``) load into
the same stacks through the parameters' loaders, with shard ids ``(expert, "gate" | "up")`` and
``expert`` (``expert_shard``).

The layer computes through one op, ``kvik::fused_moe`` (kvik.ops: routing and experts from the
router's logits), whose kernels the platforms register; a platform may instead give the layer a
``kernel`` after loading (the CPU's packed per-expert weights, kvik_cpu.moe).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import Tensor, nn

from kvik import ops
from kvik.layers.linear import default_weight_loader

#: A checkpoint's per-expert tensor: "<prefix>.experts.<N>.<projection>.weight", where the
#: projection is transformers' (gate_proj, up_proj, down_proj) or Mixtral's (w1, w3, w2).
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_PROJECTIONS = {
    "gate_proj": ("gate_up_proj", "gate"),
    "w1": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
    "w3": ("gate_up_proj", "up"),
    "down_proj": ("down_proj", None),
    "w2": ("down_proj", None),
}


def expert_shard(name: str) -> tuple[str, tuple[int, str] | int] | None:
    """A per-expert checkpoint name -> (the stacked parameter's name, its shard id), or None when
    ``name`` is not one. ``model.layers.0.mlp.experts.7.up_proj.weight`` ->
    ``("model.layers.0.mlp.experts.gate_up_proj", (7, "up"))``."""
    match = _PER_EXPERT.match(name)
    if match is None or match["proj"] not in _PROJECTIONS:
        return None
    target, half = _PROJECTIONS[match["proj"]]
    expert = int(match["expert"])
    return f"{match['prefix']}.{target}", expert if half is None else (expert, half)


class FusedMoE(nn.Module):
    """Experts [E] of intermediate size I over hidden size H, ``top_k`` of them per token."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}] experts, got {top_k}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        for param in (self.gate_up_proj, self.down_proj):
            param.weight_loader = self.weight_loader
        self._fused_moe = ops.small_op("fused_moe")
        #: Set by a platform after loading: computes the layer instead of the op (same arguments).
        self.kernel: Callable[[Tensor, Tensor], Tensor] | None = None

    def weight_loader(
        self, param: Tensor, loaded: Tensor, shard_id: tuple[int, str] | int | None = None
    ) -> None:
        """The whole stack (shard None), or one expert's tensor: ``(expert, "gate" | "up")`` of
        gate_up_proj, ``expert`` of down_proj."""
        if shard_id is None:
            default_weight_loader(param, loaded)
            return
        expert, half = shard_id if isinstance(shard_id, tuple) else (shard_id, None)
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range: the layer has {self.num_experts}")
        target = param.data[expert]
        if half is not None:
            if half not in ("gate", "up"):
                raise ValueError(f"gate_up_proj's shards are 'gate' and 'up', not {half!r}")
            size = self.intermediate_size
            target = target.narrow(0, 0 if half == "gate" else size, size)
        default_weight_loader(target, loaded)

    def forward(self, hidden: Tensor, router_logits: Tensor) -> Tensor:
        # hidden [T, H], router_logits [T, E] -> [T, H]
        if self.kernel is not None:
            return self.kernel(hidden, router_logits)
        return self._fused_moe(
            hidden, router_logits, self.gate_up_proj, self.down_proj, self.top_k, self.renormalize
        )

    def extra_repr(self) -> str:
        e, two_i, h = self.gate_up_proj.shape
        return f"experts={e}, top_k={self.top_k}, hidden={h}, intermediate={two_i // 2}"
