"""Pure sidecar policy: functions and small deterministic objects over immutable inputs.

No I/O and no clock of its own — every time is passed in — so the fleet simulator drives
exactly this code on a virtual clock, and the live sidecar drives it on the real one.
"""

from engine_sidecar.policy.admission import (
    RESERVED,
    TPOT_OBJECTIVE,
    AdmissionDecision,
    AdmissionVerdict,
    PoolOutlook,
    SequenceOutlook,
    decide_admission,
    growth_reserve,
    growth_tokens,
    total_growth_reserve,
    tpot_gate_s,
)
from engine_sidecar.policy.host_prefixes import HostPrefixes
from engine_sidecar.policy.latency import (
    EngineLoad,
    LatencyForecast,
    LatencyPredictor,
    OnlineLinear,
)
from engine_sidecar.policy.lifecycle import (
    TRANSITIONS,
    IllegalTransitionError,
    RequestRecord,
    RequestState,
)
from engine_sidecar.policy.prediction import LengthKey, OutputLengthPredictor
from engine_sidecar.policy.prompt_size import PromptSizer
from engine_sidecar.policy.queue import (
    AdmissionQueue,
    QueuedRequest,
    admits_now,
    effective_priority,
    engine_priority,
    expired,
    queue_order,
    queue_wait_s,
    queued_request,
    retry_after_s,
)
from engine_sidecar.policy.relief import (
    H200_LLAMA_8B,
    ModeCosts,
    ReliefCosts,
    ReliefPlan,
    Rung,
    TargetRooms,
    VictimCandidate,
    VictimChoice,
    VictimScore,
    continuation_tokens,
    peer_rooms,
    plan_relief,
    score_victim,
)
from engine_sidecar.policy.reservation import (
    RESERVATION_TTL_S,
    Reservation,
    Reservations,
    pick_target,
    reservable_tokens,
)
from engine_sidecar.policy.watermark import (
    GrowthRate,
    KVUsage,
    classify_watermark,
    reconcile_used,
    steady_range,
)

__all__ = [
    "H200_LLAMA_8B",
    "RESERVATION_TTL_S",
    "RESERVED",
    "TPOT_OBJECTIVE",
    "TRANSITIONS",
    "AdmissionDecision",
    "AdmissionQueue",
    "AdmissionVerdict",
    "EngineLoad",
    "GrowthRate",
    "HostPrefixes",
    "IllegalTransitionError",
    "KVUsage",
    "LatencyForecast",
    "LatencyPredictor",
    "LengthKey",
    "ModeCosts",
    "OnlineLinear",
    "OutputLengthPredictor",
    "PoolOutlook",
    "PromptSizer",
    "QueuedRequest",
    "ReliefCosts",
    "ReliefPlan",
    "RequestRecord",
    "RequestState",
    "Reservation",
    "Reservations",
    "Rung",
    "SequenceOutlook",
    "TargetRooms",
    "VictimCandidate",
    "VictimChoice",
    "VictimScore",
    "admits_now",
    "classify_watermark",
    "continuation_tokens",
    "decide_admission",
    "effective_priority",
    "engine_priority",
    "expired",
    "growth_reserve",
    "growth_tokens",
    "peer_rooms",
    "pick_target",
    "plan_relief",
    "queue_order",
    "queue_wait_s",
    "queued_request",
    "reconcile_used",
    "reservable_tokens",
    "retry_after_s",
    "score_victim",
    "steady_range",
    "total_growth_reserve",
    "tpot_gate_s",
]
