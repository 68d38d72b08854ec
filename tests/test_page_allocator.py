"""The host-side page allocator: free list, exhaustion, double free."""

import pytest

from jaxserve.page_allocator import PageAllocator, pages_for


def test_allocate_free_cycle():
    a = PageAllocator(4)
    p = a.allocate(3)
    assert len(set(p)) == 3 and a.num_free_pages == 1 and a.num_used_pages == 3
    assert a.can_allocate(1) and not a.can_allocate(2)
    a.free(p[:2])
    assert a.num_free_pages == 3
    q = a.allocate(3)
    assert not set(q) & {p[2]}  # never hands out a page in use
    a.free(q + [p[2]])
    assert a.num_free_pages == 4


def test_errors():
    a = PageAllocator(2)
    with pytest.raises(RuntimeError, match="out of KV pages"):
        a.allocate(3)
    p = a.allocate(1)
    a.free(p)
    with pytest.raises(ValueError, match="double free"):
        a.free(p)
    with pytest.raises(ValueError, match="not allocated"):
        a.free([7])
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(0)


def test_pages_for():
    assert [pages_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
