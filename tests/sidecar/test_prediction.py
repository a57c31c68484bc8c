"""Online output-length prediction: quantiles, conditioning, bounds, fallbacks, window."""

from __future__ import annotations

from engine_sidecar.policy import LengthKey, OutputLengthPredictor

KEY = LengthKey("acme", "m")


def test_prior_without_history_and_bounds() -> None:
    p = OutputLengthPredictor(prior_tokens=100)
    assert p.predict_total(KEY, 0.9, generated=0, max_new_tokens=1000) == 100
    assert p.predict_total(KEY, 0.9, generated=0, max_new_tokens=50) == 50
    assert p.predict_total(KEY, 0.9, generated=300, max_new_tokens=1000) == 600
    assert p.predict_total(KEY, 0.9, generated=1000, max_new_tokens=1000) == 1000


def test_quantiles_from_completions_and_conditioning() -> None:
    p = OutputLengthPredictor()
    for n in range(1, 101):
        p.observe(KEY, n * 10)
    assert p.predict_total(KEY, 0.5, 0, 10_000) == 500
    assert p.predict_total(KEY, 0.9, 0, 10_000) == 900
    # A request already at 800 is judged against the ones that got that far.
    assert p.predict_total(KEY, 0.5, 800, 10_000) == 900
    # Past everything ever seen: still predicts growth, never zero.
    assert p.predict_total(KEY, 0.9, 5000, 10_000) == 10_000
    assert p.predict_total(KEY, 0.9, 5000, 5001) == 5001


def test_falls_back_to_model_history_then_window_forgets() -> None:
    p = OutputLengthPredictor(window=4)
    for n in (10, 10, 10, 10):
        p.observe(KEY, n)
    other = LengthKey("newcomer", "m")
    assert p.samples(other) == 0
    assert p.predict_total(other, 0.9, 0, 1000) == 10
    for n in (500, 500, 500, 500):
        p.observe(KEY, n)
    assert p.samples(KEY) == 4
    assert p.predict_total(KEY, 0.5, 0, 1000) == 500
