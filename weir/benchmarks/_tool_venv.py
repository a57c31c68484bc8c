"""A load generator's own virtual environment, built once into the user's cache.

Clients that nobody on this team wrote (`inference-perf`) need another Python than Weir's
and dependencies Weir must not carry, so each gets a venv of its own under
`${XDG_CACHE_HOME:-~/.cache}/weir/<tool>/<version>/venv`, the way `scripts/sglang_env.py`
keeps SGLang's: the exact, pinned closure installed `--no-deps` (what was measured is what
reruns), a stamp keyed by a hash of the pins so that a second call returns at once and a
changed pin rebuilds, and a file lock so that concurrent callers build it once.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

STAMP = "weir-stamp.json"


class ToolVenvError(RuntimeError):
    """The venv cannot be built here; the message says which step failed and why."""


def cache_home() -> Path:
    """`${XDG_CACHE_HOME:-~/.cache}/weir`."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "weir"


@contextlib.contextmanager
def locked(lock: Path) -> Iterator[None]:
    """Held by one process at a time across the machine: concurrent builders of one
    cached thing build it once."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@dataclass(frozen=True, slots=True)
class ToolVenv:
    tool: str  # the distribution that provides the client, e.g. "inference-perf"
    version: str
    python: tuple[int, int]  # the interpreter version the tool requires
    pins: tuple[str, ...]  # the tool's dependency closure, `name==version` each

    @property
    def folder(self) -> Path:
        return cache_home() / self.tool / self.version / "venv"

    def bin(self, name: str) -> Path:
        return self.folder / "bin" / name

    @property
    def key(self) -> str:
        requirements = (f"{self.tool}=={self.version}", *self.pins)
        return hashlib.sha256("\0".join(("tool-venv/1", *requirements)).encode()).hexdigest()

    def ready(self) -> bool:
        """Built, and from these pins (no subprocess)."""
        try:
            stamp = json.loads((self.folder / STAMP).read_text())
        except (OSError, ValueError):
            return False
        return isinstance(stamp, dict) and stamp.get("key") == self.key

    def ensure(self) -> Path:
        """The venv's folder, building it first if it is missing or stale."""
        if self.ready():
            return self.folder
        with locked(self.folder.parent / ".lock"):
            if not self.ready():
                self._build()
        return self.folder

    def _build(self) -> None:
        if self.folder.exists():
            shutil.rmtree(self.folder)
        _step([self._base_python(), "-m", "venv", str(self.folder)], "python -m venv")
        pip = [str(self.bin("python")), "-m", "pip", "install", "-q", "--no-deps"]
        _step([*pip, f"{self.tool}=={self.version}", *self.pins], f"installing {self.tool}")
        stamp = {"key": self.key, "tool": self.tool, "version": self.version}
        (self.folder / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")

    def _base_python(self) -> str:
        """`pythonX.Y` from pyenv's versions or PATH: the first that runs (pyenv's shim
        is on PATH even where that version is not selected, and then fails)."""
        name = "python{}.{}".format(*self.python)
        root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
        pyenv = sorted(glob.glob(f"{root}/versions/{name[6:]}.*/bin/{name}"), reverse=True)
        for candidate in (*pyenv, shutil.which(name)):
            if candidate and _runs(candidate):
                return candidate
        raise ToolVenvError(f"{self.tool} {self.version} needs {name}, which is not here")


def _step(args: list[str], what: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-10:])
        raise ToolVenvError(f"{what} failed (exit {done.returncode}):\n{tail}")


def _runs(python: str) -> bool:
    return subprocess.run([python, "-c", ""], capture_output=True, check=False).returncode == 0
