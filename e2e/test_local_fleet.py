"""`weir up`, the README's main job, run as a user runs it: a subprocess that starts Redis,
reference engines, sidecars and the router, serves real streamed requests, and stops every
child on SIGTERM."""

from __future__ import annotations

import re
import subprocess
import time
import urllib.request

import pytest
from openai import OpenAI

from e2e.conftest import WEIR, WeirUp

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def test_weir_up_smoke_streams_sample_requests_and_exits_cleanly() -> None:
    done = subprocess.run(
        [*WEIR, "up", "--smoke", "--requests", "3", "--port", "0", "--speed-factor", "20"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3/3 sample requests ok" in done.stdout
    assert len(re.findall(r"^sample \d -> .*\[local-\d\]$", done.stdout, re.M)) == 3


def test_weir_up_serves_openai_streams_until_sigterm(weir_up: WeirUp) -> None:
    _wait_ready(weir_up.url)
    # Closed clients and responses: a pooled socket left to the garbage collector is a
    # ResourceWarning (an error here) wherever the collector happens to run.
    with OpenAI(base_url=weir_up.url + "/v1", api_key="unused") as client:
        served = set()
        for i in range(4):
            with client.chat.completions.with_streaming_response.create(
                model="meta-llama/Llama-3.1-8B-Instruct",
                messages=[{"role": "user", "content": f"request {i}"}],
                max_tokens=20,
                stream=True,
                extra_body={"ignore_eos": True},
            ) as response:
                served.add(response.headers["x-weir-endpoint"])
                text = "".join(
                    chunk.choices[0].delta.content or ""
                    for chunk in response.parse()
                    if chunk.choices
                )
            assert len(text) == 20
        assert served <= {"local-0", "local-1"}
        # The demo policy's tenants: named by header on the open router, each with a quota.
        reply = client.completions.create(
            model="meta-llama/Llama-3.1-8B-Instruct", prompt="a batch job", max_tokens=4,
            extra_headers={"x-weir-tenant": "batch"},
        )  # fmt: skip
        assert reply.choices[0].text
    with urllib.request.urlopen(weir_up.url + "/metrics", timeout=5) as reply:
        metrics = reply.read().decode()
    for tenant in ("default", "batch"):
        assert (
            f'weir_router_quota_utilization_ratio{{pool="local",resource="concurrency",tenant="{tenant}"}}'
            in metrics
        )
    with urllib.request.urlopen(weir_up.url + "/weir/v1/pool", timeout=5) as reply:
        status = reply.read()
    assert b'"local-0"' in status
    assert b'"local-1"' in status

    code, output = weir_up.stop()
    assert code == 0, output
    assert "weir up: stopping" in output
    assert "watermark" in output  # the status view was printed while serving
    ports = [int(p) for p in re.findall(r"http://127\.0\.0\.1:(\d+)", output)]
    assert ports
    for port in set(ports):  # every child (engines, sidecars, router, redis) is gone
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).close()
        except OSError:
            continue
        pytest.fail(f"something still answers on port {port} after weir up stopped")


def _wait_ready(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError("the router never became ready")
        time.sleep(0.1)
