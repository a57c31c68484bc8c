"""What Weir's hops say to each other and to clients besides their records: named once, here.

A streamed answer is server-sent events ending in `data: [DONE]`; a migrating sidecar ends
its stream instead with a `weir.preempted` event whose data is the `Continuation` (the
router resumes it elsewhere and splices the client's stream). Every refusal and every
stream that ends in failure carries one error body, OpenAI's shape with Weir's fields:
`{"error": {"type", "message", "reason", "param", "request_id", ...}}`, where `type` is
OpenAI's kind of error and `reason` Weir's finer one (a client and the metrics tell a full
quota from a stale snapshot by it).
"""

from __future__ import annotations

from typing import Final

import msgspec

DONE: Final = b"[DONE]"
"""The data of a stream's last event."""
PREEMPTED_EVENT: Final = b"weir.preempted"
"""The name of the event that ends a migrated request's stream; its data is the
continuation, as JSON."""


def sse(data: bytes) -> bytes:
    """One data event (`data` on one line, as JSON is)."""
    return b"data: " + data + b"\n\n"


DONE_FRAME: Final = sse(DONE)


def preempted_frame(continuation: bytes) -> bytes:
    """The event that hands a request's continuation back to the router."""
    return b"event: " + PREEMPTED_EVENT + b"\n" + sse(continuation)


def error_body(error_type: str, message: str, **fields: str | int | None) -> bytes:
    """The error body: `type` and `message`, then Weir's fields (`reason`, `param`,
    `request_id`, ...), those given as None left out."""
    error: dict[str, str | int] = {"type": error_type, "message": message}
    error.update((key, value) for key, value in fields.items() if value is not None)
    return msgspec.json.encode({"error": error})
