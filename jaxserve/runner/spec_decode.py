"""Prompt-lookup speculative decoding (vLLM's `ngram` method) as one jitted step, on the device.

    ngram_propose(history, num_tokens, k, min_n, max_n)   i32[B, k] draft tokens per row
    ngram_propose_reference(tokens, k, min_n, max_n)       the same for one row, in plain Python
    speculate(params, cache, state, limit; shape, k, ...)  proposes, verifies and accepts ->
                                                           (cache, state, DecodeOutput of k + 1)

Each decode row looks up the longest n-gram (n from max_n down to min_n) that ends its sequence
and occurred earlier, at its latest earlier place (vLLM's `NgramProposer`), and proposes the k
tokens that followed it; where fewer than k follow before the sequence's end, the match's period
repeats (a sequence looping with period p continues as it looped). The step then feeds every row
its last token and its k drafts at their positions in one forward (K/V into the row's pages,
each token seeing the keys up to its own position), takes the greedy token at every position,
accepts the drafts up to the first that differs from the target's token there, and emits the accepted drafts plus the target's next token: 1 to k + 1
tokens a row, the tokens greedy decoding makes one at a time. The K/V written past the accepted
tokens lie beyond the row's new length and are overwritten before anything reads them. Where the
attention's decode path takes rows with their own page tables (`DECODE_ROW_IMPLS`: the C++ CPU
kernel, Pallas), the B x (k + 1) tokens run as decode rows instead of a chunk, each with its row's
pages and its own length: every token then gets the bits a plain decode step would give it, so
the outputs equal plain greedy decoding's in bf16 as well (a chunk's forward rounds differently).

Only greedy rows without penalties, processors, grammars or log-probs speculate (the scheduler
plans a speculative step only when every decoding request is such a row: `Scheduler`), so the
target's token is the argmax alone. `limit` (i32[S], from the host's plan) caps each row's
tokens, so the device never writes K/V past the pages the host gave the row, and a row the plan
left out (limit 0) does not move.

The proposer reads `SlotState.history` (every token of each slot at its position), which the
insert, prefill and decode steps keep when the engine speculates. Host code never runs here.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxserve.layers.attention import AttentionMetadata
from jaxserve.models import llama
from jaxserve.parallel.partition import pin_cache, pin_replicated, pin_slots
from jaxserve.resolve import DecodeShape
from jaxserve.runner import sampling, token_history
from jaxserve.runner.jit_step import step
from jaxserve.runner.slot_state import SlotState, set_rows, take_rows
from jaxserve.runner.steps import DecodeOutput
from jaxserve.runner.vocab_ops import blocked_argmax


def ngram_propose(history, num_tokens, k: int, min_n: int, max_n: int):
    """Draft tokens i32[B, k] for rows whose tokens are history[b, :num_tokens[b]] (i32[B, L],
    i32[B]). A row with no earlier occurrence of any n-gram ending it (n in [min_n, max_n])
    proposes its last token k times (verification rejects what is wrong; it only costs)."""
    b, length = history.shape
    pos = jnp.arange(length)[None, :]  # (1, L): the place p where a candidate n-gram ends
    n = num_tokens[:, None]  # (B, 1)
    run = jnp.zeros((b, length), jnp.int32)  # matching tokens going back from p, up to max_n
    alive = jnp.ones((b, length), bool)
    for i in range(max_n):  # history[p - i] == history[n - 1 - i]
        tail = jnp.take_along_axis(history, jnp.maximum(n - 1 - i, 0), axis=1)  # (B, 1)
        back = jnp.roll(history, i, axis=1)  # back[:, p] = history[:, p - i]
        alive = alive & (back == tail) & (pos >= i) & (n - 1 - i >= 0)
        run = run + alive.astype(jnp.int32)
    ok = (pos <= n - 2) & (run >= min_n)  # an earlier place, a long enough match
    score = jnp.where(ok, run * length + pos, -1)  # the longest match, then the latest place
    best = jnp.argmax(score, axis=1)[:, None]  # (B, 1)
    found = jnp.max(score, axis=1)[:, None] >= 0
    period = jnp.maximum(n - 1 - best, 1)  # the tokens after the match, up to the end
    src = best + 1 + jnp.arange(k)[None, :] % period  # (B, k)
    last = jnp.take_along_axis(history, jnp.maximum(n - 1, 0), axis=1)
    return jnp.where(found, jnp.take_along_axis(history, src, axis=1), last)


def ngram_propose_reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """`ngram_propose` for one row, in plain Python (the tests' reference)."""
    t = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if t <= n:
            continue
        tail = tokens[t - n :]
        for end in range(t - 2, n - 2, -1):  # the latest earlier place first
            if tokens[end - n + 1 : end + 1] == tail:
                period = t - 1 - end
                return [tokens[end + 1 + j % period] for j in range(k)]
    return [tokens[-1]] * k


# Attention implementations whose decode path takes any rows with their own page tables and
# lengths: there the verify forward runs its B x (k + 1) tokens as that many decode rows (each
# row's page table repeated), so every token gets the bits a decode step gives it, in bf16 too.
# 'ragged' decodes over a live-page bucket sized for B rows: there the tokens run as a chunk.
DECODE_ROW_IMPLS = ("cpu_kernel", "pallas", "pallas_interpret", "mgpu", "mgpu_interpret")


def _verify_inputs(st: SlotState, pt, draft, limit, ps: int, as_rows: bool):
    """The tokens (last token, drafts) at each row's next positions and their metadata: as
    [B * (k + 1), 1] decode rows (`as_rows`) or as a [B, k + 1] chunk. A row writes K/V only
    at the positions of the tokens it may make (`limit`)."""
    b, width = pt.shape
    t = draft.shape[1] + 1
    tokens = jnp.concatenate([st.last_token[:, None], draft], axis=1)  # (B, T)
    pos = st.seq_len[:, None] + jnp.arange(t)[None, :]  # (B, T)
    writes = jnp.arange(t)[None, :] < limit[:, None]  # (B, T)
    page = jnp.take_along_axis(pt, jnp.minimum(pos // ps, width - 1), axis=1)
    slots = jnp.where(writes, page * ps + pos % ps, -1)
    if as_rows:  # row b * T + j: token j of row b, seeing keys up to its position
        meta = AttentionMetadata(
            positions=pos.reshape(b * t, 1),
            slot_mapping=slots.reshape(b * t, 1),
            page_table=jnp.repeat(pt, t, axis=0),
            seq_lens=jnp.where(writes, pos + 1, 0).reshape(b * t),
        )
        return tokens.reshape(b * t, 1), meta
    meta = AttentionMetadata(
        positions=pos,
        slot_mapping=slots,
        page_table=pt,
        seq_lens=jnp.where(limit > 0, st.seq_len + limit, 0),
    )
    return tokens, meta


@step(
    static_argnames=("config", "impl", "shape", "num_spec", "min_n", "max_n"),
    donate_argnames=("cache", "state"),
)
def speculate(
    params,
    cache,
    state: SlotState,
    limit,
    *,
    config,
    impl,
    shape: DecodeShape,
    num_spec: int,
    min_n: int,
    max_n: int,
):
    """One speculative decode step of the first shape.rows slots: each active row proposes
    `num_spec` drafts, verifies them in one forward and makes 1 to num_spec + 1 tokens, at most
    limit[slot] (i32[S]; 0 = the row does not move). Returns (cache, state, DecodeOutput with
    k = num_spec + 1 steps: tokens[j, b] is row b's j-th new token where valid[j, b]); the
    log-prob outputs are zeros (speculating rows ask for none)."""
    st = take_rows(state, shape.rows)
    pt = st.page_table[:, : shape.width]
    t = num_spec + 1
    # the device's own guard: never past max_total_len (as a decode step's `alive`)
    room = jnp.maximum(st.max_total_len - st.seq_len - 1, 0)
    lim = jnp.where(st.active, jnp.minimum(jnp.minimum(limit[: shape.rows], room), t), 0)
    draft = ngram_propose(st.history, st.seq_len + 1, num_spec, min_n, max_n)  # (B, k)
    as_rows = impl.attention in DECODE_ROW_IMPLS
    tokens, meta = _verify_inputs(st, pt, draft, lim, cache.page_size, as_rows)
    lora = jnp.repeat(st.lora, t) if as_rows else st.lora  # each token row's adapter slot
    hidden, cache = llama.forward(params, tokens, meta, cache, config, impl, lora_rows=lora)
    b, d = shape.rows, hidden.shape[-1]
    logits = llama.compute_logits(params, hidden.reshape(b * t, d), config, impl)
    target = blocked_argmax(pin_replicated(logits).astype(jnp.float32)).reshape(b, t)
    # accepted drafts: the leading ones equal to the target's token at the position before
    same = (draft == target[:, :num_spec]).astype(jnp.int32)
    accepted = jnp.sum(jnp.cumprod(same, axis=1), axis=1)
    made = jnp.minimum(accepted + 1, lim)  # (B,) tokens the row makes
    valid = jnp.arange(t)[:, None] < made[None, :]  # (T, B)
    out_tokens = jnp.where(valid, target.T, 0)  # target[b, j] = draft[b, j] for j < accepted
    smp = st.sampling
    hist = st.history
    for j in range(t):
        smp = sampling.update_counts(smp, target[:, j], valid[j])
        hist = token_history.append(hist, jnp.arange(b), st.seq_len + 1 + j, target[:, j], valid[j])
    moved = made > 0
    newest = jnp.take_along_axis(target, jnp.maximum(made - 1, 0)[:, None], axis=1)[:, 0]
    st = st.replace(
        last_token=jnp.where(moved, newest, st.last_token),
        seq_len=st.seq_len + made,
        num_generated=st.num_generated + made,
        sampling=smp,
        history=hist,
    )
    zeros = jnp.zeros((t, b), jnp.float32)
    top = jnp.zeros((t, b, shape.num_top), jnp.int32)
    out = DecodeOutput(
        out_tokens, valid, zeros, top, top.astype(jnp.float32), jnp.zeros((t, b), jnp.int32)
    )
    return pin_cache(cache), pin_slots(set_rows(state, st)), out
