"""The host-side page allocator: free list, exhaustion, double free, shared and retained pages."""

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


def test_shared_pages_are_reference_counted_and_retained_pages_evicted_last():
    a = PageAllocator(4)
    evicted = []
    a.on_evict = evicted.append
    p = a.allocate(2)
    a.retain(p[0])
    a.retain(p[1])
    a.share(p[0])
    assert a.num_shared_refs == 1 and a.num_used_pages == 2
    a.free(p)  # p[0] still held by its sharer; p[1] is retained, nobody holds it: evictable
    assert a.num_shared_refs == 0 and a.num_free_pages == 3 and a.is_held(p[0])
    a.share(p[1])  # an evictable page is taken back without recomputing it
    assert a.num_free_pages == 2
    a.free([p[0], p[1]])
    assert a.num_free_pages == 4 and not a.is_held(p[0])
    q = a.allocate(2)  # the two plain free pages first
    assert not set(q) & set(p) and evicted == [] and a.num_evictions == 0
    # then the evictable pages, least recently freed first, each reported as it is reused
    assert a.allocate(1) == [p[0]] and evicted == [p[0]] and a.num_evictions == 1
    a.free([p[0]])  # no longer retained: a plain free page, taken before an evictable one
    assert a.allocate(1) == [p[0]] and evicted == [p[0]]
    assert a.allocate(1) == [p[1]] and evicted == [p[0], p[1]] and a.num_evictions == 2


def test_unretained_pages_go_back_to_the_free_list():
    a = PageAllocator(3)
    p = a.allocate(2)
    a.retain(p[0])
    a.free(p)
    assert a.num_free_pages == 3
    assert a.allocate(2) == [2, p[1]]  # FIFO free list; the retained page p[0] is kept last
    assert a.num_evictions == 0


def test_retain_and_share_errors():
    a = PageAllocator(3)
    p = a.allocate(1)
    with pytest.raises(ValueError, match="not retained"):
        a.share(p[0])
    a.retain(p[0])
    with pytest.raises(ValueError, match="retained already"):
        a.retain(p[0])
    with pytest.raises(ValueError, match="not held"):
        a.retain(2)
    with pytest.raises(ValueError, match="not held"):
        a.retain(7)


def test_release_retained_turns_evictable_pages_into_free_ones():
    a = PageAllocator(4)
    evicted = []
    a.on_evict = evicted.append
    p = a.allocate(3)
    for page in p:
        a.retain(page)
    a.free(p[:2])
    a.release_retained()
    assert a.num_free_pages == 3 and a.num_used_pages == 1
    a.free(p[2:])  # held while released: it is a plain free page now
    assert sorted(a.allocate(4)) == [0, 1, 2, 3] and a.num_evictions == 0 and evicted == []
