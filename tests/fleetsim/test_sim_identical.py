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

import pytest

from tests.fleetsim.identical_cells import RECORDED, assert_recorded, summaries

RECORD = os.environ.get("WEIR_RECORD_IDENTICAL") == "1"


def test_a_fixed_seed_matrix_gives_the_recorded_report() -> None:
    got = summaries()
    if RECORD:
        RECORDED.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"recorded {RECORDED}")
    assert_recorded(got)
