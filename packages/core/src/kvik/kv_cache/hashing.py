"""Chained hashes of full KV blocks: equal hashes mean equal prefixes, so blocks can be shared."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvik.request import BlockHash

if TYPE_CHECKING:
    from kvik.request import Request


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> BlockHash:
    """sha256 of the parent hash, the block's token ids and its extra keys.

    Chaining makes a block's hash stand for its whole prefix. Python's ``hash()`` is salted per
    process, so a digest is used: the same tokens hash the same in every process and on every run.
    Extra keys must have a deterministic ``repr`` (str, int, bytes, tuples of them).
    """
    h = hashlib.sha256(parent or b"")
    # Little-endian int64 with a count, so the bytes are the same on every host and unambiguous.
    h.update(struct.pack(f"<q{len(token_ids)}q", len(token_ids), *token_ids))
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def request_extra_keys(request: Request, block_index: int) -> tuple | None:
    """What besides the tokens decides a block's contents.

    The cache salt goes into the first block only, as in vLLM: chaining carries it to every later
    block. Adapter names and prompt-embedding digests belong here once requests carry them.
    """
    if block_index == 0 and request.cache_salt is not None:
        return (request.cache_salt,)
    return None


def extend_block_hashes(request: Request, block_size: int) -> None:
    """Append the hashes of the request's full blocks that have none yet.

    Only known tokens (``all_token_ids``) are hashed, never an output token still in flight.
    """
    hashes = request.block_hashes
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), request.num_tokens // block_size):
        tokens = request.all_token_ids[i * block_size : (i + 1) * block_size]
        parent = hash_block_tokens(parent, tokens, request_extra_keys(request, i))
        hashes.append(parent)
