"""How many tokens a text prompt is, before the engine has tokenized it.

The sidecar admits a request before its engine has seen it, so a text prompt's size is
an estimate until the engine's first answer says it (the ledger then takes the real
figure). A byte per token never under-counts a byte-level tokenizer, but it over-counts a
real one several times over (about four bytes per token for English under Llama's):
admission would then reserve KV for prompts four times their size and queue requests an
engine had room for. So the estimate learns the engine's own bytes per token from the
prompts it counted (a moving average), and divides by a little less than that
(`margin`): a prompt denser than the average is still rarely under-counted, and one that
is costs only the correction when the engine reports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class PromptSizer:
    """Text prompt tokens from their UTF-8 bytes, at the bytes per token the engine's
    counts showed (`observe`); a byte per token until it has counted one."""

    bytes_per_token: float = 1.0
    margin: float = 0.8
    weight: float = 0.05  # of each new prompt in the moving average
    observed: int = 0

    def __post_init__(self) -> None:
        if not (self.bytes_per_token >= 1.0 and 0 < self.margin <= 1 and 0 < self.weight <= 1):
            raise ValueError("bytes_per_token >= 1, margin and weight in (0, 1]")

    def tokens(self, text_bytes: int) -> int:
        """The tokens a prompt of `text_bytes` is estimated at: one per
        `bytes_per_token * margin` bytes, and at most one per byte."""
        return math.ceil(text_bytes / max(1.0, self.bytes_per_token * self.margin))

    def observe(self, text_bytes: int, engine_tokens: int) -> None:
        """The engine counted a prompt of `text_bytes` as `engine_tokens`."""
        if text_bytes <= 0 or engine_tokens <= 0:
            return
        ratio = max(1.0, text_bytes / engine_tokens)
        # The first counts weigh more, so that the estimate leaves the prior quickly.
        weight = max(self.weight, 1.0 / (self.observed + 1))
        self.bytes_per_token += weight * (ratio - self.bytes_per_token)
        self.observed += 1
