"""The fleet simulator compiled by mypyc, for `weir bench fleet --compiled`.

The simulator's hot modules (the engine model, the event loop, Weir's orchestration, the
sidecar policy and the router's scoring, ownership and rules) are the same typed Python
the live system runs; mypyc compiles them to C extensions from that source, unchanged.
A build is a copy of the `controlplane`, `engine_sidecar` and `fleetsim` packages with
those modules compiled in place, under `${XDG_CACHE_HOME:-~/.cache}/weir/compiled-sim/
<key>`, the key a hash of every file of the three packages, Python's and mypy's versions:
a changed source builds again (about two minutes on two cores), an unchanged one returns
at once. A run puts the build first on `PYTHONPATH` in a child process, so every module
it imports comes from one version of the source.

What mypyc cannot compile stays interpreted, and the compiled modules keep to what it
compiles identically (`tests/weir/test_compiled_sim.py` runs the recorded identical
cells through a build): a `sum` of floats starts at `0.0` (mypyc keeps a `sum` started
at the int 0 in an int), and a dataclass field that `__init__` does not take is set in
`__post_init__`, not by a default; a generic class is a plain class (a generic
dataclass does not import compiled). Interpreted: `controlplane.routing.framework`
and `snapshot` (their construction short-cuts through `object.__new__` and slot setters,
and a runtime-checkable protocol). A dataclass's generated methods (`__init__` among
them) stay interpreted in a compiled module: mypyc compiles only the methods written
out, so the hottest value types write theirs (and are not frozen: a frozen one's fields
are set through `object.__setattr__`, a generic call each). Module constants read in
hot code are `Final` (inlined; others are looked up at each use), and a product is a
machine multiply only while both factors are below 2**30 (else arbitrary precision).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from weir.benchmarks._tool_venv import cache_home, locked

PACKAGES = ("controlplane", "engine_sidecar", "fleetsim")
COMPILED = (
    "controlplane/ownership/blocks.py",
    "controlplane/ownership/membership.py",
    "controlplane/ownership/ring.py",
    "controlplane/routing/cost.py",
    "controlplane/routing/dispatch.py",
    "controlplane/routing/fair_queue.py",
    "controlplane/routing/filters.py",
    "controlplane/routing/inflight.py",
    "controlplane/routing/pairing.py",
    "controlplane/routing/pickers.py",
    "controlplane/routing/prefix_index.py",
    "controlplane/routing/profile.py",
    "controlplane/routing/registry.py",
    "controlplane/routing/scorers.py",
    "controlplane/rules/credits.py",
    "controlplane/rules/fairness.py",
    "controlplane/rules/quotas.py",
    "engine_sidecar/ledger.py",
    "engine_sidecar/policy/admission.py",
    "engine_sidecar/policy/host_prefixes.py",
    "engine_sidecar/policy/latency.py",
    "engine_sidecar/policy/prediction.py",
    "engine_sidecar/policy/prompt_size.py",
    "engine_sidecar/policy/queue.py",
    "engine_sidecar/policy/relief.py",
    "engine_sidecar/policy/reservation.py",
    "engine_sidecar/policy/watermark.py",
    "fleetsim/baselines/llmd_weighted.py",
    "fleetsim/baselines/reservation.py",
    "fleetsim/baselines/sglang_cache_aware.py",
    "fleetsim/baselines/simple.py",
    "fleetsim/engine/backends.py",
    "fleetsim/engine/config.py",
    "fleetsim/engine/host_cache.py",
    "fleetsim/engine/kv_cache.py",
    "fleetsim/engine/request.py",
    "fleetsim/engine/scheduler.py",
    "fleetsim/engine/timing.py",
    "fleetsim/engine/tokens.py",
    "fleetsim/sim/baseline.py",
    "fleetsim/sim/config.py",
    "fleetsim/sim/flight.py",
    "fleetsim/sim/gate.py",
    "fleetsim/sim/loop.py",
    "fleetsim/sim/oracle.py",
    "fleetsim/sim/weir.py",
    "fleetsim/workloads/request.py",
)
# Set in the child a compiled run starts: the build it was started on.
BUILD_ENV = "WEIR_COMPILED_SIM"
_BUILT = "weir-built"
_KEEP = 3  # builds kept in the cache, the most recently made

# mypycify reads the type checker's options from the build folder; the packages are
# checked by `mypy --strict` in CI, the build only needs their types.
_MYPY_CONFIG = "[mypy]\npython_version = 3.11\nignore_missing_imports = True\n"
_SETUP = """\
import sys
from mypyc.build import mypycify
from setuptools import setup
jobs = sys.argv[1]
setup(
    name="weir-compiled-sim",
    ext_modules=mypycify(sys.argv[2:], opt_level="3"),
    script_args=["build_ext", "--inplace", "--parallel", jobs],
)
"""


class CompiledSimError(RuntimeError):
    """No build: mypyc or a C compiler is missing, or a module did not compile."""


def source_root() -> Path:
    """The folder holding the three packages (the checkout, or site-packages)."""
    import fleetsim  # here, not at the top: the command line starts without the simulator

    return Path(fleetsim.__file__).resolve().parent.parent


def _sources(root: Path) -> list[Path]:
    files = (p for package in PACKAGES for p in (root / package).rglob("*") if p.is_file())
    return sorted(p for p in files if "__pycache__" not in p.parts and p.suffix != ".so")


def build_key(root: Path) -> str:
    digest = hashlib.sha256()
    try:
        mypy = importlib.metadata.version("mypy")
    except importlib.metadata.PackageNotFoundError as exc:
        raise CompiledSimError("mypyc is not installed (it comes with mypy)") from exc
    digest.update(f"compiled-sim/1\0{sys.version}\0{mypy}\0{COMPILED}".encode())
    for path in _sources(root):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def ensure_build(jobs: int = 2) -> Path:
    """The build for the sources as they are, made first if it is not cached."""
    root = source_root()
    cache = cache_home() / "compiled-sim"
    target = cache / build_key(root)
    if (target / _BUILT).exists():
        return target
    with locked(cache / ".lock"):
        if not (target / _BUILT).exists():
            _build(root, target, jobs)
            _prune(cache, target)
    return target


def _build(root: Path, target: Path, jobs: int) -> None:
    if shutil.which((os.environ.get("CC") or "cc").split()[0]) is None:
        raise CompiledSimError("no C compiler (cc) here")
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        for package in PACKAGES:
            shutil.copytree(
                root / package, staging / package, ignore=shutil.ignore_patterns("__pycache__")
            )
        (staging / "mypy.ini").write_text(_MYPY_CONFIG)
        done = subprocess.run(
            [sys.executable, "-c", _SETUP, str(jobs), *COMPILED],
            cwd=staging,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            raise CompiledSimError(f"mypyc failed (exit {done.returncode}):\n{tail}")
        shutil.rmtree(staging / "build")
        (staging / _BUILT).write_text("")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _prune(cache: Path, keep: Path) -> None:
    """Keep the newest builds; drop what an interrupted build left (the lock is held)."""
    for left in cache.glob(".build-*"):
        shutil.rmtree(left, ignore_errors=True)
    builds = sorted(
        (p for p in cache.iterdir() if (p / _BUILT).exists() and p != keep),
        key=lambda p: (p / _BUILT).stat().st_mtime,
        reverse=True,
    )
    for old in builds[_KEEP - 1 :]:
        shutil.rmtree(old, ignore_errors=True)


def compiled_env(build: Path) -> dict[str, str]:
    """The environment of a child process that imports the build's modules."""
    env = dict(os.environ)
    paths = [str(build), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env[BUILD_ENV] = str(build)
    return env


def running_compiled() -> bool:
    """Whether this process is a compiled run's child; an error if it was started as
    one but imported the interpreted simulator."""
    build = os.environ.get(BUILD_ENV)
    if not build:
        return False
    from fleetsim.sim import loop

    if not Path(loop.__file__).is_relative_to(build) or Path(loop.__file__).suffix != ".so":
        raise CompiledSimError(f"started on the build {build} but imported {loop.__file__}")
    return True


def run_compiled(argv: Sequence[str]) -> int:
    """`weir` with `argv` in a child process on the compiled simulator."""
    build = ensure_build()
    # -P: the working folder (a checkout, often) must not shadow the build.
    command = [sys.executable, "-P", "-m", "weir.cli", *argv]
    return subprocess.run(command, env=compiled_env(build), check=False).returncode
