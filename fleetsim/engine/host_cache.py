"""The host tier: SGLang's hierarchical cache (HiCache), LRU, page by page.

Pages the device pool evicts from its prefix cache are copied here first (write-back), or
were copied as they entered it (write-through; `fleetsim.engine.kv_cache`), and a later
request whose history continues past its device hit onto pages held here loads
them back over PCIe instead of computing them. Each host page is keyed by the whole
history up to its end: a chained hash of (salt, previous page's key, this page's tokens),
and it stores its tokens and its parent's key, so a lookup checks every page it credits and
a hash collision can only cost a miss, never a wrong hit.

A copy is a transaction: room is made (least recently used pages leave first), every page
is copied, and only then are the pages entered. A copy that fails part way enters nothing,
and the device pool, which frees its pages only after the copy returns, keeps them: a
page's only device copy is never freed before its host copy is complete.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


def page_keys(salt: str, ids: Sequence[int], page_size: int, pages: int) -> Iterator[int]:
    """The chain keys of the first `pages` full pages of `ids`."""
    key = hash(("hicache", salt))
    for index in range(pages):
        key = hash((key, tuple(ids[index * page_size : (index + 1) * page_size])))
        yield key


@dataclass(frozen=True, slots=True)
class _HostPage:
    parent: int
    tokens: tuple[int, ...]


class HostCache:
    """A host page pool of `total_pages` pages of `page_size` tokens (`total_pages` may be
    0: nothing is kept, every eviction drops its pages)."""

    def __init__(self, total_pages: int, page_size: int) -> None:
        if total_pages < 0 or page_size <= 0:
            raise ValueError("the host pool needs a non-negative size and pages of a token or more")
        self.total_pages = total_pages
        self.page_size = page_size
        self._pages: OrderedDict[int, _HostPage] = OrderedDict()  # LRU first
        # cumulative counters (SGLang's hicache_backup / load_back / dropped tokens)
        self.backup_tokens_total = 0
        self.load_back_tokens_total = 0
        self.dropped_tokens_total = 0

    @property
    def used_pages(self) -> int:
        return len(self._pages)

    def match(self, salt: str, ids: Sequence[int], start: int, limit: int) -> int:
        """Tokens of `ids` past `start` (a page boundary) held here as whole pages, the
        history up to `limit` tokens; matched pages count as used (most recent last)."""
        size = self.page_size
        first, last = start // size, limit // size
        if last <= first or not self._pages:
            return 0
        keys = page_keys(salt, ids, size, last)
        parent = hash(("hicache", salt))
        for _ in range(first):
            parent = next(keys)
        hits: list[int] = []
        for index, key in zip(range(first, last), keys, strict=False):
            page = self._pages.get(key)
            tokens = tuple(ids[index * size : (index + 1) * size])
            if page is None or page.parent != parent or page.tokens != tokens:
                break
            hits.append(key)
            parent = key
        for key in reversed(hits):  # the chain's head is evicted last
            self._pages.move_to_end(key)
        return len(hits) * size

    def back_up(self, salt: str, ids: Sequence[int], start: int, end: int) -> bool:
        """Copy the pages of history `ids` in [start, end) (page boundaries) that are not
        held here yet (SGLang backs a node up once: under write-through its pages were
        copied as they were written), making room by evicting the least recently used
        host pages. False when they cannot all be held (the pool is smaller than the
        run): nothing is entered and the caller drops them. A copy that fails part way
        raises and enters nothing."""
        size = self.page_size
        first, last = start // size, end // size
        count = last - first
        if count <= 0:
            return True
        if count > self.total_pages:
            self.dropped_tokens_total += count * size
            return False
        pages = self._pages
        chain = list(page_keys(salt, ids, size, last))
        parent, keys = chain[first - 1] if first else hash(("hicache", salt)), chain[first:]
        fresh: dict[int, _HostPage] = {}
        for index, key in enumerate(keys, start=first):
            if key not in pages:
                fresh[key] = _HostPage(parent, self._copy(ids[index * size : (index + 1) * size]))
            parent = key
        for key in keys:  # already held: kept, out of eviction's way
            if key not in fresh:
                pages.move_to_end(key)
        for _ in range(len(pages) + len(fresh) - self.total_pages):
            pages.popitem(last=False)  # count <= total_pages: the oldest are none of the run
        for key in reversed(keys):  # the run's head is evicted last
            if key in fresh:
                pages[key] = fresh[key]
            pages.move_to_end(key)
        self.backup_tokens_total += len(fresh) * size
        return True

    def _copy(self, tokens: Sequence[int]) -> tuple[int, ...]:
        """One page's device-to-host copy (its tokens stand for its KV)."""
        return tuple(tokens)

    def clear(self) -> None:
        self._pages.clear()

    def loaded(self, tokens: int) -> None:
        self.load_back_tokens_total += tokens

    def check(self) -> None:
        """Raise AssertionError unless the pool is within its size and every page is whole."""
        if len(self._pages) > self.total_pages:
            raise AssertionError(f"host pool holds {len(self._pages)} of {self.total_pages} pages")
        for page in self._pages.values():
            if len(page.tokens) != self.page_size:
                raise AssertionError("host page of the wrong size")
