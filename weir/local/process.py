"""The life cycle shared by every local server process (Redis, Prometheus, a fleet)."""

from __future__ import annotations

import subprocess
from abc import ABC, abstractmethod
from pathlib import Path
from types import TracebackType
from typing import Self


def stop_process(proc: subprocess.Popen[bytes] | None, timeout_s: float = 10.0) -> None:
    """Terminate politely, and kill what has not exited after `timeout_s`."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def log_tail(log: Path, lines: int = 20) -> str:
    """The last `lines` lines of a child's log, for an error that says why it failed."""
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class LocalService(ABC):
    """Something started on loopback and cleaned up afterwards, usable with `with`.

    A start that fails half way is cleaned up before the error propagates, so a test that
    cannot start its Redis or Prometheus leaves no process behind.
    """

    @abstractmethod
    def start(self) -> Self: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
