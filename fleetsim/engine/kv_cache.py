"""The KV pool: fixed-size pages, a radix (prefix) cache over full pages, exact accounting.

Every page is in exactly one place: the free list, one request's private list (the tail it
is still filling), or the prefix cache inside one tree node. The tree is a compressed radix
tree, as SGLang's: a node holds a run of pages (its `key` is their tokens) and is split only
where two histories diverge, so caching a prompt costs one node, not one per page.

A node's `refs` counts the holders (running requests) whose cached path runs through it; a
holder is known by the last node of its path, and locking or unlocking walks up to the root.
A node's references are therefore never fewer than its children's, and an unreferenced node
roots an unreferenced subtree. Unreferenced pages are evictable: eviction trims unreferenced
leaves from their tail in least-recently-used order (a use is a match or a release), so a
page in use is never reclaimed. Allocation fails closed: it hands out every page asked for
or none. Each cache salt (SGLang's `cache_salt`) has its own tree.

With a host tier (`fleetsim.engine.host_cache`), an evicted run is written back to it
before its pages return to the free list; a copy that fails leaves the run cached here.
Under write-through (SGLang's `--hicache-write-policy write_through`) pages are copied as
they enter the cache, so an eviction finds them held and copies nothing; one the host
tier has meanwhile let go is written back then, as under write-back (SGLang would drop
it): a page's only copy is never freed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from fleetsim.engine.host_cache import HostCache


class CacheNode:
    """A run of cached pages, reached from its parent by the tokens of its first page."""

    __slots__ = ("children", "key", "pages", "parent", "refs")

    def __init__(self, key: list[int], pages: list[int], parent: CacheNode | None) -> None:
        self.key = key  # len(pages) * page_size tokens
        self.pages = pages
        self.parent = parent
        self.children: dict[tuple[int, ...], CacheNode] = {}
        self.refs = 0


def path_pages(node: CacheNode | None) -> list[int]:
    """The pages from the root down to `node`, in token order."""
    runs: list[list[int]] = []
    while node is not None and node.parent is not None:
        runs.append(node.pages)
        node = node.parent
    return [page for run in reversed(runs) for page in run]


class KVCache:
    """Pages of `page_size` tokens, `total_pages` of them, with an optional prefix cache."""

    def __init__(
        self,
        total_pages: int,
        page_size: int,
        prefix_cache: bool = True,
        host: HostCache | None = None,
        write_through: bool = False,
    ) -> None:
        if total_pages <= 0 or page_size <= 0:
            raise ValueError("the KV pool needs at least one page of at least one token")
        self.total_pages = total_pages
        self.page_size = page_size
        self.prefix_cache = prefix_cache
        self._free = list(range(total_pages - 1, -1, -1))
        self._roots: dict[str, CacheNode] = {}
        self._salts: dict[int, str] = {}  # id(root) -> its salt
        self.host = host
        self.write_through = write_through and host is not None
        self.evicted_tokens_total = 0
        self._leaves: OrderedDict[CacheNode, None] = OrderedDict()  # evictable, LRU first
        self.cached_pages = 0
        self.evictable_pages = 0

    # -- sizes ---------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def available_pages(self) -> int:
        """Pages an allocation could obtain now: free ones plus evictable cached ones."""
        return len(self._free) + self.evictable_pages

    @property
    def used_pages(self) -> int:
        """Pages that hold KV somebody references (SGLang's used = total − available)."""
        return self.total_pages - self.available_pages

    # -- allocation ----------------------------------------------------------------------
    def allocate(self, count: int) -> list[int] | None:
        """`count` pages, evicting unreferenced cached pages if needed; None (and nothing
        taken) if that is impossible."""
        if count <= 0:
            return []
        shortfall = count - len(self._free)
        if shortfall > 0:
            if shortfall > self.evictable_pages:
                return None
            self.evict(shortfall)
        taken = self._free[-count:]
        del self._free[-count:]
        return taken

    def free(self, pages: Iterable[int]) -> None:
        self._free.extend(pages)

    def evict(self, count: int, back_up: bool = True) -> int:
        """Return up to `count` unreferenced cached pages to the free list: the tails of
        the least recently used unreferenced leaves, each first written back to the host
        tier if there is one (and `back_up`)."""
        evicted = 0
        size = self.page_size
        while evicted < count and self._leaves:
            node = next(iter(self._leaves))
            take = min(count - evicted, len(node.pages))
            if back_up and self.host is not None:
                salt, ids = self._path_ids(node)
                self.host.back_up(salt, ids, len(ids) - take * size, len(ids))
            if take < len(node.pages):
                self._free.extend(node.pages[-take:])
                del node.pages[-take:]
                del node.key[-take * size :]
            else:
                del self._leaves[node]
                self._free.extend(node.pages)
                parent = node.parent
                assert parent is not None
                del parent.children[tuple(node.key[:size])]
                if parent.refs == 0 and not parent.children:
                    self._leaves[parent] = None
                    self._leaves.move_to_end(parent, last=False)
            self.cached_pages -= take
            self.evictable_pages -= take
            evicted += take
        self.evicted_tokens_total += evicted * size
        return evicted

    def _path_ids(self, node: CacheNode) -> tuple[str, list[int]]:
        """The salt of `node`'s tree and the tokens from its root down to `node`'s end."""
        runs: list[list[int]] = []
        while node.parent is not None:
            runs.append(node.key)
            node = node.parent
        return self._salts[id(node)], [token for run in reversed(runs) for token in run]

    def flush(self) -> int:
        """Drop every unreferenced cached page, the host tier's included (SGLang's
        /flush_cache)."""
        if self.host is not None:
            self.host.clear()
        return self.evict(self.evictable_pages, back_up=False)

    # -- prefix cache --------------------------------------------------------------------
    def root(self, salt: str = "") -> CacheNode:
        node = self._roots.get(salt)
        if node is None:
            node = self._roots[salt] = CacheNode([], [], None)
            node.refs = 1  # never evicted
            self._salts[id(node)] = salt
        return node

    def match(self, ids: Sequence[int], max_tokens: int, salt: str = "") -> tuple[CacheNode, int]:
        """The deepest cached node whose path prefixes `ids` in full pages, at most
        `max_tokens` long, and that path's length in tokens. A node the match ends inside
        is split there, so the result always ends on a node boundary."""
        node = self.root(salt)
        if not self.prefix_cache:
            return node, 0
        size = self.page_size
        limit = max_tokens // size * size
        pos = 0
        while pos + size <= limit:
            child = node.children.get(tuple(ids[pos : pos + size]))
            if child is None:
                break
            n = len(child.key)
            if pos + n <= limit and ids[pos : pos + n] == child.key:
                node, pos = child, pos + n
                continue
            pages = self._common_pages(child.key, ids, pos, min(n, limit - pos))
            node, pos = self._split(child, pages), pos + pages * size
            break
        if node in self._leaves:
            self._leaves.move_to_end(node)  # a hit is a use
        return node, pos

    def evictable_on_path(self, node: CacheNode) -> int:
        """Pages on the path to `node` that locking it would take out of the evictable
        pool (the unreferenced bottom of the path)."""
        pages = 0
        while node.parent is not None and node.refs == 0:
            pages += len(node.pages)
            node = node.parent
        return pages

    def lock(self, node: CacheNode) -> None:
        """A holder's path now ends at `node`: reference every node up to the root."""
        while node.parent is not None:
            if node.refs == 0:
                self.evictable_pages -= len(node.pages)
                self._leaves.pop(node, None)
            node.refs += 1
            node = node.parent

    def unlock(self, node: CacheNode) -> None:
        while node.parent is not None:
            node.refs -= 1
            if node.refs == 0:
                self.evictable_pages += len(node.pages)
                if not node.children:
                    self._leaves[node] = None
            node = node.parent

    def adopt(
        self, last: CacheNode, private: list[int], ids: Sequence[int], start: int, end: int
    ) -> CacheNode:
        """Move a holder's filled private pages for tokens [start, end) into the cache
        below its locked path ending at `last` (covering `start` tokens), consuming them
        from the front of `private`; returns the holder's new last node (locked).

        A page whose content is already cached (another request computed the same prefix)
        is freed and the holder switches to the cached one: same tokens, same KV. Under
        write-through the run is copied to the host tier once it is cached."""
        last = self._adopt(last, private, ids, start, end)
        if self.write_through and end > start:
            assert self.host is not None
            node = last
            while node.parent is not None:
                node = node.parent
            self.host.back_up(self._salts[id(node)], ids, start, end)
        return last

    def _adopt(
        self, last: CacheNode, private: list[int], ids: Sequence[int], start: int, end: int
    ) -> CacheNode:
        size = self.page_size
        node, pos, used = last, start, 0
        while pos < end:
            child = node.children.get(tuple(ids[pos : pos + size]))
            if child is None:
                count = (end - pos) // size
                if node.parent is not None and node.refs == 1 and not node.children:
                    # The holder's own leaf: grow it in place rather than chain a child.
                    node.key.extend(ids[pos:end])
                    node.pages.extend(private[used : used + count])
                    self.cached_pages += count
                    del private[: used + count]
                    return node
                child = CacheNode(list(ids[pos:end]), private[used : used + count], node)
                node.children[tuple(ids[pos : pos + size])] = child
                self.cached_pages += count
                child.refs = 1
                del private[: used + count]
                return child
            pages = self._common_pages(child.key, ids, pos, min(len(child.key), end - pos))
            if pages * size < len(child.key):
                child = self._split(child, pages)
            self.free(private[used : used + pages])
            used += pages
            if child.refs == 0:
                self.evictable_pages -= len(child.pages)
                self._leaves.pop(child, None)
            child.refs += 1
            node, pos = child, pos + pages * size
        del private[:used]
        return node

    def _common_pages(self, key: list[int], ids: Sequence[int], pos: int, span: int) -> int:
        """Whole pages of `key` equal to ids[pos:] within `span` tokens (the first page is
        known to match)."""
        size = self.page_size
        pages = 1
        while (pages + 1) * size <= span and (
            ids[pos + pages * size : pos + (pages + 1) * size]
            == key[pages * size : (pages + 1) * size]
        ):
            pages += 1
        return pages

    def _split(self, node: CacheNode, pages: int) -> CacheNode:
        """Cut `node` after `pages` pages; returns the new upper part. The lower part keeps
        its identity, so holders whose path ends at it are unaffected, and the upper part
        carries the same references (every such path runs through it)."""
        size = self.page_size
        parent = node.parent
        assert parent is not None
        assert 0 < pages < len(node.pages)
        upper = CacheNode(node.key[: pages * size], node.pages[:pages], parent)
        upper.refs = node.refs
        parent.children[tuple(node.key[:size])] = upper
        node.key = node.key[pages * size :]
        node.pages = node.pages[pages:]
        node.parent = upper
        upper.children[tuple(node.key[:size])] = node
        return upper

    # -- invariants ----------------------------------------------------------------------
    def check(self, holders: Iterable[tuple[CacheNode | None, Sequence[int]]]) -> None:
        """Raise AssertionError unless every page has exactly one owner and every cached
        node's reference count equals the number of holders whose path runs through it."""
        size = self.page_size
        owner: dict[int, str] = {}

        def own(page: int, who: str) -> None:
            if not 0 <= page < self.total_pages:
                raise AssertionError(f"page {page} out of range")
            if page in owner:
                raise AssertionError(f"page {page} owned by {owner[page]} and {who}")
            owner[page] = who

        for page in self._free:
            own(page, "free list")
        refs: dict[int, int] = {}
        for index, (last, pages) in enumerate(holders):
            node = last
            while node is not None and node.parent is not None:
                refs[id(node)] = refs.get(id(node), 0) + 1
                node = node.parent
            for page in pages:
                own(page, f"holder {index}")
        cached = evictable = 0
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            if not node.pages or len(node.key) != len(node.pages) * size:
                raise AssertionError(f"node with {len(node.pages)} pages has a bad key")
            assert node.parent is not None
            if node.parent.children.get(tuple(node.key[:size])) is not node:
                raise AssertionError("node not reachable from its parent by its first page")
            for page in node.pages:
                own(page, "cache")
            cached += len(node.pages)
            if node.refs != refs.get(id(node), 0):
                raise AssertionError(f"node of pages {node.pages[:3]}… has refs {node.refs}")
            if node.refs == 0:
                evictable += len(node.pages)
                if not node.children and node not in self._leaves:
                    raise AssertionError("evictable leaf not in the LRU")
            elif node in self._leaves:
                raise AssertionError("referenced node in the LRU")
            stack.extend(node.children.values())
        if len(owner) != self.total_pages:
            raise AssertionError(f"{self.total_pages - len(owner)} pages lost")
        if (cached, evictable) != (self.cached_pages, self.evictable_pages):
            raise AssertionError("cached/evictable counters drifted")
