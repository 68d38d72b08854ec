"""The prefix cache: full KV pages found again by the tokens they hold. Host only (no jax).

vLLM's automatic prefix caching (EngineConfig.enable_prefix_caching). A page that holds a full page
of some token sequence's K/V is registered under a key naming its content exactly,

    key = (uid of the previous page's key, or 0 for the first page,  the page's token ids)

so a key names the whole token prefix up to the page's end, with no hash collisions: uids are never
reused, so the key of a page whose parent was evicted can never match again. A request carries the
uids of its first full pages (`Request.block_uids`, matched or registered), which name the parent
of its next page's key.

What the scheduler calls, and when (scheduler.py):

    take(req)       at admission: shares the cached pages req's prefill tokens begin with, so only
                    the rest is prefilled. Never the page holding the last prefill token (it must
                    be computed to sample from), and nothing for a request that wants prompt
                    log-probs (every prompt token's logits are computed).
    register(req)   registers req's full pages whose K/V a prefill computed: pages of its prefill
                    tokens (the prompt, or after a preemption the prompt and the generated tokens
                    it recomputes) as their chunks are planned. A key already cached (another page
                    computed the same prefix) keeps its page; req's copy stays private and is freed
                    as usual.
    reset()         forgets every key, while no page is held.

Only prefill-computed pages are cached, so that a hit changes no output (issue 24): a request that
hits computes bit for bit what it would have computed without the cache. A prefill computes a
token's K/V the same whatever its chunk's offset, its row bucket or its page-table width (measured
on the CPU in bf16, SmolLM2: a prompt's K/V are identical prefilled alone or inside a longer
prompt; hits of 304 tokens, off the 64-token chunk grid, and 48 batched few-shot rows and n=4
samples gave every uncached token). A decode step does not: its one-token attention and
matmuls reduce in another order than a prefill chunk's, so a generated token's K/V differ from
what the next turn's uncached prefill computes for it (SmolLM2 bf16: from layer 1 on, 59 of 64
answer positions differed, by up to 0.22), and taking those pages from the cache changed 32 of 64
greedy follow-up answers of a 32-chat, three-turn benchmark. So a chat's next turn takes the
previous turn's prompt pages from the cache, and computes the previous answer's tokens again.

The table (key -> page and uid) lives here; reference counts and the evictable pages live in the
`PageAllocator`. A registered page is `retain`ed there, so when its last holder frees it, it stays
evictable (its K/V still reusable) until an allocation needs it; the allocator then tells this
cache (`on_evict`), which drops the page's key.

    a page's life:   held --register--> held, cached --free (ref 0)--> evictable --take--> held
                     evictable --allocate (no free page left)--> held by a new owner, key gone
"""

from __future__ import annotations

from jaxserve.core.page_allocator import PageAllocator
from jaxserve.core.request import Request


class PrefixCache:
    """Keys of full pages -> (page, uid). With enabled=False it matches and registers nothing."""

    def __init__(self, allocator: PageAllocator, page_size: int, enabled: bool = True):
        if allocator.on_evict is not None:
            raise ValueError("the allocator already reports its evictions to a prefix cache")
        self.allocator = allocator
        self.page_size = page_size
        self.enabled = enabled
        self._table: dict[tuple, tuple[int, int]] = {}  # key -> (page, uid)
        self._page_key: dict[int, tuple] = {}  # registered page -> its key
        self._next_uid = 1
        allocator.on_evict = self._forget

    @property
    def num_cached_pages(self) -> int:
        """Registered pages: held, or evictable."""
        return len(self._page_key)

    # -- what the scheduler calls ---------------------------------------------------------------
    def match(self, req: Request) -> list[tuple[int, int]]:
        """(page, uid) of the cached pages `req`'s prefill tokens begin with (none taken yet)."""
        if not self.enabled or req.sampling_params.prompt_logprobs is not None:
            return []
        tokens = req.all_token_ids[: req.num_prefill_tokens]
        hits: list[tuple[int, int]] = []
        for i in range((req.num_prefill_tokens - 1) // self.page_size):
            hit = self._table.get(self._key(hits[-1][1] if hits else 0, tokens, i, req.lora_int_id))
            if hit is None:
                break
            hits.append(hit)
        return hits

    def take(self, req: Request) -> list[int]:
        """Shares the pages `match` finds and starts req.block_uids with their uids (req has just
        begun its prefill). The caller holds them now: it frees them if req is not admitted."""
        hits = self.match(req)
        for page, uid in hits:
            self.allocator.share(page)
            req.block_uids.append(uid)
        return [page for page, _ in hits]

    def register(self, req: Request) -> None:
        """Registers `req`'s full pages whose K/V its prefill computed (in this plan or an earlier
        one). Pages holding a token past the prefill (K/V written by decode steps) are not: their
        K/V differ in bf16 from a prefill's of the same tokens (see the module docstring)."""
        if not self.enabled:
            return
        full = min(req.num_computed_tokens, req.num_prefill_tokens) // self.page_size
        if len(req.block_uids) >= full:
            return
        tokens = req.all_token_ids
        for i in range(len(req.block_uids), full):
            parent = req.block_uids[i - 1] if i else 0
            key = self._key(parent, tokens, i, req.lora_int_id)
            req.block_uids.append(self.insert(req.pages[i], key))

    def reset(self) -> bool:
        """Forgets every cached prefix; evictable pages become free pages. Refused (False, nothing
        changed) while some page is held, since its holder's registrations would be lost
        mid-request."""
        if self.allocator.num_used_pages:
            return False
        self.allocator.release_retained()
        self._table.clear()
        self._page_key.clear()
        return True

    # -- the table ------------------------------------------------------------------------------
    def _key(self, parent_uid: int, tokens: list[int], i: int, lora_int_id: int = 0) -> tuple:
        """The key of the i-th page of `tokens`, whose previous page's key has `parent_uid`. The
        first page's names the LoRA adapter the K/V were computed with (0: none), so requests
        with other adapters never share a page (vLLM's extra hash key); the rest follow from it."""
        page = tuple(tokens[i * self.page_size : (i + 1) * self.page_size])
        return (
            (parent_uid, page, lora_int_id)
            if lora_int_id and not parent_uid
            else (parent_uid, page)
        )

    def lookup(self, key: tuple) -> tuple[int, int] | None:
        """(page, uid) registered under `key`, or None."""
        return self._table.get(key)

    def insert(self, page: int, key: tuple) -> int:
        """Records that held `page` holds the K/V named by `key`; returns the key's uid. If the key
        is already cached (another page computed the same prefix), that entry's uid is returned and
        `page` stays private to its holder."""
        if not self.enabled:
            raise RuntimeError("a disabled prefix cache registers nothing")
        if not self.allocator.is_held(page) or page in self._page_key:
            raise ValueError(f"page {page} is not held, or is registered already")
        hit = self._table.get(key)
        if hit is not None:
            return hit[1]
        self.allocator.retain(page)
        uid = self._next_uid
        self._next_uid += 1
        self._table[key] = (page, uid)
        self._page_key[page] = key
        return uid

    def _forget(self, page: int) -> None:
        """The allocator reuses evictable `page` for new K/V: its key names nothing any more."""
        del self._table[self._page_key.pop(page)]
