"""KV cache accounts per request: which blocks it holds, prefix-cache lookups, allocation."""

from __future__ import annotations

from collections.abc import Sequence

from kvik.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvik.kv_cache.hashing import extend_block_hashes
from kvik.request import Request


class KVCacheManager:
    """Counts blocks for the scheduler; it never decides who runs.

    A request's blocks hold its tokens ``[0, num_computed_tokens + scheduled)`` in order; block
    ``i`` holds tokens ``[i * block_size, (i + 1) * block_size)``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same blocks' ids, kept beside them so that a step's ScheduledRequest gets them
        # without a list built per request per step (a decode step at batch 256 built 256).
        self.req_to_block_ids: dict[str, list[int]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up, cumulative
        self.prefix_cache_hits = 0  # tokens found, cumulative

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's full blocks, and its length in tokens.

        The last token is always left to compute, since its logits give the next token; so a hit
        on every token backs off by one block. Prompt logprobs need every prompt position's
        logits, so those requests skip the cache.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        extend_block_hashes(request, self.block_size)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_hit_tokens = len(blocks) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return blocks, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``new_computed_blocks`` are prefix-cache hits from ``get_computed_blocks``. Returns the
        newly allocated blocks, or None (changing nothing) when too few blocks are free.
        """
        request_id = request.request_id
        held = self.req_to_blocks.get(request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_total = num_computed + num_new_tokens
        num_needed = -(-num_total // self.block_size) - len(held) - len(new_computed_blocks)
        if num_needed <= 0 and not new_computed_blocks and held:
            # Most decode steps: the tokens fit the blocks held, and no block fills up that is
            # not registered yet; nothing to allocate or cache.
            num_full = min(num_total, request.num_tokens) // self.block_size
            if not self.enable_caching or num_full <= self.num_cached_blocks.get(request_id, 0):
                return []
        # Hit blocks nobody holds sit in the free queue: taking them leaves fewer to hand out.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_free_hits:
            return None

        self.pool.touch(new_computed_blocks)
        blocks = self.req_to_blocks.setdefault(request_id, held)
        block_ids = self.req_to_block_ids.setdefault(request_id, [])
        blocks.extend(new_computed_blocks)
        block_ids.extend(b.block_id for b in new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(num_needed, 0))
        blocks.extend(new_blocks)
        block_ids.extend(b.block_id for b in new_blocks)

        # Blocks whose tokens are all known can be shared as soon as this step writes them.
        # request.num_tokens counts known tokens only: under asynchronous scheduling a step may
        # compute a token still in flight (a placeholder), whose slot is allocated here but whose
        # block is hashed and cached only by a later call, once the token is known.
        num_full = min(num_total, request.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(request_id, 0)
        if self.enable_caching and num_full > start:
            extend_block_hashes(request, self.block_size)
            self.pool.cache_full_blocks(
                blocks[start:num_full], request.block_hashes[start:num_full]
            )
        self.num_cached_blocks[request_id] = max(num_full, start)
        return new_blocks

    def uncache_unwritten(self, request: Request, num_written_tokens: int) -> None:
        """Unregister the request's cached blocks past its first ``num_written_tokens`` tokens.

        ``allocate_slots`` registers a block as soon as the step it schedules is to write it; when
        that step is taken back before it runs (the scheduler preempts a request it had already
        scheduled), those blocks are never written, and a later prefix hit on one would read stale
        KV. Blocks past the written tokens are the request's own (hits cover computed tokens only),
        so no other request holds them.
        """
        first = num_written_tokens // self.block_size
        for block in self.req_to_blocks.get(request.request_id, [])[first:]:
            if block.block_hash is not None:
                self.pool.uncache(block)
        if request.request_id in self.num_cached_blocks:
            self.num_cached_blocks[request.request_id] = min(
                self.num_cached_blocks[request.request_id], first
            )

    def free(self, request: Request) -> None:
        """Release the request's blocks; safe to call again after a preemption or abort."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.req_to_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        # Last block first, so the tail of a sequence is evicted before its shareable prefix.
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The ids of the request's blocks, in order: the manager's own list, which grows as
        the request does (read it for the step it was scheduled for; copy it to keep it)."""
        return self.req_to_block_ids.get(request_id, [])

    def check_invariants(self) -> None:
        """Assert the accounts balance (for tests): no block leaked, shared wrongly or lost."""
        holders: dict[int, int] = {}
        assert self.req_to_block_ids.keys() == self.req_to_blocks.keys()
        for request_id, blocks in self.req_to_blocks.items():
            assert self.req_to_block_ids[request_id] == [b.block_id for b in blocks], request_id
            for block in blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), f"block {block.block_id}"
            assert (block.ref_cnt == 0) == (block.block_id in self.pool.free_queue)
            if block.block_hash is not None:
                assert self.pool.cached[block.block_hash] is block
        assert len(holders) + self.pool.num_free_blocks == self.pool.num_blocks
        assert all(b.block_hash is not None for b in self.pool.cached.values())
