"""`weir bench fleet` end to end on a tiny fleet, and its refusals of bad arguments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from weir.cli import main


def test_bench_fleet_writes_the_report_and_prints_one_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report"
    argv = [
        "bench",
        "fleet",
        "--scenario",
        "short_short",
        "--engines",
        "2",
        "--duration",
        "3",
        "--sweep",
        "",
        "--policies",
        "round_robin,weir",
        "--jobs",
        "1",
        "--out",
        str(out),
        "--json",
    ]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["benchmark"] == "fleet"
    names = [f["name"] for f in printed["figures"]]
    assert "short_short@100%: goodput vs best baseline" in names
    document = json.loads((out / "report.json").read_text())
    assert {c["policy"] for c in document["cells"]} == {"round_robin", "weir"}
    assert (out / "report.md").read_text().startswith("# Fleet simulation report")
    assert (out / "ttft_cdf.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--policies", "nope"], "unknown policies"),
        (["--scenario", "nope"], "unknown scenario"),
        (["--engines", "0"], "must be positive"),
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
