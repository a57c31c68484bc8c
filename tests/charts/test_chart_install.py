"""The chart on a real API server: `helm install`, `helm upgrade` with a changed value and
`helm uninstall` with every values file in tests/charts/, the objects as the server stores
them; e2e/cluster/install.sh against the same cluster; and Weir's InferencePool beside the
Gateway API Inference Extension's kind of the same name."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kube.control_plane import Cluster
from tests.operator.real_cluster import CHART, helm, run_helm

pytestmark = [pytest.mark.kube, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
VALUES = sorted(Path(__file__).parent.glob("values-*.yaml"))
# Cluster-scoped kinds a release creates; everything else lives in a namespace.
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}


@pytest.fixture(scope="module")
def cluster(kube: Cluster) -> Cluster:
    """The Prometheus Operator's CRDs (real ones, for the ServiceMonitor and PodMonitor
    the production values render) and the namespaces the production values name."""
    applied = kube.kubectl("apply", "--server-side", "-f", str(kube.bin / "crds" /
                           "monitoring.coreos.com_servicemonitors.yaml"), "-f",
                           str(kube.bin / "crds" / "monitoring.coreos.com_podmonitors.yaml"))  # fmt: skip
    assert applied.returncode == 0, applied.stderr
    for name in ("inference", "batch", "monitoring"):
        made = kube.kubectl("create", "namespace", name)
        assert made.returncode == 0 or "AlreadyExists" in made.stderr, made.stderr
    return kube


def release_objects(kube: Cluster, release: str, namespace: str) -> list[tuple[str, str, str]]:
    """(kind, name, namespace) of what `helm get manifest` says the release installed
    (namespace "" when cluster-scoped), checked to exist on the server."""
    manifest = run_helm(kube, "get", "manifest", release, "-n", namespace)
    assert manifest.returncode == 0, manifest.stderr
    found = []
    for doc in yaml.safe_load_all(manifest.stdout):
        if not doc:
            continue
        kind, meta = doc["kind"], doc["metadata"]
        home = "" if kind in CLUSTER_SCOPED else meta.get("namespace", namespace)
        where = ["-n", home] if home else []
        got = kube.kubectl("get", f"{kind}.{doc['apiVersion'].split('/')[0]}"
                           if "/" in doc["apiVersion"] else kind, meta["name"], *where,
                           "-o", "name")  # fmt: skip
        assert got.returncode == 0, f"{kind} {meta['name']}: {got.stderr}"
        found.append((kind, meta["name"], home))
    return found


def prerequisites(kube: Cluster, namespace: str, values: Path) -> None:
    """Secrets a values file expects to exist already."""
    text = values.read_text()
    if "existingSecret: team-redis" in text:
        kube.kubectl("create", "secret", "generic", "team-redis", "-n", namespace,
                     "--from-literal=url=redis://redis.team:6379/0")  # fmt: skip
    if "apiKeysSecret: weir-api-keys" in text:
        kube.kubectl("create", "secret", "generic", "weir-api-keys", "-n", namespace,
                     "--from-literal=api-keys.yaml=sk-test-1: team-a")  # fmt: skip


def admin_token(kube: Cluster, release: str, namespace: str) -> str:
    """The generated sidecar admin token as the server stores it ("" when none)."""
    got = kube.kubectl("get", "secret", f"{release}-weir-sidecar-admin", "-n", namespace,
                       "-o", "jsonpath={.data.token}")  # fmt: skip
    return got.stdout if got.returncode == 0 else ""


@pytest.mark.parametrize("values", VALUES, ids=lambda p: p.stem)
def test_install_upgrade_uninstall(cluster: Cluster, values: Path) -> None:
    namespace = cluster.namespace("chart")
    release = f"w{namespace[-6:]}"
    prerequisites(cluster, namespace, values)
    installed = run_helm(cluster, "install", release, str(CHART), "-n", namespace,
                         "-f", str(values), "--timeout", "3m")  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    objects = release_objects(cluster, release, namespace)
    kinds = {kind for kind, _, _ in objects}
    assert "Deployment" in kinds or "StatefulSet" in kinds, objects
    generated = "sidecarAdminTokenSecret" not in values.read_text()
    token = admin_token(cluster, release, namespace)
    assert bool(token) == generated  # the sidecars' admin token: generated or the user's

    upgraded = run_helm(cluster, "upgrade", release, str(CHART), "-n", namespace,
                        "-f", str(values), "--set", "operator.statusIntervalSeconds=7",
                        "--timeout", "3m")  # fmt: skip
    assert upgraded.returncode == 0, upgraded.stderr
    operator = cluster.kubectl("get", "deployment", f"{release}-weir-operator", "-n", namespace,
                               "-o", "json")  # fmt: skip
    if operator.returncode == 0:  # the operator is on in every values file but none say off
        env = json.loads(operator.stdout)["spec"]["template"]["spec"]["containers"][0]["env"]
        assert {"name": "WEIR_STATUS_INTERVAL_S", "value": "7"} in env
    revision = json.loads(run_helm(cluster, "status", release, "-n", namespace,
                                   "-o", "json").stdout)["version"]  # fmt: skip
    assert revision == 2
    assert admin_token(cluster, release, namespace) == token  # kept on upgrade

    uninstalled = run_helm(cluster, "uninstall", release, "-n", namespace, "--wait",
                           "--timeout", "2m")  # fmt: skip
    assert uninstalled.returncode == 0, uninstalled.stderr
    for kind, name, home in objects:
        if kind == "CustomResourceDefinition":
            continue  # helm keeps CRDs on uninstall, by design
        where = ["-n", home] if home else []
        left = cluster.kubectl("get", kind, name, *where, "-o", "name")
        assert "NotFound" in left.stderr, f"{kind} {name} survived the uninstall"


def test_the_charts_test_pod_is_valid_on_the_server(cluster: Cluster) -> None:
    """`helm test` needs a kubelet to run its pod; here the pod is checked by the server
    (a dry run), and the e2e script runs `helm test` on a cluster with nodes."""
    values = ["--set", "router.pools[0].name=llama", "--set", "router.pools[0].model=m"]
    rendered = subprocess.run(
        [helm(), "template", "weir", str(CHART), "--show-only",
         "templates/tests/test-router.yaml", *values],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    checked = cluster.kubectl("apply", "--dry-run=server", "-n", "default", "-f", "-",
                              stdin=rendered.stdout)  # fmt: skip
    assert checked.returncode == 0, checked.stderr


def test_the_e2e_install_script_passes_against_this_cluster(
    cluster: Cluster, redis_url: str, tmp_path: Path
) -> None:
    """e2e/cluster/install.sh as CI runs it: the chart, a pool, its status from the control
    plane, cleanup. No kubelet runs the operator's pod here, so the script runs
    `weir operator` itself as the chart's ServiceAccount (WEIR_OPERATOR=local)."""
    env = {
        **os.environ,
        "KUBECONFIG": str(cluster.kubeconfig),
        "KUBECTL": str(cluster.bin / "kubectl"),
        "WEIR_OPERATOR": "local",
        "WEIR_REDIS_URL": redis_url,
        "WEIR_NAMESPACE": cluster.namespace("e2e")[: -len("-xxxxxx")] + "-script",
        "PYTHON": str(ROOT / ".venv" / "bin" / "python"),
    }
    ran = subprocess.run(
        ["bash", str(ROOT / "e2e" / "cluster" / "install.sh")],
        env=env, capture_output=True, text=True, check=False, timeout=280,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-4000:]
    assert "PASSED" in ran.stdout


def test_beside_the_gateway_api_inference_extension(cluster: Cluster) -> None:
    """Two kinds named InferencePool on one cluster: Weir's are reached by their short
    names and category without ambiguity; the bare plural names the other group's, which
    the docs tell users."""
    gie = cluster.bin / "crds" / "gie-inferencepools.yaml"
    applied = cluster.kubectl("apply", "--server-side", "-f", str(gie), "-f", str(ROOT / "crds"))
    assert applied.returncode == 0, applied.stderr
    for crd in ("inferencepools.inference.networking.k8s.io", "inferencepools.inference.weir.dev"):
        ready = cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}",
                                "--timeout=60s")  # fmt: skip
        assert ready.returncode == 0, ready.stderr
    namespace = cluster.namespace("both")
    weir_pool = {
        "apiVersion": "inference.weir.dev/v1alpha1",
        "kind": "InferencePool",
        "metadata": {"name": "weir-pool"},
        "spec": {"model": {"name": "m"}},
    }
    gie_pool = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "gateway-pool"},
        "spec": {
            "selector": {"matchLabels": {"app": "vllm"}},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
        },
    }
    for pool in (weir_pool, gie_pool):
        created = cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(pool))
        assert created.returncode == 0, created.stderr

    def names(resource: str) -> set[str]:
        got = cluster.kubectl("get", resource, "-n", namespace, "-o", "json")
        assert got.returncode == 0, got.stderr
        items: list[dict[str, Any]] = json.loads(got.stdout)["items"]
        return {item["metadata"]["name"] for item in items}

    for resource in ("weirpool", "wpool", "ipool", "inferencepools.inference.weir.dev",
                     "weir"):  # fmt: skip
        assert names(resource) == {"weir-pool"}, resource
    assert names("inferencepools.inference.networking.k8s.io") == {"gateway-pool"}
    assert names("infpool") == {"gateway-pool"}
    # kubectl resolves the bare plural to the Gateway API's group (what the docs say).
    assert names("inferencepools") == {"gateway-pool"}
