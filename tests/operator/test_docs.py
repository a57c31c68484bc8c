"""The generated reference documents are current."""

from __future__ import annotations

from fleet_operator.docs import generated, main


def test_reference_docs_are_current() -> None:
    for path, text in generated().items():
        assert path.read_text() == text, f"{path} is stale: run python -m fleet_operator.docs"
    assert main(["--check"]) == 0


def test_reference_lists_every_spec_section() -> None:
    crd_doc = next(text for path, text in generated().items() if path.name == "inferencepool.md")
    for field in ("spec.kv.lowWatermark", "spec.scheduling.overloadMayAbort",
                  "spec.tenants[].kvTokenSecondsPerMin", "status.conditions[].reason"):  # fmt: skip
        assert f"`{field}`" in crd_doc, field
