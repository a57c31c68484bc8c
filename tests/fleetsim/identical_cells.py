"""The fixed set of small seeded cells whose report is recorded in
`data/identical_cells.json`: every policy on a mix past saturation, P/D with credits,
engine failures and cancellations, relief (migrations and recomputes) and a hot prefix.
Run by the interpreted simulator (`test_sim_identical.py`) and by the compiled one
(`tests/weir/test_compiled_sim.py`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fleetsim.report import CellSpec, json_safe, run_cell
from fleetsim.sim import policies

RECORDED = Path(__file__).parent / "data" / "identical_cells.json"

# (scenario, load, arrival window s, policies): four engines at a quarter of the KV.
_CELLS = (
    ("few_long_many_short", 1.5, 20.0, tuple(policies())),
    ("pd_no_decode_credit", 1.0, 40.0, ("weir", "round_robin")),
    ("cancel_deadline_failure", 1.0, 8.0, ("weir", "least_outstanding")),
    ("preemption_crossing", 1.0, 30.0, ("weir", "llmd_weighted")),
    ("hot_prefix_high_water", 1.0, 20.0, ("weir",)),
)


def specs() -> list[CellSpec]:
    return [
        CellSpec(name, policy, load, 0, 4, window, kv_scale=0.25, drain_s=60.0)
        for name, load, window, chosen in _CELLS
        for policy in chosen
    ]


def key(spec: CellSpec) -> str:
    return f"{spec.scenario}/{spec.policy}@{spec.load}"


def summaries() -> dict[str, Any]:
    """Each cell's summary, through JSON as report.json writes it (tuples become lists,
    floats round-trip)."""
    got = {key(spec): json_safe(run_cell(spec).summary) for spec in specs()}
    loaded: dict[str, Any] = json.loads(json.dumps(got, sort_keys=True))
    return loaded


def assert_recorded(got: dict[str, Any]) -> None:
    """Every cell of the recorded report, figure for figure, and no other cell."""
    want = json.loads(RECORDED.read_text())
    assert got.keys() == want.keys()
    for cell, summary in want.items():
        assert got[cell] == summary, cell
