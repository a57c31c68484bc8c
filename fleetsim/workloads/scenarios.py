"""The long-request validation matrix as named, seeded scenarios.

Each scenario is a mixture of request classes. A class fixes the joint law of one kind of
traffic: who sends it (tenant, priority), how long its prompt and answer are (a bivariate
log-normal — log input and log output are correlated, not independent marginals), how
much of its prompt is a shared prefix (a Zipf-popular pool of prefixes: requests that
reuse a prefix carry it in front of their own text, so reuse and length go together),
when it arrives (Poisson over the run, or concentrated in a burst window), and what the
client does besides (deadline, cancellation, maximum wait). A scenario adds fleet events
(an engine failure) and a knob or two the simulator reads (P/D split, output-length
misprediction).

The ten scenarios are section 25 of the long-request governance essay
(../shared/reading/000_*): 1 short/short, 2 long-in/short-out, 3 short-in/long-out,
4 long/long, 5 a few long mixed into many short, 6 a long burst from one tenant, 7 high
prefix reuse on an owner at high water, 8 P/D handoff without decode credit, 9 preemption
modes crossing, 10 cancellations, deadlines and an engine failure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from controlplane.contract import TenantQuota
from fleetsim.workloads.misprediction import with_output_hints
from fleetsim.workloads.request import BLOCK_TOKENS, RequestSpec


@dataclass(frozen=True, slots=True)
class LengthLaw:
    """A clipped log-normal: `median × exp(sigma × z)`, clipped to [low, high]."""

    median: float
    sigma: float
    low: int
    high: int

    def draw(self, z: np.ndarray) -> np.ndarray:
        raw = self.median * np.exp(self.sigma * z)
        return np.clip(np.rint(raw), self.low, self.high).astype(np.int64)


@dataclass(frozen=True, slots=True)
class PrefixPool:
    """Shared prompt prefixes (system prompts, documents): `groups` of them, each
    `blocks` blocks long, chosen with Zipf(`skew`) popularity by a `reuse` fraction of
    the class's requests."""

    name: str
    groups: int
    blocks: int
    skew: float
    reuse: float


@dataclass(frozen=True, slots=True)
class Burst:
    """All of a class's arrivals fall in [start_s, start_s + length_s) instead of being
    spread over the run."""

    start_s: float
    length_s: float


@dataclass(frozen=True, slots=True)
class RequestClass:
    name: str
    share: float
    tenants: tuple[str, ...]
    priority: int
    input: LengthLaw
    output: LengthLaw
    correlation: float = 0.0
    max_tokens: int = 1024
    prefix: PrefixPool | None = None
    burst: Burst | None = None
    long: bool = False
    deadline_s: float = 0.0
    deadline_share: float = 0.0
    cancel_share: float = 0.0
    cancel_after_s: tuple[float, float] = (0.5, 10.0)
    max_wait_s: float = 0.0


@dataclass(frozen=True, slots=True)
class KVSizedQuota:
    """A tenant's concurrency quota sized to the fleet's KV by the operator's rule
    (docs/fleet-simulation.md, "The quota trade-off"): the tenant's requests at their
    typical size (`request_tokens`, prompt plus expected answer) hold at most `kv_share`
    of the fleet's KV, so the same scenario keeps its meaning at any fleet size."""

    name: str
    priority_class: str
    request_tokens: int
    kv_share: float

    def for_fleet(self, kv_tokens: int) -> TenantQuota:
        concurrency = int(self.kv_share * kv_tokens / self.request_tokens)
        return TenantQuota(
            name=self.name, priority_class=self.priority_class, max_concurrency=max(1, concurrency)
        )


@dataclass(frozen=True, slots=True)
class EngineFailure:
    at_s: float
    engine: int


@dataclass(frozen=True, slots=True)
class Scenario:
    """A named workload plus what the simulator needs to know about the fleet around it.

    `output_hint_bias` multiplies the true output length into the hint a predictor is
    given (1.0 exact, < 1 systematically under-predicted, > 1 over-predicted; 0 no hint).
    `prefill_share` > 0 splits the fleet into that fraction of prefill engines and the
    rest decode engines (P/D), with `decode_kv_factor` scaling the decode side's KV.
    `kv_factor` < 1 gives every engine that fraction of its KV while the offered load
    stays what the full-KV fleet serves: small-KV engines, as the live chaos test runs.
    `tenant_quotas` are what an operator would configure for this traffic in Weir's pool
    policy (baselines have no quotas); `quotas_for` sizes them to a fleet.
    """

    name: str
    title: str
    classes: tuple[RequestClass, ...]
    duration_s: float = 30.0
    failures: tuple[EngineFailure, ...] = ()
    output_hint_bias: float = 0.0
    prefill_share: float = 0.0
    decode_kv_factor: float = 1.0
    kv_factor: float = 1.0
    mixed_long_short: bool = False
    tenant_quotas: tuple[TenantQuota | KVSizedQuota, ...] = ()
    notes: str = ""

    def quotas_for(self, fleet_kv_tokens: int) -> tuple[TenantQuota, ...]:
        """The pool policy's quotas for a fleet holding `fleet_kv_tokens` of KV."""
        return tuple(
            q.for_fleet(fleet_kv_tokens) if isinstance(q, KVSizedQuota) else q
            for q in self.tenant_quotas
        )

    def generate(self, rate_rps: float, seed: int) -> list[RequestSpec]:
        """The scenario's requests for a total offered rate, deterministic for `seed`."""
        if not math.isfinite(rate_rps) or rate_rps <= 0:
            raise ValueError(f"rate must be a positive number, got {rate_rps}")
        rng = np.random.default_rng(seed)
        specs: list[RequestSpec] = []
        blocks = _BlockIds()
        for index, cls in enumerate(self.classes):
            specs.extend(_draw_class(cls, index, rate_rps * cls.share, self, rng, blocks))
        specs.sort(key=lambda s: (s.arrival_s, s.request_id))
        return with_output_hints(specs, self.output_hint_bias)

    def with_duration(self, duration_s: float) -> Scenario:
        scale = duration_s / self.duration_s
        classes = tuple(
            replace(c, burst=Burst(c.burst.start_s * scale, c.burst.length_s * scale))
            if c.burst
            else c
            for c in self.classes
        )
        failures = tuple(EngineFailure(f.at_s * scale, f.engine) for f in self.failures)
        return replace(self, duration_s=duration_s, classes=classes, failures=failures)


class _BlockIds:
    """Hands out fresh unique block ids; shared prefix blocks get stable ids per pool."""

    def __init__(self) -> None:
        self._next = 1
        self._pools: dict[tuple[str, int], tuple[int, ...]] = {}

    def fresh(self, count: int) -> tuple[int, ...]:
        start = self._next
        self._next += count
        return tuple(range(start, start + count))

    def shared(self, pool: PrefixPool, group: int) -> tuple[int, ...]:
        key = (pool.name, group)
        if key not in self._pools:
            self._pools[key] = self.fresh(pool.blocks)
        return self._pools[key]


def _draw_class(
    cls: RequestClass,
    index: int,
    rate: float,
    scenario: Scenario,
    rng: np.random.Generator,
    blocks: _BlockIds,
) -> list[RequestSpec]:
    if cls.burst is None:
        window_start, window = 0.0, scenario.duration_s
    else:
        window_start, window = cls.burst.start_s, cls.burst.length_s
    count = int(rng.poisson(rate * scenario.duration_s))
    if count == 0:
        return []
    arrivals = np.sort(window_start + rng.uniform(0.0, window, size=count))
    z_in = rng.standard_normal(count)
    z_other = rng.standard_normal(count)
    rho = cls.correlation
    z_out = rho * z_in + math.sqrt(max(0.0, 1.0 - rho * rho)) * z_other
    inputs = cls.input.draw(z_in)
    outputs = cls.output.draw(z_out)
    tenants = rng.integers(0, len(cls.tenants), size=count)
    reuse = rng.uniform(size=count)
    groups = _zipf_choice(rng, cls.prefix, count)
    cancel = rng.uniform(size=count) < cls.cancel_share
    cancel_after = rng.uniform(*cls.cancel_after_s, size=count)
    deadline = rng.uniform(size=count) < cls.deadline_share
    specs = []
    for i in range(count):
        prefix: tuple[int, ...] = ()
        if cls.prefix is not None and reuse[i] < cls.prefix.reuse:
            prefix = blocks.shared(cls.prefix, int(groups[i]))
        prompt = len(prefix) * BLOCK_TOKENS + int(inputs[i])
        own = -(-prompt // BLOCK_TOKENS) - len(prefix)
        specs.append(
            RequestSpec(
                request_id=f"{scenario.name[:6]}-{index:02d}-{i:06d}",
                arrival_s=float(arrivals[i]),
                tenant=cls.tenants[int(tenants[i])],
                priority=cls.priority,
                input_tokens=prompt,
                output_tokens=int(outputs[i]),
                max_tokens=cls.max_tokens,
                block_ids=prefix + blocks.fresh(own),
                category=cls.name,
                deadline_s=cls.deadline_s if deadline[i] else 0.0,
                cancel_after_s=float(cancel_after[i]) if cancel[i] else 0.0,
                max_wait_s=cls.max_wait_s,
                tags=("long",) if cls.long else ("short",),
            )
        )
    return specs


def _zipf_choice(rng: np.random.Generator, pool: PrefixPool | None, count: int) -> np.ndarray:
    if pool is None:
        return np.zeros(count, dtype=np.int64)
    ranks = np.arange(1, pool.groups + 1, dtype=np.float64)
    weights = ranks**-pool.skew
    return rng.choice(pool.groups, size=count, p=weights / weights.sum())


# --- the matrix ------------------------------------------------------------------------

_INTERACTIVE = ("chat-a", "chat-b", "chat-c", "chat-d")
_SYSTEM_PROMPTS = PrefixPool("system", groups=16, blocks=2, skew=1.0, reuse=0.5)
_SHORT = RequestClass(
    name="short",
    share=1.0,
    tenants=_INTERACTIVE,
    priority=2,
    input=LengthLaw(median=600, sigma=0.8, low=32, high=4096),
    output=LengthLaw(median=160, sigma=0.8, low=8, high=1024),
    correlation=0.2,
    max_tokens=1024,
    prefix=_SYSTEM_PROMPTS,
)
_LONG_IN = LengthLaw(median=20000, sigma=0.35, low=8192, high=28000)
_LONG_OUT = LengthLaw(median=2500, sigma=0.5, low=1024, high=8192)
_SHORT_OUT = LengthLaw(median=200, sigma=0.7, low=16, high=1024)
_SHORT_IN = LengthLaw(median=800, sigma=0.7, low=64, high=4096)
_RUNAWAY_OUT = LengthLaw(median=3000, sigma=0.9, low=512, high=12000)


def _short(share: float) -> RequestClass:
    return replace(_SHORT, share=share)


def _long(
    name: str,
    share: float,
    input: LengthLaw,
    output: LengthLaw,
    *,
    tenants: tuple[str, ...] = ("batch",),
    max_tokens: int = 8192,
    **extra: object,
) -> RequestClass:
    return replace(
        RequestClass(
            name=name,
            share=share,
            tenants=tenants,
            priority=0,
            input=input,
            output=output,
            correlation=0.3,
            max_tokens=max_tokens,
            long=True,
            max_wait_s=120.0,
        ),
        **extra,  # type: ignore[arg-type]
    )


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            name="short_short",
            title="1. short in / short out (baseline)",
            classes=(_short(1.0),),
        ),
        Scenario(
            name="long_in_short_out",
            title="2. long in / short out: TTFT and chunk fairness",
            classes=(_short(0.85), _long("long_in", 0.15, _LONG_IN, _SHORT_OUT, max_tokens=1024)),
            mixed_long_short=True,
        ),
        Scenario(
            name="short_in_long_out",
            title="3. short in / long out: KV growth and TPOT",
            classes=(_short(0.7), _long("long_out", 0.3, _SHORT_IN, _LONG_OUT)),
            mixed_long_short=True,
        ),
        Scenario(
            name="long_long",
            title="4. long in / long out: the worst end-to-end resources",
            classes=(
                _short(0.8),
                _long(
                    "long_long",
                    0.2,
                    LengthLaw(median=12000, sigma=0.35, low=4096, high=20000),
                    LengthLaw(median=2000, sigma=0.5, low=512, high=6000),
                ),
            ),
            mixed_long_short=True,
        ),
        Scenario(
            name="few_long_many_short",
            title="5. a few long requests mixed into many short ones",
            classes=(
                _short(0.94),
                _long("long_in", 0.03, _LONG_IN, _SHORT_OUT, max_tokens=1024),
                _long("long_out", 0.03, _SHORT_IN, _LONG_OUT),
            ),
            mixed_long_short=True,
        ),
        Scenario(
            name="tenant_long_burst",
            title="6. a burst of long requests from one tenant",
            classes=(
                _short(0.85),
                _long(
                    "bulk_burst",
                    0.15,
                    LengthLaw(median=8000, sigma=0.4, low=2048, high=20000),
                    _LONG_OUT,
                    tenants=("bulk",),
                    burst=Burst(start_s=8.0, length_s=3.0),
                ),
            ),
            mixed_long_short=True,
            # The bulk tenant's concurrency, by the upper of the two rules an operator
            # can apply (docs/fleet-simulation.md, "The quota trade-off"): its requests'
            # KV (8K prompt + 2.8K answer) leaves the fleet below the pressure watermark,
            # with room for everyone else's: 0.6 of the fleet's KV (33 requests on 16
            # engines at a quarter of the KV, 132 at full KV). The interactive tenants are
            # listed without limits (a pool that declares quotas refuses tenants it does
            # not know).
            tenant_quotas=(
                KVSizedQuota(
                    name="bulk", priority_class="batch", request_tokens=10_900, kv_share=0.6
                ),
                *(TenantQuota(name=t) for t in _INTERACTIVE),
            ),
        ),
        Scenario(
            name="hot_prefix_high_water",
            title="7. high prefix reuse whose owner is at high water",
            classes=(
                replace(
                    _short(0.7),
                    prefix=PrefixPool("hot-doc", groups=3, blocks=16, skew=1.5, reuse=0.9),
                ),
                _long(
                    "hot_long_out",
                    0.3,
                    _SHORT_IN,
                    _LONG_OUT,
                    prefix=PrefixPool("hot-doc", groups=3, blocks=16, skew=1.5, reuse=0.9),
                ),
            ),
            mixed_long_short=True,
        ),
        Scenario(
            name="pd_no_decode_credit",
            title="8. P/D handoff while decode has no credit",
            classes=(
                _short(0.6),
                _long("long_in", 0.4, _LONG_IN, _LONG_OUT),
            ),
            # A quarter of the engines prefill; three quarters decode, on the same GPUs.
            # (Decode engines with half the KV cannot hold these 8K–28K prompts at the
            # bench's quarter-KV scale: every policy lost them at the engine.)
            prefill_share=0.25,
            mixed_long_short=True,
            notes="prefill engines hand finished prompts to decode engines",
        ),
        Scenario(
            name="preemption_crossing",
            title="9. swap / recompute / migrate crossing: a KV burst on small-KV engines",
            classes=(
                _short(0.55),
                _long(
                    "runaway_out",
                    0.30,
                    _SHORT_IN,
                    _RUNAWAY_OUT,
                    max_tokens=12000,
                ),
                # The live chaos test's KV burst (`weir bench chaos`), scaled: long answers
                # asked for at once, far more KV than the fleet has free.
                _long(
                    "kv_burst",
                    0.15,
                    _SHORT_IN,
                    _RUNAWAY_OUT,
                    max_tokens=12000,
                    burst=Burst(start_s=10.0, length_s=1.0),
                ),
            ),
            output_hint_bias=0.25,
            kv_factor=0.35,
            mixed_long_short=True,
            notes="output lengths under-predicted 4x: growth outruns every reserve",
        ),
        Scenario(
            name="cancel_deadline_failure",
            title="10. cancellations, deadlines, an engine and a sidecar lost",
            classes=(
                replace(_short(0.8), cancel_share=0.1, deadline_share=0.3, deadline_s=15.0),
                _long(
                    "long_out",
                    0.2,
                    _SHORT_IN,
                    _LONG_OUT,
                    cancel_share=0.2,
                    cancel_after_s=(1.0, 20.0),
                    deadline_share=0.3,
                    deadline_s=60.0,
                ),
            ),
            # An engine lost for good, then a sidecar (or its pod): to the router both
            # break their streams, which it resumes elsewhere, as the live chaos test's.
            failures=(EngineFailure(at_s=15.0, engine=3), EngineFailure(at_s=25.0, engine=1)),
            mixed_long_short=True,
        ),
    )
}


def scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise KeyError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}") from None


@dataclass(frozen=True, slots=True)
class MixStats:
    """Mean tokens per request of a generated mix, for sizing the offered load."""

    requests: int
    mean_input: float
    mean_output: float
    mean_uncached_input: float = field(default=0.0)


def mix_stats(specs: list[RequestSpec]) -> MixStats:
    """Means over a sample; `mean_uncached_input` counts each shared block once."""
    if not specs:
        raise ValueError("empty request mix")
    seen: set[int] = set()
    uncached = 0
    for spec in specs:
        fresh = [b for b in spec.block_ids if b not in seen]
        seen.update(fresh)
        uncached += min(spec.input_tokens, len(fresh) * BLOCK_TOKENS)
    n = len(specs)
    return MixStats(
        requests=n,
        mean_input=sum(s.input_tokens for s in specs) / n,
        mean_output=sum(s.generated_tokens for s in specs) / n,
        mean_uncached_input=uncached / n,
    )
