"""Which rank this process is, and the process groups it belongs to.

One process per rank. A rank joins the world with ``init_distributed_environment`` and then builds
its groups with ``initialize_model_parallel``; layers ask ``get_tp_group()`` for their shard and for
the collectives. A process that never joined a world (the single-rank engine, most tests) sees a
group of one, whose collectives return their input, so layers need no special case for TP=1.

Only tensor parallelism has a group so far; pipeline and data parallelism add theirs here.

The all-reduce layers call is the custom op ``torch.ops.kvik.all_reduce``: ``torch.compile`` keeps
it as one opaque node (it does not trace into torch.distributed), and a CUDA graph captures the
collective library's kernel inside it. NCCL may only be captured once its communicator exists, so
a group that is built runs one eager all-reduce at once (capturing the first collective would
create the communicator inside the capture, which hangs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvik.op_library import custom_op


@dataclass
class GroupCoordinator:
    """A process group and this rank's place in it, with the collectives layers use."""

    ranks: list[int]
    rank_in_group: int
    device_group: dist.ProcessGroup | None  # None for a group of one

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def name(self) -> str:
        """The group's key in the registry the ``kvik::all_reduce`` op looks groups up in."""
        return "ranks-" + "-".join(map(str, self.ranks))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group's ranks, as a new tensor (``x`` itself for a group of one)."""
        if self.world_size == 1:
            return x
        return torch.ops.kvik.all_reduce(x, self.name)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' tensors concatenated along ``dim``, in rank order."""
        if self.world_size == 1:
            return x
        dim = dim % x.dim()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``x`` of the group's rank ``src`` on every rank (in place)."""
        if self.world_size == 1:
            return x
        dist.broadcast(x, src=self.ranks[src], group=self.device_group)
        return x

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.device_group)


_SINGLE = GroupCoordinator(ranks=[0], rank_in_group=0, device_group=None)
_TP: GroupCoordinator | None = None
#: The groups this rank belongs to, by name, for the ``kvik::all_reduce`` op.
_GROUPS: dict[str, GroupCoordinator] = {}


@custom_op("kvik::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, group_name: str) -> torch.Tensor:
    # Out of place: a custom op may not return its input. The copy is one activation per
    # row-parallel layer, small beside the product that made it.
    out = x.clone()
    dist.all_reduce(out, group=_GROUPS[group_name].device_group)
    return out


@_all_reduce_op.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


def _warm_up(group: GroupCoordinator) -> None:
    """One eager all-reduce, so that the collective library's communicator exists before any
    CUDA graph captures a collective of the group."""
    backend = dist.get_backend(group.device_group)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe, group=group.device_group)
    if probe.item() != group.world_size:
        raise RuntimeError(
            f"the warm-up all-reduce of ranks {group.ranks} gave {probe.item()}, "
            f"not {group.world_size}"
        )


def init_distributed_environment(
    world_size: int, rank: int, distributed_init_method: str, backend: str
) -> None:
    """Join the world of ``world_size`` ranks as ``rank`` (``backend``: "nccl" or "gloo";
    ``distributed_init_method``: e.g. ``tcp://127.0.0.1:PORT``). A world of one is not joined."""
    if world_size == 1 or dist.is_initialized():
        return
    dist.init_process_group(
        backend=backend, init_method=distributed_init_method, world_size=world_size, rank=rank
    )


def initialize_model_parallel(tensor_parallel_size: int) -> None:
    """Build this rank's tensor-parallel group: consecutive ranks ``tensor_parallel_size`` at a
    time (the whole world until other kinds of parallelism exist)."""
    global _TP
    if tensor_parallel_size == 1 and not dist.is_initialized():
        _TP = _SINGLE
        return
    world_size = dist.get_world_size()
    if world_size % tensor_parallel_size:
        raise ValueError(
            f"the world of {world_size} ranks does not split into tensor-parallel groups of "
            f"{tensor_parallel_size}"
        )
    rank = dist.get_rank()
    for start in range(0, world_size, tensor_parallel_size):
        ranks = list(range(start, start + tensor_parallel_size))
        # Every rank must create every group, in the same order (torch.distributed's rule).
        group = dist.new_group(ranks) if tensor_parallel_size > 1 else None
        if rank in ranks:
            _TP = GroupCoordinator(ranks, ranks.index(rank), group)
    if _TP.world_size > 1:
        _GROUPS[_TP.name] = _TP
        _warm_up(_TP)


def get_tp_group() -> GroupCoordinator:
    """The tensor-parallel group of this rank: a group of one when no world was joined."""
    return _TP if _TP is not None else _SINGLE


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def destroy_model_parallel() -> None:
    """Leave the groups and the world (a worker's shutdown; tests that build several worlds)."""
    global _TP
    _TP = None
    _GROUPS.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
