"""The mixture-of-experts layer: both grouped paths (ragged_dot, GPU; tiled, CPU) equal the
per-expert dense reference, routing equals Hugging Face's per token (the golden routers),
quantized expert stacks, and no recompilation across batches that route differently."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_testing import GOLDEN_DIR, load_golden_logits

from jaxserve.bench.core import CompileCounter
from jaxserve.layers import moe, moe_tiles
from jaxserve.loading import hf
from jaxserve.models import llama
from jaxserve.quant import int8, rtn
from pallas_kernels.lowering import kernel_launches

grouped = jax.jit(moe.moe_mlp, static_argnums=(5, 6, 7))
PATHS = list(moe.GROUPED)
reference = jax.jit(moe.moe_mlp_reference, static_argnums=(5, 6))


def random_experts(seed, n, d, i, e, dtype=jnp.float32, skew=0.0):
    """x [N, D], router logits [N, E], w_gate/w_up [E, D, I], w_down [E, I, D]. skew > 0 adds a
    bias towards expert 0 (so some experts get no token and one gets most)."""
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (n, d))
    logits = jax.random.normal(ks[1], (n, e)) - skew * jnp.arange(e)
    wg = jax.random.normal(ks[2], (e, d, i)) / np.sqrt(d)
    wu = jax.random.normal(ks[3], (e, d, i)) / np.sqrt(d)
    wd = jax.random.normal(ks[4], (e, i, d)) / np.sqrt(i)
    return tuple(a.astype(dtype) for a in (x, logits, wg, wu, wd))


# N includes 1 (one decode row) and sizes where several experts get no pair.
@pytest.mark.parametrize(
    "n,e,k,norm,skew",
    [
        (1, 8, 2, True, 0.0),
        (7, 8, 2, True, 0.0),
        (33, 8, 2, True, 3.0),  # most pairs on experts 0 and 1, the rest nearly empty
        (16, 16, 4, False, 0.0),
        (5, 4, 4, False, 0.0),  # k == E: every expert on every token
        (64, 32, 1, True, 0.0),
        (40, 2, 2, True, 0.0),  # 'tiled': 40 pairs per expert -> tiles of 32, partial tiles
        (300, 4, 2, True, 2.0),  # 'tiled': tiles of 128, one expert with most pairs
    ],
)
@pytest.mark.parametrize("path", PATHS)
def test_grouped_equals_dense_reference_f32(n, e, k, norm, skew, path):
    args = random_experts(n * 100 + e, n, 32, 24, e, skew=skew)
    got, want = grouped(*args, k, norm, path), reference(*args, k, norm)
    # f32: only the accumulation order differs (measured max 1.2e-6 on O(1) outputs).
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_tile_rows():
    """8 rows while experts average under 16 pairs (decode), else a power of two <= P / E up to
    128; the padded buffer bounds every routing's used tiles."""
    assert [moe_tiles.tile_rows(p, 8) for p in (1, 16, 127, 128, 255, 256, 1024, 4096)] == [
        8,
        8,
        8,
        16,
        16,
        32,
        128,
        128,
    ]
    assert moe_tiles.tile_rows(256, 128) == 8 and moe_tiles.tile_rows(4096, 128) == 32


@pytest.mark.parametrize("path", PATHS)
def test_grouped_equals_dense_reference_bf16(path):
    args = random_experts(3, 40, 64, 48, 8, dtype=jnp.bfloat16)
    got = np.asarray(grouped(*args, 2, True, path), np.float32)
    want = np.asarray(reference(*args, 2, True), np.float32)
    # bf16 rounding of the intermediates in different orders: a few bf16 ulps of O(1) outputs.
    np.testing.assert_allclose(got, want, atol=5e-2, rtol=0)
    assert np.abs(got - want).mean() < 5e-3


def test_route_matches_softmax_over_the_chosen_logits():
    """Mixtral's definition (softmax over the top-k logits) == the renormalized top-k."""
    logits = jax.random.normal(jax.random.key(0), (50, 8))
    w, idx = moe.route(logits, 2, norm_topk_prob=True)
    chosen = jnp.take_along_axis(logits, idx, axis=-1)
    np.testing.assert_allclose(w, jax.nn.softmax(chosen, axis=-1), atol=1e-6)
    w_raw, idx_raw = moe.route(logits, 2, norm_topk_prob=False)  # Qwen3-MoE's default
    np.testing.assert_array_equal(idx_raw, idx)
    np.testing.assert_allclose(
        w_raw, jnp.take_along_axis(jax.nn.softmax(logits, -1), idx, axis=-1), atol=1e-7
    )


def _dense_attend(q, k, v, config):
    """Full causal GQA attention (q [B, T, H, Dh], k/v [B, T, KVH, Dh]) for whole sequences."""
    b, t, h, dh = q.shape
    qg = q.reshape(b, t, config.num_kv_heads, config.q_per_kv, dh)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k) / np.sqrt(dh)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    o = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(s, -1), v)
    return o.reshape(b, t, h, dh), None


def layer_params(params, config, li):
    """Layer li's params without their stacked axis (MLP stacks by the row holding li)."""
    rows = llama.mlp_rows(config)
    out = {}
    for name, w in params["layers"].items():
        row = int(rows[name][li]) if name in rows else li
        out[name] = w[row]
    return out


@functools.lru_cache
def our_router_logits(name):
    """{sparse layer: our f32 router logits [B*T, E]} for the golden tokens, layer by layer."""
    config, params = hf.load_hf_dir(GOLDEN_DIR / name, "float32")
    tokens, _ = load_golden_logits(name)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = params["embed"][tokens]
    attend = functools.partial(_dense_attend, config=config)
    out = {}
    for li in range(config.num_layers):
        lp = layer_params(params, config, li)
        sparse = li in config.moe_layers
        x, _, taps = llama.decoder_layer(lp, x, positions, attend, config, sparse=sparse)
        if sparse:
            out[li] = np.asarray(taps["mlp"].reshape(b * t, -1) @ lp["router"])
    return config, out


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen3_moe_sparse2"])
def test_routing_equals_hf_per_token(name):
    golden = np.load(GOLDEN_DIR / name / "routing.npz")
    config, logits = our_router_logits(name)
    assert sorted(logits) == list(config.moe_layers)
    k = config.num_experts_per_tok
    for li, ours in logits.items():
        # The router's inputs went through li attention layers: f32 accumulation order only.
        np.testing.assert_allclose(ours, golden[f"logits_{li}"], atol=2e-5, rtol=0)
        w, idx = (np.asarray(a) for a in moe.route(jnp.asarray(ours), k, config.norm_topk_prob))
        np.testing.assert_array_equal(idx, golden[f"experts_{li}"])
        np.testing.assert_allclose(w, golden[f"weights_{li}"], atol=1e-5)
        # From HF's own logits, our router picks HF's experts with HF's weights exactly.
        w, idx = moe.route(jnp.asarray(golden[f"logits_{li}"]), k, config.norm_topk_prob)
        np.testing.assert_array_equal(idx, golden[f"experts_{li}"])
        np.testing.assert_allclose(w, golden[f"weights_{li}"], atol=1e-6)
        assert len(np.unique(idx)) > k  # the goldens route tokens to different experts


@pytest.mark.parametrize(
    "quantize",
    [
        int8.quantize_int8,
        int8.quantize_fp8,
        lambda w: rtn.quantize_int4_rtn(w, 32),
    ],
    ids=["int8", "fp8", "int4"],
)
@pytest.mark.parametrize("path", PATHS)
def test_quantized_expert_stack_is_its_dequantized_weight(quantize, path):
    x, logits, wg, wu, wd = random_experts(7, 12, 64, 32, 4)
    q = [quantize(w) for w in (wg, wu, wd)]
    stacks = [moe.expert_stack(w, jnp.float32) for w in q]
    for w, s in zip(q, stacks):
        np.testing.assert_array_equal(s, w.dequantize())
    got = grouped(x, logits, *stacks, 2, True, path)
    np.testing.assert_allclose(got, reference(x, logits, *stacks, 2, True), atol=1e-5)
    assert np.abs(got - grouped(x, logits, wg, wu, wd, 2, True, path)).max() < 0.3  # near float
    # The stacks as stored: 'tiled' multiplies each tile by its own expert's quantized weight
    # (`matmul(layer=e)`), 'ragged_dot' dequantizes the stack first; both equal the float path.
    np.testing.assert_allclose(grouped(x, logits, *q, 2, True, path), got, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_no_recompilation_across_routings(path):
    """One compile per shape: routings that differ (balanced, all on one expert, experts left
    empty; for 'tiled', used tile counts from 3 to 8) are traced arrays, never static."""
    args = random_experts(0, 24, 32, 16, 8)
    jax.block_until_ready(grouped(*args, 2, True, path))  # warm-up
    x, _, wg, wu, wd = args
    routings = [
        random_experts(s, 24, 32, 16, 8, skew=k)[1] for s, k in [(1, 0), (2, 5), (3, -5), (4, 50)]
    ]
    with CompileCounter() as counter:
        got = [jax.block_until_ready(grouped(x, r, wg, wu, wd, 2, True, path)) for r in routings]
    assert counter.count == 0
    for r, out in zip(routings, got):
        np.testing.assert_allclose(out, reference(x, r, wg, wu, wd, 2, True), atol=1e-5)


def test_bad_shapes_are_named():
    x, logits, wg, wu, wd = random_experts(0, 4, 32, 16, 8)
    with pytest.raises(ValueError, match=r"w_down has shape \(8, 32, 16\), expected \(8, 16, 32\)"):
        moe.moe_mlp(x, logits, wg, wu, jnp.swapaxes(wd, 1, 2), 2, True)
    with pytest.raises(ValueError, match=r"k=9 experts per token must be in \[1, 8\]"):
        moe.moe_mlp(x, logits, wg, wu, wd, 9, True)
    with pytest.raises(ValueError, match=r"grouped='dense' must be one of"):
        moe.moe_mlp(x, logits, wg, wu, wd, 2, True, "dense")


QUANTIZERS = {
    "int4": lambda w: rtn.quantize_int4_rtn(w, 32),
    "int8": int8.quantize_int8,
    "fp8": int8.quantize_fp8,
}
TILED_KERNEL = {"int4": "int4_matmul_t16", "int8": "w8_matmul_t16", "fp8": "w8_matmul_t16"}


def layer_stacks(seed, layers, d, i, e):
    """w_gate/w_up [Ls, E, D, I], w_down [Ls, E, I, D]: a model's expert stacks."""
    ks = jax.random.split(jax.random.key(seed), 3)
    wg = jax.random.normal(ks[0], (layers, e, d, i)) / np.sqrt(d)
    wu = jax.random.normal(ks[1], (layers, e, d, i)) / np.sqrt(d)
    wd = jax.random.normal(ks[2], (layers, e, i, d)) / np.sqrt(i)
    return wg, wu, wd


@pytest.mark.parametrize("fmt", list(QUANTIZERS))
def test_kernel_path_runs_each_tile_on_its_expert_in_the_stack(fmt):
    """The GPU path of quantized experts: one tiled kernel launch per weight over the model's
    whole [Ls, E, K, N] stack (interpreted here), each tile of 16 rows reading its expert of the
    layer; equal to 'ragged_dot' over the layer's dequantized experts, for every layer."""
    from jaxserve.quant import with_matmul_impl

    layers, e = 3, 4
    x, logits, *_ = random_experts(11, 12, 64, 32, e)  # 24 pairs: 5 tiles of 16 rows, some empty
    floats = layer_stacks(5, layers, 64, 32, e)
    stacks = with_matmul_impl([QUANTIZERS[fmt](w) for w in floats], "pallas_interpret")
    run = jax.jit(moe.moe_mlp, static_argnums=(5, 6, 7))
    for li in range(layers):
        experts = [moe_tiles.StackedExperts(w, jnp.int32(li)) for w in stacks]
        want = grouped(x, logits, *[w.dequantize()[li] for w in stacks], 2, True, "ragged_dot")
        got = run(x, logits, *experts, 2, True, "kernel")
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    jaxpr = jax.make_jaxpr(run, static_argnums=(5, 6, 7))(x, logits, *experts, 2, True, "kernel")
    assert kernel_launches(jaxpr.jaxpr, TILED_KERNEL[fmt]) == 3  # gate, up, down: a launch each


def test_kernel_path_takes_ragged_dot_where_the_kernel_does_not_take_the_tiles():
    """Tiles beyond the weights' kernel rows (a prefill chunk's), or float experts: XLA's
    ragged_dot over the dequantized layer, with the same result."""
    from jaxserve.quant import with_matmul_impl

    x, logits, *_ = random_experts(3, 12, 64, 32, 4)
    floats = layer_stacks(2, 2, 64, 32, 4)
    narrow = with_matmul_impl(
        [QUANTIZERS["int4"](w) for w in floats], "pallas_interpret", {"int4_matmul": 8}
    )
    experts = [moe_tiles.StackedExperts(w, jnp.int32(1)) for w in narrow]
    run = jax.jit(moe.moe_mlp, static_argnums=(5, 6, 7))
    jaxpr = jax.make_jaxpr(run, static_argnums=(5, 6, 7))(x, logits, *experts, 2, True, "kernel")
    assert kernel_launches(jaxpr.jaxpr, "int4_matmul") == 0 and "ragged_dot" in str(jaxpr)
    want = grouped(x, logits, *[w.dequantize()[1] for w in narrow], 2, True, "ragged_dot")
    np.testing.assert_allclose(run(x, logits, *experts, 2, True, "kernel"), want, atol=1e-6)
    plain = [moe_tiles.StackedExperts(w, jnp.int32(1)).layer() for w in floats]
    np.testing.assert_array_equal(
        run(x, logits, *plain, 2, True, "kernel"), grouped(x, logits, *plain, 2, True, "ragged_dot")
    )


def test_kernel_tile_is_what_every_weights_kernel_takes_while_tiles_stay_few():
    """The 'kernel' path's rows per tile: INT4's kernel takes 16 rows (the shipped table), W8A16's
    up to 64; none for float experts, a kernel impl set to XLA, or a prefill chunk whose tiles
    could pass MAX_TILES_PER_EXPERT reads of every expert (then 'ragged_dot' moves fewer bytes)."""
    from jaxserve.quant import with_matmul_impl

    floats = layer_stacks(0, 1, 128, 64, 8)
    int4 = with_matmul_impl([QUANTIZERS["int4"](w) for w in floats], "pallas", {"int4_matmul": 16})
    fp8 = with_matmul_impl([QUANTIZERS["fp8"](w) for w in floats], "pallas", {"w8_matmul": 64})
    tile = moe_tiles.kernel_tile
    assert tile(int4, 16, 8) == tile(int4, 128, 8) == 16  # decode: 8 and 64 Mixtral slots
    assert tile(int4, 256, 8) == 16  # 32 pairs an expert: INT4 still takes 16-row tiles
    assert tile(fp8, 256, 8) == 32 and tile(fp8, 1024, 8) == 64 and tile(fp8, 2048, 8) is None
    assert tile(int4, 512, 8) is None  # 32 + 8 tiles > 4 a expert
    assert tile(int4, 512, 128) == 16  # Qwen3-30B-A3B at 64 slots: 32 + 128 tiles <= 512
    assert tile(floats, 16, 8) is None
    assert tile(with_matmul_impl(int4, "xla"), 16, 8) is None
