"""The InferencePool CRD read as a file: a structural schema, defaults and fields that map
onto the contract, printer columns that point at status fields. Whether a pool is valid is
the API server's to decide: test_crd_server.py applies the CRD, the examples and invalid
pools to a real one."""

from __future__ import annotations

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
from fleet_operator.spec import snake_case

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


def test_schema_is_structural() -> None:
    """Every node has a type, or explicitly preserves unknown fields."""

    def walk(node: dict[str, Any], where: str) -> None:
        assert (
            "type" in node
            or node.get("x-kubernetes-preserve-unknown-fields")
            or node.get("x-kubernetes-int-or-string")
        ), where
        assert "$ref" not in node, where
        assert not ("additionalProperties" in node and "properties" in node), where
        if "default" in node:
            assert jsonschema.Draft4Validator(node).is_valid(node["default"]), where
        for key, sub in (node.get("properties") or {}).items():
            walk(sub, f"{where}.{key}")
        if "items" in node:
            walk(node["items"], f"{where}[]")
        if "additionalProperties" in node:
            walk(node["additionalProperties"], f"{where}.*")

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


def test_printer_columns_point_at_status_fields() -> None:
    status = SCHEMA["properties"]["status"]["properties"]
    for column in VERSION["additionalPrinterColumns"]:
        path = column["jsonPath"]
        if path.startswith(".status."):
            top = re.split(r"[.\[]", path.removeprefix(".status."))[0]
            assert top in status, column["name"]
