"""What a router counts on top of an endpoint's report: what it sent since, never both."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from controlplane.routing import InFlight
from tests.polling import until
from tests.router.conftest import MODEL, make_fleet


def test_a_dispatch_counts_until_a_report_shows_it_or_it_ends() -> None:
    inflight = InFlight()
    inflight.add("e0", "a", 1.0)
    inflight.add("e0", "b", 2.0)
    inflight.add("e1", "c", 2.0)
    assert (inflight.counts, inflight.total) == ({"e0": 2, "e1": 1}, 3)
    inflight.reported("e0", 1.5)  # shows a, not b (sent after it was taken)
    assert (inflight.count("e0"), inflight.total) == (1, 2)
    inflight.remove("e0", "a")  # already shown: nothing to take back
    inflight.remove("e1", "c")  # ended before any report
    assert (inflight.counts, inflight.total) == ({"e0": 1}, 1)
    inflight.reported("e0", 9.0)
    assert (inflight.counts, inflight.total) == ({}, 0)


@pytest.mark.redis
async def test_a_running_stream_is_counted_by_its_endpoint_once_it_reports(
    redis_url: str,
) -> None:
    """The router's own count covers a stream only until the endpoint's next report,
    which includes it; counted in both, every long stream would weigh double."""
    async with make_fleet(redis_url, engines=1, speed_factor=1.0) as fleet:
        router = fleet.router.router
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2000, "stream": True,
                "ignore_eos": True}  # fmt: skip
        async with (
            aiohttp.ClientSession() as session,
            session.post(fleet.url + "/v1/completions", json=body) as reply,
        ):
            assert reply.status == 200
            await reply.content.readline()
            assert router.dispatch.inflight.count("e0") == 1
            await asyncio.sleep(0.2)  # the report is taken after the dispatch
            await fleet.report("e0", running_requests=1)
            await until(lambda: router.dispatch.inflight.count("e0") == 0, "the report to count it")
            pool = await (await session.get(fleet.url + "/weir/v1/pool")).json()
            (endpoint,) = pool["endpoints"]
            assert (endpoint["running_requests"], endpoint["router_inflight"]) == (1, 0)
