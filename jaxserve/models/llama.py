"""The one functional decoder (Llama 2/3/3.1, Mistral, Qwen2/3, SmolLM2, Gemma 2/3, Phi-3, MoE)
over a paged KV cache. A family is a ModelConfig and its switches, never a copy of this file.

    forward(params, tokens, meta, cache, config, impl) -> (hidden, cache)
    decoder_layer(lp, x, positions, attend, config, proj) -> (x, aux, taps)   one layer
    compute_logits(params, hidden, config, impl) -> f32 logits

`decoder_layer` is written once: `forward` scans it over the paged cache, calibration
(`quant/calibration.py`) runs it with a dense causal attention to collect the linears' inputs.
Its MLP, dense, mixture of experts or one per layer, is `models/mlp.py`.

Params are a plain pytree passed into jit (never closed over). Per-layer weights are stacked on a
leading layer axis and the layers run under `lax.scan`, so compile time does not depend on depth:

    embed        [V, D]           or a quantized weight in the lm_head view [D, V] (see below)
    layers/
      attn_norm  [L, D]
      wq         [L, D, H*Dh]     (+ bq [L, H*Dh] when config.attention_bias, Qwen2)
      wk, wv     [L, D, KVH*Dh]   (+ bk, bv [L, KVH*Dh])
      wo         [L, H*Dh, D]
      q_norm, k_norm [L, Dh]      config.qk_norm (Qwen3, Gemma 3): per-head RMSNorm before RoPE
      post_attn_norm [L, D]       config.sandwich_norms (Gemma 2/3): on the attention output,
      post_mlp_norm  [L, D]         and on the MLP output, before each residual add
      mlp_norm   [L, D]
      w_gate     [L, D, I]
      w_up       [L, D, I]
      w_down     [L, I, D]
      -- mixture-of-experts (config.num_experts > 0; `layers/moe.py`): the sparse layers Ls =
         config.moe_layers hold these instead of w_gate/w_up/w_down (which then stack only the
         dense layers, [Ld, ...], Ld = len(config.dense_layers), absent when Ld = 0):
      router     [Ls, D, E]       (float, never quantized)
      we_gate    [Ls, E, D, Im]   Im = moe_intermediate_size
      we_up      [Ls, E, D, Im]
      we_down    [Ls, E, Im, D]
    final_norm   [D]
    lm_head      [D, V]           absent when config.tie_word_embeddings (logits use embed^T)
    lora/        only with LoRA adapters (EngineConfig.enable_lora; `layers/lora.py`): every
      wq ... w_down  {"a": [L, N, in, R], "b": [L, N, R, out]}   N adapter slots of rank R

Linear weights are `[in, out]` arrays or quantized-weight pytrees (see `jaxserve.quant`) with the
same logical shape; `layers.linear.linear` multiplies either. A quantized embedding is stored as the
output projection it is when tied, logical [D, V] (`layers.embedding`): the lookup gathers its
columns and tied logits are `linear(hidden, embed)`. Norms and softmax run in f32; matmuls in the
params' dtype (`model_dtype`: the float embedding's, else final_norm's).

The family switches, all read from the static config (`config/model.py`): q/k norms, Gemma's
`(1 + w)` norms (`norm_offset`), sandwich norms, the gate activation, scaled embeddings,
attention scale and soft-caps, final-logit soft-cap, RoPE scaling (llama3 / linear / LongRoPE /
GGUF divisors). What differs per layer (Gemma's sliding and global layers, Gemma 3's two RoPE
bases) is scanned with the weights as `layer_constants(config)`: the window i32[L] and the RoPE
table f32[L, Dh/2].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.layers import kv_cache as kvc
from jaxserve.layers import lora
from jaxserve.layers.attention import AttentionMetadata, attention
from jaxserve.layers.embedding import embed, is_quantized
from jaxserve.layers.linear import TransposedWeight, fused_name, linear, linears
from jaxserve.layers.moe_tiles import StackedExperts
from jaxserve.layers.norm import rms_norm
from jaxserve.layers.rope import apply_rope
from jaxserve.models.mlp import mlp, mlp_rows
from jaxserve.models.params import check_params, init_params, model_dtype, param_shapes  # noqa: F401
from jaxserve.resolve import REFERENCE_IMPL, ModelImpl


def forward(
    params: dict,
    tokens: jax.Array,
    meta: AttentionMetadata,
    cache: kvc.KVCache,
    config: ModelConfig,
    impl: ModelImpl = REFERENCE_IMPL,
    lora_rows: jax.Array | None = None,
) -> tuple[jax.Array, kvc.KVCache]:
    """Runs the new tokens through every layer, writing their K/V into the paged cache.

    tokens: i32[B, T]; meta: positions/slot_mapping [B, T], page_table [B, W], seq_lens [B].
    impl (static): the attention implementation and the matmul row padding (`jaxserve.resolve`).
    lora_rows: i32[B], each row's LoRA adapter slot (-1 = none), used when params hold the
    adapters' stacks (params["lora"], `layers/lora.py`): each adapted weight's output gains its
    row's adapter product.
    Returns the final-norm hidden states [B, T, D] (params dtype) and the updated cache.
    """
    c = config
    dtype = model_dtype(params)
    x = embed_tokens(params, tokens, c, dtype)  # (B, T, D)
    # Weights whose kernel reads a layer of the stack in place (INT4) stay out of the scan's
    # inputs, which would slice (copy) each layer out for the kernel; they get the layer index.
    # So do the MLP stacks of a model mixing dense and sparse layers (`mlp_rows`): they get the
    # row of their stack that holds the layer.
    rows = {name: jnp.asarray(r) for name, r in mlp_rows(c).items()}  # name -> i32[L]
    whole = {
        name: w
        for name, w in params["layers"].items()
        if getattr(w, "reads_layer_in_place", False) or name in rows
    }
    scanned = {name: w for name, w in params["layers"].items() if name not in whole}
    sparse = jnp.asarray(np.isin(np.arange(c.num_layers), c.moe_layers)) if rows else None
    adapters = params.get("lora") if lora_rows is not None else None

    def layer(carry, xs):
        x, cache = carry
        lp, li, row, is_sparse, lc, la = xs  # lc: this layer's `layer_constants`; la: its LoRA

        def adapted(a, name, y):  # y = a @ weight `name`, plus each row's adapter product
            if la is None or name not in la:
                return y
            return y + lora.delta(a, la[name]["a"], la[name]["b"], lora_rows)

        def stack_row(name):  # the row of whole[name] holding layer li
            return row[name] if name in row else li

        def proj(a, name):  # a @ layer li's weight `name`
            if name not in whole:
                return adapted(a, name, linear(a, lp[name], min_rows=impl.min_matmul_rows))
            y = linear(a, whole[name], layer=stack_row(name), min_rows=impl.min_matmul_rows)
            return adapted(a, name, y)

        def projs(a, names):  # (a @ layer li's weight `name` for each name), stacks together
            key = fused_name(names)
            if key in lp or key in whole:  # one GEMM / W8A16 launch over the concatenated group
                fused, layer = (whole[key], li) if key in whole else (lp[key], None)
                ys = fused.split(linear(a, fused.w, layer=layer, min_rows=impl.min_matmul_rows))
                return tuple(adapted(a, n, y) for n, y in zip(names, ys))
            if all(n in whole and n not in row for n in names):
                ws = [whole[n] for n in names]
                ys = linears(a, ws, layer=li, min_rows=impl.min_matmul_rows)
                return tuple(adapted(a, n, y) for n, y in zip(names, ys))
            return tuple(proj(a, n) for n in names)

        def expert(name):  # layer li's expert stack `name` [E, K, N] as stored (moe_mlp reads it)
            if name not in whole:
                return lp.get(name)
            stacked = StackedExperts(whole[name], stack_row(name))
            # quantized: left in the stack, read in place by the tiled kernels (`layers/moe.py`)
            return stacked if hasattr(whole[name], "matmul") else stacked.layer()

        x, cache, _ = decoder_layer(
            lp,
            x,
            meta.positions,
            paged_attend(cache, li, meta, impl, **attention_options(c, lc["window"])),
            c,
            proj,
            expert,
            sparse=is_sparse,
            projs=projs,
            inv_freq=lc["inv_freq"],
            moe_matmul=impl.moe_matmul,
        )
        return (x, cache), None

    consts = {k: jnp.asarray(v) for k, v in layer_constants(c).items()}
    (x, cache), _ = jax.lax.scan(
        layer,
        (x, cache),
        (scanned, jnp.arange(c.num_layers, dtype=jnp.int32), rows, sparse, consts, adapters),
    )
    return rms_norm(x, params["final_norm"], c.rms_norm_eps, c.norm_offset), cache


def embed_tokens(params: dict, tokens: jax.Array, config: ModelConfig, dtype) -> jax.Array:
    """tokens i32[B, T] -> the first layer's input [B, T, D] in dtype (Gemma: times sqrt(D),
    the scale rounded to dtype first, as HF does)."""
    x = embed(params["embed"], tokens, dtype)  # (B, T, D)
    if config.scale_embeddings:
        x = x * jnp.asarray(config.hidden_size**0.5, dtype)
    return x


def layer_constants(config: ModelConfig) -> dict[str, np.ndarray]:
    """What varies per layer besides the weights, scanned with them:
    {"window": i32[L] (0 = global), "inv_freq": f32[L, Dh/2] (the layer's RoPE table)}."""
    return {"window": config.layer_windows(), "inv_freq": config.layer_inv_freq()}


def attention_options(config: ModelConfig, window) -> dict:
    """The `attention` keywords of a layer: its window (traced i32[], only when some layer of the
    config slides: else None, the unmasked path), the soft-cap and the scale (static)."""
    return dict(
        window=window if config.uses_sliding_window else None,
        softcap=config.attn_logit_softcap,
        scale=config.attention_scale,
    )


def paged_attend(
    cache: kvc.KVCache,
    layer,
    meta: AttentionMetadata,
    impl: ModelImpl,
    *,
    window=None,
    softcap: float | None = None,
    scale: float | None = None,
):
    """The engine's `attend` for `decoder_layer`: writes the new tokens' K/V into layer `layer`
    of the paged cache (ONE write, before attention reads it, so XLA updates the donated pool in
    place), then runs paged attention over it (window / softcap / scale: `attention_options`).
    Returns (out [B, T, H, Dh], the updated cache)."""

    def attend(q, k, v):
        new = kvc.write(cache, layer, k, v, meta.slot_mapping)
        out = attention(
            q, new, layer, meta, impl.attention, window=window, softcap=softcap, scale=scale
        )
        return out, new

    return attend


def decoder_layer(
    lp: dict,
    x: jax.Array,
    positions: jax.Array,
    attend: Callable,
    config: ModelConfig,
    proj: Callable | None = None,
    expert: Callable | None = None,
    sparse=None,
    inv_freq=None,
    moe_matmul: str = "ragged_dot",
    projs: Callable | None = None,
) -> tuple[jax.Array, Any, dict]:
    """One decoder layer: the engine's, calibration's (AWQ/GPTQ statistics) and the experiments'.

    lp: the layer's params (no layer axis) or, with `proj`, at least its norms and biases;
    x [B, T, D] in the activation dtype; positions i32[B, T];
    attend(q [B, T, H, Dh] (roped), k [B, T, KVH, Dh] (roped), v [B, T, KVH, Dh]) ->
      (out [B, T, H, Dh], aux): the attention over whatever holds the keys (the paged cache, whose
      updated self is `aux`; or a dense causal softmax over the window);
    proj(a, name) -> a @ the layer's weight `name` (default: `linear(a, lp[name])`);
    projs(a, names) -> (a @ the layer's weight `name` for each of names), for the weights that
      share an input (wq, wk, wv; w_gate, w_up) (default: `proj` for each; the engine's runs
      them as one call, `layers.linear.linears`);
    expert(name) -> the layer's expert stack `name` [E, K, N], plain or quantized as stored
      (default: lp[name]; `moe.moe_mlp` dequantizes what its path needs);
    sparse: whether the MLP (`models/mlp.py`) is the mixture of experts or the dense one: None
      (from the config, when all its layers are one kind), a Python bool, or a traced bool[]
      (a model mixing both: `lax.cond` runs one of the two, both compiled once);
    inv_freq: the layer's RoPE table f32[Dh/2] (`layer_constants`; default: the config's, which
      must then be the same for every layer). The layer's window goes into `attend`.
    moe_matmul: the sparse MLP's grouped path, 'ragged_dot' or 'tiled' (`ModelImpl`).

    Returns (x' [B, T, D], aux, taps), taps = the inputs of the layer's linears, {"attn" [B, T, D]
    -> wq/wk/wv, "o" [B, T, H*Dh] -> wo, "mlp" [B, T, D] -> w_gate/w_up (or the router), "down"
    [B, T, I] -> w_down (dense MLP only)} and the roped queries "q" [B, T, H, Dh]. Unused taps
    cost nothing under jit.
    """
    c = config
    b, t, _ = x.shape
    h, kvh, dh = c.num_heads, c.num_kv_heads, c.head_dim
    dtype = x.dtype
    if inv_freq is None:
        table = c.layer_inv_freq()
        if not (table == table[:1]).all():
            raise ValueError("this config's RoPE differs per layer: pass decoder_layer inv_freq=")
        inv_freq = table[0]
    if proj is None:
        proj = lambda a, name: linear(a, lp[name])  # noqa: E731
    if projs is None:
        projs = lambda a, names: tuple(proj(a, n) for n in names)  # noqa: E731

    def norm(a, name):
        return rms_norm(a, lp[name], c.rms_norm_eps, c.norm_offset)

    rope = dict(long_from=c.rope_long_from, scale=c.rope_attention_factor)
    if c.rope_long_from is not None:
        rope["long_inv_freq"] = c.inv_freq(long=True)

    a_in = norm(x, "attn_norm")  # (B, T, D)
    q, k, v = projs(a_in, ("wq", "wk", "wv"))
    if c.attention_bias:
        # the biases add after the GEMMs, not in their epilogue: on GPU a GEMM with a bias
        # epilogue cannot read its weight in place from the layer stack, so XLA copied Qwen2's
        # q/k/v weights out of it every step (tests/bench/test_gpu_programs.py)
        q, k, v = jax.lax.optimization_barrier((q, k, v))
        q = q + lp["bq"].astype(dtype)
        k = k + lp["bk"].astype(dtype)
        v = v + lp["bv"].astype(dtype)
    q, k = q.reshape(b, t, h, dh), k.reshape(b, t, kvh, dh)  # (B, T, H | KVH, Dh)
    if c.qk_norm:
        q, k = norm(q, "q_norm"), norm(k, "k_norm")
    q = apply_rope(q, positions, inv_freq, **rope)  # (B, T, H, Dh)
    k = apply_rope(k, positions, inv_freq, **rope)  # (B, T, KVH, Dh)
    o, aux = attend(q, k, v.reshape(b, t, kvh, dh))
    o_in = o.reshape(b, t, h * dh)
    attn_out = proj(o_in, "wo")
    x = x + (norm(attn_out, "post_attn_norm") if c.sandwich_norms else attn_out)
    m_in = norm(x, "mlp_norm")
    taps = {"attn": a_in, "q": q, "o": o_in, "mlp": m_in}
    if expert is None:
        expert = lambda name: lp[name]  # noqa: E731
    y, down_in = mlp(m_in, proj, projs, expert, c, sparse, moe_matmul)
    if down_in is not None:
        taps["down"] = down_in
    x = x + (norm(y, "post_mlp_norm") if c.sandwich_norms else y)
    return x, aux, taps


def compute_logits(
    params: dict, hidden: jax.Array, config: ModelConfig, impl: ModelImpl = REFERENCE_IMPL
) -> jax.Array:
    """hidden[..., D] -> f32 logits[..., V] (Gemma 2: soft-capped, cap * tanh(logits / cap))."""
    rows = impl.min_matmul_rows
    if config.tie_word_embeddings:
        w = params["embed"]
        if is_quantized(w):  # the lm_head view (D, V)
            logits = linear(hidden, w).astype(jnp.float32)
        else:  # the table [V, D] is the logits' weight stored [out, in]
            w = TransposedWeight(w, impl.cpu_matmul)
            logits = w.matmul(hidden, min_rows=rows, out_dtype=jnp.float32)
    else:
        logits = linear(hidden, params["lm_head"], min_rows=rows).astype(jnp.float32)
    cap = config.final_logit_softcap
    return logits if cap is None else cap * jnp.tanh(logits / cap)
