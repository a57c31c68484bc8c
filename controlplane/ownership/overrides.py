"""Hot-prefix overrides: extra owners for a few prefixes too hot for one primary.

The table lives in Redis (versioned; every entry expires by Redis server time) and reaches
every router through the pool's change feed; this module is its pure, immutable view.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec

from controlplane.contract import SCHEMA_VERSION


class HotPrefix(msgspec.Struct, frozen=True, kw_only=True):
    """The stored body of an override (version and expiry are the store's, kept beside it)."""

    schema: int = SCHEMA_VERSION
    extra_owners: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class HotPrefixOverride:
    key: int
    extra_owners: tuple[str, ...]
    version: int
    expires_at_ms: int


@dataclass(frozen=True, slots=True)
class HotPrefixTable:
    """All overrides of a pool at one table version."""

    version: int = 0
    overrides: Mapping[int, HotPrefixOverride] = field(default_factory=dict)

    def extra_owners(self, key: int, now_ms: int) -> tuple[str, ...]:
        """Extra owners for `key` at server time `now_ms` (none once expired)."""
        override = self.overrides.get(key)
        if override is None or override.expires_at_ms <= now_ms:
            return ()
        return override.extra_owners
