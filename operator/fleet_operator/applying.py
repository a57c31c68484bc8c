"""Bringing child objects to their rendered form with server-side apply.

Each child is applied whole, as the operator's field manager (`weir-operator`): the API
server merges it with what others own (defaults, status, the HPA's or a user's fields),
in its own canonical form, so `cpu: "0.5"` against a stored `500m`, or a field the server
omits when false, is no difference at all. An apply that changes nothing is not written:
a steady pool costs the API server no writes, which `apply` tells by the object's
resourceVersion.

`merge_patch` computes a JSON merge patch (RFC 7386) from a live mapping to a desired one,
over the desired mapping's fields only; `write_status` sends such a patch to a pool's status
subresource. The operator writes its pools' status itself rather than through kopf's
patch of the handler's outcome: a failed write is then the handler's error, retried by
kopf like any other, where a failure in kopf's own patch step silently ended the pool's
status timer.
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

from fleet_operator.spec import GROUP, PLURAL, VERSION

MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
FIELD_MANAGER = "weir-operator"


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
    patch: Call  # (name, namespace, body)


def _ops(api: ApiClient, manifest: Mapping[str, Any]) -> _Ops:
    kind = manifest["kind"]
    if kind == "Deployment":
        apps = AppsV1Api(api)
        return _Ops(
            apps.read_namespaced_deployment,
            apps.patch_namespaced_deployment,
        )
    core = CoreV1Api(api)
    if kind == "Service":
        return _Ops(
            core.read_namespaced_service,
            core.patch_namespaced_service,
        )
    if kind == "ConfigMap":
        return _Ops(
            core.read_namespaced_config_map,
            core.patch_namespaced_config_map,
        )
    if kind == "ServiceAccount":
        return _Ops(
            core.read_namespaced_service_account,
            core.patch_namespaced_service_account,
        )
    if kind == "PodDisruptionBudget":
        policy = PolicyV1Api(api)
        return _Ops(
            policy.read_namespaced_pod_disruption_budget,
            policy.patch_namespaced_pod_disruption_budget,
        )
    # Custom resources (the ServiceMonitor) go through the generic custom-objects API.
    group, version = manifest["apiVersion"].split("/")
    plural = f"{kind.lower()}s"
    custom = CustomObjectsApi(api)

    def read(name: str, namespace: str, **kw: Any) -> Awaitable[Any]:
        return custom.get_namespaced_custom_object(group, version, namespace, plural, name, **kw)

    def patch(name: str, namespace: str, body: Any, **kw: Any) -> Awaitable[Any]:
        return custom.patch_namespaced_custom_object(
            group, version, namespace, plural, name, body, **kw
        )

    return _Ops(read, patch)


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
    applied = await ops.patch(
        meta["name"],
        meta["namespace"],
        dict(manifest),
        field_manager=FIELD_MANAGER,
        force=True,  # the operator owns what it renders, whoever touched it since
        _content_type=APPLY_PATCH,
    )
    if live is None:
        return Applied.CREATED
    after: dict[str, Any] = api.sanitize_for_serialization(applied)
    if after["metadata"]["resourceVersion"] == live["metadata"]["resourceVersion"]:
        return Applied.UNCHANGED
    return Applied.PATCHED


async def write_status(
    api: ApiClient,
    namespace: str,
    name: str,
    changes: Mapping[str, Any],
    read_version: str = "",
) -> None:
    """Merge `changes` into the pool's status (nothing is sent when there are none). With
    `read_version` (the resourceVersion the changes were computed from) the API server
    refuses the write with 409 Conflict if the pool changed since: a status pass that read
    the pool before another writer's change must not replace that writer's conditions
    (a merge patch replaces the list whole), not even until its next pass."""
    if not changes:
        return
    patch: dict[str, Any] = {"status": dict(changes)}
    if read_version:
        patch["metadata"] = {"resourceVersion": read_version}
    # The client's stubs omit `_content_type`; its default for a dict is a JSON patch.
    merge: dict[str, Any] = {"_content_type": MERGE_PATCH}
    await CustomObjectsApi(api).patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, name, patch, **merge
    )
