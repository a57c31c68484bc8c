"""Token backends: what computes the next token once the scheduler has placed the KV.

The scheduler owns pages and positions; a backend only fills KV and picks tokens. The
default `HashBackend` is the deterministic token function (no KV content, O(1) per token),
fast enough for million-request simulations. `fleetsim.engine.torch_backend` computes real
attention over the paged KV cache with a tiny transformer, to prove the paging is right.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from fleetsim.engine.request import EngineRequest
from fleetsim.engine.tokens import TokenFunction


class TokenBackend(Protocol):
    def prefill(self, request: EngineRequest, start: int, end: int) -> int | None:
        """Write KV for history[start:end] into the request's pages; when `end` reaches the
        end of its history, return the next token, else None."""
        ...

    def decode(self, batch: Sequence[EngineRequest]) -> list[int]:
        """Write KV for each request's last token (at position `computed`) and return each
        one's next token."""
        ...


class HashBackend:
    """Tokens from the rolling prefix hash the scheduler keeps on every request."""

    __slots__ = ("_tokens",)

    def __init__(self, tokens: TokenFunction) -> None:
        # The function itself, not its bound methods: compiled (the fleet simulator's
        # `--compiled`), a method called on it is a direct call, a stored bound method a
        # generic one, for every request at every iteration.
        self._tokens = tokens

    def prefill(self, request: EngineRequest, start: int, end: int) -> int | None:
        if end < request.total_len:
            return None
        return self._tokens.next_token(request.hash_state, request.eos_suppressed)

    def decode(self, batch: Sequence[EngineRequest]) -> list[int]:
        tokens = self._tokens
        return [
            tokens.next_token(r.hash_state, r.ignore_eos or len(r.output_ids) < r.min_new_tokens)
            for r in batch
        ]

    def decode_run(self, request: EngineRequest, count: int) -> tuple[list[int], int]:
        """`count` decode steps of a request that cannot stop on EOS (`ignore_eos`): its
        next `count` tokens and its prefix hash after them."""
        return self._tokens.run(request.hash_state, count)
