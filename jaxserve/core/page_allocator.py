"""Host-side KV page allocator: reference-counted pages, free or evictable. Host only (no jax).

Pages are handed out as sequences grow (`allocate`) and returned the moment a request finishes or
is preempted (`free`). Pages are never reserved for `max_model_len` up front; that is what lets far
more requests share a fixed KV budget.

A page can have several holders (`share`); it returns to the pool when its last holder frees it.
Where it returns depends on whether its K/V is worth keeping: a page the prefix cache has
`retain`ed (prefix_cache.py: it is registered under a key, a later request may reuse it) becomes
evictable instead of free. Evictable pages still count as free pages, and `share` takes one back
without recomputing its K/V; an allocation reuses them only once no plain free page is left, least
recently freed first, and then calls `on_evict(page)` so the cache drops the page's key.

    page states:   free --allocate--> held (ref >= 1) --free (ref 0)--> free       (not retained)
                                      held --retain--> held, retained
                   held, retained --free (ref 0)--> evictable --share--> held, retained
                   evictable --allocate (no free page left)--> held, not retained (on_evict)
                   evictable --release_retained--> free
"""

from __future__ import annotations

import collections
from collections.abc import Callable


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._free = collections.deque(range(num_pages))  # FIFO: freed pages are reused last
        self._ref = [0] * num_pages
        self._retained: set[int] = set()  # pages kept (evictable) when their last holder frees
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU
        # Told which retained page an allocation reuses (set by the PrefixCache that retains them).
        self.on_evict: Callable[[int], None] | None = None
        self.num_shared_refs = 0  # sum over pages of (ref - 1) for ref > 1
        self.num_evictions = 0

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can take: free ones and evictable ones (retained, nobody holds)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        """Pages some request holds."""
        return self.num_pages - self.num_free_pages

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_pages

    def is_held(self, page: int) -> bool:
        return 0 <= page < self.num_pages and self._ref[page] > 0

    def allocate(self, n: int) -> list[int]:
        """n page ids; raises RuntimeError if the pool has fewer free (callers check first).
        Free pages go first; then evictable pages, least recently freed first."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > self.num_free_pages:
            raise RuntimeError(f"out of KV pages: asked for {n}, {self.num_free_pages} free")
        pages = []
        for _ in range(n):
            if self._free:
                p = self._free.popleft()
            else:
                p, _ = self._evictable.popitem(last=False)
                self._retained.remove(p)
                self.num_evictions += 1
                if self.on_evict is not None:
                    self.on_evict(p)
            self._ref[p] = 1
            pages.append(p)
        return pages

    def free(self, pages: list[int]) -> None:
        """Drops one reference to each page; a page nobody holds returns to the pool: free, or
        evictable if it is retained."""
        for p in pages:
            if not (0 <= p < self.num_pages) or self._ref[p] <= 0:
                raise ValueError(f"page {p} is not allocated (double free?)")
            self._ref[p] -= 1
            if self._ref[p] >= 1:
                self.num_shared_refs -= 1
            elif p in self._retained:
                self._evictable[p] = None
            else:
                self._free.append(p)

    def retain(self, page: int) -> None:
        """Keeps held `page`'s K/V once its last holder frees it (evictable, not free)."""
        if not self.is_held(page) or page in self._retained:
            raise ValueError(f"page {page} is not held, or is retained already")
        self._retained.add(page)

    def share(self, page: int) -> None:
        """Takes one more reference to a retained page, held or evictable."""
        if page not in self._retained:
            raise ValueError(f"page {page} is not retained (only cached pages are shared)")
        if self._ref[page] == 0:
            del self._evictable[page]
        else:
            self.num_shared_refs += 1
        self._ref[page] += 1

    def release_retained(self) -> None:
        """Retains nothing any more: evictable pages become free pages (their K/V forgotten), held
        ones go back to the free list when their holders free them."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._retained.clear()
