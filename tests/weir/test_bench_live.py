"""`weir bench live` runs end to end on a tiny local fleet under a load generator written
elsewhere, and reports the router and the engine side by side with no errors; it refuses
bad flags.

The test drives it with SGLang's `bench_serving`, from the SGLang venv the bootstrap
installs: inference-perf, the command's default client, needs a venv of its own whose cold
install took about 4 minutes here (docs/benchmarks.md), too much for the suite."""

from __future__ import annotations

import json

import pytest

from tests.tiers import unavailable
from weir.benchmarks._live_clients import BenchServing
from weir.benchmarks._tool_venv import ToolVenvError
from weir.cli import main

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def test_bench_live_reports_router_and_direct_side_by_side(
    capsys: pytest.CaptureFixture[str],
) -> None:
    try:
        BenchServing().prepare()
    except ToolVenvError as exc:
        unavailable("SGLang", str(exc))
    code = main(["bench", "live", "--json", "--client", "bench-serving", "--scenario", "mix",
                 "--requests", "6", "--rate", "6", "--speed-factor", "20"])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert "bench_serving" in out["params"]["client"]
    rows = {row["figure"]: row for row in out["rows"]}
    assert {row["scenario"] for row in out["rows"]} == {"mix"}
    for path in ("router", "direct"):
        assert rows["requests"][path] == 6
        assert rows["errors"][path] == 0
        assert rows["TTFT p99"][path] >= rows["TTFT p50"][path] > 0
        assert rows["output throughput"][path] > 0
        # The ASCII tokenizer counts the output as the engine's usage does.
        assert rows["tool's output count vs usage (gap)"][path] == 0


@pytest.mark.parametrize("flags", [["--requests", "0"], ["--rate", "0"],
                                   ["--slo-ttft-ms", "-1"], ["--engines", "0"],
                                   ["--speed-factor", "0"],
                                   ["--engine", "sglang-0.5.23", "--speed-factor", "2"]])  # fmt: skip
def test_bench_live_refuses_bad_flags(flags: list[str]) -> None:
    with pytest.raises(SystemExit, match="bad arguments"):
        main(["bench", "live", *flags])
