"""The scheduler's plans: admission under slots/rows/pages, chunking, preemption order, the two
admission policies (continuous, static), prefix-cache hits and registration."""

from jaxserve.config import EngineConfig
from jaxserve.core.admission import ContinuousAdmission, StaticAdmission
from jaxserve.core.page_allocator import PageAllocator
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import Scheduler
from jaxserve.resolve import bucket_for


def make(
    num_slots=2, num_pages=32, page_size=4, chunk=8, rows=2, batching="continuous", caching=False
):
    ec = EngineConfig(
        num_slots=num_slots,
        max_model_len=64,
        page_size=page_size,
        max_num_batched_tokens=rows * chunk,
        prefill_chunk_size=chunk,
        batching=batching,
        enable_prefix_caching=caching,
    )
    return Scheduler(ec.scheduler, ec.cache, num_pages)


def req(rid, n_prompt, max_tokens=8, **kw):
    sp = SamplingParams(max_tokens=max_tokens, **kw)
    return Request(
        rid, rid, 0, list(range(3, 3 + n_prompt)), sp, 0, (2,), n_prompt + max_tokens, 0.0
    )


def finish_prefill(plan):
    """Pretend the engine received the plan's prefill results (a first token per finished prompt).

    The scheduler already advanced num_computed_tokens when it made the plan."""
    for c, forced in zip(plan.prefill, plan.forced):
        if c.is_last and not forced:
            c.request.output_token_ids.append(5)
            c.request.num_pending_tokens -= 1


def test_admission_is_bounded_by_slots_and_rows():
    s = make(num_slots=2, rows=1)
    for i in range(3):
        s.add(req(str(i), 4))
    plan = s.schedule()
    assert [r.request_id for r in plan.inserted] == ["0"] and len(plan.prefill) == 1
    finish_prefill(plan)
    plan = s.schedule()
    assert [r.request_id for r in plan.decode] == ["0"]
    assert [r.request_id for r in plan.inserted] == ["1"]  # second slot
    finish_prefill(plan)
    plan = s.schedule()
    assert not plan.inserted and len(s.waiting) == 1  # no free slot for "2"


def test_long_prompt_is_chunked():
    s = make(chunk=8, rows=2)
    s.add(req("long", 30))
    chunks = []
    while True:
        plan = s.schedule()
        if not plan.prefill:
            break
        chunks += [(c.start, c.length, c.is_last) for c in plan.prefill]
        finish_prefill(plan)
    assert chunks == [(0, 8, False), (8, 8, False), (16, 8, False), (24, 6, True)]
    r = s.running[0]
    assert len(r.pages) == 8  # 30 tokens of K/V + room for the first decode


def decode(plan):
    for r, steps in zip(plan.decode, plan.decode_steps):
        r.output_token_ids += [5] * steps
        r.num_pending_tokens -= steps


def test_preemption_evicts_newest_and_requeues_it_first():
    s = make(num_slots=3, num_pages=7, page_size=4, rows=3)
    reqs = [req(str(i), 7, max_tokens=20) for i in range(3)]
    for r in reqs:
        s.add(r)
    plan = s.schedule()
    assert plan.inserted == reqs and s.allocator.num_free_pages == 1  # 2 pages each
    finish_prefill(plan)
    plan = s.schedule()  # position 7 still fits in the second page
    assert plan.decode == reqs and not plan.preempted
    assert [r.num_computed_tokens for r in reqs] == [8, 8, 8]  # advanced when planned
    assert [r.num_pending_tokens for r in reqs] == [1, 1, 1]
    decode(plan)
    plan = s.schedule()  # position 8 needs a third page each; one is free
    assert plan.decode == reqs[:2] and plan.preempted == [reqs[2]]
    assert plan.released == [2] and s.num_preemptions == 1
    victim = reqs[2]
    assert s.waiting[0] is victim and victim.status == RequestStatus.WAITING
    assert victim.pages == [] and victim.slot is None and victim.num_computed_tokens == 0
    assert victim.output_token_ids == [5, 5]  # generated tokens kept for the recompute
    victim.begin_prefill()
    assert victim.num_prefill_tokens == 8 and victim.forced_token == 5


def test_static_batch_waits_for_all():
    s = make(num_slots=2, batching="static", rows=1)
    for i in range(3):
        s.add(req(str(i), 4, max_tokens=2))
    plan = s.schedule()
    assert len(plan.inserted) == 2 and len(plan.prefill) == 1  # both slots, one chunk row
    first = plan.inserted[0]
    finish_prefill(plan)
    s.finish(first, RequestStatus.FINISHED_LENGTH)
    plan = s.schedule()
    assert not plan.inserted  # a free slot, but the batch is still running
    assert plan.released == [first.slot if first.slot is not None else 0]


def test_continuous_admission_policy():
    policy = ContinuousAdmission(watermark=2, page_size=4, wait_for_leader=True)
    running = [req("r", 4)]
    assert policy.is_open([]) and policy.is_open(running)
    assert policy.wants_more(1) and not policy.wants_more(0)  # one prefill row per admission
    pool = PageAllocator(5)
    pool.allocate(2)
    assert policy.fits(pool, 3, []) and not policy.fits(pool, 4, [])  # alone: every free page
    assert policy.fits(pool, 1, running) and not policy.fits(pool, 2, running)  # + watermark
    lead, child, short = req("g-0", 8), req("g-1", 8), req("s-1", 4)
    child.leader, short.leader = lead, req("s-0", 4)
    short.leader.status = lead.status = RequestStatus.RUNNING
    lead.begin_prefill()
    short.leader.begin_prefill()
    assert policy.must_wait(child)  # child 0 computes the prompt pages it will share
    assert not policy.must_wait(short)  # a prompt of one page or less: nothing to share
    assert not policy.must_wait(lead)
    assert not ContinuousAdmission(2, 4, wait_for_leader=False).must_wait(child)  # no caching
    lead.num_computed_tokens = 8
    assert not policy.must_wait(child)  # its prompt pages are cached now


def test_static_admission_policy():
    policy = StaticAdmission()
    assert policy.is_open([]) and not policy.is_open([req("r", 4)])  # the batch is running
    assert policy.wants_more(0)  # rows bound the chunks, not the admissions
    pool = PageAllocator(2)
    pool.allocate(2)
    assert policy.fits(pool, 3, [req("r", 4)])  # no page check: the pool preempts if it must
    child = req("g-1", 8)
    child.leader = req("g-0", 8)
    child.leader.status = RequestStatus.RUNNING
    assert not policy.must_wait(child)


def test_admission_policy_follows_batching():
    assert isinstance(make(batching="continuous").admission, ContinuousAdmission)
    assert isinstance(make(batching="static").admission, StaticAdmission)
    assert make(num_pages=300).admission.watermark == 3


def test_static_batch_ignores_rows_and_pages_continuous_keeps_a_watermark():
    # 8-token prompts: 2 pages each for the first chunk; a pool of 5 pages, watermark 1
    plans = {}
    for batching in ("continuous", "static"):
        s = make(num_slots=3, num_pages=5, page_size=4, chunk=8, rows=3, batching=batching)
        for i in range(3):
            s.add(req(str(i), 8))
        plans[batching] = s.schedule()
    cont, stat = plans["continuous"], plans["static"]
    assert [r.request_id for r in cont.inserted] == ["0", "1"]  # 2 + 2 (+ 1 kept back) pages
    assert [c.request.request_id for c in cont.prefill] == ["0", "1"]
    assert [r.request_id for r in stat.inserted] == ["0", "1", "2"]  # every slot filled
    assert [c.request.request_id for c in stat.prefill] == ["0", "1"]  # "2" waits for pages


def test_prefix_cache_hits_full_pages_but_never_the_last_prefill_token():
    s = make(num_slots=4, page_size=4, chunk=16, rows=4, caching=True)
    s.add(req("a", 12))
    finish_prefill(s.schedule())  # a's 12 prompt tokens: pages 0-2 registered
    s.add(req("b", 12))  # same 12 tokens: pages 0-1 shared, page 2 (last token) recomputed
    s.add(req("c", 10))  # a 10-token prefix of them: pages 0-1 shared, 2 tokens computed
    s.add(req("d", 12, prompt_logprobs=0))  # wants every prompt token's logits: no hits
    plan = s.schedule()
    a, b, c, d = s.running
    assert [(ch.request.request_id, ch.start, ch.length) for ch in plan.prefill] == [
        ("b", 8, 4),
        ("c", 8, 2),
        ("d", 0, 12),
    ]
    assert b.pages[:2] == a.pages[:2] == c.pages[:2] and b.pages[2] != a.pages[2]
    assert not set(d.pages) & set(a.pages)
    assert (b.num_cached_tokens, c.num_cached_tokens, d.num_cached_tokens) == (8, 8, 0)
    assert plan.page_updates[b.slot] == b.pages and s.num_cached_tokens == 16
    assert s.allocator.num_shared_refs == 4
    for r in (a, b, c, d):
        s.finish(r, RequestStatus.FINISHED_LENGTH)
    assert s.allocator.num_free_pages == 32 and s.allocator.num_shared_refs == 0


def test_prefix_cache_registers_prefill_pages_never_generated_ones():
    """Pages whose K/V a decode step wrote are not cached (they differ in bf16 from what a
    prefill computes for the same tokens, issue 24); a later turn hits the prompt's pages and
    recomputes the answer."""
    s = make(num_slots=2, page_size=4, chunk=8, rows=2, caching=True)
    s.add(req("a", 6, max_tokens=20))
    finish_prefill(s.schedule())  # prompt page 0 registered
    (a,) = s.running
    plans = [s.schedule() for _ in range(3)]  # positions 6, 7, 8 decoded (async: in flight)
    for p in plans:
        decode(p)
    s.schedule()
    assert len(a.block_uids) == 1  # page 1 (tokens 4-7) is full and known, but decode-written
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    assert s.prefix_cache.num_cached_pages == 1 and s.allocator.num_free_pages == 32
    turn = a.all_token_ids + [9, 9, 9]  # a later turn: a's prompt, its answer and more
    b = Request("b", "b", 0, turn, SamplingParams(max_tokens=8), 0, (2,), len(turn) + 8, 0.0)
    s.add(b)
    plan = s.schedule()
    assert b.num_cached_tokens == 4 and plan.prefill[0].start == 4
    assert not s.reset_prefix_cache()  # b is running


def test_bucket_for():
    assert [bucket_for(n, (2, 4, 8)) for n in (0, 1, 2, 3, 5, 8)] == [2, 2, 2, 4, 8, 8]
