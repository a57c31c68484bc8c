"""The consistent-hash ring: primary and secondary owners of a prefix key.

Each member gets `vnodes` points on a 64-bit ring, derived only from its id, so every
router that sees the same membership builds the same ring. A key's primary owner is the
member of the first point at or after the key (wrapping), its secondary the next distinct
member clockwise. When one of N members leaves, only the keys it owned move (about 1/N).

Lookups are the router's hot path: the ring precomputes, per point, the (primary,
secondary) pair, so a lookup is one `bisect` over a flat list. Building a ring hashes the
points with numpy (a 64-bit mix of a blake2b seed per member), a few milliseconds for a
thousand members, once per membership version.

The bounded-load variant (consistent hashing with bounded loads, Mirrokni et al. 2018)
walks clockwise past members already carrying `c` times the average load, so no member
takes more than ceil(c * average) however skewed the keys.
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections.abc import Mapping, Sequence
from hashlib import blake2b
from typing import Final

import numpy as np

from controlplane.ownership.membership import Membership
from controlplane.ownership.overrides import HotPrefixTable

DEFAULT_VNODES: Final = 160
_MAX_KEY: Final = 2**64 - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array (wrapping arithmetic, no warnings)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    mixed: np.ndarray = x ^ (x >> np.uint64(31))
    return mixed


def _ring_points(members: tuple[str, ...], vnodes: int) -> np.ndarray:
    """Each member's `vnodes` points, member by member (a row per member)."""
    seeds = np.array(
        [int.from_bytes(blake2b(m.encode(), digest_size=8).digest(), "little") for m in members],
        dtype=np.uint64,
    )
    steps = np.arange(vnodes, dtype=np.uint64) * _GOLDEN
    return _splitmix64(seeds[:, None] + steps[None, :]).ravel()


class OwnershipRing:
    """An immutable ring over one membership version."""

    def __init__(self, membership: Membership, vnodes: int = DEFAULT_VNODES) -> None:
        if not isinstance(vnodes, int) or not 1 <= vnodes <= 4096:
            raise ValueError(f"vnodes must be an integer in [1, 4096], got {vnodes!r}")
        self.membership = membership
        self.vnodes = vnodes
        members = membership.members
        self._members = members
        if not members:
            self._points: Sequence[int] = array("Q")
            self._primary: list[str] = []
            self._secondary: list[str] = []
            self._owner_index: Sequence[int] = array("I")
            self._bucket_start: Sequence[int] = array("I")
            self._shift = 64
            return
        points = _ring_points(members, vnodes)
        owners = np.repeat(np.arange(len(members)), vnodes)
        order = np.argsort(points)
        points, owners = points[order], owners[order]
        if np.any(points[1:] == points[:-1]):
            # Tied points (astronomically rare): break ties by member order, so every
            # reader's ring is the same whatever its sort algorithm did.
            order = np.lexsort((owners, points))
            points, owners = points[order], owners[order]
        second = _next_distinct(owners)
        names = np.array([*members, ""], dtype=object)  # index -1 is "": no secondary
        # Flat machine arrays, not lists of Python ints: 8 bytes a point instead of ~40.
        self._points = array("Q", points.tobytes())
        self._owner_index = array("I", owners.astype(np.uint32).tobytes())
        self._primary = names[owners].tolist()
        self._secondary = names[second].tolist()
        # Bucket the ring by the top bits of a key, so a lookup bisects only the few
        # points of its bucket: a bisect over the whole ring chases ~17 pointers to
        # scattered ints, which costs microseconds.
        bits = max(4, min(20, (len(self._points) * 2).bit_length()))
        self._shift = 64 - bits
        counts = np.bincount(points >> np.uint64(self._shift), minlength=1 << bits)
        starts = np.concatenate(([0], np.cumsum(counts))).astype(np.uint32)
        self._bucket_start = array("I", starts.tobytes())

    @property
    def version(self) -> int:
        return self.membership.version

    def __len__(self) -> int:
        return len(self._members)

    def owners(self, key: int) -> tuple[str, str]:
        """(primary, secondary) owner of prefix `key`; "" where the ring has too few members.

        `key` is a prefix key from `prefix_key` (already seeded by the cache identity).
        """
        if not 0 <= key <= _MAX_KEY:
            raise ValueError(f"a prefix key is an unsigned 64-bit integer, got {key!r}")
        if not self._points:
            return ("", "")
        i = self._find(key)
        if i == len(self._points):
            i = 0
        return (self._primary[i], self._secondary[i])

    def _find(self, key: int) -> int:
        """Index of the first point >= key (len(points) when it wraps)."""
        bucket = key >> self._shift
        starts = self._bucket_start
        return bisect.bisect_left(self._points, key, starts[bucket], starts[bucket + 1])

    def owners_with_overrides(
        self, key: int, table: HotPrefixTable, now_ms: int
    ) -> tuple[str, ...]:
        """Primary, secondary, then a hot prefix's extra owners that are members."""
        primary, secondary = self.owners(key)
        found = [m for m in (primary, secondary) if m]
        members = set(self._members)
        found.extend(m for m in table.extra_owners(key, now_ms) if m in members and m not in found)
        return tuple(found)

    def bounded_owners(
        self, key: int, loads: Mapping[str, int], total_load: int, c: float = 1.25
    ) -> tuple[str, str]:
        """Owners under bounded load: the first two distinct members clockwise from `key`
        whose load is below ceil(c * (total_load + 1) / members).

        `loads` maps members to their current load (absent: 0) and `total_load` is its sum,
        kept by the caller so a lookup stays O(walk), not O(members).
        """
        if not c >= 1.0 or math.isinf(c):
            raise ValueError(f"the load bound c must be a finite number >= 1, got {c!r}")
        n = len(self._members)
        if not 0 <= key <= _MAX_KEY:
            raise ValueError(f"a prefix key is an unsigned 64-bit integer, got {key!r}")
        if n == 0:
            return ("", "")
        capacity = math.ceil(c * (total_load + 1) / n)
        found: list[str] = []
        seen: set[int] = set()
        start = self._find(key)
        size = len(self._points)
        for step in range(size):
            index = self._owner_index[(start + step) % size]
            if index in seen:
                continue
            seen.add(index)
            member = self._members[index]
            if loads.get(member, 0) < capacity:
                found.append(member)
                if len(found) == 2:
                    break
            if len(seen) == n:
                break
        while len(found) < 2:
            found.append("")
        return (found[0], found[1])


def _next_distinct(owners: np.ndarray) -> np.ndarray:
    """For each point, the owner of the next point clockwise owned by someone else (-1 if
    the ring has one member)."""
    n = len(owners)
    doubled = np.concatenate([owners, owners])
    starts = np.flatnonzero(doubled[1:] != doubled[:-1]) + 1  # where a new run begins
    if len(starts) == 0:
        return np.full(n, -1)
    nxt = np.searchsorted(starts, np.arange(n), side="right")
    return np.asarray(doubled[starts[nxt]])
