"""The host tier (SGLang's hierarchical cache): evicted prefix pages are written back to
host memory and loaded back on a prefix hit instead of being computed, at PCIe cost; the
host pool is LRU and counted exactly; a page's only device copy is never freed before its
host copy is complete; and a request resumed from host pages continues exactly."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from fleetsim.engine import EngineConfig, EngineModel, EngineRequest
from fleetsim.engine.host_cache import HostCache
from fleetsim.engine.kv_cache import KVCache
from tests.fleetsim.test_engine_model import drain, run_alone

PAGE = 16


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 200) for _ in range(n)]


def tiered(**changes: object) -> EngineModel:
    """A pool of 4096 tokens with a host tier twice its size."""
    config = EngineConfig(
        max_total_tokens=4096, page_size=PAGE, enable_hierarchical_cache=True
    ).replace(**changes)
    return EngineModel(config)


def run(model: EngineModel, rid: str, ids: list[int], max_new: int) -> EngineRequest:
    req = model.make_request(rid, ids, max_new, ignore_eos=True)
    assert model.submit(req, 0.0)
    drain(model)
    return req


def push_out(model: EngineModel, seeds: Sequence[int]) -> None:
    """Run unrelated prompts until the device cache has had to evict."""
    for seed in seeds:
        run(model, f"filler-{seed}", tokens(seed, 1500), 1)


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_an_offloaded_request_resumes_from_host_pages_exactly(policy: str) -> None:
    """Offload as a stock engine does it: abort mid-decode (its pages stay cached),
    evicted to the host by other work (or copied there as they were cached), then resumed
    as a continuation of its history: the continuation loads its history from the host
    instead of computing it, pays PCIe time for it, and produces exactly the tokens the
    uninterrupted request does."""
    model = tiered(hicache_write_policy=policy)
    prompt = tokens(1, 2000)
    req = model.make_request("long", prompt, 64, ignore_eos=True)
    assert model.submit(req, 0.0)
    now = 0.0
    while len(req.output_ids) < 24:
        now += model.step(now).duration
    model.abort_request(req, now)
    push_out(model, (2, 3, 4))
    assert model.host is not None
    assert model.kv.match(req.history(), req.total_len, "")[1] == 0  # not on the device
    before = model.host.load_back_tokens_total
    backed_before = model.host.backup_tokens_total
    history = req.history()
    cont = model.make_request("long-cont", history, 64 - 24, ignore_eos=True)
    assert model.submit(cont, now)
    first = model.step(now)
    loaded = model.host.load_back_tokens_total - before
    # Its pages evicted others': those were written back in the same iteration.
    backed_up = model.host.backup_tokens_total - backed_before
    # Everything but the last partial page and the token to sample from came back.
    assert loaded == (len(history) - 1) // PAGE * PAGE
    assert first.prefill_tokens == len(history) - loaded
    assert cont.host_cached_tokens == loaded
    roofline = model.config.timing.iteration_s(
        first.prefill_tokens,
        (len(history) * (len(history) + 1) - loaded * (loaded + 1)) // 2,
        loaded,
        0,
        0,
    )
    assert first.duration == pytest.approx(
        roofline + model.config.timing.host_transfer_s(loaded + backed_up)
    )
    model.check()
    drain(model, now + first.duration)
    assert req.output_ids + cont.output_ids == run_alone(
        model.make_request("solo", prompt, 64, ignore_eos=True)
    )


def test_without_a_host_tier_the_continuation_recomputes() -> None:
    model = tiered(enable_hierarchical_cache=False)
    prompt = tokens(1, 2000)
    run(model, "long", prompt, 8)
    push_out(model, (2, 3, 4))
    assert model.host is None
    cont = model.make_request("cont", prompt, 8, ignore_eos=True)
    assert model.submit(cont, 0.0)
    assert model.step(0.0).prefill_tokens == len(prompt)
    assert cont.cached_tokens == 0


def test_the_host_pool_evicts_least_recently_used_pages() -> None:
    host = HostCache(total_pages=4, page_size=2)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    assert host.back_up("", a, 0, 4)
    assert host.back_up("", b, 0, 4)
    assert host.match("", a, 0, 4) == 4  # a is used: b is now the oldest
    assert host.back_up("", c, 0, 4)
    assert (host.match("", a, 0, 4), host.match("", b, 0, 4), host.match("", c, 0, 4)) == (4, 0, 4)
    assert host.used_pages == 4
    host.check()
    # A run larger than the pool is dropped, and counted as such; nothing else moves.
    assert not host.back_up("", list(range(1, 11)), 0, 10)
    assert host.dropped_tokens_total == 10
    assert host.match("", c, 0, 4) == 4


def test_host_pages_match_only_the_history_they_were_written_for() -> None:
    """A host page is keyed by its whole history and its salt: the same tokens after a
    different prefix, or under another salt, are a miss, and a match continues only from
    where the device hit ended."""
    host = HostCache(total_pages=8, page_size=2)
    assert host.back_up("s", [1, 2, 3, 4, 5, 6], 2, 6)  # pages 2..3; page 1 not held
    assert host.match("s", [1, 2, 3, 4, 5, 6], 2, 6) == 4
    assert host.match("s", [1, 2, 3, 4, 5, 6], 0, 6) == 0  # the first page is not here
    assert host.match("s", [9, 9, 3, 4, 5, 6], 2, 6) == 0  # same tokens, other prefix
    assert host.match("t", [1, 2, 3, 4, 5, 6], 2, 6) == 0  # other salt
    assert host.match("s", [1, 2, 3, 4, 7, 7], 2, 6) == 2  # diverges in the last page


class _FailingHost(HostCache):
    """A host pool whose device-to-host copy fails after `copies` pages."""

    def __init__(self, total_pages: int, page_size: int, copies: int) -> None:
        super().__init__(total_pages, page_size)
        self.copies = copies

    def _copy(self, tokens: Sequence[int]) -> tuple[int, ...]:
        if self.copies == 0:
            raise OSError("copy failed")
        self.copies -= 1
        return super()._copy(tokens)


def cached(kv: KVCache, ids: list[int]) -> None:
    """Put `ids` (whole pages) in `kv`'s prefix cache, unreferenced."""
    pages = kv.allocate(len(ids) // kv.page_size)
    assert pages is not None
    kv.unlock(kv.adopt(kv.root(), pages, ids, 0, len(ids)))


def test_a_write_back_that_fails_part_way_keeps_the_device_copy() -> None:
    ids = [1, 2, 3, 4, 5, 6]
    host = _FailingHost(total_pages=8, page_size=2, copies=2)
    kv = KVCache(4, 2, host=host)
    cached(kv, ids)
    with pytest.raises(OSError, match="copy failed"):
        kv.evict(3)
    # Nothing was freed and nothing half-copied was entered: the device still has it all.
    kv.check([])
    assert (kv.free_pages, kv.cached_pages, kv.match(ids, 6)[1]) == (1, 3, 6)
    assert (host.used_pages, host.backup_tokens_total) == (0, 0)
    host.copies = 3
    assert kv.evict(3) == 3
    kv.check([])
    assert kv.match(ids, 6)[1] == 0
    assert host.match("", ids, 0, 6) == 6
    assert (host.backup_tokens_total, kv.evicted_tokens_total) == (6, 6)


class _WatchingHost(HostCache):
    """A host pool that, at each page copy, records whether the device still holds the
    run being copied."""

    def __init__(self, kv_ids: list[int]) -> None:
        super().__init__(total_pages=8, page_size=2)
        self.kv: KVCache | None = None
        self.ids = kv_ids
        self.device_held: list[int] = []

    def _copy(self, tokens: Sequence[int]) -> tuple[int, ...]:
        assert self.kv is not None
        self.device_held.append(self.kv.match(self.ids, len(self.ids))[1])
        return super()._copy(tokens)


def test_a_page_is_freed_only_after_its_host_copy_is_complete() -> None:
    ids = [1, 2, 3, 4, 5, 6]
    host = _WatchingHost(ids)
    kv = KVCache(4, 2, host=host)
    host.kv = kv
    cached(kv, ids)
    free = kv.free_pages
    assert kv.evict(2) == 2  # the tail: tokens 2..6
    assert host.device_held == [6, 6]  # while each page was copied, all of it was cached
    assert kv.free_pages == free + 2
    assert (kv.match(ids, 6)[1], host.match("", ids, 2, 6)) == (2, 4)


def test_write_through_copies_pages_as_they_are_cached_and_eviction_copies_none() -> None:
    """Under write-through the host holds a run as soon as the device caches it; evicting
    it then frees the device pages without a copy, and the host still serves all of it.
    A run the host has let go meanwhile is written back on eviction: never lost."""
    ids, other = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10]
    host = _WatchingHost(ids)
    kv = KVCache(4, 2, host=host, write_through=True)
    host.kv = kv
    cached(kv, ids)
    assert (host.backup_tokens_total, host.match("", ids, 0, 6), kv.evicted_tokens_total) == (
        6, 6, 0,
    )  # fmt: skip
    assert host.device_held == [6, 6, 6]  # copied once cached, before anything was freed
    assert kv.evict(3) == 3
    kv.check([])
    assert (host.backup_tokens_total, kv.match(ids, 6)[1], host.match("", ids, 0, 6)) == (6, 0, 6)
    # The host (8 pages) lets the first run's pages go as others come; the device's copy
    # of a run is written back when evicted if the host no longer holds it.
    cached(kv, other)
    assert host.backup_tokens_total == 10
    host.clear()
    assert kv.evict(2) == 2
    assert (host.backup_tokens_total, host.match("", other, 0, 4)) == (14, 4)
    kv.check([])


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_churn_keeps_every_invariant_and_every_token_exact(policy: str) -> None:
    """Many requests over shared prefixes, a pool that must evict and a host tier that
    must evict too: the device and host pools balance after every step, the host's
    counters add up, and every request produces what it would alone."""
    model = tiered(
        max_total_tokens=2048, hicache_ratio=1.5, chunked_prefill_size=256,
        hicache_write_policy=policy,
    )  # fmt: skip
    rng = random.Random(7)
    stems = [tokens(seed, 600) for seed in range(4)]
    reqs = []
    now = 0.0
    for index in range(40):
        ids = rng.choice(stems)[: rng.randrange(100, 600)] + tokens(100 + index, 40)
        req = model.make_request(f"r{index}", ids, rng.randrange(1, 40), ignore_eos=True)
        assert model.submit(req, now)
        reqs.append(req)
        for _ in range(rng.randrange(1, 6)):
            now += model.step(now).duration
            model.check()
    drain(model, now)
    host = model.host
    assert host is not None
    assert host.load_back_tokens_total > 0
    assert host.backup_tokens_total > 0
    assert host.used_pages == host.total_pages  # full, so it has had to evict
    assert sum(r.host_cached_tokens for r in reqs) == host.load_back_tokens_total
    for req in reqs:
        assert req.finish is not None
        assert req.finish.kind == "length"
        assert req.output_ids == run_alone(req)


def test_host_pool_size_follows_sglangs_flags() -> None:
    base = EngineConfig(max_total_tokens=4096, page_size=PAGE)
    assert base.host_total_tokens == 0
    assert base.replace(enable_hierarchical_cache=True).host_total_tokens == 8192
    ratio = base.replace(enable_hierarchical_cache=True, hicache_ratio=0.5)
    assert ratio.host_total_tokens == 2048
    # --hicache-size is in GB and overrides the ratio: 1 GB of Llama-8B KV (128 KiB/token).
    sized = base.replace(enable_hierarchical_cache=True, hicache_size=1)
    assert sized.host_total_tokens == int(1e9 // (128 * 1024)) // PAGE * PAGE


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"disable_radix_cache": True}, "needs the radix cache"),
        ({"hicache_write_policy": "write_through_selective"}, "not write_through_selective"),
        ({"hicache_ratio": 0.0}, "hicache_ratio must be positive"),
        ({"hicache_size": -1}, "hicache_size must not be negative"),
        ({"token_backend": "torch"}, "hash backend only"),
    ],
)
def test_bad_hierarchical_cache_settings_are_refused(
    changes: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(enable_hierarchical_cache=True, **changes)  # type: ignore[arg-type]
