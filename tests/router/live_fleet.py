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
from controlplane.gateway import GatewayConfig, RunningGateway, serve_gateway
from engine_sidecar.server import RunningSidecar, SidecarConfig, serve_sidecar
from fleetsim.engine import EngineConfig
from fleetsim.server import RunningEngine, serve_engine
from tests.router.conftest import MODEL, until

POOL = "promise"
KV_TOKENS = 6_000


@dataclass
class LiveFleet:
    engines: dict[str, RunningEngine]
    sidecars: dict[str, RunningSidecar]  # in this process
    processes: dict[str, subprocess.Popen[bytes]]  # sidecars of their own, to be killed
    router: RunningGateway
    stack: contextlib.AsyncExitStack = field(repr=False)


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
) -> AsyncIterator[LiveFleet]:
    """`size` endpoints s0, s1, …; those named in `processes` run their sidecar as a
    `weir sidecar` process of its own (in `workdir`), which a test may SIGKILL. With
    `tenants`, the router enforces their quotas; `admin_token` guards router's and sidecars'
    admin routes."""
    async with contextlib.AsyncExitStack() as stack:
        engines, sidecars, procs = {}, {}, {}
        policy = PoolPolicy(
            pool=POOL, model=MODEL, context_length=4096, tenants=tenants,
            routing=RoutingPolicy(queue_max_wait_s=60.0),
        )  # fmt: skip
        for i in range(size):
            endpoint_id = f"s{i}"
            engines[endpoint_id] = await stack.enter_async_context(
                serve_engine(
                    EngineConfig(
                        model=MODEL, max_total_tokens=kv_tokens, context_length=4096,
                        speed_factor=40.0, seed=7,
                    )
                )
            )  # fmt: skip
            if endpoint_id in processes:
                assert workdir is not None
                procs[endpoint_id] = sidecar_process(
                    engines[endpoint_id].url, redis_url, endpoint_id, policy, workdir
                )
                stack.callback(reap, procs[endpoint_id])
                continue
            sidecars[endpoint_id] = await stack.enter_async_context(
                serve_sidecar(
                    SidecarConfig(
                        engine_url=engines[endpoint_id].url, redis_url=redis_url, pool=POOL,
                        endpoint_id=endpoint_id, policy=policy, heartbeat_s=0.2,
                        lease_ttl_s=3.0, engine_poll_s=0.1, admin_token=admin_token,
                    )
                )
            )  # fmt: skip
        router = await serve_gateway(
            GatewayConfig.from_policy(policy, admin_token=admin_token), redis_url=redis_url
        )
        stack.push_async_callback(router.close)
        view = router.gateway.view
        await until(lambda: len(view.snapshot.endpoints) == size, "every sidecar registered")
        yield LiveFleet(engines, sidecars, procs, router, stack)


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
