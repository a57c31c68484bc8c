"""`weir bench chaos` on real processes, tiny sizes: every figure printed, every admitted
stream whole through the burst and both kills."""

from __future__ import annotations

import json
import re

import pytest

from weir.cli import main


def test_bench_chaos_keeps_every_stream_whole(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["bench", "chaos", "--json", "--runs", "1", "--streams", "10", "--kill-streams", "4",
         "--max-tokens", "600", "--kv-tokens", "3000", "--speed-factor", "40"]
    )  # fmt: skip
    assert code == 0
    figures = {f["name"]: f for f in json.loads(capsys.readouterr().out)["figures"]}
    for scenario in ("kv burst", "engine killed", "sidecar killed"):
        lost = figures[f"{scenario}: admitted streams not whole"]
        assert lost["met"], lost
        assert f"{scenario}: longest pause between chunks (p99 of streams)" in figures
    preempted = re.search(
        r"(\d+) preempted", figures["kv burst: admitted streams not whole"]["note"]
    )
    assert preempted is not None
    assert int(preempted[1]) > 0  # the burst did run into KV exhaustion
