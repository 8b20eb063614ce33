"""CUDA graphs: kvik_cuda's step runner, FULL graphs for uniform steps (decodes, and speculative
decoding's verifications) and PIECEWISE graphs for the others (``CompilationConfig.cudagraph_mode``).

FULL: one graph per padded batch size (``CompilationConfig.cudagraph_capture_sizes``), each holding
the whole forward pass of a decode step, embedding to fp32 logits, over the runner's persistent
buffers (kvik.worker.step_buffers), with the model's layers run eagerly during the capture (the
hand-written kernels and the one-row GEMV). A decode batch of n requests runs in the graph of the
smallest size B >= n: the runner fills rows n..B with padding (slot -1, so no cache write; sequence
length 1 and block 0, so one harmless key; position 0), replays, and samples rows 0..n outside the
graph.

With speculative decoding (k drafts at most a request) a second set of FULL graphs holds
verifications: 1 + k rows a request (its newest token, then its drafts), at the capture sizes up
to ``disable_by_batch_size`` whose rows fit the step buffers. Every request of such a step is laid
out over 1 + k rows (the model runner's ``prepare_inputs``): one with fewer drafts gets padding rows
after them (slot -1, positions after its drafts, logits not read), and padding requests of 1 + k
rows fill the batch. The graph computes logits for every row; the rejection sampler reads each
request's own rows (``logits_indices``) outside it.

PIECEWISE (kvik_cuda.piecewise_graphs): the model compiled and split at attention, each piece
captured per padded token count of two or more; any other step of at most the largest size runs
padded to the next size, attention between the pieces. Steps above the largest size run compiled
without graphs (or eagerly, when the model is not compiled).

The graphs share one memory pool and are captured largest first, so the smaller ones reuse the
larger ones' activation memory. Before the KV cache is sized, ``reserved_memory_bytes`` captures the
largest and smallest graphs on a one-block cache to measure what the graphs will hold, then frees
them; the real graphs are captured once the KV cache exists.
"""

from __future__ import annotations

import bisect
import collections
import inspect
import logging
import time
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from kvik.worker.step_runner import StepRunner
from kvik_cuda.piecewise_graphs import PiecewiseGraphs

logger = logging.getLogger(__name__)
MiB = 1024**2


@dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    logits: Tensor  # [B, vocab] fp32, the graph's output: rows of the runner's one logits buffer
    size: int


class CudaGraphStepRunner(StepRunner):
    name = "cuda_graphs"

    def __init__(self, runner) -> None:
        compilation = runner.config.compilation
        self.piecewise = PiecewiseGraphs() if compilation.piecewise_graphs else None
        super().__init__(runner)  # compiles the model, wrapping its pieces (wrap_piece)
        if self.piecewise is not None:
            # The compiled pieces live on in dynamo's cache after the engine is gone: release
            # their graphs (and the pool's memory) with this runner.
            weakref.finalize(self, self.piecewise.clear)
        sizes = sorted(s for s in compilation.cudagraph_capture_sizes if s <= runner.max_num_seqs)
        #: FULL graphs to capture, as (rows per request, padded request count).
        self.capture_shapes = full_graph_shapes(runner, sizes) if compilation.full_graphs else []
        # A piecewise step has two or more tokens (a single token runs eagerly: kvik.compilation).
        self.piecewise_sizes = [s for s in sizes if s >= 2] if self.piecewise else []
        self.graphs: dict[tuple[int, int], CapturedStep] = {}
        #: Per rows-per-request, the request counts of its FULL graphs captured, ascending.
        self._sizes: dict[int, list[int]] = {}
        self._piecewise_sizes: list[int] = []  # piecewise graphs captured, ascending
        self._pool = None
        #: The FULL graphs' fp32 logits, all of them in the rows of this one buffer (outside the
        #: pool): a graph's own output would stay allocated as long as the graph, and with a
        #: vocabulary of 150k the 48 sizes to 512 would hold ~6 GiB of logits. One graph runs
        #: at a time, and its logits are read (sampled) before the next replay on the stream.
        self._logits: Tensor | None = None
        self._logits_rows = 0
        #: Whether the model's compute_logits takes ``out``, writing the buffer's rows itself
        #: (kvik's models do; a plugin's model of the older signature gets its logits copied).
        self._logits_into = "out" in inspect.signature(self.model.compute_logits).parameters
        #: FULL-graph replays so far, and per rows a request (tests and benchmarks check that
        #: graphs ran).
        self.num_replays = 0
        self.replays_by_rows: collections.Counter[int] = collections.Counter()
        self.capture_seconds = 0.0
        self.reserved_estimate = 0  # reserved_memory_bytes's figure, for the capture's log line
        self.capture_bytes = 0

    def wrap_piece(self, piece, index: int, count: int):
        if self.piecewise is None:
            return piece
        return self.piecewise.wrap(piece, index, count)

    @property
    def num_piecewise_replays(self) -> int:
        return self.piecewise.num_replays if self.piecewise else 0

    def uniform_batch_size(self, num_reqs: int, query_len: int) -> int | None:
        sizes = self._sizes.get(query_len)
        if not sizes or num_reqs > sizes[-1]:
            return None
        return sizes[bisect.bisect_left(sizes, num_reqs)]

    def padded_num_tokens(self, num_tokens: int) -> int:
        sizes = self._piecewise_sizes
        if num_tokens >= 2 and sizes and num_tokens <= sizes[-1]:
            return sizes[bisect.bisect_left(sizes, num_tokens)]
        return num_tokens

    def forward(self, inputs) -> tuple[Tensor | None, Tensor | None]:
        query_len = inputs.uniform_query_len
        captured = self.graphs.get((query_len, inputs.num_padded // max(1, query_len)))
        if captured is not None:
            captured.graph.replay()
            self.num_replays += 1
            self.replays_by_rows[query_len] += 1
            if query_len == 1:  # the sampling rows are the first ones
                return None, captured.logits[: inputs.num_sampling]
            return None, captured.logits.index_select(0, inputs.logits_indices)
        if self.piecewise is not None and inputs.num_padded in self._piecewise_set:
            with self.piecewise.running(inputs.num_padded):
                return super().forward(inputs)
        return super().forward(inputs)

    # --- capture --------------------------------------------------------------------------
    @property
    def _piecewise_set(self) -> set[int]:
        return set(self._piecewise_sizes)

    def _body(self, inputs) -> Tensor:
        hidden = self.eager_hidden(inputs)
        rows = hidden.shape[0]
        if self._logits is not None and self._logits_into:
            # The LM head writes the buffer's rows itself where its kernel can (the fp32-output
            # cuBLAS product); others compute and copy (``LinearKernel.apply_into``).
            return self.model.compute_logits(hidden, out=self._logits[:rows])
        logits = self.model.compute_logits(hidden)
        if self._logits is None:
            # Sized by the first (eager) run of the largest shape, before any capture: an
            # allocation inside a capture would land in the pool.
            assert not torch.cuda.is_current_stream_capturing()
            self._logits = torch.empty(
                self._logits_rows, logits.shape[1], dtype=torch.float32, device=logits.device
            )
        out = self._logits[:rows]
        out.copy_(logits)
        return out

    @torch.inference_mode()
    def _capture(self, query_len: int, size: int) -> CapturedStep:
        inputs = self.runner.dummy_decode_inputs(size, query_len)
        # Eager runs first: Triton compiles this shape's kernel variants and cuBLAS picks its
        # algorithms outside the capture (neither may happen inside one).
        for _ in range(2):
            self._body(inputs)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._body(inputs)
        return CapturedStep(graph, logits, size)

    def _capture_all(self, shapes: list[tuple[int, int]]) -> dict[tuple[int, int], CapturedStep]:
        graphs = {}
        if shapes:
            self._logits_rows = max(query_len * size for query_len, size in shapes)
            if self._logits is not None and self._logits.shape[0] < self._logits_rows:
                self._logits = None
        # Most rows first: the pool then fits the rest.
        for query_len, size in sorted(shapes, key=lambda shape: shape[0] * shape[1], reverse=True):
            graphs[query_len, size] = self._capture(query_len, size)
        torch.cuda.synchronize()
        return graphs

    @torch.inference_mode()
    def _capture_piecewise(self, sizes: list[int]) -> None:
        for size in sorted(sizes, reverse=True):
            inputs = self.runner.dummy_decode_inputs(size)
            with self.piecewise.capture(size, self._pool):
                self.forward_hidden(inputs)
        torch.cuda.synchronize()

    def reserved_memory_bytes(self) -> int:
        """What the graphs will hold, from a trial on a one-block cache. The graphs share one pool
        and are captured largest first, so the largest graph of each kind sets the pool's size
        (and the FULL graphs' logits buffer), and each further graph adds only what the smallest
        one adds after it (its own state, any pool memory the smaller shapes lay out otherwise):
        the trial captures those two of each kind and counts the second's cost once a size."""
        full, piecewise = self.capture_shapes, self.piecewise_sizes
        if not full and not piecewise:
            return 0
        runner = self.runner
        by_rows = sorted(full, key=lambda shape: shape[0] * shape[1])
        runner.initialize_kv_cache(1, warm_up=False)  # padding rows read block 0 only
        self._pool = torch.cuda.graph_pool_handle()
        trial = []  # the trial's graphs stay alive until every figure is read
        costs = []  # (kind, sizes, the largest's bytes, the smallest's bytes)
        try:
            free = _free_memory()
            for kind, sizes, capture in (
                ("FULL", by_rows, lambda shape: trial.append(self._capture_all([shape]))),
                ("PIECEWISE", piecewise, lambda size: self._capture_piecewise([size])),
            ):
                if not sizes:
                    continue
                capture(sizes[-1])
                largest, free = free - (after := _free_memory()), after
                smallest = 0
                if len(sizes) > 1:
                    capture(sizes[0])
                    smallest, free = free - (after := _free_memory()), after
                costs.append((kind, sizes, max(0, largest), max(0, smallest)))
        finally:
            trial.clear()  # release the graphs and their pool
            if self.piecewise is not None:
                self.piecewise.clear()
            self._pool = None
            self._logits = None
            for layer in runner.attention_layers.values():
                layer.kv_cache = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        estimate = sum(
            largest + smallest * (len(sizes) - 1) for _, sizes, largest, smallest in costs
        )
        for kind, sizes, largest, smallest in costs:
            logger.info(
                "CUDA graphs: a trial capture of the %s graphs for %s took %.1f MiB and for %s %.1f "
                "MiB more", kind, sizes[-1], largest / MiB, sizes[0], smallest / MiB,
            )  # fmt: skip
        logger.info(
            "CUDA graphs: %d FULL and %d PIECEWISE sizes are estimated at %.1f MiB",
            len(full), len(piecewise), estimate / MiB,
        )  # fmt: skip
        self.reserved_estimate = estimate
        return estimate

    def on_kv_cache_ready(self) -> None:
        if not self.capture_shapes and not self.piecewise_sizes:
            super().on_kv_cache_ready()
            return
        free_before = _free_memory()
        started = time.perf_counter()
        self._pool = torch.cuda.graph_pool_handle()
        self.graphs = self._capture_all(self.capture_shapes)
        self._sizes = {}
        for query_len, size in sorted(self.graphs):
            self._sizes.setdefault(query_len, []).append(size)
        if self.piecewise_sizes:
            self._capture_piecewise(self.piecewise_sizes)
            self._piecewise_sizes = sorted(self.piecewise.captured_sizes())
        self.capture_seconds = time.perf_counter() - started
        self.capture_bytes = max(0, free_before - _free_memory())
        logger.info(
            "captured %d FULL CUDA graphs (decode batch sizes %s, verification batch sizes %s) "
            "and piecewise graphs of %d pieces for %d token counts (%s) in %.1f s, %.1f MiB "
            "(estimated before the KV cache was sized: %.1f MiB)",
            len(self.graphs), _span(self._sizes.get(1, [])),
            _span([s for q, sizes in self._sizes.items() if q > 1 for s in sizes]),
            len(self.piecewise.pieces) if self.piecewise else 0, len(self._piecewise_sizes),
            _span(self._piecewise_sizes), self.capture_seconds, self.capture_bytes / MiB,
            self.reserved_estimate / MiB,
        )  # fmt: skip


def full_graph_shapes(runner, sizes: list[int]) -> list[tuple[int, int]]:
    """(rows per request, request count) of the FULL graphs: decodes at every capture size and,
    with speculative decoding, verifications of 1 + k rows a request at the sizes whose rows fit
    the step buffers and that speculate (at most ``disable_by_batch_size`` requests)."""
    shapes = [(1, size) for size in sizes]
    k = runner.num_speculative_tokens
    if k:
        limit = runner.config.speculative.disable_by_batch_size or runner.max_num_seqs
        shapes += [
            (1 + k, size)
            for size in sizes
            if size <= limit and size * (1 + k) <= runner.max_num_tokens
        ]
    return shapes


def _free_memory() -> int:
    """The device's free bytes once the caching allocator has returned what nothing holds (an
    eager run's activations), so that only what the graphs keep is counted."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def _span(sizes: list[int]) -> str:
    return f"{sizes[0]}..{sizes[-1]}" if sizes else "none"
