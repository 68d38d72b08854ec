"""MoE decode step time vs a dense model of the same active parameters, on CPU (issue 26).

For Mixtral-8x7B's and Qwen3-30B-A3B's per-layer shapes (hidden, heads, experts, expert width,
top-k; only 2 layers, so the weights fit this VM's 23 GB), one decode step (forward + logits over
the paged cache, the jnp reference attention, 121-token contexts) at 8 and 32 slots, bf16 dummy
weights, timed alternately in one process (median of --repeats):

    tiled       the engine's CPU path (`ModelImpl.moe_matmul='tiled'`): pairs sorted by expert,
                a loop over row tiles of the chosen experts only
    ragged_dot  the engine's GPU path: `jax.lax.ragged_dot` (on CPU: E times the active work)
    all-exp     the per-expert dense reference swapped in (every expert on every token)
    dense       a Llama-shaped model whose MLP has intermediate k * moe_intermediate_size: the
                same active parameters per token

    .venv/bin/python experiments/moe_decode_step.py [--layers 2] [--repeats 5] \
        [--models mixtral-8x7b qwen3-30b-a3b] [--skip_all_experts] [--json out.json]

Name the CPU beside every figure (NOTES.md): these VMs vary between sessions.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.bench.core import cpu_name
from jaxserve.config import ModelConfig
from jaxserve.layers import kv_cache as kvc
from jaxserve.layers import moe
from jaxserve.layers.attention import AttentionMetadata
from jaxserve.models import llama
from jaxserve.resolve import ModelImpl

PS, W, CTX = 16, 8, 120  # 120 tokens cached; the new one goes to page 7, offset 8


def shapes(num_layers: int) -> dict[str, ModelConfig]:
    mix = dataclasses.replace(ModelConfig.preset("mixtral-8x7b"), num_layers=num_layers)
    # Qwen3-30B-A3B's shapes (128 experts of 768, top-8, hidden 2048, 32/4 heads of 128); its
    # q/k norms cost nothing measurable here, so the Mixtral switch set carries the shapes.
    qwen = dataclasses.replace(
        mix,
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        name="qwen3-30b-a3b",
    )
    return {"mixtral-8x7b": mix, "qwen3-30b-a3b": qwen}


def dense_twin(c: ModelConfig) -> ModelConfig:
    return dataclasses.replace(
        c,
        architecture="llama",
        intermediate_size=c.num_experts_per_tok * c.moe_intermediate_size,
        num_experts=0,
        num_experts_per_tok=0,
        moe_intermediate_size=0,
        name=c.name + "-dense-twin",
    )


def init_leafwise(config: ModelConfig, dtype, seed: int) -> dict:
    """`llama.init_params`'s distribution, one jitted program per leaf: the one-program init
    (`loading.dummy`) needs ~5x the params' bytes of temporaries at these shapes (31.6 GB for
    2 Mixtral layers), more than this VM has."""
    shapes = llama.param_shapes(config)
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple)
    )
    keys = jax.random.split(jax.random.key(seed), len(flat))
    leaves = []
    for (path, shape), k in zip(flat, keys):
        if "norm" in jax.tree_util.keystr(path):
            leaves.append(jnp.ones(shape, dtype))
            continue
        f = jax.jit(lambda k, shape=shape: (0.02 * jax.random.normal(k, shape)).astype(dtype))
        leaves.append(jax.block_until_ready(f(k)))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def all_experts(x, router_logits, w_gate, w_up, w_down, k, norm_topk_prob, grouped=None):
    """`moe.moe_mlp_reference` (every expert on every token) in `moe_mlp`'s call signature."""
    return moe.moe_mlp_reference(x, router_logits, w_gate, w_up, w_down, k, norm_topk_prob)


def step_fn(config: ModelConfig, variant: str = "ragged_dot"):
    """variant: 'ragged_dot' | 'tiled' (the engine's GPU / CPU grouped paths, `ModelImpl`), or
    'all-exp' (the dense reference swapped in at trace time)."""
    impl = ModelImpl(moe_matmul="tiled" if variant == "tiled" else "ragged_dot")

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, cache, tokens, meta):
        if variant == "all-exp":  # swapped in at trace time only
            real, llama.moe_mlp = llama.moe_mlp, all_experts
        try:
            hidden, cache = llama.forward(params, tokens, meta, cache, config, impl)
        finally:
            if variant == "all-exp":
                llama.moe_mlp = real
        return llama.compute_logits(params, hidden[:, 0], config, impl), cache

    return step


def inputs(c: ModelConfig, slots: int, dtype):
    cache = kvc.init(c.num_layers, c.num_kv_heads, slots * W, PS, c.head_dim, "auto", dtype)
    pt = jnp.arange(slots * W, dtype=jnp.int32).reshape(slots, W)
    meta = AttentionMetadata(
        jnp.full((slots, 1), CTX, jnp.int32),
        pt[:, CTX // PS : CTX // PS + 1] * PS + CTX % PS,
        pt,
        jnp.full((slots,), CTX + 1, jnp.int32),
    )
    tokens = jax.random.randint(jax.random.key(slots), (slots, 1), 0, c.vocab_size)
    return cache, tokens, meta


def time_variants(variants, slots: int, repeats: int) -> dict[str, float]:
    state = {}
    for name, (c, params, f) in variants.items():
        cache, tokens, meta = inputs(c, slots, jnp.bfloat16)
        out, cache = f(params, cache, tokens, meta)  # compile
        jax.block_until_ready(out)
        state[name] = [cache, tokens, meta]
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, (_, params, f) in variants.items():
            cache, tokens, meta = state[name]
            t0 = time.perf_counter()
            out, cache = f(params, cache, tokens, meta)
            jax.block_until_ready(out)
            times[name].append(time.perf_counter() - t0)
            state[name][0] = cache
    return {name: float(np.median(t)) for name, t in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--slots", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--models", nargs="+", default=["mixtral-8x7b", "qwen3-30b-a3b"])
    ap.add_argument("--skip_all_experts", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    cpu = cpu_name()
    print(f"CPU: {cpu}, jax {jax.__version__}, bf16")
    results = []
    for cname, c in shapes(args.layers).items():
        if cname not in args.models:
            continue
        twin = dense_twin(c)
        moe_params = init_leafwise(c, jnp.bfloat16, 0)
        dense_params = init_leafwise(twin, jnp.bfloat16, 1)
        variants = {
            name: (c, moe_params, step_fn(c, name)) for name in ("tiled", "ragged_dot", "all-exp")
        }
        if args.skip_all_experts:
            del variants["all-exp"]
        variants["dense"] = (twin, dense_params, step_fn(twin))
        for slots in args.slots:
            t = time_variants(variants, slots, args.repeats)
            row = ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in t.items())
            ratio = t["tiled"] / t["dense"]
            print(f"{cname} L={c.num_layers} slots={slots}: {row} (tiled/dense {ratio:.2f}x)")
            results.append(
                {
                    "model": cname,
                    "layers": c.num_layers,
                    "slots": slots,
                    "ms": {k: round(1e3 * v, 1) for k, v in t.items()},
                }
            )
        del moe_params, dense_params, variants
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "jax": jax.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
