"""Waiting in tests for what another task, process or server does next: one bounded poll,
whose failure says what it waited for and what it saw last."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


async def until(
    probe: Callable[[], Any],
    what: str = "",
    timeout_s: float = 15.0,
    *,
    every_s: float = 0.02,
    ignoring: tuple[type[Exception], ...] = (),
) -> Any:
    """Call `probe` (a function, or a coroutine function: a real request, say) until it
    returns something truthy, and return that. An exception in `ignoring` counts as a
    no (a store that is down for now). Fails after `timeout_s` naming `what`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = seen = None
        try:
            value = probe()
            if inspect.isawaitable(value):
                value = await value
            seen = value
        except ignoring as exc:
            seen = exc
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(_timed_out(probe, what, timeout_s, seen))
        await asyncio.sleep(every_s)


def wait_until(
    probe: Callable[[], Any], what: str = "", timeout_s: float = 15.0, *, every_s: float = 0.05
) -> Any:
    """`until` for code that runs no event loop (it blocks the thread)."""
    deadline = time.monotonic() + timeout_s
    while not (value := probe()):
        if time.monotonic() > deadline:
            raise AssertionError(_timed_out(probe, what, timeout_s, value))
        time.sleep(every_s)
    return value


def _timed_out(probe: Callable[[], Any], what: str, timeout_s: float, seen: object) -> str:
    """What a poll waited for (else the probe's own source line) and what it last saw."""
    if not what:
        try:
            what = inspect.getsource(probe).strip()
        except (OSError, TypeError):
            what = repr(probe)
    return f"timed out after {timeout_s:g} s waiting for {what} (last seen: {seen!r})"
