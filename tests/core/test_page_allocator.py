"""The host-side page allocator: free list, exhaustion, double free."""

import pytest

from jaxserve.core.page_allocator import PageAllocator, pages_for


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


def test_shared_pages_are_reference_counted_and_cached_pages_evicted_last():
    a = PageAllocator(4, enable_caching=True)
    p = a.allocate(2)
    u0 = a.register(p[0], (0, (1, 2)))
    u1 = a.register(p[1], (u0, (3, 4)))
    assert a.lookup((0, (1, 2))) == (p[0], u0) and a.lookup((u0, (3, 4))) == (p[1], u1)
    assert a.register(a.allocate(1)[0], (0, (1, 2))) == u0  # same prefix: the first page stays
    a.share(p[0])
    assert a.num_shared_refs == 1 and a.num_used_pages == 3
    a.free(p)  # p[0] still held by its sharer; p[1] is cached, nobody holds it
    assert a.num_shared_refs == 0 and a.num_free_pages == 2 and a.num_cached_pages == 2
    a.share(p[1])  # a cached page nobody held is taken back without recomputing it
    assert a.num_free_pages == 1
    a.free([p[0], p[1]])
    assert a.num_free_pages == 3
    # allocation takes the free page first, then evicts the least recently freed cached page
    q = a.allocate(2)
    assert p[0] in q and a.lookup((0, (1, 2))) is None and a.lookup((u0, (3, 4))) is not None
    assert a.num_evictions == 1


def test_prefix_cache_errors_and_disabled_lookup():
    a = PageAllocator(3)
    p = a.allocate(1)
    with pytest.raises(RuntimeError, match="enable_caching"):
        a.register(p[0], (0, (1,)))
    assert a.lookup((0, (1,))) is None
    c = PageAllocator(3, enable_caching=True)
    p = c.allocate(1)
    with pytest.raises(ValueError, match="not a cached page"):
        c.share(p[0])
    c.register(p[0], (0, (1,)))
    with pytest.raises(ValueError, match="registered already"):
        c.register(p[0], (0, (2,)))
    with pytest.raises(ValueError, match="not held"):
        c.register(2, (0, (3,)))


def test_reset_cache_frees_cached_pages_only_when_none_is_held():
    a = PageAllocator(4, enable_caching=True)
    p = a.allocate(2)
    u0 = a.register(p[0], (0, (1, 2)))
    a.register(p[1], (u0, (3, 4)))
    assert not a.reset_cache()  # held pages: refused, nothing forgotten
    assert a.lookup((0, (1, 2))) == (p[0], u0)
    a.free(p)
    assert a.num_cached_pages == 2 and a.num_free_pages == 4
    assert a.reset_cache()
    assert a.num_cached_pages == 0 and a.lookup((0, (1, 2))) is None
    assert sorted(a.allocate(4)) == [0, 1, 2, 3] and a.num_evictions == 0  # plain free pages
