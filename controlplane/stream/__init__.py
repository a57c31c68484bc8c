"""A streamed request's output as the router and the sidecar both read, count, splice and
relay it: the engine's events (`events`), one request's stream across its segments
(`splicer`, pure), and the loop that relays a segment from the upstream connection's read
callback (`relay`, imported from its module: it is the only part that does I/O). The wire
vocabulary they speak (`[DONE]`, `weir.preempted`, the error body) is
`controlplane.contract.vocabulary`."""

from controlplane.stream.events import finish_reason
from controlplane.stream.splicer import Asks, MalformedEventError, Splicer, ask_for_counts

__all__ = [
    "Asks",
    "MalformedEventError",
    "Splicer",
    "ask_for_counts",
    "finish_reason",
]
