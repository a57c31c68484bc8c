"""A request's id across the hops, and the decisions each hop records about it.

The router takes the client's `x-request-id` when it is one Weir can carry, else mints
one, answers with it (header and error bodies) and sends it to the sidecar as
`x-weir-request-id`; the sidecar starts its engine rids with it, so SGLang's own logs name
it too. While a hop handles a request, its log lines carry the id (`RequestIdFilter`).

Each hop records what it decided — the route and why, admission and its arithmetic, relief
and its alternatives, a resume and its target, the finish — in a `Trail`: a bounded
in-memory ring of recent requests, served by an authenticated debug route
(`GET /weir/v1/requests/{id}`), and one JSON line per record on the `weir.decisions`
logger when it is enabled at DEBUG (`--log-decisions`). Records are cheap dicts; the costly
parts of an explanation (every scorer's term for every candidate) are computed only while
`detailed` is on.
"""

from __future__ import annotations

import contextvars
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec

_CARRIED = re.compile(r"[A-Za-z0-9._:-]{1,64}\Z")
# Never in a request id (and allowed in store keys): it ends the id in a sidecar rid.
RID_SEPARATOR = "@"

NO_REQUEST = "-"
current_request: contextvars.ContextVar[str] = contextvars.ContextVar(
    "weir_request_id", default=NO_REQUEST
)

DECISIONS = logging.getLogger("weir.decisions")
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s [%(request_id)s] %(message)s"


def handled_request() -> str | None:
    """The id of the request being handled, None outside one (for its error bodies)."""
    request_id = current_request.get()
    return None if request_id == NO_REQUEST else request_id


def carried_request_id(given: str | None) -> str:
    """`given` when Weir can carry it across the hops (1 to 64 of `A-Za-z0-9._:-`), else
    a fresh id: a client's malformed tracing header never fails its request."""
    if given and _CARRIED.match(given):
        return given
    return uuid.uuid4().hex


def sidecar_rid(request_id: str) -> str:
    """A sidecar's rid for one request of `request_id`: the id, the separator, 32 hex.

    SGLang aborts every rid that *starts with* the one named, so no rid may be a prefix of
    another. Ids never hold the separator, so its first occurrence ends the id: one rid
    starts with another only if both ids and both 32-hex parts are equal."""
    return f"{request_id}{RID_SEPARATOR}{uuid.uuid4().hex}"


class RequestIdFilter(logging.Filter):
    """Puts the id of the request being handled (`-` for none) on every log record as
    `request_id`, for `LOG_FORMAT`. Installed on handlers, so it covers every logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current_request.get()
        return True


def configure_logging(level: str, log_decisions: bool = False) -> None:
    """The request-path services' logging: `LOG_FORMAT` with request ids, at `level`;
    `log_decisions` turns the `weir.decisions` JSON records on whatever `level` is."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    if log_decisions:
        DECISIONS.setLevel(logging.DEBUG)


class Trail:
    """What one hop decided about its recent requests, newest last: at most
    `max_requests` requests (the oldest forgotten first) of at most `max_events` records
    each (a request's later records beyond that are counted, not kept)."""

    def __init__(
        self,
        hop: str,
        max_requests: int = 4096,
        max_events: int = 64,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.hop = hop
        self.max_requests = max_requests
        self.max_events = max_events
        self.clock = clock
        self._requests: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._dropped: dict[str, int] = {}

    @property
    def detailed(self) -> bool:
        """Whether records should carry their costly details (decision logs are on)."""
        return DECISIONS.isEnabledFor(logging.DEBUG)

    def record(self, request_id: str, event: str, **fields: Any) -> None:
        entry = {"at": round(self.clock(), 6), "hop": self.hop, "event": event, **fields}
        events = self._requests.get(request_id)
        if events is None:
            events = self._requests[request_id] = []
            if len(self._requests) > self.max_requests:
                forgotten, _ = self._requests.popitem(last=False)
                self._dropped.pop(forgotten, None)
        if len(events) < self.max_events:
            events.append(entry)
        else:
            self._dropped[request_id] = self._dropped.get(request_id, 0) + 1
        if DECISIONS.isEnabledFor(logging.DEBUG):
            line = {"request_id": request_id, **entry}
            DECISIONS.debug("%s", msgspec.json.encode(line).decode())

    def story(self, request_id: str) -> dict[str, Any] | None:
        """The request's records at this hop, or None when it has none (never seen, or
        forgotten)."""
        events = self._requests.get(request_id)
        if events is None:
            return None
        story: dict[str, Any] = {"request_id": request_id, "hop": self.hop, "events": events}
        if dropped := self._dropped.get(request_id):
            story["events_dropped"] = dropped
        return story


def request_id_of(rid: str) -> str:
    """The request id a sidecar rid (or an engine rid made from one) starts with."""
    return rid.partition(RID_SEPARATOR)[0]
