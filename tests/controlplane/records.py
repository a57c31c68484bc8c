"""Records the control-plane tests write."""

from __future__ import annotations

from controlplane.contract import EndpointState

POOL = "pool-a"


def endpoint(endpoint_id: str, **fields: object) -> EndpointState:
    """A plausible state of one endpoint of POOL."""
    values: dict[str, object] = {
        "pool": POOL,
        "endpoint_id": endpoint_id,
        "address": f"http://127.0.0.1:9/{endpoint_id}",
        "model": "m",
        "kv_capacity_tokens": 1000,
    }
    values.update(fields)
    return EndpointState(**values)  # type: ignore[arg-type]
