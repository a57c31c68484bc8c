"""`weir sidecar` as the operator runs it: a process with the documented flags."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml

from controlplane.store import EndpointRegistry, RedisSettings, connect
from fleetsim.server import RunningEngine
from tests.sidecar.conftest import MODEL
from tests.sidecar.streams import read_sse
from weir.local.ports import free_port, wait_for_port

pytestmark = pytest.mark.redis


async def test_runs_with_the_operators_flags_and_leaves_cleanly(
    engine: RunningEngine, redis_url: str, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        yaml.safe_dump(
            {"pool": "p", "model": MODEL, "context_length": 4096, "kv": {"low_watermark": 0.6}}
        )
    )
    token_file = tmp_path / "token"
    token_file.write_text("cli-admin-token-0123456789\n")  # as a mounted Secret's file
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # The Redis URL in the environment, from the pool's Secret, as the operator passes it.
    env = {**os.environ, "WEIR_REDIS_URL": redis_url}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "weir.cli", "sidecar",
        "--engine-url", engine.url, "--host", "127.0.0.1", "--port", str(port),
        "--pool", "p", "--endpoint-id", "pod-cli",
        "--advertise-url", "http://10.1.2.3:8001", "--policy-file", str(policy),
        "--heartbeat-s", "0.2", "--lease-ttl-s", "3", "--admin-token-file", str(token_file),
        env=env,
    )  # fmt: skip
    redis = connect(RedisSettings(url=redis_url))
    registry = EndpointRegistry(redis, "p")
    try:
        await asyncio.to_thread(wait_for_port, port, "127.0.0.1", 60.0)
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 5}, "stream": True}
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/generate", json=body) as resp:
                assert resp.status == 200
                assert (await read_sse(resp)).done
            async with http.get(url + "/weir/v1/state") as resp:
                assert resp.status == 401
            admin = {"Authorization": "Bearer cli-admin-token-0123456789"}
            async with http.get(url + "/weir/v1/state", headers=admin) as resp:
                assert resp.status == 200
        snap = await registry.snapshot()
        while "pod-cli" not in snap.endpoints:
            await registry.wait_for_change(snap.position, 1000)
            snap = await registry.snapshot()
        assert snap.endpoints["pod-cli"].address == "http://10.1.2.3:8001"
        # The preStop hook's drain: refused without the token, done with it.
        drains = []
        for extra in ((), ("--admin-token-file", str(token_file))):
            drain = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "weir.cli", "sidecar", "drain", "--url", url,
                "--deadline-s", "1", *extra, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            out, err = await drain.communicate()
            drains.append((drain.returncode, out, err))
        (refused, _, why), (drained, out, _) = drains
        assert (refused, drained) == (1, 0)
        assert b"answered 401" in why
        assert b'"in_flight": 0' in out
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert "pod-cli" not in (await registry.snapshot()).endpoints
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await redis.aclose()


async def test_refuses_a_bad_policy_file(tmp_path: Path) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text('{"pool": "p", "model": "m", "kv": {"low_watermark": 2}}')
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "weir.cli", "sidecar", "--engine-url", "http://127.0.0.1:9",
        "--policy-file", str(policy), stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await proc.communicate()
    assert proc.returncode == 2
    assert b"bad --policy-file" in err
    assert b"watermark" in err


def test_the_package_exports_what_it_documents() -> None:
    import engine_sidecar

    for name in engine_sidecar.__all__:
        assert getattr(engine_sidecar, name) is not None
    assert sorted(engine_sidecar.__all__) == sorted(engine_sidecar._EXPORTS)
