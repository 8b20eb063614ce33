"""CUDA graphs for device work outside the model's step (``Platform.step_graphs``): EAGLE-3's
draft steps (kvik.spec_decode.eagle3_proposer), one graph per padded batch size.

A key's graph is captured the first time the key is run, after two eager runs of the same work
(Triton compiles its kernel variants and cuBLAS picks its algorithms outside the capture, where
neither may happen). The work must be idempotent for this: it reads and writes persistent buffers
only, and the eager runs write what the replay writes again. The graphs share one memory pool,
their own (they are captured while serving, after the step runner's graphs).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch


class LazyStepGraphs:
    def __init__(self) -> None:
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._pool = None
        #: Replays so far (benchmarks check that graphs ran).
        self.num_replays = 0

    def run(self, key: Hashable, fn: Callable[[], None]) -> None:
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(fn)
            self.graphs[key] = graph
        graph.replay()
        self.num_replays += 1

    def _capture(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            fn()
        return graph
