"""A baseline router (and optionally full-`max_tokens` reservation) as a fleet policy.

Baselines route every request the moment it arrives and leave admission to the engine's
own scheduler (SGLang's: admit on estimated growth, retract on decode OOM). They see only
what their namesakes see (`fleetsim.baselines.view`): their own in-flight counts, exact;
engine queue and KV figures as of the last scrape. When an engine dies its requests are
lost: a stock router has nothing to resume them from.
"""

from __future__ import annotations

from controlplane.contract import FinishReason
from fleetsim.baselines import BaselineRouter, NoHealthyWorkerError, WorkerView
from fleetsim.baselines.reservation import MaxTokensReservation
from fleetsim.engine import EngineConfig
from fleetsim.sim.config import FleetConfig
from fleetsim.sim.flight import Flight
from fleetsim.sim.loop import Simulation


class BaselinePolicy:
    def __init__(
        self, router: BaselineRouter, *, reserve_max_tokens: bool = False, name: str = ""
    ) -> None:
        self.router = router
        self.reserve = reserve_max_tokens
        self.name = name or router.name
        self._sim: Simulation | None = None
        self._outstanding: list[int] = []
        self._scraped: list[tuple[int, float]] = []
        self._scraped_at = 0.0
        self._ledgers: list[MaxTokensReservation[Flight]] = []
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
        sim.every(sim.config.staleness.scrape_period_s, self._scrape)

    def _scrape(self, now: float) -> None:
        self._scraped = [
            (len(e.model.waiting), e.usage) if e.alive else (0, 0.0) for e in self.sim.engines
        ]
        self._scraped_at = now

    def _views(self) -> list[WorkerView]:
        return [
            WorkerView(
                e.index,
                e.alive,
                self._outstanding[e.index],
                self._scraped[e.index][0],
                self._scraped[e.index][1],
                self._scraped_at,
            )
            for e in self.sim.engines
        ]

    def arrive(self, flight: Flight, now: float) -> None:
        self._dispatch(flight, now)

    def _dispatch(self, flight: Flight, now: float) -> None:
        sim = self.sim
        try:
            engine = self.router.route(flight.spec, self._views(), now)
        except NoHealthyWorkerError:
            sim.end(flight, FinishReason.OVERLOAD, now, "no healthy worker")
            return
        self._assigned[flight.rid] = engine
        self._outstanding[engine] += 1
        if not self.reserve:
            sim.submit(flight, engine, now)
            return
        ledger = self._ledgers[engine]
        cost = flight.spec.input_tokens + flight.spec.max_tokens
        if not ledger.fits_ever(cost):
            sim.end(flight, FinishReason.OVERLOAD, now, "max_tokens reservation never fits")
            return
        flight.accepted = True
        flight.enqueue(now)
        ledger.offer(flight, cost)
        ledger.admit(lambda f: self._send(f, engine, now))

    def _send(self, flight: Flight, engine: int, now: float) -> bool:
        if flight.done:
            return False
        return self.sim.submit(flight, engine, now)

    def before_step(self, engine: int, now: float) -> None:
        if self.reserve:
            self._ledgers[engine].admit(lambda f: self._send(f, engine, now))

    def after_step(self, engine: int, now: float) -> None:
        return None

    def ended(self, flight: Flight, now: float) -> None:
        engine = self._assigned.pop(flight.rid, -1)
        if engine < 0:
            return
        self._outstanding[engine] -= 1
        if self.reserve:
            ledger = self._ledgers[engine]
            ledger.discard(flight)
            if self.sim.engines[engine].alive:
                ledger.admit(lambda f: self._send(f, engine, now))

    def engine_failed(self, engine: int, flights: list[Flight], now: float) -> None:
        self.router.forget(engine)
        ledger = self._ledgers[engine]
        queued = [item for item, _ in ledger.queue]
        for flight in [*flights, *queued]:
            self.sim.end(flight, FinishReason.ERROR, now, f"engine {engine} failed")
