"""The decode half of a P/D pair, chosen before either leg starts.

A prefill pool's router serves each request as a pair (`controlplane.router.pd`): once
its prefill endpoint is picked, the decode endpoint is picked too, at once, by the
decode pool's own dispatch core over the decode pool's snapshot; both legs then start
together and the decode engine holds room for the prompt's KV while the prefill runs.
A decode side that cannot take the request now refuses it (429 `decode_saturated`)
rather than queue it behind a prefill that would run for nothing. The fleet simulator
pairs its flights with the same two calls (`fleetsim.sim.weir`).

Pure: the caller passes the instant and the decode pool's snapshot.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Final, TypeVar

from controlplane.contract import Role
from controlplane.routing.dispatch import ENDPOINTS_OVERLOADED, Dispatcher, Placed, Refusal, Refused
from controlplane.routing.snapshot import PoolSnapshot, RouteRequest

P = TypeVar("P")

DECODE_SATURATED = "decode_saturated"
# A client told the decode side is saturated asks again after this long.
DECODE_SATURATED_RETRY_S: Final = 1.0


def decode_route(route: RouteRequest, generated: int, failed: Collection[str]) -> RouteRequest:
    """The decode leg of `route` (the request as its prefill pool's router took it), after
    `generated` tokens the client already holds: the prompt and those tokens are its KV,
    the rest of the output limit its growth; the decode endpoints in `failed` refused or
    failed it already. The prefill pool's owners, blocks and deadline do not apply."""
    return RouteRequest(
        request_id=route.request_id,
        model=route.model,
        prompt_tokens=route.prompt_tokens + generated,
        max_new_tokens=max(1, route.max_new_tokens - generated),
        tenant=route.tenant,
        adapter=route.adapter,
        role=Role.DECODE,
        priority=route.priority,
        exclude=frozenset(failed),
    )


def place_decode(
    dispatch: Dispatcher[P], route: RouteRequest, payload: P, now: float, snapshot: PoolSnapshot
) -> str | Refusal:
    """The decode endpoint for the pair now (reserved in `dispatch` until the caller's
    `finished`), or why the pair cannot start: the dispatch core's refusal, or
    `decode_saturated` where the core would have queued it (it is not left waiting)."""
    for event in dispatch.arrive(route, payload, now, snapshot):
        if event.payload is not payload:
            continue
        if isinstance(event, Placed):
            return event.endpoint_id
        if isinstance(event, Refused):
            return event.refusal
    dispatch.finished(route.request_id, 0, now, snapshot)
    message = f"no endpoint of decode pool {snapshot.pool!r} can take it now"
    return Refusal(429, DECODE_SATURATED, DECODE_SATURATED_RETRY_S, message)


def decode_attempts_spent(attempts: int, retry_after_s: float) -> Refusal:
    """The pair's refusal once `attempts` decode endpoints refused or failed it before
    the client had a byte."""
    message = f"{attempts} decode endpoint(s) refused or failed the request"
    return Refusal(429, ENDPOINTS_OVERLOADED, max(1.0, retry_after_s), message)
