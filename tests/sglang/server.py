"""A real SGLang server on the CPU, for tests: PyPI's sglang (0.5.23 or 0.5.5) serving the
tiny random-weight Llama that `scripts/sglang_env.py` installs and builds.

    with SGLangServer("0.5.23") as server:
        urllib.request.urlopen(server.url + "/get_server_info")

The venv, the model and the CPU launch flags come from `weir.local.sglang_cpu`, the one
recipe (`weir bench live --engine sglang-0.5.23` launches the same way). Nothing is
installed here: the install takes minutes and belongs to the bootstrap, not to a test's
timeout; `unavailable_reason(version)` says why a tier cannot run.

The server runs in a process group of its own (HTTP server, scheduler, detokenizer and
multiprocessing's resource tracker), on a free loopback port, with its temporary files
(ZMQ sockets, Prometheus' multiprocess folder) in a folder of its own; leaving the context
ends the whole group and removes that folder.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType

from weir.local.sglang_cpu import (
    cpu_environment,
    cpu_flags,
    model_dir,
    unavailable_reason,
    venv_python,
)

# A hang guard, not a goal: a start takes 25-60 s alone, and several times that while the
# suite's other worker (scripts/check.sh runs two) keeps both cores busy.
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 20.0
# Loopback only: no proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def weir_sglang_args(version: str) -> list[str]:
    """`weir`'s flags (`weir up`, `weir bench sidecar`) that launch `version`'s server with
    the tiny model on this machine's CPU. Skips through `tests.tiers.unavailable` (fails in
    CI) when the version cannot run."""
    from tests.tiers import unavailable

    reason = unavailable_reason(version)
    if reason is not None:
        unavailable(f"SGLang {version}", reason)
    return [
        "--engine", "sglang",
        "--model", str(model_dir()),
        "--sglang-python", str(venv_python(version)),
        *(f"--engine-arg={flag}" for flag in cpu_flags(version)),
    ]  # fmt: skip


class SGLangUnavailableError(RuntimeError):
    """The version is not installed, or its server did not come up."""


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on every address, below the kernel's ephemeral range: the client end
    of every connection (a health poll, SGLang's own) takes a port from that range, and
    one taken between this check and the server's bind fails the start (seen: the
    scheduler's torch.distributed store, EADDRINUSE)."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(10000, max(low, 10001))
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
        return port
    with socket.socket() as sock:
        sock.bind(("", 0))
        found: int = sock.getsockname()[1]
        return found


class SGLangServer:
    """One real SGLang server, started on entering and stopped (whole process group) on
    leaving. `extra_args` go after the defaults, so they override them (argparse keeps the
    last value)."""

    def __init__(
        self,
        version: str,
        *,
        extra_args: Sequence[str] = (),
        log_dir: Path | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        port: int | None = None,
    ) -> None:
        self.version = version
        self.extra_args = tuple(extra_args)
        self.start_timeout_s = start_timeout_s
        self.port = port or free_port()
        # torch.distributed's store (the scheduler's process group), on a port of ours too:
        # SGLang's own pick (the HTTP port plus 100 to 1,000) races with other servers.
        self.nccl_port = free_port()
        while self.nccl_port == self.port:
            self.nccl_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        folder = log_dir or Path(tempfile.mkdtemp(prefix=f"weir-sglang-{version}-"))
        folder.mkdir(parents=True, exist_ok=True)
        self.log_path = folder / f"sglang-{version}-{self.port}.log"
        self.start_seconds: float | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._tmp: Path | None = None

    def command(self) -> list[str]:
        return [
            str(venv_python(self.version)), "-m", "sglang.launch_server",
            "--model-path", str(model_dir()),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--nccl-port", str(self.nccl_port),
            "--enable-metrics",
            *cpu_flags(self.version),
            *self.extra_args,
        ]  # fmt: skip

    def environment(self, tmp: Path) -> dict[str, str]:
        env = {
            key: value
            for key, value in os.environ.items()
            if key not in ("PYTHONPATH", "PROMETHEUS_MULTIPROC_DIR", "VIRTUAL_ENV")
        }
        env.update(cpu_environment(), TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
        return env

    def __enter__(self) -> SGLangServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        """The server's main process, also its process group's id."""
        return None if self._process is None else self._process.pid

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def processes(self) -> list[int]:
        """The live processes of the server's group (HTTP server, scheduler, detokenizer,
        multiprocessing's resource tracker)."""
        return [] if self.pid is None else _group_members(self.pid)

    def rss_bytes(self) -> int:
        """Resident memory of the server's processes together."""
        total = 0
        for pid in self.processes():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        return total

    def start(self) -> None:
        reason = unavailable_reason(self.version)
        if reason is not None:
            raise SGLangUnavailableError(reason)
        self._tmp = Path(tempfile.mkdtemp(prefix="weir-sglang-tmp-"))
        started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(self._tmp),
                cwd=self._tmp,
                start_new_session=True,
            )
        try:
            self._wait_ready(started)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - started

    def _wait_ready(self, started: float) -> None:
        assert self._process is not None
        deadline = started + self.start_timeout_s
        while True:
            code = self._process.poll()
            if code is not None:
                raise SGLangUnavailableError(
                    f"SGLang {self.version} exited with {code} while starting:\n{self.log_tail()}"
                )
            if self._healthy():
                return
            if time.monotonic() > deadline:
                raise SGLangUnavailableError(
                    f"SGLang {self.version} was not healthy after {self.start_timeout_s:.0f} s:"
                    f"\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            with _OPENER.open(self.url + "/health", timeout=10) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM to the server, SIGKILL to what is left of its process group after
        STOP_TIMEOUT_S; returns once no live process of the group is left."""
        process, self._process = self._process, None
        if process is not None:
            group = process.pid
            # The leader alone: on SIGTERM it drains and ends its children itself. A
            # SIGTERM to the whole group kills the scheduler first, which the leader takes
            # for a crash, and its crash handler sleeps 5 s before cleaning up.
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            if not _wait_group_gone(group, process, STOP_TIMEOUT_S):
                _signal_group(group, signal.SIGKILL)
                if not _wait_group_gone(group, process, STOP_TIMEOUT_S):
                    raise RuntimeError(
                        f"SGLang {self.version}'s processes {_group_members(group)} outlived"
                        " SIGKILL"
                    )
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


def _signal_group(group: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, sig)


def _group_members(group: int) -> list[int]:
    """Live (not zombie) processes whose process group is `group`, from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == group:
            members.append(int(entry.name))
    return members


def _wait_group_gone(group: int, process: subprocess.Popen[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        process.poll()  # reaps the leader once it exits
        if not _group_members(group):
            process.wait(timeout=5)  # a leader gone since the last poll is a zombie: reap it
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def serve(
    version: str, *, log_dir: Path | None = None, extra_args: Sequence[str] = ()
) -> Iterator[SGLangServer]:
    """The body of a pytest fixture: skips through `tests.tiers.unavailable` (fails in CI)
    when the version cannot run, else yields a started server and stops it afterwards.

        @pytest.fixture(scope="session", params=versions())
        def sglang(request, tmp_path_factory):
            logs = tmp_path_factory.mktemp("sglang")
            yield from sglang_server.serve(request.param, log_dir=logs)
    """
    from tests.tiers import unavailable

    reason = unavailable_reason(version)
    if reason is not None:
        unavailable(f"SGLang {version}", reason)
    with SGLangServer(version, log_dir=log_dir, extra_args=extra_args) as server:
        yield server
