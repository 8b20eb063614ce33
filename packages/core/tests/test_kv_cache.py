from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvik.kv_cache import BlockPool, KVCacheManager, extend_block_hashes, hash_block_tokens
from kvik.request import Request
from kvik.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], **kwargs) -> Request:
    sp = SamplingParams(**kwargs.pop("sp", {}))
    return Request(rid, tokens, sp, max_tokens=kwargs.pop("max_tokens", 8), **kwargs)


def admit(kv: KVCacheManager, request: Request) -> int:
    """Schedule the whole request the way the scheduler does; returns the prefix hit."""
    blocks, hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - hit, blocks, hit) is not None
    request.num_computed_tokens = request.num_tokens
    return hit


def test_hash_chain() -> None:
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4]) and isinstance(a, bytes)
    assert a != hash_block_tokens(None, [1, 2, 3, 5])
    assert a != hash_block_tokens(None, [1, 2, 3, 4], ("salt",))
    b = hash_block_tokens(a, [5, 6, 7, 8])
    assert b != hash_block_tokens(None, [5, 6, 7, 8])
    assert b != hash_block_tokens(hash_block_tokens(None, [0, 2, 3, 4]), [5, 6, 7, 8])


def test_hash_is_the_same_in_another_process() -> None:
    code = "from kvik.kv_cache import hash_block_tokens as h; print(h(h(None, [1, 2]), [3], ('s',)).hex())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    here = hash_block_tokens(hash_block_tokens(None, [1, 2]), [3], ("s",))
    assert out.stdout.strip() == here.hex()


def test_extend_block_hashes_covers_full_blocks_only() -> None:
    request = make_request("r", list(range(9)))
    extend_block_hashes(request, BS)
    assert len(request.block_hashes) == 2
    assert request.block_hashes[1] == hash_block_tokens(request.block_hashes[0], [4, 5, 6, 7])
    for t in (9, 10, 11):
        request.append_output_token(t)
    extend_block_hashes(request, BS)
    assert len(request.block_hashes) == 3
    salted = make_request("s", list(range(9)), cache_salt="tenant")
    extend_block_hashes(salted, BS)
    # The salt enters the first block only, and the chain carries it on.
    assert all(x != y for x, y in zip(salted.block_hashes, request.block_hashes))


def test_pool_lru_eviction_order() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2), pool.get_new_blocks(2)
    pool.cache_full_blocks(a + b, [b"a0", b"a1", b"b0", b"b1"])
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))
    assert pool.usage == 0.0
    # a's tail goes first, then a's head: least recently freed first, tails before prefixes.
    assert pool.get_new_blocks(1) == [a[1]] and pool.get_cached_block(b"a1") is None
    pool.touch([a[0]])  # a prefix hit takes it out of the free queue
    pool.free_blocks([a[0]])  # and freeing it again makes it the most recently used
    assert pool.get_new_blocks(2) == [b[1], b[0]]
    assert pool.get_cached_block(b"a0") is a[0] and pool.usage == 0.75


def test_pool_hands_out_uncached_blocks_first() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks[:1], [b"x"])
    pool.free_blocks(blocks)
    assert pool.get_new_blocks(2) == [blocks[2], blocks[1]]
    assert pool.get_cached_block(b"x") is blocks[0]


def test_prefix_hit_after_request_finishes() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    first = make_request("a", list(range(10)))
    assert admit(kv, first) == 0
    first_ids = kv.get_block_ids("a")
    kv.free(first)
    second = make_request("b", list(range(8)) + [99, 98, 97])
    blocks, hit = kv.get_computed_blocks(second)
    assert hit == 8 and [b.block_id for b in blocks] == first_ids[:2]
    assert kv.allocate_slots(second, second.num_tokens - hit, blocks, hit) is not None
    assert kv.get_block_ids("b")[:2] == [b.block_id for b in blocks]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (21, 8)
    kv.check_invariants()


def test_shared_blocks_are_counted_once_per_holder() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    first, second = make_request("a", list(range(9))), make_request("b", list(range(9)))
    admit(kv, first)
    assert admit(kv, second) == 8
    assert [b.ref_cnt for b in kv.req_to_blocks["b"]] == [2, 2, 1]
    kv.check_invariants()
    kv.free(first)
    kv.free(first)  # idempotent, as after a preemption followed by an abort
    kv.check_invariants()
    assert kv.num_free_blocks == 8 - 3


def test_full_prompt_hit_backs_off_one_block() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    admit(kv, make_request("a", list(range(8))))
    blocks, hit = kv.get_computed_blocks(make_request("b", list(range(8))))
    assert hit == 4 and len(blocks) == 1


@pytest.mark.parametrize(
    ("kv", "kwargs"),
    [
        (KVCacheManager(8, BS, enable_caching=False), {}),
        (KVCacheManager(8, BS), {"sp": {"prompt_logprobs": 1}}),
        (KVCacheManager(8, BS), {"cache_salt": "other"}),
    ],
)
def test_no_hit(kv: KVCacheManager, kwargs: dict) -> None:
    admit(kv, make_request("a", list(range(9))))
    assert kv.get_computed_blocks(make_request("b", list(range(9)), **kwargs)) == ([], 0)


def test_allocate_says_no_without_changing_anything() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    first = make_request("a", list(range(9)))
    admit(kv, first)
    kv.free(first)
    # The two cached blocks are free but would be taken by the hit: 2 + 2 new > 4 free - 2.
    second = make_request("b", list(range(8)) + list(range(50, 59)))
    blocks, hit = kv.get_computed_blocks(second)
    assert hit == 8
    assert kv.allocate_slots(second, second.num_tokens - hit, blocks, hit) is None
    assert kv.num_free_blocks == 4 and kv.get_block_ids("b") == []
    kv.check_invariants()


class KVCacheMachine(RuleBasedStateMachine):
    """Random request lifecycles on a small pool: the accounts must balance after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=8, block_size=BS)
        self.waiting: dict[str, Request] = {}
        self.running: dict[str, Request] = {}
        self.next_id = 0

    def _ids(self, live: dict[str, Request], index: int) -> Request:
        return live[sorted(live)[index % len(live)]]

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=14))
    def add(self, tokens: list[int]) -> None:
        self.next_id += 1
        self.waiting[str(self.next_id)] = make_request(str(self.next_id), tokens)

    @precondition(lambda self: self.waiting)
    @rule(index=st.integers(0, 100), chunk=st.integers(1, 16))
    def admit(self, index: int, chunk: int) -> None:
        request = self._ids(self.waiting, index)
        blocks, hit = self.kv.get_computed_blocks(request)
        num_new = min(request.num_tokens - hit, chunk)
        free_before = self.kv.num_free_blocks
        if self.kv.allocate_slots(request, num_new, blocks, hit) is None:
            assert self.kv.num_free_blocks == free_before
            assert request.request_id not in self.kv.req_to_blocks
            return
        request.num_computed_tokens = hit + num_new
        self.running[request.request_id] = self.waiting.pop(request.request_id)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100), chunk=st.integers(1, 16), token=st.integers(0, 2))
    def step(self, index: int, chunk: int, token: int) -> None:
        request = self._ids(self.running, index)
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token(token)  # the previous step sampled it
        num_new = min(request.num_tokens - request.num_computed_tokens, chunk)
        if self.kv.allocate_slots(request, num_new) is not None:
            request.num_computed_tokens += num_new

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100))
    def finish(self, index: int) -> None:
        request = self._ids(self.running, index)
        self.kv.free(request)
        del self.running[request.request_id]

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100))
    def preempt(self, index: int) -> None:
        request = self._ids(self.running, index)
        self.kv.free(request)
        request.num_computed_tokens = 0
        self.waiting[request.request_id] = self.running.pop(request.request_id)

    @precondition(lambda self: self.waiting)
    @rule(index=st.integers(0, 100))
    def abort_waiting(self, index: int) -> None:
        request = self._ids(self.waiting, index)
        self.kv.free(request)  # holds nothing: freeing again must be harmless
        del self.waiting[request.request_id]

    @invariant()
    def accounts_balance(self) -> None:
        self.kv.check_invariants()
        held = sum(len(self.kv.req_to_blocks.get(rid, [])) for rid in self.running)
        assert sum(b.ref_cnt for b in self.kv.pool.blocks) == held
        assert set(self.kv.req_to_blocks) <= set(self.running)
        if not self.running:
            assert self.kv.num_free_blocks == self.kv.num_blocks

    @invariant()
    def shared_blocks_hold_the_right_tokens(self) -> None:
        for request in self.running.values():
            for i, block in enumerate(self.kv.req_to_blocks.get(request.request_id, [])):
                if block.block_hash is not None:
                    assert block.block_hash == request.block_hashes[i]

    def teardown(self) -> None:
        for request in [*self.running.values(), *self.waiting.values()]:
            self.kv.free(request)
        self.kv.check_invariants()
        assert self.kv.num_free_blocks == self.kv.num_blocks


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
