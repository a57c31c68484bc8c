"""`weir router` and the Redis password: read from the environment or a file, never shown
at start, and off the process's command line; against a real Redis that requires it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.polling import until
from tests.router.router_process import weir_router
from weir.cli import main
from weir.local.redis_server import RedisServer

pytestmark = pytest.mark.redis
PASSWORD = "Rldm2TqGF0sTCVN-router-secret"


@pytest.fixture(scope="module")
def locked_redis() -> Iterator[RedisServer]:
    with RedisServer(extra_args=("--requirepass", PASSWORD)) as server:
        yield server


def _with_password(server: RedisServer) -> str:
    return f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"


@pytest.mark.parametrize("source", ["env", "file", "flag"])
async def test_the_router_takes_the_url_from_env_or_file_and_never_prints_the_password(
    locked_redis: RedisServer, tmp_path: Path, source: str
) -> None:
    url = _with_password(locked_redis)
    env = {k: v for k, v in os.environ.items() if k != "WEIR_REDIS_URL"}
    args = ["--port", "0", "--pool", "secret-pool", "--model", "m"]
    if source == "env":
        env["WEIR_REDIS_URL"] = url
    elif source == "file":
        secret = tmp_path / "redis-url"
        secret.write_text(url + "\n")  # as a mounted Secret's key
        args += ["--redis-url-file", str(secret)]
    else:
        args += ["--redis-url", url]
    async with weir_router(*args, env=env) as running:
        started = running.started
        assert f"from redis://:***@127.0.0.1:{locked_redis.port}/0" in started
        assert PASSWORD not in started
        cmdline = await asyncio.to_thread(Path(f"/proc/{running.proc.pid}/cmdline").read_bytes)
        assert (PASSWORD.encode() in cmdline) == (source == "flag")
        # The router reached Redis with the password: its pool view is current.

        async def following() -> bool:
            async with (
                aiohttp.ClientSession() as http,
                http.get(running.url + "/weir/v1/pool") as reply,
            ):
                pool = await reply.json()
            return pool["error"] == "" and not pool["stale"]

        await until(following, "the router to follow the locked Redis", timeout_s=30)
    err = running.stderr
    assert PASSWORD not in err
    warned = "the password in --redis-url shows in process listings" in err
    assert warned == (source == "flag")


def test_a_missing_empty_or_unusable_url_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WEIR_REDIS_URL", raising=False)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert main(["router", "--redis-url-file", str(tmp_path / "nope")]) == 2
    assert "cannot read --redis-url-file" in capsys.readouterr().err
    assert main(["router", "--redis-url-file", str(empty)]) == 2
    assert "holds no URL" in capsys.readouterr().err
    assert main(["router"]) == 2  # neither the control plane nor fixed engines
    assert "--redis-url-file or $WEIR_REDIS_URL" in capsys.readouterr().err
    assert main(["operator", "--redis-url-file", str(empty)]) == 2
    assert "holds no URL" in capsys.readouterr().err
    # A URL no component can use is refused at start, by each, without its password.
    monkeypatch.setenv("WEIR_REDIS_URL", "redis+sentinel://:hunter2@sentinel-0/weir")
    for command in (["router"], ["operator"], ["sidecar", "--engine-url", "http://127.0.0.1:1"]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert "is not host:port" in err
        assert "hunter2" not in err


@pytest.mark.parametrize(("text", "message"), [
    ("{}\n", "holds no API keys, which would let every request in"),
    ("\n", "expected a mapping of API key to tenant"),
    ("[]\n", "expected a mapping of API key to tenant"),
])  # fmt: skip
def test_an_api_keys_file_without_keys_is_refused(tmp_path: Path, text: str, message: str) -> None:
    """The chart's production values mount an API keys Secret: a Secret holding `{}` must
    stop the router, not quietly run it without authentication."""
    keys = tmp_path / "api-keys.yaml"
    keys.write_text(text)
    # A process of its own: a router that took the file would serve until stopped.
    ran = subprocess.run(
        [sys.executable, "-m", "weir.cli", "router", "--port", "0",
         "--endpoint", "http://127.0.0.1:9", "--api-keys", str(keys)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert ran.returncode == 2, ran.stdout + ran.stderr
    assert message in ran.stderr
