"""Host-side KV page allocator: a free list over the pool's page ids. Host only (no jax).

Pages are handed out as sequences grow (`allocate`) and returned the moment a request finishes or
is preempted (`free`). Pages are never reserved for `max_model_len` up front; that is what lets far
more requests share a fixed KV budget.
"""

from __future__ import annotations

import collections


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._free = collections.deque(range(num_pages))  # FIFO: freed pages are reused last
        self._used = [False] * num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n page ids; raises RuntimeError if the pool has fewer free (callers check first)."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free):
            raise RuntimeError(f"out of KV pages: asked for {n}, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._used[p] = True
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if not (0 <= p < self.num_pages) or not self._used[p]:
                raise ValueError(f"page {p} is not allocated (double free?)")
            self._used[p] = False
            self._free.append(p)
