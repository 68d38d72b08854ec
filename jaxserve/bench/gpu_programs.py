"""The GPU program inspector: a GPU engine's warm-up programs, compiled for an H100 / H200 on this
machine (no GPU, no weights), each reported per step (`gpu_report`).

    engine = abstract_engine(engine_config, target)     the engine's choices, abstract arrays
    programs = warmup_programs(engine)                  what `ModelRunner.warmup` compiles
    reports = [inspect(engine, p) for p in programs]    compiled deviceless, read back

Command line (any preset or a checkpoint folder's config.json, any TP x DP, h100 / h200 / a
target config file): `python -m jaxserve.launch.gpu_programs --model=llama3-8b --num_slots=64
--programs=decode`; it prints one row per program (kernels per step and per layer, host
launches, launches outside CUDA graphs, host round trips, weight bytes copied, collectives,
compile seconds).

The engine is built from `build_engine`'s blueprint (`runner.blueprint.blueprint` with backend
'gpu', the chip's kernel table row and memory) and `ModelRunner`'s layout
(`device_state.kernel_layout`, `partition.param_specs` under a mesh, `device_state.state_fns` /
`state_specs`); but from `jax.eval_shape`, so an 8B or 70B model is never allocated. The
programs are `ModelRunner.warmup`'s: on one device group a decode step is `decode_forward` (one
per decode shape) then `decode_sample` (one per row bucket); a prefill step `prefill_forward` +
`prefill_sample` where there are page-table width buckets (`prefill` alone otherwise); the
data-parallel steps otherwise; the speculative steps when the engine speculates; and the slot
updates (insert, sync, move, set_grammar).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxserve.bench import deviceless, gpu_report
from jaxserve.bench.deviceless import GpuTarget

# Program kinds, the --programs choices.
KINDS = ("decode", "sample", "prefill", "speculative", "slots")


@dataclasses.dataclass(frozen=True)
class AbstractEngine:
    """A GPU engine's choices and abstract arrays (ShapeDtypeStructs on a compile-only mesh)."""

    engine_config: object  # EngineConfig, filled; TP / DP as the mesh has them
    model_config: object  # ModelConfig (KV heads replicated up to TP where TP exceeds them)
    resolved: object  # Resolved, backend 'gpu'
    mesh: object
    params: object
    cache: object
    state: object
    num_pages: int
    target: GpuTarget

    @property
    def data_shards(self) -> int:
        return self.engine_config.parallel.data_parallel_size

    @property
    def overlaps_grammar(self) -> bool:
        """Decode = forward, then sample: `ModelRunner.structured`'s decision."""
        from jaxserve.runner import structured_decoding

        return structured_decoding.overlaps(
            self.data_shards, self.engine_config.scheduler.decode_steps
        )

    @property
    def splits_prefill(self) -> bool:
        """Prefill = forward, then sample: `ModelRunner.prefill_strategy`'s decision."""
        from jaxserve.runner import prefill_strategy

        return prefill_strategy.splits(self.resolved, self.data_shards)


def model_config_for(engine_config):
    """The ModelConfig of engine_config.model: a preset name, a ModelConfig, or a Hugging Face
    folder (its config.json; no weights are read)."""
    import json
    from pathlib import Path

    from jaxserve.config import ModelConfig

    m = engine_config.load.model
    if isinstance(m, ModelConfig):
        return m
    path = Path(str(m))
    if path.is_dir() and (path / "config.json").is_file():
        return ModelConfig.from_hf(json.loads((path / "config.json").read_text()), path.name)
    return ModelConfig.preset(str(m))


def abstract_engine(engine_config, target: GpuTarget | str = "h100") -> AbstractEngine:
    """A GPU engine of `engine_config` (model: a preset, ModelConfig or HF folder; quantization,
    dtype, kv_cache_dtype, num_slots, max_model_len, TP, DP, ...) on compile-only GPUs."""
    target = deviceless.target(target) if isinstance(target, str) else target
    mesh = deviceless.gpu_mesh(
        target,
        engine_config.parallel.tensor_parallel_size,
        engine_config.parallel.data_parallel_size,
    )
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from jaxserve.layers import lora as lora_layers
    from jaxserve.models import llama
    from jaxserve.parallel import partition
    from jaxserve.quant import quantize_params
    from jaxserve.runner import device_state
    from jaxserve.runner.blueprint import blueprint

    loaded = model_config_for(engine_config)
    e = engine_config.for_model(loaded)
    t, d = e.parallel.tensor_parallel_size, e.parallel.data_parallel_size
    dtype = jnp.dtype(e.load.dtype if e.load.dtype != "auto" else "bfloat16")
    params = jax.eval_shape(lambda k: llama.init_params(loaded, k, dtype), jax.random.key(0))
    if e.load.quantization:
        params = jax.eval_shape(
            lambda w: quantize_params(w, loaded, e.load.quantization, row_shards=t), params
        )
    # the runner's blueprint, for this chip: build_engine's
    b = blueprint(
        params,
        loaded,
        e,
        backend="gpu",
        mesh=mesh,
        device_kind=target.device_kind,
        memory_bytes=target.memory_bytes,
    )
    c = b.model_config
    specs = {}

    def laid_out(params):  # the runner's layout; quantized column weights repacked for T
        params, specs["params"] = partition.param_specs(device_state.kernel_layout(params, b), c, t)
        return params

    params = jax.eval_shape(laid_out, params)
    specs = specs["params"]
    lora = e.lora
    if lora.enable_lora:  # every adapter slot's stacks, split as ModelRunner splits them
        stacks = jax.eval_shape(
            lambda: lora_layers.init(c, lora.max_loras, lora.max_lora_rank, dtype)
        )
        params = {**params, "lora": stacks}
        specs = {**specs, "lora": partition.lora_specs(stacks)}
    cache, state = map(jax.eval_shape, device_state.state_fns(b))  # ModelRunner's
    cache_specs, state_specs = device_state.state_specs(cache, state, d)

    def placed(tree, spec_tree):
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
            tree,
            spec_tree,
        )

    return AbstractEngine(
        engine_config=e,
        model_config=c,
        resolved=b.resolved,
        mesh=mesh,
        params=placed(params, specs),
        cache=placed(cache, cache_specs),
        state=placed(state, state_specs),
        num_pages=b.num_pages,
        target=target,
    )


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """One program of the engine: a step function, its abstract arguments and static keywords."""

    name: str  # e.g. "decode_forward rows=8 width=256"
    kind: str  # one of KINDS
    fn: Callable  # a step function (`runner.jit_step.Step`)
    args: tuple
    static: dict


def _spec(engine: AbstractEngine, shape, dtype, spec=None):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(engine.mesh, spec or P()))


def _batch(engine: AbstractEngine, rows: int, chunk: int, with_tokens: bool = True):
    """An abstract PrefillBatch of `rows` rows (split over 'data' under data parallelism)."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jaxserve.runner.input_batch import PrefillBatch

    spec = P("data") if engine.data_shards > 1 else P()
    i32 = lambda *s: _spec(engine, s, jnp.int32, spec)  # noqa: E731
    return PrefillBatch(
        tokens=i32(rows, chunk) if with_tokens else None,
        slots=i32(rows),
        start=i32(rows),
        length=i32(rows),
        is_last=_spec(engine, (rows,), jnp.bool_, spec),
        forced=i32(rows),
        targets=i32(rows, chunk) if with_tokens else None,
    )


def warmup_programs(engine: AbstractEngine, kinds=KINDS) -> list[StepProgram]:
    """Every program `ModelRunner.warmup` compiles for this engine, of the given kinds, in the
    warm-up's order."""
    import jax.numpy as jnp

    from jaxserve.runner import data_parallel, spec_decode, steps

    e, r, c = engine.engine_config, engine.resolved, engine.model_config
    p, cache, state = engine.params, engine.cache, engine.state
    common = dict(config=c, impl=r.model)
    flag = _spec(engine, (), jnp.bool_)
    out: list[StepProgram] = []
    d = engine.data_shards
    fns = data_parallel if d > 1 else steps
    decode = r.decode_shapes()
    if "decode" in kinds:
        for s in decode:
            name = f"rows={s.rows} width={s.width}"
            if engine.overlaps_grammar:
                args = (p, cache, state)
                out.append(
                    StepProgram(
                        f"decode_forward {name}",
                        "decode",
                        steps.decode_forward,
                        args,
                        {**common, "shape": s},
                    )
                )
            else:
                static = {**common, "shape": s, "num_steps": e.scheduler.decode_steps}
                out.append(
                    StepProgram(
                        f"generate {name}", "decode", fns.generate, (p, cache, state, flag), static
                    )
                )
    if "sample" in kinds and engine.overlaps_grammar:
        for rows in sorted({s.rows for s in decode}):
            logits = _spec(engine, (rows, c.vocab_size), jnp.float32)
            out.append(
                StepProgram(
                    f"decode_sample rows={rows}",
                    "sample",
                    steps.decode_sample,
                    (state, logits, flag),
                    {"num_top": r.num_top},
                )
            )
    if "speculative" in kinds and e.speculative.num_speculative_tokens:
        limit = _spec(engine, (e.scheduler.num_slots,), jnp.int32)
        for s, k in r.speculative_shapes(e.speculative):  # the runner's warm-up set
            static = {
                **common,
                "shape": s,
                "num_spec": k,
                "min_n": e.speculative.prompt_lookup_min,
                "max_n": e.speculative.prompt_lookup_max,
            }
            out.append(
                StepProgram(
                    f"speculate rows={s.rows} width={s.width} k={k}",
                    "speculative",
                    spec_decode.speculate,
                    (p, cache, state, limit),
                    static,
                )
            )
    if "prefill" in kinds:
        for s in r.prefill_shapes():
            name = f"rows={s.rows} chunk={s.chunk} width={s.width}" + (
                " prompt_logprobs" if s.prompt_logprobs else ""
            )
            batch = _batch(engine, s.rows * d, s.chunk)
            if engine.splits_prefill:
                out.append(
                    StepProgram(
                        f"prefill_forward {name}",
                        "prefill",
                        steps.prefill_forward,
                        (p, cache, state, batch),
                        {**common, "shape": s},
                    )
                )
            else:
                out.append(
                    StepProgram(
                        f"prefill {name}",
                        "prefill",
                        fns.prefill,
                        (p, cache, state, batch, flag),
                        {**common, "shape": s},
                    )
                )
        if engine.splits_prefill and "sample" in kinds:
            for rows in sorted({s.rows for s in r.prefill_shapes()}):
                batch = _batch(engine, rows, 1, with_tokens=False)
                logits = _spec(engine, (rows, c.vocab_size), jnp.float32)
                out.append(
                    StepProgram(
                        f"prefill_sample rows={rows}",
                        "sample",
                        steps.prefill_sample,
                        (state, batch, logits, flag),
                        {"num_top": r.num_top},
                    )
                )
    if "slots" in kinds:
        out += _slot_programs(engine)
    return out


def _slot_programs(engine: AbstractEngine) -> list[StepProgram]:
    import jax.numpy as jnp

    from jaxserve.runner import slot_state

    e, c, state = engine.engine_config, engine.model_config, engine.state
    s = e.scheduler.num_slots
    i32 = lambda *shape: _spec(engine, shape, jnp.int32)  # noqa: E731
    words = -(-c.vocab_size // 32)
    row = _slot_row(engine)
    return [
        StepProgram("insert", "slots", slot_state.insert, (state, i32(), row, i32(), i32()), {}),
        StepProgram(
            "sync",
            "slots",
            slot_state.sync,
            (state, i32(s, engine.resolved.max_pages), _spec(engine, (s,), jnp.bool_)),
            {},
        ),
        StepProgram("move", "slots", slot_state.move, (state, i32(s), i32(s)), {}),
        StepProgram(
            "set_grammar",
            "slots",
            slot_state.set_grammar,
            (state, i32(s, words), _spec(engine, (s,), jnp.bool_)),
            {},
        ),
    ]


def _slot_row(engine: AbstractEngine):
    """The abstract SlotRow `insert` takes (from a real one's shapes)."""
    import jax
    import numpy as np

    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.core.slot_row import make_slot_row

    e = engine.engine_config
    row = make_slot_row(SamplingParams(), [0], [], (), 0, e.scheduler.max_model_len)
    return jax.tree.map(lambda x: _spec(engine, np.shape(x), np.asarray(x).dtype), row)


def compile_program(engine: AbstractEngine, program: StepProgram, compiler_options=None):
    """-> deviceless.GpuProgram: the program compiled for the engine's GPUs with the engine's
    compiler options (`Resolved.compiler_options`) unless others are given."""
    options = compiler_options
    if options is None:
        options = dict(engine.resolved.compiler_options)
    # the function the engine's runner calls (`ModelRunner._jit`), its options recorded
    fn = program.fn.jit(tuple(sorted(options.items())))
    return deviceless.compile_for_gpu(
        program.name, fn, program.args, program.static, engine.mesh, options
    )


def inspect(engine: AbstractEngine, program: StepProgram, compiler_options=None):
    """-> gpu_report.ProgramReport of one program."""
    compiled = compile_program(engine, program, compiler_options)
    # the programs that run the model have its layer loop (a sampler's loops are other loops)
    model = program.kind in ("decode", "prefill", "speculative")
    return gpu_report.report(compiled, engine.model_config.num_layers if model else None)
