"""The data-parallel steps: `steps.generate` / `steps.prefill` once per data shard, in one SPMD
program (`jax.shard_map` over the mesh's 'data' axis; the 'model' axis stays automatic inside).

    generate(params, cache, state, want_top; shape)          DecodeOutput [k, D*B]
    prefill(params, cache, state, batch, want_top; shape)    PrefillOutput [D*R]
    state_specs(state) / cache_specs(cache)                  how they are split over 'data'

Shard d holds slots [d*S/D, (d+1)*S/D) of the slot state and pages [d*N/D, (d+1)*N/D) of the pool,
which its page tables number locally (0 .. N/D-1; the host's schedulers do, `core/data_parallel.py`),
so each shard's step reads only its own pages. A decode step runs the first B = shape.rows slots
OF EACH SHARD; a prefill batch is D blocks of R rows, block d holding shard d's chunks with local
slot numbers. Params are replicated over 'data'.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.resolve import DecodeShape, ModelImpl, PrefillShape
from jaxserve.runner import steps
from jaxserve.runner.jit_step import step

DATA = "data"


def state_specs(state):
    """Every slot-state leaf has the slot axis first: split it over 'data'."""
    return jax.tree.map(lambda _: P(DATA), state)


def cache_specs(cache):
    """The pool [L, KVH, N, ps, Dh] (and scales [L, KVH, N, ps]): pages split over 'data' (the
    'model' split of the KV heads is automatic inside the shard_map)."""
    return jax.tree.map(lambda _: P(None, None, DATA), cache)


def _shard_map(fn, in_specs, out_specs):
    return jax.shard_map(
        fn, in_specs=in_specs, out_specs=out_specs, axis_names={DATA}, check_vma=False
    )


@step(
    static_argnames=("config", "impl", "shape", "num_steps"),
    donate_argnames=("cache", "state"),
)
def generate(
    params,
    cache,
    state,
    want_top,
    *,
    config: ModelConfig,
    impl: ModelImpl,
    shape: DecodeShape,
    num_steps: int,
):
    def local(params, cache, state, want_top):
        return steps.generate(
            params,
            cache,
            state,
            want_top,
            config=config,
            impl=impl,
            shape=shape,
            num_steps=num_steps,
        )

    out_spec = steps.DecodeOutput(*([P(None, DATA)] * 6))  # [k, D*B, ...]
    return _shard_map(
        local,
        (P(), cache_specs(cache), state_specs(state), P()),
        (cache_specs(cache), state_specs(state), out_spec),
    )(params, cache, state, want_top)


@step(
    static_argnames=("config", "impl", "shape"),
    donate_argnames=("cache", "state"),
)
def prefill(
    params,
    cache,
    state,
    batch,
    want_top,
    *,
    config: ModelConfig,
    impl: ModelImpl,
    shape: PrefillShape,
):
    def local(params, cache, state, batch, want_top):
        return steps.prefill(
            params, cache, state, batch, want_top, config=config, impl=impl, shape=shape
        )

    rows = P(DATA)
    prompt = steps.PromptLogprobs(rows, rows, rows, rows) if shape.prompt_logprobs else None
    out_spec = steps.PrefillOutput(rows, rows, rows, rows, rows, prompt)
    return _shard_map(
        local,
        (P(), cache_specs(cache), state_specs(state), jax.tree.map(lambda _: rows, batch), P()),
        (cache_specs(cache), state_specs(state), out_spec),
    )(params, cache, state, batch, want_top)
