"""`weir bench pd` runs end to end on two tiny local fleets (a mixed pool and a P/D pair
sharing one Redis) and reports the P/D path's added TTFT; it refuses bad flags."""

from __future__ import annotations

import json

import pytest

from weir.cli import main

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def test_bench_pd_reports_the_added_ttft_against_a_mixed_pool(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["bench", "pd", "--json", "--requests", "2", "--prompt-tokens", "300",
                 "--max-tokens", "4", "--speed-factor", "20"])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"]["prompt_tokens"] == 300
    figures = {f["name"]: f for f in out["figures"]}
    mixed, pd = figures["TTFT, mixed pool"], figures["TTFT, P/D pair"]
    assert mixed["value"] > 0
    assert pd["value"] > 0
    # The median of per-request differences lies between the extremes of those differences.
    added = figures["P/D added TTFT"]
    assert added["unit"] == "ms"
    assert added["p99"] >= added["value"]
    transfer = figures["modelled KV transfer of one prompt"]["value"]
    assert transfer == pytest.approx(300 * 131_072 / 50e9 / 20 * 1e3)
    assert figures["E2E, P/D pair"]["value"] >= pd["value"]


@pytest.mark.parametrize("flags", [["--requests", "0"], ["--speed-factor", "0"],
                                   ["--kv-link-bytes-per-s", "-1"]])  # fmt: skip
def test_bench_pd_refuses_bad_flags(flags: list[str]) -> None:
    with pytest.raises(SystemExit, match="bad arguments"):
        main(["bench", "pd", *flags])
