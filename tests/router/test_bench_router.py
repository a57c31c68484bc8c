"""`weir bench router --routers N` runs end to end on a tiny local fleet and prints every
figure for one router and for N, and refuses bad fleet flags."""

from __future__ import annotations

import json

import pytest

from weir.cli import main

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def test_bench_router_compares_one_router_with_several(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(
        ["bench", "router", "--json", "--runs", "1", "--decisions", "10", "--skip-proxy",
         "--routers", "2", "--fleet-engines", "2", "--fleet-requests", "8", "--fleet-burst", "4",
         "--fleet-rate", "20"]
    )  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"]["routers"] == 2
    assert out["params"]["fleet_burst"] == 4
    figures = {f["name"]: f for f in out["figures"]}
    for label in ("1 router", "2 routers"):
        for what in (
            "max/avg endpoint load",
            "most of one burst on one endpoint",
            "busiest endpoint's peak (per run)",
            "waiting at the sidecars",
            "TTFT",
            "quota refusals (per run)",
        ):
            assert f"{label}: {what}" in figures, (label, what)
        assert figures[f"{label}: max/avg endpoint load"]["value"] >= 1.0
        assert 1 <= figures[f"{label}: most of one burst on one endpoint"]["value"] <= 4
        refusals = figures[f"{label}: quota refusals (per run)"]
        assert (refusals["value"], refusals["note"]) == (0, "other refusals per run: [0]")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--routers", "17"], "--routers must be between 0 and 16"),
        (["--routers", "2", "--fleet-engines", "1"], "--fleet-engines must be at least 2"),
        (["--routers", "2", "--fleet-burst", "0"], "--fleet-burst positive"),
        (["--routers", "2", "--fleet-kv-tokens", "-1"], "--fleet-kv-tokens not negative"),
    ],
)
def test_bench_router_refuses_bad_fleet_flags(flags: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["bench", "router", "--skip-proxy", *flags])
