"""The InferencePool CRD on a real API server: it installs, every example applies, the
server fills the contract's defaults, and every invalid pool is refused with the message a
user reads. The server decides, not a translation of its rules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from controlplane.contract import PoolPolicy
from fleet_operator.spec import GROUP, InvalidPoolError, parse_pool
from tests.kube.control_plane import Cluster
from tests.operator.real_cluster import CRD_NAME, install_crd

pytestmark = pytest.mark.kube

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module")
def crd(kube: Cluster) -> Cluster:
    install_crd(kube)
    return kube


def pool(name: str = "p", **spec: Any) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": f"{GROUP}/v1alpha1",
            "kind": "InferencePool",
            "metadata": {"name": name},
            "spec": {"model": {"name": "m"}, **spec},
        }
    )


def stored_spec(kube: Cluster, namespace: str, name: str) -> dict[str, Any]:
    got = kube.kubectl("get", CRD_NAME, name, "-n", namespace,
                       "-o", "json")  # fmt: skip
    assert got.returncode == 0, got.stderr
    spec: dict[str, Any] = json.loads(got.stdout)["spec"]
    return spec


def test_the_crd_installs_and_is_established(crd: Cluster) -> None:
    got = crd.kubectl("get", "crd", CRD_NAME, "-o", "json")
    assert got.returncode == 0, got.stderr
    conditions = {c["type"]: c["status"] for c in json.loads(got.stdout)["status"]["conditions"]}
    assert conditions["Established"] == "True"
    assert conditions["NamesAccepted"] == "True"


def test_every_example_applies_and_parses(crd: Cluster) -> None:
    namespace = crd.namespace("examples")
    applied = crd.kubectl("apply", "-n", namespace, "-f", str(EXAMPLES))
    assert applied.returncode == 0, applied.stderr
    names = [
        doc["metadata"]["name"]
        for path in sorted(EXAMPLES.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
    ]
    assert len(names) >= 3
    for name in names:
        parsed = parse_pool(name, namespace, stored_spec(crd, namespace, name))
        assert parsed.policy.pool == name


def test_a_minimal_pool_gets_the_contracts_defaults(crd: Cluster) -> None:
    """What the server stores for `{model: {name: m}}` is exactly the contract's default
    policy: the CRD's defaults and PoolPolicy's cannot drift apart."""
    namespace = crd.namespace("defaults")
    created = crd.kubectl("apply", "-n", namespace, "-f", "-", stdin=pool("minimal"))
    assert created.returncode == 0, created.stderr
    spec = stored_spec(crd, namespace, "minimal")
    assert spec["replicas"] == {"min": 1, "max": 1}
    parsed = parse_pool("minimal", namespace, spec)
    assert parsed.policy == PoolPolicy(
        pool="minimal", model="m", context_length=spec["model"]["contextLength"]
    )


INVALID = [
    ("min-over-max", pool(replicas={"min": 3, "max": 2}),
     "replicas.min must not exceed replicas.max"),
    ("min-over-default-max", pool(replicas={"min": 3}),
     "replicas.min must not exceed replicas.max"),
    ("watermark-order", pool(kv={"lowWatermark": 0.9, "highWatermark": 0.8}),
     "lowWatermark < highWatermark < emergencyWatermark"),
    ("high-over-default-emergency", pool(kv={"highWatermark": 0.96}),
     "lowWatermark < highWatermark < emergencyWatermark"),
    ("watermark-out-of-range", pool(kv={"lowWatermark": 1.5}), "spec.kv.lowWatermark"),
    ("unknown-field", pool(engine={"imag": "typo"}), 'unknown field "spec.engine.imag"'),
    ("bad-enum", pool(role="both"), 'spec.role: Unsupported value: "both"'),
    ("bad-preemption-mode", pool(scheduling={"preemptionModes": ["evict"]}),
     "spec.scheduling.preemptionModes[0]: Unsupported value"),
    ("missing-model", yaml.safe_dump({"apiVersion": f"{GROUP}/v1alpha1",
                                      "kind": "InferencePool", "metadata": {"name": "p"},
                                      "spec": {}}),
     "spec.model: Required value"),
    ("wrong-type", pool(engine={"tensorParallel": "two"}), "spec.engine.tensorParallel"),
    ("prefill-without-decode-pool", pool(role="prefill"),
     "a prefill pool must name its decode pool"),
    ("decode-pool-on-a-mixed-pool", pool(decodePool="d"), "only a prefill pool names a decode pool"),
    ("leading-digit", pool("7b-pool"), "must be a DNS-1035 label"),
    ("uppercase", pool("Llama"), "metadata.name"),
    ("too-long", pool("p" * 64), "must be a DNS-1035 label"),
    ("bad-tenant-name", pool(tenants=[{"name": "bad name"}]), "spec.tenants[0].name"),
    ("zero-tenant-weight", pool(tenants=[{"name": "t", "weight": 0}]), "spec.tenants[0].weight"),
    ("bad-quantity", pool(engine={"resources": {"limits": {"cpu": "lots"}}}),
     "spec.engine.resources.limits.cpu"),
    ("unknown-resources-key", pool(sidecar={"resources": {"limit": {"cpu": "1"}}}),
     'unknown field "spec.sidecar.resources.limit"'),
    ("bad-env-name", pool(engine={"env": [{"name": "1 BAD", "value": "x"}]}),
     "spec.engine.env[0].name"),
    ("negative-engine-user", pool(engine={"runAsUser": -1}), "spec.engine.runAsUser"),
    ("capability-with-prefix", pool(engine={"addCapabilities": ["CAP_IPC_LOCK"]}),
     "a capability name without CAP_, and not ALL"),
    ("every-capability", pool(engine={"addCapabilities": ["ALL"]}),
     "a capability name without CAP_, and not ALL"),
    ("lowercase-capability", pool(engine={"addCapabilities": ["ipc_lock"]}),
     "spec.engine.addCapabilities[0]"),
    ("fake-transfer-backend", pool(engine={"transferBackend": "fake"}),
     'spec.engine.transferBackend: Unsupported value: "fake"'),
    ("bootstrap-on-the-engine-port", pool(engine={"bootstrapPort": 30000}),
     "engine.bootstrapPort must differ from engine.port"),
]  # fmt: skip


@pytest.mark.parametrize(("manifest", "message"), [(m, msg) for _, m, msg in INVALID],
                         ids=[case for case, _, _ in INVALID])  # fmt: skip
def test_the_server_refuses_invalid_pools_with_a_readable_message(
    crd: Cluster, manifest: str, message: str
) -> None:
    refused = crd.kubectl("apply", "--dry-run=server", "-n", "default", "-f", "-", stdin=manifest)
    assert refused.returncode != 0, f"accepted:\n{manifest}"
    assert message in refused.stderr, refused.stderr


@pytest.mark.parametrize(("manifest", "message"), [
    (pool(replicas={"min": 3, "max": 2}), "min <= max"),
    (pool(kv={"lowWatermark": 0.9, "highWatermark": 0.8}), "watermark"),
    (pool(role="prefill"), "decode pool"),
    (pool(decodePool="d"), "only a prefill pool"),
    (pool("7b-pool"), "DNS-1035 label"),
    (pool(engine={"resources": {"limits": {"cpu": "lots"}}}), "quantity"),
    (pool(engine={"runAsUser": -1}), "runAsUser"),
    (pool(engine={"addCapabilities": ["CAP_IPC_LOCK"]}), "without CAP_"),
    (pool(engine={"addCapabilities": ["ALL"]}), "addCapabilities"),
])  # fmt: skip
def test_the_operator_checks_again_what_the_server_refuses(manifest: str, message: str) -> None:
    """An old CRD or a `--validate=false` edit must not get past the operator either."""
    doc = yaml.safe_load(manifest)
    with pytest.raises(InvalidPoolError, match=message):
        parse_pool(doc["metadata"]["name"], "default", doc["spec"])
