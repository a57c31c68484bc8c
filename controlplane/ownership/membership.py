"""A pool's live membership at one version: the input to every ownership computation."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Membership:
    """Members sorted by id, so equal memberships are equal values on every router."""

    version: int
    members: tuple[str, ...]

    @classmethod
    def of(cls, version: int, members: Iterable[str]) -> Membership:
        return cls(version, tuple(sorted(set(members))))

    def __len__(self) -> int:
        return len(self.members)
