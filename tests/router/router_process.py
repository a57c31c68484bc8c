"""`weir router` as a process of its own, for tests of what its command line does."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass


@dataclass
class RouterProcess:
    proc: asyncio.subprocess.Process
    started: str = ""  # its first line: "weir router: URL ..."
    stderr: str = ""  # what it wrote there, once it has ended

    @property
    def url(self) -> str:
        return self.started.split()[2]


@contextlib.asynccontextmanager
async def weir_router(
    *args: str, env: Mapping[str, str] | None = None
) -> AsyncIterator[RouterProcess]:
    """Start `weir router ARGS`, wait for its start line, and SIGTERM it at the end."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "weir.cli", "router", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    running = RouterProcess(proc)
    try:
        assert proc.stdout is not None
        running.started = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert running.started.startswith("weir router: http://127.0.0.1:"), running.started
        yield running
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        running.stderr = err.decode()
