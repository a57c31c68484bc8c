"""The router's status and debug routes: `GET /v1/models`, `/health`, `/ready`,
`/metrics`, `/weir/v1/pool` (the fleet as this router sees it) and
`/weir/v1/requests/{id}` (one request's story, behind the admin token)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web
from redis.exceptions import RedisError

from controlplane.router.errors import RouterError, unavailable
from controlplane.router.exchange import JSON
from controlplane.routing import Dispatcher, PoolSnapshot
from controlplane.transport import TransportError
from controlplane.transport.admin import admin_only

if TYPE_CHECKING:
    from controlplane.router.app import Router
    from controlplane.router.exchange import Exchange


class StatusRoutes:
    """What the router answers besides requests: read-only views of its state."""

    def __init__(self, router: Router) -> None:
        self._router = router

    def add_to(self, app: web.Application) -> None:
        app.router.add_get(
            "/weir/v1/requests/{request_id}",
            admin_only(self._router.config.admin_token, "router", self._story),
        )
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/weir/v1/pool", self._pool_status)

    async def _models(self, _request: web.Request) -> web.Response:
        data = [
            {"id": model, "object": "model", "owned_by": "weir"}
            for model in sorted(self._router.served_models())
        ]
        return web.json_response({"object": "list", "data": data})

    async def _health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _ready(self, _request: web.Request) -> web.Response:
        try:
            snapshot = self._router.view.current(self._router.clock())
        except RouterError as exc:
            return exc.response()
        if not snapshot.preferred:
            return unavailable("no_endpoint", "no ready endpoint in the pool").response()
        return web.json_response({"status": "ready", "endpoints": len(snapshot.preferred)})

    async def _metrics(self, _request: web.Request) -> web.Response:
        self._observe_snapshot()
        if self._router.quotas is not None:
            self._router.metrics.quota_releases_pending.labels(self._router.config.pool).set(
                self._router.quotas.book.pending
            )
            gauge = self._router.metrics.quota_utilization
            with contextlib.suppress(RedisError, OSError):  # scrape what is known
                for (tenant, resource), ratio in (await self._router.quotas.utilization()).items():
                    gauge.labels(self._router.config.pool, tenant, resource).set(ratio)
        return web.Response(
            body=self._router.metrics.exposition(), content_type="text/plain", charset="utf-8"
        )

    def _observe_snapshot(self) -> None:
        m, pool, snapshot = (
            self._router.metrics,
            self._router.config.pool,
            self._router.view.snapshot,
        )
        m.snapshot_age.labels(pool).set(
            max(0.0, self._router.clock() - self._router.view.confirmed_at)
        )
        m.ring_version.labels(pool).set(snapshot.ring_version)
        m.endpoints.clear()
        m.endpoint_kv.clear()
        counts: dict[tuple[str, str], int] = {}
        for e in snapshot.endpoints:
            s = e.state
            key = (s.lifecycle.value, s.watermark.value)
            counts[key] = counts.get(key, 0) + 1
            m.endpoint_kv.labels(pool, e.endpoint_id, "used").set(s.kv_used_tokens)
            m.endpoint_kv.labels(pool, e.endpoint_id, "reserved").set(s.kv_reserved_growth_tokens)
            m.endpoint_kv.labels(pool, e.endpoint_id, "capacity").set(s.kv_capacity_tokens)
        for (lifecycle, watermark), n in counts.items():
            m.endpoints.labels(pool, lifecycle, watermark).set(n)

    async def _story(self, request: web.Request) -> web.Response:
        """One request's whole story: what this router decided about it, and what each
        endpoint it went to recorded (read from their sidecars with the admin token)."""
        request_id = request.match_info["request_id"]
        story = self._router.trail.story(request_id)
        if story is None:
            return RouterError(
                404, "not_found_error", "unknown_request",
                f"no record of request {request_id!r} here (unknown, or forgotten: the "
                f"router keeps its last {self._router.trail.max_requests} requests)",
            ).response()  # fmt: skip
        events = story["events"]
        endpoints = sorted(
            {e["endpoint"] for e in events if e["event"] == "attempt"}
            | {e["decode"] for e in events if e["event"] == "pair"}  # a P/D pair's decode legs
        )
        stories = await asyncio.gather(*(self._endpoint_story(e, request_id) for e in endpoints))
        return web.json_response({**story, "endpoints": dict(zip(endpoints, stories, strict=True))})

    async def _endpoint_story(self, endpoint_id: str, request_id: str) -> Any:
        """What `endpoint_id`'s sidecar recorded about the request, or why it cannot say."""
        view = self._router.view.snapshot.by_id.get(endpoint_id)
        if view is None and self._router.pairing is not None:
            view = self._router.pairing.view.snapshot.by_id.get(endpoint_id)
        if view is None or self._router.http is None:
            return {"unavailable": "the endpoint has left the pool"}
        headers = dict(JSON)
        if self._router.config.admin_token:
            headers["Authorization"] = f"Bearer {self._router.config.admin_token}"
        url = f"{view.state.address}/weir/v1/requests/{request_id}"
        try:
            async with await self._router.http.request("GET", url, b"", headers) as reply:
                raw = await reply.read()
                if reply.status != 200:
                    return {"unavailable": f"the sidecar answered {reply.status}"}
                return msgspec.json.decode(raw)
        except (TransportError, msgspec.DecodeError) as exc:
            return {"unavailable": f"the sidecar did not answer: {exc}"}

    async def _pool_status(self, _request: web.Request) -> web.Response:
        """`GET /weir/v1/pool`: the fleet as this router sees it (`weir up`'s status view).

        Top level: `pool`, `version` (change-feed) and `ring_version` of the snapshot,
        `snapshot_age_s` since the control plane last confirmed it, `stale` (past the
        staleness bound: routing refuses), `error` (why the feed is failing; empty while it works),
        `queued` (requests in the fair queue) and `endpoints`, one object each:
        `endpoint_id`, `address`, `lifecycle`, `watermark`, `kv_used_tokens`,
        `kv_reserved_growth_tokens`, `kv_capacity_tokens`, `running_requests`,
        `queued_requests` (as last reported), `router_inflight` (sent by this router since
        that report) and `lease_left_s` (null for a fixed `--endpoint`). A prefill pool's
        router adds `decode`: its decode pool (`pool`, `stale`, `endpoints`) as it sees it."""
        now = self._router.clock()
        status = {
            "pool": self._router.config.pool,
            "version": self._router.view.snapshot.version,
            "ring_version": self._router.view.snapshot.ring_version,
            "snapshot_age_s": round(now - self._router.view.confirmed_at, 3),
            "stale": self._router.view.is_stale(now),
            "error": self._router.view.error,
            "queued": len(self._router.dispatch.queue),
            "endpoints": _endpoint_rows(self._router.view.snapshot, self._router.dispatch, now),
        }
        if self._router.pairing is not None:
            decode = self._router.pairing.view
            status["decode"] = {
                "pool": decode.pool,
                "stale": decode.is_stale(now),
                "endpoints": _endpoint_rows(decode.snapshot, self._router.pairing.dispatch, now),
            }
        return web.json_response(status)


def _endpoint_rows(
    snapshot: PoolSnapshot, dispatch: Dispatcher[Exchange], now: float
) -> list[dict[str, Any]]:
    """Each endpoint of a snapshot, for `GET /weir/v1/pool`."""
    return [
        {
            "endpoint_id": e.endpoint_id,
            "address": e.state.address,
            "lifecycle": e.state.lifecycle.value,
            "watermark": e.state.watermark.value,
            "kv_used_tokens": e.state.kv_used_tokens,
            "kv_reserved_growth_tokens": e.state.kv_reserved_growth_tokens,
            "kv_capacity_tokens": e.state.kv_capacity_tokens,
            "running_requests": e.state.running_requests,
            "queued_requests": e.state.queued_requests,
            "router_inflight": dispatch.inflight.count(e.endpoint_id),
            "lease_left_s": None
            if e.lease_deadline == float("inf")
            else round(e.lease_deadline - now, 3),
        }
        for e in snapshot.endpoints
    ]
