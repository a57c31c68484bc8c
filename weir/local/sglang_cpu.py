"""The real SGLang tier on this machine's CPU: PyPI's sglang (0.5.23 or 0.5.5) serving the
tiny random-weight Llama, both installed and built by `scripts/sglang_env.py`.

The one recipe for launching it, shared by the SGLang test tier (`tests/sglang/server.py`)
and `weir bench live --engine sglang-0.5.23`: where the installer put the venv and the
model (its own path functions, loaded by file location: scripts/ is not a package, so this
works from a source checkout only), whether they are ready, and the launch flags and
environment that make a version serve on the CPU. Nothing is installed here: the install
takes minutes and belongs to the bootstrap.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
INSTALLER = ROOT / "scripts" / "sglang_env.py"

# Flags each version needs on the CPU besides the common ones. 0.5.5's paged KV allocator
# (page size > 1) runs a Triton kernel, which has no CPU driver: 0.5.5 keeps page size 1.
VERSION_FLAGS: dict[str, tuple[str, ...]] = {
    "0.5.23": ("--page-size", "16"),
    "0.5.5": ("--page-size", "1"),
}
# The KV pool `cpu_flags` gives a server, in tokens.
KV_TOKENS = 4096


def cpu_flags(version: str) -> list[str]:
    """The launch flags that make `version` serve the tiny model on this machine's CPU,
    with a small KV pool (`KV_TOKENS`) that a handful of requests fills."""
    return [
        "--device", "cpu",
        "--attention-backend", "torch_native",
        "--disable-overlap-schedule",
        "--max-total-tokens", str(KV_TOKENS),
        "--mem-fraction-static", "0.05",
        "--skip-server-warmup",
        # Without it an idle scheduler polls its sockets flat out: a whole core per server
        # (measured on 0.5.5 and 0.5.23), taken from everything else on a CPU machine.
        "--sleep-on-idle",
        *VERSION_FLAGS.get(version, ()),
    ]  # fmt: skip


def cpu_environment() -> dict[str, str]:
    """SGLang's CPU engine, offline: what a server's environment adds to ours."""
    return {"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@functools.cache
def installer() -> ModuleType:
    """`scripts/sglang_env.py`, loaded by file location (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("weir_sglang_env", INSTALLER)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {INSTALLER}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def versions() -> tuple[str, ...]:
    """The SGLang versions the installer knows, newest first."""
    return tuple(str(version) for version in installer().SUPPORTED)


def venv_python(version: str) -> Path:
    return Path(installer().venv_python(version))


def model_dir() -> Path:
    return Path(installer().model_dir())


def unavailable_reason(version: str) -> str | None:
    """Why a real SGLang `version` cannot run here, or None when it can. Reads only the
    installer's stamps (no subprocess): a venv installed from other pins is stale."""
    if not INSTALLER.is_file():
        return f"its installer {INSTALLER} is missing: the SGLang tier runs from a checkout"
    env = installer()
    command = f"python3 {INSTALLER.relative_to(ROOT)} {version}"
    if version not in env.SUPPORTED:
        return f"SGLang {version} is not one the installer knows ({', '.join(versions())})"
    if not venv_python(version).is_file():
        return f"SGLang {version} is not installed in {env.venv_dir(version)}: run {command}"
    if not env.venv_ready(version):
        return f"SGLang {version}'s venv is unfinished or stale (other pins): run {command}"
    if not env.model_ready():
        return f"the tiny model is not built in {model_dir()}: run {command}"
    return None
