"""Create, update and resume: render the pool's children and apply what changed."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes_asyncio.client import ApiClient, ApiException, ApiextensionsV1Api

from fleet_operator.applying import Applied, apply, read_manifest
from fleet_operator.config import OperatorConfig
from fleet_operator.rendering import render_children
from fleet_operator.spec import InvalidPoolError, Pool, parse_pool
from fleet_operator.status import Observed, build_status

SERVICEMONITOR_CRD = "servicemonitors.monitoring.coreos.com"


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def classify(exc: ApiException, what: str) -> kopf.TemporaryError | kopf.PermanentError:
    """A request the API server refuses as malformed will fail the same way again; anything
    else (conflicts, throttling, outages, missing RBAC being fixed) may pass later."""
    if exc.status in (400, 422):
        return kopf.PermanentError(f"{what} rejected ({exc.status}): {exc.reason}")
    return kopf.TemporaryError(f"{what} failed ({exc.status}): {exc.reason}", delay=10)


async def monitoring_available(api: ApiClient) -> bool:
    try:
        await ApiextensionsV1Api(api).read_custom_resource_definition(SERVICEMONITOR_CRD)
    except ApiException as exc:
        if exc.status in (403, 404):
            return False
        raise classify(exc, "looking up the ServiceMonitor CRD") from exc
    return True


def deployment_ref(name: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
    }


async def reconcile(
    *,
    api: ApiClient,
    config: OperatorConfig,
    body: kopf.Body,
    name: str,
    namespace: str,
    spec: Mapping[str, Any],
    generation: int,
    status: Mapping[str, Any],
    patch: kopf.Patch,
    logger: kopf.Logger,
) -> None:
    try:
        pool = parse_pool(name, namespace, spec)
    except InvalidPoolError as exc:
        seen = Observed(generation=generation, invalid=str(exc))
        patch.status.update(build_status(seen, status.get("conditions") or [], now_iso()))
        kopf.warn(body, reason="InvalidSpec", message=str(exc))
        raise kopf.PermanentError(f"invalid pool: {exc}") from exc

    live = await read_deployment(api, pool)
    await apply_children(api, config, body, pool, live, logger)
    patch.status["observedGeneration"] = generation


async def read_deployment(api: ApiClient, pool: Pool) -> dict[str, Any] | None:
    try:
        return await read_manifest(api, deployment_ref(pool.name, pool.namespace))
    except ApiException as exc:
        raise classify(exc, "reading the engine Deployment") from exc


async def apply_children(
    api: ApiClient,
    config: OperatorConfig,
    body: kopf.Body,
    pool: Pool,
    live_deployment: Mapping[str, Any] | None,
    logger: kopf.Logger,
) -> None:
    """Render every child and apply what differs, with an event for each change."""
    # Scaling owns the replica count once the Deployment exists.
    replicas = (
        int(live_deployment["spec"]["replicas"]) if live_deployment else pool.spec.replicas.min
    )
    try:
        children = render_children(
            pool, replicas, config, monitoring=await monitoring_available(api)
        )
        for manifest in children:
            kopf.adopt(manifest, owner=body)
            outcome = await apply(api, manifest)
            if outcome is not Applied.UNCHANGED:
                message = f"{outcome} {manifest['kind']} {manifest['metadata']['name']}"
                logger.info(message)
                kopf.info(body, reason=outcome.capitalize(), message=message)
    except ApiException as exc:
        raise classify(exc, "applying the pool's children") from exc
