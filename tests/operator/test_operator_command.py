"""`weir operator` as a real process: the command line wires kopf, the kubeconfig, the
control plane and the liveness endpoint the chart probes."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import aiohttp
import kmock
import pytest
from kubernetes_asyncio import client

from fleet_operator.spec import GROUP, PLURAL, VERSION
from tests.operator.cluster import declare, eventually, stored, write_kubeconfig
from weir.local.ports import free_port

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[2]


async def test_weir_operator_runs_a_pool(
    kmock: kmock.KubernetesEmulator, tmp_path: Path, redis_url: str
) -> None:
    declare(kmock)
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", str(kmock.url))
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "WEIR_REDIS_URL": redis_url,
        "WEIR_IMAGE": "weir:cli-test",
        "WEIR_STATUS_INTERVAL_S": "0.5",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "operator")]),
    }
    liveness = f"http://127.0.0.1:{free_port()}/healthz"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "weir.cli", "operator", "--liveness", liveness,
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as http:

            async def alive() -> bool:
                if process.returncode is not None:
                    assert process.stderr is not None
                    raise AssertionError((await process.stderr.read()).decode())
                try:
                    async with http.get(liveness) as response:
                        return response.status == 200
                except aiohttp.ClientError:
                    return False

            await eventually(alive, what="the operator's liveness endpoint")

        pool = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "InferencePool",
            "metadata": {"name": "cli", "namespace": "default", "resourceVersion": "1",
                         "uid": "uid-cli"},
            "spec": {"model": {"name": "m"}},
        }  # fmt: skip
        configuration = client.Configuration(host=str(kmock.url))
        async with client.ApiClient(configuration) as api:
            await client.CustomObjectsApi(api).create_namespaced_custom_object(
                GROUP, VERSION, "default", PLURAL, pool
            )
        deployment = await eventually(lambda: stored(kmock, "apps/v1/deployments", "cli"))
        sidecar = deployment["spec"]["template"]["spec"]["containers"][1]
        assert sidecar["image"] == "weir:cli-test"
        await eventually(
            lambda: (
                (stored(kmock, f"{GROUP}/{VERSION}/{PLURAL}", "cli") or {})
                .get("status", {})
                .get("conditions")
            ),
            what="a status from the operator process",
        )
    finally:
        if process.returncode is None:
            process.terminate()
        await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode is not None
