"""Online latency prediction for one engine: the TTFT and TPOT a request will see.

Each request that reaches the sidecar is described by the engine's load at that moment
(`EngineLoad`: prompt tokens ahead of it waiting for prefill, the running batch, the KV
committed) and, once the engine reports it, its own uncached prompt. When it finishes,
its observed TTFT (arrival at the sidecar to first token) and TPOT train two small
linear models by exponentially weighted recursive least squares (`OnlineLinear`): a few
features, O(features²) work and memory per update, old samples forgotten at a fixed
rate (a sample's weight halves every ~35 newer ones by default) so the model follows an
engine that slows down or speeds up within a hundred or so requests.

Both models are fitted in relative terms (each sample weighted by 1 / observed²): the
error that matters is a percentage — half a second is nothing on a 20 s queue and
everything on a 50 ms prefill — and the mean absolute percentage error is what is
measured. Before any sample, the priors make the predictions the calibration the
router used before there was a predictor (`prefill_s_per_token` per prompt token ahead
and per own token, a fixed TPOT).

TTFT is linear in the request's uncached prompt, so the sidecar publishes the model's
terms rather than one number (`LatencyForecast`): the predicted wait before a new
request's own prefill starts and the learned prefill seconds per uncached token. A
router predicts any request's TTFT from them without a round trip.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

# Feature scales: the models see tokens in thousands and the batch in tens, so the
# prior covariance means roughly the same thing for every weight.
_TOKENS = 1e-3
_BATCH = 0.1


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What the sidecar sees of its engine when a request reaches it."""

    prefill_ahead_tokens: int  # prompt tokens admitted or queued here, not yet prefilled
    running_requests: int  # requests in the engine's batch
    kv_fraction: float  # KV committed (used plus reserved growth) over capacity

    def __post_init__(self) -> None:
        if self.prefill_ahead_tokens < 0 or self.running_requests < 0:
            raise ValueError(f"engine load must not be negative: {self}")
        if not math.isfinite(self.kv_fraction) or self.kv_fraction < 0.0:
            raise ValueError(f"kv_fraction must be a finite number >= 0, got {self.kv_fraction}")


@dataclass
class OnlineLinear:
    """y ≈ w·x by recursive least squares with forgetting factor `forgetting`.

    `prior` is the starting w and `prior_variance` how far each weight may move from it
    on the first samples. The covariance's trace is capped at its prior's: a feature that
    stays constant for a long time would otherwise let its variance grow without bound
    under forgetting (windup), and the next change would throw the weights far off."""

    prior: Sequence[float]
    prior_variance: Sequence[float]
    forgetting: float = 0.995
    weights: list[float] = field(init=False)
    _cov: list[list[float]] = field(init=False, repr=False)
    _max_trace: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.prior)
        if n == 0 or len(self.prior_variance) != n:
            raise ValueError("prior and prior_variance must be non-empty and of one length")
        if not 0.0 < self.forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {self.forgetting}")
        if any(not (math.isfinite(v) and v > 0.0) for v in self.prior_variance):
            raise ValueError("prior_variance must be positive numbers")
        self.weights = [float(w) for w in self.prior]
        self._cov = [[self.prior_variance[i] if i == j else 0.0 for j in range(n)]
                     for i in range(n)]  # fmt: skip
        self._max_trace = float(sum(self.prior_variance))

    def predict(self, x: Sequence[float]) -> float:
        return sum(w * v for w, v in zip(self.weights, x, strict=True))

    def update(self, x: Sequence[float], y: float, weight: float = 1.0) -> None:
        """One sample, counted `weight` times as much as a plain one."""
        if not (math.isfinite(y) and math.isfinite(weight) and weight > 0.0):
            return
        scale = math.sqrt(weight)
        xs = [v * scale for v in x]
        cov, lam = self._cov, self.forgetting
        px = [sum(row[j] * xs[j] for j in range(len(xs))) for row in cov]
        denominator = lam + sum(a * b for a, b in zip(xs, px, strict=True))
        gain = [p / denominator for p in px]
        error = y * scale - sum(w * v for w, v in zip(self.weights, xs, strict=True))
        self.weights = [w + k * error for w, k in zip(self.weights, gain, strict=True)]
        # P = (P - k (P x)ᵀ) / λ: P is symmetric, so x'P = (Px)ᵀ.
        for i, row in enumerate(cov):
            k = gain[i]
            for j in range(len(row)):
                row[j] = (row[j] - k * px[j]) / lam
        trace = sum(cov[i][i] for i in range(len(cov)))
        if trace > self._max_trace:
            shrink = self._max_trace / trace
            for row in cov:
                for j in range(len(row)):
                    row[j] *= shrink


@dataclass(frozen=True, slots=True)
class LatencyForecast:
    """What the model predicts for a request reaching the engine under `load`, as the
    sidecar publishes it: the wait before its own prefill starts, the prefill seconds
    per uncached prompt token, and its TPOT. Every term is >= 0."""

    load: EngineLoad
    wait_s: float
    prefill_s_per_token: float
    tpot_s: float

    def ttft_s(self, uncached_tokens: int) -> float:
        return self.wait_s + max(0, uncached_tokens) * self.prefill_s_per_token


@dataclass(frozen=True, slots=True)
class ForecastError:
    """A finished request's absolute percentage errors, |predicted - observed| / observed
    (None for a measure it did not have: no TPOT from a single-token answer)."""

    ttft: float
    tpot: float | None


class LatencyPredictor:
    """The two online models of one engine.

    TTFT features: [1, prefill tokens ahead, own uncached tokens, running batch, KV
    fraction]; TPOT features: [1, running batch, KV fraction, prefill tokens ahead]
    (a prefill beside the batch stretches its iterations). Observed values below
    `floor_s` are weighted as `floor_s`: a near-zero TTFT would otherwise weigh without
    bound in relative terms."""

    def __init__(
        self,
        prefill_s_per_token: float = 5e-5,
        tpot_s: float = 0.02,
        forgetting: float = 0.98,
        floor_s: float = 1e-3,
    ) -> None:
        if not (prefill_s_per_token > 0.0 and tpot_s > 0.0 and floor_s > 0.0):
            raise ValueError("latency predictor: priors and floor_s must be positive")
        per_k = prefill_s_per_token / _TOKENS
        self.ttft = OnlineLinear(
            (0.0, per_k, per_k, 0.0, 0.0), (1.0, per_k, per_k, 1.0, 1.0), forgetting
        )
        self.tpot = OnlineLinear((tpot_s, 0.0, 0.0, 0.0), (tpot_s, tpot_s, tpot_s, tpot_s),
                                 forgetting)  # fmt: skip
        self.floor_s = floor_s
        self.samples = 0

    @staticmethod
    def _ttft_x(load: EngineLoad, uncached_tokens: int) -> tuple[float, ...]:
        return (
            1.0,
            load.prefill_ahead_tokens * _TOKENS,
            uncached_tokens * _TOKENS,
            load.running_requests * _BATCH,
            load.kv_fraction,
        )

    @staticmethod
    def _tpot_x(load: EngineLoad) -> tuple[float, ...]:
        return (
            1.0,
            load.running_requests * _BATCH,
            load.kv_fraction,
            load.prefill_ahead_tokens * _TOKENS,
        )

    def forecast(self, load: EngineLoad) -> LatencyForecast:
        """The prediction for a request reaching the engine now, under `load`."""
        return LatencyForecast(
            load,
            max(0.0, self.ttft.predict(self._ttft_x(load, 0))),
            max(0.0, self.ttft.weights[2] * _TOKENS),
            max(0.0, self.tpot.predict(self._tpot_x(load))),
        )

    def observe(
        self, forecast: LatencyForecast, uncached_tokens: int, ttft_s: float, tpot_s: float | None
    ) -> ForecastError:
        """Train on a finished request (`forecast` is what was predicted when it arrived,
        `tpot_s` None without a second token); returns how far that prediction was."""
        load = forecast.load
        self.samples += 1
        ttft_floor = max(ttft_s, self.floor_s)
        self.ttft.update(self._ttft_x(load, uncached_tokens), ttft_s, ttft_floor**-2)
        error = ForecastError(abs(forecast.ttft_s(uncached_tokens) - ttft_s) / ttft_floor, None)
        if tpot_s is None:
            return error
        tpot_floor = max(tpot_s, self.floor_s)
        self.tpot.update(self._tpot_x(load), tpot_s, tpot_floor**-2)
        return ForecastError(error.ttft, abs(forecast.tpot_s - tpot_s) / tpot_floor)
