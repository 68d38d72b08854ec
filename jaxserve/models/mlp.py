"""The decoder layer's MLP (`llama.decoder_layer`): the dense gated one, the mixture of experts, or,
in a model mixing both, the one the layer holds.

    mlp(m_in, proj, projs, expert, config, sparse, moe_matmul) -> (y, down_in)    one layer's
    dense_mlp(m_in, proj, projs, config) -> (y, down_in)     SwiGLU / GeGLU (`gate_activation`)
    moe_block(m_in, proj, expert, config, moe_matmul) -> y   the sparse MLP (`layers/moe.py`)
    mlp_rows(config) -> {MLP param: i32[L]}                  a mixed model's stack rows per layer

The weights come through the layer's `proj` / `projs` / `expert` (see `decoder_layer`), so the same
code runs in the engine's scan over the paged cache and in calibration.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.layers.moe import moe_mlp

MOE_PARAMS = ("router", "we_gate", "we_up", "we_down")
DENSE_MLP_PARAMS = ("w_gate", "w_up", "w_down")


def mlp(
    m_in: jax.Array,
    proj: Callable,
    projs: Callable,
    expert: Callable,
    config: ModelConfig,
    sparse=None,
    moe_matmul: str = "ragged_dot",
) -> tuple[jax.Array, jax.Array | None]:
    """The layer's MLP: m_in [B, T, D] -> (y [B, T, D], the input of w_down [B, T, I] for the
    dense MLP, else None). sparse: whether it is the mixture of experts: None (from the config,
    when all its layers are one kind), a Python bool, or a traced bool[] (a model mixing both:
    `lax.cond` runs one of the two, both compiled once)."""
    c = config
    if sparse is None:
        if c.moe_layers and c.dense_layers:
            raise ValueError(
                "this config mixes dense and sparse layers (mlp_only_layers / "
                "decoder_sparse_step): decoder_layer needs sparse= for each layer"
            )
        sparse = bool(c.moe_layers)
    if sparse is True:
        return moe_block(m_in, proj, expert, c, moe_matmul), None
    if sparse is False:
        return dense_mlp(m_in, proj, projs, c)
    y = jax.lax.cond(
        sparse,
        lambda m: moe_block(m, proj, expert, c, moe_matmul),
        lambda m: dense_mlp(m, proj, projs, c)[0],
        m_in,
    )
    return y, None


def gate_activation(config: ModelConfig) -> Callable:
    """The MLP gate's activation, f32 -> f32: SiLU (SwiGLU) or tanh-GELU (Gemma's GeGLU)."""
    if config.mlp_activation == "gelu_tanh":
        return lambda a: jax.nn.gelu(a, approximate=True)
    return jax.nn.silu


def dense_mlp(m_in: jax.Array, proj: Callable, projs: Callable, config: ModelConfig):
    """w_down(act(w_gate m) * w_up m), the gate's activation in f32 -> (y, the input of w_down)."""
    act = gate_activation(config)
    gate, up = projs(m_in, ("w_gate", "w_up"))
    d_in = act(gate.astype(jnp.float32)).astype(m_in.dtype) * up
    return proj(d_in, "w_down"), d_in


def moe_block(
    m_in: jax.Array,
    proj: Callable,
    expert: Callable,
    config: ModelConfig,
    moe_matmul: str = "ragged_dot",
) -> jax.Array:
    """The sparse MLP: m_in [B, T, D] -> [B, T, D]. Router logits in the activation dtype (as
    HF), then `moe.moe_mlp` over the B*T tokens (padding rows too: dropless, they take no
    capacity from real tokens)."""
    b, t, d = m_in.shape
    flat = m_in.reshape(b * t, d)  # (N, D)
    logits = proj(flat, "router")  # (N, E)
    y = moe_mlp(
        flat,
        logits,
        expert("we_gate"),
        expert("we_up"),
        expert("we_down"),
        config.num_experts_per_tok,
        config.norm_topk_prob,
        moe_matmul,
    )
    return y.reshape(b, t, d)


def mlp_rows(config: ModelConfig) -> dict[str, np.ndarray]:
    """{MLP param: i32[L], the row of its stack holding layer l (0 for the other kind's layers)}
    for a model mixing dense and sparse layers; {} when every layer is one kind (the stacks then
    hold every layer, [L, ...], and are scanned like the rest).

    Why compact stacks and `lax.cond` rather than both MLPs stacked over every layer: no layer
    stores (or loads, or quantizes) weights it never uses, the scan stays one loop body whatever
    the pattern, and the conditional costs a predicate per layer."""
    c = config
    if not (c.moe_layers and c.dense_layers):
        return {}
    out = {}
    for names, held in ((DENSE_MLP_PARAMS, c.dense_layers), (MOE_PARAMS, c.moe_layers)):
        row = np.zeros(c.num_layers, np.int32)
        row[list(held)] = np.arange(len(held), dtype=np.int32)
        out.update({n: row for n in names})
    return out
