"""A numpy stand-in for `ModelRunner` whose next token is computable by hand (JetStream mock engine).

It keeps a real paged "KV cache" of token ids ([num_pages, page_size]) and reads every sequence back
through its page table, so any paging mistake (a page freed while in use, a wrong page table, a
resumed request re-prefilled wrongly) changes the tokens and shows as an exact mismatch against
`reference()`, which runs the same rule on the plain token list.

    next token = rule(sequence read back from the cache, seed of the slot)
"""

from __future__ import annotations

import numpy as np

from jaxserve.core.request import Request
from jaxserve.core.runner_api import Sampled, StepResult
from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.resolve import bucket_for


def default_rule(seq: list[int], seed: int, vocab: int = 64) -> int:
    return (sum((i + 1) * t for i, t in enumerate(seq)) * 31 + 7 + seed) % vocab


def fake_logprob(token: int) -> float:
    return -0.25 * (token % 4) - 0.5


class FakeRunner:
    """Implements `jaxserve.core.runner_api.Runner` in numpy (no jax)."""

    def __init__(
        self,
        num_slots,
        num_pages,
        page_size,
        decode_steps=1,
        rule=default_rule,
        rows=2,
        chunk=8,
        slot_buckets=None,
    ):
        self.num_slots, self.page_size, self.rule = num_slots, page_size, rule
        # Decode row buckets, as ModelRunner: a decode step advances only the slots below one.
        self.slot_buckets = slot_buckets or (num_slots,)
        self.decode_rows: list[int] = []  # the row bucket of every decode step
        self.kv = np.full((num_pages, page_size), -1, np.int64)
        self.page_table: dict[int, list[int]] = {}
        self.active = np.zeros(num_slots, bool)
        self.last = np.zeros(num_slots, np.int64)
        self.seq_len = np.zeros(num_slots, np.int64)
        self.max_total = np.zeros(num_slots, np.int64)
        self.seed = np.zeros(num_slots, np.uint64)  # derived child seeds are 64-bit
        self.decode_steps, self.rows, self.chunk = decode_steps, rows, chunk
        self.num_h2d_transfers = 0
        self.num_d2h_transfers = 0
        self.overlaps_grammar = False  # the masks come with the plan (and are not applied)
        self.plans: list[SchedulerOutput] = []  # every plan executed, for assertions
        self.log: list[dict] = []  # what each plan held when it ran (requests mutate later)

    def _write(self, slot: int, pos: int, token: int) -> None:
        pages = self.page_table[slot]
        assert pos // self.page_size < len(pages), (
            f"slot {slot} writes position {pos} past its pages"
        )
        self.kv[pages[pos // self.page_size], pos % self.page_size] = token

    def _read(self, slot: int, n: int) -> list[int]:
        pages = self.page_table[slot]
        return [int(self.kv[pages[p // self.page_size], p % self.page_size]) for p in range(n)]

    def _insert(self, req: Request) -> None:
        s = req.slot
        self.active[s] = False
        self.seq_len[s] = req.num_cached_tokens  # prefix-cache hits: its prefill starts there
        self.max_total[s] = req.max_total_len
        self.seed[s] = req.seed

    def dispatch(self, plan: SchedulerOutput, masks=None, masks_later=False) -> StepResult:
        if masks_later:
            raise RuntimeError("FakeRunner computes a step at dispatch: its masks come with it")
        return self._run(plan)  # computed at once; the engine still fetches it a step later

    def fetch(self, handle: StepResult) -> StepResult:
        return handle

    def complete(self, handle: StepResult, masks) -> StepResult:
        raise RuntimeError("FakeRunner computes a step at dispatch: no step is ever deferred")

    def warmup(self) -> float:
        return 0.0  # nothing to compile

    def _run(self, plan: SchedulerOutput) -> StepResult:
        self.plans.append(plan)
        self.log.append(
            {
                "released": list(plan.released),
                "inserted": [r.slot for r in plan.inserted],
                "decode": [r.slot for r in plan.decode],
                "prefill": [(c.request.slot, c.start, c.length) for c in plan.prefill],
            }
        )
        for s in plan.released:
            self.active[s] = False
            self.page_table.pop(s, None)
        for a, b in plan.moves:
            assert not self.active[b] and b not in self.page_table, f"move {a}->{b}: {b} is held"
            for arr in (self.active, self.last, self.seq_len, self.max_total, self.seed):
                arr[b] = arr[a]
            self.active[a] = False
            if a in self.page_table:
                self.page_table[b] = self.page_table.pop(a)
        for req in plan.inserted:
            self._insert(req)
        for s, pages in plan.page_updates.items():
            self.page_table[s] = list(pages)
        decoding = set(plan.decode_slots)
        assert decoding <= set(np.flatnonzero(self.active)), "a planned slot is not active"
        for s in set(np.flatnonzero(self.active)) - decoding:  # only slots at their length limit
            assert self.seq_len[s] + 2 > self.max_total[s], f"slot {s} active but not planned"
        k, n = plan.num_decode_steps, self.num_slots
        decode = prefill = None
        if plan.decode:
            n = bucket_for(max(plan.decode_slots) + 1, self.slot_buckets)
            self.decode_rows.append(n)
            decode = Sampled(
                np.zeros((n, k), np.int32),
                np.zeros((n, k), np.float32),
                None,
                np.zeros((n, k), bool),
            )
            for s in np.flatnonzero(self.active[:n]):
                for j in range(k):
                    if self.seq_len[s] + 2 > self.max_total[s]:
                        break
                    self._write(s, int(self.seq_len[s]), int(self.last[s]))
                    self.seq_len[s] += 1
                    tok = self.rule(self._read(s, int(self.seq_len[s])), int(self.seed[s]))
                    self.last[s] = tok
                    decode.tokens[s, j], decode.valid[s, j] = tok, True
                    decode.logprobs[s, j] = fake_logprob(tok)
        if plan.prefill:
            r = self.rows
            prefill = Sampled(np.zeros(r, np.int32), np.zeros(r, np.float32))
            assert len(plan.prefill) <= r
            for i, c in enumerate(plan.prefill):
                s = c.request.slot
                assert c.length <= self.chunk and self.seq_len[s] == c.start
                for t, tok in enumerate(c.token_ids):
                    self._write(s, c.start + t, tok)
                self.seq_len[s] = c.start + c.length
                if c.is_last:
                    tok = (
                        c.request.output_token_ids[-1]
                        if plan.forced[i]
                        else self.rule(self._read(s, int(self.seq_len[s])), int(self.seed[s]))
                    )
                    self.last[s] = tok
                    self.active[s] = True
                    prefill.tokens[i] = tok
                    prefill.logprobs[i] = fake_logprob(tok)
            self.num_h2d_transfers += 1
        if plan.decode or plan.prefill:
            self.num_d2h_transfers += 1
        return StepResult(decode, prefill)


def reference(prompt, max_tokens, seed=0, rule=default_rule, stop_ids=(), max_model_len=10**9):
    """Tokens the rule produces for `prompt`, stopping at a stop id, max_tokens or max_model_len."""
    seq, out = list(prompt), []
    while len(out) < max_tokens and len(seq) < max_model_len:
        tok = rule(seq, seed)
        out.append(tok)
        seq.append(tok)
        if tok in stop_ids:
            break
    return out
