"""`weir bench fleet` end to end on a tiny fleet, and its refusals of bad arguments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from weir.cli import main


def _fleet(out: Path, *extra: str) -> list[str]:
    """`weir bench fleet` on short_short over two engines for a 3 s window, no sweep,
    its report in `out`, one JSON object printed."""
    return ["bench", "fleet", "--scenario", "short_short", "--engines", "2", "--duration",
            "3", "--sweep", "", *extra, "--out", str(out), "--json"]  # fmt: skip


def test_bench_fleet_writes_the_report_and_prints_one_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report"
    argv = _fleet(out, "--policies", "round_robin,weir", "--jobs", "1")
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["benchmark"] == "fleet"
    names = [f["name"] for f in printed["figures"]]
    assert "short_short@100%: goodput vs best baseline" in names
    document = json.loads((out / "report.json").read_text())
    assert {c["policy"] for c in document["cells"]} == {"round_robin", "weir"}
    assert (out / "report.md").read_text().startswith("# Fleet simulation report")
    assert (out / "ttft_cdf.png").stat().st_size > 0


def test_bench_fleet_finds_capacities_at_slo_reusing_the_matrix_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report"
    argv = _fleet(
        out, "--drain", "30", "--policies", "round_robin,weir,oracle", "--jobs", "2",
        "--capacity", "--capacity-tolerance", "0.5",
    )  # fmt: skip
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    names = [f["name"] for f in printed["figures"]]
    assert "short_short: capacity at SLO vs best baseline" in names
    assert "short_short: Weir capacity / oracle" in names
    speed = next(f for f in printed["figures"] if f["name"] == "simulated requests per CPU-second")
    assert speed["value"] > 0
    document = json.loads((out / "report.json").read_text())
    curves = {c["policy"]: c for c in document["capacity_curves"]}
    assert set(curves) == {"round_robin", "weir", "oracle"}
    matrix = {c["policy"]: c for c in document["cells"]}
    for policy, curve in curves.items():
        loads = [p["load"] for p in curve["probes"]]
        assert loads == sorted(loads)
        assert len(loads) >= 2
        # The matrix's own load is the search's first probe, not run a second time.
        (at_one,) = (p for p in curve["probes"] if p["load"] == 1.0)
        assert at_one["offered"] == matrix[policy]["offered"]
        assert at_one["slo_attainment"] == matrix[policy]["slo_attainment"]
        met = [p for p in curve["probes"] if p["slo_attainment"] >= 0.9]
        assert curve["capacity"] == max((p["load"] for p in met), default=0.0)
    (row,) = document["capacity"]
    assert row["best_baseline"] == "round_robin"
    assert row["policies"]["oracle"]["oracle_fraction"] == 1.0
    text = (out / "report.md").read_text()
    assert "## Capacity at SLO" in text
    assert (out / "attainment_vs_load.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--policies", "nope"], "unknown policies"),
        (["--scenario", "nope"], "unknown scenario"),
        (["--engines", "0"], "must be positive"),
        (["--capacity-tolerance", "0"], "must be positive"),
        (["--capacity-target", "1.5"], "capacity-target"),
        (["--capacity", "--trace", "t.jsonl"], "a trace's is its --speedup"),
    ],
)
def test_bench_fleet_refuses_bad_arguments(extra: list[str], message: str, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["bench", "fleet", "--out", str(tmp_path), *extra])


def test_bench_fleet_replays_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "azure.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(
            f"2023-11-16 18:15:{10 + i:02d}.0000000,{300 + 40 * i},{20 + i}\n" for i in range(12)
        )
    )
    out = tmp_path / "trace-report"
    argv = [
        "bench",
        "fleet",
        "--trace",
        str(trace),
        "--engines",
        "2",
        "--jobs",
        "1",
        "--policies",
        "least_outstanding,weir",
        "--out",
        str(out),
        "--json",
    ]
    assert main(argv) == 0
    capsys.readouterr()
    document = json.loads((out / "report.json").read_text())
    assert document["params"]["scenario"] == "trace"
    assert [c["offered"] for c in document["cells"]] == [12, 12]
    assert all(c["completed"] == 12 for c in document["cells"])
    assert document["sweep"] == []


def test_bench_fleet_replays_a_written_trace_where_the_best_baseline_sits_at_capacity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--write-trace writes a scenario's traffic as a Mooncake trace; --calibrate replays
    it at the speedup where the best baseline's capacity at SLO is, searched on its first
    requests: the replay's speedup is the given one times that baseline's capacity."""
    trace = tmp_path / "trace.jsonl"
    write = ["bench", "fleet", "--scenario", "few_long_many_short", "--engines", "2",
             "--write-trace", str(trace), "--trace-requests", "80"]  # fmt: skip
    assert main(write) == 0
    assert len(trace.read_text().splitlines()) == 80
    out = tmp_path / "report"
    argv = ["bench", "fleet", "--trace", str(trace), "--engines", "2", "--speedup", "2",
            "--calibrate", "--calibrate-requests", "60", "--capacity-tolerance", "0.5",
            "--policies", "round_robin,least_outstanding", "--jobs", "1", "--drain", "30",
            "--out", str(out), "--json"]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    document = json.loads((out / "report.json").read_text())
    curves = {c["policy"]: c for c in document["capacity_curves"]}
    assert set(curves) == {"round_robin", "least_outstanding"}
    for curve in curves.values():
        assert curve["limit"] == ""  # bracketed: one load met the target, one did not
        assert all(p["offered"] == 60 for p in curve["probes"])
        (at,) = (p for p in curve["probes"] if p["load"] == curve["capacity"])
        assert at["slo_attainment"] >= 0.9
    best = max(c["capacity"] for c in curves.values())
    assert document["params"]["speedup"] == 2 * best
    assert {c["offered"] for c in document["cells"]} == {80}


def test_bench_fleet_refuses_calibrating_without_a_trace(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--calibrate needs --trace"):
        main(_fleet(tmp_path, "--calibrate"))
