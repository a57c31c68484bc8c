"""The `weir` command line: discovery of commands and benchmarks, and the report format."""

from __future__ import annotations

import json

import pytest

from weir.benchmarks._report import Figure, Report, median_p99
from weir.cli import build_parser, main


def test_help_lists_bench(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "bench" in capsys.readouterr().out


def test_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["no-such-command"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_median_and_p99() -> None:
    assert median_p99([3.0, 1.0, 2.0]) == (2.0, 3.0)
    samples = [float(i) for i in range(1, 101)]
    assert median_p99(samples) == (50.5, 99.0)
    with pytest.raises(ValueError, match="no samples"):
        median_p99([])


def test_report_prints_a_table_and_one_json_object() -> None:
    report = Report("demo", params={"runs": 3})
    report.add(Figure("latency", 0.00042, "s", p99=0.0009, goal="<= 1 ms", met=True))
    report.add(Figure("throughput", 51234.0, "tok/s", note="one core"))
    table = report.to_table()
    assert "weir bench demo" in table
    assert "51,234" in table
    assert "note: throughput: one core" in table
    decoded = json.loads(report.to_json())
    assert decoded["benchmark"] == "demo"
    assert [f["name"] for f in decoded["figures"]] == ["latency", "throughput"]
    assert decoded["figures"][0]["met"] is True
