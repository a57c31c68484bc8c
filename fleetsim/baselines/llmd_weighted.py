"""llm-d's default endpoint-picker profile: queue ×2, KV utilization ×2, prefix ×3, then
the max-score picker.

Source: the `default-plugins.yaml` that llm-d's InferencePool chart installs (github
llm-d/llm-d-inference-scheduler and kubernetes-sigs/gateway-api-inference-extension,
`config/charts/inferencepool`): plugins `queue-scorer`, `kv-cache-utilization-scorer`,
`prefix-cache-scorer` with weights 2, 2, 3 in profile `default`, and the default
`max-score-picker`. The scorers, as in gateway-api-inference-extension
`pkg/epp/scheduling/framework/plugins`:

- queue: min-max normalised waiting-queue size across candidates, shortest queue 1,
  longest 0, all equal 1;
- kv-cache-utilization: `1 - KVCacheUsagePercent`;
- prefix-cache: matched prompt blocks / prompt blocks, from an approximate index of where
  the picker sent each 64-token block hash (`maxPrefixBlocksToMatch` 256,
  `lruCapacityPerServer` 31250 blocks), recorded when a request is scheduled;
- max-score picker: the highest weighted sum; ties broken at random (it shuffles first).

Queue and KV figures are scraped from the engines' metrics and are as stale as the
simulator's metric delay makes them. Prompts here are 512-token blocks, so one simulator
block stands for eight of llm-d's 64-token hashes, and the per-server LRU holds
31250 / 8 of them.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

from fleetsim.baselines.view import WorkerView, healthy
from fleetsim.workloads import BLOCK_TOKENS, RequestSpec

HASH_BLOCK_TOKENS: Final = 64
MAX_PREFIX_BLOCKS: Final = 256
LRU_CAPACITY_PER_SERVER: Final = 31250
_SUB = BLOCK_TOKENS // HASH_BLOCK_TOKENS


class LlmdWeighted:
    name = "llmd_weighted"

    def __init__(
        self,
        seed: int = 0,
        queue_weight: float = 2.0,
        kv_weight: float = 2.0,
        prefix_weight: float = 3.0,
    ) -> None:
        self.weights = (queue_weight, kv_weight, prefix_weight)
        self._rng = random.Random(seed)
        self._lru: dict[int, OrderedDict[int, None]] = {}
        self._capacity = LRU_CAPACITY_PER_SERVER // _SUB

    def route(self, request: RequestSpec, workers: Sequence[WorkerView], now: float) -> int:
        alive = healthy(workers)
        queues = [w.waiting_requests for w in alive]
        q_low, q_high = min(queues), max(queues)
        total_blocks = min(MAX_PREFIX_BLOCKS, request.input_tokens // HASH_BLOCK_TOKENS)
        considered = request.block_ids[: -(-MAX_PREFIX_BLOCKS // _SUB)]
        wq, wkv, wp = self.weights
        scores = []
        for w in alive:
            queue = 1.0 if q_high == q_low else (q_high - w.waiting_requests) / (q_high - q_low)
            kv = 1.0 - min(1.0, max(0.0, w.kv_utilization))
            prefix = 0.0
            if total_blocks > 0:
                held = self._matched(w.index, considered)
                prefix = min(total_blocks, held * _SUB) / total_blocks
            scores.append(wq * queue + wkv * kv + wp * prefix)
        best = max(scores)
        tied = [w.index for w, s in zip(alive, scores, strict=True) if s == best]
        chosen = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        self._record(chosen, considered)
        return chosen

    def _matched(self, worker: int, blocks: Sequence[int]) -> int:
        lru = self._lru.get(worker)
        if not lru:
            return 0
        count = 0
        for block in blocks:
            if block not in lru:
                break
            count += 1
        return count

    def _record(self, worker: int, blocks: Sequence[int]) -> None:
        lru = self._lru.setdefault(worker, OrderedDict())
        for block in blocks:
            lru[block] = None
            lru.move_to_end(block)
        while len(lru) > self._capacity:
            lru.popitem(last=False)

    def forget(self, worker: int) -> None:
        self._lru.pop(worker, None)
