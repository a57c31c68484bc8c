"""Fixtures: a real reference engine over HTTP and a real sidecar in front of it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from controlplane.contract import KVPolicy, PoolPolicy
from engine_sidecar.server import RunningSidecar, SidecarConfig, serve_sidecar
from fleetsim.engine import EngineConfig
from fleetsim.server import RunningEngine, serve_engine

MODEL = "weir/test-model"


def engine_config(**overrides: object) -> EngineConfig:
    """A small, fast, deterministic engine: 8K tokens of KV, 200x real time."""
    fields: dict[str, object] = {
        "model": MODEL,
        "max_total_tokens": 8192,
        "context_length": 4096,
        "speed_factor": 200.0,
        "seed": 7,
    }
    fields.update(overrides)
    return EngineConfig(**fields)  # type: ignore[arg-type]


def pool_policy(**kv: object) -> PoolPolicy:
    return PoolPolicy(pool="p", model=MODEL, context_length=4096, kv=KVPolicy(**kv))  # type: ignore[arg-type]


@pytest.fixture
async def engine() -> AsyncIterator[RunningEngine]:
    async with serve_engine(engine_config()) as running:
        yield running


@pytest.fixture
async def sidecar(engine: RunningEngine) -> AsyncIterator[RunningSidecar]:
    async with serve_sidecar(
        SidecarConfig(engine_url=engine.url, pool="p", policy=pool_policy())
    ) as running:
        yield running
