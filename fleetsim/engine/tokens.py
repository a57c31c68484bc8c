"""Byte-level tokens and the deterministic token function.

Token ids are byte values (0..255) plus one end-of-sequence id outside that range, so text
and ids convert both ways without a vocabulary. Generated tokens are printable ASCII bytes,
which keeps every output valid UTF-8 and makes `text` and `output_ids` interchangeable:
a client may resume with either.

The next token is a pure function of the *whole* token prefix, computed from a rolling hash
(CRC-32 over the ids as little-endian 16-bit words, so a whole prompt hashes at C speed)
that costs O(1) per generated token. A request resumed anywhere as a continuation (prompt plus what
was generated so far) therefore produces exactly the tokens an uninterrupted run would,
which is what the sidecar's recompute and the router's migration rely on.
"""

from __future__ import annotations

import array
import zlib
from collections.abc import Iterable, Sequence
from typing import Final

VOCAB_BYTES: Final = 256
EOS_ID: Final = 256
VOCAB_SIZE: Final = 257

_MASK32: Final = (1 << 32) - 1
_PRINTABLE_FIRST: Final = 32
_PRINTABLE_COUNT: Final = 95  # bytes 32..126

# One generated token in 512 is EOS unless `ignore_eos` is set: outputs end on their own at
# realistic lengths, and tests that need exact lengths set `ignore_eos`.
DEFAULT_EOS_PER_MILLE: Final = 2.0

HASH_SEED: Final = 0
# Each token id's bytes in the hashed stream, precomputed for the decode loop.
TOKEN_BYTES = tuple(t.to_bytes(2, "little") for t in range(VOCAB_SIZE))


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids: Iterable[int]) -> str:
    """Text of the byte tokens; EOS (and anything outside bytes) is skipped, as a real
    detokenizer skips special tokens."""
    return bytes(t for t in ids if 0 <= t < VOCAB_BYTES).decode("utf-8", errors="replace")


def extend_hash(state: int, token: int) -> int:
    """The rolling prefix hash after one more token."""
    return zlib.crc32(TOKEN_BYTES[token], state)


def byte_ids(ids: Sequence[int]) -> bytes | None:
    """The ids as bytes when every one is a byte value (all but EOS and out-of-vocabulary
    ids, as in all but a rare prompt), else None: one C pass over the list."""
    try:
        return bytes(ids)
    except (ValueError, TypeError):
        return None


def prefix_hash(ids: Sequence[int], state: int = HASH_SEED) -> int:
    """The rolling hash over many tokens at once: equal to extending one by one."""
    raw = byte_ids(ids)
    if raw is None:
        return zlib.crc32(array.array("H", ids), state)
    # The same little-endian 16-bit words, built by one strided copy: about a third of
    # the time `array` takes to convert the ids one by one.
    words = bytearray(2 * len(raw))
    words[::2] = raw
    return zlib.crc32(words, state)


_MIX: Final = 0x45D9F3B  # 27 bits


def _mul_low32(x: int) -> int:
    """The low 32 bits of `x * _MIX` for a 32-bit `x`, from its two 16-bit halves.
    Compiled (the fleet simulator's `--compiled`), a product is a machine multiply only
    while both factors are below 2**30: `x * _MIX` itself went through Python's
    arbitrary-precision arithmetic at every token, the halves' products never do."""
    return ((((x >> 16) * _MIX) & 0xFFFF) << 16) + (x & 0xFFFF) * _MIX & _MASK32


def _mix(state: int) -> int:
    """A 32-bit integer finaliser (two multiply-xorshift rounds by a 27-bit constant):
    spreads the CRC over the bits the decision reads."""
    z = _mul_low32((state >> 16) ^ state)
    z = _mul_low32((z >> 16) ^ z)
    return (z >> 16) ^ z


class TokenFunction:
    """next token = f(hash of the whole prefix). `eos_threshold` out of 2**20 decides EOS."""

    __slots__ = ("_eos_threshold",)

    def __init__(self, eos_per_mille: float = DEFAULT_EOS_PER_MILLE) -> None:
        if not 0.0 <= eos_per_mille <= 1000.0:
            raise ValueError("eos_per_mille must be within [0, 1000]")
        self._eos_threshold = int(eos_per_mille / 1000.0 * (1 << 20))

    def next_token(self, state: int, ignore_eos: bool) -> int:
        z = _mix(state)
        if not ignore_eos and (z & 0xFFFFF) < self._eos_threshold:
            return EOS_ID
        return _PRINTABLE_FIRST + (z >> 20) % _PRINTABLE_COUNT

    def run(self, state: int, count: int) -> tuple[list[int], int]:
        """The next `count` tokens with EOS suppressed, from prefix hash `state`, and the
        hash after them: `next_token` and `extend_hash` `count` times over, in one call."""
        tokens: list[int] = []
        append, crc32, token_bytes = tokens.append, zlib.crc32, TOKEN_BYTES
        for _ in range(count):
            token = _PRINTABLE_FIRST + (_mix(state) >> 20) % _PRINTABLE_COUNT
            append(token)
            state = crc32(token_bytes[token], state)
        return tokens, state
