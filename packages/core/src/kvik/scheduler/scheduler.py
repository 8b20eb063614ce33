"""The scheduler: one token budget per step, shared by every request, with no prefill/decode phases.

Each step every request advances ``num_computed_tokens`` toward ``num_tokens``. A prompt is a
request far behind; a decode is a request one token behind; a prefix-cache hit starts a request
ahead. That one rule gives continuous batching, chunked prefill and prefix caching together.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from kvik.kv_cache.manager import KVCacheManager
from kvik.request import Request, RequestStatus
from kvik.scheduler.output import (
    EngineCoreOutput,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)


@dataclass
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    policy: Literal["fcfs", "priority"] = "fcfs"

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

    def remove(self, request: Request) -> None:
        self._heap = [item for item in self._heap if item[1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
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

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
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

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        preempted: set[str] = set()

        # Running requests first: they hold blocks already, and finishing them frees blocks.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            # Preempt until the blocks fit; the else branch runs unless the request was the victim.
            while self.kv.allocate_slots(request, num_new) is None:
                victim_index = self._victim_index()
                victim = self.running.pop(victim_index)
                if victim_index < index:
                    index -= 1
                if victim.request_id in scheduled:
                    # Already scheduled in this step (priority policy): take its tokens back.
                    budget += scheduled.pop(victim.request_id).num_tokens
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = self._schedule(request, num_new)
                budget -= num_new
                index += 1

        # Then waiting ones, unless blocks ran short this step: a preempted request must not come
        # straight back, and nothing is preempted to admit a newcomer.
        while (
            not preempted
            and len(self.waiting) > 0
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek()
            hit_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if self.kv.allocate_slots(request, num_new, hit_blocks, num_hit_tokens) is None:
                break
            self.waiting.pop()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request.request_id] = self._schedule(request, num_new)
            budget -= num_new

        self._num_steps += 1
        finished, self._finished_since_schedule = self._finished_since_schedule, set()
        return SchedulerOutput(
            scheduled=list(scheduled.values()),
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            finished_req_ids=finished,
            preempted_req_ids=preempted,
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, list[int]]
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply the stop rules, and free what finished.

        Returns one output per request that got tokens or finished. Stop strings are the front
        end's business: only the detokenizer sees text.
        """
        outputs = []
        for item in scheduler_output.scheduled:
            request = item.request
            # Aborted since schedule(): its blocks are gone and its output was already given.
            if not item.samples or request.is_finished():
                continue
            new_token_ids = []
            for token_id in sampled_token_ids[request.request_id]:
                request.append_output_token(token_id)
                new_token_ids.append(token_id)
                if self._check_stop(request):
                    self._release(request)
                    break
            outputs.append(self._output(request, new_token_ids))
        self.running = [r for r in self.running if not r.is_finished()]
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished(self) -> int:
        return len(self.requests)

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
        )

    def _schedule(self, request: Request, num_tokens: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_tokens
        if start < request.num_prompt_tokens and end < request.num_prompt_tokens:
            self._num_prefill_chunks += 1
        request.num_computed_tokens = end
        return ScheduledRequest(
            request=request,
            start=start,
            num_tokens=num_tokens,
            block_ids=self.kv.get_block_ids(request.request_id),
            samples=end == request.num_tokens,
        )

    def _victim_index(self) -> int:
        """The running request to preempt: the last admitted, or the lowest priority."""
        if self.config.policy == "fcfs":
            return len(self.running) - 1
        return max(
            range(len(self.running)),
            key=lambda i: (self.running[i].priority, self.running[i].arrival_time),
        )

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
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
        if (
            request.num_output_tokens >= request.max_tokens
            or request.num_tokens >= self.config.max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _release(self, request: Request) -> None:
        """Forget a finished request; the caller takes it out of running or waiting."""
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_since_schedule.add(request.request_id)

    def _output(self, request: Request, new_token_ids: list[int]) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )
