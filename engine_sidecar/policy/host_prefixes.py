"""The prompts whose pages wait in the engine's host tier, as routers key them.

An offload leaves a request's pages in host memory (SGLang's hierarchical cache) until
its continuation loads them back. Whichever router resumes it (the one that placed it
may not be the one that resumes it, and a continuation handed back goes through the
router again) should send it where those pages are, so the sidecar publishes them in
its heartbeat (`EndpointState.host_prefixes`): each prompt by the last of its chained
block hashes, which the router that placed it sent along (`x-weir-prefix-block`). A
continuation resumed here has its pages back on the device and leaves the list. What it
lists is bounded as the engine's tier is, oldest out first (the tier evicts LRU): at most
`MAX_HOST_PREFIXES`, holding at most the tier's capacity in tokens.
"""

from __future__ import annotations

from collections import OrderedDict

from controlplane.contract import MAX_HOST_PREFIXES


class HostPrefixes:
    """Block hash -> tokens its request left in the host tier, oldest first."""

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 0:
            raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self._held: OrderedDict[int, int] = OrderedDict()
        self._tokens = 0

    def offloaded(self, block: int, tokens: int) -> None:
        """A request keyed `block` (0: unkeyed, nothing to publish) left `tokens` there."""
        if not block:
            return
        self.loaded(block)
        self._held[block] = tokens
        self._tokens += tokens
        while self._held and (
            len(self._held) > MAX_HOST_PREFIXES or self._tokens > self.capacity_tokens
        ):
            self._tokens -= self._held.popitem(last=False)[1]

    def loaded(self, block: int) -> None:
        """The request keyed `block` resumed here: its pages are on the device again."""
        self._tokens -= self._held.pop(block, 0)

    def published(self) -> tuple[int, ...]:
        """What the heartbeat carries: most recent first."""
        return tuple(reversed(self._held))
