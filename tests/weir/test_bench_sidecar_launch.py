"""`weir bench sidecar --engine sglang`: its refusals before anything starts, the server's
life cycle (a stand-in for SGLang, in a process group of its own), and the benchmark in
front of SGLang's own server (0.5.23, the tiny model on this machine's CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from tests.sglang.server import cpu_environment, weir_sglang_args
from weir.cli import main
from weir.local.sglang import SGLangStartError, serve_sglang

VERSION = "0.5.23"
# Serves /health and, as SGLang does, spawns a child; the child's pid goes to the file named
# as the model's path. SIGTERM ends the server alone, leaving the child in the group.
STAND_IN = """
import http.server, subprocess, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(sys.argv[sys.argv.index("--model-path") + 1], "w") as out:
    out.write(str(child.pid))

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_bench_sidecar_with_sglang_needs_the_weights(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "sidecar", "--engine", "sglang"]) == 2
    assert "--engine sglang needs --model PATH" in capsys.readouterr().err


def test_bench_sidecar_takes_sglang_flags_only_with_sglang(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "sidecar", "--model", "/models/llama"]) == 2
    assert "go with --engine sglang" in capsys.readouterr().err


def _python(tmp_path: Path, body: str) -> str:
    """An executable standing in for the Python that has SGLang: it runs `body`."""
    script = tmp_path / "python"
    script.write_text(f"#!{sys.executable}\n{body}")
    script.chmod(0o755)
    return str(script)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _ended(pid: int, timeout_s: float = 5.0) -> bool:
    """Whether process `pid` ends within `timeout_s` (a SIGKILL takes effect when it next
    runs)."""
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


async def test_the_servers_whole_process_group_ends_with_the_block(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    python = _python(tmp_path, STAND_IN)
    async with serve_sglang(python, str(pid_file), [], startup_timeout_s=30) as url:
        async with aiohttp.ClientSession() as http, http.get(url + "/health") as resp:
            assert resp.status == 200
        child = int(pid_file.read_text())
        assert _alive(child)
    assert _ended(child)


async def test_a_server_that_exits_while_starting_is_reported_with_its_log(
    tmp_path: Path,
) -> None:
    python = _python(tmp_path, "import sys\nprint('no weights at', sys.argv[4])\nsys.exit(3)\n")
    with pytest.raises(SGLangStartError, match="exited with 3 while starting:\nno weights at /x"):
        async with serve_sglang(python, "/x", [], startup_timeout_s=30):
            pass


@pytest.mark.sglang
@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_sidecar_measures_in_front_of_real_sglang() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "weir.cli", "bench", "sidecar", *weir_sglang_args(VERSION),
         "--runs", "1", "--requests", "2", "--streams", "2",
         "--stream-tokens", "16", "--probes", "2", "--startup-timeout-s", "150", "--json"],
        capture_output=True, text=True, timeout=220, env={**os.environ, **cpu_environment()},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    params = report["params"]
    assert params["engine"] == f"SGLang {VERSION}"
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
    assert f"SGLang {VERSION}" in figures["added TTFT"]["note"]
    assert figures["KV change → publication"]["value"] > 0
