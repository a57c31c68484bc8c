"""`weir bench live` runs end to end on a tiny local fleet under a load generator written
elsewhere, and reports the router and the engine side by side with no errors; it refuses
bad flags.

The test drives it with SGLang's `bench_serving`, from the SGLang venv the bootstrap
installs: inference-perf, the command's default client, needs a venv of its own whose cold
install took about 4 minutes here (docs/benchmarks.md), too much for the suite."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.tiers import unavailable
from weir.benchmarks._live_clients import BenchServing, _run
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


def test_a_client_run_leaves_none_of_its_processes_behind(tmp_path: Path) -> None:
    """A load generator's worker processes end with its run (inference-perf's outlived an
    interrupted benchmark): here a client that exits with a child still running."""
    pid_file = tmp_path / "child.pid"
    client = (
        "import subprocess, sys; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))"
    )
    _run([sys.executable, "-c", client], "a client")
    child = int(pid_file.read_text())
    # Killed by the run; reaped by init, so /proc may show it briefly as a zombie.
    for _ in range(100):
        state = _process_state(child)
        if state in (None, "Z"):
            break
        time.sleep(0.05)
    assert _process_state(child) in (None, "Z")


def _process_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[0]
