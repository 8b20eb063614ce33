"""Piecewise compilation: the model's forward under ``torch.compile``, split at attention.

Dynamo traces the model once with a dynamic token dimension. This backend cuts the traced graph at
every ``kvik::unified_attention`` (or ``unified_attention_with_rotary``) call, so the graph becomes pieces (embedding to the first
attention's inputs, then everything between two attentions, then the last attention to the final
norm) with the attention calls left between them as they are. Each piece is compiled by inductor
for the dynamic token count (so it fuses the elementwise work around the matrix products), and
handed to ``wrap_piece``: the platform's step runner wraps it, e.g. in CUDA graphs captured per
padded token count (kvik_cuda.piecewise_graphs), while attention, whose work depends on the step's
metadata and not only on its shapes, runs eagerly between the pieces.

Inductor's own on-disk caches (its FX graph cache and the generated kernels) live under
``CompilationConfig.cache_dir``, so that a second start takes the compiled pieces from there;
dynamo's trace of the model is redone at each start.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
import types
import weakref
from collections.abc import Callable

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.split_module import split_module

logger = logging.getLogger(__name__)

#: What a platform's step runner wraps each compiled piece with: (piece, index, count) -> callable.
PieceWrapper = Callable[[Callable, int, int], Callable]

_ATTENTION_TARGETS = None


def _is_attention(node: fx.Node) -> bool:
    global _ATTENTION_TARGETS
    if _ATTENTION_TARGETS is None:
        import kvik.ops  # noqa: F401  (defines torch.ops.kvik.*)

        ops = (torch.ops.kvik.unified_attention, torch.ops.kvik.unified_attention_with_rotary)
        _ATTENTION_TARGETS = (*ops, *(op.default for op in ops))
    return node.op == "call_function" and node.target in _ATTENTION_TARGETS


def split_at_attention(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[str]]:
    """The graph cut into submodules ``submod_0, submod_1, ...``: attention calls alone in theirs,
    the work between them in the others. Returns the split module and the names of the pieces
    that are not attention, in order."""
    partition: dict[fx.Node, int] = {}
    current = 0
    attention_parts = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if _is_attention(node):
            current += 1
            partition[node] = current
            attention_parts.add(current)
            current += 1
        else:
            partition[node] = current
    split = split_module(gm, None, lambda node: partition[node], keep_original_order=True)
    pieces = [
        name
        for name, _ in split.named_children()
        if int(name.removeprefix("submod_")) not in attention_parts
    ]
    return split, pieces


class PiecewiseBackend:
    """A ``torch.compile`` backend: split at attention, compile each piece with inductor (or keep
    it as traced, ``use_inductor=False``), wrap it with ``wrap_piece``."""

    def __init__(self, wrap_piece: PieceWrapper | None = None, use_inductor: bool = True) -> None:
        # Dynamo's cache keeps this backend (and what it compiled) for the life of the process;
        # a bound method is held weakly so that it does not keep its engine alive with it.
        if inspect.ismethod(wrap_piece):
            wrap_piece = weakref.WeakMethod(wrap_piece)
        self._wrap_piece = wrap_piece
        self.use_inductor = use_inductor
        self.num_pieces = 0
        self.compile_seconds = 0.0
        self.num_graphs_traced = 0

    @property
    def wrap_piece(self) -> PieceWrapper | None:
        wrap = self._wrap_piece
        return wrap() if isinstance(wrap, weakref.WeakMethod) else wrap

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        started = time.perf_counter()
        self.num_graphs_traced += 1
        split, pieces = split_at_attention(gm)
        self.num_pieces = len(pieces)
        if self.use_inductor:
            self._compile_pieces(gm, split, set(pieces))
        wrap_piece = self.wrap_piece
        if wrap_piece is not None:
            for index, name in enumerate(pieces):
                wrapped = wrap_piece(getattr(split, name), index, len(pieces))
                setattr(split, name, _Piece(wrapped))
        self.compile_seconds += time.perf_counter() - started
        logger.info(
            "compiled the model in %d pieces split at attention in %.1f s",
            len(pieces), time.perf_counter() - started,
        )  # fmt: skip
        return split

    def _compile_pieces(self, gm: fx.GraphModule, split: fx.GraphModule, pieces: set[str]) -> None:
        # Each piece compiles on the fake values that flow into it, symbolic token count included:
        # run the split graph on the traced graph's own example values, compiling as we go.
        from torch._inductor import standalone_compile

        fake_args = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
        fake_mode = next(a.fake_mode for a in fake_args if isinstance(a, torch.Tensor))

        class CompilingInterpreter(fx.Interpreter):
            def call_module(self, target, args, kwargs):
                out = super().call_module(target, args, kwargs)
                if target in pieces:
                    module = self.fetch_attr(target)
                    compiled = standalone_compile(
                        module, list(args), dynamic_shapes="from_tracing_context", options={}
                    )
                    setattr(split, target, _Piece(compiled))
                return out

        with fake_mode:
            CompilingInterpreter(split).run(*fake_args)


class _Piece(nn.Module):
    """A compiled piece as a submodule of the split graph (which calls its submodules)."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def use_cache_dir(cache_dir: str) -> None:
    """Point inductor's on-disk caches (compiled graphs, generated kernels) at ``cache_dir``,
    unless the user chose a place with TORCHINDUCTOR_CACHE_DIR (torch writes its own default into
    that variable on first use, which is told apart by its value)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.makedirs(cache_dir, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, "inductor")
        logger.info("torch.compile caches in %s", cache_dir)


class CompiledModel:
    """The model's ``forward(input_ids, positions)`` compiled piecewise, for any token count of two
    or more (one dynamo trace; a single-token step goes to the eager model, which is what dynamo's
    0/1 specialisation would otherwise recompile for)."""

    def __init__(
        self,
        model: nn.Module,
        wrap_piece: PieceWrapper | None = None,
        use_inductor: bool = True,
        cache_dir: str | None = None,
    ) -> None:
        self.model = model
        self.backend = PiecewiseBackend(wrap_piece, use_inductor)
        if cache_dir:
            use_cache_dir(cache_dir)
        self._compiled = torch.compile(
            _private_forward(), backend=self.backend, dynamic=True, fullgraph=True
        )

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] < 2:
            return self.model(input_ids, positions)
        torch._dynamo.mark_dynamic(input_ids, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        # Module attributes that are floats (norm epsilons) stay constants in the graph.
        with torch._dynamo.config.patch(specialize_float=True):
            return self._compiled(self.model, input_ids, positions)


def _forward(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return model(input_ids, positions)


def _private_forward() -> Callable:
    """``_forward`` with a code object of its own.

    Dynamo keeps its compiled entries (and their guards) on the code object of the function it
    compiles, and allows each code object a few recompilations only (``recompile_limit``). Had every
    engine compiled the model class's own ``forward``, the engines of one process would share one
    code object: each new engine's model fails the earlier entries' guards and adds an entry, until
    the ninth raises. A private copy of the code per compiled model gives each its own entries.
    """
    return types.FunctionType(_forward.__code__.replace(), _forward.__globals__, "_forward")
