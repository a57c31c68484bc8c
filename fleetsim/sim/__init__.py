"""The fleet simulator: N reference-engine models on one virtual clock, driven by Weir's
real router and sidecar policy code or by a baseline, over a workload.

    from fleetsim.sim import FleetConfig, Simulation, policies
    result = Simulation(specs, policies()["weir"](), FleetConfig(engines=16)).run()
"""

from collections.abc import Callable

from fleetsim.baselines import LeastOutstanding, LlmdWeighted, RoundRobin, SGLangCacheAware
from fleetsim.sim.baseline import BaselinePolicy
from fleetsim.sim.config import LLAMA_70B_FP8, SLO, FleetConfig, Staleness, default_pool_policy
from fleetsim.sim.flight import SimFlight, Stage
from fleetsim.sim.loop import FleetPolicy, KVSample, SimResult, Simulation, engine_config_for
from fleetsim.sim.oracle import ORACLE_NAME, OraclePolicy
from fleetsim.sim.weir import WEIR_NAME, WeirPolicy


def policies(seed: int = 0) -> dict[str, Callable[[], FleetPolicy]]:
    """Every policy the report compares, by name, each a fresh instance per call: the
    baselines, Weir, and the oracle (Weir knowing every answer's length and every
    engine's state as it is: the limit, not a baseline)."""
    return {
        "round_robin": lambda: BaselinePolicy(RoundRobin()),
        "least_outstanding": lambda: BaselinePolicy(LeastOutstanding(seed)),
        "sglang_cache_aware": lambda: BaselinePolicy(SGLangCacheAware()),
        "llmd_weighted": lambda: BaselinePolicy(LlmdWeighted(seed)),
        "max_tokens_reserve": lambda: BaselinePolicy(
            LeastOutstanding(seed), reserve_max_tokens=True, name="max_tokens_reserve"
        ),
        WEIR_NAME: WeirPolicy,
        ORACLE_NAME: OraclePolicy,
    }


def is_baseline(name: str) -> bool:
    """Whether a policy is one users would pick instead of Weir (not Weir, not the
    oracle)."""
    return name not in (WEIR_NAME, ORACLE_NAME)


__all__ = [
    "LLAMA_70B_FP8",
    "ORACLE_NAME",
    "SLO",
    "WEIR_NAME",
    "BaselinePolicy",
    "FleetConfig",
    "FleetPolicy",
    "KVSample",
    "OraclePolicy",
    "SimFlight",
    "SimResult",
    "Simulation",
    "Stage",
    "Staleness",
    "WeirPolicy",
    "default_pool_policy",
    "engine_config_for",
    "is_baseline",
    "policies",
]
