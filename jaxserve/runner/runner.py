"""The one device-facing class: params, the paged KV cache and the slot state, with jitted steps.

JetStream's slot API over a paged cache:

    insert(request, slot)   writes the request's row into the slot state (sampling row, counters);
                            its K/V pages come from the host allocator via the page table
    prefill(chunks)         runs R fixed-size chunks [R, T] through the model, writing K/V into each
                            slot's pages; a chunk that completes a prompt samples the first token
                            (or installs the last generated one, after a preemption) and activates
                            its slot
    generate()              advances every active slot by `decode_steps` tokens (lax.scan)
    move(moves)             copies slot rows to other slots (the scheduler packing requests down)
    _mixed                  a decode step and one prefill chunk in ONE forward pass (fuse_prefill):
                            the layers' weights are read once and the matmuls get more rows

`dispatch(plan)` queues one engine step in that order: release / move / insert / page-table
sync, then `generate` (the slots decoding before this step), then `prefill`; `fetch` then makes
ONE device->host transfer of the new tokens (and log-probs when any request asked). JAX dispatch
is asynchronous, so the engine can dispatch the next step before fetching this one.

Step functions are jitted once per shape bucket so their cost follows the real work:
  generate  per flat live-page bucket F (a power of two >= the decoding slots' pages) with the
            CPU's 'ragged' attention, or per page-table width bucket W (a power of two of pages,
            capped at max_pages_per_seq) with the others; and per slot row bucket B
            (`EngineConfig.slot_buckets`): it computes only slots [0, B), B the smallest bucket
            above the highest decoding slot, so on the CPU the drain of a batch with 3 requests
            left costs an 8-row step, not a 32-row one
  prefill   per width W and row bucket (a power of two of chunks, up to
            R = max_num_batched_tokens // prefill_chunk_size): a step with one chunk does not pay
            for R
  mixed     per flat live-page bucket of the full row bucket, with one chunk of a prompt's first
            two (page-table width `mixed_width`); other steps with both run the two calls
`warmup()` compiles every bucket, after which nothing recompiles. Params are an argument of every
jitted function; the KV cache and slot state are donated.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import MAX_LOGPROBS, SamplingParams, make_slot_row
from jaxserve.core.scheduler import SchedulerOutput, bucket_for
from jaxserve.layers import kv_cache, linear
from jaxserve.layers.attention import AttentionMetadata, resolve_impl
from jaxserve.layers.ragged_attention import flat_bucket, flat_buckets
from jaxserve.models import llama
from jaxserve.runner import sampling

logger = logging.getLogger(__name__)


@struct.dataclass
class SlotState:
    last_token: jax.Array  # i32[S]  newest token, not yet in the cache (the next decode feeds it)
    seq_len: jax.Array  # i32[S]  tokens whose K/V are cached = position of last_token
    max_total_len: jax.Array  # i32[S]  decoding stops when prompt + output reach this
    num_generated: jax.Array  # i32[S]  output tokens so far (the step of the sampling key)
    active: jax.Array  # bool[S]  the slot decodes
    page_table: jax.Array  # i32[S, max_pages_per_seq]
    sampling: sampling.SamplingState  # [S, ...] per-slot sampling parameters, keys, counts


@struct.dataclass
class PrefillBatch:
    tokens: jax.Array  # i32[R, T]  chunk tokens, 0-padded
    slots: jax.Array  # i32[R]  slot of each row; S marks a padding row
    start: jax.Array  # i32[R]  position of the row's first token
    length: jax.Array  # i32[R]  valid tokens in the row; 0 = padding row
    is_last: jax.Array  # bool[R]  the chunk completes the prefill
    forced: jax.Array  # i32[R]  token to install instead of sampling (-1 = sample)
    targets: jax.Array  # i32[R, T]  next prompt token for prompt log-probs (-1 = none)


@dataclasses.dataclass
class StepResult:
    """Host copies of one step's outputs (k = decode_steps, K = top log-probs, T = chunk)."""

    decode_tokens: np.ndarray | None = None  # i32[S, k]
    decode_valid: np.ndarray | None = None  # bool[S, k]
    decode_logprobs: np.ndarray | None = None  # f32[S, k]
    decode_top_ids: np.ndarray | None = None  # i32[S, k, K] (only when some slot asked)
    decode_top_logprobs: np.ndarray | None = None  # f32[S, k, K]
    prefill_tokens: np.ndarray | None = None  # i32[R]
    prefill_logprobs: np.ndarray | None = None  # f32[R]
    prefill_top_ids: np.ndarray | None = None  # i32[R, K]
    prefill_top_logprobs: np.ndarray | None = None  # f32[R, K]
    prompt_logprobs: np.ndarray | None = None  # f32[R, T]
    prompt_top_ids: np.ndarray | None = None  # i32[R, T, K]
    prompt_top_logprobs: np.ndarray | None = None  # f32[R, T, K]


def init_slot_state(num_slots: int, max_pages: int, vocab_size: int) -> SlotState:
    zeros = lambda: jnp.zeros((num_slots,), jnp.int32)  # distinct buffers: the state is donated
    return SlotState(
        last_token=zeros(),
        seq_len=zeros(),
        max_total_len=zeros(),
        num_generated=zeros(),
        active=jnp.zeros((num_slots,), bool),
        page_table=jnp.zeros((num_slots, max_pages), jnp.int32),
        sampling=sampling.init_state(num_slots, vocab_size),
    )


@functools.partial(jax.jit, donate_argnames=("state",))
def _insert(state: SlotState, slot, row, num_generated, max_total_len) -> SlotState:
    """JetStream `insert`: one request's row into slot `slot` (i32[]); the slot stays inactive."""
    return state.replace(
        sampling=sampling.set_slot(state.sampling, slot, row),
        num_generated=state.num_generated.at[slot].set(num_generated),
        max_total_len=state.max_total_len.at[slot].set(max_total_len),
        seq_len=state.seq_len.at[slot].set(0),
        active=state.active.at[slot].set(False),
    )


@functools.partial(jax.jit, donate_argnames=("state",))
def _sync(state: SlotState, page_table, active) -> SlotState:
    """Installs the host's page table i32[S, max_pages] and decode mask bool[S]."""
    return state.replace(page_table=page_table, active=active)


@functools.partial(jax.jit, donate_argnames=("state",))
def _move(state: SlotState, src, dst) -> SlotState:
    """Copies slot rows src[i] -> dst[i] (i32[S] each; dst = S marks padding, dropped)."""
    s = state.last_token.shape[0]
    return jax.tree.map(lambda a: a.at[dst].set(a[jnp.minimum(src, s - 1)], mode="drop"), state)


def _decode_inputs(st: SlotState, pt, num_flat: int, ps: int):
    """One decode step's inputs for slot rows `st` (B rows): (alive bool[B], tokens [B, 1], meta)."""
    rows, width = pt.shape
    alive = st.active & (st.seq_len + 2 <= st.max_total_len)  # (B,)
    pos = st.seq_len  # (B,)
    page = pt[jnp.arange(rows), jnp.minimum(pos // ps, width - 1)]
    meta = AttentionMetadata(
        positions=pos[:, None],
        slot_mapping=jnp.where(alive, page * ps + pos % ps, -1)[:, None],
        page_table=pt,
        seq_lens=jnp.where(alive, pos + 1, 0),
        num_flat_pages=num_flat,
    )
    return alive, st.last_token[:, None], meta


def _decode_advance(st: SlotState, logits, alive, want_top):
    """Samples one token per row from logits f32[B, V] and advances the alive rows."""
    out = sampling.sample(logits, st.sampling, st.num_generated, MAX_LOGPROBS, want_top)
    tok = jnp.where(alive, out.tokens, st.last_token)
    inc = alive.astype(jnp.int32)
    st = st.replace(
        last_token=tok,
        seq_len=st.seq_len + inc,
        num_generated=st.num_generated + inc,
        sampling=sampling.update_counts(st.sampling, tok, alive),
    )
    return st, (tok, alive, out.logprobs, out.top_ids, out.top_logprobs)


def _rows(state: SlotState, rows: int) -> SlotState:
    """Slots [0, rows) of the state (all of it when rows covers every slot)."""
    if rows < state.last_token.shape[0]:
        return jax.tree.map(lambda a: a[:rows], state)
    return state


def _set_rows(full: SlotState, part: SlotState) -> SlotState:
    """`full` with slots [0, rows) replaced by `part`'s."""
    rows = part.last_token.shape[0]
    if rows < full.last_token.shape[0]:
        return jax.tree.map(lambda f, b: f.at[:rows].set(b), full, part)
    return part


@functools.partial(
    jax.jit,
    static_argnames=("config", "width", "num_flat", "num_steps", "impl", "rows"),
    donate_argnames=("cache", "state"),
)
def _generate(params, cache, state, want_top, *, config, width, num_flat, num_steps, impl, rows):
    """JetStream `generate`: every active slot among the first `rows` advances `num_steps` tokens.

    rows: the step's row bucket (static); slots >= rows are left as they are (the scheduler keeps
    every occupied slot below it), so the matmuls compute [rows, D], not [S, D].

    num_flat: the 'ragged' attention's live-page bucket (>= the decoding slots' pages; 0 for the
    other implementations, whose cost follows the page-table width instead).

    want_top (bool[], traced: no second variant is compiled) turns the top-K log-prob search on
    for steps where some request asked for log-probs; otherwise those outputs are zeros.

    Returns (cache, state, (tokens i32[k, B], valid bool[k, B], logprobs f32[k, B],
    top_ids i32[k, B, K], top_logprobs f32[k, B, K])), B = rows.
    """
    sub = _rows(state, rows)
    pt = sub.page_table[:, :width]  # (B, W)

    def step(carry, _):
        cache, st = carry
        alive, tokens, meta = _decode_inputs(st, pt, num_flat, cache.page_size)
        hidden, cache = llama.forward(params, tokens, meta, cache, config, impl)
        logits = llama.compute_logits(params, hidden[:, 0], config)  # (B, V)
        st, out = _decode_advance(st, logits, alive, want_top)
        return (cache, st), out

    (cache, sub), outs = jax.lax.scan(step, (cache, sub), None, length=num_steps)
    return cache, _set_rows(state, sub), outs


def _prefill_inputs(state: SlotState, batch: PrefillBatch, width: int, ps: int):
    """A prefill batch's attention metadata over the slots' page tables (width W)."""
    s = state.last_token.shape[0]
    t = batch.tokens.shape[1]
    slot = jnp.minimum(batch.slots, s - 1)  # gather index; padding rows read a real slot, unused
    pt = state.page_table[slot, :width]  # (R, W)
    pos = batch.start[:, None] + jnp.arange(t)[None, :]  # (R, T)
    valid = jnp.arange(t)[None, :] < batch.length[:, None]  # (R, T)
    page = jnp.take_along_axis(pt, jnp.minimum(pos // ps, width - 1), axis=1)
    return AttentionMetadata(
        positions=pos,
        slot_mapping=jnp.where(valid, page * ps + pos % ps, -1),
        page_table=pt,
        seq_lens=jnp.where(batch.length > 0, batch.start + batch.length, 0),
    )


def _last_hidden(hidden, batch: PrefillBatch):
    """hidden [R, T, D] -> each row's last valid token [R, D]."""
    return hidden[jnp.arange(hidden.shape[0]), jnp.maximum(batch.length - 1, 0)]


def _prefill_advance(state: SlotState, batch: PrefillBatch, logits, want_top):
    """Samples (or installs) the token of each row completing a prefill; logits f32[R, V] of the
    rows' last tokens. Sets seq_len, activates the finished slots. Returns (state, (tokens,
    logprobs, top_ids, top_logprobs))."""
    s = state.last_token.shape[0]
    slot = jnp.minimum(batch.slots, s - 1)
    row_valid = batch.length > 0  # (R,)
    sub = jax.tree.map(lambda x: x[slot], state.sampling)  # the rows' sampling state (R, ...)
    out = sampling.sample(logits, sub, state.num_generated[slot], MAX_LOGPROBS, want_top)
    finishing = row_valid & batch.is_last
    sampled = finishing & (batch.forced < 0)
    tok = jnp.where(batch.forced >= 0, batch.forced, out.tokens)
    fin_idx = jnp.where(finishing, batch.slots, s)  # index s is out of range: dropped
    smp_idx = jnp.where(sampled, batch.slots, s)
    tokens_s = jnp.zeros((s,), jnp.int32).at[smp_idx].set(tok, mode="drop")
    sampled_s = jnp.zeros((s,), bool).at[smp_idx].set(True, mode="drop")
    state = state.replace(
        last_token=state.last_token.at[fin_idx].set(tok, mode="drop"),
        seq_len=state.seq_len.at[jnp.where(row_valid, batch.slots, s)].set(
            batch.start + batch.length, mode="drop"
        ),
        active=state.active.at[fin_idx].set(True, mode="drop"),
        num_generated=state.num_generated + sampled_s.astype(jnp.int32),
        sampling=sampling.update_counts(state.sampling, tokens_s, sampled_s),
    )
    return state, (tok, out.logprobs, out.top_ids, out.top_logprobs)


@functools.partial(
    jax.jit,
    static_argnames=("config", "width", "prompt_logprobs", "impl"),
    donate_argnames=("cache", "state"),
)
def _prefill(
    params, cache, state, batch: PrefillBatch, want_top, *, config, width, prompt_logprobs, impl
):
    """JetStream `prefill` over fixed [R, T] chunks, K/V written into each row's slot pages.

    Returns (cache, state, (tokens i32[R], logprobs f32[R], top_ids i32[R, K], top_lp f32[R, K],
    prompt (lp f32[R, T], top_ids i32[R, T, K], top_lp f32[R, T, K]) or None)).
    """
    r, t = batch.tokens.shape
    meta = _prefill_inputs(state, batch, width, cache.page_size)
    hidden, cache = llama.forward(params, batch.tokens, meta, cache, config, impl)  # (R, T, D)
    logits = llama.compute_logits(params, _last_hidden(hidden, batch), config)  # (R, V)
    state, out = _prefill_advance(state, batch, logits, want_top)
    prompt = None
    if prompt_logprobs:
        all_logits = llama.compute_logits(params, hidden, config)  # (R, T, V)
        lp, top_ids, top_lp = sampling.token_logprobs(
            all_logits.reshape(r * t, -1), batch.targets.reshape(r * t), MAX_LOGPROBS
        )
        prompt = (lp.reshape(r, t), top_ids.reshape(r, t, -1), top_lp.reshape(r, t, -1))
    return cache, state, (*out, prompt)


@functools.partial(
    jax.jit,
    static_argnames=("config", "width", "num_flat", "rows", "prefill_width", "impl"),
    donate_argnames=("cache", "state"),
)
def _mixed(
    params,
    cache,
    state,
    batch: PrefillBatch,
    want_top,
    want_top_prefill,
    *,
    config,
    width,
    num_flat,
    rows,
    prefill_width,
    impl,
):
    """One decode step of slots [0, rows) and a prefill batch in ONE forward pass
    (`llama.forward_parts`): each layer's weights are read once for both, and the matmuls see
    rows + R*T rows instead of two smaller calls. Same results as `_generate` (num_steps 1) then
    `_prefill` (no prompt log-probs): the two touch disjoint slots. Returns (cache, state,
    decode outputs as `_generate`'s, prefill outputs as `_prefill`'s without the prompt part)."""
    sub = _rows(state, rows)
    alive, tokens, dmeta = _decode_inputs(sub, sub.page_table[:, :width], num_flat, cache.page_size)
    pmeta = _prefill_inputs(state, batch, prefill_width, cache.page_size)
    (hd, hp), cache = llama.forward_parts(
        params, [(tokens, dmeta), (batch.tokens, pmeta)], cache, config, impl
    )
    last = jnp.concatenate([hd[:, 0], _last_hidden(hp, batch)])  # (rows + R, D)
    logits = llama.compute_logits(params, last, config)  # one lm_head pass for both
    sub, dec = _decode_advance(sub, logits[:rows], alive, want_top)
    state, pre = _prefill_advance(_set_rows(state, sub), batch, logits[rows:], want_top_prefill)
    return cache, state, (jax.tree.map(lambda a: a[None], dec), pre)


class ModelRunner:
    """Owns the device state; `execute(plan)` runs one scheduler plan and returns host numpy."""

    def __init__(
        self, params, model_config: ModelConfig, engine_config: EngineConfig, num_pages: int
    ):
        if jax.default_backend() == "cpu":  # XLA's CPU GEMM is faster on [out, in] weights
            params = {**params, "layers": linear.cpu_layout(params["layers"])}
        self.params = params
        self.model_config = model_config
        self.config = engine_config
        self.num_slots = engine_config.num_slots
        self.max_pages = engine_config.max_pages_per_seq
        self.rows = max(1, engine_config.max_num_batched_tokens // engine_config.prefill_chunk_size)
        # Prefill row buckets: a step with one chunk (the steady state) computes [1, T], not [R, T].
        self.row_buckets = sorted(
            {min(1 << i, self.rows) for i in range(self.rows.bit_length() + 1)}
        )
        self.chunk = engine_config.prefill_chunk_size
        c = model_config
        self.cache = kv_cache.init(
            c.num_layers,
            c.num_kv_heads,
            num_pages,
            engine_config.page_size,
            c.head_dim,
            engine_config.kv_cache_dtype,
            jnp.dtype(engine_config.dtype),
        )
        self.state = init_slot_state(self.num_slots, self.max_pages, c.vocab_size)
        self.widths = sorted(
            {min(1 << i, self.max_pages) for i in range(self.max_pages.bit_length() + 1)}
        )
        # 'ragged' decode: one width (the whole table), buckets of the decoding slots' total pages
        self.ragged = resolve_impl(engine_config.attention_impl) == "ragged"
        self.max_flat = min(num_pages, self.num_slots * self.max_pages)
        self.slot_buckets = engine_config.resolved_slot_buckets(jax.default_backend())
        # Fused decode + prefill (`_mixed`): one chunk of a prompt's first two (page-table width
        # `mixed_width`) beside a full-bucket decode step; 0 = off.
        self.mixed_width = 0
        if engine_config.fuse_prefill and engine_config.decode_steps == 1:
            self.mixed_width = self.width_for(
                min(self.max_pages, -(-2 * self.chunk // engine_config.page_size))
            )
        self._page_table = np.zeros((self.num_slots, self.max_pages), np.int32)  # host mirror
        self._active = np.zeros((self.num_slots,), bool)  # host mirror of state.active
        self._dirty = False
        self.num_h2d_transfers = 0
        self.num_d2h_transfers = 0
        self.num_fused_steps = 0  # steps run as one `_mixed` call

    def width_for(self, num_pages: int) -> int:
        """The smallest bucket holding `num_pages` pages."""
        for w in self.widths:
            if w >= num_pages:
                return w
        raise ValueError(f"{num_pages} pages exceed max_pages_per_seq={self.max_pages}")

    def _static(self) -> dict:
        return {"config": self.model_config, "impl": self.config.attention_impl}

    # -- slot API -------------------------------------------------------------------------------
    def insert(self, req: Request) -> None:
        row = make_slot_row(
            req.sampling_params,
            req.prompt_token_ids,
            req.output_token_ids,
            req.eos_token_ids,
            req.seed,
            self.config.max_model_len,
        )
        self.state = _insert(
            self.state,
            np.int32(req.slot),
            row,
            np.int32(len(req.output_token_ids)),
            np.int32(req.max_total_len),
        )
        self._active[req.slot] = False
        self._dirty = True
        self.num_h2d_transfers += 1

    def release(self, slot: int) -> None:
        self._active[slot] = False
        self._dirty = True

    def set_pages(self, slot: int, pages: list[int]) -> None:
        self._page_table[slot, : len(pages)] = pages
        self._page_table[slot, len(pages) :] = 0
        self._dirty = True

    def _flush(self) -> None:
        if self._dirty:
            self.state = _sync(self.state, self._page_table.copy(), self._active.copy())
            self.num_h2d_transfers += 1
            self._dirty = False

    def max_flat_for(self, rows: int) -> int:
        """The most live pages a decode step over `rows` slots can hold."""
        return min(self.max_flat, rows * self.max_pages)

    def decode_shapes(self) -> list[tuple[int, int, int]]:
        """Every (rows, width, num_flat) that `decode_shape` can return (what warm-up compiles)."""
        if self.ragged:
            return [
                (b, self.max_pages, f)
                for b in self.slot_buckets
                for f in flat_buckets(self.max_flat_for(b))
            ]
        return [(b, w, 0) for b in self.slot_buckets for w in self.widths]

    def mixed_shapes(self) -> list[tuple[int, int, int]]:
        """The decode shapes a fused decode + prefill step can take (the full row bucket)."""
        if not self.mixed_width:
            return []
        return [x for x in self.decode_shapes() if x[0] == self.slot_buckets[-1]]

    def decode_shape(self, decoding: list[Request], slots: list[int]) -> tuple[int, int, int]:
        """(rows, width, num_flat) of the decode step over `decoding`, which sit in `slots`."""
        rows = bucket_for(max(slots) + 1, self.slot_buckets)
        if self.ragged:
            total = sum(len(r.pages) for r in decoding)
            return rows, self.max_pages, flat_bucket(total, self.max_flat_for(rows))
        return rows, self.width_for(max(len(r.pages) for r in decoding)), 0

    def generate(self, width: int, num_flat: int = 0, want_top: bool = False, rows: int = 0):
        self.cache, self.state, out = _generate(
            self.params,
            self.cache,
            self.state,
            np.bool_(want_top),
            width=width,
            num_flat=num_flat,
            num_steps=self.config.decode_steps,
            rows=rows or self.num_slots,
            **self._static(),
        )
        return out

    def move(self, moves: list[tuple[int, int]]) -> None:
        """Moves slot rows (a request changing slot, `Scheduler._compact`): one device copy."""
        src = np.full((self.num_slots,), self.num_slots, np.int32)
        dst = src.copy()
        for i, (a, b) in enumerate(moves):
            src[i], dst[i] = a, b
        self.state = _move(self.state, src, dst)
        self.num_h2d_transfers += 1
        a, b = zip(*moves)
        a, b = list(a), list(b)
        self._page_table[b] = self._page_table[a]
        active = self._active[a].copy()
        self._page_table[a] = 0
        self._active[a] = False
        self._active[b] = active
        self._dirty = True

    def prefill(
        self, batch: PrefillBatch, width: int, prompt_logprobs: bool, want_top: bool = False
    ):
        self.cache, self.state, out = _prefill(
            self.params,
            self.cache,
            self.state,
            batch,
            np.bool_(want_top),
            width=width,
            prompt_logprobs=prompt_logprobs,
            **self._static(),
        )
        return out

    # -- one engine step ------------------------------------------------------------------------
    def execute(self, plan: SchedulerOutput) -> StepResult:
        """Runs one plan to completion: `fetch(dispatch(plan))`."""
        return self.fetch(self.dispatch(plan))

    def dispatch(self, plan: SchedulerOutput) -> dict[str, jax.Array]:
        """Queues the plan's device work (asynchronously) and returns the arrays to fetch."""
        for slot in plan.released:
            self.release(slot)
        if plan.moves:
            self.move(plan.moves)
        for req in plan.inserted:
            self.insert(req)
        for slot, pages in plan.page_updates.items():
            self.set_pages(slot, pages)
        self._flush()

        fetch: dict[str, jax.Array] = {}
        if plan.decode and plan.prefill and self._fuse(plan):
            self._dispatch_mixed(plan, fetch)
        else:
            self._dispatch_separate(plan, fetch)
        for x in fetch.values():
            x.copy_to_host_async()  # the transfer starts as soon as the step is computed
        return fetch

    def _fuse(self, plan: SchedulerOutput) -> bool:
        """The plan's decode and prefill can run as one `_mixed` call."""
        if not self.mixed_width or len(plan.prefill) != 1:
            return False
        c = plan.prefill[0]
        if c.request.sampling_params.prompt_logprobs is not None:
            return False
        rows, _, _ = self.decode_shape(plan.decode, plan.decode_slots)
        return rows == self.slot_buckets[-1] and len(c.request.pages) <= self.mixed_width

    def mixed(
        self,
        batch: PrefillBatch,
        rows: int,
        width: int,
        num_flat: int,
        want_top=False,
        want_pf=False,
    ):
        """One `_mixed` call: decode of slots [0, rows) and `batch` in one forward pass."""
        self.cache, self.state, out = _mixed(
            self.params,
            self.cache,
            self.state,
            batch,
            np.bool_(want_top),
            np.bool_(want_pf),
            width=width,
            num_flat=num_flat,
            rows=rows,
            prefill_width=self.mixed_width,
            **self._static(),
        )
        return out

    def _dispatch_mixed(self, plan: SchedulerOutput, fetch: dict) -> None:
        want_top = any(r.sampling_params.logprobs for r in plan.decode)
        want_top_pf = bool(plan.prefill[0].request.sampling_params.logprobs)
        rows, width, num_flat = self.decode_shape(plan.decode, plan.decode_slots)
        batch, _ = self._prefill_batch(plan)
        dec, pre = self.mixed(batch, rows, width, num_flat, want_top, want_top_pf)
        self.num_h2d_transfers += 1
        self.num_fused_steps += 1
        self._after_prefill(plan)
        self._fetch_outputs(fetch, dec, want_top, pre, want_top_pf, None)

    def _after_prefill(self, plan: SchedulerOutput) -> None:
        for c in plan.prefill:
            if c.is_last:
                self._active[c.request.slot] = True  # the device activated it too

    @staticmethod
    def _fetch_outputs(fetch, dec, want_top, pre, want_top_pf, prompt) -> None:
        """Names the arrays of a step to bring back (decode / prefill outputs, either None)."""
        if dec is not None:
            tok, valid, lp, top_ids, top_lp = dec
            fetch.update(decode_tokens=tok, decode_valid=valid, decode_logprobs=lp)
            if want_top:
                fetch.update(decode_top_ids=top_ids, decode_top_logprobs=top_lp)
        if pre is not None:
            tok, lp, top_ids, top_lp = pre
            fetch.update(prefill_tokens=tok, prefill_logprobs=lp)
            if want_top_pf:
                fetch.update(prefill_top_ids=top_ids, prefill_top_logprobs=top_lp)
        if prompt is not None:
            fetch.update(
                prompt_logprobs=prompt[0], prompt_top_ids=prompt[1], prompt_top_logprobs=prompt[2]
            )

    def _dispatch_separate(self, plan: SchedulerOutput, fetch: dict) -> None:
        dec = pre = prompt = None
        want_top = want_top_pf = False
        if plan.decode:
            want_top = any(r.sampling_params.logprobs for r in plan.decode)
            rows, width, num_flat = self.decode_shape(plan.decode, plan.decode_slots)
            dec = self.generate(width, num_flat, want_top, rows)
        if plan.prefill:
            batch, want_prompt = self._prefill_batch(plan)
            need = max(len(c.request.pages) for c in plan.prefill)
            want_top_pf = any(c.request.sampling_params.logprobs for c in plan.prefill)
            *pre, prompt = self.prefill(batch, self.width_for(need), want_prompt, want_top_pf)
            self.num_h2d_transfers += 1
            self._after_prefill(plan)
        self._fetch_outputs(fetch, dec, want_top, pre, want_top_pf, prompt)

    def fetch(self, fetch: dict[str, jax.Array]) -> StepResult:
        """Waits for a dispatched step and brings its outputs to the host in one transfer."""
        if not fetch:
            return StepResult()
        host = jax.device_get(fetch)  # the step's one device->host transfer
        self.num_d2h_transfers += 1
        for name in ("tokens", "valid", "logprobs"):
            if "decode_" + name in host:  # scan stacks steps first: (k, S) -> (S, k)
                host["decode_" + name] = np.asarray(host["decode_" + name]).T
        for name in ("top_ids", "top_logprobs"):
            if "decode_" + name in host:
                host["decode_" + name] = np.asarray(host["decode_" + name]).transpose(1, 0, 2)
        return StepResult(**host)

    def _prefill_batch(self, plan: SchedulerOutput) -> tuple[PrefillBatch, bool]:
        """Host arrays of the plan's chunks, padded to a row bucket (all R rows for prompt logprobs,
        whose variant is compiled for R rows only)."""
        want_prompt = any(
            c.request.sampling_params.prompt_logprobs is not None
            and c.start + 1 < len(c.request.prompt_token_ids)
            for c in plan.prefill
        )
        r = (
            self.rows
            if want_prompt
            else next(b for b in self.row_buckets if b >= len(plan.prefill))
        )
        t, s = self.chunk, self.num_slots
        tokens = np.zeros((r, t), np.int32)
        targets = np.full((r, t), -1, np.int32)
        slots = np.full((r,), s, np.int32)
        start = np.zeros((r,), np.int32)
        length = np.zeros((r,), np.int32)
        is_last = np.zeros((r,), bool)
        forced = np.full((r,), -1, np.int32)
        for i, c in enumerate(plan.prefill):
            req = c.request
            ids = req.all_token_ids
            tokens[i, : c.length] = ids[c.start : c.start + c.length]
            slots[i], start[i], length[i], is_last[i] = req.slot, c.start, c.length, c.is_last
            if plan.forced[i]:
                forced[i] = req.output_token_ids[-1]  # complete: no token of it is in flight
            n_prompt = len(req.prompt_token_ids)
            if req.sampling_params.prompt_logprobs is not None and c.start + 1 < n_prompt:
                end = min(c.start + c.length, n_prompt - 1)
                targets[i, : end - c.start] = req.prompt_token_ids[c.start + 1 : end + 1]
        batch = PrefillBatch(tokens, slots, start, length, is_last, forced, targets)
        return batch, want_prompt

    def step_variants(self) -> list[tuple[str, dict]]:
        """Every step program the engine can run, as (kind, static shape): what warm-up compiles.

        ("generate", {rows, width, num_flat}) per decode bucket; ("prefill", {rows, width,
        prompt_logprobs}) per page-table width x prefill row bucket, plus the full row count with
        prompt log-probs; ("mixed", {rows, width, num_flat}) per fused decode + prefill bucket.
        """
        out = [("generate", dict(rows=r, width=w, num_flat=f)) for r, w, f in self.decode_shapes()]
        for w in self.widths:
            for r in self.row_buckets:
                out.append(("prefill", dict(rows=r, width=w, prompt_logprobs=False)))
            out.append(("prefill", dict(rows=self.rows, width=w, prompt_logprobs=True)))
        out += [("mixed", dict(rows=r, width=w, num_flat=f)) for r, w, f in self.mixed_shapes()]
        return out

    def padding_batch(self, rows: int) -> PrefillBatch:
        """A prefill batch of `rows` padding rows (no slot, no valid token)."""
        t, s = self.chunk, self.num_slots
        return PrefillBatch(
            tokens=np.zeros((rows, t), np.int32),
            slots=np.full((rows,), s, np.int32),
            start=np.zeros((rows,), np.int32),
            length=np.zeros((rows,), np.int32),
            is_last=np.zeros((rows,), bool),
            forced=np.full((rows,), -1, np.int32),
            targets=np.full((rows, t), -1, np.int32),
        )

    def warmup(self) -> float:
        """Compiles every step variant (`step_variants`); returns the seconds it took.

        All rows are padding (nothing active, no valid chunk), so the state is left as it was.
        """
        t0 = time.perf_counter()
        s = self.num_slots
        saved = self._active.copy()
        self._active[:] = False
        self._dirty = True
        self._flush()
        row = make_slot_row(SamplingParams(), [0], [], (), 0, self.config.max_model_len)
        self.state = _insert(self.state, np.int32(0), row, np.int32(0), np.int32(0))
        pad = np.full((s,), s, np.int32)
        self.state = _move(self.state, pad, pad)  # compiles the slot move (all rows padding)
        variants = self.step_variants()
        for kind, v in variants:
            if kind == "generate":
                self.generate(v["width"], v["num_flat"], rows=v["rows"])
            elif kind == "prefill":
                self.prefill(self.padding_batch(v["rows"]), v["width"], v["prompt_logprobs"])
            else:
                self.mixed(self.padding_batch(1), v["rows"], v["width"], v["num_flat"])
        self._active[:] = saved
        self._dirty = True
        self._flush()
        jax.block_until_ready(self.state)
        dt = time.perf_counter() - t0
        counts = {
            k: sum(kind == k for kind, _ in variants) for k in ("generate", "prefill", "mixed")
        }
        logger.info(
            "warm-up: %d decode, %d prefill and %d fused decode + prefill programs in %.1f s",
            counts["generate"],
            counts["prefill"],
            counts["mixed"],
            dt,
        )
        return dt
