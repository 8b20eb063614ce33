from __future__ import annotations

import weakref
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvik.kv_cache import KVCacheManager
from kvik.request import Request, RequestStatus
from kvik.sampling_params import SamplingParams
from kvik.scheduler import EngineCoreOutput, Scheduler, SchedulerConfig, SchedulerOutput

EOS = 2


def make_scheduler(num_blocks: int = 64, block_size: int = 4, **config) -> Scheduler:
    config.setdefault("max_model_len", 64)
    return Scheduler(SchedulerConfig(**config), KVCacheManager(num_blocks, block_size))


def make_request(
    rid: str, prompt: int | list[int], max_tokens: int = 8, priority: int = 0, **sp
) -> Request:
    if isinstance(prompt, int):  # distinct tokens per request id, so no prefix is shared
        start = 100 * (1 + sum(rid.encode()))
        prompt = list(range(start, start + prompt))
    return Request(
        rid,
        prompt,
        SamplingParams(**sp),
        max_tokens=max_tokens,
        eos_token_ids=frozenset({EOS}),
        priority=priority,
    )


def fake_token(request: Request) -> int:
    # A function of the whole sequence, so a recomputed request samples the same tokens.
    return 1000 + sum(request.all_token_ids) % 97


# A fake device's KV cache per scheduler: (block id, offset) -> the token id written there.
_kv_slots: weakref.WeakKeyDictionary[Scheduler, dict[tuple[int, int], int]] = (
    weakref.WeakKeyDictionary()
)


def read_and_write_kv(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """Run a step on the fake KV cache: each scheduled request's computed tokens must be in its
    blocks already (a prefix hit on a block that no step wrote, or wrote with other tokens, would
    read stale KV), then the step writes its tokens (drafts included) into their slots."""
    slots = _kv_slots.setdefault(scheduler, {})
    size = scheduler.kv.block_size
    for s in out.scheduled:
        tokens = [*s.request.all_token_ids, *s.spec_token_ids]
        for pos in range(s.start):
            held = slots.get((s.block_ids[pos // size], pos % size))
            assert held == tokens[pos], (
                f"request {s.request.request_id} reads {held} at position {pos} of block "
                f"{s.block_ids[pos // size]}, not its token {tokens[pos]}"
            )
        for pos in range(s.start, s.start + s.num_tokens):
            slots[(s.block_ids[pos // size], pos % size)] = tokens[pos]


def step(
    scheduler: Scheduler, sample: Callable[[Request], int] = fake_token
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    out = scheduler.schedule()
    read_and_write_kv(scheduler, out)
    assert out.total_num_scheduled_tokens == sum(s.num_tokens for s in out.scheduled)
    assert out.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    assert not out.preempted_req_ids & {s.request.request_id for s in out.scheduled}
    for s in out.scheduled:
        assert s.block_ids == scheduler.kv.get_block_ids(s.request.request_id)
        assert len(s.block_ids) * scheduler.kv.block_size >= s.start + s.num_tokens
    sampled = {s.request.request_id: [sample(s.request)] for s in out.scheduled if s.samples}
    outputs = scheduler.update_from_output(out, sampled)
    scheduler.kv.check_invariants()
    return out, outputs


def run(scheduler: Scheduler, sample: Callable[[Request], int] = fake_token, max_steps: int = 500):
    """Step until nothing is left; returns every output by request id."""
    by_id: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        for o in step(scheduler, sample)[1]:
            by_id.setdefault(o.request_id, []).append(o)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    return by_id


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= max_model_len"):
        SchedulerConfig(max_model_len=100, max_num_batched_tokens=64, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(max_model_len=10, policy="lifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_model_len"):
        Scheduler(SchedulerConfig(max_model_len=100), KVCacheManager(4, 4))


def test_budget_and_max_num_seqs() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=20, max_num_seqs=3)
    requests = [make_request(str(i), 7, max_tokens=5) for i in range(6)]
    for request in requests:
        scheduler.add_request(request)
    out, _ = step(scheduler)
    # 7 + 7 + 6 (chunked) tokens; the 4th request waits for a free seat.
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [
        ("0", 7),
        ("1", 7),
        ("2", 6),
    ]
    assert [s.samples for s in out.scheduled] == [True, True, False]
    assert scheduler.stats.num_running == 3 and scheduler.stats.num_waiting == 3
    run(scheduler)
    assert [r.num_output_tokens for r in requests] == [5] * 6


def test_chunked_prefill() -> None:
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=32, max_model_len=128)
    request = make_request("r", 100, max_tokens=2)
    scheduler.add_request(request)
    chunks = []
    for _ in range(4):
        out, outputs = step(scheduler)
        (s,) = out.scheduled
        chunks.append((s.start, s.num_tokens, s.samples))
        assert bool(outputs) == s.samples
    assert chunks == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
    assert scheduler.stats.num_prefill_chunks == 3 and scheduler.stats.num_steps == 4
    assert request.num_output_tokens == 1


def test_no_chunking_runs_a_prompt_whole_or_not_at_all() -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=30, max_model_len=30, enable_chunked_prefill=False
    )
    scheduler.add_request(make_request("a", 20))
    scheduler.add_request(make_request("b", 20))
    out, _ = step(scheduler)
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    out, _ = step(scheduler)
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 20)]


def test_prefix_hit_on_shared_prefix() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", list(range(10, 42))))
    step(scheduler)
    scheduler.add_request(make_request("b", list(range(10, 42)) + [7] * 8))
    out, outputs = step(scheduler)
    (b,) = [s for s in out.scheduled if s.request.request_id == "b"]
    assert (b.start, b.num_tokens) == (32, 8)
    assert b.block_ids[:8] == scheduler.kv.get_block_ids("a")[:8]
    assert {o.request_id: o.num_cached_tokens for o in outputs} == {"a": 0, "b": 32}
    stats = scheduler.stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (72, 32)


def test_preemption_when_blocks_run_out() -> None:
    expected = {}
    scheduler = make_scheduler(num_blocks=8, max_model_len=32)
    for rid in "abc":
        scheduler.add_request(make_request(rid, 8, max_tokens=12))
    for rid in "abc":
        expected_scheduler = make_scheduler(num_blocks=64, max_model_len=32)
        expected_scheduler.add_request(make_request(rid, 8, max_tokens=12))
        expected[rid] = run(expected_scheduler)[rid]
    requests = dict(scheduler.requests)
    outputs = run(scheduler)
    assert scheduler.stats.num_preemptions > 0
    assert sum(r.num_preemptions for r in requests.values()) == scheduler.stats.num_preemptions
    for rid, request in requests.items():
        tokens = [t for o in outputs[rid] for t in o.new_token_ids]
        assert tokens == [t for o in expected[rid] for t in o.new_token_ids]
        assert len(tokens) == 12 and outputs[rid][-1].finish_reason == "length"
        assert request.output_token_ids == tokens


def test_fcfs_preempts_the_last_admitted() -> None:
    scheduler = make_scheduler(num_blocks=5, max_model_len=20)
    requests = [make_request("a", 8, max_tokens=10), make_request("b", 4, max_tokens=10)]
    for request in requests:
        scheduler.add_request(request)
    while not (out := step(scheduler)[0]).preempted_req_ids:
        pass
    # "a" asked for a block first; "b" came later, so "b" makes room.
    assert out.preempted_req_ids == {"b"}
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    b = scheduler.requests["b"]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert scheduler.kv.get_block_ids("b") == []
    run(scheduler)
    assert [r.num_output_tokens for r in requests] == [10, 10]


def test_priority_ties_preempt_the_last_admitted() -> None:
    """Equal priorities and arrival times (one offline batch): the victim is the last admitted,
    as under FCFS, not the first, which has done the most work."""
    scheduler = make_scheduler(num_blocks=5, max_model_len=20, policy="priority")
    requests = [make_request("a", 8, max_tokens=10), make_request("b", 4, max_tokens=10)]
    for request in requests:
        request.arrival_time = requests[0].arrival_time
        scheduler.add_request(request)
    while not (out := step(scheduler)[0]).preempted_req_ids:
        pass
    assert out.preempted_req_ids == {"b"}
    assert [s.request.request_id for s in out.scheduled] == ["a"]


def test_priority_order_and_victim() -> None:
    scheduler = make_scheduler(num_blocks=5, max_model_len=20, policy="priority", max_num_seqs=1)
    for rid, priority in [("x", 2), ("y", 0), ("z", 1)]:
        scheduler.add_request(make_request(rid, 4, max_tokens=2, priority=priority))
    order = []
    for _ in range(10):
        out, _ = step(scheduler)
        order += [s.request.request_id for s in out.scheduled if s.start == 0]
    assert order == ["y", "z", "x"]

    scheduler = make_scheduler(num_blocks=5, max_model_len=20, policy="priority")
    scheduler.add_request(make_request("low", 2, max_tokens=16, priority=5))
    step(scheduler)
    scheduler.add_request(make_request("high", 8, max_tokens=10, priority=0))
    while not (out := step(scheduler)[0]).preempted_req_ids:
        pass
    # "high" ran out of blocks; "low" was admitted first and already scheduled in this step, but
    # it has the lower priority: it is preempted and its tokens go back to the budget.
    assert out.preempted_req_ids == {"low"}
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("high", 1)]
    assert out.total_num_scheduled_tokens == 1
    outputs = run(scheduler)
    assert outputs["high"][-1].finish_reason == outputs["low"][-1].finish_reason == "length"


def test_a_victim_taken_back_leaves_no_unwritten_block_in_the_cache() -> None:
    """Priority policy: a victim already scheduled in the step is taken back, so the step writes
    nothing for it; the block its allocation registered in the prefix cache (the one its known
    token completes, here kept from eviction by its draft block, which the newcomer takes) must
    leave the cache, or a later hit reads a position no step wrote."""
    scheduler = Scheduler(
        SchedulerConfig(max_model_len=24, policy="priority", num_speculative_tokens=2),
        KVCacheManager(6, 4),
    )
    low = make_request("low", 6, max_tokens=10, priority=5)
    scheduler.add_request(low)
    step(scheduler)  # low's prompt
    scheduler.add_request(make_request("high", 12, max_tokens=2, priority=0))
    step(scheduler)  # low decodes position 6; high's prompt takes 3 of the 4 free blocks
    low.spec_token_ids = [5, 5]  # a proposer's drafts: low schedules positions 7 to 9
    out, _ = step(scheduler)
    assert out.preempted_req_ids == {"low"}  # high needed a block: low was taken back
    assert [s.request.request_id for s in out.scheduled] == ["high"]
    # Position 7 completes low's second block, which the taken-back step never wrote.
    scheduler.add_request(make_request("reader", low.all_token_ids + [7, 7], max_tokens=1))
    out, _ = step(scheduler)
    reader = next(s for s in out.scheduled if s.request.request_id == "reader")
    assert reader.start == 4  # a hit on the first block only
    run(scheduler)


def test_abort_waiting_and_running() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("run", 9))
    scheduler.add_request(make_request("wait", 9))
    step(scheduler)
    assert scheduler.kv.num_free_blocks < scheduler.kv.num_blocks
    outputs = scheduler.abort_requests(["run", "wait", "unknown"])
    assert [(o.request_id, o.finish_reason) for o in outputs] == [
        ("run", "abort"),
        ("wait", "abort"),
    ]
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    assert not scheduler.has_unfinished_requests() and not scheduler.requests
    out = scheduler.schedule()
    assert out.scheduled == [] and out.finished_req_ids == {"run", "wait"}
    assert scheduler.schedule().finished_req_ids == set()


def test_abort_between_schedule_and_update() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 5))
    scheduler.add_request(make_request("b", 5))
    out = scheduler.schedule()
    scheduler.abort_requests(["a"])
    outputs = scheduler.update_from_output(out, {"a": [7], "b": [7]})
    assert [o.request_id for o in outputs] == ["b"]
    assert [r.request_id for r in scheduler.running] == ["b"]
    scheduler.kv.check_invariants()


def test_fail_and_stop_between_schedule_and_update() -> None:
    """A request the engine core finds with nothing to sample (its constraint admits no token)
    is finished after scheduling and before the step's output: "error" with the message and
    the field at fault, or "stop"; its output comes early, its token from the step is dropped,
    its blocks are freed and the runner hears of it at the next schedule."""
    scheduler = make_scheduler()
    for rid in ("a", "b", "c"):
        scheduler.add_request(make_request(rid, 5))
    out = scheduler.schedule()
    a, b, _ = (s.request for s in out.scheduled)
    scheduler.fail_request(a, "no token left", "allowed_token_ids")
    scheduler.stop_request(b)
    scheduler.fail_request(a, "again", "bad_words")  # finished already: nothing happens
    early = scheduler.take_early_outputs()
    assert [(o.request_id, o.finish_reason, o.stop_reason, o.error_param) for o in early] == [
        ("a", "error", "no token left", "allowed_token_ids"),
        ("b", "stop", None, None),
    ]
    assert all(o.new_token_ids == [] for o in early)
    outputs = scheduler.update_from_output(out, {"a": [7], "b": [7], "c": [7]})
    assert [o.request_id for o in outputs] == ["c"] and a.output_token_ids == []
    assert [r.request_id for r in scheduler.running] == ["c"]
    assert scheduler.schedule().finished_req_ids == {"a", "b"}
    scheduler.kv.check_invariants()


def sequence(tokens: list[int]) -> Callable[[Request], int]:
    return lambda request: tokens[request.num_output_tokens]


@pytest.mark.parametrize(
    ("tokens", "kwargs", "produced", "finish_reason", "stop_reason"),
    [
        ([5, EOS, 6], {}, [5, EOS], "stop", None),
        ([EOS, EOS, EOS, 7], {"min_tokens": 3}, [EOS, EOS, EOS], "stop", None),
        ([1, 42, 3], {"stop_token_ids": [42]}, [1, 42], "stop", 42),
        ([42, 42, 42, 42], {"stop_token_ids": [42], "min_tokens": 3}, [42] * 3, "stop", 42),
        ([EOS] * 5, {"ignore_eos": True}, [EOS] * 4, "length", None),
        ([1, 3, 4, 5, 6], {}, [1, 3, 4, 5], "length", None),
        ([1, 3, 4, EOS], {}, [1, 3, 4, EOS], "stop", None),  # EOS on the last allowed token
    ],
)
def test_stop_rules(
    tokens: list[int],
    kwargs: dict,
    produced: list[int],
    finish_reason: str,
    stop_reason: int | None,
) -> None:
    scheduler = make_scheduler()
    request = make_request("r", 5, max_tokens=4, **kwargs)
    scheduler.add_request(request)
    outputs = run(scheduler, sequence(tokens))["r"]
    assert [t for o in outputs for t in o.new_token_ids] == produced == request.output_token_ids
    assert all(o.finish_reason is None for o in outputs[:-1])
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == (finish_reason, stop_reason)
    assert request.finish_reason == finish_reason


def test_stop_at_max_model_len() -> None:
    scheduler = make_scheduler(max_model_len=8)
    request = make_request("r", 6, max_tokens=100)
    scheduler.add_request(request)
    outputs = run(scheduler)["r"]
    assert request.num_output_tokens == 2 and outputs[-1].finish_reason == "length"


@settings(max_examples=100, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(st.lists(st.integers(3, 6), min_size=1, max_size=20), st.integers(1, 12)),
        min_size=1,
        max_size=8,
    ),
    num_blocks=st.integers(6, 16),
    budget=st.integers(1, 40),
    max_num_seqs=st.integers(1, 4),
    policy=st.sampled_from(["fcfs", "priority"]),
)
def test_everything_finishes_whatever_the_pressure(
    prompts: list[tuple[list[int], int]], num_blocks: int, budget: int, max_num_seqs: int, policy
) -> None:
    # Small alphabets make prompts share prefixes; small pools force preemptions.
    scheduler = make_scheduler(
        num_blocks=num_blocks,
        max_model_len=24,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        policy=policy,
    )
    requests = [
        make_request(str(i), prompt, max_tokens=max_tokens, priority=i % 3)
        for i, (prompt, max_tokens) in enumerate(prompts)
    ]
    for request in requests:
        scheduler.add_request(request)
    run(scheduler, max_steps=2000)
    for request in requests:
        expected = min(request.max_tokens, 24 - request.num_prompt_tokens)
        assert request.num_output_tokens == expected and request.finish_reason == "length"


def test_a_refused_request_leaves_no_trace():
    """A request add_request refuses (here: a grammar with no structured output manager) is not
    left registered: it held has_unfinished_requests true for ever, an engine core spinning on it
    after its error went back."""
    from kvik.sampling_params import StructuredOutputsParams

    scheduler = make_scheduler(max_model_len=64)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a"))
    with pytest.raises(ValueError, match="no structured output manager"):
        scheduler.add_request(Request("r", [1, 2, 3], params, max_tokens=4))
    assert not scheduler.has_unfinished_requests()
    scheduler.add_request(Request("r", [1, 2, 3], SamplingParams(max_tokens=4), max_tokens=4))
    assert scheduler.has_unfinished_requests()
