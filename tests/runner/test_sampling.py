"""The pure-jnp sampler: greedy, penalties, min_tokens, distributions, determinism, compiles."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.slot_row import make_slot_row
from jaxserve.runner import sampling

# Most tests share one shape so the sampler compiles a handful of times, not once per test.
S, V, K = 8, 64, 4
SAMPLE = jax.jit(sampling.sample, static_argnums=3)
SET_SLOT = jax.jit(sampling.set_slot, donate_argnums=0)
UPDATE_COUNTS = jax.jit(sampling.update_counts, donate_argnums=0)
PENALIZE = jax.jit(sampling.apply_penalties)


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _uniform_state(num_slots, vocab_size, **fields):
    """init_state with the given per-slot fields broadcast to [S] (key_data to [S, 2])."""
    state = sampling.init_state(num_slots, vocab_size)
    updates = {}
    for name, value in fields.items():
        old = getattr(state, name)
        updates[name] = jnp.broadcast_to(jnp.asarray(value, old.dtype), old.shape)
    return state.replace(**updates)


def test_greedy_is_argmax_and_logprobs_are_raw():
    logits = jax.random.normal(jax.random.key(0), (S, V)) * 3
    logits = logits.at[4, 7].set(10.0).at[4, 3].set(10.0)  # a tie: the lowest id wins
    state = sampling.init_state(S, V)
    out = SAMPLE(logits, state, jnp.zeros((S,), jnp.int32), K)
    np.testing.assert_array_equal(out.tokens, np.argmax(np.asarray(logits), -1))
    assert int(out.tokens[4]) == 3
    raw = _log_softmax(logits)
    np.testing.assert_allclose(out.logprobs, raw[np.arange(S), out.tokens], atol=1e-5)
    order = np.argsort(-raw, axis=-1, kind="stable")[:, :K]
    np.testing.assert_array_equal(out.top_ids, order)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(raw, order, -1), atol=1e-5)
    # greedy picks a most likely token: rank 1, except row 4's tie, where vLLM's >= count gives 2
    np.testing.assert_array_equal(out.ranks, [2 if i == 4 else 1 for i in range(S)])
    # a sampled (hot) token's rank counts the whole vocabulary, beyond the top K
    hot = state.replace(temperature=jnp.full((S,), 2.0), key_data=state.key_data + 1)
    sampled = SAMPLE(logits, hot, jnp.zeros((S,), jnp.int32), K)
    chosen = raw[np.arange(S), np.asarray(sampled.tokens)]
    np.testing.assert_array_equal(sampled.ranks, (raw >= chosen[:, None] - 1e-6).sum(-1))
    assert np.asarray(sampled.ranks).max() > K
    no_top = functools.partial(sampling.sample, num_top_logprobs=0)
    empty = jax.eval_shape(no_top, logits, state, jnp.zeros((S,), jnp.int32))
    assert empty.top_ids.shape == (S, 0) and empty.top_logprobs.shape == (S, 0)
    with pytest.raises(ValueError, match="num_top_logprobs"):
        sampling.sample(logits, state, jnp.zeros((S,), jnp.int32), V + 1)


def test_the_quick_greedy_step_equals_the_full_one():
    """Every slot greedy and plain, no log-probs: `sample` takes the argmax alone (no copies of
    the logits); its tokens are the full path's (log-probs asked for, or one slot penalized) and
    its log-prob outputs zeros, as the full path's without log-probs."""
    logits = jax.random.normal(jax.random.key(5), (S, V)) * 3
    logits = logits.at[2, 9].set(10.0).at[2, 1].set(10.0)  # a tie: the lowest id wins
    state, ng = sampling.init_state(S, V), jnp.zeros((S,), jnp.int32)
    quick = jax.jit(sampling.sample, static_argnums=3)(logits, state, ng, K, False)
    full = SAMPLE(logits, state, ng, K)
    np.testing.assert_array_equal(quick.tokens, full.tokens)
    assert int(quick.tokens[2]) == 1
    for a in (quick.logprobs, quick.top_ids, quick.top_logprobs, quick.ranks):
        assert not np.asarray(a).any()
    # one slot with a neutral-valued penalty field set: not plain, the full path, same tokens
    neutral = state.replace(min_tokens=state.min_tokens.at[0].set(1))  # num_generated 0 < 1
    slow = jax.jit(sampling.sample, static_argnums=3)(logits, neutral, ng, K, False)
    np.testing.assert_array_equal(slow.tokens[1:], quick.tokens[1:])


@pytest.mark.parametrize("v", [50, 49152, 64 * 7])
def test_blocked_argmax_is_jnp_argmax_with_ties_inf_and_nan(v):
    """Blocks of 50 or 512 (or 448) columns; V = 50 has no block in [64, 512]: plain argmax."""
    x = np.array(jax.random.normal(jax.random.key(1), (7, v)))
    x[1, [4, 9, v - 1]] = 7.0  # a tie: the first
    x[2] = -np.inf  # all masked: index 0
    x[3, [5, v - 2]] = np.nan  # a NaN counts as the max: the first NaN
    x[4, v - 1] = np.inf  # the max in the last block
    x[5, [v // 2, 3]] = [np.inf, np.nan]
    x[6, [v - 3, v - 2]] = 9.0  # a tie within the last block
    got = jax.jit(sampling.blocked_argmax)(jnp.asarray(x))
    np.testing.assert_array_equal(got, jnp.argmax(jnp.asarray(x), axis=-1))
    assert got.dtype == jnp.int32 and list(np.asarray(got)[1:7]) == [4, 0, 5, v - 1, 3, v - 3]


def test_penalties_hand_computed():
    # Tokens 0..5 matter (the rest of the vocab sits at -5, never seen); the prompt holds token 1,
    # the request already generated 2, 2, 3 (before a preemption).
    sp = SamplingParams(
        temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    row = make_slot_row(sp, [1], [2, 2, 3], eos_token_ids=(0,), seed=0, max_model_len=8)
    state = SET_SLOT(sampling.init_state(S, V), jnp.int32(1), row)
    logits = jnp.full((S, V), -5.0).at[0].set(0.0).at[1, :6].set([1.0, 4.0, 3.0, -1.0, 2.5, -2.0])
    steps = jnp.zeros((S,), jnp.int32).at[1].set(3)
    out = np.asarray(PENALIZE(logits, state, steps))
    # token 1 (prompt): 4 / 2 = 2. token 2 (generated twice): 3 / 2 - 0.5 * 2 - 0.25 = 0.25.
    # token 3 (generated once, negative): -1 * 2 - 0.5 - 0.25 = -2.75. Others unchanged.
    np.testing.assert_allclose(out[1, :6], [1.0, 2.0, 0.25, -2.75, 2.5, -2.0], atol=1e-6)
    np.testing.assert_array_equal(out[1, 6:], -5.0)
    np.testing.assert_array_equal(out[0], np.zeros(V))  # slot 0 untouched
    tokens = SAMPLE(logits, state, steps, K).tokens
    assert int(tokens[1]) == 4  # argmax moved from token 1 to token 4
    # Counting a new token through update_counts feeds the same penalties.
    tokens = jnp.full((S,), 5, jnp.int32).at[1].set(4)
    state = UPDATE_COUNTS(state, tokens, jnp.arange(S) == 1)
    np.testing.assert_array_equal(state.token_counts[0], np.zeros(V))
    np.testing.assert_array_equal(state.token_counts[1, :7], [0, 0, 2, 1, 1, 0, 0])
    out = np.asarray(PENALIZE(logits, state, steps + 1))
    assert out[1, 4] == pytest.approx(2.5 / 2 - 0.5 - 0.25)


def test_set_slot_ignores_padding_and_other_slots():
    row = make_slot_row(SamplingParams(), [3], [], (2,), seed=7, max_model_len=5)
    state = SET_SLOT(_uniform_state(S, V, temperature=0.5), jnp.int32(2), row)
    assert not bool(state.prompt_mask[2, V - 1])  # -1 padding did not wrap to the last id
    np.testing.assert_array_equal(state.prompt_mask[2], np.arange(V) == 3)
    assert int(state.prompt_mask.sum()) == 1 and int(state.token_counts.sum()) == 0
    np.testing.assert_allclose(state.temperature, [0.5, 0.5, 1.0] + [0.5] * (S - 3))
    np.testing.assert_array_equal(state.key_data[2], [0, 7])


def test_min_tokens_suppresses_stop_ids():
    sp = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[4])
    row = make_slot_row(sp, [1], [], eos_token_ids=(5,), seed=0, max_model_len=4)
    state = sampling.init_state(S, V)
    for slot in range(3):
        state = SET_SLOT(state, jnp.int32(slot), row)
    logits = jnp.full((S, V), -5.0).at[:, :6].set(jnp.array([0.0, 1.0, 0.0, 0.0, 3.0, 5.0]))
    steps = jnp.arange(S, dtype=jnp.int32)  # eos (5) is best, the stop id (4) next
    out = SAMPLE(logits, state, steps, K)
    np.testing.assert_array_equal(out.tokens[:3], [1, 1, 5])
    assert float(out.logprobs[0]) == pytest.approx(_log_softmax(logits[0])[1], abs=1e-5)
    # ignore_eos: eos is still suppressed during min_tokens (vLLM's all_stop_token_ids holds eos
    # whatever ignore_eos; issue 25), and so is the stop id.
    sp = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5], ignore_eos=True)
    row = make_slot_row(sp, [1], [], eos_token_ids=(4,), seed=0, max_model_len=4)
    state = SET_SLOT(state, jnp.int32(0), row)
    assert int(SAMPLE(logits, state, steps, K).tokens[0]) == 1


# Statistical checks: V = 8 distinct probabilities, N draws of one slot's parameters through the
# real per-token key path (one seed, num_generated = 0..N-1). A chi-square statistic over the kept
# tokens is compared with its 1 - 1e-4 quantile (and every frequency must be within 0.015 of its
# probability, > 4 sigma at N = 20k); tokens outside the kept set must never appear.
PROBS = np.array([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02])
N = 20_000
CHI2_99_99 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.75, 6: 27.86, 7: 29.88}


def _draw(**fields):
    state = _uniform_state(N, len(PROBS), key_data=[0, 1234], **fields)
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(PROBS, jnp.float32)), (N, len(PROBS)))
    tokens = SAMPLE(logits, state, jnp.arange(N, dtype=jnp.int32), K).tokens
    return np.bincount(np.asarray(tokens), minlength=len(PROBS))


def _check(counts, expected):
    kept = expected > 0
    assert counts[~kept].sum() == 0, f"sampled outside the kept set: {counts}"
    e = N * expected[kept]
    chi2 = float(((counts[kept] - e) ** 2 / e).sum())
    dof = int(kept.sum()) - 1
    if dof:
        assert chi2 < CHI2_99_99[dof], f"chi2 {chi2:.1f} (dof {dof}) counts {counts} vs {e}"
    assert np.abs(counts / N - expected).max() < 0.015


def _renorm(p):
    return p / p.sum()


def test_temperature_sampling_matches_softmax():
    _check(_draw(temperature=1.0), PROBS)
    _check(_draw(temperature=0.5), _renorm(PROBS**2))  # softmax(log p / 0.5) = p^2 / sum p^2


def test_top_k_keeps_the_k_best_renormalized():
    _check(_draw(temperature=1.0, top_k=3), _renorm(PROBS * (np.arange(8) < 3)))
    _check(_draw(temperature=1.0, top_k=1), np.eye(8)[0])


def test_top_p_keeps_smallest_set_reaching_p():
    # cumulative 0.30, 0.50, 0.65: the smallest set with mass >= 0.62 is the first three.
    _check(_draw(temperature=1.0, top_p=0.62), _renorm(PROBS * (np.arange(8) < 3)))
    # top-p applies to the top-k-renormalized distribution: within the best 4 (mass 0.77) the
    # cumulative is 0.39, 0.65, 0.84, so p = 0.7 keeps 3 (on the raw one it would keep 4).
    _check(_draw(temperature=1.0, top_k=4, top_p=0.7), _renorm(PROBS * (np.arange(8) < 3)))


def test_min_p_keeps_tokens_above_fraction_of_max():
    # min_p 0.3 * p_max 0.30 = 0.09: tokens with p >= 0.09 are the first five.
    _check(_draw(temperature=1.0, min_p=0.3), _renorm(PROBS * (PROBS >= 0.09)))


def test_min_p_comes_before_top_p_as_in_vllm():
    """vLLM v1 applies min-p (an argmax-invariant logits processor) before top-k/top-p: min_p 0.3
    keeps the first five (mass 0.87), renormalized 0.345, 0.230, 0.172, ... (cumulative 0.345,
    0.575, 0.747), so top_p 0.7 keeps three. Top-p first (on the raw cumulative 0.30, 0.50,
    0.65, 0.77) would keep four."""
    _check(_draw(temperature=1.0, min_p=0.3, top_p=0.7), _renorm(PROBS * (np.arange(8) < 3)))


def test_key_contract_fold_in_seed_and_step():
    """token = categorical(fold_in(key(seed), num_generated), logits / T), nothing else."""
    logits = jax.random.normal(jax.random.key(1), (S, V))
    state = _uniform_state(S, V, temperature=0.7, key_data=[0, 99])
    steps = jnp.array([0, 5, 6, 1000, 1, 2, 3, 4], jnp.int32)
    tokens = SAMPLE(logits, state, steps, K).tokens
    for s in range(S):
        key = jax.random.fold_in(jax.random.key(99), int(steps[s]))
        assert int(tokens[s]) == int(jax.random.categorical(key, logits[s] / 0.7))


def _pick_rows(mask, a, b):
    """Rows of a where mask[s], else rows of b. mask bool[S]; a, b [S, ...]."""
    return jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 1)), a, b)


MINE = {
    "filtered": dict(temperature=0.9, top_k=20, top_p=0.95, min_p=0.05, repetition_penalty=1.3),
    "plain": dict(temperature=0.9, repetition_penalty=1.3),
    "greedy": dict(temperature=0.0, repetition_penalty=1.3),
}


@pytest.mark.parametrize("mine", MINE.values(), ids=MINE.keys())
def test_slot_and_batch_invariance(mine):
    """A request's token depends on its row, params, seed and step, not on slots or neighbours."""
    rng = np.random.default_rng(0)
    row_logits = jnp.asarray(rng.normal(size=V) * 2, jnp.float32)
    base = _uniform_state(S, V, key_data=[0, 5], **mine)
    base = base.replace(prompt_mask=base.prompt_mask.at[:, :8].set(True))
    steps = jnp.arange(S, dtype=jnp.int32)
    want = np.asarray(SAMPLE(jnp.tile(row_logits, (S, 1)), base, steps, K).tokens)
    if mine["temperature"] > 0:
        assert len(set(want.tolist())) > 2  # really random

    # The same (row, step) pairs scattered over random slots among unrelated neighbours (other
    # logits, seeds, steps, penalties): all greedy (no random path), sampling without filters (no
    # top-k/top-p search), sampling with top-p (the search runs for every slot).
    half = S // 2
    for trial, neighbours in enumerate(("greedy", "sampling", "top_p") * 2):
        perm = rng.permutation(S)
        mine_slots = perm[:half]
        temperature = rng.uniform(0.1, 1.5, size=S) * (neighbours != "greedy")
        other = _uniform_state(
            S,
            V,
            temperature=temperature,
            top_p=0.5 if neighbours == "top_p" else 1.0,
            key_data=[1, 2],
            presence_penalty=1.0,
        )
        take_mine = np.zeros(S, bool)
        take_mine[mine_slots] = True
        mixed = jax.tree.map(functools.partial(_pick_rows, take_mine), base, other)
        logits = jnp.asarray(rng.normal(size=(S, V)) * 4, jnp.float32)
        logits = logits.at[mine_slots].set(row_logits)
        mixed_steps = np.asarray(rng.integers(0, 10_000, size=S), np.int32)
        which = np.arange(half) + (trial % 2) * half  # steps 0..3, then 4..7
        mixed_steps[mine_slots] = which
        got = np.asarray(SAMPLE(logits, mixed, jnp.asarray(mixed_steps), K).tokens)
        np.testing.assert_array_equal(got[mine_slots], want[which], err_msg=neighbours)

    # A batch of a different size (one slot) gives the same tokens too.
    single = jax.tree.map(lambda x: x[:1], base)
    for step in (0, 7):
        tok = SAMPLE(row_logits[None], single, jnp.array([step], jnp.int32), K).tokens
        assert int(tok[0]) == want[step]


def test_seed_changes_tokens_and_repeats_exactly():
    logits = jnp.zeros((S, V))  # uniform: tokens are pure seed/step noise
    steps = jnp.arange(S, dtype=jnp.int32)
    draws = {}
    for name, key_data in (("a", [0, 1]), ("b", [0, 1]), ("c", [0, 2]), ("d", [1, 1])):
        state = _uniform_state(S, V, temperature=1.0, key_data=key_data)
        draws[name] = np.asarray(SAMPLE(logits, state, steps, K).tokens)
    np.testing.assert_array_equal(draws["a"], draws["b"])
    assert (draws["a"] != draws["c"]).sum() >= S - 1 and (draws["a"] != draws["d"]).sum() >= S - 1


def test_token_logprobs():
    logits = jax.random.normal(jax.random.key(2), (6, 30)) * 2
    targets = jnp.array([0, 5, 29, 3, -1, 7], jnp.int32)
    fn = jax.jit(sampling.token_logprobs, static_argnums=2)
    lp, top_ids, top_lp, ranks = fn(logits, targets, 3)
    raw = _log_softmax(logits)
    want = raw[np.arange(6), np.maximum(np.asarray(targets), 0)]
    # vLLM's rank: the tokens at least as likely, itself included; padding (-1) 0
    want_ranks = (raw >= want[:, None] - 1e-6).sum(-1)
    want_ranks[4] = 0
    want[4] = 0.0
    np.testing.assert_allclose(lp, want, atol=1e-5)
    np.testing.assert_array_equal(ranks, want_ranks)
    np.testing.assert_array_equal(top_ids, np.argsort(-raw, -1, kind="stable")[:, :3])
    np.testing.assert_allclose(top_lp, np.sort(raw, -1)[:, ::-1][:, :3], atol=1e-5)
    with pytest.raises(ValueError, match="k must be"):
        sampling.token_logprobs(logits, targets, 31)


def test_no_recompilation_for_new_parameter_values():
    sample = jax.jit(sampling.sample, static_argnums=3)
    set_slot = jax.jit(sampling.set_slot, donate_argnums=0)
    update = jax.jit(sampling.update_counts, donate_argnums=0)
    max_len = 16
    state = sampling.init_state(S, V)
    rng = np.random.default_rng(3)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=5, seed=3),
        SamplingParams(temperature=1.3, top_p=0.3, min_p=0.1, repetition_penalty=1.2),
        SamplingParams(temperature=0.5, presence_penalty=-1.0, frequency_penalty=2.0, min_tokens=4),
        SamplingParams(temperature=1e-6, top_k=-1, ignore_eos=True, stop_token_ids=[1, 2, 3]),
    ]
    for i, sp in enumerate(params * 2):
        prompt = rng.integers(0, V, size=rng.integers(1, 8)).tolist()
        row = make_slot_row(sp, prompt, prompt[:2], (0,), seed=i * 7919, max_model_len=max_len)
        state = set_slot(state, jnp.int32(i % S), row)
        logits = jnp.asarray(rng.normal(size=(S, V)), jnp.float32)
        out = sample(logits, state, jnp.asarray(rng.integers(0, 9, size=S), jnp.int32), K)
        state = update(state, out.tokens, jnp.asarray(rng.random(S) < 0.5))
        sizes = (sample._cache_size(), set_slot._cache_size(), update._cache_size())
        if i == 0:
            warm = sizes  # the cache is per function (shared with other tests' jits): count growth
        assert sizes == warm, f"recompiled at request {i}: {sizes} vs {warm}"


def _top_k_top_p_reference(x, k, p):
    """numpy, vLLM's `apply_top_k_top_p` line by line (v1/sample/ops/topk_topp_sampler.py) with a
    stable ascending sort: keep x >= the k-th largest value; then over the sorted, renormalized
    probabilities drop every token whose cumulative sum is <= 1 - p, the last one always kept."""
    order = np.argsort(x, kind="stable")  # ascending
    xs = x[order].copy()
    if 0 < k < len(x):
        xs[xs < xs[len(x) - k]] = -np.inf
    if p < 1.0:
        probs = np.exp(xs - xs.max())
        probs /= probs.sum()
        drop = np.cumsum(probs) <= 1 - p
        drop[-1] = False
        xs[drop] = -np.inf
    keep = np.empty(len(x), bool)
    keep[order] = np.isfinite(xs)
    return keep


def test_top_k_top_p_mask_matches_reference_with_ties_and_inf():
    rng = np.random.default_rng(5)
    s, v = 16, 200
    x = np.round(rng.normal(size=(s, v)) * 3, 1).astype(np.float32)  # many ties
    x[0, :50] = -np.inf
    top_k = rng.integers(0, 250, size=s)
    top_k[:3] = [0, 1, v]
    top_p = rng.uniform(0.05, 1.0, size=s).astype(np.float32)
    top_p[3:6] = 1.0
    got = np.isfinite(jax.jit(sampling.apply_top_k_top_p)(x, top_k, top_p))
    for r in range(s):
        want = _top_k_top_p_reference(x[r].astype(np.float64), int(top_k[r]), float(top_p[r]))
        np.testing.assert_array_equal(got[r], want & np.isfinite(x[r]), err_msg=f"row {r}")


def test_grammar_mask_matches_llguidance_reference_and_spares_unconstrained_rows():
    """The device's unpacking of the packed [S, ceil(V/32)] bitmask against llguidance's own
    numpy `apply_token_bitmask_inplace`; unconstrained rows keep every logit; greedy and sampled
    tokens of constrained rows are allowed ones; log-probs are of the masked distribution."""
    from llguidance.numpy import apply_token_bitmask_inplace

    v = 70  # not a multiple of 32: the last word is partial
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(S, v)).astype(np.float32) * 3
    words = rng.integers(-(2**31), 2**31, size=(S, -(-v // 32)), dtype=np.int64).astype(np.int32)
    words[2] = 0
    words[2, 1] = 1 << 5  # row 2 allows token 37 only
    constrained = np.array([True, True, True, False, True, False, True, True])
    state = sampling.init_state(S, v)
    state = state.replace(grammar_mask=jnp.asarray(words), constrained=jnp.asarray(constrained))
    got = np.asarray(sampling.apply_grammar_mask(jnp.asarray(logits), state))
    want = logits.copy()
    apply_token_bitmask_inplace(want, words)
    want[~constrained] = logits[~constrained]
    np.testing.assert_array_equal(got, want)

    allowed = np.isfinite(want)
    greedy = SAMPLE(jnp.asarray(logits), state, jnp.zeros((S,), jnp.int32), K)
    np.testing.assert_array_equal(greedy.tokens, np.argmax(want, -1))
    assert int(greedy.tokens[2]) == 37 and float(greedy.logprobs[2]) == 0.0  # the only choice
    lp = _log_softmax(want)[np.arange(S), np.asarray(greedy.tokens)]
    np.testing.assert_allclose(greedy.logprobs, lp, rtol=1e-5)
    hot = state.replace(temperature=jnp.full((S,), 1.5), key_data=state.key_data + 3)
    for step in range(4):
        out = SAMPLE(jnp.asarray(logits), hot, jnp.full((S,), step, jnp.int32), K)
        assert allowed[np.arange(S), np.asarray(out.tokens)].all()
    # set_slot (a new request in the slot) switches the slot's mask off
    row = make_slot_row(SamplingParams(), [1], [], (), 0, 8)
    fresh = sampling.set_slot(state, jnp.int32(2), row)
    assert not bool(fresh.constrained[2]) and bool(fresh.constrained[1])
