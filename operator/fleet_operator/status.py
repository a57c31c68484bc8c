"""The InferencePool status, computed from what the operator observed. Pure.

Conditions follow Kubernetes conventions: every type is always present, `reason` is a
CamelCase word a runbook can look up, and `lastTransitionTime` moves only when `status`
changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleet_operator.fleet import FleetObservation

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
CONTROL_PLANE_REACHABLE = "ControlPlaneReachable"
CHILD_REJECTED = "ChildRejected"


@dataclass(frozen=True, slots=True)
class DeploymentView:
    replicas: int
    ready_replicas: int
    updated_replicas: int
    observed: bool
    """Whether the Deployment controller has seen the latest Deployment spec."""

    @classmethod
    def from_manifest(cls, deployment: Mapping[str, Any]) -> DeploymentView:
        spec = deployment.get("spec") or {}
        status = deployment.get("status") or {}
        generation = (deployment.get("metadata") or {}).get("generation")
        return cls(
            replicas=int(spec.get("replicas") or 0),
            ready_replicas=int(status.get("readyReplicas") or 0),
            updated_replicas=int(status.get("updatedReplicas") or 0),
            observed=generation is None or status.get("observedGeneration") == generation,
        )


@dataclass(frozen=True, slots=True)
class Observed:
    """Everything one status pass saw."""

    generation: int
    invalid: str = ""
    """Why the spec cannot be served, empty when it can."""
    rejected: str = ""
    """The API server's refusal of a child rendered from this generation, if any."""
    deployment: DeploymentView | None = None
    fleet: FleetObservation | None = None
    control_plane_error: str = ""
    draining: Sequence[str] = ()


def condition(
    type_: str,
    status: bool,
    reason: str,
    message: str,
    generation: int,
    previous: Sequence[Mapping[str, Any]],
    now_iso: str,
) -> dict[str, Any]:
    text = "True" if status else "False"
    before = next((c for c in previous if c.get("type") == type_), None)
    since = (
        before["lastTransitionTime"]
        if before and before.get("status") == text and before.get("lastTransitionTime")
        else now_iso
    )
    return {
        "type": type_,
        "status": text,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }


def _ready(seen: Observed) -> tuple[bool, str, str]:
    if seen.invalid:
        return False, "InvalidSpec", seen.invalid
    if seen.rejected:
        return False, CHILD_REJECTED, seen.rejected
    deployment = seen.deployment
    if deployment is None:
        return False, "Creating", "the engine Deployment does not exist yet"
    if deployment.replicas == 0:
        return True, "ScaledToZero", "the pool runs no engines"
    if deployment.ready_replicas < deployment.replicas:
        return (
            False,
            "EnginesNotReady",
            f"{deployment.ready_replicas} of {deployment.replicas} engines ready",
        )
    if seen.fleet is not None and seen.fleet.live == 0:
        return False, "NoLiveEndpoints", "no endpoint of the pool holds a lease"
    return True, "EnginesReady", f"{deployment.ready_replicas} engines ready"


def _progressing(seen: Observed) -> tuple[bool, str, str]:
    deployment = seen.deployment
    if seen.draining:
        return True, "Draining", f"draining {', '.join(seen.draining)} before scaling down"
    if seen.rejected:
        return False, CHILD_REJECTED, seen.rejected
    if deployment is None:
        return (False, "InvalidSpec", seen.invalid) if seen.invalid else (True, "Creating", "")
    if not deployment.observed or deployment.updated_replicas < deployment.replicas:
        return (
            True,
            "RollingOut",
            f"{deployment.updated_replicas} of {deployment.replicas} engines updated",
        )
    return False, "Stable", "every engine runs the current spec"


def _degraded(seen: Observed) -> tuple[bool, str, str]:
    if seen.invalid:
        return True, "InvalidSpec", seen.invalid
    if seen.rejected:
        return True, CHILD_REJECTED, seen.rejected
    fleet = seen.fleet
    if fleet is not None and fleet.expired:
        return True, "LeasesExpired", f"{fleet.expired} endpoints stopped heartbeating"
    return False, "AsExpected", ""


def rejection(status: Mapping[str, Any], generation: int) -> str:
    """The child refusal recorded for this generation (a spec change clears it). It lives in
    `status.rejection`, apart from the conditions: a status pass that read the pool just
    before the refusal was written replaces the whole conditions list (a merge patch
    replaces lists), and must not erase the refusal with it."""
    recorded = status.get("rejection") or {}
    if recorded.get("observedGeneration") == generation:
        return str(recorded.get("message") or "")
    return ""


def rejection_status(message: str, generation: int) -> dict[str, Any]:
    """The status fields that record a child refusal of this generation."""
    return {"rejection": {"observedGeneration": generation, "message": message}}


def build_status(
    seen: Observed, previous_conditions: Sequence[Mapping[str, Any]], now_iso: str
) -> dict[str, Any]:
    status: dict[str, Any] = {}
    if seen.deployment is not None:
        status["replicas"] = seen.deployment.replicas
        status["readyReplicas"] = seen.deployment.ready_replicas
    fleet = seen.fleet
    if fleet is not None:
        status["endpoints"] = {
            "live": fleet.live,
            "draining": fleet.draining,
            "expired": fleet.expired,
        }
        status["watermarks"] = {str(k): v for k, v in fleet.watermark_counts().items()}
        pressure = fleet.kv_pressure
        status["kvUsage"] = "-" if pressure is None else f"{pressure:.0%}"
    reachable = (
        (False, "RedisUnavailable", seen.control_plane_error)
        if seen.control_plane_error
        else (True, "Connected", "")
    )
    status["conditions"] = [
        condition(kind, *verdict, seen.generation, previous_conditions, now_iso)
        for kind, verdict in (
            (READY, _ready(seen)),
            (PROGRESSING, _progressing(seen)),
            (DEGRADED, _degraded(seen)),
            (CONTROL_PLANE_REACHABLE, reachable),
        )
    ]
    return status
