"""Time one SmolLM2-shaped decode step (forward + logits, no sampling) with and without attention.

Random bf16/f32 weights at the smollm2-135m preset, 32 slots, 128-token contexts in 8 pages of 16,
the jnp reference attention. Both variants are timed alternately in one process (median of 5).

    .venv/bin/python experiments/decode_step_profile.py            # both cores
    taskset -c 0 .venv/bin/python experiments/decode_step_profile.py   # one core
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.layers import kv_cache as kvc
from jaxserve.layers.attention import AttentionMetadata
from jaxserve.models import llama

S, PS, W = 32, 16, 8


def step_fn(config, with_attention: bool):
    def no_attention(q, cache, layer, meta, impl):
        return q

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, cache, tokens, meta):
        if not with_attention:  # swapped in at trace time only
            real, llama.attention = llama.attention, no_attention
        try:
            hidden, cache = llama.forward(params, tokens, meta, cache, config)
        finally:
            if not with_attention:
                llama.attention = real
        return llama.compute_logits(params, hidden[:, 0], config), cache

    return step


def main():
    c = ModelConfig.preset("smollm2-135m")
    for name in ("bfloat16", "float32"):
        dt = jnp.dtype(name)
        params = jax.jit(lambda k, dt=dt: llama.init_params(c, k, dt))(jax.random.key(0))
        cache = kvc.init(c.num_layers, c.num_kv_heads, 1024, PS, c.head_dim, "auto", dt)
        pt = jnp.arange(S * W, dtype=jnp.int32).reshape(S, W)
        meta = AttentionMetadata(
            jnp.full((S, 1), 100, jnp.int32),
            pt[:, 6:7] * PS + 4,
            pt,
            jnp.full((S,), 101, jnp.int32),
        )
        tokens = jnp.zeros((S, 1), jnp.int32)
        fns = {"full": step_fn(c, True), "no-attention": step_fn(c, False)}
        times = {k: [] for k in fns}
        for f in fns.values():  # compile
            out, cache = f(params, cache, tokens, meta)
            jax.block_until_ready(out)
        for _ in range(5):
            for k, f in fns.items():
                t = time.perf_counter()
                out, cache = f(params, cache, tokens, meta)
                jax.block_until_ready(out)
                times[k].append(time.perf_counter() - t)
        print(name, {k: f"{np.median(v) * 1e3:.1f} ms" for k, v in times.items()})


if __name__ == "__main__":
    main()
