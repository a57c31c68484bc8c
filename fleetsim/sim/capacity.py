"""A fleet's nominal capacity for a request mix, from the engines' own roofline.

The load sweep states offered load as a fraction of this figure. It is an estimate, not a
measurement: an engine is taken to decode the largest batch its KV holds at the mix's
mean context (prompt plus half the answer, 85 % of the pool), and to prefill each
request's uncached prompt at the compute roofline (prefills share iterations); a request costs its prefill plus its share of the
decode iterations, averaged over the mix. Where a policy actually saturates is what the
sweep finds.
"""

from __future__ import annotations

from collections.abc import Sequence

from fleetsim.engine import EngineConfig
from fleetsim.workloads import BLOCK_TOKENS, RequestSpec, mix_stats


def nominal_capacity_rps(specs: Sequence[RequestSpec], engine: EngineConfig, engines: int) -> float:
    stats = mix_stats(list(specs))
    timing = engine.timing
    context = stats.mean_input + stats.mean_output / 2.0
    batch = max(1, min(engine.running_limit, int(0.85 * engine.total_tokens / context)))
    per_token_decode = timing.iteration_s(0, 0, 0, batch, int(batch * context)) / batch
    model, hw = timing.model, timing.hardware
    rate = hw.flops * hw.compute_efficiency
    seen: set[int] = set()
    total = 0.0
    for spec in specs:
        fresh = [b for b in spec.block_ids if b not in seen]
        seen.update(fresh)
        uncached = min(spec.input_tokens, len(fresh) * BLOCK_TOKENS)
        cached = spec.input_tokens - uncached
        pairs = (spec.input_tokens * (spec.input_tokens + 1) - cached * (cached + 1)) // 2
        # Prefills share iterations (one weight read for many prompts): count compute only.
        total += (2.0 * model.params * uncached + 4.0 * model.layers * model.hidden * pairs) / rate
        total += spec.generated_tokens * per_token_decode
    return engines * len(specs) / total
