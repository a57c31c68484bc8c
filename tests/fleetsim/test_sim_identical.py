"""The simulator's speed-ups change no result: a fixed set of small seeded cells gives
exactly the report recorded in `data/identical_cells.json`.

The cells cover every policy on a mix past saturation, P/D with credits, engine failures
and cancellations, relief (migrations and recomputes) and a hot prefix, so a change to the
event loop, the engine model, the sidecars' bookkeeping or the router's snapshot that is
not a pure speed-up shows here as a changed figure. A change meant to move results (a
policy change) records the file again: `WEIR_RECORD_IDENTICAL=1 pytest` on this test,
and the diff of the JSON is part of that change's review.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fleetsim.report import CellSpec, json_safe, run_cell
from fleetsim.sim import policies

RECORDED = Path(__file__).parent / "data" / "identical_cells.json"
RECORD = os.environ.get("WEIR_RECORD_IDENTICAL") == "1"

# (scenario, load, arrival window s, policies): four engines at a quarter of the KV.
_CELLS = (
    ("few_long_many_short", 1.5, 20.0, tuple(policies())),
    ("pd_no_decode_credit", 1.0, 40.0, ("weir", "round_robin")),
    ("cancel_deadline_failure", 1.0, 8.0, ("weir", "least_outstanding")),
    ("preemption_crossing", 1.0, 30.0, ("weir", "llmd_weighted")),
    ("hot_prefix_high_water", 1.0, 20.0, ("weir",)),
)


def _specs() -> list[CellSpec]:
    return [
        CellSpec(name, policy, load, 0, 4, window, kv_scale=0.25, drain_s=60.0)
        for name, load, window, chosen in _CELLS
        for policy in chosen
    ]


def _key(spec: CellSpec) -> str:
    return f"{spec.scenario}/{spec.policy}@{spec.load}"


def test_a_fixed_seed_matrix_gives_the_recorded_report() -> None:
    got = {_key(spec): json_safe(run_cell(spec).summary) for spec in _specs()}
    # Through JSON, as report.json writes it: tuples become lists, floats round-trip.
    got = json.loads(json.dumps(got, sort_keys=True))
    if RECORD:
        RECORDED.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"recorded {RECORDED}")
    want = json.loads(RECORDED.read_text())
    assert got.keys() == want.keys()
    for key, summary in want.items():
        assert got[key] == summary, key
