"""`weir bench sidecar` in front of SGLang's own server (the session's, the tiny model on
this machine's CPU): the figures it reports and the sizes it takes from the engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.sglang.server import SGLangServer

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.redis,
    pytest.mark.slow,
    pytest.mark.timeout(600),
]  # the session server may start in this test


def test_bench_sidecar_measures_in_front_of_real_sglang(sglang: SGLangServer) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "weir.cli", "bench", "sidecar", "--engine", "sglang",
         "--engine-url", sglang.url, "--runs", "1", "--requests", "2", "--streams", "2",
         "--stream-tokens", "16", "--probes", "2", "--json"],
        capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    params = report["params"]
    assert params["engine"] == f"SGLang {sglang.version}"
    assert params["kv_capacity_tokens"] == 4096  # cpu_flags' --max-total-tokens
    # A tenth of the pool, as the tiny model's tokenizer counts it (not the prompt's bytes).
    assert 4096 * 0.05 < params["probe_tokens"] <= 4096 * 0.15
    figures = {f["name"]: f for f in report["figures"]}
    assert set(figures) == {
        "added TTFT",
        "CPU per streamed chunk",
        "byte relay CPU per chunk (floor)",
        "CPU per chunk above the byte relay",
        "KV change → publication",
    }
    assert f"SGLang {sglang.version}" in figures["added TTFT"]["note"]
    assert figures["KV change → publication"]["value"] > 0
