"""A stopping operator settles its status passes before it closes their connections: kopf
abandons a timer that does not exit at once, so the cleanup waits for the passes still
running (or cancels them after a grace) and none is left holding a connection."""

from __future__ import annotations

import asyncio

from fleet_operator.handlers import StatusPasses


async def test_a_running_pass_finishes_before_the_cleanup_goes_on() -> None:
    passes, release, finished = StatusPasses(), asyncio.Event(), []

    async def status_pass() -> None:
        await release.wait()
        finished.append("pass")

    passes.start(status_pass())
    settling = asyncio.ensure_future(passes.settle(grace_s=30))
    await asyncio.sleep(0)
    assert not settling.done()  # held by the pass
    release.set()
    await settling
    assert finished == ["pass"]


async def test_a_stuck_pass_is_cancelled_after_the_grace_and_unwinds() -> None:
    passes, unwound = StatusPasses(), []

    async def stuck() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            unwound.append("closed its connection")

    task = passes.start(stuck())
    await passes.settle(grace_s=0.01)
    assert task.cancelled()
    assert unwound == ["closed its connection"]
    await passes.settle(grace_s=30)  # nothing left: returns at once
