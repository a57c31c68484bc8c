"""Create, update and resume: render the pool's children and apply what changed."""

from __future__ import annotations

import contextlib
import datetime
import json
from collections.abc import Iterator, Mapping
from typing import Any

import aiohttp
import kopf
from kubernetes_asyncio.client import ApiClient, ApiException, ApiextensionsV1Api

from fleet_operator.applying import Applied, apply, read_manifest, write_status
from fleet_operator.config import OperatorConfig
from fleet_operator.rendering import render_children
from fleet_operator.spec import InvalidPoolError, Pool, parse_pool
from fleet_operator.status import Observed, build_status, rejection_status

SERVICEMONITOR_CRD = "servicemonitors.monitoring.coreos.com"


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


# An API server that does not answer (restarting, a network blip) is retried soon: the
# pool's status and scaling must not pause for kopf's default minute.
UNREACHABLE_RETRY_S = 2.0


class ChildRejectedError(Exception):
    """The API server refused a rendered child as invalid: only a spec change can fix it.
    The message is the server's own (which field, why)."""


def server_message(exc: ApiException) -> str:
    """The API server's explanation (its Status object's message), not just the reason."""
    try:
        status = json.loads(exc.body or "")
    except (TypeError, ValueError):
        status = None
    message = status.get("message") if isinstance(status, dict) else None
    return str(message or exc.reason or f"HTTP {exc.status}")


def classify_api_error(exc: ApiException, what: str) -> kopf.TemporaryError | kopf.PermanentError:
    """A request the API server refuses as malformed will fail the same way again; anything
    else (conflicts, throttling, outages, missing RBAC being fixed) may pass later."""
    message = f"{what} failed ({exc.status}): {server_message(exc)}"
    if exc.status in (400, 422):
        return kopf.PermanentError(message)
    if exc.status == 409:  # a write raced ours: read again at once
        return kopf.TemporaryError(message, delay=1)
    if exc.status == 429 or exc.status >= 500:  # a busy or failing server: soon
        return kopf.TemporaryError(message, delay=UNREACHABLE_RETRY_S)
    return kopf.TemporaryError(message, delay=10)  # 403, 404: RBAC or a CRD being fixed


@contextlib.contextmanager
def kubernetes_errors(what: str) -> Iterator[None]:
    """Turn what the Kubernetes client raises into kopf's temporary or permanent errors."""
    try:
        yield
    except ApiException as exc:
        raise classify_api_error(exc, what) from exc
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise kopf.TemporaryError(
            f"{what}: the API server is unreachable ({type(exc).__name__}: {exc})",
            delay=UNREACHABLE_RETRY_S,
        ) from exc


async def monitoring_available(api: ApiClient) -> bool:
    with kubernetes_errors("looking up the ServiceMonitor CRD"):
        try:
            await ApiextensionsV1Api(api).read_custom_resource_definition(SERVICEMONITOR_CRD)
        except ApiException as exc:
            if exc.status in (403, 404):
                return False
            raise
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
    logger: kopf.Logger,
) -> None:
    previous = status.get("conditions") or []
    try:
        pool = parse_pool(name, namespace, spec)
    except InvalidPoolError as exc:
        seen = Observed(generation=generation, invalid=str(exc))
        with kubernetes_errors("writing the pool's status"):
            await write_status(api, namespace, name, build_status(seen, previous, now_iso()))
        kopf.warn(body, reason="InvalidSpec", message=str(exc))
        raise kopf.PermanentError(f"invalid pool: {exc}") from exc

    live = await read_deployment(api, pool)
    try:
        await apply_children(api, config, body, pool, live, logger)
    except ChildRejectedError as exc:
        # Recorded, not raised: kopf would retry a failure, and only a spec change can fix
        # this one (the update handler then runs again). Degraded keeps it until then.
        seen = Observed(generation=generation, rejected=str(exc))
        changes = build_status(seen, previous, now_iso()) | rejection_status(str(exc), generation)
        with kubernetes_errors("writing the pool's status"):
            await write_status(api, namespace, name, changes)
        logger.error(str(exc))
        kopf.warn(body, reason="ChildRejected", message=str(exc))
        return
    with kubernetes_errors("writing the pool's status"):
        await write_status(
            api, namespace, name, {"observedGeneration": generation, "rejection": None}
        )


async def read_deployment(api: ApiClient, pool: Pool) -> dict[str, Any] | None:
    with kubernetes_errors("reading the engine Deployment"):
        return await read_manifest(api, deployment_ref(pool.name, pool.namespace))


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
    children = render_children(pool, replicas, config, monitoring=await monitoring_available(api))
    for manifest in children:
        kopf.adopt(manifest, owner=body)
        kind, name = manifest["kind"], manifest["metadata"]["name"]
        with kubernetes_errors(f"applying {kind} {name}"):
            try:
                outcome = await apply(api, manifest)
            except ApiException as exc:
                if exc.status in (400, 422):
                    raise ChildRejectedError(
                        f"the API server refused {kind} {name}: {server_message(exc)}"
                    ) from exc
                raise
        if outcome is not Applied.UNCHANGED:
            message = f"{outcome} {kind} {name}"
            logger.info(message)
            kopf.info(body, reason=outcome.capitalize(), message=message)
