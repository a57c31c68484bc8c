"""A throwaway `redis-server` (and optionally `redis-sentinel`) on loopback.

Used by `weir up` when no Redis URL is given, and by the tests, which always run against a
real server: Lua, key expiry and server time cannot be faked faithfully.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from weir.local.ports import free_port, wait_for_port
from weir.local.process import LocalService, stop_process


class RedisNotInstalledError(RuntimeError):
    pass


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RedisNotInstalledError(
            f"{name} is not installed; run scripts/bootstrap.sh (apt-get install {name})"
        )
    return path


class RedisServer(LocalService):
    """One redis-server process with no persistence, on a free loopback port."""

    def __init__(self, port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self.extra_args = extra_args
        self._dir = tempfile.TemporaryDirectory(prefix="weir-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def workdir(self) -> Path:
        return Path(self._dir.name)

    def start(self) -> RedisServer:
        args = [
            _binary("redis-server"),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir.name,
            *self.extra_args,
        ]  # fmt: skip
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port)
        return self

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        stop_process(self._proc, timeout_s=5)
        self._proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is handed over or written on the way out."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def restart(self) -> None:
        """Stop and start on the same port: all data is lost, as after a crash."""
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()
