"""Ownership: chained block hashes, the ring, bounded load and hot-prefix overrides."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.contract import CacheIdentity
from controlplane.ownership import (
    HotPrefixOverride,
    HotPrefixTable,
    Membership,
    OwnershipRing,
    block_hashes,
    prefix_key,
)
from controlplane.ownership.blocks import _pack

IDENTITY = CacheIdentity(model="m")


def _members(n: int, version: int = 1) -> Membership:
    return Membership.of(version, (f"ep-{i}" for i in range(n)))


def _keys(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


def test_block_hashes_are_chained_and_seeded_by_the_cache_identity() -> None:
    prompt = list(range(64))
    hashes = block_hashes(IDENTITY, prompt, 16)
    assert len(hashes) == 4
    assert block_hashes(IDENTITY, prompt[:40], 16) == hashes[:2]  # partial block not hashed
    # Same second block after a different first block: a different chain from there on.
    other = [999, *prompt[1:]]
    assert block_hashes(IDENTITY, other, 16)[1] != hashes[1]
    for identity in (
        CacheIdentity(model="m2"),
        CacheIdentity(model="m", adapter="lora"),
        CacheIdentity(model="m", cache_schema=2),
        CacheIdentity(model="m", security_domain="tenant-a"),
    ):
        assert block_hashes(identity, prompt, 16)[0] != hashes[0]
    assert block_hashes(IDENTITY, prompt, 16, max_blocks=2) == hashes[:2]
    assert all(0 <= h < 2**64 for h in hashes)


def test_byte_level_tokens_hash_like_their_ids() -> None:
    text = b"hello, weir! " * 10
    assert block_hashes(IDENTITY, text, 8) == block_hashes(IDENTITY, list(text), 8)
    assert prefix_key(IDENTITY, text, 8, 2) == block_hashes(IDENTITY, text, 8)[1]
    short = prefix_key(IDENTITY, b"hi", 8, 2)
    assert short != prefix_key(IDENTITY, b"ho", 8, 2)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.integers(1, 16))
def test_every_token_form_packs_as_little_endian_uint32s(text: bytes, block: int) -> None:
    """Bytes (strided into a buffer) and id lists (an array) pack to the same bytes: each
    id as 4 little-endian bytes, whatever the machine's byte order."""
    expected = b"".join(token.to_bytes(4, "little") for token in text)
    for form in (text, bytearray(text), memoryview(text), list(text)):
        assert _pack(form) == expected
    ids = [token * 16_777_259 % 2**32 for token in text]  # ids beyond one byte too
    assert _pack(ids) == b"".join(token.to_bytes(4, "little") for token in ids)
    assert block_hashes(IDENTITY, text, block) == block_hashes(IDENTITY, list(text), block)


@pytest.mark.parametrize(
    ("tokens", "block", "match"),
    [([1, -1], 1, "token ids"), ([1, 2**32], 1, "token ids"), ([1], 0, "block_tokens")],
)
def test_bad_tokens_and_block_sizes_are_refused(tokens: list[int], block: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        block_hashes(IDENTITY, tokens, block)


def test_every_reader_computes_the_same_owners() -> None:
    names = [f"ep-{i}" for i in range(50)]
    shuffled = names[:]
    random.Random(7).shuffle(shuffled)
    a = OwnershipRing(Membership.of(3, names))
    b = OwnershipRing(Membership.of(3, shuffled))
    for key in _keys(2000):
        primary, secondary = a.owners(key)
        assert (primary, secondary) == b.owners(key)
        assert primary != secondary
        assert primary in names
        assert secondary in names
    assert a.version == 3


def test_small_rings() -> None:
    assert OwnershipRing(_members(0)).owners(5) == ("", "")
    one = OwnershipRing(_members(1))
    assert one.owners(5) == ("ep-0", "")
    assert one.owners(2**64 - 1) == ("ep-0", "")
    with pytest.raises(ValueError, match="unsigned"):
        one.owners(-1)
    with pytest.raises(ValueError, match="unsigned"):
        one.owners(2**64)
    with pytest.raises(ValueError, match="vnodes"):
        OwnershipRing(_members(1), vnodes=0)


def test_when_a_member_leaves_only_its_keys_move() -> None:
    before = OwnershipRing(_members(40))
    leaver = "ep-17"
    after = OwnershipRing(Membership.of(2, (m for m in before.membership.members if m != leaver)))
    keys = _keys(20_000)
    moved = [k for k in keys if before.owners(k)[0] != after.owners(k)[0]]
    assert all(before.owners(k)[0] == leaver for k in moved)
    # The leaver's keys go to its secondary, which already had the next-best claim.
    assert all(after.owners(k)[0] == before.owners(k)[1] for k in moved)
    assert len(moved) / len(keys) < 2.0 / 40


def test_bounded_load_never_exceeds_c_times_the_average() -> None:
    ring = OwnershipRing(_members(20))
    rng = random.Random(3)
    hot = _keys(200, seed=5)
    weights = [1 / (rank + 1) for rank in range(len(hot))]  # Zipf(1)
    loads: Counter[str] = Counter()
    plain: Counter[str] = Counter()
    total = 0
    for key in rng.choices(hot, weights, k=4000):
        primary, secondary = ring.bounded_owners(key, loads, total, c=1.25)
        assert primary
        assert primary != secondary
        loads[primary] += 1
        total += 1
        plain[ring.owners(key)[0]] += 1
    average = total / 20
    assert max(loads.values()) <= -(-1.25 * average // 1) + 1
    assert max(plain.values()) > 1.25 * average  # the skew bounded load protects against
    with pytest.raises(ValueError, match="load bound"):
        ring.bounded_owners(1, loads, total, c=0.5)


def test_bounded_load_prefers_the_plain_owners_when_unloaded() -> None:
    ring = OwnershipRing(_members(10))
    for key in _keys(100):
        assert ring.bounded_owners(key, {}, 0) == ring.owners(key)


def test_hot_prefix_overrides_add_members_until_they_expire() -> None:
    ring = OwnershipRing(_members(10))
    key = _keys(1)[0]
    primary, secondary = ring.owners(key)
    extra = next(m for m in ring.membership.members if m not in (primary, secondary))
    table = HotPrefixTable(
        4, {key: HotPrefixOverride(key, (extra, "gone-endpoint", primary), 4, 1000)}
    )
    assert ring.owners_with_overrides(key, table, now_ms=999) == (primary, secondary, extra)
    assert ring.owners_with_overrides(key, table, now_ms=1000) == (primary, secondary)
