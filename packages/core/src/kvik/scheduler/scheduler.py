"""The scheduler: one token budget per step, shared by every request, with no prefill/decode phases.

Each step every request advances ``num_computed_tokens`` toward ``num_tokens``. A prompt is a
request far behind; a decode is a request one token behind; a prefix-cache hit starts a request
ahead. That one rule gives continuous batching, chunked prefill and prefix caching together.

Asynchronous scheduling (``SchedulerConfig.async_scheduling``, vLLM V1's): the engine schedules
step N+1 while the device runs step N, before N's sampled tokens are known. A request that samples
in a step gets an output *placeholder* (``Request.num_output_placeholders``) until the token comes
back in ``update_from_output``; the scheduler plans with ``num_tokens + num_output_placeholders``
tokens, so a decoding request's next step computes its in-flight token, which the runner takes on
the device from the previous step's sampled tokens. The rules:

- The engine keeps at most one step in flight, so when ``schedule()`` runs a request has at most
  one placeholder, and only if it sampled in the step launched just before; scheduling it again
  makes two until that step is collected. The step that computes a placeholder is always a one-
  token decode, and ``ScheduledRequest.num_placeholder_tokens`` says so.
- A running request that is certain to finish when its in-flight tokens arrive (they reach
  ``max_tokens`` or ``max_model_len``) is not scheduled: no step is spent on a token to discard.
- A stop token (EOS, ``stop_token_ids``) is seen one step late: the request already has a step in
  flight, whose token ``update_from_output`` drops since the request is finished by then.
- A preempted request's in-flight token still arrives and is appended (it recomputes everything
  when readmitted), and it is not readmitted while a placeholder is outstanding.
- Block hashes and the prefix cache only ever cover known tokens (``all_token_ids``), never
  placeholders; see ``KVCacheManager.allocate_slots``.
- Logits processors that read a request's output history would see it one token short; the
  engine collects the in-flight step before scheduling when such a request has a token in flight
  (``must_collect_before_schedule``). A grammar (structured outputs) counts as one.

Speculative decoding (vLLM V1's): a running request carries the draft tokens its proposer made
after its last step (``Request.spec_token_ids``). The scheduler schedules them after the request's
last known token, within the token budget (a budget too small cuts the drafts first) and within
``max_tokens`` and ``max_model_len``; their KV slots are allocated like any token's, plus
``num_lookahead_tokens`` slots a draft model writes while proposing. After the step the accepted
tokens are appended one by one, each checked against the stop rules (a stop inside an accepted
run ends the request there), and ``num_computed_tokens`` is rolled back over the rejected drafts:
their KV slots are simply overwritten later, and no block hash ever covers them (hashes cover
known tokens only). Speculation runs with synchronous scheduling only (the EngineCore's rule).

Structured outputs: a waiting request whose grammar is still compiling is passed over (it keeps
its place) while the others are admitted; one whose grammar failed to compile finishes with
"error" (``RequestStatus.FINISHED_ERROR``: the request's own fault, stop_reason says why), its
output handed out by ``take_early_outputs``. So does a request whose constraint admits no token
where it stands (``fail_request``, called by the engine core when it fills the step's masks), and
one whose grammar refused a sampled token (only possible when its mask allowed nothing). A request
whose grammar has reached its end finishes with "stop". With speculation its drafts are cut, as
they arrive, to the prefix its grammar accepts (``StructuredOutputManager.valid_drafts``).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kvik.kv_cache.manager import KVCacheManager
from kvik.request import Request, RequestStatus
from kvik.scheduler.output import (
    EngineCoreOutput,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)
from kvik.spec_decode.metrics import SpecDecodingStats

if TYPE_CHECKING:
    from kvik.structured_output.manager import StructuredOutputManager


@dataclass
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    policy: Literal["fcfs", "priority"] = "fcfs"
    #: Schedule a step before the previous one's tokens are back (set by the EngineCore).
    async_scheduling: bool = False
    #: Speculative decoding: the most draft tokens a request proposes per step (0: off), and
    #: the KV slots allocated past a sampling request's scheduled tokens for a draft model to
    #: write while proposing (set by the EngineCore).
    num_speculative_tokens: int = 0
    num_lookahead_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunking a prompt runs whole, so a long one would wait forever.
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len when chunked prefill is off, "
                f"got {self.max_num_batched_tokens} < {self.max_model_len}"
            )


class _WaitingQueue:
    """Waiting requests in admission order: arrival (fcfs) or (priority, arrival) (priority).

    One heap serves both policies; under fcfs the key is a counter that runs up for new requests
    and down for preempted ones, which go back to the front.
    """

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._heap: list[tuple[tuple, Request]] = []
        self._back = 0
        self._front = 0

    def push(self, request: Request, front: bool = False) -> None:
        if front:
            self._front -= 1
            order = self._front
        else:
            self._back += 1
            order = self._back
        # The unique counter ends every key, so two requests are never compared.
        key = (order,) if self.policy == "fcfs" else (request.priority, request.arrival_time, order)
        heapq.heappush(self._heap, (key, request))

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def pop_entry(self) -> tuple[tuple, Request]:
        """The head with its key, for ``push_entry`` to put back in the same place."""
        return heapq.heappop(self._heap)

    def push_entry(self, entry: tuple[tuple, Request]) -> None:
        heapq.heappush(self._heap, entry)

    def remove(self, request: Request) -> None:
        self._heap = [item for item in self._heap if item[1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def requests(self) -> list[Request]:
        """Every waiting request, in no particular order."""
        return [request for _, request in self._heap]


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        structured_outputs: StructuredOutputManager | None = None,
    ) -> None:
        capacity = kv_cache_manager.num_blocks * kv_cache_manager.block_size
        if capacity < config.max_model_len:
            # A request at max_model_len could then never fit, even alone.
            raise ValueError(
                f"the KV cache holds {capacity} tokens, fewer than max_model_len="
                f"{config.max_model_len}"
            )
        self.config = config
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = _WaitingQueue(config.policy)
        self.running: list[Request] = []  # in admission order
        self._finished_since_schedule: set[str] = set()
        self._num_preemptions = 0
        self._num_prefill_chunks = 0
        self._num_steps = 0
        self.structured_outputs = structured_outputs
        # Outputs of requests finished outside a step (a grammar that failed to compile, or that
        # admits no token: fail_request).
        self._early_outputs: list[EngineCoreOutput] = []
        if config.num_speculative_tokens and config.async_scheduling:
            raise ValueError("speculative decoding runs with synchronous scheduling only")
        self.spec_stats = (
            SpecDecodingStats(config.num_speculative_tokens)
            if config.num_speculative_tokens
            else None
        )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.sampling_params.structured_outputs is not None:
            if self.structured_outputs is None:
                raise ValueError("this scheduler has no structured output manager")
            self.structured_outputs.add_request(request)
        # Registered only once nothing above can refuse it: a refused request leaves no trace.
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Abort unfinished requests, free their blocks, and return their final outputs at once.

        Unknown or already finished ids are ignored, since an abort may race a finish.
        """
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_ABORTED
            self._release(request)
            outputs.append(self._output(request, []))
        return outputs

    def fail_request(self, request: Request, message: str, param: str) -> None:
        """Finish an unfinished request with "error", the request's own fault (its constraint
        admits no token): ``message`` says why, ``param`` names the SamplingParams field at
        fault. Its output is handed out by ``take_early_outputs``. The request may be in the
        step just scheduled: its token from there is dropped, as an aborted request's."""
        self._finish_early(request, message, param)

    def stop_request(self, request: Request) -> None:
        """Finish an unfinished request with "stop" before its next token: its grammar allows
        only its end (EOS), which its other parameters forbid (allowed_token_ids, bad_words,
        min_tokens). The grammar wins, as in ``_check_stop``; otherwise as ``fail_request``."""
        self._finish_early(request)

    def _finish_early(
        self, request: Request, message: str | None = None, param: str | None = None
    ) -> None:
        if request.is_finished():
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        if message is None:
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self._finish_with_error(request, message, param)
        self._release(request)
        self._early_outputs.append(self._output(request, []))

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        preempted: set[str] = set()

        # Running requests first: they hold blocks already, and finishing them frees blocks.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self._finishes_in_flight(request):
                index += 1
                continue
            assert request.num_output_placeholders <= 1, "more than one step in flight"
            num_known = (
                request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
            )
            num_new = min(num_known + self._num_spec_tokens(request), budget)
            num_spec = max(0, num_new - num_known)
            end = request.num_computed_tokens + num_new
            num_slots = num_new + self._lookahead(end, num_new >= num_known)
            # Preempt until the blocks fit; the else branch runs unless the request was the victim.
            while self.kv.allocate_slots(request, num_slots) is None:
                victim_index = self._victim_index()
                victim = self.running.pop(victim_index)
                if victim_index < index:
                    index -= 1
                if victim.request_id in scheduled:
                    # Already scheduled in this step (priority policy): take its tokens back.
                    taken = scheduled.pop(victim.request_id)
                    budget += taken.num_tokens
                    if taken.samples and self.config.async_scheduling:
                        victim.num_output_placeholders -= 1
                    # Its allocation registered the blocks this step was to complete in the
                    # prefix cache; the step will not write them now.
                    self.kv.uncache_unwritten(victim, taken.start)
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = self._schedule(request, num_new, num_spec)
                budget -= num_new
                index += 1

        # Then waiting ones, unless blocks ran short this step: a preempted request must not come
        # straight back, and nothing is preempted to admit a newcomer.
        compiling: list[tuple[tuple, Request]] = []  # passed over, put back after the loop
        while (
            not preempted
            and len(self.waiting) > 0
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek()
            if request.num_output_placeholders:
                # Preempted with a token in flight: it may only start over once the token is
                # known, so that the recompute covers it. The head waits, keeping the order.
                break
            if request.structured_output is not None and not self._grammar_ready(request):
                entry = self.waiting.pop_entry()
                if not request.is_finished():
                    compiling.append(entry)
                continue
            hit_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            end = num_hit_tokens + num_new
            lookahead = self._lookahead(end, end == request.num_tokens)
            if (
                self.kv.allocate_slots(request, num_new + lookahead, hit_blocks, num_hit_tokens)
                is None
            ):
                break
            self.waiting.pop()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request.request_id] = self._schedule(request, num_new)
            budget -= num_new
        for entry in compiling:
            self.waiting.push_entry(entry)

        self._num_steps += 1
        finished, self._finished_since_schedule = self._finished_since_schedule, set()
        return SchedulerOutput(
            scheduled=list(scheduled.values()),
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            finished_req_ids=finished,
            preempted_req_ids=preempted,
        )

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled_token_ids: dict[str, list[int]],
        spec_token_ids: dict[str, list[int]] | None = None,
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply the stop rules, and free what finished.

        Returns one output per request that got tokens or finished. Stop strings are the front
        end's business: only the detokenizer sees text.

        Under asynchronous scheduling the output is that of an earlier ``schedule()`` than the
        last one: a request may have finished since (a stop seen in the step before, an abort),
        and then its token is dropped; or it may have been preempted since, and then the token
        is appended all the same (it is part of the sequence the request will recompute).

        Speculative decoding: ``sampled_token_ids`` holds each request's accepted drafts and the
        target's own token; ``spec_token_ids`` the drafts proposed for the next step.
        """
        outputs = []
        for item in scheduler_output.scheduled:
            request = item.request
            if not item.samples or request.is_finished():
                # A finished request's blocks are gone and its final output was given; under
                # asynchronous scheduling its blocks may have been freed while this step was
                # still writing into them, which is safe: see _release.
                continue
            if self.config.async_scheduling:
                request.num_output_placeholders -= 1
            preempted = request.status == RequestStatus.PREEMPTED
            generated = sampled_token_ids[request.request_id]
            if item.spec_token_ids:
                self._roll_back_rejected(request, item, generated)
            new_token_ids = []
            for token_id in generated:
                request.append_output_token(token_id)
                if request.structured_output is not None:
                    self.structured_outputs.accept_token(request, token_id)
                new_token_ids.append(token_id)
                if self._check_stop(request):
                    if preempted:  # preempted with this token in flight, which finished it
                        self.waiting.remove(request)
                    self._release(request)
                    break
            if not request.is_finished() and spec_token_ids is not None:
                drafts = list(spec_token_ids.get(request.request_id, ()))
                if request.structured_output is not None:
                    drafts = self.structured_outputs.valid_drafts(request, drafts)
                request.spec_token_ids = drafts
            outputs.append(self._output(request, new_token_ids))
        self.running = [r for r in self.running if not r.is_finished()]
        return outputs

    def must_collect_before_schedule(self) -> bool:
        """Whether the next ``schedule()`` must wait for the step in flight (asynchronous
        scheduling): true when a request it may schedule has a token in flight and a logits
        processor that reads the output history (``Request.needs_output_history``), which would
        otherwise see that history one token short. The engine then collects first, making that
        iteration synchronous. Only running requests can have a placeholder and be scheduled."""
        return any(
            request.num_output_placeholders > 0
            and request.needs_output_history
            and not self._finishes_in_flight(request)
            for request in self.running
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._early_outputs)

    def take_early_outputs(self) -> list[EngineCoreOutput]:
        """Outputs of requests finished between steps (their grammar did not compile, or admits
        no token: ``fail_request``)."""
        outputs, self._early_outputs = self._early_outputs, []
        return outputs

    def waiting_for_grammars(self) -> list[Request]:
        """Waiting requests whose grammar is still compiling."""
        return [
            request
            for request in self.waiting.requests()
            if request.structured_output is not None and request.structured_output.matcher is None
        ]

    def _grammar_ready(self, request: Request) -> bool:
        """Whether a waiting request's grammar is compiled; one that failed finishes ("error")."""
        if self.structured_outputs.is_ready(request):
            return True
        if request.structured_output.error is not None:
            self._finish_with_error(request, request.structured_output.error, "structured_outputs")
            self._release(request)
            self._early_outputs.append(self._output(request, []))
        return False

    @property
    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self._num_preemptions,
            num_prefill_chunks=self._num_prefill_chunks,
            num_steps=self._num_steps,
            spec_decoding=None if self.spec_stats is None else self.spec_stats.copy(),
        )

    def _num_spec_tokens(self, request: Request) -> int:
        """How many of the request's drafts may be scheduled: all of them, unless the drafts and
        the token after them would pass ``max_tokens`` or ``max_model_len`` (tokens past those
        would be dropped, and positions past ``max_model_len`` have no slot)."""
        if not request.spec_token_ids:
            return 0
        if request.num_computed_tokens != request.num_tokens - 1:
            return 0  # not decoding (a recompute after preemption): drafts are stale
        room = min(
            request.max_tokens - request.num_output_tokens,
            self.config.max_model_len - request.num_tokens,
        )
        return max(0, min(len(request.spec_token_ids), room - 1))

    def _lookahead(self, end: int, samples: bool) -> int:
        """KV slots a draft model writes past a sampling step's tokens (which end at ``end``)
        while proposing the drafts of the next step, within ``max_model_len``."""
        if not self.config.num_lookahead_tokens or not samples:
            return 0
        return max(0, min(self.config.num_lookahead_tokens, self.config.max_model_len - end))

    def _roll_back_rejected(
        self, request: Request, item: ScheduledRequest, generated: list[int]
    ) -> None:
        """Count a verification and forget the rejected drafts: ``generated`` holds the
        accepted drafts and one token more."""
        num_drafts = len(item.spec_token_ids)
        num_accepted = len(generated) - 1
        if not 0 <= num_accepted <= num_drafts:
            raise RuntimeError(
                f"request {request.request_id}: {len(generated)} tokens back for {num_drafts} "
                "drafts (expected 1 to drafts + 1)"
            )
        if self.spec_stats is not None:
            self.spec_stats.observe_draft(num_drafts, num_accepted)
        # Only accepted drafts' KV counts as computed; the new last token is computed next step.
        if request.status == RequestStatus.RUNNING:
            request.num_computed_tokens -= num_drafts - num_accepted

    def _schedule(self, request: Request, num_tokens: int, num_spec: int = 0) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_tokens
        if start < request.num_prompt_tokens and end < request.num_prompt_tokens:
            self._num_prefill_chunks += 1
        request.num_computed_tokens = end
        num_placeholder_tokens = max(0, end - num_spec - request.num_tokens)
        samples = end - num_spec == request.num_tokens + request.num_output_placeholders
        if samples and self.config.async_scheduling:
            request.num_output_placeholders += 1
        return ScheduledRequest(
            request=request,
            start=start,
            num_tokens=num_tokens,
            block_ids=self.kv.get_block_ids(request.request_id),
            samples=samples,
            num_placeholder_tokens=num_placeholder_tokens,
            spec_token_ids=tuple(request.spec_token_ids[:num_spec]) if num_spec else (),
        )

    def _finishes_in_flight(self, request: Request) -> bool:
        """Whether the request's in-flight tokens are certain to finish it (by length), so that a
        step for it would only compute a token to discard."""
        n = request.num_output_placeholders
        return n > 0 and (
            request.num_output_tokens + n >= request.max_tokens
            or request.num_tokens + n >= self.config.max_model_len
        )

    def _victim_index(self) -> int:
        """The running request to preempt: the last admitted, or the lowest priority (among
        equal priorities the latest arrival, and among equal arrivals the last admitted, which has
        done the least work: an offline batch's requests share one arrival time)."""
        if self.config.policy == "fcfs":
            return len(self.running) - 1
        return max(
            range(len(self.running)),
            key=lambda i: (self.running[i].priority, self.running[i].arrival_time, i),
        )

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.push(request, front=True)

    def _check_stop(self, request: Request) -> bool:
        """Apply the stop rules to the last token, setting the status; True when it finished."""
        params = request.sampling_params
        token_id = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return True
        so = request.structured_output
        if (
            so is not None
            and request.num_output_tokens < params.min_tokens
            and self.structured_outputs.allows_only(request, request.stop_token_set())
        ):
            # The output is complete (its grammar allows only a stop token next), and min_tokens
            # forbids those: nothing would be left to sample. The grammar wins; the request stops.
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if so is not None and so.rejected:
            # The grammar refused the token: the mask allowed nothing the sampler could pick (a
            # dead end the engine core's check before sampling did not see: a row of a
            # speculative step after the drafts).
            n = request.num_output_tokens - 1  # before the refused one
            self._finish_with_error(
                request,
                "no token satisfies the structured output constraint "
                f"({request.sampling_params.structured_outputs.kind}) together with the other "
                f"sampling parameters after {n} output token{'s' * (n != 1)}",
                "structured_outputs",
            )
            return True
        if so is not None and so.is_terminated():
            # The grammar allows nothing more.
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if (
            request.num_output_tokens >= request.max_tokens
            or request.num_tokens >= self.config.max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    @staticmethod
    def _finish_with_error(request: Request, message: str, param: str) -> None:
        request.status = RequestStatus.FINISHED_ERROR
        request.stop_reason = message
        request.error_param = param

    def _release(self, request: Request) -> None:
        """Forget a finished request; the caller takes it out of running or waiting.

        Under asynchronous scheduling a step that writes into the request's blocks may still be
        in flight (the request stopped on the token of the step before it, or was aborted; a
        preempted request's blocks are freed the same way). Freeing them at once is safe: they can
        only be handed out again, or hit in the prefix cache, by a later ``schedule()``, whose step
        is launched after the one in flight and so runs after it on the device's stream. That step
        sees what the late one wrote: the right contents for any block with a hash (hashes cover
        known tokens only, and those are the tokens the late step computed), and overwritten for
        any other. Nothing on the host reads KV blocks.
        """
        self.kv.free(request)
        del self.requests[request.request_id]
        request.num_output_placeholders = 0
        self._finished_since_schedule.add(request.request_id)

    def _output(self, request: Request, new_token_ids: list[int]) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            error_param=request.error_param,
        )
