"""Reading a counter from what a local process exports on `/metrics`: benchmarks and tests
count a fleet's events (preemptions, resumes, routing decisions) where it reports them."""

from __future__ import annotations

from typing import Any


async def counter(http: Any, url: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples at `url`/metrics (an aiohttp session's GET) whose labels
    include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    async with http.get(url + "/metrics") as reply:
        text = await reply.text()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )
