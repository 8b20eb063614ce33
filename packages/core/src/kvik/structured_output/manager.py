"""The engine core's structured-output manager: grammars compiled off the critical path, one
matcher per request, the batch's bitmask filled each step.

Compilation runs on a thread pool (xgrammar compiles in C++ without the GIL), keyed by the
grammar so that requests with the same schema share one compile. A request whose grammar is not
compiled yet stays in the scheduler's waiting queue while others run (``is_ready``). Tokens reach
a request's matcher as the scheduler appends them (``accept_token``); a matcher that has reached
the end of its grammar finishes the request with "stop".

Speculative decoding (vLLM's rule): a request's drafts are cut, as they arrive, to the longest
prefix its grammar accepts (``valid_drafts``), and a step that scores k drafts gets k + 1 mask rows:
the grammar's state before the first draft, then after each (the matcher advances through the
drafts and rolls back). The scheduler then appends the accepted run through ``accept_token``.

Asynchronous scheduling: the bitmask of a step is filled when the step is scheduled, from the
tokens known then. A request with a grammar counts as reading its output history
(``Request.needs_output_history``), so the engine collects the step in flight before scheduling
it again: its matcher has then seen every token, and the mask is exact.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvik.config import StructuredOutputsConfig
from kvik.layers.logits_processors import bad_word_endings
from kvik.structured_output.bitmask import unpack_bitmask
from kvik.structured_output.grammar import compile_grammar, grammar_key, tokenizer_info
from kvik.structured_output.reasoning import REASONING_TOKENS, ReasoningEnd

if TYPE_CHECKING:
    from kvik.config import EngineConfig
    from kvik.request import Request
    from kvik.scheduler.output import ScheduledRequest

logger = logging.getLogger(__name__)

#: Compiled grammars kept for reuse (least recently used dropped first).
_CACHE_SIZE = 512


@dataclass
class GrammarBitmask:
    """One step's masks, ``bitmask`` [M, ceil(V / 32)] int32 (host memory): the request
    ``request_ids[i]`` has ``rows_per_request[i]`` consecutive rows (one, or 1 + its scheduled
    drafts in a verification: one per scored position), in that order; requests of the step
    without a grammar have none. ``rows_per_request`` None: one row each."""

    request_ids: list[str]
    bitmask: torch.Tensor
    rows_per_request: list[int] | None = None

    def row_counts(self) -> list[int]:
        if self.rows_per_request is None:
            return [1] * len(self.request_ids)
        return self.rows_per_request


@dataclass
class StructuredOutputRequest:
    """A request's grammar: its compile (shared with other requests of the same grammar), then
    its matcher."""

    key: tuple[str, str, bool]
    compiled: Future
    matcher: Any = None
    error: str | None = None
    #: False while the model is still reasoning (a reasoning parser is set): no mask yet.
    reasoning_ended: bool = True
    #: The matcher refused a sampled token (only possible if a mask was not applied).
    rejected: bool = field(default=False)

    @property
    def active(self) -> bool:
        """Whether the next token is constrained."""
        return (
            self.matcher is not None and self.reasoning_ended and not self.matcher.is_terminated()
        )

    def is_terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()


class StructuredOutputManager:
    def __init__(self, config: EngineConfig, max_workers: int = 2) -> None:
        self.settings: StructuredOutputsConfig = config.structured_outputs
        check_settings(self.settings)
        # Read at the first grammar: an engine without one needs nothing of the model here.
        self._model = config.model
        self._max_workers = max_workers
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: Any = None
        self._reasoning_end: ReasoningEnd | None = None
        self._setup_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str, bool], Future] = OrderedDict()
        # Ids no grammar accepts (special tokens, the padding past the tokenizer's vocabulary):
        # drafts stop at them without asking the matcher, which would log a warning for each.
        self._special_ids: frozenset[int] = frozenset()

    # -- compilation (off the critical path) ------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Start compiling the request's grammar (or share a compile under way or done)."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        try:
            key = grammar_key(params)
        except ValueError as e:
            failed: Future = Future()
            failed.set_exception(e)
            request.structured_output = StructuredOutputRequest(("", "", False), failed)
            return
        future = self._cache.get(key)
        if future is None or (future.done() and future.exception() is not None):
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._max_workers, "kvik-grammar")
            future = self._pool.submit(self._compile, key)
            self._cache[key] = future
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        request.structured_output = StructuredOutputRequest(key, future)

    def _compile(self, key: tuple[str, str, bool]) -> Any:
        return compile_grammar(self._get_compiler(), key)

    def _get_compiler(self) -> Any:
        """The engine's xgrammar compiler, built once (the tokenizer's vocabulary scanned once)."""
        with self._setup_lock:
            if self._compiler is None:
                import xgrammar as xgr

                from kvik.engine.input_processor import load_tokenizer

                source = self._model.tokenizer or self._model.path
                tokenizer = load_tokenizer(source)
                if tokenizer is None:
                    raise ValueError(f"structured outputs need a tokenizer, and {source} has none")
                stop_token_ids = sorted(self._model.eos_token_ids())
                info = tokenizer_info(tokenizer, self._model.vocab_size, stop_token_ids)
                self._special_ids = frozenset(info.special_token_ids) - set(stop_token_ids)
                if self.settings.reasoning_parser is not None:
                    self._reasoning_end = ReasoningEnd(self.settings.reasoning_parser, tokenizer)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_workers)
            return self._compiler

    def is_ready(self, request: Request) -> bool:
        """Whether the request's grammar is compiled (its matcher is then made); False also when
        compiling failed, which ``StructuredOutputRequest.error`` then says."""
        so = request.structured_output
        if so is None or so.matcher is not None:
            return True
        if so.error is not None or not so.compiled.done():
            return False
        error = so.compiled.exception()
        if error is not None:
            so.error = str(error)
            logger.warning("request %s: %s", request.request_id, so.error)
            return False
        import xgrammar as xgr

        so.matcher = xgr.GrammarMatcher(so.compiled.result())
        if self._reasoning_end is not None:
            so.reasoning_ended = self._reasoning_end.ended_in_prompt(request.prompt_token_ids)
        # A request preempted and recomputed keeps its matcher; one made now catches up on any
        # output it already has (none, unless it was readmitted after preemption).
        for token_id in request.output_token_ids:
            self.accept_token(request, token_id)
        return True

    def wait_for_compiles(self, requests: list[Request], timeout_s: float) -> None:
        """Block up to ``timeout_s`` until one of these requests' grammars is compiled (an engine
        with nothing else to run waits here rather than spinning)."""
        pending = {
            r.structured_output.compiled
            for r in requests
            if r.structured_output is not None and not r.structured_output.compiled.done()
        }
        if pending:
            wait(pending, timeout_s, return_when=FIRST_COMPLETED)

    # -- each step ----------------------------------------------------------------------------

    def grammar_bitmask(self, scheduled: list[ScheduledRequest]) -> GrammarBitmask | None:
        """The masks of the step's requests that sample under an active grammar, or None: one
        row per scored position (1 + the request's scheduled drafts)."""
        constrained = [
            s
            for s in scheduled
            if s.samples and s.request.structured_output is not None
            if s.request.structured_output.active
        ]
        if not constrained:
            return None
        import xgrammar as xgr

        counts = [1 + len(s.spec_token_ids) for s in constrained]
        bitmask = xgr.allocate_token_bitmask(sum(counts), self._model.vocab_size)  # all allowed
        index = 0
        for s in constrained:
            self._fill_rows(s.request, s.spec_token_ids, bitmask, index)
            index += 1 + len(s.spec_token_ids)
        speculative = any(count > 1 for count in counts)
        return GrammarBitmask(
            [s.request.request_id for s in constrained], bitmask, counts if speculative else None
        )

    def dead_ends(
        self, scheduled: list[ScheduledRequest], grammar: GrammarBitmask
    ) -> list[tuple[Request, str | None, str | None]]:
        """The step's constrained requests that have nothing to sample: where each stands (its
        first mask row), no token its grammar admits survives its other parameters
        (allowed_token_ids, the bad words its output completes, min_tokens' ban on stop
        tokens), or the grammar admits none at all. Sampled, such a request took token 0, which
        its grammar refused. Each comes with ``(message, param)``: why, and the SamplingParams
        field at fault; or ``(None, None)`` where the grammar allows only its end (EOS), which
        the other parameters forbid: the output is complete and the request stops, as in the
        scheduler's min_tokens rule. The caller finishes them; their rows are set to allow
        everything, so that the sampler still draws from a distribution (the token is dropped).
        Host work only: one row of ceil(V / 32) words looked at per request."""
        requests = {s.request.request_id: s.request for s in scheduled}
        words = grammar.bitmask.numpy().view(np.uint32)
        found = []
        first = 0
        for request_id, count in zip(grammar.request_ids, grammar.row_counts(), strict=True):
            request = requests[request_id]
            verdict = _dead_end(request, words[first])
            if verdict is not None:
                words[first : first + count] = 0xFFFFFFFF
                found.append((request, *verdict))
            elif count > 1:
                # A verification's rows after its drafts: one that allows nothing (the grammar
                # dead-ends after a draft) allows everything instead; the token sampled there,
                # if the drafts before it are accepted, is refused by the grammar, which fails
                # the request in the scheduler.
                later = words[first + 1 : first + count]
                later[~later.any(axis=1)] = 0xFFFFFFFF
            first += count
        return found

    def _fill_rows(
        self, request: Request, drafts: tuple[int, ...], bitmask: torch.Tensor, first: int
    ) -> None:
        """Rows ``first .. first + len(drafts)``: the grammar's next-token mask before each draft
        and after the last, the matcher advanced through the drafts and rolled back after. Rows
        after a draft that ends the grammar stay all-allowed (the request stops at that draft);
        a draft the grammar refuses (``valid_drafts`` cut them all, so only a bug makes one) is
        refused by its row's mask, and the rows after it are never read."""
        matcher = request.structured_output.matcher
        advanced = 0
        for row, draft in enumerate((*drafts, None)):
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(bitmask, first + row)
            if draft is None or not matcher.accept_token(draft):
                break
            advanced += 1
        if advanced:
            matcher.rollback(advanced)

    def valid_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """The longest prefix of a request's proposed drafts that its grammar allows after the
        tokens it has; all of them without a grammar. While the model is still reasoning the
        drafts stop before the end-of-reasoning token, so that every position a step scores is
        unconstrained (the grammar's first mask comes with the step after)."""
        so = request.structured_output
        if so is None or so.matcher is None or not drafts:
            return drafts
        if not so.reasoning_ended:
            end = self._reasoning_end.end_id if self._reasoning_end is not None else None
            return drafts[: drafts.index(end)] if end in drafts else drafts
        matcher = so.matcher
        accepted = 0
        for draft in drafts:
            if (
                draft in self._special_ids
                or matcher.is_terminated()
                or not matcher.accept_token(draft)
            ):
                break
            accepted += 1
        if accepted:
            matcher.rollback(accepted)
        return drafts[:accepted]

    def accept_token(self, request: Request, token_id: int) -> None:
        """Advance the request's grammar by a sampled token (tokens of its reasoning excepted)."""
        so = request.structured_output
        if so is None or so.matcher is None:
            return
        if not so.reasoning_ended:
            so.reasoning_ended = (
                self._reasoning_end is not None and token_id == self._reasoning_end.end_id
            )
            return
        if so.matcher.is_terminated():
            return
        if not so.matcher.accept_token(token_id):
            so.rejected = True
            logger.error(
                "request %s: token %d does not follow its grammar", request.request_id, token_id
            )

    def allows_only(self, request: Request, token_ids: frozenset[int]) -> bool:
        """Whether the request's grammar, where it stands, allows no next token but some of
        ``token_ids`` (the request's stop tokens: the output is complete). One mask row filled
        and read on the host; the scheduler asks only while min_tokens forbids the stop tokens,
        which would otherwise leave nothing to sample."""
        so = request.structured_output
        if so is None or not so.active:
            return False
        import xgrammar as xgr

        row = xgr.allocate_token_bitmask(1, self._model.vocab_size)
        so.matcher.fill_next_token_bitmask(row, 0)
        allowed = unpack_bitmask(row, self._model.vocab_size)[0].nonzero().flatten().tolist()
        return bool(allowed) and set(allowed) <= token_ids

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _ids(ids: Any, width: int) -> Any:
    return np.array(sorted({i for i in ids if 0 <= i < width}), dtype=np.int64)


def _bits(row: Any, ids: Any) -> Any:
    """Whether each of ``ids`` (an int64 array) is allowed in a mask row (uint32 words)."""
    return ((row[ids >> 5] >> (ids & 31).astype(row.dtype)) & 1).astype(bool)


def _without(row: Any, ids: Any) -> Any:
    """A copy of a mask row (uint32 words) with ``ids`` (an int64 array) forbidden."""
    rest = row.copy()
    np.bitwise_and.at(rest, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
    return rest


def _dead_end(request: Request, row: Any) -> tuple[str | None, str | None] | None:
    """``StructuredOutputManager.dead_ends`` for one request and its mask row (uint32 words):
    None when some token is left to sample. Mirrors the logits processors of
    ``kvik.layers.logits_processors`` that forbid tokens (allowed tokens, bad words, min
    tokens); logit bias and penalties keep logits finite."""
    params = request.sampling_params
    kind = params.structured_outputs.kind
    n = request.num_output_tokens
    where = "at the start of the output" if n == 0 else f"after {n} output token{'s' * (n != 1)}"
    if not row.any():
        return (
            f"the structured output constraint ({kind}) admits no token {where}: no text this "
            "model can generate satisfies it",
            "structured_outputs",
        )
    width = row.shape[0] * 32
    by_words = set(bad_word_endings(request.bad_words_token_ids, request.output_token_ids))
    by_min_tokens: set[int] = set()
    if n < params.min_tokens:
        by_min_tokens.update(params.stop_token_ids or ())
        if not params.ignore_eos:
            by_min_tokens.update(request.eos_token_ids)
    banned = by_words | by_min_tokens
    allowed = params.allowed_token_ids
    if allowed is not None:
        ids = _ids(allowed, width)
        admitted = set(ids[_bits(row, ids)].tolist())
        if admitted - banned:
            return None
    else:
        if not banned:
            return None
        ids = _ids(banned, width)
        if _without(row, ids).any():
            return None
        admitted = set(ids[_bits(row, ids)].tolist())
    # Nothing is left to sample.
    if not _without(row, _ids(request.eos_token_ids, width)).any():
        return None, None  # the grammar allows only its end: the output is complete
    constraint = f"the structured output constraint ({kind})"
    if not admitted:
        return (
            f"allowed_token_ids leave no token that {constraint} admits {where}: none of them "
            "can continue the output",
            "allowed_token_ids",
        )
    causes = []  # (the field at fault, how the message names it)
    if admitted & by_words:
        causes.append(("bad_words", "bad_words"))
    if admitted & by_min_tokens:
        causes.append(("min_tokens", f"min_tokens={params.min_tokens} (no stop token before it)"))
    verb = "forbids" if causes == [causes[0]] and causes[0][0] == "min_tokens" else "forbid"
    if allowed is not None:
        admits = f"both allowed_token_ids and {constraint} admit"
    else:
        admits = f"{constraint} admits"
    names = " and ".join(name for _, name in causes)
    return f"{names} {verb} every token that {admits} {where}", causes[0][0]


def check_settings(settings: StructuredOutputsConfig) -> None:
    """Refuse, when the engine starts, a backend or reasoning parser kvik does not have."""
    if settings.backend != "xgrammar":
        raise ValueError(
            f"structured outputs backend {settings.backend!r} is not built into kvik; use xgrammar"
        )
    parser = settings.reasoning_parser
    if parser is not None and parser not in REASONING_TOKENS:
        raise ValueError(
            f"unknown reasoning parser {parser!r}; known: {', '.join(sorted(REASONING_TOKENS))}"
        )
