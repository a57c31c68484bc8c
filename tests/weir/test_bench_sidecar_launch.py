"""`weir bench sidecar --engine sglang`: its refusals before anything starts and the server's
life cycle (a stand-in for SGLang, in a process group of its own). The benchmark in front
of SGLang's own server runs in the SGLang tier (tests/sglang/test_bench_sidecar.py)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import aiohttp
import pytest

from weir.cli import main
from weir.local.sglang import SGLangStartError, serve_sglang

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


def test_bench_sidecar_takes_an_engine_url_alone(capsys: pytest.CaptureFixture[str]) -> None:
    url = ["--engine-url", "http://127.0.0.1:30000"]
    assert main(["bench", "sidecar", *url, "--model", "/models/llama"]) == 2
    assert "takes no --model" in capsys.readouterr().err
    assert main(["bench", "sidecar", "--engine-url", "127.0.0.1:30000"]) == 2
    assert "must be an http:// URL" in capsys.readouterr().err


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
