"""PIECEWISE CUDA graphs: each compiled piece of the model (kvik.compilation.piecewise) captured once
per padded token count, attention running eagerly between them.

A step of ``n`` tokens that is not a FULL-graph decode runs at the smallest piecewise size
``S >= n`` (the runner pads its buffers to S): every piece replays its graph for S, reading its
inputs where the capture left them (the persistent step buffers, the weights, the previous piece's
outputs) and writing its outputs there, and attention, whose work depends on the step's metadata,
runs between the pieces as a normal launch.

All pieces of all sizes share one memory pool, captured size by size, largest first. A piece keeps
no owning reference to its outputs: it keeps non-owning aliases of them, so that once a capture's
forward pass has ended the pool can give the same memory to the next size's captures (only one size
runs at a time, and within a size the pool's reuse follows the order of the capture, which the
replay repeats). The aliases are built from the outputs' data pointers with torch's private
``_construct_storage_from_data_pointer``, as torch's own CUDA graph trees do.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor


def _non_owning(value: Any) -> Any:
    if not isinstance(value, Tensor):
        return value
    storage = value.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), value.device, storage.nbytes()
    )
    return torch.empty(0, dtype=value.dtype, device=value.device).set_(
        alias, value.storage_offset(), value.shape, value.stride()
    )


class PiecewiseGraphs:
    """The graphs of every piece, and the state that tells a piece whether to replay, capture or
    just run: ``size`` (the step's padded token count while a piecewise step runs, else None) and
    ``capturing`` (only inside ``capture``: a piece never captures during a request)."""

    def __init__(self) -> None:
        self.size: int | None = None
        self.capturing = False
        self.pool = None
        self.pieces: list[_PieceGraph] = []
        self.num_replays = 0  # steps replayed piecewise (tests check graphs ran)

    def wrap(self, piece: Callable, index: int, count: int) -> Callable:
        graph = _PieceGraph(piece, self)
        self.pieces.append(graph)
        return graph

    @contextmanager
    def running(self, size: int):
        """A step of ``size`` padded tokens runs inside: its pieces replay their graphs."""
        self.size = size
        try:
            yield
        finally:
            self.size = None
        self.num_replays += 1

    @contextmanager
    def capture(self, size: int, pool):
        """The forward pass inside captures every piece's graph for ``size`` into ``pool``."""
        self.size, self.capturing, self.pool = size, True, pool
        try:
            yield
        finally:
            self.size, self.capturing, self.pool = None, False, None

    def captured_sizes(self) -> set[int]:
        sizes = [set(p.graphs) for p in self.pieces]
        return set.intersection(*sizes) if sizes else set()

    def clear(self) -> None:
        for piece in self.pieces:
            piece.graphs.clear()


class _PieceGraph:
    def __init__(self, piece: Callable, owner: PiecewiseGraphs) -> None:
        self.piece = piece
        self.owner = owner
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Any]] = {}

    def __call__(self, *args):
        size = self.owner.size
        if size is None:
            return self.piece(*args)
        captured = self.graphs.get(size)
        if captured is not None:
            graph, outputs = captured
            graph.replay()
            return outputs
        if not self.owner.capturing:
            return self.piece(*args)
        # A run outside the capture first: Triton compiles and cuBLAS chooses its algorithms for
        # this shape there (neither may happen inside a capture).
        self.piece(*args)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.owner.pool):
            outputs = self.piece(*args)
        if isinstance(outputs, (tuple, list)):
            kept = type(outputs)(_non_owning(o) for o in outputs)
        else:
            kept = _non_owning(outputs)
        self.graphs[size] = (graph, kept)
        return outputs
