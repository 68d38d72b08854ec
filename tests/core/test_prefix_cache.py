"""The prefix cache: its key table over the allocator's pages, and matching and registering requests."""

import pytest

from jaxserve.core.page_allocator import PageAllocator
from jaxserve.core.prefix_cache import PrefixCache
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams


def make(num_pages=4, page_size=2, enabled=True):
    allocator = PageAllocator(num_pages)
    return allocator, PrefixCache(allocator, page_size, enabled=enabled)


def req(tokens, **kw):
    r = Request("r", "r", 0, list(tokens), SamplingParams(**kw), 0, (2,), len(tokens) + 8, 0.0)
    r.begin_prefill()
    return r


def test_shared_pages_are_reference_counted_and_cached_pages_evicted_last():
    a, c = make()
    p = a.allocate(2)
    u0 = c.insert(p[0], (0, (1, 2)))
    u1 = c.insert(p[1], (u0, (3, 4)))
    assert c.lookup((0, (1, 2))) == (p[0], u0) and c.lookup((u0, (3, 4))) == (p[1], u1)
    private = a.allocate(1)[0]
    assert c.insert(private, (0, (1, 2))) == u0  # same prefix: the first page stays
    a.share(p[0])
    assert a.num_shared_refs == 1 and a.num_used_pages == 3
    a.free(p)  # p[0] still held by its sharer; p[1] is cached, nobody holds it
    assert a.num_shared_refs == 0 and a.num_free_pages == 2 and c.num_cached_pages == 2
    a.share(p[1])  # a cached page nobody held is taken back without recomputing it
    assert a.num_free_pages == 1
    a.free([p[0], p[1], private])  # the private copy is a plain free page
    assert a.num_free_pages == 4 and c.num_cached_pages == 2
    # allocation takes the free pages first, then evicts the least recently freed cached page
    q = a.allocate(3)
    assert p[0] in q and p[1] not in q and a.num_evictions == 1
    assert c.lookup((0, (1, 2))) is None and c.lookup((u0, (3, 4))) == (p[1], u1)
    assert c.num_cached_pages == 1


def test_prefix_cache_errors_and_disabled_cache():
    a, c = make(num_pages=3)
    p = a.allocate(1)
    c.insert(p[0], (0, (1,)))
    with pytest.raises(ValueError, match="registered already"):
        c.insert(p[0], (0, (2,)))
    with pytest.raises(ValueError, match="not held"):
        c.insert(2, (0, (3,)))
    with pytest.raises(ValueError, match="already reports"):
        PrefixCache(a, 2)  # one cache per allocator: it must hear of every eviction
    a, off = make(num_pages=3, enabled=False)
    p = a.allocate(1)
    with pytest.raises(RuntimeError, match="disabled"):
        off.insert(p[0], (0, (1,)))
    with pytest.raises(ValueError, match="not retained"):
        a.share(p[0])  # only cached pages are shared
    r = req([5, 6, 7, 8, 9])
    r.pages, r.num_computed_tokens = a.allocate(2) + p, 5
    off.register(r)  # a disabled cache registers nothing, and so finds nothing
    assert r.block_uids == [] and off.num_cached_pages == 0 and off.take(req([5, 6, 7])) == []
    assert off.lookup((0, (5, 6))) is None


def test_reset_frees_cached_pages_only_when_none_is_held():
    a, c = make()
    p = a.allocate(2)
    u0 = c.insert(p[0], (0, (1, 2)))
    c.insert(p[1], (u0, (3, 4)))
    assert not c.reset()  # held pages: refused, nothing forgotten
    assert c.lookup((0, (1, 2))) == (p[0], u0)
    a.free(p)
    assert c.num_cached_pages == 2 and a.num_free_pages == 4
    assert c.reset()
    assert c.num_cached_pages == 0 and c.lookup((0, (1, 2))) is None
    assert sorted(a.allocate(4)) == [0, 1, 2, 3] and a.num_evictions == 0  # plain free pages


def test_register_names_each_full_computed_page_by_its_whole_prefix():
    a, c = make(num_pages=8)
    r = req([5, 6, 7, 8, 9])
    r.pages = a.allocate(4)
    r.num_computed_tokens = 3
    c.register(r)  # one full page computed
    assert len(r.block_uids) == 1 and c.lookup((0, (5, 6))) == (r.pages[0], r.block_uids[0])
    r.num_computed_tokens = 5
    c.register(r)
    u0, u1 = r.block_uids
    assert c.lookup((u0, (7, 8))) == (r.pages[1], u1)  # page 2 (token 9) is not full
    c.register(r)  # nothing new: registered once
    assert r.block_uids == [u0, u1] and c.num_cached_pages == 2


def test_only_pages_a_prefill_computed_are_registered():
    """Issue 24: a page holding a token whose K/V a decode step wrote is never registered (in bf16
    decode K/V differ from a prefill's, so a hit on it would change the next turn's answer); after
    a preemption the generated tokens the resumed prefill recomputes are."""
    a, c = make(num_pages=8)
    r = req([5, 6, 7, 8, 9])
    r.pages, r.num_computed_tokens = a.allocate(4), 5
    c.register(r)
    assert len(r.block_uids) == 2  # (5, 6), (7, 8): the prompt's full pages
    r.output_token_ids, r.num_computed_tokens = [10, 11, 12], 8  # decode wrote tokens 5..7
    c.register(r)
    assert len(r.block_uids) == 2 and c.num_cached_pages == 2
    assert c.lookup((r.block_uids[1], (9, 10))) is None
    a.free(r.pages[::-1])  # preempted: recompute prompt + generated tokens but the last
    r.pages = []
    r.begin_prefill()
    assert r.num_prefill_tokens == 7
    r.pages = c.take(r) + a.allocate(2)  # its two prompt pages, then (9, 10) and (11, 12)
    assert len(r.block_uids) == 2
    r.num_computed_tokens = 7  # the resumed prefill computed tokens 4..6
    c.register(r)
    u2 = r.block_uids[2]
    assert len(r.block_uids) == 3 and c.lookup((r.block_uids[1], (9, 10))) == (r.pages[2], u2)
    r.num_computed_tokens = 8  # a decode step writes token 7: page (11, 12) stays unregistered
    c.register(r)
    assert len(r.block_uids) == 3 and c.num_cached_pages == 3


def test_take_shares_full_pages_but_never_the_last_prefill_token():
    a, c = make(num_pages=8)
    first = req([5, 6, 7, 8, 9, 10])
    first.pages, first.num_computed_tokens = a.allocate(3), 6
    c.register(first)  # pages of (5, 6), (7, 8), (9, 10)
    same = req([5, 6, 7, 8, 9, 10])
    assert c.match(same) == list(zip(first.pages[:2], first.block_uids[:2]))  # not (9, 10)
    assert same.block_uids == [] and a.num_shared_refs == 0  # match takes nothing
    assert c.take(same) == first.pages[:2] and same.block_uids == first.block_uids[:2]
    assert a.num_shared_refs == 2
    assert c.take(req([5, 6, 7, 0, 9])) == first.pages[:1]  # the match stops at a differing page
    assert c.take(req([6, 5, 7, 8, 9])) == []  # a miss on the first page
    assert c.lookup((0, (7, 8))) is None  # a page's key names the pages before it too
    assert c.take(req([5, 6, 7, 8, 9, 10, 11], prompt_logprobs=0)) == []  # computes every token
