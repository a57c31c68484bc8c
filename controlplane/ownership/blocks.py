"""Chained prompt-block hashes: the keys of prefix caching and of ownership.

A prompt is cut into blocks of `block_tokens` tokens (the engine's page size, or a multiple
of it). Block i's hash covers block i's tokens and block i-1's hash, so equal hashes mean
equal prefixes, not merely equal blocks; the chain is seeded with the cache identity, so
different models, adapters, cache schemas or security domains never share a key. Only
full blocks are hashed: a partial last block cannot be reused by an engine's prefix cache.

The router and the fleet simulator both call these functions, so they agree on keys.
blake2b with an 8-byte digest is in the standard library and fast; tokens are packed as
unsigned 32-bit integers (every real vocabulary fits).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b
from typing import Final

from controlplane.contract import CacheIdentity

DIGEST_BYTES: Final = 8
_BIG_ENDIAN = sys.byteorder == "big"
assert array("I").itemsize == 4, "tokens pack as 4-byte unsigned ints"


def _pack(tokens: Sequence[int] | bytes) -> bytes:
    """Token ids as little-endian uint32s. Bytes are byte-level token ids (one per byte),
    so `b"hi"` and `[104, 105]` are the same prompt."""
    if isinstance(tokens, bytes | bytearray | memoryview):
        # Each byte is the low byte of its uint32; the other three stay zero. A strided
        # slice assignment packs them in C, where a list of ints costs ~40 ns a token.
        out = bytearray(4 * len(tokens))
        out[0::4] = tokens
        return bytes(out)
    try:
        packed = array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from exc
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _check_block(block_tokens: int) -> None:
    if not isinstance(block_tokens, int) or block_tokens < 1:
        raise ValueError(f"block_tokens must be a positive integer, got {block_tokens!r}")


def block_hashes(
    identity: CacheIdentity,
    tokens: Sequence[int] | bytes,
    block_tokens: int,
    max_blocks: int = -1,
) -> list[int]:
    """Chained 64-bit hashes of the full blocks of `tokens` (at most `max_blocks` if >= 0)."""
    _check_block(block_tokens)
    full = len(tokens) // block_tokens
    if max_blocks >= 0:
        full = min(full, max_blocks)
    packed = _pack(tokens[: full * block_tokens])
    width = block_tokens * 4
    previous = blake2b(identity.seed(), digest_size=DIGEST_BYTES).digest()
    hashes = []
    for i in range(full):
        previous = blake2b(
            packed[i * width : (i + 1) * width], digest_size=DIGEST_BYTES, key=previous
        ).digest()
        hashes.append(int.from_bytes(previous, "little"))
    return hashes


def prefix_key(
    identity: CacheIdentity, tokens: Sequence[int] | bytes, block_tokens: int, owner_blocks: int
) -> int:
    """The ownership key of a prompt: the chained hash of its first `owner_blocks` blocks.

    A prompt shorter than one block is keyed by its tokens (seeded the same way), so short
    prompts still spread over the ring instead of all landing on one owner.
    """
    if not isinstance(owner_blocks, int) or owner_blocks < 1:
        raise ValueError(f"owner_blocks must be a positive integer, got {owner_blocks!r}")
    hashes = block_hashes(identity, tokens, block_tokens, owner_blocks)
    if hashes:
        return hashes[-1]
    seed = blake2b(identity.seed(), digest_size=DIGEST_BYTES).digest()
    return int.from_bytes(
        blake2b(_pack(tokens), digest_size=DIGEST_BYTES, key=seed, person=b"short").digest(),
        "little",
    )
