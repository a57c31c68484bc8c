"""The KV pool: fixed-size pages, a radix (prefix) cache over full pages, exact accounting.

Every page is in exactly one place: the free list, one request's private list (the tail it
is still filling), or the prefix cache as one tree node. A cache node's `refs` counts the
requests whose page path runs through it; a request holds a reference on every node of its
path, so a node's references are never fewer than its children's and an unreferenced node
roots an unreferenced subtree. Unreferenced nodes are evictable; eviction takes unreferenced
leaves in least-recently-used order (a use is a match or a release), so a page in use is
never reclaimed. Each cache salt (SGLang's `cache_salt`) has its own tree: requests with
different salts never share KV. Allocation fails
closed: it either hands out every page asked for or none.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class CacheNode:
    """One full page of cached tokens, reached from its parent by the page's token ids."""

    __slots__ = ("children", "key", "page", "parent", "refs")

    def __init__(self, key: tuple[int, ...], page: int, parent: CacheNode | None) -> None:
        self.key = key
        self.page = page
        self.parent = parent
        self.children: dict[tuple[int, ...], CacheNode] = {}
        self.refs = 0


class KVCache:
    """Pages of `page_size` tokens, `total_pages` of them, with an optional prefix cache."""

    def __init__(self, total_pages: int, page_size: int, prefix_cache: bool = True) -> None:
        if total_pages <= 0 or page_size <= 0:
            raise ValueError("the KV pool needs at least one page of at least one token")
        self.total_pages = total_pages
        self.page_size = page_size
        self.prefix_cache = prefix_cache
        self._free = list(range(total_pages - 1, -1, -1))
        self._roots: dict[str, CacheNode] = {}
        self._leaves: OrderedDict[CacheNode, None] = OrderedDict()
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

    def evict(self, count: int) -> int:
        """Return up to `count` unreferenced cached pages to the free list, LRU first."""
        evicted = 0
        while evicted < count and self._leaves:
            node, _ = self._leaves.popitem(last=False)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key]
            self._free.append(node.page)
            self.cached_pages -= 1
            self.evictable_pages -= 1
            evicted += 1
            if parent.refs == 0 and not parent.children:
                self._leaves[parent] = None
                self._leaves.move_to_end(parent, last=False)
        return evicted

    def flush(self) -> int:
        """Evict every unreferenced cached page (SGLang's /flush_cache)."""
        return self.evict(self.evictable_pages)

    # -- prefix cache --------------------------------------------------------------------
    def root(self, salt: str = "") -> CacheNode:
        node = self._roots.get(salt)
        if node is None:
            node = self._roots[salt] = CacheNode((), -1, None)
            node.refs = 1  # never evicted
        return node

    def match(self, ids: Sequence[int], max_tokens: int, salt: str = "") -> list[CacheNode]:
        """The cached path of full pages that prefixes `ids`, at most `max_tokens` long."""
        if not self.prefix_cache:
            return []
        size = self.page_size
        node = self.root(salt)
        path: list[CacheNode] = []
        for start in range(0, max_tokens - size + 1, size):
            child = node.children.get(tuple(ids[start : start + size]))
            if child is None:
                break
            path.append(child)
            node = child
        if path and path[-1] in self._leaves:
            self._leaves.move_to_end(path[-1])  # a hit is a use
        return path

    def lock(self, nodes: Iterable[CacheNode]) -> None:
        for node in nodes:
            if node.refs == 0:
                self.evictable_pages -= 1
                self._leaves.pop(node, None)
            node.refs += 1

    def unlock(self, nodes: Iterable[CacheNode]) -> None:
        for node in nodes:
            node.refs -= 1
            if node.refs == 0:
                self.evictable_pages += 1
                if not node.children:
                    self._leaves[node] = None

    def adopt(
        self,
        path: list[CacheNode],
        pages: list[int],
        ids: Sequence[int],
        full_pages: int,
        salt: str = "",
    ) -> None:
        """Move a holder's filled private pages into the cache, extending its locked `path`
        in place and consuming the adopted pages from the front of `pages`.

        A page whose content is already cached (another request computed the same prefix)
        is freed and the holder switches to the cached node: same tokens, same KV.
        Without a prefix cache this does nothing.
        """
        if not self.prefix_cache:
            return
        size = self.page_size
        parent = path[-1] if path else self.root(salt)
        adopted = 0
        for index in range(len(path), full_pages):
            key = tuple(ids[index * size : (index + 1) * size])
            page = pages[adopted]
            adopted += 1
            node = parent.children.get(key)
            if node is None:
                node = CacheNode(key, page, parent)
                parent.children[key] = node
                self.cached_pages += 1
                node.refs = 1
            else:
                self.free((page,))
                self.lock((node,))
            path.append(node)
            parent = node
        del pages[:adopted]

    def check(self, holders: Iterable[tuple[Sequence[CacheNode], Sequence[int]]]) -> None:
        """Raise AssertionError unless every page has exactly one owner and every cached
        node's reference count equals the number of holders whose path runs through it."""
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
        for index, (path, pages) in enumerate(holders):
            for node in path:
                refs[id(node)] = refs.get(id(node), 0) + 1
            for page in pages:
                own(page, f"holder {index}")
        cached = evictable = 0
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            cached += 1
            own(node.page, "cache")
            if node.refs != refs.get(id(node), 0):
                raise AssertionError(f"node of page {node.page} has refs {node.refs}")
            if node.refs == 0:
                evictable += 1
                if not node.children and node not in self._leaves:
                    raise AssertionError(f"evictable leaf page {node.page} not in LRU")
            elif node in self._leaves:
                raise AssertionError(f"referenced page {node.page} in LRU")
            stack.extend(node.children.values())
        if len(owner) != self.total_pages:
            raise AssertionError(f"{self.total_pages - len(owner)} pages lost")
        if (cached, evictable) != (self.cached_pages, self.evictable_pages):
            raise AssertionError("cached/evictable counters drifted")
