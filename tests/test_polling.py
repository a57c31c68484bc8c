"""The tests' one polling helper: it returns what it waited for, and a timeout says what it
waited for and what it saw last."""

from __future__ import annotations

import pytest

from tests.polling import until, wait_until


async def test_until_returns_the_first_truthy_value_of_a_function_or_a_coroutine() -> None:
    seen = iter([0, [], "ready"])
    assert await until(lambda: next(seen), "the third value", every_s=0) == "ready"

    async def probe() -> dict[str, int]:
        return {"endpoints": 2}

    assert await until(probe, "a coroutine's answer") == {"endpoints": 2}


async def test_a_timeout_names_what_it_waited_for_and_the_last_value_or_error() -> None:
    with pytest.raises(AssertionError, match=r"waiting for the queue to drain \(last seen: 0\)"):
        await until(lambda: 0, "the queue to drain", timeout_s=0.05)

    def down() -> bool:
        raise ConnectionError("store down")

    with pytest.raises(AssertionError, match=r"last seen: ConnectionError\('store down'\)"):
        await until(down, "the store", timeout_s=0.05, ignoring=(ConnectionError,))


def test_without_a_name_the_timeout_quotes_the_probe_and_blocking_waits_say_the_same() -> None:
    with pytest.raises(AssertionError, match=r"wait_until\(lambda: 0, timeout_s=0.05"):
        wait_until(lambda: 0, timeout_s=0.05, every_s=0.01)
