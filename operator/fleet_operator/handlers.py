"""The kopf handlers: every decorator of the operator lives here and delegates.

- create / update (spec) / resume: parse the pool, render its children, apply what
  changed (`reconciling`). An invalid spec sets `Degraded=True, reason=InvalidSpec` and
  fails permanently: kopf retries it only when the spec changes again, so a bad pool never
  turns into a crash loop.
- a timer every `status_interval_s`: status from the Deployment, the pods and the control
  plane, and the scaling step (autoscaling, drain-first scale-down) (`observing`).
- delete: the finalizer clears the pool's control-plane state; children go with their
  owner references.

Errors are classified: an unreachable control plane or a busy API server is temporary
(retried with a delay), a child the API server rejects as invalid is permanent.

Handlers are registered into a registry the caller passes (`register`), with the settings
as arguments rather than read at import, so `weir operator` and the tests run the same
code with their own settings.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

import kopf
from kubernetes_asyncio import client, config

from fleet_operator import observing, reconciling
from fleet_operator.config import OperatorConfig
from fleet_operator.fleet import ControlPlaneUnreachableError, RedisControlPlane
from fleet_operator.scaling import RecommendationLog
from fleet_operator.spec import GROUP, PLURAL, VERSION

FINALIZER = "inference.weir.dev/control-plane"
# How long a stopping operator waits for status passes still running before it cancels them
# and closes their connections: a pass is bounded by its Redis retries and API timeouts.
PASS_GRACE_S = 10.0


async def connect_kubernetes() -> client.ApiClient:
    """In-cluster service account first, the developer's kubeconfig otherwise (the same
    order kopf's own login uses)."""
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        await config.load_kube_config()
    return client.ApiClient()


def register(registry: kopf.OperatorRegistry, operator_config: OperatorConfig) -> None:
    """Declare every handler of the operator in `registry`."""

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER
        # Handler progress and the last-handled spec live in annotations under Weir's own
        # prefix: the CRD's structural schema would prune anything kopf put in the status.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=GROUP, key="last-handled-configuration"
        )
        settings.posting.level = logging.INFO
        settings.watching.server_timeout = 300
        # A timer that does not stop at once (see _unless_deleted) is checked again this
        # often; kopf's default, 60 s, held a pool's deletion for a minute.
        settings.background.cancellation_polling = 1.0
        memo.api = await connect_kubernetes()
        memo.control = RedisControlPlane.from_url(operator_config.redis_url)
        memo.passes = StatusPasses()  # one for every pool (kopf copies the memo shallowly)

    @kopf.on.login(registry=registry)
    async def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # The same credentials as the operator's own client: service account, else kubeconfig.
        return await kopf.login_via_async_client(**kwargs)

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: Any, **_: Any) -> None:
        await memo.passes.settle(PASS_GRACE_S)
        await memo.control.close()
        await memo.api.close()

    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, field="spec", registry=registry)
    async def reconcile(
        body: kopf.Body,
        name: str,
        namespace: str | None,
        spec: kopf.Spec,
        meta: kopf.Meta,
        status: kopf.Status,
        memo: Any,
        logger: kopf.Logger,
        **_: Any,
    ) -> None:
        await reconciling.reconcile(
            api=memo.api,
            config=operator_config,
            body=body,
            name=name,
            namespace=namespace or "",
            spec=dict(spec),
            generation=int(meta.get("generation") or 0),
            status=dict(status),
            logger=logger,
        )

    @kopf.timer(
        GROUP,
        VERSION,
        PLURAL,
        interval=operator_config.status_interval_s,
        initial_delay=min(1.0, operator_config.status_interval_s),
        registry=registry,
    )
    async def observe(
        body: kopf.Body,
        name: str,
        namespace: str | None,
        spec: kopf.Spec,
        meta: kopf.Meta,
        status: kopf.Status,
        memo: Any,
        logger: kopf.Logger,
        **kwargs: Any,
    ) -> None:
        # kopf gives each pool a shallow copy of the operator's memo: what is assigned
        # here stays with this pool.
        if getattr(memo, "recommendations", None) is None:
            memo.recommendations = RecommendationLog(since=time.time(), entries=[])
        passing = observing.observe(
            api=memo.api,
            config=operator_config,
            control=memo.control,
            body=body,
            name=name,
            namespace=namespace or "",
            spec=dict(spec),
            generation=int(meta.get("generation") or 0),
            status=dict(status),
            logger=logger,
            recommendations=memo.recommendations,
        )
        # kopf passes timers `stopped`, though its TimerFn protocol does not declare it.
        await _unless_deleted(memo.passes.start(passing), kwargs["stopped"])

    @kopf.on.delete(GROUP, VERSION, PLURAL, registry=registry)
    async def forget(name: str, memo: Any, logger: kopf.Logger, **_: Any) -> None:
        try:
            removed = await memo.control.forget(name)
        except ControlPlaneUnreachableError as exc:
            raise kopf.TemporaryError(
                f"cannot clear the control plane yet: {exc}", delay=10
            ) from exc
        logger.info("cleared %d control-plane keys of pool %s", removed, name)


class StatusPasses:
    """The status passes running now. When the operator stops, kopf abandons a timer that
    does not exit at once (timers get no cancellation timeout), and then runs the cleanup
    that closes the Redis connections: the cleanup first lets the passes still running
    finish (or cancels them after a grace), else one would open a connection after the
    close and leave it open when the event loop ends."""

    def __init__(self) -> None:
        self._running: set[asyncio.Task[None]] = set()

    def start(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(work)
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return task

    async def settle(self, grace_s: float) -> None:
        """Wait up to `grace_s` for the running passes, then cancel what is left."""
        if not self._running:
            return
        _, late = await asyncio.wait(set(self._running), timeout=grace_s)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late)


async def _unless_deleted(task: asyncio.Task[None], stopped: kopf.DaemonStopped) -> None:
    """Run a status pass, abandoning it if the pool is deleted meanwhile. kopf lets a
    pool go only once its timer has exited, and re-runs the delete handlers while it
    waits: a pass held up by a slow Redis or API server must not hold the deletion."""
    stop = asyncio.ensure_future(stopped.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        stop.cancel()
    reason = stopped.reason
    if not task.done() and reason and kopf.DaemonStoppingReason.RESOURCE_DELETED in reason:
        task.cancel()
        await asyncio.wait({task})
        return
    await task  # an operator that stops lets the pass finish


def build_registry(operator_config: OperatorConfig) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    register(registry, operator_config)
    return registry
