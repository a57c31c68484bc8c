"""The report: metrics definitions, goals, markdown, strict JSON and PNGs from real runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

from controlplane.contract import FinishReason
from fleetsim.report import (
    CellSpec,
    goals,
    json_safe,
    kv_plot,
    markdown_document,
    quantiles,
    run_cells,
    sweep_plot,
    ttft_cdf_plot,
)
from fleetsim.report.metrics import is_lost, is_rejected, meets_slo, slo_verdict
from fleetsim.sim import SLO, SimFlight, Stage
from fleetsim.workloads import BLOCK_TOKENS, RequestSpec


def _flight(**changes: object) -> SimFlight:
    spec = RequestSpec("r", 0.0, "t", 0, BLOCK_TOKENS, 10, 10, (1,))
    flight = SimFlight(spec)
    for key, value in changes.items():
        setattr(flight, key, value)
    if flight.reason is not None:
        flight.stage = Stage.DONE
    return flight


def test_quantiles_are_nearest_rank() -> None:
    q = quantiles(float(i) for i in range(1, 101))
    assert (q["p50"], q["p90"], q["p99"], q["n"]) == (50.0, 90.0, 99.0, 100)
    assert math.isnan(quantiles([])["p99"])


def test_refusals_are_not_losses_and_errors_after_acceptance_are() -> None:
    refused = _flight(reason=FinishReason.OVERLOAD, accepted=True)
    assert is_rejected(refused)
    assert not is_lost(refused)
    failed = _flight(reason=FinishReason.ERROR, accepted=True)
    assert is_lost(failed)
    assert not is_rejected(failed)
    assert not is_lost(_flight(reason=FinishReason.CANCELLED, accepted=True))
    assert not is_lost(_flight(accepted=True))  # still running when the run stopped


def test_slo_needs_every_objective() -> None:
    slo = SLO(ttft_s=1.0, ttft_per_1k_input_s=0.0, tpot_s=0.05)
    ok = _flight(
        reason=FinishReason.STOP,
        first_token_at=0.5,
        last_token_at=0.9,
        finished_at=0.9,
        generated=10,
    )
    assert meets_slo(ok, slo)
    slow_tokens = _flight(
        reason=FinishReason.STOP,
        first_token_at=0.5,
        last_token_at=1.5,
        finished_at=1.5,
        generated=10,
    )
    assert not meets_slo(slow_tokens, slo)
    assert not meets_slo(_flight(reason=FinishReason.ERROR, first_token_at=0.1), slo)


def test_a_request_withdrawn_or_open_within_its_objectives_is_not_judged() -> None:
    slo = SLO(ttft_s=1.0, ttft_per_1k_input_s=0.0, tpot_s=0.1)
    streaming = {"first_token_at": 0.5, "last_token_at": 1.4, "generated": 10}
    # Cancelled while streaming on pace (10 tokens by 1.5 s: 1 s + 10 x 0.1 s allowed).
    on_pace = _flight(reason=FinishReason.CANCELLED, finished_at=1.5, **streaming)
    assert slo_verdict(on_pace, slo, end_s=100.0) is None
    # Cancelled after stalling: 10 tokens by 2.5 s is slower than the objective.
    stalled = _flight(reason=FinishReason.CANCELLED, finished_at=2.5, **streaming)
    assert slo_verdict(stalled, slo, end_s=100.0) is False
    # Its deadline passed before the first token was due / after it was due.
    assert slo_verdict(_flight(reason=FinishReason.DEADLINE, finished_at=0.9), slo, 9.0) is None
    assert slo_verdict(_flight(reason=FinishReason.DEADLINE, finished_at=1.2), slo, 9.0) is False
    # Still running when the run stopped: judged at the end like a withdrawal.
    assert slo_verdict(_flight(**streaming), slo, end_s=1.5) is None
    assert slo_verdict(_flight(**streaming), slo, end_s=30.0) is False
    # Refusals and errors are misses; completions are judged on their SLOs.
    assert slo_verdict(_flight(reason=FinishReason.OVERLOAD), slo, 9.0) is False
    done = _flight(reason=FinishReason.STOP, finished_at=1.4, **streaming)
    assert slo_verdict(done, slo, 9.0) is True


def test_a_small_matrix_writes_goals_markdown_json_and_plots(tmp_path: Path) -> None:
    specs = [
        CellSpec("few_long_many_short", p, load, 0, 2, 4.0)
        for load in (0.5, 1.0)
        for p in ("least_outstanding", "weir")
    ]
    cells = run_cells(specs, jobs=2)
    assert [c.spec for c in cells] == specs
    assert all(c.summary["offered"] > 0 for c in cells)
    for cell in cells:  # the overall attainment is the tenants' weighted by their requests
        summary = cell.summary
        tenants = summary["tenant_slo_attainment"]
        assert set(tenants) <= set(summary["tenant_kv_token_s"])
        assert min(tenants.values()) <= summary["slo_attainment"] <= max(tenants.values())
    rows = goals(cells)
    assert [(r["scenario"], r["load"]) for r in rows] == [
        ("few_long_many_short", 0.5),
        ("few_long_many_short", 1.0),
    ]
    assert all(r["goodput_best_baseline"] == "least_outstanding" for r in rows)

    text = markdown_document(cells[:2], rows, cells, [], {"engines": 2})
    assert "## Goals" in text
    assert "| weir |" in text
    assert "## Load sweep" in text
    assert "## Capacity at SLO" not in text  # no search was run
    header = next(line for line in text.splitlines() if line.startswith("| policy | offered"))
    assert "| goodput req/s | refused |" in header  # refusals beside goodput
    assert "| tenant SLO met |" in header
    encoded = json.dumps(json_safe({"cells": [c.summary for c in cells], "x": math.nan}))
    assert json.loads(encoded)["x"] is None

    for plot in (
        ttft_cdf_plot(cells, tmp_path / "cdf.png"),
        kv_plot(cells, tmp_path / "kv.png"),
        sweep_plot(cells, tmp_path / "sweep.png"),
    ):
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
