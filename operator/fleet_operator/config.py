"""Operator settings, read once from the environment (the chart sets every one of them).

WEIR_IMAGE                  image for sidecars whose pool names none
WEIR_REDIS_URL              the control plane the operator reads status from and drains
                            (`weir operator --redis-url-file FILE` reads it from a file)
WEIR_REDIS_SECRET           Secret holding the Redis URL that pods receive
WEIR_REDIS_SECRET_KEY       key of that Secret (default: url)
WEIR_ADMIN_SECRET           Secret holding the sidecars' admin token, mounted into every
                            engine pod (default: weir-sidecar-admin; empty: sidecars run
                            with their admin routes open)
WEIR_ADMIN_SECRET_KEY       key of that Secret (default: token)
WEIR_STATUS_INTERVAL_S      seconds between status and scaling passes, which also advance
                            a drain in progress (default: 5)
WEIR_ENGINE_RUN_AS_USER     user id the SGLang engine containers run as when a pool names
                            none (spec.engine.runAsUser); 0 runs them as root (default:
                            10001, the same non-root user as the sidecars)
WEIR_OTLP_ENDPOINT          OTLP/HTTP endpoint the sidecars export spans to (their
                            OTEL_EXPORTER_OTLP_ENDPOINT); empty: none (default)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

# The largest user id a pod's securityContext accepts.
MAX_UID = 2**31 - 1


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    image: str = "ghcr.io/weir-dev/weir:0.1.0"
    redis_url: str = field(default="redis://127.0.0.1:6379/0", repr=False)  # has a password
    redis_secret: str = "weir-redis"
    redis_secret_key: str = "url"
    admin_secret: str = "weir-sidecar-admin"
    admin_secret_key: str = "token"
    status_interval_s: float = 5.0
    engine_run_as_user: int = 10001
    otlp_endpoint: str = ""

    def __post_init__(self) -> None:
        if not 0 < self.status_interval_s <= 3600:
            raise ValueError(
                f"WEIR_STATUS_INTERVAL_S must lie in (0, 3600], got {self.status_interval_s}"
            )
        if not 0 <= self.engine_run_as_user <= MAX_UID:
            raise ValueError(
                f"WEIR_ENGINE_RUN_AS_USER must lie in [0, {MAX_UID}], got {self.engine_run_as_user}"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> OperatorConfig:
        base = cls()
        return cls(
            image=env.get("WEIR_IMAGE", base.image),
            redis_url=env.get("WEIR_REDIS_URL", base.redis_url),
            redis_secret=env.get("WEIR_REDIS_SECRET", base.redis_secret),
            redis_secret_key=env.get("WEIR_REDIS_SECRET_KEY", base.redis_secret_key),
            admin_secret=env.get("WEIR_ADMIN_SECRET", base.admin_secret),
            admin_secret_key=env.get("WEIR_ADMIN_SECRET_KEY", base.admin_secret_key),
            status_interval_s=float(env.get("WEIR_STATUS_INTERVAL_S", base.status_interval_s)),
            engine_run_as_user=_integer(env, "WEIR_ENGINE_RUN_AS_USER", base.engine_run_as_user),
            otlp_endpoint=env.get("WEIR_OTLP_ENDPOINT", base.otlp_endpoint),
        )


def _integer(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}") from None
