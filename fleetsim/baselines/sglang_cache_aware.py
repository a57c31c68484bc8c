"""SGLang router's `cache_aware` policy (sgl-project/sglang, sgl-router/src/policies/
cache_aware.rs), with its launch defaults: cache threshold 0.3, balance thresholds
abs 64 / rel 1.5.

Per request:
1. Loads are the router's own in-flight request counts per worker. The fleet is
   *imbalanced* when both `max - min > balance_abs_threshold` and
   `max > balance_rel_threshold × min`; then the least-loaded worker wins, and the
   request's prefix is still inserted into the tree under that worker.
2. Otherwise the approximate radix tree is searched for the longest matched prefix. If the
   match rate (matched / prompt length) exceeds `cache_threshold`, the worker that holds
   that deepest match wins; else the worker whose tree is smallest (the most cache room,
   as the router guesses it). The prompt is inserted under the chosen worker.

The tree is "approximate" because it records where the router sent prompts, never what
an engine actually still caches. SGLang's tree holds characters of request text; here it
holds the prompt's 512-token blocks (the unit prompts share in this simulator), and sizes
are counted in tokens. Among the workers holding the deepest match SGLang takes whichever
its map yields first; here the most recently used one, deterministically. The router's
LRU eviction (max_tree_size 2^26 characters every 120 s) never triggers at the scale of
these runs, so it is not modelled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fleetsim.baselines.view import WorkerView, healthy
from fleetsim.workloads import BLOCK_TOKENS, RequestSpec


@dataclass(slots=True)
class _Node:
    children: dict[int, _Node] = field(default_factory=dict)
    last_access: dict[int, float] = field(default_factory=dict)


class ApproximateRadixTree:
    """One multi-tenant tree over block ids; tenants are worker indexes."""

    def __init__(self) -> None:
        self._root = _Node()
        self._tokens: dict[int, int] = {}

    def add_tenant(self, worker: int) -> None:
        self._tokens.setdefault(worker, 0)

    def insert(self, blocks: Sequence[int], worker: int, now: float) -> None:
        self._tokens.setdefault(worker, 0)
        node = self._root
        for block in blocks:
            child = node.children.get(block)
            if child is None:
                child = node.children[block] = _Node()
            if worker not in child.last_access:
                self._tokens[worker] += BLOCK_TOKENS
            child.last_access[worker] = now
            node = child

    def prefix_match(self, blocks: Sequence[int], among: set[int]) -> tuple[int, int | None]:
        """(matched blocks, worker holding the deepest match) over workers in `among`."""
        node, depth, holder = self._root, 0, None
        for block in blocks:
            child = node.children.get(block)
            if child is None:
                break
            present = [(t, w) for w, t in child.last_access.items() if w in among]
            if not present:
                break
            node, depth = child, depth + 1
            holder = max(present)[1]
        return depth, holder

    def smallest_tenant(self, among: set[int]) -> int:
        return min(sorted(among), key=lambda w: self._tokens.get(w, 0))

    def remove_tenant(self, worker: int) -> None:
        self._tokens.pop(worker, None)
        stack = [self._root]
        while stack:
            node = stack.pop()
            node.last_access.pop(worker, None)
            stack.extend(node.children.values())


class SGLangCacheAware:
    name = "sglang_cache_aware"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree = ApproximateRadixTree()
        self.cache_hits = 0
        self.balancing_events = 0

    def route(self, request: RequestSpec, workers: Sequence[WorkerView], now: float) -> int:
        alive = healthy(workers)
        for w in alive:
            self.tree.add_tenant(w.index)
        loads = [w.outstanding for w in alive]
        high, low = max(loads), min(loads)
        if high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold:
            self.balancing_events += 1
            chosen = min(alive, key=lambda w: (w.outstanding, w.index)).index
        else:
            among = {w.index for w in alive}
            depth, holder = self.tree.prefix_match(request.block_ids, among)
            matched = min(request.input_tokens, depth * BLOCK_TOKENS)
            if holder is not None and matched / request.input_tokens > self.cache_threshold:
                self.cache_hits += 1
                chosen = holder
            else:
                chosen = self.tree.smallest_tenant(among)
        self.tree.insert(request.block_ids, chosen, now)
        return chosen

    def forget(self, worker: int) -> None:
        self.tree.remove_tenant(worker)
