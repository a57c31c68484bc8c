"""The simulator's Weir runs its engines with the flags a Weir deployment gives SGLang,
nothing more: the operator's rendered engine arguments, read by the reference engine's own
command line (`weir engine`, SGLang's flag names), configure the same engine as the
simulated Weir policy's `tune`. An engine feature stock SGLang lacks (the reference
engine's prefill yielding, a per-iteration prefill time budget) cannot creep back into
Weir's simulated figures without failing here."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

from controlplane.contract import PoolPolicy
from fleet_operator.rendering import engine_args
from fleet_operator.spec import parse_pool
from fleetsim.engine import EngineConfig
from fleetsim.sim import FleetConfig
from fleetsim.sim.loop import engine_config_for
from fleetsim.sim.weir import WeirPolicy
from weir.commands.engine import config_from_args, configure

# The reference engine's scheduling flags: each is SGLang's, or the reference engine's own.
SCHEDULING = (
    "chunked_prefill_size",
    "max_running_requests",
    "enable_priority_scheduling",
    "schedule_policy",
    "enable_mixed_chunk",
    "prefill_yield",
    "prefill_time_budget_s",
    "priority_aging_s",
)


def _rendered(scheduling: dict[str, Any]) -> tuple[PoolPolicy, EngineConfig]:
    """The pool's policy, and the engine the reference engine's command line makes of the
    operator's arguments for it."""
    pool = parse_pool("sim", "ns", {"model": {"name": "m", "source": "org/m"},
                                    "scheduling": scheduling})  # fmt: skip
    parser = argparse.ArgumentParser()
    configure(parser)
    known, _ = parser.parse_known_args(engine_args(pool))  # --tp, --enable-metrics: not ours
    return pool.policy, config_from_args(known)


@pytest.mark.parametrize(
    "scheduling",
    [{}, {"chunkedPrefillSize": 512, "maxRunningRequests": 64, "priorityScheduling": False}],
)
def test_weirs_simulated_engines_run_the_flags_the_operator_renders(
    scheduling: dict[str, Any],
) -> None:
    policy, rendered = _rendered(scheduling)
    fleet = FleetConfig(engines=2, policy=policy)
    base = engine_config_for(fleet)
    tuned = WeirPolicy(policy).tune(base, fleet)
    changed = {
        f.name for f in dataclasses.fields(base) if getattr(tuned, f.name) != getattr(base, f.name)
    }
    assert changed <= set(SCHEDULING), changed
    expected = {name: getattr(rendered, name) for name in SCHEDULING}
    if rendered.max_running_requests is None:  # not rendered: SGLang's own (the fleet's here)
        expected["max_running_requests"] = base.max_running_requests
    assert {name: getattr(tuned, name) for name in SCHEDULING} == expected
