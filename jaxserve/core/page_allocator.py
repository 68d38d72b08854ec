"""Host-side KV page allocator: reference-counted pages and an optional prefix cache. Host only.

Pages are handed out as sequences grow (`allocate`) and returned the moment a request finishes or
is preempted (`free`). Pages are never reserved for `max_model_len` up front; that is what lets far
more requests share a fixed KV budget.

Prefix caching (vLLM's automatic prefix caching, `enable_caching=True`): a page that holds a full
page of some token sequence's K/V can be `register`ed under a key naming its content exactly,

    key = (uid of the previous page's key, or 0 for the first page,  the page's token ids)

so a key names the whole token prefix up to the page's end, with no hash collisions: uids are never
reused, so the key of a page whose parent was evicted can never match again. A later request whose
tokens begin with the same pages finds them with `lookup` and takes them with `share` instead of
recomputing them. Pages are reference-counted: a page returns to the pool when its last holder
frees it; a registered page then stays cached (`evictable`, least recently freed first) until an
allocation needs it, so its K/V can still be reused until then.

    page states:   free --allocate--> held (ref >= 1) --free (ref 0)--> free       (unregistered)
                                      held --free (ref 0)--> evictable --share--> held
                                      evictable --allocate (pool otherwise empty)--> held, key gone
"""

from __future__ import annotations

import collections


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


class PageAllocator:
    def __init__(self, num_pages: int, enable_caching: bool = False):
        if num_pages < 1:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self.enable_caching = enable_caching
        self._free = collections.deque(range(num_pages))  # FIFO: freed pages are reused last
        self._ref = [0] * num_pages
        self._cached: dict[tuple, tuple[int, int]] = {}  # key -> (page, uid)
        self._page_key: dict[int, tuple] = {}  # registered page -> its key
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._next_uid = 1
        self.num_shared_refs = 0  # sum over pages of (ref - 1) for ref > 1
        self.num_evictions = 0

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can take: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        """Pages some request holds."""
        return self.num_pages - self.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        return len(self._page_key)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_pages

    def allocate(self, n: int) -> list[int]:
        """n page ids; raises RuntimeError if the pool has fewer free (callers check first).
        Free pages go first; then cached pages nobody holds, least recently freed first."""
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
                del self._cached[self._page_key.pop(p)]
                self.num_evictions += 1
            self._ref[p] = 1
            pages.append(p)
        return pages

    def free(self, pages: list[int]) -> None:
        """Drops one reference to each page; a page nobody holds returns to the pool (or stays
        cached, evictable, if it is registered)."""
        for p in pages:
            if not (0 <= p < self.num_pages) or self._ref[p] <= 0:
                raise ValueError(f"page {p} is not allocated (double free?)")
            self._ref[p] -= 1
            if self._ref[p] >= 1:
                self.num_shared_refs -= 1
            elif p in self._page_key:
                self._evictable[p] = None
            else:
                self._free.append(p)

    # -- prefix cache -----------------------------------------------------------------------
    def lookup(self, key: tuple) -> tuple[int, int] | None:
        """(page, uid) registered under `key`, or None."""
        return self._cached.get(key) if self.enable_caching else None

    def share(self, page: int) -> None:
        """Takes one more reference to a registered page (found by `lookup`)."""
        if page not in self._page_key:
            raise ValueError(f"page {page} is not a cached page")
        if self._ref[page] == 0:
            del self._evictable[page]
        else:
            self.num_shared_refs += 1
        self._ref[page] += 1

    def register(self, page: int, key: tuple) -> int:
        """Records that held `page` holds the K/V named by `key`; returns the key's uid. If the key
        is already cached (another page computed the same prefix), that entry's uid is returned and
        `page` stays private to its holder."""
        if not self.enable_caching:
            raise RuntimeError("register needs enable_caching=True")
        if self._ref[page] <= 0 or page in self._page_key:
            raise ValueError(f"page {page} is not held, or is registered already")
        hit = self._cached.get(key)
        if hit is not None:
            return hit[1]
        uid = self._next_uid
        self._next_uid += 1
        self._cached[key] = (page, uid)
        self._page_key[page] = key
        return uid

    def reset_cache(self) -> bool:
        """Forgets every cached prefix; cached pages nobody holds become free pages. Refused
        (False, nothing changed) while some page is held, since its holder's registrations would
        be lost mid-request."""
        if self.num_used_pages:
            return False
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._cached.clear()
        self._page_key.clear()
        return True
