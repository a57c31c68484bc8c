"""Fixtures for end-to-end tests: `weir up` as a real subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from weir.local.ports import free_port, wait_for_port

WEIR = (sys.executable, "-m", "weir.cli")


@dataclass
class WeirUp:
    proc: subprocess.Popen[str]
    url: str

    def stop(self, timeout_s: float = 30.0) -> tuple[int, str]:
        """SIGTERM, as a service manager would; returns the exit code and the output."""
        self.proc.send_signal(signal.SIGTERM)
        output, _ = self.proc.communicate(timeout=timeout_s)
        return self.proc.returncode, output


@pytest.fixture
def weir_up() -> Iterator[WeirUp]:
    """`weir up` serving on a free port until the test stops it."""
    port = free_port()
    proc = subprocess.Popen(
        [*WEIR, "up", "--port", str(port), "--engines", "2", "--requests", "0",
         "--speed-factor", "20", "--status-every", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        wait_for_port(port, timeout_s=120)
        yield WeirUp(proc, f"http://127.0.0.1:{port}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
