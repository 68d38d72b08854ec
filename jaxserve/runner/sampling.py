"""Pure-jnp sampling over fixed-shape per-slot arrays: logits[S, V] + SamplingState -> tokens[S].

Every per-request number (temperature, top-k, seeds, ...) is an array, so nothing recompiles.
`sample` follows vLLM's order:

    logits f32[S, V]
      -> structured outputs: tokens the slot's grammar forbids -> -inf (constrained slots only;
         the log-probs are those of this masked distribution, as vLLM's)
      -> allowed_token_ids: every other token -> -inf
      -> bad_words: the last token of a word whose other tokens were just generated -> -inf
      -> logit_bias: + bias[token]
      -> min_tokens: stop/eos ids -> -inf while num_generated < min_tokens
      -> repetition penalty on prompt | generated tokens (positive / rp, negative * rp)
      -> frequency (* count) and presence (* [count > 0]) penalties on generated tokens
      -> greedy slots (temperature 0): argmax                       (ties: lowest id)
      -> others: / temperature -> min-p -> top-k -> top-p -> jax.random.categorical

The key of slot s is fold_in(wrap_key_data(key_data[s]), num_generated[s]): a slot's token depends
only on its own logits row, parameters, seed and step, never on other slots or its index.
`lax.cond` skips the random path when every slot is greedy, and the top-k/top-p threshold search
when no sampling slot asks for it, and the allowed / bad-words / bias pass when no slot has one
(`has_processors`). Log-probs are those of the raw model distribution (log_softmax
of the unmodified logits), as vLLM returns by default.

The runner writes a request into a slot with `set_slot(state, slot, row)` where `row` is the host's
`SlotRow` (numpy leaves are fine: SlotRow is registered as a pytree here), and after each step
counts the new tokens with `update_counts`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jaxserve.core.sampling_fields import (
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
)
from jaxserve.core.slot_row import SlotRow
from jaxserve.runner.vocab_ops import apply_top_k_top_p, blocked_argmax, top_k

jax.tree_util.register_dataclass(
    SlotRow, data_fields=[f.name for f in dataclasses.fields(SlotRow)], meta_fields=[]
)


@struct.dataclass
class SamplingState:
    temperature: jax.Array  # f32[S]; 0 = greedy
    top_k: jax.Array  # i32[S]; 0 = off
    top_p: jax.Array  # f32[S]; 1 = off
    min_p: jax.Array  # f32[S]; 0 = off
    repetition_penalty: jax.Array  # f32[S]; 1 = off
    presence_penalty: jax.Array  # f32[S]
    frequency_penalty: jax.Array  # f32[S]
    min_tokens: jax.Array  # i32[S]
    key_data: jax.Array  # u32[S, 2]; threefry key data of each request's seed
    token_counts: jax.Array  # i32[S, V]; times each token was generated
    prompt_mask: jax.Array  # bool[S, V]; token occurs in the prompt
    stop_mask: jax.Array  # bool[S, V]; suppressed while num_generated < min_tokens
    allowed_mask: jax.Array  # bool[S, V]; all True unless the request set allowed_token_ids
    bias_ids: jax.Array  # i32[S, NB]; logit_bias token ids, -1 padded (NB = MAX_LOGIT_BIAS)
    bias_values: jax.Array  # f32[S, NB]
    bad_words: jax.Array  # i32[S, NW, W]; token sequences right-aligned, -1 padded
    recent_tokens: jax.Array  # i32[S, W - 1]; last generated tokens, newest last, -2 padded
    has_processors: jax.Array  # bool[S]; the slot uses allowed_token_ids, bad_words or logit_bias
    grammar_mask: jax.Array  # i32[S, ceil(V / 32)]; bit t % 32 of word t // 32: token t allowed
    constrained: jax.Array  # bool[S]; grammar_mask holds this step's mask of the slot


@struct.dataclass
class SampleOutput:
    tokens: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]; raw log_softmax of the chosen token (0 unless want_top)
    top_ids: jax.Array  # i32[S, K]; K = num_top_logprobs, best first
    top_logprobs: jax.Array  # f32[S, K]
    ranks: jax.Array  # i32[S]; vLLM's rank of the chosen token: #tokens with logprob >= its own


def init_state(num_slots: int, vocab_size: int) -> SamplingState:
    """All slots greedy with no penalties, zero keys, empty counts and masks."""
    if num_slots < 1 or vocab_size < 1:
        raise ValueError(
            f"num_slots and vocab_size must be positive, got {num_slots}, {vocab_size}"
        )
    s, v = num_slots, vocab_size
    return SamplingState(
        temperature=jnp.zeros((s,), jnp.float32),
        top_k=jnp.zeros((s,), jnp.int32),
        top_p=jnp.ones((s,), jnp.float32),
        min_p=jnp.zeros((s,), jnp.float32),
        repetition_penalty=jnp.ones((s,), jnp.float32),
        presence_penalty=jnp.zeros((s,), jnp.float32),
        frequency_penalty=jnp.zeros((s,), jnp.float32),
        min_tokens=jnp.zeros((s,), jnp.int32),
        key_data=jnp.zeros((s, 2), jnp.uint32),
        token_counts=jnp.zeros((s, v), jnp.int32),
        prompt_mask=jnp.zeros((s, v), bool),
        stop_mask=jnp.zeros((s, v), bool),
        allowed_mask=jnp.ones((s, v), bool),
        bias_ids=jnp.full((s, MAX_LOGIT_BIAS), -1, jnp.int32),
        bias_values=jnp.zeros((s, MAX_LOGIT_BIAS), jnp.float32),
        bad_words=jnp.full((s, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), -1, jnp.int32),
        recent_tokens=jnp.full((s, MAX_BAD_WORD_TOKENS - 1), -2, jnp.int32),
        has_processors=jnp.zeros((s,), bool),
        grammar_mask=jnp.full((s, -(-v // 32)), -1, jnp.int32),
        constrained=jnp.zeros((s,), bool),
    )


def _one_hot_rows(ids: jax.Array, vocab_size: int, dtype) -> jax.Array:
    """ids i32[N] (-1 = padding, ids >= V dropped) -> dtype[V] counts (or presence for bool)."""
    # A negative id would wrap around to the end of the vocab: send it out of range instead.
    ids = jnp.where(ids < 0, vocab_size, ids)
    zeros = jnp.zeros((vocab_size,), dtype)
    if dtype == jnp.bool_:
        return zeros.at[ids].set(True, mode="drop")
    return zeros.at[ids].add(1, mode="drop")


def set_slot(state: SamplingState, slot: jax.Array, row: SlotRow) -> SamplingState:
    """Writes one request's row into slot `slot` (i32[]); jittable, donate `state`."""
    v = state.token_counts.shape[1]
    allowed = jnp.asarray(row.allowed_ids, jnp.int32)  # (NA,)
    bias_ids = jnp.asarray(row.bias_ids, jnp.int32)  # (NB,)
    bad_words = jnp.asarray(row.bad_words, jnp.int32)  # (NW, W)
    scalars = {
        name: getattr(state, name).at[slot].set(jnp.asarray(getattr(row, name)))
        for name in (
            "temperature",
            "top_k",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
            "min_tokens",
        )
    }
    return state.replace(
        **scalars,
        key_data=state.key_data.at[slot].set(jnp.asarray(row.key_data, jnp.uint32)),
        token_counts=state.token_counts.at[slot].set(
            _one_hot_rows(jnp.asarray(row.output_tokens), v, jnp.int32)
        ),
        prompt_mask=state.prompt_mask.at[slot].set(
            _one_hot_rows(jnp.asarray(row.prompt_tokens), v, jnp.bool_)
        ),
        stop_mask=state.stop_mask.at[slot].set(
            _one_hot_rows(jnp.asarray(row.stop_ids), v, jnp.bool_)
        ),
        allowed_mask=state.allowed_mask.at[slot].set(
            jnp.where(allowed[0] < 0, True, _one_hot_rows(allowed, v, jnp.bool_))
        ),
        bias_ids=state.bias_ids.at[slot].set(bias_ids),
        bias_values=state.bias_values.at[slot].set(jnp.asarray(row.bias_values, jnp.float32)),
        bad_words=state.bad_words.at[slot].set(bad_words),
        recent_tokens=state.recent_tokens.at[slot].set(jnp.asarray(row.recent_tokens, jnp.int32)),
        has_processors=state.has_processors.at[slot].set(
            (allowed[0] >= 0) | (bias_ids[0] >= 0) | (bad_words[0, -1] >= 0)
        ),
        constrained=state.constrained.at[slot].set(False),  # until the engine sends its mask
    )


def apply_grammar_mask(logits: jax.Array, state: SamplingState) -> jax.Array:
    """-inf on every token a constrained slot's mask forbids. f32[S, V] -> f32[S, V]."""
    s, v = logits.shape
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = jnp.right_shift(state.grammar_mask[:, :, None], shifts) & 1  # (S, W, 32)
    allowed = bits.reshape(s, -1)[:, :v] != 0
    return jnp.where(state.constrained[:, None] & ~allowed, -jnp.inf, logits)


def update_counts(state: SamplingState, tokens: jax.Array, active: jax.Array) -> SamplingState:
    """token_counts[s, tokens[s]] += 1 and tokens[s] appended to recent_tokens[s] for each active
    slot. tokens i32[S], active bool[S]."""
    s, v = state.token_counts.shape
    ids = jnp.where(active & (tokens >= 0), tokens, v)  # inactive -> out of range -> dropped
    counts = state.token_counts.at[jnp.arange(s), ids].add(1, mode="drop")
    shifted = jnp.concatenate([state.recent_tokens[:, 1:], tokens[:, None]], axis=1)  # (S, W-1)
    recent = jnp.where((active & (tokens >= 0))[:, None], shifted, state.recent_tokens)
    return state.replace(token_counts=counts, recent_tokens=recent)


def apply_logits_processors(logits: jax.Array, state: SamplingState) -> jax.Array:
    """allowed_token_ids, bad_words, then logit_bias (vLLM v1's order). f32[S, V] -> f32[S, V].

    A bad word [t_1 .. t_n] bans t_n when the last n-1 generated tokens are t_1 .. t_n-1 (vLLM:
    only generated tokens count, not the prompt); a one-token word is always banned.
    """
    s, v = logits.shape
    logits = jnp.where(state.allowed_mask, logits, -jnp.inf)
    words = state.bad_words  # (S, NW, W)
    prefix, last = words[:, :, :-1], words[:, :, -1]  # (S, NW, W-1), (S, NW)
    recent = state.recent_tokens[:, None, :]  # (S, 1, W-1)
    match = jnp.all((prefix < 0) | (prefix == recent), axis=-1) & (last >= 0)  # (S, NW)
    banned = jnp.where(match, last, v)  # out of range -> dropped
    rows = jnp.arange(s)[:, None]
    logits = logits.at[rows, banned].set(-jnp.inf, mode="drop")
    bias_ids = jnp.where(state.bias_ids < 0, v, state.bias_ids)  # (S, NB)
    return logits.at[rows, bias_ids].add(state.bias_values, mode="drop")


def apply_penalties(logits: jax.Array, state: SamplingState, num_generated: jax.Array) -> jax.Array:
    """min_tokens suppression, repetition/frequency/presence penalties. f32[S, V] -> f32[S, V]."""
    too_early = (num_generated < state.min_tokens)[:, None]  # (S, 1)
    logits = jnp.where(state.stop_mask & too_early, -jnp.inf, logits)
    counts = state.token_counts
    seen = state.prompt_mask | (counts > 0)
    rp = state.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - state.frequency_penalty[:, None] * counts.astype(jnp.float32)
    return logits - state.presence_penalty[:, None] * (counts > 0).astype(jnp.float32)


def _sample_random(logits: jax.Array, state: SamplingState, num_generated: jax.Array) -> jax.Array:
    """vLLM v1's order: temperature, min-p, top-k, top-p, then a categorical draw per slot.
    f32[S, V] -> i32[S]."""
    temperature = jnp.where(state.temperature > 0, state.temperature, 1.0)
    logits = logits / temperature[:, None]
    # min-p (vLLM applies it before top-k/top-p): keep p_i >= min_p * p_max, i.e.
    # logit_i >= logit_max + log(min_p).
    max_logit = jnp.max(logits, axis=-1, keepdims=True)
    logits = jnp.where(logits >= max_logit + jnp.log(state.min_p)[:, None], logits, -jnp.inf)
    sampling = state.temperature > 0
    needs_cut = jnp.any(sampling & ((state.top_k > 0) | (state.top_p < 1.0)))
    logits = jax.lax.cond(
        needs_cut,
        lambda x: apply_top_k_top_p(x, state.top_k, state.top_p),
        lambda x: x,
        logits,
    )

    def perturb(key_data, step, row):  # jax.random.categorical(key, row) is argmax of this
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data), step)
        return row + jax.random.gumbel(key, row.shape, row.dtype)

    return blocked_argmax(jax.vmap(perturb)(state.key_data, num_generated, logits))


def sample(
    logits: jax.Array,
    state: SamplingState,
    num_generated: jax.Array,
    num_top_logprobs: int,
    want_top: jax.Array | bool = True,
) -> SampleOutput:
    """One token per slot. logits f32[S, V]; num_generated i32[S] (tokens generated so far).

    num_top_logprobs (static, 0..V: the engine's max_logprobs) sizes top_ids/top_logprobs [S, K];
    0 gives [S, 0].
    want_top (bool[], may be traced): False skips the log-probs, the chosen token's and the
    top-K (their outputs are then zeros), so a step where no request asked for logprobs does
    not pay for them.
    """
    if not 0 <= num_top_logprobs <= logits.shape[-1]:
        raise ValueError(
            f"num_top_logprobs must be in [0, V={logits.shape[-1]}], got {num_top_logprobs}"
        )
    logits = logits.astype(jnp.float32)
    neutral = (
        jnp.all(state.repetition_penalty == 1.0)
        & jnp.all(state.presence_penalty == 0.0)
        & jnp.all(state.frequency_penalty == 0.0)
        & jnp.all(num_generated >= state.min_tokens)
    )
    plain = ~jnp.any(state.constrained) & ~jnp.any(state.has_processors) & neutral

    def processed():  # grammar masks, then processors and penalties; each skipped when unused
        masked = jax.lax.cond(
            jnp.any(state.constrained), lambda: apply_grammar_mask(logits, state), lambda: logits
        )
        out = jax.lax.cond(
            jnp.any(state.has_processors),
            lambda: apply_logits_processors(masked, state),
            lambda: masked,
        )
        out = jax.lax.cond(neutral, lambda: out, lambda: apply_penalties(out, state, num_generated))
        return masked, out

    def full():
        # One cond around the passes: a step with no slot constrained, processed or penalized
        # takes one identity branch, not three (each copies its [S, V] operand, ~1 ms a CPU step
        # at [32, 49152]); the draw after it is traced once (in both branches it doubled the
        # compile).
        masked, penalized = jax.lax.cond(plain, lambda: (logits, logits), processed)
        return _sample_from(masked, penalized, state, num_generated, num_top_logprobs, want_top)

    # The commonest step of all (every slot greedy, plain, no log-probs) is the argmax alone: the
    # identity branch above would still copy the logits twice, and the copies into fresh pages of
    # the step's temporaries cost a CPU step 1-15 ms at [32, 49152] (JOURNAL.md 51c).
    s = logits.shape[0]
    quick = plain & jnp.all(state.temperature <= 0) & ~jnp.asarray(want_top)
    return jax.lax.cond(
        quick,
        lambda: SampleOutput(
            tokens=blocked_argmax(logits),
            logprobs=jnp.zeros((s,), jnp.float32),
            top_ids=jnp.zeros((s, num_top_logprobs), jnp.int32),
            top_logprobs=jnp.zeros((s, num_top_logprobs), jnp.float32),
            ranks=jnp.zeros((s,), jnp.int32),
        ),
        full,
    )


def _sample_from(masked, penalized, state, num_generated, k: int, want_top) -> SampleOutput:
    """`sample` after the logit passes: masked = the logits after the grammar mask (log-probs are
    of these), penalized = after processors and penalties too (what the token is drawn from)."""
    s = masked.shape[0]
    greedy_tokens = blocked_argmax(penalized)
    greedy = state.temperature <= 0
    tokens = jax.lax.cond(
        jnp.all(greedy),
        lambda: greedy_tokens,
        lambda: jnp.where(greedy, greedy_tokens, _sample_random(penalized, state, num_generated)),
    )

    # The log-probs only when a request asked for them: their log-sum-exp is an exp over the
    # whole [S, V] (~7% of a CPU decode step at [32, 49152]; JOURNAL.md section 37).
    def logprobs():
        lse = jax.nn.logsumexp(masked, axis=-1)  # (S,)
        chosen = jnp.take_along_axis(masked, tokens[:, None], axis=-1)[:, 0] - lse
        top_logits, top_ids = top_k(masked, k)
        ranks = _ranks(masked - lse[:, None], chosen)
        return chosen, top_logits - lse[:, None], top_ids.astype(jnp.int32), ranks

    chosen, top_logprobs, top_ids, ranks = jax.lax.cond(
        jnp.asarray(want_top),
        logprobs,
        lambda: (
            jnp.zeros((s,), jnp.float32),
            jnp.zeros((s, k), jnp.float32),
            jnp.zeros((s, k), jnp.int32),
            jnp.zeros((s,), jnp.int32),
        ),
    )
    return SampleOutput(
        tokens=tokens, logprobs=chosen, top_ids=top_ids, top_logprobs=top_logprobs, ranks=ranks
    )


def _ranks(logprobs: jax.Array, chosen: jax.Array) -> jax.Array:
    """vLLM's rank (`batched_count_greater_than`): the tokens whose log-prob is >= the chosen
    one's, itself included, so ties rank after. logprobs f32[N, V], chosen f32[N] -> i32[N]."""
    return jnp.sum(logprobs >= chosen[:, None], axis=-1).astype(jnp.int32)


def token_logprobs(
    logits: jax.Array, target_ids: jax.Array, k: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Prompt log-probs: logits f32[T, V], target_ids i32[T] -> (lp f32[T], top_ids i32[T, K],
    top_lp f32[T, K], ranks i32[T]).

    lp[t] = log_softmax(logits[t])[target_ids[t]]; a padded target (-1) gives lp 0 and rank 0.
    ranks: vLLM's rank of each target (`_ranks`). k is static.
    """
    if not 0 <= k <= logits.shape[-1]:
        raise ValueError(f"k must be in [0, V={logits.shape[-1]}], got {k}")
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # (T, V)
    valid = target_ids >= 0
    lp = jnp.take_along_axis(logprobs, jnp.where(valid, target_ids, 0)[:, None], axis=-1)[:, 0]
    top_lp, top_ids = top_k(logprobs, k)
    ranks = jnp.where(valid, _ranks(logprobs, lp), 0)
    return jnp.where(valid, lp, 0.0), top_ids.astype(jnp.int32), top_lp, ranks
