"""A baseline router (and optionally full-`max_tokens` reservation) as a fleet policy.

Baselines route every request the moment it arrives and leave admission to the engine's
own scheduler (SGLang's: admit on estimated growth, retract on decode OOM). They see only
what their namesakes see (`fleetsim.baselines.view`): their own in-flight counts, exact;
engine queue and KV figures as of the last scrape. When an engine dies its requests are
lost: a stock router has nothing to resume them from.

P/D: a baseline routes a request's prefill with its policy over the prefill engines and,
once the KV has moved, its decode with a second instance of the same policy over the
decode engines — SGLang's router in PD mode (`--pd-disaggregation`, one policy applied to
each worker list), llm-d's prefill and decode scheduling profiles, and a plain load
balancer in front of each pool all work this way. No baseline checks that decode can take
the request before it prefills: the KV waits on the decode engine's queue.
"""

from __future__ import annotations

import copy
import math

from controlplane.contract import FinishReason, Role
from fleetsim.baselines import BaselineRouter, NoHealthyWorkerError, WorkerView
from fleetsim.baselines.reservation import MaxTokensReservation
from fleetsim.engine import EngineConfig
from fleetsim.sim.config import FleetConfig
from fleetsim.sim.flight import SimFlight
from fleetsim.sim.loop import EngineSlot, Simulation


class BaselinePolicy:
    def __init__(
        self, router: BaselineRouter, *, reserve_max_tokens: bool = False, name: str = ""
    ) -> None:
        self.router = router
        self.decode_router = router
        self.reserve = reserve_max_tokens
        self.name = name or router.name
        self._sim: Simulation | None = None
        self._outstanding: list[int] = []
        self._scraped: list[tuple[int, float]] = []
        self._scraped_at = 0.0
        # Every engine as the router sees it, by role, kept up to date as its figures
        # change (a dispatch, an ending, a scrape, a failure) rather than built anew for
        # every arrival; and each engine's place among its role's.
        self._worker_views: dict[Role, list[WorkerView]] = {}
        self._view_at: list[int] = []
        self._ledgers: list[MaxTokensReservation[SimFlight]] = []
        self._assigned: dict[str, int] = {}

    @property
    def sim(self) -> Simulation:
        assert self._sim is not None, "start() first"
        return self._sim

    def tune(self, config: EngineConfig, fleet: FleetConfig) -> EngineConfig:
        return config  # stock engine flags

    def start(self, sim: Simulation) -> None:
        self._sim = sim
        n = len(sim.engines)
        self._outstanding = [0] * n
        self._scraped = [(0, 0.0)] * n
        self._ledgers = [MaxTokensReservation(e.capacity_tokens) for e in sim.engines]
        self._view_at = [0] * n
        self._all_viewed()
        if sim.config.disaggregated:
            self.decode_router = copy.deepcopy(self.router)  # a fresh one, its own state
        sim.every(sim.config.staleness.scrape_period_s, self._scrape)

    def _scrape(self, now: float) -> None:
        self._scraped = [
            (len(e.model.waiting), e.usage) if e.alive else (0, 0.0) for e in self.sim.engines
        ]
        self._scraped_at = now
        self._all_viewed()

    def _view(self, slot: EngineSlot) -> WorkerView:
        waiting, usage = self._scraped[slot.index]
        i = slot.index
        return WorkerView(i, slot.alive, self._outstanding[i], waiting, usage, self._scraped_at)

    def _all_viewed(self) -> None:
        self._worker_views = {}
        for slot in self.sim.engines:
            views = self._worker_views.setdefault(slot.role, [])
            self._view_at[slot.index] = len(views)
            views.append(self._view(slot))

    def _viewed(self, engine: int) -> None:
        slot = self.sim.engines[engine]
        self._worker_views[slot.role][self._view_at[engine]] = self._view(slot)

    def _views(self, role: Role) -> list[WorkerView]:
        return self._worker_views.get(role, [])

    def arrive(self, flight: SimFlight, now: float) -> None:
        role = Role.PREFILL if self.sim.config.disaggregated else Role.MIXED
        self._dispatch(flight, now, self.router, role)

    def handoff(self, flight: SimFlight, prefill_engine: int, now: float) -> None:
        self._leave(flight, now)
        self._dispatch(flight, now, self.decode_router, Role.DECODE)

    def _dispatch(self, flight: SimFlight, now: float, router: BaselineRouter, role: Role) -> None:
        sim = self.sim
        try:
            engine = router.route(flight.spec, self._views(role), now)
        except NoHealthyWorkerError:
            sim.end(flight, FinishReason.OVERLOAD, now, "no healthy worker")
            return
        self._assigned[flight.rid] = engine
        self._outstanding[engine] += 1
        self._viewed(engine)
        if not self.reserve:
            sim.submit(flight, engine, now)
            return
        ledger = self._ledgers[engine]
        wanted = 1 if role is Role.PREFILL else flight.spec.max_tokens
        cost = flight.spec.input_tokens + wanted
        if not ledger.fits_ever(cost):
            sim.end(flight, FinishReason.OVERLOAD, now, "max_tokens reservation never fits")
            return
        flight.accepted = True
        flight.enqueue(now)
        self.sim.interrupt(engine)  # its iterations now admit from the ledger's queue
        ledger.offer(flight, cost)
        ledger.admit(lambda f: self._send(f, engine, now))

    def _send(self, flight: SimFlight, engine: int, now: float) -> bool:
        if flight.done:
            return False
        return self.sim.submit(flight, engine, now)

    def before_step(self, engine: int, now: float) -> None:
        if self.reserve:
            self._ledgers[engine].admit(lambda f: self._send(f, engine, now))

    def after_step(self, engine: int, now: float) -> None:
        return None

    def quiet_until(self, engine: int, now: float) -> float:
        """Always, but while requests wait in the engine's max-tokens ledger."""
        return now if self.reserve and self._ledgers[engine].queue else math.inf

    def ended(self, flight: SimFlight, now: float) -> None:
        self._leave(flight, now)

    def _leave(self, flight: SimFlight, now: float) -> None:
        """The flight is done with the engine it was assigned to."""
        engine = self._assigned.pop(flight.rid, -1)
        if engine < 0:
            return
        self._outstanding[engine] -= 1
        self._viewed(engine)
        if self.reserve:
            ledger = self._ledgers[engine]
            ledger.discard(flight)
            if self.sim.engines[engine].alive:
                ledger.admit(lambda f: self._send(f, engine, now))

    def engine_failed(self, engine: int, flights: list[SimFlight], now: float) -> None:
        self._viewed(engine)  # no longer healthy
        self.router.forget(engine)
        if self.decode_router is not self.router:
            self.decode_router.forget(engine)
        ledger = self._ledgers[engine]
        queued = [item for item, _ in ledger.queue]
        for flight in [*flights, *queued]:
            self.sim.end(flight, FinishReason.ERROR, now, f"engine {engine} failed")
