"""Admission policies: when waiting requests may take free slots (`Scheduler._admit` asks).

Continuous and static batching differ only here, so the scheduler has no branch on the mode:

    ContinuousAdmission  a finished request's slot is refilled at the next plan, while prefill
                         rows and pages (with a small watermark) allow
    StaticAdmission      the baseline: a new batch only once the last one has finished

Host only.
"""

from __future__ import annotations

from typing import Protocol

from jaxserve.core.page_allocator import PageAllocator
from jaxserve.core.request import Request, RequestStatus


class AdmissionPolicy(Protocol):
    """When waiting requests may take free slots (`Scheduler._admit` asks, in this order)."""

    def is_open(self, running: list[Request]) -> bool:
        """Whether this plan admits at all (asked once, after the running requests are planned)."""
        ...

    def wants_more(self, rows_left: int) -> bool:
        """Whether to admit another request while `rows_left` prefill chunk rows are left."""
        ...

    def must_wait(self, req: Request) -> bool:
        """Whether the head of the queue waits for a later plan (and those behind it with it)."""
        ...

    def fits(self, allocator: PageAllocator, num_pages: int, running: list[Request]) -> bool:
        """Whether the pool can give a new request the `num_pages` pages of its first chunk."""
        ...


class ContinuousAdmission:
    """A finished request's slot is refilled at the next plan: requests are admitted while prefill
    rows and pages allow, keeping `watermark` free pages back for the running requests' growth."""

    def __init__(self, watermark: int, page_size: int, wait_for_leader: bool):
        self.watermark = watermark
        self.page_size = page_size
        self.wait_for_leader = wait_for_leader  # prefix caching: n > 1 children share its pages

    def is_open(self, running: list[Request]) -> bool:
        return True

    def wants_more(self, rows_left: int) -> bool:
        return rows_left > 0

    def must_wait(self, req: Request) -> bool:
        # its prompt pages are being computed by child 0: share them next step
        return self.wait_for_leader and _leader_prefilling(req, self.page_size)

    def fits(self, allocator: PageAllocator, num_pages: int, running: list[Request]) -> bool:
        headroom = self.watermark if running else 0  # alone, a request always fits
        return allocator.can_allocate(num_pages + headroom)


class StaticAdmission:
    """The baseline: a new batch only once every request of the last one has finished (no request
    running), then as many requests as there are free slots. Neither prefill rows nor pages hold
    one back: its chunks wait for rows, and a pool that runs out preempts, as for any request."""

    def is_open(self, running: list[Request]) -> bool:
        return not running

    def wants_more(self, rows_left: int) -> bool:
        return True

    def must_wait(self, req: Request) -> bool:
        return False

    def fits(self, allocator: PageAllocator, num_pages: int, running: list[Request]) -> bool:
        return True


def _leader_prefilling(req: Request, page_size: int) -> bool:
    """`req` is a later child of an n > 1 request whose child 0 is still computing prompt pages."""
    lead = req.leader
    return (
        lead is not None
        and lead.status == RequestStatus.RUNNING
        and not lead.prefill_done
        and len(req.prompt_token_ids) > page_size
        and req.sampling_params.prompt_logprobs is None
    )
