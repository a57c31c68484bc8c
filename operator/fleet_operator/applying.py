"""Bringing child objects to their rendered form, touching only what differs.

`merge_patch` computes a JSON merge patch (RFC 7386) from the live object to the desired
one, over the desired object's fields only: fields the API server or other controllers
add (defaults, status, annotations of their own) are left alone. A list counts as
unchanged when it has the same length and each desired item is contained in the live
one, so server-side defaults inside containers do not cause a patch on every pass.

`apply` reads a child, creates it when missing and otherwise sends that patch (nothing at
all when it is empty), through the official client's typed APIs.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes_asyncio.client import (
    ApiClient,
    ApiException,
    AppsV1Api,
    CoreV1Api,
    CustomObjectsApi,
    PolicyV1Api,
)

MERGE_PATCH = "application/merge-patch+json"


class Applied(enum.StrEnum):
    CREATED = "created"
    PATCHED = "patched"
    UNCHANGED = "unchanged"


def _contains(desired: Any, live: Any) -> bool:
    if isinstance(desired, Mapping):
        return isinstance(live, Mapping) and all(
            _contains(v, live.get(k)) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(desired) == len(live)
            and all(_contains(d, x) for d, x in zip(desired, live, strict=True))
        )
    return bool(desired == live)


def merge_patch(desired: Mapping[str, Any], live: Mapping[str, Any]) -> dict[str, Any]:
    patch: dict[str, Any] = {}
    for key, want in desired.items():
        have = live.get(key)
        if isinstance(want, Mapping) and isinstance(have, Mapping):
            nested = merge_patch(want, have)
            if nested:
                patch[key] = nested
        elif not _contains(want, have):
            patch[key] = want
    return patch


Call = Callable[..., Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class _Ops:
    read: Call  # (name, namespace)
    create: Call  # (namespace, body)
    patch: Call  # (name, namespace, body)


def _ops(api: ApiClient, manifest: Mapping[str, Any]) -> _Ops:
    kind = manifest["kind"]
    if kind == "Deployment":
        apps = AppsV1Api(api)
        return _Ops(
            apps.read_namespaced_deployment,
            apps.create_namespaced_deployment,
            apps.patch_namespaced_deployment,
        )
    core = CoreV1Api(api)
    if kind == "Service":
        return _Ops(
            core.read_namespaced_service,
            core.create_namespaced_service,
            core.patch_namespaced_service,
        )
    if kind == "ConfigMap":
        return _Ops(
            core.read_namespaced_config_map,
            core.create_namespaced_config_map,
            core.patch_namespaced_config_map,
        )
    if kind == "PodDisruptionBudget":
        policy = PolicyV1Api(api)
        return _Ops(
            policy.read_namespaced_pod_disruption_budget,
            policy.create_namespaced_pod_disruption_budget,
            policy.patch_namespaced_pod_disruption_budget,
        )
    # Custom resources (the ServiceMonitor) go through the generic custom-objects API.
    group, version = manifest["apiVersion"].split("/")
    plural = f"{kind.lower()}s"
    custom = CustomObjectsApi(api)

    def read(name: str, namespace: str, **kw: Any) -> Awaitable[Any]:
        return custom.get_namespaced_custom_object(group, version, namespace, plural, name, **kw)

    def create(namespace: str, body: Any, **kw: Any) -> Awaitable[Any]:
        return custom.create_namespaced_custom_object(group, version, namespace, plural, body, **kw)

    def patch(name: str, namespace: str, body: Any, **kw: Any) -> Awaitable[Any]:
        return custom.patch_namespaced_custom_object(
            group, version, namespace, plural, name, body, **kw
        )

    return _Ops(read, create, patch)


async def read_manifest(api: ApiClient, manifest: Mapping[str, Any]) -> dict[str, Any] | None:
    """The live object named by `manifest` as a plain dict, or None when it is absent."""
    meta = manifest["metadata"]
    try:
        live = await _ops(api, manifest).read(meta["name"], meta["namespace"])
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    plain: dict[str, Any] = api.sanitize_for_serialization(live)
    return plain


async def apply(api: ApiClient, manifest: Mapping[str, Any]) -> Applied:
    meta = manifest["metadata"]
    ops = _ops(api, manifest)
    live = await read_manifest(api, manifest)
    if live is None:
        await ops.create(meta["namespace"], dict(manifest))
        return Applied.CREATED
    patch = merge_patch(manifest, live)
    if not patch:
        return Applied.UNCHANGED
    await ops.patch(meta["name"], meta["namespace"], patch, _content_type=MERGE_PATCH)
    return Applied.PATCHED
