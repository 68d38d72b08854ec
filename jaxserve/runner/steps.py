"""The engine's pure jitted step functions over a paged KV cache and the slot state
(`slot_state.py`: the state and JetStream's slot updates, insert / sync / set_grammar / move).

    generate(params, cache, state, want_top; shape: DecodeShape)
                                      every active slot among the first shape.rows advances
                                      `num_steps` tokens (lax.scan) -> DecodeOutput
    decode_forward / decode_sample    one decode step in two programs (forward -> logits, then
                                      sampling), so the host can compute structured-output masks
                                      while the forward runs; equal to generate's one step
                                      (`structured_decoding.py` runs them)
    prefill(params, cache, state, batch, want_top; shape: PrefillShape)
                                      R fixed-size chunks [R, T] through the model, K/V into each
                                      slot's pages; a chunk completing a prompt samples the first
                                      token (or installs the last generated one after a
                                      preemption) and activates its slot -> PrefillOutput
    prefill_forward / prefill_sample  the same in two programs, as decode: the forward (one per
                                      rows x page-table width) and the sampling (one per rows),
                                      so with width buckets the sampler is not compiled again
                                      for every width (`prefill_strategy.py` runs them)

Everything static is a hashable argument fixed when the engine is built (config, `ModelImpl`, the
step's shape); everything per request is an array. Params are an argument, never closed over; the
KV cache and the slot state are donated, so XLA updates them in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxserve.config import ModelConfig
from jaxserve.layers import kv_cache
from jaxserve.layers.attention import AttentionMetadata
from jaxserve.models import llama
from jaxserve.parallel.partition import pin_cache, pin_replicated, pin_slots
from jaxserve.resolve import DecodeShape, ModelImpl, PrefillShape
from jaxserve.runner import sampling, slot_state, token_history
from jaxserve.runner.input_batch import PrefillBatch
from jaxserve.runner.jit_step import step


@struct.dataclass
class DecodeOutput:
    """One `generate` call's results (k = num_steps, B = shape.rows, K = shape.num_top)."""

    tokens: jax.Array  # i32[k, B]
    valid: jax.Array  # bool[k, B]  the row produced a token at that step
    logprobs: jax.Array  # f32[k, B]  the token's log-prob (0 unless want_top)
    top_ids: jax.Array  # i32[k, B, K]  zeros unless want_top
    top_logprobs: jax.Array  # f32[k, B, K]
    ranks: jax.Array  # i32[k, B]  the token's vLLM rank (0 unless want_top)


@struct.dataclass
class PromptLogprobs:
    """Every prompt token's log-prob (R chunk rows of T tokens)."""

    logprobs: jax.Array  # f32[R, T]  of the next prompt token (0 where there is none)
    top_ids: jax.Array  # i32[R, T, K]
    top_logprobs: jax.Array  # f32[R, T, K]
    ranks: jax.Array  # i32[R, T]  the next prompt token's vLLM rank (0 where there is none)


@struct.dataclass
class PrefillOutput:
    """One `prefill` call's results: the token each row completing a prompt sampled (R rows)."""

    tokens: jax.Array  # i32[R]
    logprobs: jax.Array  # f32[R]  (0 unless want_top)
    top_ids: jax.Array  # i32[R, K]  zeros unless want_top
    top_logprobs: jax.Array  # f32[R, K]
    ranks: jax.Array  # i32[R]  the sampled token's vLLM rank (0 unless want_top)
    prompt: PromptLogprobs | None  # only in the shape.prompt_logprobs variant


def init_cache(model_config: ModelConfig, num_pages: int, page_size: int, kv_dtype, dtype):
    c = model_config
    return kv_cache.init(
        c.num_layers, c.num_kv_heads, num_pages, page_size, c.head_dim, kv_dtype, jnp.dtype(dtype)
    )


def _window_flat(config: ModelConfig, rows: int, num_flat: int, ps: int) -> int:
    """The 'ragged' flat-page bucket of a sliding-window layer: each row reads at most the
    ceil(window / ps) + 1 pages its window touches (0 when the model has no window)."""
    window = getattr(config, "sliding_window", None)
    if not window or not num_flat:
        return 0
    return min(num_flat, rows * (-(-window // ps) + 1))


def _decode_inputs(st: slot_state.SlotState, pt, num_flat: int, ps: int, window_flat: int = 0):
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
        num_window_flat_pages=window_flat,
    )
    return alive, st.last_token[:, None], meta


@step(
    static_argnames=("config", "impl", "shape", "num_steps"),
    donate_argnames=("cache", "state"),
)
def generate(
    params,
    cache,
    state: slot_state.SlotState,
    want_top,
    *,
    config: ModelConfig,
    impl: ModelImpl,
    shape: DecodeShape,
    num_steps: int,
):
    """JetStream `generate`: every active slot among the first `shape.rows` advances `num_steps`.

    Slots >= shape.rows are left as they are (the scheduler keeps every occupied slot below it),
    so the matmuls compute [rows, D], not [S, D]. shape.num_flat is the 'ragged' attention's
    live-page bucket; shape.width the page-table width the other implementations read (the
    whole table for 'cpu_kernel', which reads each row's own pages).
    want_top (bool[], traced: no second variant is compiled) turns the log-probs (the token's and
    the top-K) on for steps where some request asked for them; otherwise those outputs are zeros.

    Returns (cache, state, DecodeOutput).
    """
    sub = slot_state.take_rows(state, shape.rows)
    pt = sub.page_table[:, : shape.width]  # (B, W)

    def step(carry, _):
        cache, st = carry
        logits, cache = _decode_logits(params, cache, st, pt, config, impl, shape)
        st, out = _decode_advance(st, logits, shape.num_top, want_top)
        return (cache, st), out

    (cache, sub), out = jax.lax.scan(step, (cache, sub), None, length=num_steps)
    return pin_cache(cache), pin_slots(slot_state.set_rows(state, sub)), out


def _decode_logits(params, cache, st: slot_state.SlotState, pt, config, impl, shape: DecodeShape):
    """One decode forward of slot rows `st` (B rows) -> (logits f32[B, V], cache)."""
    window_flat = _window_flat(config, shape.rows, shape.num_flat, cache.page_size)
    _, tokens, meta = _decode_inputs(st, pt, shape.num_flat, cache.page_size, window_flat)
    hidden, cache = llama.forward(params, tokens, meta, cache, config, impl, lora_rows=st.lora)
    return pin_replicated(llama.compute_logits(params, hidden[:, 0], config, impl)), cache


def _decode_advance(st: slot_state.SlotState, logits, num_top: int, want_top):
    """Samples one token per live row of `st` from its logits and advances the rows ->
    (st, DecodeOutput of one step)."""
    alive = st.active & (st.seq_len + 2 <= st.max_total_len)  # (B,), as _decode_inputs
    out = sampling.sample(logits, st.sampling, st.num_generated, num_top, want_top)
    tok = jnp.where(alive, out.tokens, st.last_token)
    inc = alive.astype(jnp.int32)
    rows = jnp.arange(tok.shape[0])
    st = st.replace(
        last_token=tok,
        seq_len=st.seq_len + inc,
        num_generated=st.num_generated + inc,
        sampling=sampling.update_counts(st.sampling, tok, alive),
        history=token_history.append(st.history, rows, st.seq_len + 1, tok, alive),
    )
    return st, DecodeOutput(tok, alive, out.logprobs, out.top_ids, out.top_logprobs, out.ranks)


@step(static_argnames=("config", "impl", "shape"), donate_argnames=("cache",))
def decode_forward(params, cache, state: slot_state.SlotState, *, config, impl, shape: DecodeShape):
    """The first half of a one-step `generate`: the forward pass of the first shape.rows slots
    -> (cache, logits f32[B, V]). The host computes the step's structured-output masks while it
    runs (vLLM's overlap), then `decode_sample` samples with them. The state is read, not
    changed."""
    sub = slot_state.take_rows(state, shape.rows)
    logits, cache = _decode_logits(
        params, cache, sub, sub.page_table[:, : shape.width], config, impl, shape
    )
    return pin_cache(cache), logits


@step(static_argnames=("num_top",), donate_argnames=("state",))
def decode_sample(state: slot_state.SlotState, logits, want_top, *, num_top: int):
    """The second half: samples from `decode_forward`'s logits f32[B, V] (with the masks
    `set_grammar` installed) and advances the first B slots -> (state, DecodeOutput with k = 1),
    exactly as `generate(..., num_steps=1)`. Its program depends on B and num_top only, not on
    the forward's page-table width or live-page bucket: one per decode row bucket."""
    rows = logits.shape[0]
    sub, out = _decode_advance(slot_state.take_rows(state, rows), logits, num_top, want_top)
    return pin_slots(slot_state.set_rows(state, sub)), jax.tree.map(lambda x: x[None], out)


def _prefill_inputs(state: slot_state.SlotState, batch: PrefillBatch, width: int, ps: int):
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


def _prefill_advance(
    state: slot_state.SlotState, batch: PrefillBatch, logits, want_top, num_top: int
):
    """Samples (or installs) the token of each row completing a prefill; logits f32[R, V] of the
    rows' last tokens. Sets seq_len, activates the finished slots. Returns (state, SampleOutput
    with the installed tokens)."""
    s = state.last_token.shape[0]
    slot = jnp.minimum(batch.slots, s - 1)
    row_valid = batch.length > 0  # (R,)
    sub = jax.tree.map(lambda x: x[slot], state.sampling)  # the rows' sampling state (R, ...)
    out = sampling.sample(logits, sub, state.num_generated[slot], num_top, want_top)
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
        history=token_history.append(
            state.history, batch.slots, batch.start + batch.length, tok, finishing
        ),
    )
    return state, out.replace(tokens=tok)


def _prefill_forward(params, cache, state, batch, config, impl, shape: PrefillShape):
    """The forward of [R, T] chunks -> (cache, logits f32[R, V] of each row's last token,
    PromptLogprobs or None)."""
    r, t = batch.tokens.shape
    meta = _prefill_inputs(state, batch, shape.width, cache.page_size)
    rows = state.lora[jnp.minimum(batch.slots, state.lora.shape[0] - 1)]  # padding: unused
    hidden, cache = llama.forward(params, batch.tokens, meta, cache, config, impl, lora_rows=rows)
    last = hidden[jnp.arange(r), jnp.maximum(batch.length - 1, 0)]  # each row's last token (R, D)
    logits = pin_replicated(llama.compute_logits(params, last, config, impl))  # (R, V)
    prompt = None
    if shape.prompt_logprobs:
        prompt = _prompt_logprobs(params, hidden, batch.targets, config, impl, shape.num_top)
    return cache, logits, prompt


def _prompt_logprobs(params, hidden, targets, config, impl, num_top: int) -> PromptLogprobs:
    """Each row's prompt log-probs, a row at a time: a row with no target (padding, a request
    that did not ask, a chunk that ends the prompt) skips its [T, V] logits, so a lone
    lm-evaluation-harness request pays for one row of the program's R, not all of them."""

    def row(args):
        h, target = args

        def compute(_):
            logits = llama.compute_logits(params, h, config, impl)  # (T, V)
            return sampling.token_logprobs(logits, target, num_top)

        def skip(_):  # zeros of compute's shapes (read nowhere: the row has no target)
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(compute, 0))

        return jax.lax.cond(jnp.any(target >= 0), compute, skip, 0)

    return PromptLogprobs(*jax.lax.map(row, (hidden, targets)))


def _prefill_output(out, prompt) -> PrefillOutput:
    return PrefillOutput(out.tokens, out.logprobs, out.top_ids, out.top_logprobs, out.ranks, prompt)


@step(
    static_argnames=("config", "impl", "shape"),
    donate_argnames=("cache", "state"),
)
def prefill(
    params,
    cache,
    state: slot_state.SlotState,
    batch: PrefillBatch,
    want_top,
    *,
    config: ModelConfig,
    impl: ModelImpl,
    shape: PrefillShape,
):
    """JetStream `prefill` over fixed [R, T] chunks (R = shape.rows), K/V written into each row's
    slot pages. Returns (cache, state, PrefillOutput). One program (each data shard runs it, as
    does an engine with one page-table width); one device group with width buckets runs
    `prefill_forward` then `prefill_sample`, which equal it."""
    cache, logits, prompt = _prefill_forward(params, cache, state, batch, config, impl, shape)
    state, out = _prefill_advance(state, batch, logits, want_top, shape.num_top)
    return pin_cache(cache), pin_slots(state), _prefill_output(out, prompt)


@step(static_argnames=("config", "impl", "shape"), donate_argnames=("cache",))
def prefill_forward(
    params, cache, state: slot_state.SlotState, batch: PrefillBatch, *, config, impl, shape
):
    """The first half of `prefill`: the forward pass -> (cache, logits f32[R, V] of each row's
    last token, PromptLogprobs or None). The state is read (page tables), not changed."""
    cache, logits, prompt = _prefill_forward(params, cache, state, batch, config, impl, shape)
    return pin_cache(cache), logits, prompt


@step(static_argnames=("num_top",), donate_argnames=("state",))
def prefill_sample(
    state: slot_state.SlotState, batch: PrefillBatch, logits, want_top, *, num_top: int
):
    """The second half: samples (or installs) each completing row's token from
    `prefill_forward`'s logits and advances the slots -> (state, PrefillOutput without prompt
    log-probs), exactly as `prefill`. Its program depends on R and num_top, not on the
    page-table width or the chunk length T (it reads only the batch's per-row fields; pass the
    batch without `tokens` and `targets`): one per prefill row bucket."""
    state, out = _prefill_advance(state, batch, logits, want_top, num_top)
    return pin_slots(state), _prefill_output(out, None)
