"""Physical KV blocks: reference counts, an LRU free queue and the hash-to-block prefix cache."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvik.request import BlockHash


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block holds a full, cached block of tokens that other requests may reuse.
    block_hash: BlockHash | None = None


class BlockPool:
    """All blocks of the KV cache.

    A block with ``ref_cnt == 0`` sits in the free queue, possibly still cached: it is reused as
    is on a prefix hit and evicted only when ``get_new_blocks`` pops it. The queue's head is the
    least recently freed block, so eviction is LRU.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # An OrderedDict gives O(1) removal of a free block that a prefix hit touches again.
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        blocks = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; pass a request's blocks last first."""
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed twice"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                if block.block_hash is None:
                    # Nothing to reuse in it: hand it out before any cached block.
                    self.free_queue.move_to_end(block.block_id, last=False)

    def cache_full_blocks(
        self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash]
    ) -> None:
        """Register full blocks under their hashes, pairwise (a no-op with caching off)."""
        if not self.enable_caching:
            return
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            # A block hit in the cache is already registered; if another request computed the
            # same block first, that copy stays the cached one and this one is freed uncached.
            if block.block_hash is None and block_hash not in self.cached:
                block.block_hash = block_hash
                self.cached[block_hash] = block

    def uncache(self, block: KVCacheBlock) -> None:
        """Take a block out of the prefix cache (its contents are not what its hash says)."""
        self._evict(block)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None
