"""Reference-engine fixtures: a served engine on a loopback port, fast enough for tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from fleetsim.engine import EngineConfig
from fleetsim.server import RunningEngine, serve_engine

# Fast simulated GPU: an 8B decode step of ~7 ms takes ~0.1 ms of wall time.
FAST = 64.0


def small_config(**changes: object) -> EngineConfig:
    """A small pool so tests exercise admission, eviction and retraction quickly."""
    base = EngineConfig(
        max_total_tokens=16384, page_size=4, chunked_prefill_size=512, speed_factor=FAST
    )
    return base.replace(**changes)


@pytest.fixture
async def engine() -> AsyncIterator[RunningEngine]:
    async with serve_engine(small_config()) as running:
        yield running


async def until(predicate: Callable[[], object], timeout_s: float = 30.0) -> None:
    """Poll the engine's state (it lives in this event loop) until `predicate` holds."""
    for _ in range(int(timeout_s / 0.002)):
        if predicate():
            return
        await asyncio.sleep(0.002)
    raise TimeoutError("condition not reached")
