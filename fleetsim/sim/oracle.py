"""The limit a policy is measured against: Weir's own orchestration with nothing hidden.

The oracle runs exactly what `WeirPolicy` runs — the router's profile and dispatch core,
the sidecars' admission, queue, watermarks and relief, the engine flags — with the two
things a real fleet never has:

- **Every answer's true length.** The sidecars' growth reserve and relief's victim
  scores use the length each request will really generate instead of the output-length
  predictor's quantile, and the router's cost model counts the true length where it
  would assume half of `max_tokens`.
- **An up-to-date view of every engine.** A sidecar re-derives its KV account at every
  engine iteration instead of at its engine-poll rhythm, and its state reaches the
  router as soon as it changes (an iteration, an admission, an end), with no change-feed
  delay, so no decision is taken on a heartbeat half a second old.

The engines themselves are the stock reference engines with Weir's flags: they are asked
for `max_tokens`, as every policy's are. What the oracle reaches is therefore the
capacity Weir's orchestration could reach with perfect prediction and perfect
information, not the fleet's physical limit.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Final

from controlplane.contract import PoolPolicy
from fleetsim.sim.config import Staleness
from fleetsim.sim.flight import SimFlight
from fleetsim.sim.loop import Simulation
from fleetsim.sim.weir import Sidecar, WeirPolicy

ORACLE_NAME: Final = "oracle"


class OraclePolicy(WeirPolicy):
    name = ORACLE_NAME
    knows_lengths = True

    def __init__(self, policy: PoolPolicy | None = None) -> None:
        super().__init__(policy)
        self._due: set[int] = set()  # sidecars whose fresh state is about to be published
        self._staleness = Staleness()

    @property
    def staleness(self) -> Staleness:
        """Nothing late: the sidecar's account is exact at every iteration and its state
        published the instant it changes (heartbeats keep their period: leases lapse as
        Weir's do)."""
        return self._staleness

    def start(self, sim: Simulation) -> None:
        self._due.clear()
        self._staleness = replace(sim.config.staleness, notify_delay_s=0.0, engine_poll_s=0.0)
        super().start(sim)

    def _heartbeat(self, sidecar: Sidecar, now: float, registered: bool = False) -> None:
        """Publish once the event that changed the sidecar is over, with its state as it
        is then (several changes in one event publish once)."""
        if registered:
            super()._heartbeat(sidecar, now, registered=True)
            return
        if sidecar.index not in self._due:
            self._due.add(sidecar.index)
            self.sim.at(now, functools.partial(self._publish_fresh, sidecar))

    def _publish_fresh(self, sidecar: Sidecar) -> None:
        self._due.discard(sidecar.index)
        if not self.sim.engines[sidecar.index].alive:
            return
        now = self.sim.now
        state, lease = self._report(sidecar, now)
        self._publish(sidecar.index, state, lease, now)

    # Every change to a sidecar's state is published. Its account is exact when it is:
    # re-derived at every iteration (engine_poll_s 0), at every end, and after admissions
    # (below) rather than adjusted by what was admitted.
    def after_step(self, engine: int, now: float) -> None:
        super().after_step(engine, now)
        self._heartbeat(self.sidecars[engine], now)

    def quiet_until(self, engine: int, now: float) -> float:
        return now  # every iteration is published

    def _admit(self, sidecar: Sidecar, now: float) -> None:
        queued = len(sidecar.queue)
        super()._admit(sidecar, now)
        if queued:
            sidecar.account()
            self._heartbeat(sidecar, now)

    def _offer(self, sidecar: Sidecar, flight: SimFlight, now: float) -> None:
        super()._offer(sidecar, flight, now)
        self._heartbeat(sidecar, now)

    def ended(self, flight: SimFlight, now: float) -> None:
        index = self._where.get(flight.rid, -1)
        super().ended(flight, now)
        if index >= 0:
            self._heartbeat(self.sidecars[index], now)
