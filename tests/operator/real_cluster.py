"""Weir installed on the real control plane, for the operator's tests.

`install_crd` applies crds/ as a user would. `Installation` is one Helm release of
charts/weir in a namespace of its own, which it also watches (`operator.watchNamespaces`):
the CRD, the operator's ServiceAccount, its namespaced Role and the read-only ClusterRole
with their bindings exactly as the chart renders them, and the Redis URL Secret pointing
at the test's redis-server. The namespace enforces Pod Security's `restricted` profile,
so the server refuses any engine pod that asks for more. No kubelet runs the chart's operator pod (kwok only marks it
Running), so the chart's operator Deployment is scaled to zero and the operator runs in
the test's process instead, as that ServiceAccount, through a token the API server issues
for it: every call it makes passes the chart's RBAC or fails with 403.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

from fleet_operator.spec import GROUP, PLURAL, VERSION
from tests.kube.control_plane import Cluster

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "weir"
CRD_NAME = f"{PLURAL}.{GROUP}"
POD_SECURITY = "pod-security.kubernetes.io/enforce"


@cache
def helm() -> str:
    """The helm binary that scripts/k8s_tools.py extracts (docs/testing.md, the kube tier)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "k8s_tools.py")],
        capture_output=True,
        text=True,
        check=True,
    )
    return str(Path(out.stdout.strip()) / "helm")


def run_helm(kube: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [helm(), "--kubeconfig", str(kube.kubeconfig), *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


def install_crd(kube: Cluster) -> None:
    applied = kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    assert applied.returncode == 0, applied.stderr
    established = kube.kubectl(
        "wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s"
    )
    assert established.returncode == 0, established.stderr


class Installation:
    """One release of the chart (operator only) in its own namespace."""

    def __init__(self, kube: Cluster, redis_url: str, tmp: Path) -> None:
        self.kube = kube
        self.namespace = kube.namespace("weir")
        self.release = self.namespace  # unique, so its ClusterRole is too
        labelled = kube.kubectl("label", "namespace", self.namespace,
                                f"{POD_SECURITY}=restricted")  # fmt: skip
        assert labelled.returncode == 0, labelled.stderr
        installed = run_helm(
            kube, "install", self.release, str(CHART), "--namespace", self.namespace,
            "--set", f"operator.watchNamespaces={{{self.namespace}}}",
            "--set", "router.enabled=false", "--set", "redis.enabled=false",
            "--set", f"redis.external.url={redis_url}", "--set", "dashboards.enabled=false",
            "--set", "networkPolicy.enabled=false", "--timeout", "2m",
        )  # fmt: skip
        assert installed.returncode == 0, installed.stderr
        self.service_account = f"{self.release}-operator"
        scaled = kube.kubectl(
            "scale", "deployment", self.service_account, "-n", self.namespace, "--replicas=0"
        )
        assert scaled.returncode == 0, scaled.stderr
        token = kube.kubectl(
            "create", "token", self.service_account, "-n", self.namespace, "--duration=2h"
        )
        assert token.returncode == 0, token.stderr
        self.operator_kubeconfig = kube.kubeconfig_for(
            token.stdout.strip(), tmp / "operator.kubeconfig", user=self.service_account
        )

    def pool(self, name: str, **spec: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "contextLength": 8192},
            "engine": {"image": "lmsysorg/sglang:v0.5.23", "tensorParallel": 1},
            "replicas": {"min": 1, "max": 1},
        }
        body.update(spec)
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "InferencePool",
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": body,
        }

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        """An object as the admin sees it; None when absent."""
        got = self.kube.kubectl(
            "get", kind, name, "-n", self.namespace, "-o", "json", "--show-managed-fields"
        )
        if got.returncode != 0:
            assert "NotFound" in got.stderr, got.stderr
            return None
        found: dict[str, Any] = json.loads(got.stdout)
        return found

    def pod_security(self) -> str:
        """The Pod Security level the namespace enforces."""
        got = self.kube.kubectl("get", "namespace", self.namespace, "-o", "json")
        assert got.returncode == 0, got.stderr
        level: str = json.loads(got.stdout)["metadata"]["labels"].get(POD_SECURITY, "")
        return level

    def pods(self, pool: str) -> list[dict[str, Any]]:
        got = self.kube.kubectl(
            "get", "pods", "-n", self.namespace, "-l", f"inference.weir.dev/pool={pool}",
            "-o", "json",
        )  # fmt: skip
        assert got.returncode == 0, got.stderr
        items: list[dict[str, Any]] = json.loads(got.stdout)["items"]
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]

    def condition(self, pool: str, kind: str) -> dict[str, Any]:
        obj = self.get(CRD_NAME, pool) or {}
        for item in (obj.get("status") or {}).get("conditions") or []:
            if item["type"] == kind:
                return dict(item)
        return {}
