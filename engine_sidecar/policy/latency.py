"""Online latency prediction for one engine: the TTFT and TPOT a request will see.

Each request that reaches the sidecar is described by the engine's load at that moment
(`EngineLoad`: prompt tokens ahead of it waiting for prefill, the running batch, the KV
committed, the requests queued for KV) and, once the engine reports it, its own uncached
prompt. Its first token trains the TTFT model (arrival at the sidecar to first token:
feedback within seconds even for long answers), its end the TPOT model: two small
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
from typing import Final

# Feature scales: the models see tokens in thousands and the batch in tens, so the
# prior covariance means roughly the same thing for every weight.
_TOKENS: Final = 1e-3
_BATCH: Final = 0.1


@dataclass(slots=True)
class EngineLoad:
    """What the sidecar sees of its engine when a request reaches it: a value, never
    changed once made (not declared frozen: see `__init__`)."""

    prefill_ahead_tokens: int  # prompt tokens admitted or queued here, not yet prefilled
    running_requests: int  # requests in the engine's batch
    kv_fraction: float  # KV committed (used plus reserved growth) over capacity
    queued_requests: int = 0  # requests waiting here for KV to be admitted
    # Requests the engine itself holds waiting (its last load report): admitted here but
    # not scheduled there, or retracted by it and waiting to run again.
    engine_waiting_requests: int = 0

    # Written out, not generated, and not frozen: compiled (the fleet simulator's
    # `--compiled`), a dataclass's generated `__init__` stays interpreted, and a frozen
    # one's fields can only be set through `object.__setattr__`, a generic call per field;
    # a load is built at every heartbeat and admission.
    def __init__(
        self,
        prefill_ahead_tokens: int,
        running_requests: int,
        kv_fraction: float,
        queued_requests: int = 0,
        engine_waiting_requests: int = 0,
    ) -> None:
        if (prefill_ahead_tokens < 0 or running_requests < 0 or queued_requests < 0
                or engine_waiting_requests < 0):  # fmt: skip
            raise ValueError(
                f"engine load must not be negative: {prefill_ahead_tokens} tokens ahead, "
                f"{running_requests} running, {queued_requests} queued, "
                f"{engine_waiting_requests} waiting in the engine"
            )
        # NaN fails the comparison; `isinf`, unlike `isfinite`, is native when compiled.
        if not kv_fraction >= 0.0 or math.isinf(kv_fraction):
            raise ValueError(f"kv_fraction must be a finite number >= 0, got {kv_fraction}")
        self.prefill_ahead_tokens = prefill_ahead_tokens
        self.running_requests = running_requests
        self.kv_fraction = kv_fraction
        self.queued_requests = queued_requests
        self.engine_waiting_requests = engine_waiting_requests


@dataclass
class OnlineLinear:
    """y ≈ w·x by recursive least squares with forgetting factor `forgetting`.

    `prior` is the starting w and `prior_variance` how far each weight may move from it
    on the first samples. Each weight's variance is capped at its prior: a feature that
    stays constant for a long time would otherwise let its variance grow without bound
    under forgetting (windup), and the next change would throw the weights far off."""

    prior: Sequence[float]
    prior_variance: Sequence[float]
    forgetting: float = 0.995
    # Covariance resetting: when the recent relative errors keep one sign beyond this
    # (an engine that slowed down or sped up), the covariance goes back to the prior's,
    # so the next samples move the weights at once instead of against everything the
    # old regime taught (with relative weights, a slowdown's samples weigh less than the
    # fast ones before them, and forgetting alone would take hundreds of samples).
    drift_reset: float = 0.5
    weights: list[float] = field(init=False)
    _cov: list[list[float]] = field(init=False, repr=False)
    _drift: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.prior)
        if n == 0 or len(self.prior_variance) != n:
            raise ValueError("prior and prior_variance must be non-empty and of one length")
        if not 0.0 < self.forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {self.forgetting}")
        if any(not (math.isfinite(v) and v > 0.0) for v in self.prior_variance):
            raise ValueError("prior_variance must be positive numbers")
        self.weights = [float(w) for w in self.prior]
        self._drift = 0.0
        self._reset_cov()

    def _reset_cov(self) -> None:
        n = len(self.prior_variance)
        self._cov = [[self.prior_variance[i] if i == j else 0.0 for j in range(n)]
                     for i in range(n)]  # fmt: skip

    def predict(self, x: Sequence[float]) -> float:
        # A plain loop, the sum `sum(..., 0.0)` would add in the same order: compiled
        # (the fleet simulator's `--compiled`), a generator costs several times the
        # arithmetic, and this runs at every heartbeat.
        weights = self.weights
        if len(x) != len(weights):
            raise ValueError(f"{len(x)} features for {len(weights)} weights")
        total = 0.0
        for i in range(len(weights)):
            total += weights[i] * x[i]
        return total

    def update(self, x: Sequence[float], y: float, weight: float = 1.0) -> None:
        """One sample, counted `weight` times as much as a plain one."""
        if not (math.isfinite(y) and math.isfinite(weight) and weight > 0.0):
            return
        if y != 0.0:
            relative = max(-1.0, min(1.0, (y - self.predict(x)) / abs(y)))
            self._drift = 0.7 * self._drift + 0.3 * relative
            if abs(self._drift) > self.drift_reset:
                self._drift = 0.0
                self._reset_cov()
        scale = math.sqrt(weight)
        xs = [v * scale for v in x]
        n = len(xs)
        cov, lam, weights = self._cov, self.forgetting, self.weights
        if len(weights) != n:
            raise ValueError(f"{n} features for {len(weights)} weights")
        # Plain loops (as `predict`'s), each sum in the order `sum` would add: compiled,
        # generators cost several times the arithmetic, and every first token trains.
        px = []
        for row in cov:
            acc = 0.0
            for j in range(n):
                acc += row[j] * xs[j]
            px.append(acc)
        acc = 0.0
        for j in range(n):
            acc += xs[j] * px[j]
        denominator = lam + acc
        gain = [p / denominator for p in px]
        acc = 0.0
        for j in range(n):
            acc += weights[j] * xs[j]
        error = y * scale - acc
        self.weights = [weights[j] + gain[j] * error for j in range(n)]
        # P = (P - k (P x)ᵀ) / λ: P is symmetric, so x'P = (Px)ᵀ.
        for i, row in enumerate(cov):
            k = gain[i]
            for j in range(len(row)):
                row[j] = (row[j] - k * px[j]) / lam
        # Each weight's variance stays within its prior's: D P D with D_ii <= 1 keeps P
        # positive definite and leaves the directions the samples excite alone.
        shrink = [math.sqrt(cap / cov[i][i]) if cov[i][i] > cap else 1.0
                  for i, cap in enumerate(self.prior_variance)]  # fmt: skip
        if min(shrink) < 1.0:
            for i, row in enumerate(cov):
                for j in range(len(row)):
                    row[j] *= shrink[i] * shrink[j]


@dataclass(slots=True)
class LatencyForecast:
    """What the model predicts for a request reaching the engine under `load`, as the
    sidecar publishes it: the wait before its own prefill starts, the prefill seconds
    per uncached prompt token, and its TPOT. Every term is >= 0. A value, never changed
    once made (not frozen, as `EngineLoad`)."""

    load: EngineLoad
    wait_s: float
    prefill_s_per_token: float
    tpot_s: float

    def __init__(
        self, load: EngineLoad, wait_s: float, prefill_s_per_token: float, tpot_s: float
    ) -> None:  # written out, as `EngineLoad`'s: one is built at every heartbeat
        self.load = load
        self.wait_s = wait_s
        self.prefill_s_per_token = prefill_s_per_token
        self.tpot_s = tpot_s

    def ttft_s(self, uncached_tokens: int) -> float:
        return self.wait_s + max(0, uncached_tokens) * self.prefill_s_per_token


class LatencyPredictor:
    """The two online models of one engine.

    TTFT features: [1, prefill tokens ahead, own uncached tokens, running batch, KV
    fraction, requests queued for KV here, requests waiting in the engine, and the two
    prefills times the batch]: a prefill is chunked over iterations whose length grows
    with the batch beside it, and a request queued for KV, here or in the engine, waits
    for releases, about one per request ahead. TPOT features:
    [1, running batch, KV fraction, prefill tokens ahead] (a prefill beside the batch
    stretches its iterations). Observed values below
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
            (0.0, per_k, per_k, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
            (1.0, per_k, per_k, 1.0, 1.0, 1.0, 1.0, per_k, per_k),
            forgetting,
        )
        # TPOT moves with load by about its own size, not by orders of magnitude: the
        # slopes' prior keeps a few finished requests from extrapolating far.
        tpot_var = tpot_s * tpot_s
        self.tpot = OnlineLinear(
            (tpot_s, 0.0, 0.0, 0.0), (4.0 * tpot_var, tpot_var, tpot_var, tpot_var), forgetting
        )
        self.floor_s = floor_s
        self.samples = 0

    @staticmethod
    def _ttft_x(load: EngineLoad, uncached_tokens: int) -> tuple[float, ...]:
        ahead, own = load.prefill_ahead_tokens * _TOKENS, uncached_tokens * _TOKENS
        batch = load.running_requests * _BATCH
        return (1.0, ahead, own, batch, load.kv_fraction, load.queued_requests * _BATCH,
                load.engine_waiting_requests * _BATCH, ahead * batch, own * batch)  # fmt: skip

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
        w = self.ttft.weights
        per_token = (w[2] + w[8] * load.running_requests * _BATCH) * _TOKENS
        return LatencyForecast(
            load,
            max(0.0, self.ttft.predict(self._ttft_x(load, 0))),
            max(0.0, per_token),
            self.predicted_tpot_s(load),
        )

    def predicted_tpot_s(self, load: EngineLoad) -> float:
        """The TPOT a request reaching the engine now would see, under `load`."""
        return max(0.0, self.tpot.predict(self._tpot_x(load)))

    def observe_ttft(self, forecast: LatencyForecast, uncached_tokens: int, ttft_s: float) -> float:
        """Train on a request's first token (`forecast` is what was predicted when it
        arrived, `uncached_tokens` its prompt less what the engine had cached); returns
        the forecast's absolute percentage error."""
        self.samples += 1
        floor = max(ttft_s, self.floor_s)
        self.ttft.update(self._ttft_x(forecast.load, uncached_tokens), ttft_s, floor**-2)
        return abs(forecast.ttft_s(uncached_tokens) - ttft_s) / floor

    def observe_tpot(self, forecast: LatencyForecast, tpot_s: float) -> float:
        """Train on a finished request's TPOT; returns the forecast's absolute percentage
        error."""
        floor = max(tpot_s, self.floor_s)
        self.tpot.update(self._tpot_x(forecast.load), tpot_s, floor**-2)
        return abs(forecast.tpot_s - tpot_s) / floor
