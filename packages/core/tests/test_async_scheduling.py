"""Asynchronous scheduling: the scheduler's output placeholders and EngineCore's overlapped steps.

Most tests drive a real ``EngineCore`` (real scheduler and KV cache manager) over ``FakeDevice``, a
runner that keeps its own copy of every request's computed tokens (its "KV cache"), fills the
placeholder tokens from its previous launch's samples as the real runner does on the device, and
samples a token that is a function of the whole sequence it computed: any wrong, missing or
misplaced token changes every later one. Its steps can take time, as a device's would.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from kvik.config import CacheConfig, EngineConfig
from kvik.engine.core import EngineCore
from kvik.kv_cache import KVCacheManager
from kvik.platforms.base import Platform
from kvik.request import Request, RequestStatus
from kvik.sampling_params import SamplingParams
from kvik.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

EOS = 2
BLOCK_SIZE = 4


def sequence_token(request_id: str, sequence: list[int], num_prompt_tokens: int) -> int:
    """The fake model: the next token is a function of the whole sequence (never EOS)."""
    return 1000 + (sum(sequence) * 7 + len(sequence)) % 97


@dataclass
class Seen:
    """One request's share of a launched step, as the fake device saw it."""

    start: int
    tokens: list[int]  # after filling the placeholder
    num_placeholders: int
    samples: bool
    output_history: list[int]  # what a logits processor would read at launch


class FakePlatform(Platform):
    name = "fake"
    device_type = "cpu"


class FakeGpuPlatform(Platform):
    name = "fake-gpu"
    device_type = "cuda"


class FakePending:
    def __init__(self, device: FakeDevice, index: int, sampled: dict[str, int], done: float):
        self.device, self.index, self.sampled, self.done = device, index, sampled, done
        self.collected = False

    def collect(self) -> SimpleNamespace:
        assert not self.collected, "a step collected twice"
        assert self.index == self.device.num_collected, "steps collected out of order"
        self.collected = True
        self.device.num_collected += 1
        self.device.events.append(("collect_start", self.index, time.monotonic()))
        wait = self.done - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self.device.events.append(("collect_end", self.index, time.monotonic()))
        return SimpleNamespace(
            sampled_token_ids={rid: [t] for rid, t in self.sampled.items()},
            logprobs={},
            prompt_logprobs={},
        )


class FakeDevice:
    """A runner with ``launch`` / ``collect``: a step takes ``delay`` seconds of "device" time,
    queued behind the previous step, and ``collect`` waits for it."""

    backend = SimpleNamespace(name="fake")

    def __init__(
        self,
        token_fn: Callable[[str, list[int], int], int] = sequence_token,
        delay: float = 0.0,
    ) -> None:
        self.token_fn = token_fn
        self.delay = delay
        self.kv: dict[str, list[int]] = {}
        # The paged cache: (block id, offset) -> the token whose key and value are there.
        self.slots: dict[tuple[int, int], int] = {}
        self.prev_sampled: dict[str, int] = {}
        self.launches: list[dict[str, Seen]] = []
        self.outputs: list[SchedulerOutput] = []
        self.sampled: list[dict[str, int]] = []
        self.sample_counts: Counter[str] = Counter()
        self.events: list[tuple[str, int, float]] = []
        self.num_collected = 0
        self.busy_until = 0.0
        self.done_at: list[float] = []  # when each launched step finishes on the "device"

    def kv_cache_bytes_per_block(self) -> int:
        return 0  # the fake's cache holds nothing

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> SimpleNamespace:
        return self.launch(scheduler_output).collect()

    def launch(self, scheduler_output: SchedulerOutput) -> FakePending:
        index = len(self.launches)
        now = time.monotonic()
        self.events.append(("launch", index, now))
        seen: dict[str, Seen] = {}
        sampled: dict[str, int] = {}
        for s in scheduler_output.scheduled:
            request, rid = s.request, s.request.request_id
            known = request.all_token_ids
            end = s.start + s.num_tokens
            # The runner's contract: positions at or past len(all_token_ids) are in flight.
            num_unknown = max(0, end - len(known))
            assert num_unknown == s.num_placeholder_tokens
            assert num_unknown <= 1, f"{rid}: {num_unknown} unknown tokens in one step"
            tokens = list(known[s.start : end])
            if num_unknown:
                assert s.num_tokens == 1 and s.start == len(known), "a placeholder is a decode"
                assert rid in self.prev_sampled, f"{rid}: placeholder not sampled just before"
                tokens.append(self.prev_sampled[rid])
            for pos in range(s.start):  # what the step reads: the blocks' contents
                held = self.slots.get((s.block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE))
                assert held == known[pos], f"{rid}: position {pos} holds {held}, not {known[pos]}"
            for pos, token in enumerate(tokens, s.start):
                self.slots[(s.block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE)] = token
            kv = self.kv.setdefault(rid, [])
            if len(kv) < s.start:  # a prefix-cache hit: positions computed from known tokens
                assert s.start <= len(known)
                kv.extend(known[len(kv) : s.start])
            assert kv[: s.start] == known[: s.start], f"{rid}: computed prefix is not the known one"
            del kv[s.start :]
            kv.extend(tokens)
            seen[rid] = Seen(
                s.start, tokens, num_unknown, s.samples, list(request.output_token_ids)
            )
            if s.samples:
                sampled[rid] = self.token_fn(rid, list(kv), request.num_prompt_tokens)
                self.sample_counts[rid] += 1
        self.prev_sampled = sampled
        self.launches.append(seen)
        self.outputs.append(scheduler_output)
        self.sampled.append(sampled)
        done = max(now, self.busy_until) + (self.delay if scheduler_output.scheduled else 0.0)
        self.busy_until = done
        self.done_at.append(done)
        return FakePending(self, index, sampled, done)


def make_engine(
    async_scheduling: bool | None,
    device: FakeDevice | None = None,
    num_blocks: int = 64,
    max_model_len: int = 64,
    platform: type[Platform] = FakePlatform,
    prefix_caching: bool = True,
    **scheduler,
) -> EngineCore:
    config = EngineConfig(
        model=SimpleNamespace(max_model_len=max_model_len, seed=0),  # all the core reads of it
        cache=CacheConfig(
            block_size=BLOCK_SIZE, num_blocks=num_blocks, enable_prefix_caching=prefix_caching
        ),
        scheduler=SchedulerConfig(max_model_len=max_model_len, **scheduler),
        async_scheduling=async_scheduling,
    )
    engine = EngineCore(config, platform=platform, runner=device or FakeDevice())
    _check_each_schedule(engine)
    return engine


def _check_each_schedule(engine: EngineCore) -> None:
    """Wrap schedule() with the placeholder and prefix-cache invariants, and log its timing."""
    scheduler = engine.scheduler
    schedule = scheduler.schedule
    engine.preempted_with_placeholder = 0

    def known_only() -> None:
        for request in scheduler.requests.values():
            # Hashes and cached blocks cover known tokens only, never a placeholder.
            assert len(request.block_hashes) * BLOCK_SIZE <= request.num_tokens
            cached = scheduler.kv.num_cached_blocks.get(request.request_id, 0)
            assert cached * BLOCK_SIZE <= request.num_tokens

    def checked() -> SchedulerOutput:
        engine.runner.events.append(("schedule", len(engine.runner.launches), time.monotonic()))
        for request in scheduler.requests.values():
            assert request.num_output_placeholders <= 1, request.request_id
            if not engine.async_scheduling:
                assert request.num_output_placeholders == 0
        known_only()
        out = schedule()
        known_only()
        for s in out.scheduled:
            assert s.request.num_output_placeholders <= (2 if engine.async_scheduling else 0)
        for rid in out.preempted_req_ids:
            engine.preempted_with_placeholder += scheduler.requests[rid].num_output_placeholders > 0
        engine.runner.events.append(("scheduled", len(engine.runner.launches), time.monotonic()))
        return out

    scheduler.schedule = checked


def make_request(
    rid: str, prompt: int | list[int], max_tokens: int = 8, priority: int = 0, **sp
) -> Request:
    if isinstance(prompt, int):  # distinct tokens per request id, so no prefix is shared
        start = 100 * (1 + sum(rid.encode()) % 50)
        prompt = list(range(start, start + prompt))
    return Request(
        rid,
        prompt,
        SamplingParams(**sp),
        max_tokens=max_tokens,
        eos_token_ids=frozenset({EOS}),
        priority=priority,
    )


def run(engine: EngineCore, requests: list[Request], max_steps: int = 2000):
    """Step until done; returns (tokens by request id, finish reason by request id)."""
    for request in requests:
        engine.add_request(request)
    return drain(engine, max_steps)


def drain(engine: EngineCore, max_steps: int = 2000, tokens=None, finished=None):
    tokens = {} if tokens is None else tokens
    finished = {} if finished is None else finished
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            assert out.request_id not in finished, f"output after the end: {out}"
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished[out.request_id] = out.finish_reason
        engine.kv_cache_manager.check_invariants()
    assert not engine.has_unfinished_requests()
    assert engine._in_flight is None
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    return tokens, finished


def mixed_requests() -> list[Request]:
    shared = list(range(300, 311))  # 11 tokens: two full blocks shared by two requests
    return [
        make_request("a", 5, max_tokens=1),
        make_request("b", 9, max_tokens=2),
        make_request("c", 13, max_tokens=3),
        make_request("d", shared + [7, 8], max_tokens=5),
        make_request("e", shared + [9], max_tokens=8),
        make_request("f", 30, max_tokens=9),  # chunked prefill with a budget of 16
        make_request("g", 10, max_tokens=100),  # capped by max_model_len=40: 30 tokens
        make_request("h", 7, max_tokens=21, min_tokens=3),  # history needed for 3 tokens
    ]


# --- the engine's decision ------------------------------------------------------------------


def test_async_scheduling_decided_in_one_place() -> None:
    assert make_engine(None).async_scheduling is False  # a CPU platform: off
    assert make_engine(None, platform=FakeGpuPlatform).async_scheduling is True
    for choice in (True, False):
        engine = make_engine(choice, platform=FakeGpuPlatform)
        assert engine.async_scheduling is choice
        assert engine.scheduler.config.async_scheduling is choice
        assert engine.config.async_scheduling is choice


# --- (a) the same tokens either way ---------------------------------------------------------


def test_token_streams_equal_with_and_without_async() -> None:
    results = {}
    devices = {}
    for mode in (False, True):
        devices[mode] = FakeDevice()
        engine = make_engine(
            mode, devices[mode], max_model_len=40, max_num_batched_tokens=16, num_blocks=96
        )
        results[mode] = run(engine, mixed_requests())
    assert results[True] == results[False]
    tokens, finished = results[True]
    expected_lengths = {"a": 1, "b": 2, "c": 3, "d": 5, "e": 8, "f": 9, "g": 30, "h": 21}
    assert {rid: len(t) for rid, t in tokens.items()} == expected_lengths
    assert set(finished.values()) == {"length"}
    for mode in (False, True):
        # max_tokens and max_model_len exactly: no step samples a token to throw away.
        assert dict(devices[mode].sample_counts) == expected_lengths
    # Async really ran ahead: decodes computed their in-flight token ...
    placeholders = sum(s.num_placeholders for step in devices[True].launches for s in step.values())
    assert placeholders > 50
    assert all(s.num_placeholders == 0 for step in devices[False].launches for s in step.values())
    # ... and the shared prefix was a cache hit in both modes.
    assert any(
        s.start == 8 for step in devices[True].launches for rid, s in step.items() if rid == "e"
    )


def test_scheduled_token_counts() -> None:
    device = FakeDevice()
    engine = make_engine(True, device, max_num_batched_tokens=16)
    run(engine, [make_request("q", 3, max_tokens=4), make_request("p", 20, max_tokens=4)])
    by_request: dict[str, list[tuple[int, int, int]]] = {}
    for out in device.outputs:
        assert out.total_num_scheduled_tokens == sum(s.num_tokens for s in out.scheduled)
        for s in out.scheduled:
            by_request.setdefault(s.request.request_id, []).append(
                (s.start, s.num_tokens, s.num_placeholder_tokens)
            )
    # q: its prompt, then each decode computes the token still in flight (position 3, 4, 5).
    assert by_request["q"] == [(0, 3, 0), (3, 1, 1), (4, 1, 1), (5, 1, 1)]
    # p: 13 of 16 tokens beside q's prompt, the rest of its prompt, then decodes.
    assert by_request["p"] == [(0, 13, 0), (13, 7, 0), (20, 1, 1), (21, 1, 1), (22, 1, 1)]


def test_generated_blocks_are_cached_once_known() -> None:
    results = {}
    for mode in (False, True):
        engine = make_engine(mode)
        first = make_request("x", 6, max_tokens=10)
        run(engine, [first])
        # 16 tokens; the first three blocks were computed, the last one holds a token never
        # computed. Blocks 1 and 2 hold generated tokens: under async scheduling each was hashed
        # only once its last token had come back, a step after the step that computed it.
        follow = make_request("y", first.all_token_ids[:13], max_tokens=3)
        results[mode] = run(engine, [follow])
        assert follow.num_cached_tokens == 12
    assert results[True] == results[False]


# --- (b) placeholders -------------------------------------------------------------------------


def test_at_most_one_placeholder_and_only_from_the_previous_step() -> None:
    device = FakeDevice()
    engine = make_engine(True, device, max_model_len=40, max_num_batched_tokens=16, num_blocks=96)
    for request in mixed_requests():
        engine.add_request(request)
    max_seen = 0
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.requests.values():
            # Between steps one step is in flight: one placeholder per request that sampled in it.
            max_seen = max(max_seen, request.num_output_placeholders)
            assert request.num_output_placeholders <= 1
        in_flight = engine._in_flight
        if in_flight is not None:
            sampling = {
                s.request.request_id
                for s in in_flight.scheduler_output.scheduled
                if s.samples and not s.request.is_finished()
            }
            with_placeholder = {
                r.request_id
                for r in engine.scheduler.requests.values()
                if r.num_output_placeholders
            }
            assert with_placeholder == sampling
    assert max_seen == 1
    # FakeDevice asserted every placeholder is one token sampled by the step launched just before.
    for previous, step in zip(device.sampled, device.launches[1:]):
        for rid, seen in step.items():
            if seen.num_placeholders:
                assert seen.tokens == [previous[rid]]


# --- (c) stops seen a step late, and length limits --------------------------------------------


def test_late_stop_discards_the_extra_token() -> None:
    def token_fn(rid: str, sequence: list[int], num_prompt: int) -> int:
        num_output = len(sequence) - num_prompt  # tokens generated before this one
        if rid == "eos" and num_output == 3:
            return EOS
        if rid == "stop" and num_output == 5:
            return 77
        return sequence_token(rid, sequence, num_prompt)

    results, devices = {}, {}
    for mode in (False, True):
        devices[mode] = FakeDevice(token_fn)
        requests = [
            make_request("eos", 6, max_tokens=10),
            make_request("stop", 7, max_tokens=10, stop_token_ids=[77]),
            make_request("len", 5, max_tokens=6),
            make_request("one", 4, max_tokens=1),
        ]
        results[mode] = run(make_engine(mode, devices[mode]), requests)
    assert results[True] == results[False]
    tokens, finished = results[True]
    assert tokens["eos"][-1] == EOS and len(tokens["eos"]) == 4
    assert tokens["stop"][-1] == 77 and len(tokens["stop"]) == 6
    assert finished == {"eos": "stop", "stop": "stop", "len": "length", "one": "length"}
    assert len(tokens["len"]) == 6 and len(tokens["one"]) == 1
    # Synchronous: one sampling step per token. Asynchronous: a stop token is known one step
    # late, so one more token was computed and dropped; length limits cost nothing extra.
    assert devices[False].sample_counts == {"eos": 4, "stop": 6, "len": 6, "one": 1}
    assert devices[True].sample_counts == {"eos": 5, "stop": 7, "len": 6, "one": 1}
    # The dropped token is the one after EOS, sampled by the step that computed EOS itself.
    last = [i for i, step in enumerate(devices[True].launches) if "eos" in step][-1]
    assert devices[True].launches[last]["eos"].tokens == [EOS]
    assert "eos" in devices[True].sampled[last]


# --- (d) abort while a step is in flight ------------------------------------------------------


def test_abort_while_in_flight() -> None:
    reference, _ = run(
        make_engine(False), [make_request("a", 6, max_tokens=8), make_request("b", 9, max_tokens=8)]
    )
    device = FakeDevice()
    engine = make_engine(True, device)
    for request in (make_request("a", 6, max_tokens=8), make_request("b", 9, max_tokens=8)):
        engine.add_request(request)
    tokens: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    assert engine.step() == []  # step 0 launched, nothing collected yet
    for _ in range(3):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine._in_flight is not None
    assert "a" in {s.request.request_id for s in engine._in_flight.scheduler_output.scheduled}
    (aborted,) = engine.abort_requests(["a"])
    assert aborted.finish_reason == "abort" and aborted.new_token_ids == []
    finished["a"] = "abort"
    num_launches = len(device.launches)
    drain(engine, tokens=tokens, finished=finished)  # asserts nothing more arrives for "a"
    assert tokens["a"] == reference["a"][:3]  # what came before the abort
    assert tokens["b"] == reference["b"] and finished["b"] == "length"
    # The in-flight step sampled a token for "a" that was dropped, and the next launch told the
    # runner "a" is finished; nothing scheduled it again.
    assert "a" in device.sampled[num_launches - 1]
    assert "a" in device.outputs[num_launches].finished_req_ids
    assert all("a" not in step for step in device.launches[num_launches:])


# --- (e) preemption with a token in flight ----------------------------------------------------


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_with_a_token_in_flight(policy: str) -> None:
    def requests() -> list[Request]:
        made = [make_request(f"r{i}", 5 + i, max_tokens=10) for i in range(4)]
        for i, request in enumerate(made):
            request.priority = i % 2
        return made

    results = {}
    engines = {}
    for mode in (False, True):
        engines[mode] = make_engine(
            mode, num_blocks=8, max_model_len=20, max_num_batched_tokens=16, policy=policy
        )
        results[mode] = run(engines[mode], requests())
    assert results[True] == results[False]
    assert all(len(t) == 10 for t in results[True][0].values())
    assert engines[True].scheduler.stats.num_preemptions > 0
    # Victims had their last token in flight: it was appended and recomputed on readmission.
    assert engines[True].preempted_with_placeholder > 0


def test_preempted_request_waits_for_its_token_before_readmission() -> None:
    scheduler = Scheduler(
        SchedulerConfig(max_model_len=32, async_scheduling=True), KVCacheManager(16, BLOCK_SIZE)
    )
    request = make_request("r", 6, max_tokens=5)
    scheduler.add_request(request)
    first = scheduler.schedule()
    assert first.scheduled[0].samples and request.num_output_placeholders == 1
    scheduler._preempt(scheduler.running.pop())  # preempted while its first token is in flight
    assert scheduler.schedule().scheduled == []  # not readmitted: its token is not known yet
    scheduler.update_from_output(first, {"r": [500]})
    assert request.output_token_ids == [500] and request.num_output_placeholders == 0
    (readmitted,) = scheduler.schedule().scheduled
    # It starts over on its known tokens (the first block is a prefix-cache hit), token included.
    assert (readmitted.start, readmitted.num_tokens) == (4, 3)
    assert readmitted.samples and readmitted.num_placeholder_tokens == 0


def test_priority_victim_already_scheduled_gives_its_placeholder_back() -> None:
    scheduler = Scheduler(
        SchedulerConfig(max_model_len=16, policy="priority", async_scheduling=True),
        KVCacheManager(4, BLOCK_SIZE, enable_caching=False),
    )
    low = make_request("low", 4, max_tokens=8, priority=1)
    scheduler.add_request(low)
    step0 = scheduler.schedule()
    scheduler.update_from_output(step0, {"low": [500]})
    high = make_request("high", 8, max_tokens=8)
    scheduler.add_request(high)
    step1 = scheduler.schedule()  # both sample: one placeholder each, every block in use
    assert (low.num_output_placeholders, high.num_output_placeholders) == (1, 1)
    # Step 1 in flight: "low" is scheduled first (admitted first), then "high" needs a block and
    # the lowest priority, "low", is the victim: its share of this step is taken back.
    step2 = scheduler.schedule()
    assert [s.request.request_id for s in step2.scheduled] == ["high"]
    assert step2.preempted_req_ids == {"low"}
    assert low.num_output_placeholders == 1  # step 1's token only
    scheduler.update_from_output(step1, {"low": [501], "high": [600]})
    assert low.output_token_ids == [500, 501] and low.num_output_placeholders == 0
    scheduler.update_from_output(step2, {"high": [601]})
    assert high.output_token_ids == [600, 601] and high.num_output_placeholders == 0


def test_preempted_request_finished_by_its_in_flight_token() -> None:
    scheduler = Scheduler(
        SchedulerConfig(max_model_len=32, async_scheduling=True), KVCacheManager(16, BLOCK_SIZE)
    )
    request = make_request("r", 6, max_tokens=1)
    scheduler.add_request(request)
    first = scheduler.schedule()
    scheduler._preempt(scheduler.running.pop())
    (out,) = scheduler.update_from_output(first, {"r": [500]})
    assert out.finish_reason == "length" and out.new_token_ids == [500]
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert len(scheduler.waiting) == 0 and not scheduler.has_unfinished_requests()
    assert scheduler.kv.num_free_blocks == 16


# --- logits processors that read the output history ------------------------------------------


def test_history_reading_requests_never_sample_with_a_token_in_flight() -> None:
    device = FakeDevice()
    engine = make_engine(True, device)
    history = {
        "rep": make_request("rep", 5, max_tokens=6, repetition_penalty=1.3),
        "pres": make_request("pres", 6, max_tokens=6, presence_penalty=0.5),
        "freq": make_request("freq", 7, max_tokens=6, frequency_penalty=0.5),
        "min": make_request("min", 8, max_tokens=8, min_tokens=4),
    }
    history["bad"] = make_request("bad", 9, max_tokens=6)
    history["bad"].bad_words_token_ids = [[5, 6]]
    plain = make_request("plain", 4, max_tokens=12)
    tokens, _ = run(engine, [*history.values(), plain])
    reference, _ = run(
        make_engine(False),
        [
            make_request("rep", 5, max_tokens=6, repetition_penalty=1.3),
            make_request("plain", 4, max_tokens=12),
        ],
    )
    assert tokens["rep"] == reference["rep"] and tokens["plain"] == reference["plain"]
    for step in device.launches:
        for rid, seen in step.items():
            if rid in ("rep", "pres", "freq", "bad") and seen.samples:
                # Sampled with its whole output known: the processors see the real history.
                assert seen.num_placeholders == 0
                num_outputs = seen.start + len(seen.tokens) - history[rid].num_prompt_tokens
                assert len(seen.output_history) == num_outputs
    # min_tokens reads the history only while short of it: async resumes after 4 tokens.
    min_steps = [step["min"] for step in device.launches if "min" in step]
    assert all(s.num_placeholders == 0 for s in min_steps[:5])  # prompt + 4 tokens
    assert any(s.num_placeholders for s in min_steps[5:])
    # Once the history readers finished, the plain request ran ahead again.
    last_plain = [step["plain"] for step in device.launches if "plain" in step][-1]
    assert last_plain.num_placeholders == 1


# --- (f) the overlap is real ------------------------------------------------------------------


def test_schedule_overlaps_the_device_step() -> None:
    delay, host = 0.05, 0.03  # the device's step, and the host's scheduling cost
    elapsed = {}
    devices = {}
    num_tokens = 12
    for mode in (False, True):
        devices[mode] = FakeDevice(delay=delay)
        engine = make_engine(mode, devices[mode])
        schedule = engine.scheduler.schedule

        def slow_schedule(schedule=schedule) -> SchedulerOutput:
            time.sleep(host)
            return schedule()

        engine.scheduler.schedule = slow_schedule
        started = time.monotonic()
        tokens, _ = run(engine, [make_request("x", 6, max_tokens=num_tokens)])
        elapsed[mode] = time.monotonic() - started
        assert len(tokens["x"]) == num_tokens

    events = devices[True].events
    at = {(kind, index): t for kind, index, t in events}
    order = [(kind, index) for kind, index, _ in events]
    for n in range(num_tokens - 1):
        # Step n+1 was scheduled and launched before step n's collect returned ...
        assert order.index(("scheduled", n + 1)) < order.index(("collect_end", n))
        assert at[("launch", n + 1)] < at[("collect_end", n)]
    # ... and, mostly, while the device was still busy with step n (a loaded machine may delay
    # the host now and then).
    done = devices[True].done_at
    overlapped = sum(at[("scheduled", n + 1)] < done[n] for n in range(num_tokens - 1))
    assert overlapped >= (num_tokens - 1) // 2
    # Synchronous steps cost at least host + device each; overlapped ones about the larger.
    assert elapsed[False] >= num_tokens * (delay + host)
    assert elapsed[True] < num_tokens * (delay + host) - 3 * host


# --- the engine process's loop ----------------------------------------------------------------


def test_core_proc_step_with_async_scheduling() -> None:
    import msgspec

    from kvik.engine.core_proc import EngineCoreOutputs, EngineCoreProc

    class Socket:
        def __init__(self) -> None:
            self.sent: list[bytes] = []

        def send(self, data: bytes) -> None:
            self.sent.append(data)

    engine = make_engine(True)
    socket = Socket()
    proc = EngineCoreProc(engine, None, socket)
    requests = [make_request("a", 5, max_tokens=3), make_request("b", 6, max_tokens=5)]
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished_requests():
        proc._step()
    decoder = msgspec.msgpack.Decoder(tuple[str, EngineCoreOutputs])
    tokens: dict[str, list[int]] = {}
    first_scheduled: Counter[str] = Counter()
    for data in socket.sent:
        kind, payload = decoder.decode(data)
        assert kind == "outputs"
        first_scheduled.update(payload.scheduled.keys())
        for out in payload.outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert first_scheduled == {"a": 1, "b": 1}  # queue time reported once per request
    assert proc.seen_scheduled == set()
    assert {rid: len(t) for rid, t in tokens.items()} == {"a": 3, "b": 5}


# --- end to end on the CPU engine -------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    pytest.importorskip("kvik_cpu", reason="the CPU platform is not installed")
    pytest.importorskip("kvik_models", reason="kvik-models is not installed")
    pytest.importorskip("transformers")
    from tiny_models import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def test_cpu_engine_same_outputs_with_async_scheduling(tiny_llama) -> None:
    from kvik import LLM

    prompts = [[(13 * i + 7 * j) % 250 + 3 for j in range(5 + 6 * i)] for i in range(4)]
    greedy = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)
        for n in (1, 4, 9, 17)
    ]
    others = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.5),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, min_tokens=3),
    ]
    all_prompts = prompts + prompts[1:4]
    all_params = greedy + others

    def generate(llm, params):
        outputs = llm.generate(all_prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs], outputs

    results, raw, llms = {}, {}, {}
    for mode in (False, True):
        llms[mode] = LLM(
            str(tiny_llama),
            dtype="float32",
            num_kv_blocks=64,
            max_num_batched_tokens=24,
            enforce_eager=True,
            async_scheduling=mode,
        )
        assert llms[mode].engine.async_scheduling is mode
        launch = llms[mode].engine.runner.launch
        counts = Counter()

        def counting_launch(scheduler_output, launch=launch, counts=counts):
            counts["placeholders"] += sum(
                s.num_placeholder_tokens for s in scheduler_output.scheduled
            )
            return launch(scheduler_output)

        llms[mode].engine.runner.launch = counting_launch
        results[mode], raw[mode] = generate(llms[mode], all_params)
        assert (counts["placeholders"] > 0) is mode
    assert results[True] == results[False]
    assert [len(t) for t, _ in results[True]] == [1, 4, 9, 17, 8, 10, 7]
    for a, b in zip(raw[True][:4], raw[False][:4]):
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            assert all(abs(la[k].logprob - lb[k].logprob) < 1e-5 for k in la)

    # A stop token seen a step late: pick one the greedy run emits, and stop on it.
    tokens = results[False][3][0]
    stop_at = next((i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i]), 0)
    stop = SamplingParams(
        temperature=0.0, max_tokens=17, ignore_eos=True, stop_token_ids=[tokens[stop_at]]
    )
    stopped = {
        mode: llms[mode].generate([prompts[3]], stop, use_tqdm=False)[0].outputs[0]
        for mode in (False, True)
    }
    for mode in (False, True):
        assert stopped[mode].token_ids == tokens[: stop_at + 1]
        assert stopped[mode].finish_reason == "stop"
        assert not llms[mode].engine.has_unfinished_requests()
