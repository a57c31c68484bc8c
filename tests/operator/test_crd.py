"""The InferencePool CRD: a structural schema, defaults that agree with the contract, CEL
rules that say what they mean, and sample pools that validate."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import msgspec
import pytest
import yaml

from controlplane.contract import (
    AutoscalingPolicy,
    KVPolicy,
    RoutingPolicy,
    SchedulingPolicy,
    TenantQuota,
)
from fleet_operator.spec import InvalidPoolError, parse_pool, snake_case

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "inferencepool.yaml").read_text())
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]
SPEC = SCHEMA["properties"]["spec"]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
# OpenAPI 3.0 schemas (boolean exclusiveMinimum) are Draft 4 JSON schemas plus extensions.
VALIDATOR = jsonschema.Draft4Validator(SCHEMA)


def example_pools() -> list[dict[str, Any]]:
    return [doc for path in EXAMPLES for doc in yaml.safe_load_all(path.read_text())]


def with_defaults(schema: dict[str, Any], value: Any) -> Any:
    """What the API server stores: defaults filled in, top-down, as structural defaulting does."""
    if isinstance(value, dict) and schema.get("type") == "object":
        out = dict(value)
        for key, sub in (schema.get("properties") or {}).items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out:
                out[key] = with_defaults(sub, out[key])
        return out
    if isinstance(value, list) and "items" in schema:
        return [with_defaults(schema["items"], v) for v in value]
    return value


def cel(rule: str, subject: Any) -> bool:
    """Evaluate the small CEL subset our rules use (field access, comparisons, &&, ||)."""
    python = re.sub(r"self\.(\w+)", r"self['\1']", rule)
    python = python.replace("&&", " and ").replace("||", " or ")
    return bool(eval(python, {"__builtins__": {}}, {"self": subject}))


def rules(schema: dict[str, Any], path: str = "") -> list[tuple[str, str, str]]:
    found = [(path, r["rule"], r["message"]) for r in schema.get("x-kubernetes-validations", [])]
    for key, sub in (schema.get("properties") or {}).items():
        found += rules(sub, f"{path}.{key}" if path else key)
    return found


def at(obj: dict[str, Any], path: str) -> Any:
    for part in path.split(".") if path else []:
        obj = obj[part]
    return obj


def test_schema_is_structural() -> None:
    """Every node has a type, or explicitly preserves unknown fields."""

    def walk(node: dict[str, Any], where: str) -> None:
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), where
        assert "$ref" not in node, where
        assert "additionalProperties" not in node, where
        if "default" in node:
            assert jsonschema.Draft4Validator(node).is_valid(node["default"]), where
        for key, sub in (node.get("properties") or {}).items():
            walk(sub, f"{where}.{key}")
        if "items" in node:
            walk(node["items"], f"{where}[]")

    walk(SCHEMA, "")
    assert VERSION["subresources"] == {"status": {}}


@pytest.mark.parametrize(("section", "contract"), [
    ("kv", KVPolicy), ("scheduling", SchedulingPolicy), ("routing", RoutingPolicy),
    ("autoscaling", AutoscalingPolicy),
])  # fmt: skip
def test_policy_sections_map_one_to_one_onto_the_contract(
    section: str, contract: type[msgspec.Struct]
) -> None:
    props = SPEC["properties"][section]["properties"]
    defaults = msgspec.structs.asdict(contract())
    assert {snake_case(k) for k in props} == set(defaults)
    for key, prop in props.items():
        want = defaults[snake_case(key)]
        want = list(want) if isinstance(want, tuple) else want
        assert prop["default"] == want, f"{section}.{key}"


def test_tenant_fields_map_onto_tenant_quota() -> None:
    props = SPEC["properties"]["tenants"]["items"]["properties"]
    defaults = msgspec.structs.asdict(TenantQuota(name="x"))
    assert {snake_case(k) for k in props} == set(defaults) - {"schema"}
    for key, prop in props.items():
        if key != "name":
            assert prop["default"] == defaults[snake_case(key)], key


@pytest.mark.parametrize("pool", example_pools(), ids=lambda p: p["metadata"]["name"])
def test_examples_validate_and_parse(pool: dict[str, Any]) -> None:
    VALIDATOR.validate(pool)
    stored = with_defaults(SCHEMA, pool)
    for path, rule, message in rules(SPEC, "spec"):
        assert cel(rule, at(stored, path)), message
    parsed = parse_pool(pool["metadata"]["name"], "default", stored["spec"])
    assert parsed.policy.model == (
        pool["spec"]["model"].get("servedName") or pool["spec"]["model"]["name"]
    )


def base_pool(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "inference.weir.dev/v1alpha1",
        "kind": "InferencePool",
        "metadata": {"name": "p", "namespace": "default"},
        "spec": {"model": {"name": "m"}, **spec},
    }


@pytest.mark.parametrize(("spec", "message"), [
    ({"kv": {"lowWatermark": 0.9, "highWatermark": 0.8}}, "watermarks"),
    ({"kv": {"highWatermark": 0.96}}, "watermarks"),
    ({"replicas": {"min": 3, "max": 2}}, "min"),
    ({"role": "prefill"}, "decode pool"),
    ({"role": "decode", "decodePool": "d"}, "only a prefill pool"),
])  # fmt: skip
def test_cross_field_rules_reject_in_cel_and_in_the_operator(
    spec: dict[str, Any], message: str
) -> None:
    pool = base_pool(**spec)
    VALIDATOR.validate(pool)  # the per-field schema alone lets these through ...
    stored = with_defaults(SCHEMA, pool)
    verdicts = [(cel(rule, at(stored, path)), msg) for path, rule, msg in rules(SPEC, "spec")]
    failed = [msg for ok, msg in verdicts if not ok]
    assert any(message in msg for msg in failed), verdicts  # ... the CEL rules do not
    with pytest.raises(InvalidPoolError, match=message):  # nor does the operator
        parse_pool("p", "default", stored["spec"])


@pytest.mark.parametrize("spec", [
    {"kv": {"lowWatermark": 1.5}},
    {"kv": {"lowWatermark": 0}},
    {"replicas": {"min": -1}},
    {"role": "both"},
    {"scheduling": {"preemptionModes": ["evict"]}},
    {"tenants": [{"name": "bad name"}]},
    {"tenants": [{"name": "t", "weight": 0}]},
    {"model": {}},
    {"engine": {"tensorParallel": "two"}},
])  # fmt: skip
def test_schema_rejects_bad_fields(spec: dict[str, Any]) -> None:
    assert not VALIDATOR.is_valid(base_pool(**spec))


def test_printer_columns_point_at_status_fields() -> None:
    status = SCHEMA["properties"]["status"]["properties"]
    for column in VERSION["additionalPrinterColumns"]:
        path = column["jsonPath"]
        if path.startswith(".status."):
            top = re.split(r"[.\[]", path.removeprefix(".status."))[0]
            assert top in status, column["name"]
