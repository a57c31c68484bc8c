"""The periodic pass: status from the Deployment, the pods and the control plane, and the
scaling step.

A scale-down drains first. The victims (see `scaling.pick_victims`) are marked draining in
the control plane, so routers stop sending them work, and get the lowest
`controller.kubernetes.io/pod-deletion-cost`, so the ReplicaSet removes exactly them. The
replica count drops only once they are idle or the pool's drain deadline has passed. The
drain in progress is kept in `status.drain`, so it survives an operator restart. A drain
is never cancelled half-way (the control plane has no "undrain"): if the target rises
meanwhile, the drain completes and the next pass scales up with fresh engines.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import kopf
from kubernetes_asyncio.client import ApiClient, AppsV1Api, CoreV1Api

from fleet_operator.applying import merge_patch, write_status
from fleet_operator.config import OperatorConfig
from fleet_operator.fleet import ControlPlane, ControlPlaneUnreachableError, FleetObservation
from fleet_operator.reconciling import (
    apply_children,
    kubernetes_errors,
    now_iso,
    read_deployment,
)
from fleet_operator.rendering import POOL_LABEL
from fleet_operator.scaling import (
    PodView,
    Recommendation,
    RecommendationLog,
    drain_finished,
    pick_victims,
    prune,
    recommend,
    target_replicas,
)
from fleet_operator.spec import InvalidPoolError, Pool, parse_pool
from fleet_operator.status import DeploymentView, Observed, build_status, rejection

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
VICTIM_COST = "-1000"


async def observe(
    *,
    api: ApiClient,
    config: OperatorConfig,
    control: ControlPlane,
    body: kopf.Body,
    name: str,
    namespace: str,
    spec: Mapping[str, Any],
    generation: int,
    status: Mapping[str, Any],
    logger: kopf.Logger,
    recommendations: RecommendationLog,
) -> None:
    previous = status.get("conditions") or []
    read_version = str(body.get("metadata", {}).get("resourceVersion") or "")
    changes: dict[str, Any] = {}  # of the status: only what changed is written
    try:
        pool = parse_pool(name, namespace, spec)
    except InvalidPoolError as exc:
        seen = Observed(generation=generation, invalid=str(exc))
        changes = merge_patch(build_status(seen, previous, now_iso()), status)
        with kubernetes_errors("writing the pool's status"):
            await write_status(api, namespace, name, changes, read_version)
        return
    rejected = rejection(status, generation)
    live = await read_deployment(api, pool)
    if live is None and status.get("observedGeneration") is not None and not rejected:
        # Rendered once, gone now (deleted by hand, or lost): render the children again.
        logger.warning("the engine Deployment is missing; rendering the pool's children again")
        await apply_children(api, config, body, pool, None, logger)
        live = await read_deployment(api, pool)
    deployment = DeploymentView.from_manifest(live) if live else None
    fleet: FleetObservation | None = None
    unreachable = ""
    try:
        fleet = await control.observe(pool.name)
    except ControlPlaneUnreachableError as exc:
        unreachable = str(exc)
        logger.warning("control plane unreachable: %s", exc)
    draining: Sequence[str] = (status.get("drain") or {}).get("victims") or ()
    if deployment is not None and fleet is not None:
        try:
            with kubernetes_errors("scaling the pool"):
                deployment, draining = await _scale(
                    api, control, body, pool, deployment, fleet, status, changes, logger,
                    recommendations,
                )  # fmt: skip
        except ControlPlaneUnreachableError as exc:
            unreachable = str(exc)
    seen = Observed(
        generation=generation,
        rejected=rejected,
        deployment=deployment,
        fleet=fleet,
        control_plane_error=unreachable,
        draining=draining,
    )
    # Only what changed: an idle pool costs the API server no writes.
    changes.update(merge_patch(build_status(seen, previous, now_iso()), status))
    with kubernetes_errors("writing the pool's status"):
        await write_status(api, namespace, name, changes, read_version)


async def _pods(api: ApiClient, pool: Pool) -> list[PodView]:
    listed = await CoreV1Api(api).list_namespaced_pod(
        pool.namespace, label_selector=f"{POOL_LABEL}={pool.name}"
    )
    pods: list[PodView] = []
    for pod in listed.items:
        # Filter again: a selector is a request, and terminating pods are already leaving.
        if (pod.metadata.labels or {}).get(POOL_LABEL) != pool.name:
            continue
        if pod.metadata.deletion_timestamp:
            continue
        conditions = (pod.status.conditions if pod.status else None) or []
        ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
        pods.append(PodView(name=pod.metadata.name, ready=ready))
    return pods


async def _set_replicas(api: ApiClient, pool: Pool, replicas: int) -> None:
    await AppsV1Api(api).patch_namespaced_deployment(
        pool.name, pool.namespace, {"spec": {"replicas": replicas}}
    )


async def _scale(
    api: ApiClient,
    control: ControlPlane,
    body: kopf.Body,
    pool: Pool,
    deployment: DeploymentView,
    fleet: FleetObservation,
    status: Mapping[str, Any],
    changes: dict[str, Any],
    logger: kopf.Logger,
    log: RecommendationLog,
) -> tuple[DeploymentView, Sequence[str]]:
    """One scaling step; returns the Deployment as it now stands and the victims still
    draining."""
    now = time.time()
    current = deployment.replicas
    drain = status.get("drain")
    if drain:
        victims = list(drain.get("victims") or [])
        deadline = pool.spec.sidecar.drain_deadline_seconds
        if not drain_finished(victims, fleet, float(drain.get("startedAt") or 0), now, deadline):
            return deployment, victims
        target = int(drain["targetReplicas"])
        await _set_replicas(api, pool, target)
        changes["drain"] = None
        message = f"scaled {current} -> {target} engines after draining {', '.join(victims)}"
        logger.info(message)
        kopf.info(body, reason="ScaledDown", message=message)
        return dataclasses.replace(deployment, replicas=target), ()

    policy = pool.spec.autoscaling
    if policy.enabled:
        log.entries = prune(
            [*log.entries, Recommendation(now, recommend(policy, fleet, current))], policy, now
        )
    target = target_replicas(pool.spec.replicas, policy, log.entries, now, current, log.since)
    if policy.enabled and (status.get("autoscaler") or {}).get("recommendedReplicas") != target:
        changes["autoscaler"] = {"recommendedReplicas": target}
    if target > current:
        await _set_replicas(api, pool, target)
        message = f"scaled {current} -> {target} engines"
        logger.info(message)
        kopf.info(body, reason="ScaledUp", message=message)
        return dataclasses.replace(deployment, replicas=target), ()
    if target == current:
        return deployment, ()

    victims = pick_victims(await _pods(api, pool), fleet, current - target)
    registered = await control.drain(pool.name, victims)
    core = CoreV1Api(api)
    for victim in victims:
        await core.patch_namespaced_pod(
            victim,
            pool.namespace,
            {"metadata": {"annotations": {DELETION_COST: VICTIM_COST}}},
        )
    changes["drain"] = {"victims": victims, "targetReplicas": target, "startedAt": now}
    message = (
        f"draining {', '.join(victims) or 'no pods'} ({len(registered)} registered) "
        f"before scaling {current} -> {target}"
    )
    logger.info(message)
    kopf.info(body, reason="Draining", message=message)
    return deployment, victims
