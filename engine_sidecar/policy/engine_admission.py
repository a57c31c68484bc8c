"""How long the engine's own admission will hold a new request: the structural part of TTFT.

SGLang admits a waiting request only while its KV pool, less what every running request
may still grow into, holds the request's uncached prompt plus its whole clipped
`max_new_tokens` (`PrefillAdder`; /work/shared/SGLANG_CONTRACT.md, "Admission"): a running
request reserves `min(max_new - generated, 4096) × new_token_ratio`, and a request that
does not fit waits — with everything behind it — until running requests finish and free
their KV and their reservations. Under long answers that wait is 10–100 s, while the load
a request meets at arrival says nothing of it (a linear model of that load predicted
about 0.5 s for them).

The sidecar knows what the engine reserves from: every request it forwarded (prompt,
`max_new_tokens`, generated so far, the output-length predictor's estimate of where it
ends) and the engine's KV size. `admission_wait_s` replays the engine's rule forward in
time from that account: each running request frees its KV and reservation when it is
predicted to end (its predicted remaining tokens at the predicted TPOT) and, until then,
grows by a token per TPOT (a token of KV, less the reservation it used up); the requests
ahead of the new one are admitted in turn as the budget allows, and become running
requests themselves. The new request's admission time is the wait.

Not modelled: the engine's retractions (they raise the ratio), the prefix cache (prompts
count in full), priority aging and the chunk budget (admission is by KV alone). O(n log n)
in the requests tracked: it runs for every request at arrival.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

# SGLang's clip on the new tokens admission reserves for a request
# (SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION).
CLIP_MAX_NEW_TOKENS = 4096
# SGLang's new-token ratio schedule (SGLANG_INIT_NEW_TOKEN_RATIO, _MIN_NEW_TOKEN_RATIO_FACTOR,
# _NEW_TOKEN_RATIO_DECAY_STEPS) at the default --schedule-conservativeness (server info
# does not carry the environment's, and the reference engine does not report the flag):
# 0.7 when the engine becomes busy, falling linearly to 0.14 of that over 600 decode steps.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
# The output-length quantile a request's end is predicted at: its median, where admission
# reserves for a high quantile (a reservation must cover; a forecast should be central).
FINISH_QUANTILE = 0.5
# Completions longer than a running request's output so far that its predicted end
# needs to stand on the output-length predictor alone (`predicted_left`).
MIN_OUTLIVED = 3


def predicted_left(predicted_total: int, generated: int, max_new_tokens: int, outlived: int) -> int:
    """Tokens a running request is predicted still to generate: what the output-length
    predictor says (`predicted_total`), but where fewer than `MIN_OUTLIVED` of the
    completions it learnt from ran longer than this one has (`outlived`), at least as
    many as it has generated (it is expected to run as long again). The predictor learns
    only from requests that ended, and the long ones end last: early on, their lengths
    are those of the few that ended soon."""
    left = max(0, max_new_tokens - generated)
    floor = generated if outlived < MIN_OUTLIVED else 0
    return min(left, max(predicted_total - generated, floor))


def new_token_ratio(decode_steps: float) -> float:
    """The engine's new-token ratio after `decode_steps` busy decode steps, by SGLang's
    default schedule (the engine does not report it where the sidecar polls; a
    retraction, which raises it, is not seen)."""
    if not (math.isfinite(decode_steps) and decode_steps >= 0.0):
        raise ValueError(f"decode_steps must be a number >= 0, got {decode_steps}")
    init = INIT_NEW_TOKEN_RATIO
    floor = init * MIN_NEW_TOKEN_RATIO_FACTOR
    return max(floor, init - (init - floor) * decode_steps / NEW_TOKEN_RATIO_DECAY_STEPS)


@dataclass(frozen=True, slots=True)
class RunningRequest:
    """A request decoding in the engine, as the sidecar accounts it."""

    kv_tokens: int  # KV it holds: its prompt and what it generated
    left_tokens: int  # max_new_tokens - generated: what the engine reserves from
    predicted_left_tokens: int  # tokens until it is predicted to end (<= left_tokens)
    # The engine reserves all it may still generate, not the ratio of it: SGLang 0.5.23
    # does so for a request that ignores EOS (it will run to its limit).
    reserves_all: bool = False


@dataclass(frozen=True, slots=True)
class PendingRequest:
    """A request the engine has not admitted yet (or is prefilling)."""

    prompt_tokens: int
    max_new_tokens: int
    predicted_tokens: int  # its predicted output
    priority: int = 0  # the engine admits higher ones first
    reserves_all: bool = False  # as `RunningRequest.reserves_all`


@dataclass(frozen=True, slots=True)
class EngineBacklog:
    """What the engine's admission reserves from, as the sidecar knows it: its KV pool,
    the requests running, those not yet admitted (in the order they reached it), and how
    long it has been busy (its new-token ratio falls with the decode steps since)."""

    capacity_tokens: int
    running: tuple[RunningRequest, ...] = ()
    pending: tuple[PendingRequest, ...] = ()
    busy_s: float = 0.0

    def __post_init__(self) -> None:
        if self.capacity_tokens < 0 or not (math.isfinite(self.busy_s) and self.busy_s >= 0.0):
            raise ValueError(
                f"capacity and busy_s must be >= 0, got {self.capacity_tokens}, {self.busy_s}"
            )
        counts = [(r.kv_tokens, r.left_tokens, r.predicted_left_tokens) for r in self.running]
        counts += [(p.prompt_tokens, p.max_new_tokens, p.predicted_tokens) for p in self.pending]
        if any(min(c) < 0 for c in counts):
            raise ValueError("token counts in an engine backlog must not be negative")


def admission_wait_s(backlog: EngineBacklog, request: PendingRequest, tpot_s: float) -> float:
    """Seconds until the engine admits a new `request` behind the pending requests of its
    priority or above, when every request decodes a token per `tpot_s`. 0.0 when it fits
    now; when it would not fit even in an empty engine, the time the last request tracked
    is predicted to end."""
    if not (math.isfinite(tpot_s) and tpot_s > 0.0):
        raise ValueError(f"tpot_s must be a number > 0, got {tpot_s}")
    ratio = new_token_ratio(backlog.busy_s / tpot_s)
    # Each request admitted holds intercept + slope × t tokens of the budget at time t
    # (KV, its reservation, and the token mixed-chunk decoding sets aside for it) until
    # it ends: the sums over the live ones, and a heap of their ends.
    held = growth = 0.0
    ends: list[tuple[float, float, float]] = []
    now = 0.0
    # Admitted at `now` in the same pass: charged their whole clipped max_new_tokens, not
    # the ratio of it (SGLang's PrefillAdder), until the next pass.
    passing = 0.0

    def enter(
        kv: int, left: int, predicted_left: int, reserves_all: bool
    ) -> tuple[float, float, float]:
        nonlocal held, growth
        share = 1.0 if reserves_all else ratio
        # A token decoded is a token of KV, less the reservation it used up (none while
        # what is left exceeds the clip).
        slope = (1.0 if left > CLIP_MAX_NEW_TOKENS else 1.0 - share) / tpot_s
        intercept = kv + share * min(left, CLIP_MAX_NEW_TOKENS) + 1.0 - slope * now
        held += intercept
        growth += slope
        return now + predicted_left * tpot_s, intercept, slope

    def admit(req: PendingRequest) -> None:
        """Advance `now` to the first end after which `req` fits, and admit it."""
        nonlocal held, growth, now, passing
        clipped = min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS)
        need = req.prompt_tokens + clipped
        while backlog.capacity_tokens - held - growth * now - passing <= need and ends:
            end, intercept, slope = heapq.heappop(ends)
            if end > now:
                now, passing = end, 0.0
            held -= intercept
            growth -= slope
        passing += (0.0 if req.reserves_all else 1.0 - ratio) * clipped
        entered = enter(
            req.prompt_tokens, req.max_new_tokens, req.predicted_tokens, req.reserves_all
        )
        heapq.heappush(ends, entered)

    ends = [
        enter(r.kv_tokens, r.left_tokens, r.predicted_left_tokens, r.reserves_all)
        for r in backlog.running
    ]
    heapq.heapify(ends)
    ahead = sorted(
        (p for p in backlog.pending if p.priority >= request.priority), key=lambda p: -p.priority
    )
    for req in ahead:
        admit(req)
    admit(request)
    return now
