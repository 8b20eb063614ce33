"""Paged KV cache bookkeeping with prefix caching (pure Python: block ids, never tensors)."""

from kvik.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvik.kv_cache.hashing import extend_block_hashes, hash_block_tokens, request_extra_keys
from kvik.kv_cache.manager import KVCacheManager

__all__ = [
    "BlockPool",
    "KVCacheBlock",
    "KVCacheManager",
    "extend_block_hashes",
    "hash_block_tokens",
    "request_extra_keys",
]
