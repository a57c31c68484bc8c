"""Weir's engine sidecar: it runs next to each SGLang server and keeps it out of KV high water.

    from engine_sidecar import SidecarConfig, serve_sidecar

    async with serve_sidecar(SidecarConfig(engine_url="http://127.0.0.1:30000")) as sidecar:
        sidecar.url          # the proxy: /generate, /v1/completions, /v1/chat/completions,
                             # /v1/models, /weir/v1/continue, /weir/v1/{preempt,drain,state},
                             # /health, /metrics
        sidecar.service      # the SidecarService: its ledger, metrics, preempt(), drain()

Modules: `engine` (the adapter interface and SGLang over HTTP), `intake` (request
validation), `ledger` (live KV accounting, watermark, local admission queue), `relay`
(reading and splicing engine streams), `service` (the HTTP proxy, preemption, resume,
cancellation, drain), `control` (registration, heartbeats, commands), `quota` (the KV
quota), `metrics`, `server` (configuration and startup); `policy` is the pure policy the
fleet simulator shares.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine_sidecar.engine import EngineAdapter, EngineError, EngineInfo, SGLangEngine
    from engine_sidecar.server import RunningSidecar, SidecarConfig, load_policy, serve_sidecar
    from engine_sidecar.service import SidecarService

# Imported on first use, so that the simulator's `import engine_sidecar.policy` stays light.
_EXPORTS = {
    "EngineAdapter": "engine_sidecar.engine",
    "EngineError": "engine_sidecar.engine",
    "EngineInfo": "engine_sidecar.engine",
    "SGLangEngine": "engine_sidecar.engine",
    "RunningSidecar": "engine_sidecar.server",
    "SidecarConfig": "engine_sidecar.server",
    "load_policy": "engine_sidecar.server",
    "serve_sidecar": "engine_sidecar.server",
    "SidecarService": "engine_sidecar.service",
}

__all__ = [
    "EngineAdapter",
    "EngineError",
    "EngineInfo",
    "RunningSidecar",
    "SGLangEngine",
    "SidecarConfig",
    "SidecarService",
    "load_policy",
    "serve_sidecar",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine_sidecar' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
