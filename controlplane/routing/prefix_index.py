"""An approximate, bounded index of which endpoint probably holds which prompt blocks.

The router cannot see engines' radix caches; it remembers where it sent each chained
block hash instead (the same guess llm-d's approximate prefix scorer makes). Block hashes
are chained, so holding block i implies holding blocks 0..i-1: the number of leading
blocks an endpoint holds is the position of the last block it was sent. Entries age out
in LRU order beyond `capacity_blocks`, as the engine's own cache would evict them, and an
endpoint's entries are dropped when it leaves the pool.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping


class PrefixIndex:
    """Block hash -> endpoints it was routed to, most recent last, bounded in size."""

    def __init__(self, capacity_blocks: int = 200_000, holders_per_block: int = 4) -> None:
        if capacity_blocks <= 0 or holders_per_block <= 0:
            raise ValueError("capacity_blocks and holders_per_block must be positive")
        self.capacity_blocks = capacity_blocks
        self.holders_per_block = holders_per_block
        self._blocks: OrderedDict[int, list[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def holders(self, block_hashes: tuple[int, ...]) -> Mapping[str, int]:
        matched: dict[str, int] = {}
        blocks = self._blocks
        for position, block in enumerate(block_hashes, start=1):
            endpoints = blocks.get(block)
            if endpoints is None:
                break  # chained hashes: nobody holds a later block without this one
            for endpoint_id in endpoints:
                matched[endpoint_id] = position
        return matched

    def record(self, endpoint_id: str, block_hashes: tuple[int, ...]) -> None:
        """The request with these blocks was sent to `endpoint_id`."""
        blocks = self._blocks
        for block in block_hashes:
            endpoints = blocks.get(block)
            if endpoints is None:
                blocks[block] = [endpoint_id]
            else:
                blocks.move_to_end(block)
                if endpoint_id in endpoints:
                    endpoints.remove(endpoint_id)
                endpoints.append(endpoint_id)
                del endpoints[: -self.holders_per_block]
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)

    def forget(self, endpoint_id: str) -> None:
        """The endpoint left (or restarted with an empty cache): drop what it held."""
        empty = []
        for block, endpoints in self._blocks.items():
            if endpoint_id in endpoints:
                endpoints.remove(endpoint_id)
                if not endpoints:
                    empty.append(block)
        for block in empty:
            del self._blocks[block]
