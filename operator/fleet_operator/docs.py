"""Reference documentation generated from the schemas, so it cannot drift from them:
`docs/reference/inferencepool.md` from the CRD's OpenAPI schema and
`docs/reference/helm-values.md` from the chart's values schema and defaults.

    python -m fleet_operator.docs            # rewrite both files
    python -m fleet_operator.docs --check    # exit 1 if either is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "inferencepool.yaml"
VALUES_SCHEMA = ROOT / "charts" / "weir" / "values.schema.json"
VALUES = ROOT / "charts" / "weir" / "values.yaml"
CRD_DOC = ROOT / "docs" / "reference" / "inferencepool.md"
VALUES_DOC = ROOT / "docs" / "reference" / "helm-values.md"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _type(node: Mapping[str, Any]) -> str:
    kind = str(
        node.get("type", "object" if node.get("x-kubernetes-preserve-unknown-fields") else "")
    )
    if kind == "array" and "items" in node:
        return f"[]{_type(node['items'])}"
    return kind


def _constraints(node: Mapping[str, Any]) -> str:
    parts = []
    if "enum" in node:
        parts.append("one of " + ", ".join(f"`{v}`" for v in node["enum"]))
    if "minimum" in node:
        parts.append(f"{'>' if node.get('exclusiveMinimum') else '>='} {node['minimum']}")
    if "maximum" in node:
        parts.append(f"<= {node['maximum']}")
    if "pattern" in node:
        parts.append(f"matches `{node['pattern']}`")
    for rule in node.get("x-kubernetes-validations", []):
        parts.append(f"rule `{rule['rule']}`: {rule['message']}")
    return "; ".join(parts)


def _walk(node: Mapping[str, Any], path: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    yield path, node
    for key, child in (node.get("properties") or {}).items():
        yield from _walk(child, f"{path}.{key}" if path else key)
    items = node.get("items")
    if isinstance(items, Mapping) and items.get("properties"):
        for key, child in items["properties"].items():
            yield from _walk(child, f"{path}[].{key}")


def crd_reference(crd: Mapping[str, Any]) -> str:
    version = crd["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    names = crd["spec"]["names"]
    lines = [
        f"# {names['kind']} reference",
        "",
        f"`{crd['spec']['group']}/{version['name']}`, namespaced, short names "
        + ", ".join(f"`{n}`" for n in names["shortNames"])
        + f", category `{names['categories'][0]}`. Generated from `crds/inferencepool.yaml` by "
        "`python -m fleet_operator.docs`; do not edit.",
        "",
        schema.get("description", ""),
        "",
        "The Gateway API Inference Extension defines another kind named `InferencePool`",
        "(group `inference.networking.k8s.io`, short name `infpool`). On a cluster with both,",
        f"`kubectl get {names['plural']}` lists the Gateway API's pools: name Weir's by a short",
        f"name (`kubectl get {names['shortNames'][0]}`), the category (`kubectl get "
        f"{names['categories'][0]}`) or in full (`{names['plural']}.{crd['spec']['group']}`).",
        "",
        "Fields under `kv`, `scheduling`, `routing`, `autoscaling` and `tenants` map 1:1 onto",
        "`controlplane.contract.PoolPolicy` (camelCase here, snake_case there); the operator",
        "writes that policy as JSON into the ConfigMap `<pool>-policy`, read by sidecars and",
        "routers with `--policy-file`.",
    ]
    for section in ("spec", "status"):
        lines += [
            "",
            f"## {section}",
            "",
            "| field | type | default | constraints | description |",
            "|---|---|---|---|---|",
        ]
        for path, node in _walk(schema["properties"][section], section):
            default = f"`{json.dumps(node['default'])}`" if "default" in node else ""
            lines.append(
                f"| `{path}` | {_type(node)} | {_cell(default)} | {_cell(_constraints(node))} "
                f"| {_cell(node.get('description', ''))} |"
            )
    lines += ["", "## kubectl get columns", "", "| column | path |", "|---|---|"]
    lines += [f"| {c['name']} | `{c['jsonPath']}` |" for c in version["additionalPrinterColumns"]]
    return "\n".join(lines) + "\n"


def _default(values: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(values, Mapping) or part not in values:
            return None
        values = values[part]
    return values


def values_reference(schema: Mapping[str, Any], values: Mapping[str, Any]) -> str:
    lines = [
        "# Helm values",
        "",
        "Values of the `weir` chart. Generated from `charts/weir/values.schema.json` and",
        "`charts/weir/values.yaml` by `python -m fleet_operator.docs`; do not edit.",
        "",
        "| key | type | default | description |",
        "|---|---|---|---|",
    ]
    for path, node in _walk(schema, ""):
        if not path or path == "global":
            continue
        if node.get("type") == "object" and node.get("properties"):
            continue  # sections: their keys are listed one by one
        default = _default(values, path)
        shown = "" if default is None else f"`{json.dumps(default)}`"
        lines.append(
            f"| `{path}` | {_type(node)} | {_cell(shown)} | {_cell(node.get('description', ''))} |"
        )
    return "\n".join(lines) + "\n"


def generated() -> dict[Path, str]:
    return {
        CRD_DOC: crd_reference(yaml.safe_load(CRD.read_text())),
        VALUES_DOC: values_reference(
            json.loads(VALUES_SCHEMA.read_text()), yaml.safe_load(VALUES.read_text())
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="fail if a file is stale")
    args = parser.parse_args(argv)
    stale = []
    for path, text in generated().items():
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for path in stale:
        print(f"{path} is stale: run python -m fleet_operator.docs", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
