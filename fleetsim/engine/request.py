"""A request as the engine holds it, and SGLang's finish reasons.

The request carries its whole token history (`input_ids` + `output_ids`), the rolling hash
of that history (the token function's input), the KV it holds (a locked prefix-cache path
plus private pages) and how many tokens of its history have KV (`computed`). After a
retraction `computed` drops to zero and the request re-prefills its whole history: the only
way `computed` ever decreases.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from fleetsim.engine.kv_cache import CacheNode, path_pages
from fleetsim.engine.tokens import decode, prefix_hash


class Phase(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV
    # P/D decode side: waiting for pages to receive its prompt's KV into, then holding
    # them while the KV is on its way from the prefill engine.
    PREALLOC = "prealloc"
    TRANSFER = "transfer"
    # P/D prefill side: waiting for its decode peer to have pages for the KV (the
    # bootstrap queue), then holding its KV while the transfer runs (the inflight queue).
    BOOTSTRAP = "bootstrap"
    INFLIGHT = "inflight"
    PREFILL = "prefill"  # admitted, computing its history in chunks
    DECODE = "decode"  # generating one token per decode iteration
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class Finish:
    """SGLang's finish reasons: stop (EOS id or stop string), length, abort."""

    kind: str
    matched: int | str | None = None
    length: int = 0
    message: str = ""
    status_code: int | None = None

    def to_json(self) -> dict[str, object]:
        if self.kind == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.kind == "length":
            return {"type": "length", "length": self.length}
        return {
            "type": "abort",
            "message": self.message,
            "status_code": self.status_code,
            "err_type": None,
        }

    @property
    def openai(self) -> str:
        """The OpenAI-style finish_reason string."""
        return self.kind


def aborted(message: str = "Aborted", status_code: int | None = None) -> Finish:
    return Finish("abort", message=message, status_code=status_code)


@dataclass(eq=False, slots=True)
class EngineRequest:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    ignore_eos: bool = False
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    cache_salt: str = ""
    arrival: float = 0.0
    # When it last entered the waiting queue: SGLang restamps a retracted request, which
    # rejoins at the tail, and orders priorities' ties (and full-queue evictions) by it.
    queued_at: float = 0.0

    output_ids: list[int] = field(default_factory=list)
    phase: Phase = Phase.WAITING
    computed: int = 0
    cached_tokens: int = 0
    node: CacheNode | None = None  # last node of its locked prefix-cache path
    tree_len: int = 0  # tokens that path covers
    pages: list[int] = field(default_factory=list)
    hash_state: int = 0
    finish: Finish | None = None
    stop_at: int = -1
    retractions: int = 0
    prefill_yields: int = 0
    prefill_end: int = 0  # where this iteration's chunk of its history ends (admission's plan)
    admitted_at: float = -1.0
    # P/D prefill side: after its first token the request keeps its KV until the
    # transfer to its decode peer is done, then ends with SGLang's `length 0`.
    kv_export: bool = False
    # Leading history tokens whose KV arrives by transfer from a prefill engine (P/D):
    # the scheduler allocates their pages without computing them. A retraction drops it.
    kv_imported: int = 0
    # History tokens up to which this admission loads KV from the host tier (HiCache)
    # instead of computing it, and the host-tier tokens it has been credited in all.
    onboard_end: int = 0
    host_cached_tokens: int = 0
    first_token_at: float = -1.0
    finished_at: float = -1.0
    # The rolling hash of `input_ids` (`tokens.prefix_hash`), which never change: made
    # once, here, unless the maker had it (-1: not given).
    prompt_hash: int = -1

    def __post_init__(self) -> None:
        if self.prompt_hash < 0:
            self.prompt_hash = prefix_hash(self.input_ids)

    @property
    def total_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def placed_end(self) -> int:
        """History tokens whose KV is placed (transferred or loaded), not computed."""
        return max(self.kv_imported, self.onboard_end)

    @property
    def prompt_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def stop_window(self) -> int:
        """Bytes of the longest stop string."""
        return max((len(s.encode()) for s in self.stop), default=0)

    @property
    def eos_suppressed(self) -> bool:
        """EOS may not be sampled now: `ignore_eos`, or `min_new_tokens` not reached."""
        return self.ignore_eos or len(self.output_ids) < self.min_new_tokens

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED

    def history(self) -> list[int]:
        """Every token so far: what a (re-)prefill computes."""
        return self.input_ids + self.output_ids if self.output_ids else self.input_ids

    def page_table(self) -> list[int]:
        """Pages holding this request's KV, in token order."""
        return path_pages(self.node) + self.pages

    def output_text(self) -> str:
        """Generated text as SGLang returns it: EOS skipped, cut before a matched stop
        string."""
        text = decode(self.output_ids)
        if self.stop_at >= 0:
            return text[: self.stop_at]
        return text
