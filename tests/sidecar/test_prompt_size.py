"""Text prompts sized before the engine has tokenized them: a byte a token until the
engine's counts say otherwise, then near its own bytes per token, never under a byte."""

from __future__ import annotations

import math

import pytest

from controlplane.contract import EngineAPI
from engine_sidecar.intake import IntakeLimits, parse_intake
from engine_sidecar.policy import PromptSizer

LIMITS = IntakeLimits("m", 4096)


def test_a_byte_a_token_until_the_engine_has_counted_a_prompt() -> None:
    sizer = PromptSizer()
    assert sizer.tokens(1000) == 1000
    sizer.observe(0, 10)  # nothing to learn from
    sizer.observe(10, 0)
    assert (sizer.observed, sizer.tokens(1000)) == (0, 1000)


def test_it_learns_the_engine_s_bytes_per_token_and_keeps_a_margin_under_it() -> None:
    sizer = PromptSizer()
    sizer.observe(400, 100)  # the first count moves it all the way
    assert sizer.bytes_per_token == 4.0
    for _ in range(200):
        sizer.observe(400, 100)
    assert sizer.tokens(400) == math.ceil(400 / (4.0 * 0.8)) == 125  # over 100, not under
    for _ in range(200):  # the engine's tokenizer changes: it follows
        sizer.observe(300, 100)
    assert sizer.bytes_per_token == pytest.approx(3.0, rel=1e-3)


def test_it_never_counts_a_prompt_at_more_than_a_token_a_byte_less_than_a_byte_each() -> None:
    sizer = PromptSizer()
    for _ in range(50):
        sizer.observe(10, 40)  # templates, special tokens: more tokens than bytes
    assert sizer.bytes_per_token == 1.0
    assert sizer.tokens(123) == 123


def test_settings_out_of_range_are_refused() -> None:
    for bad in ({"bytes_per_token": 0.5}, {"margin": 0.0}, {"margin": 1.5}, {"weight": 0.0}):
        with pytest.raises(ValueError, match="bytes_per_token >= 1"):
            PromptSizer(**bad)  # type: ignore[arg-type]


def test_the_intake_sizes_text_prompts_with_it_and_says_what_it_may_learn_from() -> None:
    sizer = PromptSizer(bytes_per_token=4.0)
    text = parse_intake(EngineAPI.GENERATE, {"text": "x" * 320}, LIMITS, sizer)
    assert (text.prompt_tokens, text.prompt_bytes, text.template_tokens) == (100, 320, 0)
    chat = parse_intake(
        EngineAPI.CHAT, {"model": "m", "messages": [{"role": "user", "content": "y" * 314}]},
        LIMITS, sizer,
    )  # fmt: skip
    # "user\n" + 314 + "\n": 320 bytes, and the template's 8 tokens for the one message.
    assert (chat.prompt_tokens, chat.prompt_bytes, chat.template_tokens) == (108, 320, 8)
    ids = parse_intake(EngineAPI.GENERATE, {"input_ids": [1, 2, 3]}, LIMITS, sizer)
    assert (ids.prompt_tokens, ids.prompt_bytes) == (3, 0)  # known: nothing to learn
