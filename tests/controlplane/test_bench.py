"""`weir bench controlplane` runs end to end (tiny sizes) and prints one JSON object."""

from __future__ import annotations

import json

import pytest

from weir.cli import main

pytestmark = pytest.mark.redis


def test_bench_controlplane_prints_every_figure(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["bench", "controlplane", "--json", "--runs", "2", "--redis-url", redis_url,
         "--sizes", "40,80", "--members", "40", "--keys", "400", "--zipf-members", "10",
         "--requests", "2000"]
    )  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    figures = {f["name"]: f for f in out["figures"]}
    for name in (
        "heartbeats/s, 80 endpoints",
        "Redis µs per heartbeat, 80 endpoints",
        "Redis µs per empty EVALSHA (baseline), 80 endpoints",
        "full snapshot read (baseline)",
        "view refresh after 1 change",
        "owner churn x N, one of 40 leaves",
        "max/avg load, Zipf(1), plain ring",
        "max/avg load, Zipf(1), bounded c=1.25",
        "owner lookup, 40 endpoints",
    ):
        assert name in figures, name
        assert figures[name]["value"] > 0
    assert figures["max/avg load, Zipf(1), bounded c=1.25"]["met"]
    assert (
        figures["max/avg load, Zipf(1), bounded c=1.25"]["value"]
        < figures["max/avg load, Zipf(1), plain ring"]["value"]
    )
