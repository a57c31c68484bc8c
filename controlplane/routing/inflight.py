"""What a router has sent that its pool snapshot does not show yet.

An endpoint's report (`running_requests`, `queued_requests`) counts every request that
reached it before the report was taken. A router adds what it dispatched since: each
dispatch counts from the moment it is sent until the earlier of its request's end and
the endpoint's first report taken after it — never both in the report and here. An
endpoint that never reports (a fixed `--endpoint`) keeps its dispatches counted until
they end. Clock-free; the router and the simulator both keep one.
"""

from __future__ import annotations


class InFlight:
    def __init__(self) -> None:
        self._sent: dict[str, dict[str, float]] = {}  # endpoint -> request key -> sent at
        self.counts: dict[str, int] = {}  # endpoint -> dispatches not yet reported
        self.total = 0

    def add(self, endpoint_id: str, key: str, now: float) -> None:
        sent = self._sent.setdefault(endpoint_id, {})
        if key not in sent:
            sent[key] = now
            self.counts[endpoint_id] = len(sent)
            self.total += 1

    def remove(self, endpoint_id: str, key: str) -> None:
        """The request ended, or left the endpoint, before a report showed it."""
        sent = self._sent.get(endpoint_id)
        if sent is not None and sent.pop(key, None) is not None:
            self._counted(endpoint_id, sent, 1)

    def reported(self, endpoint_id: str, taken_at: float) -> None:
        """The endpoint reported at `taken_at`: what was sent until then is in the report."""
        sent = self._sent.get(endpoint_id)
        if not sent:
            return
        shown = [key for key, at in sent.items() if at <= taken_at]
        for key in shown:
            del sent[key]
        if shown:
            self._counted(endpoint_id, sent, len(shown))

    def count(self, endpoint_id: str) -> int:
        return self.counts.get(endpoint_id, 0)

    def _counted(self, endpoint_id: str, sent: dict[str, float], gone: int) -> None:
        self.total -= gone
        if sent:
            self.counts[endpoint_id] = len(sent)
        else:
            self.counts.pop(endpoint_id, None)
            del self._sent[endpoint_id]
