"""The sharded engine steps lower for CUDA on an abstract mesh of 8 H200s (no GPU needed).

Issue 22: the decode and prefill steps of Llama-3-70B (bf16 and INT4 RTN g128) at TP 8 and of
Llama-3-8B at TP 2 x DP 4 (`runner/data_parallel.py`: a shard_map over 'data' around the steps)
lower with `lowering_platforms=("cuda",)`, the Pallas kernels inside `jax.shard_map` over 'model'.

Params are abstract (`jax.eval_shape`: a 70B model is never allocated) and go through the
engine's own rules (`partition.replicate_kv_heads`, `partition.param_specs`, the pool's and slot
state's specs), as `ShapeDtypeStruct`s carrying `NamedSharding`s on an `AbstractMesh` of shape
(D, T), axes ('data', 'model'), both Auto (as `parallel.mesh.make_mesh` builds them), whose
device is an abstract "NVIDIA H200". The model's choices are a GPU engine's (`resolve` with
backend "gpu": Pallas attention, the fused INT4 kernel).

What the lowered text must hold:
- the Triton calls (paged decode / prefill attention, INT4 matmul) with PER-DEVICE operand
  shapes: the pool's KV heads / T and pages / D, each INT4 weight's column or row shard;
- the shard_maps: manual over 'model' around the kernels (and over 'data' for DP);
- the collectives the program states: the all-reduces of the INT4 row-parallel matmuls (wo,
  w_down) and of the vocab-parallel INT4 embedding lookup (psums inside their shard_maps).
  The collectives of the plain (bf16) weights are GSPMD's: XLA's partitioner inserts them when
  it compiles, which needs the CUDA backend, so the lowered text has none; it must carry the
  input shardings that make them (column, row and vocab splits over 'model', the pool over KV
  heads and pages), which is what is checked for bf16. The partitioner is the same pass on every
  backend, so the last test compiles the same 70B TP-8 decode step for 8 host CPU devices (jnp
  reference attention in place of the Triton kernel; a subprocess running this file) and finds
  them there: per layer the all-reduces after wo and w_down, and the logits' all-gather.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.layers import kv_cache
from jaxserve.models import llama
from jaxserve.parallel import partition
from jaxserve.quant import quantize_params, with_matmul_impl
from jaxserve.resolve import DecodeShape, PrefillShape, resolve
from jaxserve.runner import data_parallel, slot_state, steps
from jaxserve.runner.input_batch import PrefillBatch

# 16 slots per shard: INT4 decode runs the fused kernel (up to int4.PALLAS_MAX_ROWS rows);
# the prefill's 8 x 64 rows take XLA's unpack + dot
SLOTS_PER_SHARD, MAX_PAGES, PAGES_PER_SHARD, PAGE_SIZE, CHUNK, ROWS = 16, 16, 512, 16, 64, 8
_TINY = ModelConfig.preset("tiny")
GPU = resolve(
    EngineConfig(num_slots=SLOTS_PER_SHARD, max_model_len=256, page_size=PAGE_SIZE).for_model(
        _TINY
    ),
    _TINY,
    "gpu",
)


def h200_mesh(d: int, t: int) -> jax.sharding.AbstractMesh:
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    auto = (AxisType.Auto, AxisType.Auto)
    return jax.sharding.AbstractMesh((d, t), ("data", "model"), auto, abstract_device=dev)


def placed(tree, specs, mesh):
    """ShapeDtypeStructs of `tree` carrying NamedShardings of `specs` on `mesh`."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
        tree,
        specs,
        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct),
    )


def abstract_engine(model: str, quantization: str | None, d: int, t: int):
    """(config after KV replication, params, cache, state, mesh): abstract and placed."""
    c = ModelConfig.preset(model)
    params = jax.eval_shape(lambda k: llama.init_params(c, k, jnp.bfloat16), jax.random.key(0))
    if quantization:
        params = jax.eval_shape(lambda p: quantize_params(p, c, quantization, 128), params)
    params = with_matmul_impl(params, GPU.quant_matmul)
    out = {}

    def rules(p):  # traced: INT4 column weights are repacked into T blocks abstractly
        p, out["config"] = partition.replicate_kv_heads(p, c, t)
        p, out["specs"] = partition.param_specs(p, out["config"], t)
        return p

    params = jax.eval_shape(rules, params)
    c, mesh = out["config"], h200_mesh(d, t)
    params = placed(params, out["specs"], mesh)
    cache = jax.eval_shape(
        lambda: kv_cache.init(
            c.num_layers,
            c.num_kv_heads,
            d * PAGES_PER_SHARD,
            PAGE_SIZE,
            c.head_dim,
            "auto",
            jnp.bfloat16,
        )
    )
    state = jax.eval_shape(
        lambda: slot_state.init_slot_state(d * SLOTS_PER_SHARD, MAX_PAGES, c.vocab_size)
    )
    # The runner's placement: pool over KV heads (and pages over 'data'); slots over 'data'.
    cache = placed(cache, partition.cache_specs(cache, data_axis=d > 1), mesh)
    slot_specs = data_parallel.state_specs(state) if d > 1 else partition.replicated(state)
    return c, params, cache, placed(state, slot_specs, mesh), mesh


def abstract_batch(rows: int, mesh, d: int) -> PrefillBatch:
    sharding = NamedSharding(mesh, P("data") if d > 1 else P())
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32, sharding=sharding)  # noqa: E731
    return PrefillBatch(
        tokens=i32(rows, CHUNK),
        slots=i32(rows),
        start=i32(rows),
        length=i32(rows),
        is_last=jax.ShapeDtypeStruct((rows,), jnp.bool_, sharding=sharding),
        forced=i32(rows),
        targets=i32(rows, CHUNK),
    )


def lower_steps(model, quantization, d, t) -> tuple[ModelConfig, dict[str, str]]:
    """The decode and prefill steps' StableHLO text, lowered for CUDA under the abstract mesh."""
    c, params, cache, state, mesh = abstract_engine(model, quantization, d, t)
    fns = data_parallel if d > 1 else steps
    flag = jax.ShapeDtypeStruct((), jnp.bool_, sharding=NamedSharding(mesh, P()))
    static = dict(config=c, impl=GPU.model)
    with jax.sharding.use_abstract_mesh(mesh):
        decode = fns.generate.trace(
            params,
            cache,
            state,
            flag,
            shape=DecodeShape(SLOTS_PER_SHARD, MAX_PAGES, 0),
            num_steps=1,
            **static,
        )
        prefill = fns.prefill.trace(
            params,
            cache,
            state,
            abstract_batch(d * ROWS, mesh, d),
            flag,
            shape=PrefillShape(ROWS, CHUNK, MAX_PAGES, False),
            **static,
        )
        texts = {
            name: traced.lower(lowering_platforms=("cuda",)).as_text()
            for name, traced in (("decode", decode), ("prefill", prefill))
        }
    return c, texts


def triton_calls(text: str) -> list[tuple[str, list[str]]]:
    """(kernel kind, operand tensor types) of every Triton custom call in a lowered module."""
    calls = []
    for line in text.splitlines():
        if "__gpu$xla.gpu.triton" not in line:
            continue
        kind = re.search(r'name = "(paged_decode|paged_prefill|int4_matmul)_', line).group(1)
        operands = re.search(r"\}\s*:\s*\((.*)\)\s*->", line).group(1)
        calls.append((kind, re.findall(r"tensor<([^>]*)>", operands)))
    return calls


def int4_kn(operands: list[str]) -> tuple[int, int]:
    """(K, N) of one device's INT4 kernel call: operands (layer, x [M, K], codes [L*K, N/8], ..)."""
    k = int(operands[1].split("x")[-2])
    n8 = int(operands[2].split("x")[-2])
    return k, 8 * n8


def arg_specs(text: str) -> dict[str, set[str]]:
    """The main function's inputs: tensor type -> the sdy shardings its arguments carry."""
    main = next(x for x in text.splitlines() if "func.func public @main" in x)
    out: dict[str, set[str]] = {}
    for ty, spec in re.findall(
        r"%arg\d+: tensor<([^>]*)> \{[^%]*?sdy\.sharding<@mesh, (\[[^\]]*\])>", main
    ):
        out.setdefault(ty, set()).add(spec)
    return out


CASES = [
    ("llama3-70b", None, 1, 8),
    ("llama3-70b", "int4-rtn", 1, 8),
    ("llama3-8b", None, 4, 2),
    ("llama3-8b", "int4-rtn", 4, 2),
]


@pytest.mark.parametrize("model,quantization,d,t", CASES)
def test_sharded_steps_lower_for_cuda_on_8_h200s(model, quantization, d, t):
    c, texts = lower_steps(model, quantization, d, t)
    L, D, I, V, dh = (
        c.num_layers,
        c.hidden_size,
        c.intermediate_size,
        c.vocab_size,
        c.head_dim,
    )
    qd, kd = c.num_heads * dh, c.num_kv_heads * dh
    assert c.num_kv_heads == 8  # Llama 3: 8 KV heads, so neither T replicates them
    # One device's pool, as the attention kernel sees it: [L * KVH/T * pages/D, ps, Dh].
    local_pool = f"{L * (c.num_kv_heads // t) * PAGES_PER_SHARD}x{PAGE_SIZE}x{dh}xbf16"
    for step, text in texts.items():
        calls = triton_calls(text)
        attention = [ops for kind, ops in calls if kind.startswith("paged_")]
        fused = quantization and step == "decode"  # <= 16 rows: the fused INT4 kernel
        assert {kind for kind, _ in calls} - {"int4_matmul"} == {f"paged_{step}"}, step
        if quantization and not fused:  # the prefill's lm_head on its 8 last tokens, alone
            shards = {int4_kn(ops) for kind, ops in calls if kind == "int4_matmul"}
            assert shards == {(D, V // t)}, (step, shards)
        assert attention and all(local_pool in ops for ops in attention), (step, attention)
        # The kernels sit inside shard_map: manual over 'model' (and 'data' for DP).
        assert 'manual_axes={"model"}' in text, step
        assert ('manual_axes={"data"}' in text) == (d > 1), step
        specs = arg_specs(text)
        pool = f"{L}x{c.num_kv_heads}x{d * PAGES_PER_SHARD}x{PAGE_SIZE}x{dh}xbf16"
        assert specs[pool] == {'[{}, {"model"}, {%s}, {}, {}]' % ('"data"' if d > 1 else "")}
        if fused:
            # Each INT4 weight's kernel gets one device's shard: columns N/T (wq, wk, wv, gate,
            # up, lm_head) or rows K/T (wo, w_down); the row shards' partial sums and the
            # vocab-parallel embedding lookup each end in an all-reduce over 'model'.
            shards = {int4_kn(ops) for kind, ops in calls if kind == "int4_matmul"}
            assert shards == {
                (D, qd // t),
                (D, kd // t),
                (D, I // t),
                (qd // t, D),
                (I // t, D),
                (D, V // t),
            }, (step, shards)
            assert text.count("stablehlo.all_reduce") >= 3, step
        elif not quantization:
            # The GSPMD splits the partitioner turns into collectives at compile time.
            assert '[{}, {}, {"model"}]' in specs[f"{L}x{D}x{qd}xbf16"]  # wq: column
            assert '[{}, {}, {"model"}]' in specs[f"{L}x{D}x{kd}xbf16"]  # wk / wv: column
            assert '[{}, {"model"}, {}]' in specs[f"{L}x{qd}x{D}xbf16"]  # wo: row
            assert specs[f"{L}x{D}x{I}xbf16"] == {'[{}, {}, {"model"}]'}  # gate / up: column
            assert specs[f"{L}x{I}x{D}xbf16"] == {'[{}, {"model"}, {}]'}  # w_down: row
            assert specs[f"{V}x{D}xbf16"] == {'[{"model"}, {}]'}  # embed: vocab
            assert specs[f"{D}x{V}xbf16"] == {'[{}, {"model"}]'}  # lm_head: vocab columns


def test_70b_kernels_see_eight_query_heads_and_one_kv_head_per_device():
    """At TP 8 each H200 attends 64/8 = 8 query heads over its 1 KV head of the pool (80 layers x
    1 head x all pages): the prefill kernel's q is [R, KVH/T, (H/KVH) * chunk, Dh]; the decode
    kernel's [B, KVH/T, group padded to 16, Dh]."""
    c, texts = lower_steps("llama3-70b", None, 1, 8)
    (decode,) = [ops for kind, ops in triton_calls(texts["decode"]) if kind == "paged_decode"]
    (prefill,) = [ops for kind, ops in triton_calls(texts["prefill"]) if kind == "paged_prefill"]
    pool = f"{80 * 1 * PAGES_PER_SHARD}x{PAGE_SIZE}x128xbf16"
    assert decode.count(pool) == 2 and prefill.count(pool) == 2, (decode, prefill)
    assert f"{ROWS}x1x{8 * CHUNK}x128xbf16" in prefill, prefill
    assert f"{SLOTS_PER_SHARD}x1x16x128xbf16" in decode, decode


def _compiled_collectives() -> dict:
    """(Run with 8 host CPU devices.) The 70B bf16 TP-8 decode step compiled for the CPU: the
    shapes of its all-reduces and all-gathers."""
    from jaxserve.parallel.mesh import make_mesh
    from jaxserve.resolve import ModelImpl

    c, params, cache, state, abstract_mesh = abstract_engine("llama3-70b", None, 1, 8)
    mesh = make_mesh(8, 1)

    def on(tree):  # the same specs on the 8 real CPU devices
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(
                a.shape, a.dtype, sharding=NamedSharding(mesh, a.sharding.spec)
            ),
            tree,
        )

    with jax.set_mesh(mesh):
        compiled = (
            steps.generate.trace(
                on(params),
                on(cache),
                on(state),
                jax.ShapeDtypeStruct((), jnp.bool_),
                config=c,
                impl=ModelImpl(attention="reference"),
                shape=DecodeShape(SLOTS_PER_SHARD, MAX_PAGES, 0),
                num_steps=1,
            )
            .lower()
            .compile()
        )
    found = {"all-reduce": [], "all-gather": []}
    for line in compiled.as_text().splitlines():
        m = re.search(r"= (\w+\[[\d,]*\])\S* (all-reduce|all-gather)(-start)?\(", line)
        if m:
            found[m.group(2)].append(m.group(1))
    return found


def test_gspmd_inserts_the_collectives_of_the_plain_weights():
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, __file__],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    b, d, v = SLOTS_PER_SHARD, 8192, 128256
    # wo and w_down (row-parallel) each end in an all-reduce of the [B, D] activations, in the
    # layer scan's body (once in the program text); the embedding lookup in one of [B, 1, D].
    assert sum(s.endswith(f"[{b},{d}]") for s in found["all-reduce"]) >= 2, found
    assert any(s.endswith(f"[{b},1,{d}]") for s in found["all-reduce"]), found
    # The vocab-split logits are gathered for sampling.
    assert any(s == f"f32[{b},{v}]" for s in found["all-gather"]), found


if __name__ == "__main__":
    print(json.dumps(_compiled_collectives()))


def test_mixtral_experts_split_over_8_h200s():
    """Expert parallelism (layers/moe.py): at TP 8 each H200 holds one of Mixtral's 8 experts,
    and its grouped matmuls (`ragged_dot`, inside the shard_map over 'model') multiply that one
    expert's [1, D, I] stacks; the partial outputs meet in an all-reduce."""
    c, texts = lower_steps("mixtral-8x7b", None, 1, 8)
    d, i = c.hidden_size, c.moe_intermediate_size or c.intermediate_size
    for step, text in texts.items():
        rhs = [
            re.findall(r"tensor<([^>]*)>", line)[1]
            for line in text.splitlines()
            if "ragged_dot" in line and "tensor<" in line
        ]
        assert set(rhs) == {f"1x{d}x{i}xbf16", f"1x{i}x{d}xbf16"}, (step, rhs)
        assert 'manual_axes={"model"}' in text and "all_reduce" in text, step
