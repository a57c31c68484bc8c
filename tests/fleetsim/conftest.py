"""Reference-engine fixtures: a served engine on a loopback port, fast enough for tests."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator

import pytest

from fleetsim.engine import EngineConfig, EngineModel, EngineRequest, encode
from fleetsim.server import RunningEngine, serve_engine
from tests import polling

# Fast simulated GPU: an 8B decode step of ~7 ms takes ~0.1 ms of wall time.
FAST = 64.0


def small_config(**changes: object) -> EngineConfig:
    """A small pool so tests exercise admission, eviction and retraction quickly."""
    base = EngineConfig(
        max_total_tokens=16384, page_size=4, chunked_prefill_size=512, speed_factor=FAST
    )
    return base.replace(**changes)


def submit(
    model: EngineModel, rid: str, text: str, max_new: int, now: float = 0.0, **kw: object
) -> EngineRequest:
    """A request for `text` made and submitted to `model` at `now` (it must be accepted)."""
    req = model.make_request(rid, encode(text), max_new, **kw)  # type: ignore[arg-type]
    assert model.submit(req, now)
    return req


def drain(model: EngineModel, now: float = 0.0) -> float:
    """Step `model` until it has no work, checking its invariants after each step; returns
    the simulated time then."""
    while model.has_work:
        now += model.step(now).duration
        model.check()
    return now


@pytest.fixture
async def engine() -> AsyncIterator[RunningEngine]:
    async with serve_engine(small_config()) as running:
        yield running


# The engine lives in this event loop and steps every few milliseconds: poll at its pace.
until = functools.partial(polling.until, timeout_s=30.0, every_s=0.002)
