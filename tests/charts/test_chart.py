"""The Helm chart, rendered by the real `helm` binary: lint, template with several values
files, and check what comes out (schemas, CRD copy, RBAC, dashboards, values schema)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import pytest
import yaml
from kubernetes_asyncio import client

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "weir"
# The shipped production overlay, and the test values files (one mirrors that overlay).
PRODUCTION = CHART / "values-production.yaml"
VALUES = [*sorted(Path(__file__).parent.glob("values-*.yaml")), PRODUCTION]


def values_id(path: Path) -> str:
    return f"chart-{path.stem}" if path.parent == CHART else path.stem


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


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm(), *args], capture_output=True, text=True, check=False)


@cache
def rendered(values: Path) -> list[dict[str, Any]]:
    out = run_helm("template", "weir", str(CHART), "--namespace", "weir", "-f", str(values),
                   "--include-crds")  # fmt: skip
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def kinds(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        found.setdefault(doc["kind"], []).append(doc)
    return found


MODELS = {
    "Deployment": client.V1Deployment,
    "StatefulSet": client.V1StatefulSet,
    "Service": client.V1Service,
    "ServiceAccount": client.V1ServiceAccount,
    "Secret": client.V1Secret,
    "ConfigMap": client.V1ConfigMap,
    "ClusterRole": client.V1ClusterRole,
    "ClusterRoleBinding": client.V1ClusterRoleBinding,
    "Role": client.V1Role,
    "RoleBinding": client.V1RoleBinding,
    "NetworkPolicy": client.V1NetworkPolicy,
    "HorizontalPodAutoscaler": client.V2HorizontalPodAutoscaler,
    "Pod": client.V1Pod,
    "CustomResourceDefinition": client.V1CustomResourceDefinition,
}


class _Response:
    def __init__(self, doc: dict[str, Any]) -> None:
        self.data = json.dumps(doc)


@pytest.mark.parametrize("values", VALUES, ids=values_id)
def test_helm_lint(values: Path) -> None:
    out = run_helm("lint", "--strict", str(CHART), "-f", str(values))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("values", VALUES, ids=values_id)
async def test_rendered_manifests_match_the_api_models(values: Path) -> None:
    """Each manifest deserializes into the official client model and serializes back to
    itself: a misspelt or misplaced field would be dropped and show up as a difference."""
    api = client.ApiClient()
    try:
        for doc in rendered(values):
            model = MODELS.get(doc["kind"])
            where = f"{doc['kind']}/{doc['metadata']['name']}"
            assert doc["metadata"]["name"], where
            if model is None:
                assert doc["kind"] in {"ServiceMonitor", "PodMonitor"}, where
                assert doc["apiVersion"] == "monitoring.coreos.com/v1", where
                continue
            roundtrip = api.sanitize_for_serialization(
                api.deserialize(cast(Any, _Response(doc)), model)
            )
            assert roundtrip == doc, where
    finally:
        await api.close()


def test_chart_crd_is_identical_to_crds_folder() -> None:
    for source in (ROOT / "crds").glob("*.yaml"):
        assert (CHART / "crds" / source.name).read_bytes() == source.read_bytes(), source.name
    assert {p.name for p in (CHART / "crds").glob("*")} == {
        p.name for p in (ROOT / "crds").glob("*")
    }


def test_default_install_has_every_part() -> None:
    found = kinds(rendered(Path(__file__).parent / "values-default.yaml"))
    names = {d["metadata"]["name"] for docs in found.values() for d in docs}
    assert {"weir-operator", "weir-redis"} <= names
    assert {
        "StatefulSet",
        "NetworkPolicy",
        "ClusterRole",
        "CustomResourceDefinition",
    } <= found.keys()
    assert "Pod" not in found  # no pool listed: no router to test
    redis = found["StatefulSet"][0]["spec"]["template"]["spec"]
    (container,) = redis["containers"]
    assert container["args"][0] == "/etc/redis/redis.conf"  # its password is in there
    secret = next(s for s in found["Secret"] if s["metadata"]["name"] == "weir-redis")
    assert {"url", "password", "redis.conf"} <= secret["data"].keys()
    password = base64.b64decode(secret["data"]["password"]).decode()
    conf = base64.b64decode(secret["data"]["redis.conf"]).decode()
    assert conf == f'requirepass "{password}"\n'
    (config,) = [v for v in redis["volumes"] if v["name"] == "config"]
    assert config["secret"]["secretName"] == "weir-redis"
    assert {"name": "config", "mountPath": "/etc/redis", "readOnly": True} in container[
        "volumeMounts"
    ]
    auth = next(e for e in container["env"] if e["name"] == "REDISCLI_AUTH")
    assert auth["valueFrom"]["secretKeyRef"] == {"name": "weir-redis", "key": "password"}


def _secret_values(docs: list[dict[str, Any]]) -> set[str]:
    """Every value the rendered Secrets hold, and the password inside each URL."""
    found = set()
    for doc in docs:
        if doc["kind"] == "Secret":
            for value in doc.get("data", {}).values():
                text = base64.b64decode(value).decode()
                found.add(text)
                if "://" in text and (password := urlsplit(text).password):
                    found.add(password)
    return found


def _pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for doc in docs:
        if doc["kind"] == "Pod":
            yield doc["metadata"]["name"], doc["spec"]
        elif doc["kind"] in ("Deployment", "StatefulSet"):
            yield doc["metadata"]["name"], doc["spec"]["template"]["spec"]


def _words(container: dict[str, Any]) -> list[str]:
    """What can become a process's command line: command, args, and exec probes/hooks."""
    words = [*container.get("command", []), *container.get("args", [])]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        words += container.get(probe, {}).get("exec", {}).get("command", [])
    for hook in ("postStart", "preStop"):
        words += container.get("lifecycle", {}).get(hook, {}).get("exec", {}).get("command", [])
    return [str(w) for w in words]


@pytest.mark.parametrize("values", VALUES, ids=values_id)
def test_no_secret_is_on_a_command_line(values: Path) -> None:
    """Secrets reach processes through files and the environment: no command line,
    probe or hook holds one, or expands a variable that holds one (`$(VAR)` in args,
    `$VAR` in a shell), since process listings show command lines."""
    docs = rendered(values)
    secrets = _secret_values(docs)
    assert secrets or "operator-only" in values.stem
    for name, spec in _pod_specs(docs):
        for container in spec.get("initContainers", []) + spec["containers"]:
            from_secrets = {
                e["name"]
                for e in container.get("env", [])
                if "secretKeyRef" in e.get("valueFrom", {})
            }
            for word in _words(container):
                assert not any(secret in word for secret in secrets), (name, word)
                for var in from_secrets:
                    for reference in (f"$({var})", f"${var}", f"${{{var}}}"):
                        assert reference not in word, (name, word)
            words = _words(container)
            assert not {"--redis-url", "--requirepass", "-a"} & set(words), (name, words)


def test_the_sidecars_admin_token_is_a_generated_secret_the_operator_mounts() -> None:
    found = kinds(rendered(Path(__file__).parent / "values-default.yaml"))
    admin = next(s for s in found["Secret"] if s["metadata"]["name"] == "weir-sidecar-admin")
    assert len(base64.b64decode(admin["data"]["token"])) == 48
    operator = found["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in operator["env"]}
    assert (env["WEIR_ADMIN_SECRET"], env["WEIR_ADMIN_SECRET_KEY"]) == (
        "weir-sidecar-admin",
        "token",
    )
    # Pools in other namespaces get a copy, as they get the Redis URL's.
    production = kinds(rendered(Path(__file__).parent / "values-production.yaml"))
    copies = [s for s in production["Secret"] if s["metadata"]["name"] == "weir-sidecar-admin"]
    assert {s["metadata"]["namespace"] for s in copies} == {"weir", "inference", "batch"}
    assert len({s["data"]["token"] for s in copies}) == 1


# What the operator calls in the namespaces it watches (grep operator/ and kopf's client):
# server-side apply is get + patch (+ create when the child is new), kopf lists, watches
# and patches pools and posts core events, a drain lists and patches pods.
NAMESPACED_RULES = {
    ("inference.weir.dev", "inferencepools"): {"list", "watch", "patch"},
    ("inference.weir.dev", "inferencepools/status"): {"patch"},
    ("inference.weir.dev", "inferencepools/finalizers"): {"update"},
    ("apps", "deployments"): {"get", "create", "patch"},
    ("", "services"): {"get", "create", "patch"},
    ("", "configmaps"): {"get", "create", "patch"},
    ("", "serviceaccounts"): {"get", "create", "patch"},
    ("policy", "poddisruptionbudgets"): {"get", "create", "patch"},
    ("monitoring.coreos.com", "servicemonitors"): {"get", "create", "patch"},
    ("", "pods"): {"list", "patch"},
    ("", "events"): {"create"},
}
# Cluster-scoped reads: kopf's CRD observer, the operator's look at the ServiceMonitor CRD.
CLUSTER_READS = {("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"}}
READ_VERBS = {"get", "list", "watch"}


def rules_of(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    found: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                found.setdefault((group, resource), set()).update(rule["verbs"])
    return found


def test_operator_rbac_is_least_privilege() -> None:
    for values in VALUES:
        for doc in rendered(values):
            if doc["kind"] not in ("ClusterRole", "Role"):
                continue
            for rule in doc["rules"]:
                assert "*" not in rule["verbs"], rule
                assert "*" not in rule["resources"], rule
                assert "secrets" not in rule["resources"], rule
                assert "delete" not in rule["verbs"], rule


def test_watching_every_namespace_takes_one_cluster_role_of_exactly_what_is_called() -> None:
    found = kinds(rendered(Path(__file__).parent / "values-default.yaml"))
    (role,) = found["ClusterRole"]
    assert rules_of(role) == NAMESPACED_RULES | CLUSTER_READS
    assert not {"Role", "RoleBinding"} & found.keys()
    (binding,) = found["ClusterRoleBinding"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "weir-operator", "namespace": "weir"}
    ]


def test_listed_namespaces_get_roles_and_the_cluster_role_only_reads() -> None:
    """operator.watchNamespaces: the write rights are Roles in those namespaces; cluster-
    wide the operator can patch nothing (no ConfigMap in kube-system, no Deployment
    anywhere else)."""
    found = kinds(rendered(Path(__file__).parent / "values-production.yaml"))
    (cluster,) = found["ClusterRole"]
    assert rules_of(cluster) == CLUSTER_READS | {("", "namespaces"): {"list", "watch"}}
    for verbs in rules_of(cluster).values():
        assert verbs <= READ_VERBS
    roles = {r["metadata"]["namespace"]: r for r in found["Role"]}
    assert roles.keys() == {"inference", "batch"}  # operator.watchNamespaces
    for role in roles.values():
        assert role["metadata"]["name"] == "weir-operator"
        assert rules_of(role) == NAMESPACED_RULES
    bindings = {b["metadata"]["namespace"]: b for b in found["RoleBinding"]}
    assert bindings.keys() == roles.keys()
    for namespace, binding in bindings.items():
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "weir-operator",
        }, namespace
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "weir-operator", "namespace": "weir"}
        ]
    operator = next(d for d in found["Deployment"] if d["metadata"]["name"] == "weir-operator")
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--namespace"] == ["inference", "batch"]


def network_policies(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """(namespace, name) -> spec; the release namespace is `weir`."""
    return {
        (d["metadata"].get("namespace", "weir"), d["metadata"]["name"]): d["spec"]
        for d in docs
        if d["kind"] == "NetworkPolicy"
    }


def _labels(component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "weir",
        "app.kubernetes.io/instance": "weir",
        "app.kubernetes.io/component": component,
    }


ENGINES = {"app.kubernetes.io/managed-by": "weir-operator", "app.kubernetes.io/component": "engine"}
ROUTERS_OF_THE_RELEASE = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "weir"}},
    "podSelector": {"matchLabels": _labels("router")},
}
TO_REDIS = {
    "to": [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "weir"}},
            "podSelector": {"matchLabels": _labels("redis")},
        }
    ],
    "ports": [{"port": 6379, "protocol": "TCP"}],
}
PEERS = {"podSelector": {"matchLabels": ENGINES}}  # the engine pods of the same namespace
TO_DNS = {
    "to": [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
        }
    ],
    "ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}],
}


def test_the_policies_select_the_pods_the_operator_renders() -> None:
    from fleet_operator.rendering import labels
    from fleet_operator.spec import parse_pool

    pod_labels = labels(parse_pool("p", "weir", {"model": {"name": "m"}}))
    assert ENGINES.items() <= pod_labels.items()
    # And no pod of the chart's own carries them.
    for doc in rendered(Path(__file__).parent / "values-production.yaml"):
        if doc["kind"] in ("Deployment", "StatefulSet"):
            template = doc["spec"]["template"]["metadata"]["labels"]
            assert not ENGINES.items() <= template.items(), doc["metadata"]["name"]


def test_by_default_the_policies_restrict_ingress_only() -> None:
    found = network_policies(rendered(Path(__file__).parent / "values-default.yaml"))
    assert set(found) == {
        ("weir", "weir-redis"),
        ("weir", "weir-operator"),
        ("weir", "weir-router"),
        ("weir", "weir-engines"),
    }
    for spec in found.values():
        assert spec["policyTypes"] == ["Ingress"]
        assert "egress" not in spec
    engines = found["weir", "weir-engines"]
    assert engines["podSelector"] == {"matchLabels": ENGINES}
    assert engines["ingress"] == [
        {
            "from": [
                ROUTERS_OF_THE_RELEASE,
                {
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}
                    }
                },
                PEERS,  # relief's reservations, sidecar to sidecar
            ]
        }
    ]
    # Redis: the operator, the routers and engines in any namespace (all are watched).
    (redis_rule,) = found["weir", "weir-redis"]["ingress"]
    assert redis_rule["from"] == [
        {"podSelector": {"matchLabels": _labels("operator")}},
        {"podSelector": {"matchLabels": _labels("router")}},
        {"namespaceSelector": {}, "podSelector": {"matchLabels": ENGINES}},
    ]
    assert redis_rule["ports"] == [{"port": 6379, "protocol": "TCP"}]
    assert found["weir", "weir-operator"]["ingress"] == []


def test_production_policies_restrict_egress_to_redis_dns_and_the_engines() -> None:
    """Engine pods in every namespace where pools run: in from the release's routers,
    monitoring and their peers, out to their peers, Redis, DNS and the one rule the values
    add. Routers: out to engines,
    Redis and DNS. Redis: out to nothing."""
    found = network_policies(rendered(Path(__file__).parent / "values-production.yaml"))
    pool_namespaces = ["weir", "inference", "batch"]
    where = {
        "namespaceSelector": {
            "matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "In", "values": pool_namespaces}
            ]
        },
        "podSelector": {"matchLabels": ENGINES},
    }
    hub = {
        "to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["10.0.0.0/8"]}}],
        "ports": [{"port": 443, "protocol": "TCP"}],
    }
    for namespace in pool_namespaces:
        engines = found[namespace, "weir-engines"]
        assert engines["policyTypes"] == ["Ingress", "Egress"]
        assert engines["podSelector"] == {"matchLabels": ENGINES}
        assert engines["ingress"][0]["from"][0] == ROUTERS_OF_THE_RELEASE
        assert engines["ingress"][0]["from"][-1] == PEERS
        assert engines["egress"] == [{"to": [PEERS]}, TO_REDIS, TO_DNS, hub]
    router = found["weir", "weir-router"]
    assert router["policyTypes"] == ["Ingress", "Egress"]
    assert router["egress"] == [{"to": [where]}, TO_REDIS, TO_DNS]
    redis = found["weir", "weir-redis"]
    assert (redis["policyTypes"], redis["egress"]) == (["Ingress", "Egress"], [])
    assert redis["ingress"][0]["from"][2] == where
    # No egress rule anywhere is open to every destination.
    for key, spec in found.items():
        for rule in spec.get("egress", []):
            assert rule.get("to"), key


def test_restricted_egress_to_an_external_redis_needs_its_rules() -> None:
    settings = ["--set", "redis.enabled=false", "--set", "redis.external.url=redis://r:6379/0",
                "--set", "networkPolicy.egress.enabled=true"]  # fmt: skip
    refused = run_helm("template", "weir", str(CHART), *settings)
    assert refused.returncode != 0
    assert "needs networkPolicy.egress.externalRedis" in refused.stderr
    rule = {
        "to": [{"ipBlock": {"cidr": "10.0.0.5/32"}}],
        "ports": [{"port": 6379, "protocol": "TCP"}],
    }
    given = run_helm("template", "weir", str(CHART), "--namespace", "weir", *settings,
                     "--set-json", f"networkPolicy.egress.externalRedis=[{json.dumps(rule)}]")  # fmt: skip
    assert given.returncode == 0, given.stderr
    found = network_policies([d for d in yaml.safe_load_all(given.stdout) if d])
    assert ("weir", "weir-redis") not in found
    assert found["weir", "weir-engines"]["egress"] == [{"to": [PEERS]}, rule, TO_DNS]
    assert found["weir", "weir-router"]["egress"][1:] == [rule, TO_DNS]


def _leaves(values: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(values, dict):
        for key, value in values.items():
            yield from _leaves(value, f"{path}.{key}" if path else key)
    else:
        yield path, values


def test_the_production_test_values_mirror_the_shipped_overlay() -> None:
    """tests/charts/values-production.yaml is what the install tests run: it holds every
    setting of charts/weir/values-production.yaml, save the lists a user fills in."""
    shipped = yaml.safe_load(PRODUCTION.read_text())
    tested = yaml.safe_load((Path(__file__).parent / "values-production.yaml").read_text())
    checked = 0
    for path, value in _leaves(shipped):
        if value == []:
            continue  # operator.watchNamespaces, networkPolicy.egress.engines: the user's
        here: Any = tested
        for part in path.split("."):
            here = here[part]
        assert here == value, path
        checked += 1
    assert checked == 5  # quotas, API keys, both policies' toggles, the engine user


def test_the_shipped_production_values_turn_on_quotas_keys_and_policies() -> None:
    out = run_helm("template", "weir", str(CHART), "--namespace", "weir", "-f", str(PRODUCTION),
                   "--set", "router.pools[0].name=llama", "--set", "router.pools[0].model=m")  # fmt: skip
    assert out.returncode == 0, out.stderr
    found = kinds([d for d in yaml.safe_load_all(out.stdout) if d])
    router = next(d for d in found["Deployment"] if d["metadata"]["name"] == "weir-router-llama")
    pod = router["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert "--quotas" in args
    assert args[args.index("--api-keys") + 1] == "/etc/weir/api-keys/api-keys.yaml"
    keys = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    assert keys["secret"] == {"secretName": "weir-api-keys"}
    policies = network_policies(found["NetworkPolicy"])
    for name in ("weir-engines", "weir-router", "weir-redis"):
        assert "Egress" in policies["weir", name]["policyTypes"], name
    operator = next(d for d in found["Deployment"] if d["metadata"]["name"] == "weir-operator")
    env = {
        e["name"]: e.get("value")
        for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["WEIR_ENGINE_RUN_AS_USER"] == "10001"


def test_external_redis_and_existing_secret() -> None:
    external = kinds(rendered(Path(__file__).parent / "values-external-redis.yaml"))
    assert "StatefulSet" not in external
    (router,) = external["Deployment"][1:]
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--prefill-for") + 1] == "deepseek-decode"
    assert "NetworkPolicy" not in external
    secret = next(s for s in external["Secret"] if s["metadata"]["name"] == "weir-redis")
    assert "password" not in secret["data"]
    only = kinds(rendered(Path(__file__).parent / "values-operator-only.yaml"))
    assert "Secret" not in only  # the user's Secrets are referenced, not created
    env = only["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["env"]
    url = next(e for e in env if e["name"] == "WEIR_REDIS_URL")
    assert url["valueFrom"]["secretKeyRef"]["name"] == "team-redis"
    admin = next(e for e in env if e["name"] == "WEIR_ADMIN_SECRET")
    assert admin["value"] == "team-sidecar-admin"


def test_production_values_reach_the_manifests() -> None:
    found = kinds(rendered(Path(__file__).parent / "values-production.yaml"))
    secrets = {s["metadata"]["namespace"] for s in found["Secret"]}
    assert secrets == {"weir", "inference", "batch"}
    assert {"ServiceMonitor", "PodMonitor"} <= found.keys()
    routers = {d["metadata"]["name"]: d for d in found["Deployment"]}
    args = routers["weir-router-qwen-72b"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--pool") + 1] == "qwen-72b"
    assert args[args.index("--model") + 1] == "qwen2.5-72b"
    assert args[args.index("--context-length") + 1] == "65536"
    assert "--quotas" in args
    assert args[args.index("--api-keys") + 1] == "/etc/weir/api-keys/api-keys.yaml"
    assert {h["metadata"]["name"] for h in found["HorizontalPodAutoscaler"]} == {
        "weir-router-llama-8b",
        "weir-router-qwen-72b",
    }
    (test_pod,) = found["Pod"]
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = test_pod["spec"]["containers"][0]["command"][-1]
    assert "http://weir-router-llama-8b:80/health" in script
    statefulset = found["StatefulSet"][0]
    assert statefulset["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == "fast-ssd"
    dashboards = [c for c in found["ConfigMap"] if "grafana_dashboard" in c["metadata"]["labels"]]
    assert {c["metadata"]["namespace"] for c in dashboards} == {"monitoring"}


def test_dashboards_ship_as_labelled_configmaps() -> None:
    found = kinds(rendered(Path(__file__).parent / "values-default.yaml"))
    shipped = {}
    for cm in found["ConfigMap"]:
        if cm["metadata"]["labels"].get("grafana_dashboard") == "1":
            ((key, text),) = cm["data"].items()
            shipped[key] = json.loads(text)
    files = {p.name: json.loads(p.read_text()) for p in (CHART / "dashboards").glob("*.json")}
    assert shipped == files
    assert len(files) == 3


@pytest.mark.parametrize("setting", [
    "router.replicas=0",
    "redis.external.url=http://not-redis",
    "image.pullPolicy=Sometimes",
    "operator.statusIntervalSeconds=0",
    "no.such.value=1",
])  # fmt: skip
def test_values_schema_rejects_bad_values(setting: str) -> None:
    out = run_helm("template", "weir", str(CHART), "--set", setting)
    assert out.returncode != 0
    assert (
        "values don't meet the specifications of the schema" in out.stderr or "at '/" in out.stderr
    )


def test_external_redis_needs_a_url() -> None:
    out = run_helm("template", "weir", str(CHART), "--set", "redis.enabled=false")
    assert out.returncode != 0
    assert "redis.external.url or redis.external.existingSecret is required" in out.stderr


@pytest.mark.parametrize("values", VALUES, ids=values_id)
def test_notes_render_with_next_steps(values: Path) -> None:
    out = run_helm("install", "weir", str(CHART), "--dry-run=client", "--namespace", "weir",
                   "-f", str(values))  # fmt: skip
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:", 1)[1]
    assert "helm test weir" in notes
    assert "docs/runbook.md" in notes
    for pool in yaml.safe_load(values.read_text()).get("router", {}).get("pools", []):
        assert f"svc/weir-router-{pool['name']}" in notes


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://:pw@sentinel-0.redis:26379,sentinel-1.redis:26379/weir",
        "rediss+cluster://:pw@redis-0.redis:6379,redis-1.redis:6379",
    ],
)
def test_an_external_sentinel_managed_or_cluster_redis_is_taken_by_url(url: str) -> None:
    out = run_helm("template", "weir", str(CHART), "--set", "redis.enabled=false",
                   "--set", "redis.external.url=" + url.replace(",", "\\,"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    found = kinds([doc for doc in yaml.safe_load_all(out.stdout) if doc])
    assert "StatefulSet" not in found
    secret = next(s for s in found["Secret"] if s["metadata"]["name"] == "weir-redis")
    assert base64.b64decode(secret["data"]["url"]).decode() == url


def test_decision_logs_and_tracing_reach_routers_and_the_operator() -> None:
    out = run_helm("template", "weir", str(CHART), "--set", "router.pools[0].name=chat",
                   "--set", "router.pools[0].model=m", "--set", "router.logDecisions=true",
                   "--set", "tracing.otlpEndpoint=http://collector.monitoring:4318")  # fmt: skip
    assert out.returncode == 0, out.stderr
    found = kinds([doc for doc in yaml.safe_load_all(out.stdout) if doc])
    deployments = {d["metadata"]["name"]: d for d in found["Deployment"]}
    router = deployments["weir-router-chat"]["spec"]["template"]["spec"]["containers"][0]
    assert "--log-decisions" in router["args"]
    token = router["args"][router["args"].index("--admin-token-file") + 1]
    assert token == "/etc/weir/admin/token"
    volumes = deployments["weir-router-chat"]["spec"]["template"]["spec"]["volumes"]
    (admin,) = [v for v in volumes if v["name"] == "admin-token"]
    assert admin["secret"]["secretName"] == "weir-sidecar-admin"
    env = {e["name"]: e.get("value") for e in router["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector.monitoring:4318"
    operator = deployments["weir-operator"]["spec"]["template"]["spec"]["containers"][0]
    operator_env = {e["name"]: e.get("value") for e in operator["env"]}
    assert operator_env["WEIR_OTLP_ENDPOINT"] == "http://collector.monitoring:4318"
