"""A fleet's nominal capacity for a request mix, from the engines' own roofline.

The load sweep states offered load as a fraction of this figure. It is an estimate, not a
measurement: each engine decodes the largest batch its KV holds at the mix's mean context
(prompt plus half the answer, 85 % of the pool) and prefills each request's uncached
prompt alone. Where a policy actually saturates is what the sweep finds.
"""

from __future__ import annotations

from collections.abc import Sequence

from fleetsim.engine import EngineConfig
from fleetsim.workloads import RequestSpec, mix_stats


def nominal_capacity_rps(specs: Sequence[RequestSpec], engine: EngineConfig, engines: int) -> float:
    stats = mix_stats(list(specs))
    timing = engine.timing
    context = stats.mean_input + stats.mean_output / 2.0
    batch = max(1, min(engine.running_limit, int(0.85 * engine.total_tokens / context)))
    step = timing.iteration_s(0, 0, 0, batch, int(batch * context))
    decode_s = stats.mean_output * step / batch
    uncached = int(stats.mean_uncached_input)
    prefill_s = timing.iteration_s(uncached, uncached * (uncached + 1) // 2, 0, 0, 0)
    return engines / (decode_s + prefill_s)
