"""FULL CUDA graphs for uniform decode steps: kvik_cuda's step runner.

One graph per padded batch size (``CompilationConfig.cudagraph_capture_sizes``), each holding the
whole forward pass of a decode step, embedding to fp32 logits, over the runner's persistent
buffers (kvik.worker.step_buffers). A decode batch of n requests runs in the graph of the smallest
size B >= n: the runner fills rows n..B with padding (slot -1, so no cache write; sequence length 1
and block 0, so one harmless key; position 0), replays, and samples rows 0..n outside the graph.
Steps with prompt tokens, and decode batches above the largest size, run eagerly.

The graphs share one memory pool and are captured largest first, so the smaller ones reuse the
larger ones' activation memory. Before the KV cache is sized, ``reserved_memory_bytes`` captures the
largest and smallest graphs on a one-block cache to measure what the graphs will hold, then frees
them; the real graphs are captured once the KV cache exists.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from kvik.worker.step_runner import StepRunner

logger = logging.getLogger(__name__)
MiB = 1024**2


@dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    logits: Tensor  # [B, vocab] fp32, the graph's output
    size: int


class CudaGraphStepRunner(StepRunner):
    name = "cuda_graphs"

    def __init__(self, runner) -> None:
        super().__init__(runner)
        sizes = runner.config.compilation.cudagraph_capture_sizes
        self.capture_sizes = sorted(s for s in sizes if s <= runner.max_num_seqs)
        self.graphs: dict[int, CapturedStep] = {}
        self._sizes: list[int] = []  # captured, ascending
        self._pool = None
        #: Replays so far (tests and benchmarks check that graphs ran).
        self.num_replays = 0
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    def padded_num_tokens(self, num_tokens: int, uniform_decode: bool) -> int:
        if not uniform_decode or not self._sizes or num_tokens > self._sizes[-1]:
            return num_tokens
        return self._sizes[bisect.bisect_left(self._sizes, num_tokens)]

    def forward(self, inputs) -> tuple[Tensor | None, Tensor | None]:
        captured = self.graphs.get(inputs.num_padded) if inputs.uniform_decode else None
        if captured is None:
            return super().forward(inputs)
        captured.graph.replay()
        self.num_replays += 1
        return None, captured.logits[: inputs.num_sampling]

    # --- capture --------------------------------------------------------------------------
    def _body(self, inputs) -> Tensor:
        hidden = self.forward_hidden(inputs)
        return self.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def _capture(self, size: int) -> CapturedStep:
        inputs = self.runner.dummy_decode_inputs(size)
        # Eager runs first: Triton compiles this size's kernel variants and cuBLAS picks its
        # algorithms outside the capture (neither may happen inside one).
        for _ in range(2):
            self._body(inputs)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._body(inputs)
        return CapturedStep(graph, logits, size)

    def _capture_all(self, sizes: list[int]) -> dict[int, CapturedStep]:
        graphs = {}
        for size in sorted(sizes, reverse=True):  # largest first: the pool then fits the rest
            graphs[size] = self._capture(size)
        torch.cuda.synchronize()
        return graphs

    def reserved_memory_bytes(self) -> int:
        if not self.capture_sizes:
            return 0
        runner = self.runner
        largest, smallest = self.capture_sizes[-1], self.capture_sizes[0]
        runner.initialize_kv_cache(1, warm_up=False)  # padding rows read block 0 only
        self._pool = torch.cuda.graph_pool_handle()
        try:
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info()[0]
            trial = self._capture_all([largest])
            free_after_largest = torch.cuda.mem_get_info()[0]
            if smallest != largest:
                trial |= self._capture_all([smallest])
            free_after = torch.cuda.mem_get_info()[0]
        finally:
            trial = None  # noqa: F841  (release the graphs and their pool)
            self._pool = None
            for layer in runner.attention_layers.values():
                layer.kv_cache = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        first = max(0, free_before - free_after_largest)
        each_more = max(0, free_after_largest - free_after)
        estimate = first + each_more * (len(self.capture_sizes) - 1)
        logger.info(
            "CUDA graphs: a trial capture of sizes %d and %d took %.1f MiB and %.1f MiB; "
            "%d sizes are estimated at %.1f MiB",
            largest, smallest, first / MiB, each_more / MiB, len(self.capture_sizes),
            estimate / MiB,
        )  # fmt: skip
        return estimate

    def on_kv_cache_ready(self) -> None:
        if not self.capture_sizes:
            return
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        started = time.perf_counter()
        self._pool = torch.cuda.graph_pool_handle()
        self.graphs = self._capture_all(self.capture_sizes)
        self._sizes = sorted(self.graphs)
        self.capture_seconds = time.perf_counter() - started
        self.capture_bytes = max(0, free_before - torch.cuda.mem_get_info()[0])
        logger.info(
            "captured %d CUDA graphs (decode batch sizes %d..%d) in %.1f s, %.1f MiB",
            len(self.graphs), self._sizes[0], self._sizes[-1], self.capture_seconds,
            self.capture_bytes / MiB,
        )  # fmt: skip
