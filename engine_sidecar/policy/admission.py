"""Local memory admission: committed KV + near-term growth reserve + safety ≤ capacity.

The reserve is what the running sequences will add over the next `growth_horizon_steps`
decode steps, each bounded by its remaining `max_new_tokens` and by the predicted-length
quantile. Reserving full `max_tokens` would admit far too few requests; reserving nothing
would admit requests the pool cannot grow into, and preempt constantly. A sequence with
tokens left always reserves at least one.

The safety margin is the emergency band above `emergency_watermark` plus the policy's
absolute `headroom_tokens`. When the watermark is already critical or worse the sidecar
admits nothing new (the relief ladder's second rung) whatever the arithmetic says — except
a continuation for which it held room (a migration's reservation, `RESERVED`): that room
was counted as committed when it was granted, so taking it changes no watermark.

A request larger than the margin allows — its prompt and reserve past capacity minus
safety — is still one the engine can serve if its prompt and its whole output limit fit
the KV (`alone_tokens`): it runs alone (`ALONE`), admitted once what the endpoint holds
leaves room for all of it, and waits until then. Only one that could not fit an empty
engine is refused as `too_large`. The whole output limit, not the predicted output,
because that is what the engine's own scheduler reserves before it schedules a prompt:
one admitted on a shorter prediction would wait in the engine for room it never gets.
Relief never preempts such a request (`relief.resumable_anywhere`: no endpoint's margin
would take its continuation); the requests beside it are the victims if it grows into
the emergency band.

Memory is not the only objective that binds. A prompt's prefill shares the engine's
iterations with the running batch and stretches every one of them: at full KV on a large
batch, a second and a third prefill admitted beside a pending one push every running
stream past its TPOT objective long before the KV is full, and under overload every
stream misses it. So when the pool declares a TPOT objective (`target_tpot_s`) and the
engine's predicted TPOT (its sidecar's latency model, on the load now) is above it, a new
request waits (`TPOT_OBJECTIVE`) while one admitted earlier still waits for its first
token. The gate engages only then: the prefill in flight is what stretches the
iterations, and a gate on the prediction alone cost a fifth of the goodput at three
quarters of nominal load (measured in the simulator); one prefill at a time is always let in,
so the gate slows admission and never stops it. Only an engine that both prefills and
decodes has the gate (`tpot_gate_s`): a prefill engine streams one token per request, and
a decode engine's "prefill" is the KV its prefill peer sends, which stretches nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from controlplane.contract import KVPolicy, Role, SchedulingPolicy, WatermarkState


@dataclass(frozen=True, slots=True)
class SequenceOutlook:
    """A sequence's growth prospects: how much it has, may and is predicted to generate."""

    generated_tokens: int
    max_new_tokens: int
    predicted_total_tokens: int


def growth_reserve(seq: SequenceOutlook, horizon_steps: int) -> int:
    """Tokens this sequence is expected to add over the next `horizon_steps` steps."""
    return growth_tokens(
        seq.generated_tokens, seq.max_new_tokens, seq.predicted_total_tokens, horizon_steps
    )


def growth_tokens(
    generated_tokens: int, max_new_tokens: int, predicted_total_tokens: int, horizon_steps: int
) -> int:
    """`growth_reserve` of a sequence given by its figures (an account over every
    running sequence builds no outlook for each)."""
    remaining = max_new_tokens - generated_tokens
    if remaining <= 0:
        return 0
    predicted = max(1, predicted_total_tokens - generated_tokens)
    return max(1, min(horizon_steps, remaining, predicted))


def total_growth_reserve(sequences: Iterable[SequenceOutlook], horizon_steps: int) -> int:
    return sum(growth_reserve(seq, horizon_steps) for seq in sequences)


class AdmissionVerdict(enum.StrEnum):
    ADMIT = "admit"
    WAIT = "wait"  # fits in principle, not now: queue it
    REFUSE = "refuse"  # can never fit (too_large), however long it waits


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    verdict: AdmissionVerdict
    reason: str
    needed_tokens: int
    available_tokens: int


# The reason of an admission into room held for the request (a consumed reservation).
RESERVED = "reserved"
# The reason of a request past the margin that fits the whole KV: admitted, or waiting,
# to run alone.
ALONE = "alone"
# The reason of a request that waits for a pending prefill while its engine's predicted
# TPOT is past the pool's objective.
TPOT_OBJECTIVE = "tpot_objective"


@dataclass(frozen=True, slots=True)
class PoolOutlook:
    """The KV pool as admission sees it."""

    capacity_tokens: int
    used_tokens: int
    reserved_growth_tokens: int
    watermark: WatermarkState
    admission_open: bool = True
    # A request admitted here still waits for its first token, and the engine's predicted
    # TPOT on the load now: what the TPOT gate reads (0 where no objective is declared).
    prefill_pending: bool = False
    predicted_tpot_s: float = 0.0

    def over_tpot(self, target_tpot_s: float) -> bool:
        """Whether the TPOT gate holds new requests back (`target_tpot_s` 0: no gate)."""
        return 0.0 < target_tpot_s < self.predicted_tpot_s and self.prefill_pending


def tpot_gate_s(scheduling: SchedulingPolicy, role: Role) -> float:
    """The TPOT objective an engine of `role` gates its admission on (0: none)."""
    return scheduling.target_tpot_s if role is Role.MIXED else 0.0


def alone_tokens(candidate: SequenceOutlook, prompt_tokens: int, policy: KVPolicy) -> int:
    """The KV a request needs to run on an otherwise empty engine: its prompt, its whole
    remaining output limit and the page the engine's scheduler adds to each request."""
    remaining = max(1, candidate.max_new_tokens - candidate.generated_tokens)
    return prompt_tokens + remaining + policy.page_size


def decide_admission(
    candidate: SequenceOutlook,
    prompt_tokens: int,
    pool: PoolOutlook,
    policy: KVPolicy,
    *,
    held: bool = False,
    target_tpot_s: float = 0.0,
) -> AdmissionDecision:
    """Whether a request with `prompt_tokens` and growth prospects `candidate` fits now.
    `held`: this endpoint held room for it until now (a reservation just consumed, no
    longer counted in `pool`): only the arithmetic decides, not the watermark, a pause or
    the TPOT gate. `target_tpot_s`: the pool's TPOT objective (0: none)."""
    needed = prompt_tokens + growth_reserve(candidate, policy.growth_horizon_steps)
    capacity = pool.capacity_tokens
    safety = policy.safety_tokens(capacity)
    available = max(0, capacity - pool.used_tokens - pool.reserved_growth_tokens - safety)
    if capacity <= 0:
        return AdmissionDecision(AdmissionVerdict.WAIT, "capacity_unknown", needed, 0)
    if needed > capacity - safety:
        alone = alone_tokens(candidate, prompt_tokens, policy)
        room = max(0, capacity - pool.used_tokens - pool.reserved_growth_tokens)
        # The engine's scheduler takes a prompt only into strictly more room than this.
        if alone >= capacity:
            return AdmissionDecision(AdmissionVerdict.REFUSE, "too_large", alone, room)
        if alone >= room or not pool.admission_open:
            return AdmissionDecision(AdmissionVerdict.WAIT, ALONE, alone, room)
        if pool.over_tpot(target_tpot_s):
            return AdmissionDecision(AdmissionVerdict.WAIT, TPOT_OBJECTIVE, alone, room)
        return AdmissionDecision(AdmissionVerdict.ADMIT, ALONE, alone, room)
    if held and needed <= available:
        return AdmissionDecision(AdmissionVerdict.ADMIT, RESERVED, needed, available)
    if not pool.admission_open:
        return AdmissionDecision(AdmissionVerdict.WAIT, "admission_paused", needed, available)
    if pool.watermark.rank >= WatermarkState.CRITICAL.rank:
        return AdmissionDecision(
            AdmissionVerdict.WAIT, f"watermark_{pool.watermark}", needed, available
        )
    if needed > available:
        return AdmissionDecision(AdmissionVerdict.WAIT, "kv_reserve", needed, available)
    if pool.over_tpot(target_tpot_s):
        return AdmissionDecision(AdmissionVerdict.WAIT, TPOT_OBJECTIVE, needed, available)
    return AdmissionDecision(AdmissionVerdict.ADMIT, "fits", needed, available)
