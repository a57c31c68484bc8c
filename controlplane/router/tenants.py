"""API keys and the tenants they stand for.

A keys file is YAML or JSON mapping each key to its tenant:

    sk-team-a-1: team-a
    sk-team-b-1: team-b

A keys file must hold at least one key (an empty one is refused rather than read as "no
keys", which would open the router). With keys, a request needs `Authorization: Bearer <key>` (or `x-api-key: <key>`); a
missing or unknown key is refused with 401 before anything else happens, and the key alone
names the tenant.

With no keys configured the router is open: a request is tenant `default`, or the tenant
its `x-weir-tenant` header names when the pool policy declares that tenant (its quota; a
name the policy does not declare is refused with 403, so the tenant label set stays the
policy's). With no tenants declared the header is ignored.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml

from controlplane.contract import headers as wire
from controlplane.router.errors import RouterError

DEFAULT_TENANT = "default"
TENANT_HEADER = wire.TENANT


class TenantKeys:
    def __init__(self, keys: Mapping[str, str] | None = None, declared: Iterable[str] = ()) -> None:
        self._keys = dict(keys or {})
        for key, tenant in self._keys.items():
            if not (isinstance(key, str) and key and isinstance(tenant, str) and tenant):
                raise ValueError("API keys and tenant names must be non-empty strings")
        self.declared = frozenset(declared)

    def declaring(self, tenants: Iterable[str]) -> TenantKeys:
        """The same keys, with `tenants` declared by the pool policy as well."""
        return TenantKeys(self._keys, self.declared | frozenset(tenants))

    @classmethod
    def load(cls, path: str | Path) -> TenantKeys:
        data = yaml.safe_load(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of API key to tenant")
        if not data:
            # A keys file is a promise that requests are authenticated: an empty one would
            # quietly open the router instead.
            raise ValueError(
                f"{path} holds no API keys, which would let every request in; "
                "list at least one (`KEY: tenant`), or run without --api-keys"
            )
        return cls({str(k): v for k, v in data.items()})

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, headers: Mapping[str, str]) -> str:
        if not self._keys:
            named = headers.get(TENANT_HEADER)
            if not named or not self.declared:
                return DEFAULT_TENANT
            if named not in self.declared:
                raise RouterError(
                    403, "permission_error", "unknown_tenant",
                    f"tenant {named[:64]!r} is not declared by the pool policy",
                )  # fmt: skip
            return named
        key = _presented_key(headers)
        if key is None:
            raise RouterError(
                401, "authentication_error", "missing_api_key", "an API key is required"
            )
        for known, tenant in self._keys.items():
            if hmac.compare_digest(known.encode(), key.encode()):
                return tenant
        raise RouterError(401, "authentication_error", "invalid_api_key", "unknown API key")


def _presented_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key") or None
