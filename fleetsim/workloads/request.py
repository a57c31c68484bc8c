"""What one simulated client asks for, independent of which fleet serves it.

A prompt is described the way Mooncake's FAST'25 traces describe it: a chain of block ids,
each standing for `BLOCK_TOKENS` prompt tokens (the last block may be partial). Two requests
share a prefix exactly when their block-id chains share a leading run; that is all a prefix
cache or a cache-aware router can observe, so synthetic scenarios and replayed traces use
the same shape. Token ids are derived from block ids only when an engine needs them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np

BLOCK_TOKENS: Final = 512
"""Tokens per prompt block, as in Mooncake's traces (`hash_ids` of 512-token blocks)."""

VOCAB: Final = 256
"""Byte-level token ids, as the reference engine's tokenizer uses (`prompt_token_bytes`
takes a byte of its mix as the id)."""


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request as the client sends it, plus what only the simulator knows.

    `output_tokens` is the length the model would generate if left alone (the request ends
    with `stop` there, or `length` at `max_tokens` if that comes first). `output_hint_tokens`
    is what a length predictor would be told up front (a client hint, or a systematically
    wrong one in robustness runs); zero means no hint. Times are seconds from the start
    of the run; `cancel_after_s` and `deadline_s` are relative to arrival, zero for none.
    `max_wait_s` is the longest the client tolerates before its first token; a
    low-priority request that has not started by then counts as starved.
    """

    request_id: str
    arrival_s: float
    tenant: str
    priority: int
    input_tokens: int
    output_tokens: int
    max_tokens: int
    block_ids: tuple[int, ...]
    category: str = ""
    output_hint_tokens: int = 0
    deadline_s: float = 0.0
    cancel_after_s: float = 0.0
    max_wait_s: float = 0.0
    tags: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.input_tokens <= 0 or self.output_tokens <= 0 or self.max_tokens <= 0:
            raise ValueError(f"{self.request_id}: token counts must be positive")
        need = -(-self.input_tokens // BLOCK_TOKENS)
        if len(self.block_ids) != need:
            raise ValueError(
                f"{self.request_id}: {self.input_tokens} input tokens need {need} blocks, "
                f"got {len(self.block_ids)}"
            )

    @property
    def generated_tokens(self) -> int:
        """How many tokens an uninterrupted run streams back: the natural length, capped."""
        return min(self.output_tokens, self.max_tokens)

    @property
    def is_long(self) -> bool:
        return "long" in self.tags


def prompt_token_bytes(spec: RequestSpec) -> bytes:
    """The prompt's token ids, one byte each (byte-level ids: a prefix key packs them in
    one C pass where a list costs a conversion per id). Each block id expands to the same
    `BLOCK_TOKENS` ids wherever it appears, so shared block chains are shared token
    prefixes in any radix cache, and distinct blocks differ (a 64-bit mix of block id and
    offset per token)."""
    tokens = spec.input_tokens
    blocks = spec.block_ids[: -(-tokens // BLOCK_TOKENS)]
    return _block_token_bytes(np.asarray(blocks, dtype=np.uint64))[:tokens]


def prompt_token_bytes_each(specs: Sequence[RequestSpec]) -> list[bytes]:
    """`prompt_token_bytes` of every spec, from one pass over all their blocks: numpy's
    fixed cost per call was most of a prompt's."""
    ids = np.fromiter(
        itertools.chain.from_iterable(spec.block_ids for spec in specs), dtype=np.uint64
    )
    raw = _block_token_bytes(ids)
    prompts = []
    at = 0
    for spec in specs:
        prompts.append(raw[at : at + spec.input_tokens])
        at += len(spec.block_ids) * BLOCK_TOKENS
    return prompts


_OFFSET_MIX: Final = np.arange(BLOCK_TOKENS, dtype=np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
_BLOCK_MIX: Final = np.uint64(0x9E3779B97F4A7C15)
_FINAL_MIX: Final = np.uint64(0x94D049BB133111EB)
_SHIFTS: Final = (np.uint64(31), np.uint64(29))


def _block_token_bytes(blocks: np.ndarray) -> bytes:
    """Each block's `BLOCK_TOKENS` ids, block after block: the low byte of a 64-bit mix
    of block id and offset (the id modulo `VOCAB`)."""
    z = blocks[:, None] * _BLOCK_MIX + _OFFSET_MIX[None, :]
    z ^= z >> _SHIFTS[0]
    z *= _FINAL_MIX
    z ^= z >> _SHIFTS[1]
    return z.astype(np.uint8).tobytes()


def length_bucket(tokens: int) -> str:
    """The input/output length bucket used in every latency breakdown."""
    for limit, name in _BUCKETS:
        if tokens <= limit:
            return name
    return ">32k"


_BUCKETS = ((1024, "<=1k"), (4096, "1k-4k"), (16384, "4k-16k"), (32768, "16k-32k"))
LENGTH_BUCKETS = (*(name for _, name in _BUCKETS), ">32k")
"""Every bucket `length_bucket` returns, shortest first."""
