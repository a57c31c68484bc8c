"""Pure sidecar policy: functions and small deterministic objects over immutable inputs.

No I/O and no clock of its own — every time is passed in — so the fleet simulator drives
exactly this code on a virtual clock, and the live sidecar drives it on the real one.
"""

from engine_sidecar.policy.admission import (
    AdmissionDecision,
    AdmissionVerdict,
    PoolOutlook,
    SequenceOutlook,
    decide_admission,
    growth_reserve,
    total_growth_reserve,
)
from engine_sidecar.policy.lifecycle import (
    TRANSITIONS,
    IllegalTransitionError,
    RequestRecord,
    RequestState,
)
from engine_sidecar.policy.prediction import LengthKey, OutputLengthPredictor
from engine_sidecar.policy.queue import (
    AdmissionQueue,
    QueuedRequest,
    effective_priority,
    engine_priority,
    expired,
    queue_order,
    retry_after_s,
)
from engine_sidecar.policy.relief import (
    H200_LLAMA_8B,
    ModeCosts,
    ReliefCosts,
    ReliefPlan,
    Rung,
    VictimCandidate,
    VictimChoice,
    VictimScore,
    peer_room,
    plan_relief,
    score_victim,
)
from engine_sidecar.policy.watermark import (
    GrowthRate,
    KVUsage,
    classify,
    reconcile_used,
    steady_range,
)

__all__ = [
    "H200_LLAMA_8B",
    "TRANSITIONS",
    "AdmissionDecision",
    "AdmissionQueue",
    "AdmissionVerdict",
    "GrowthRate",
    "IllegalTransitionError",
    "KVUsage",
    "LengthKey",
    "ModeCosts",
    "OutputLengthPredictor",
    "PoolOutlook",
    "QueuedRequest",
    "ReliefCosts",
    "ReliefPlan",
    "RequestRecord",
    "RequestState",
    "Rung",
    "SequenceOutlook",
    "VictimCandidate",
    "VictimChoice",
    "VictimScore",
    "classify",
    "decide_admission",
    "effective_priority",
    "engine_priority",
    "expired",
    "growth_reserve",
    "peer_room",
    "plan_relief",
    "queue_order",
    "reconcile_used",
    "retry_after_s",
    "score_victim",
    "steady_range",
    "total_growth_reserve",
]
