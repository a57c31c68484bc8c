"""A live fleet for the promise tests: reference engines with small KV caches, a sidecar
each (in this process, or as a `weir sidecar` process a test may kill), one router, on a
real Redis; and the streams those tests send through it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from controlplane.contract import PoolPolicy, RoutingPolicy, TenantQuota, encode_json
from controlplane.router import RouterConfig, RunningRouter, serve_router
from engine_sidecar.server import RunningSidecar, SidecarConfig, serve_sidecar
from fleetsim.engine import EngineConfig
from fleetsim.server import RunningEngine, serve_engine
from tests.polling import until
from tests.router.conftest import MODEL

POOL = "promise"
KV_TOKENS = 6_000


@dataclass
class LiveFleet:
    engines: dict[str, RunningEngine]
    sidecars: dict[str, RunningSidecar]  # in this process
    processes: dict[str, subprocess.Popen[bytes]]  # sidecars of their own, to be killed
    router: RunningRouter
    stack: contextlib.AsyncExitStack = field(repr=False)
    redis_url: str = field(default="", repr=False)
    policy: PoolPolicy | None = None
    admin_token: str = field(default="", repr=False)

    async def add(
        self, endpoint_id: str, kv_tokens: int, speed_factor: float, *, process: Path | None = None
    ) -> None:
        """Another endpoint: a reference engine and its sidecar, in this process or (with
        `process`, its working folder) as a `weir sidecar` process a test may kill."""
        assert self.policy is not None
        engine = self.engines[endpoint_id] = await self.stack.enter_async_context(
            serve_engine(
                EngineConfig(
                    model=MODEL, max_total_tokens=kv_tokens, context_length=4096,
                    speed_factor=speed_factor, seed=7,
                )
            )
        )  # fmt: skip
        if process is not None:
            proc = sidecar_process(engine.url, self.redis_url, endpoint_id, self.policy, process)
            self.processes[endpoint_id] = proc
            self.stack.callback(reap, proc)
            return
        self.sidecars[endpoint_id] = await self.stack.enter_async_context(
            serve_sidecar(
                SidecarConfig(
                    engine_url=engine.url, redis_url=self.redis_url, pool=POOL,
                    endpoint_id=endpoint_id, policy=self.policy, heartbeat_s=0.2,
                    lease_ttl_s=3.0, engine_poll_s=0.1, admin_token=self.admin_token,
                )
            )
        )  # fmt: skip


@contextlib.asynccontextmanager
async def live_fleet(
    redis_url: str,
    size: int = 2,
    kv_tokens: int = KV_TOKENS,
    *,
    processes: frozenset[str] = frozenset(),
    workdir: Path | None = None,
    tenants: tuple[TenantQuota, ...] = (),
    admin_token: str = "",
    speed_factor: float = 40.0,
    resume_wait_s: float = 60.0,
) -> AsyncIterator[LiveFleet]:
    """`size` endpoints s0, s1, …; those named in `processes` run their sidecar as a
    `weir sidecar` process of its own (in `workdir`), which a test may SIGKILL. With
    `tenants`, the router enforces their quotas; `admin_token` guards router's and sidecars'
    admin routes; `resume_wait_s` bounds how long a resume waits, at the router or in a
    sidecar's queue."""
    async with contextlib.AsyncExitStack() as stack:
        policy = PoolPolicy(
            pool=POOL, model=MODEL, context_length=4096, tenants=tenants,
            routing=RoutingPolicy(queue_max_wait_s=60.0, resume_wait_s=resume_wait_s),
        )  # fmt: skip
        router = await serve_router(
            RouterConfig.from_policy(policy, admin_token=admin_token), redis_url=redis_url
        )
        stack.push_async_callback(router.close)
        fleet = LiveFleet({}, {}, {}, router, stack, redis_url, policy, admin_token)
        for i in range(size):
            endpoint_id = f"s{i}"
            process = workdir if endpoint_id in processes else None
            assert process is not None or endpoint_id not in processes
            await fleet.add(endpoint_id, kv_tokens, speed_factor, process=process)
        view = router.router.view
        await until(lambda: len(view.snapshot.endpoints) == size, "every sidecar registered")
        yield fleet


def sidecar_process(
    engine_url: str, redis_url: str, endpoint_id: str, policy: PoolPolicy, workdir: Path
) -> subprocess.Popen[bytes]:
    policy_file = workdir / f"{endpoint_id}-policy.json"
    policy_file.write_bytes(encode_json(policy))
    command = [
        sys.executable, "-m", "weir.cli", "sidecar", "--engine-url", engine_url,
        "--redis-url", redis_url, "--pool", POOL, "--endpoint-id", endpoint_id,
        "--port", "0", "--policy-file", str(policy_file), "--heartbeat-s", "0.2",
        "--lease-ttl-s", "3", "--log-level", "WARNING",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    with (workdir / f"{endpoint_id}.log").open("wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def reap(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


@dataclass
class Stream:
    text: str = ""
    finish: str = ""
    error: dict[str, object] | None = None
    done: bool = False
    endpoint: str = ""  # where it started
    request_id: str = ""  # the router's answer names it
    chunks: int = 0
    progress: asyncio.Event = field(default_factory=asyncio.Event)  # set at chunk 5


async def read_stream(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, object],
    out: Stream | None = None,
    headers: dict[str, str] | None = None,
) -> Stream:
    out = out or Stream()
    async with session.post(url + "/v1/completions", json=body, headers=headers) as reply:
        out.request_id = reply.headers.get("x-request-id", "")
        if reply.status != 200:
            out.error = {"status": reply.status, "body": await reply.text()}
            return out
        out.endpoint = reply.headers.get("x-weir-endpoint", "")
        async for line in reply.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                out.done = True
                continue
            chunk = json.loads(data)
            out.chunks += 1
            if out.chunks == 5:
                out.progress.set()
            if "error" in chunk:
                out.error = chunk["error"]
                continue
            for choice in chunk.get("choices") or ():
                out.text += choice.get("text") or ""
                out.finish = choice.get("finish_reason") or out.finish
    return out


def request_body(i: int, max_tokens: int) -> dict[str, object]:
    prompt = f"{i:03d} " + "the river rises against the weir, " * 10
    return {
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
        "stream": True,
    }  # fmt: skip
