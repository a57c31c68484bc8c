"""`weir bench live --engine sglang-0.5.23`: the live benchmark's fleet on SGLang's own
server (the tiny model on this machine's CPU, launched with the tier's recipe) behind a
sidecar and the router, under SGLang's `bench_serving`, reports both paths with no errors.

The command starts its own server, not the session's: what is under test is that it
launches one itself. A tiny load (4 requests per path) keeps the run to the server's start
and bench_serving's import."""

from __future__ import annotations

import json

import pytest

from tests.tiers import unavailable
from weir.cli import main
from weir.local.sglang_cpu import unavailable_reason

pytestmark = [pytest.mark.sglang, pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(600)]
VERSION = "0.5.23"


def test_bench_live_against_real_sglang_reports_router_and_direct(
    capsys: pytest.CaptureFixture[str],
) -> None:
    reason = unavailable_reason(VERSION)
    if reason is not None:
        unavailable(f"SGLang {VERSION}", reason)
    code = main(["bench", "live", "--json", "--engine", f"sglang-{VERSION}",
                 "--client", "bench-serving", "--scenario", "mix",
                 "--requests", "4", "--rate", "4"])  # fmt: skip
    assert code == 0, capsys.readouterr().err[-3000:]
    out = json.loads(capsys.readouterr().out)
    assert out["params"]["engine"] == f"SGLang {VERSION} on the CPU (tiny-llama)"
    rows = {row["figure"]: row for row in out["rows"]}
    for path in ("router", "direct"):
        assert rows["requests"][path] == 4
        assert rows["errors"][path] == 0
        assert rows["TTFT p99"][path] >= rows["TTFT p50"][path] > 0
        assert rows["ITL p50"][path] > 0
        assert rows["output throughput"][path] > 0
