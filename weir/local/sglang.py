"""SGLang's own server, launched the way Weir launches it: one per engine in `weir up
--engine sglang`, and one for `weir bench sidecar --engine sglang` to measure in front of.

`launch_command` is the one definition of the launch; `check_launch` refuses one that
cannot start before anything runs; `serve_sglang` runs a server for a block of async code
and ends every process it spawned afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp

from weir.local.ports import free_port
from weir.local.process import log_tail

STOP_TIMEOUT_S = 20.0


class SGLangStartError(RuntimeError):
    """The server exited while starting, or was not healthy in time; the message holds the
    tail of its log."""


def check_launch(python: str, model_path: str) -> None:
    """Raise ValueError, naming the flag to fix, for a launch that cannot start: no weights
    named, or no SGLang in `python` (empty: this one)."""
    if not model_path:
        raise ValueError("--engine sglang needs --model PATH (the weights to serve)")
    if python:
        if not Path(python).is_file():
            raise ValueError(f"--sglang-python {python}: no such file")
    elif importlib.util.find_spec("sglang") is None:
        raise ValueError(
            "--engine sglang needs SGLang: pip install 'weir[sglang]', or name the Python "
            "that has it with --sglang-python"
        )


def launch_command(
    python: str, model_path: str, port: int, engine_args: Sequence[str] = ()
) -> list[str]:
    """`launch_server` for `model_path` on loopback `port`, with its metrics on, run by
    `python` (empty: this one). `engine_args` come last, so they override Weir's flags
    (argparse keeps the last value)."""
    # torch.distributed's port, our pick: SGLang's own (its HTTP port plus a random
    # offset) can collide between engines started together.
    return [python or sys.executable, "-m", "sglang.launch_server",
            "--model-path", model_path, "--host", "127.0.0.1", "--port", str(port),
            "--nccl-port", str(free_port()), "--enable-metrics", *engine_args]  # fmt: skip


@asynccontextmanager
async def serve_sglang(
    python: str, model_path: str, engine_args: Sequence[str], startup_timeout_s: float
) -> AsyncIterator[str]:
    """A server's URL for the block, once `GET /health` answers 200. The server runs in a
    process group of its own (it spawns a scheduler and a detokenizer), with its output and
    temporary files in a folder removed afterwards; the whole group ends with the block."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="weir-sglang-") as folder:
        log = Path(folder) / "sglang.log"
        with log.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                *launch_command(python, model_path, port, engine_args),
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "TMPDIR": folder}, start_new_session=True,
            )  # fmt: skip
        try:
            await _until_healthy(proc, url, startup_timeout_s, log)
            yield url
        finally:
            await _stop_group(proc)


async def _until_healthy(
    proc: asyncio.subprocess.Process, url: str, timeout_s: float, log: Path
) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        while proc.returncode is None:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):  # not up yet
                async with http.get(url + "/health") as resp:
                    if resp.status == 200:
                        return
            if time.monotonic() > deadline:
                raise SGLangStartError(
                    f"SGLang was not healthy after {timeout_s:.0f} s:\n{log_tail(log)}"
                )
            await asyncio.sleep(0.5)
    raise SGLangStartError(f"SGLang exited with {proc.returncode} while starting:\n{log_tail(log)}")


async def _stop_group(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM to the leader alone, which then ends its children itself (a SIGTERM to the
    whole group kills the scheduler first, which the leader takes for a crash and sleeps
    on); SIGKILL to what is left of the group once it exited or STOP_TIMEOUT_S passed."""
    try:
        if proc.returncode is None:
            proc.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    await proc.wait()
