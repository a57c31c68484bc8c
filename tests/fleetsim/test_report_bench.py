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
    assert "short_short: goodput vs best baseline" in names
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
