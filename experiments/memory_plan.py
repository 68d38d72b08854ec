"""The memory plan of issue 22: what one H200 holds per device under tensor parallelism, from
shapes only (nothing is allocated; a 70B model never exists as arrays here).

    python experiments/memory_plan.py [--models llama3-8b,llama3-70b] [--tp 1,2,4,8]
                                      [--seq_len 4096] [--hbm_gb 141] [--no_measure] [--out DIR]

For each model x weights (bf16; INT4 = RTN, group 128, the embedding table included) x TP:

1. Params per device. Abstract params (`jax.eval_shape` of `llama.init_params`, and of
   `quantize_params(.., "int4-rtn", 128)` for INT4) go through the engine's own partition rules,
   `partition.replicate_kv_heads` then `partition.param_specs(params, config, T)` (under
   `jax.eval_shape`, so INT4 column weights are repacked into T blocks as the runner does), and
   each leaf's bytes are those of its shard: a dim named 'model' in its spec is divided by T.
2. KV per token per device: `kv_cache.bytes_per_token` of the (replicated) KV heads / T; the pool
   [L, KVH, P, ps, Dh] is split over KV heads. (Llama 3 8B and 70B have 8 KV heads, so TP <= 8
   never replicates them.) One sequence of `--seq_len` tokens takes seq_len / page_size pages.
3. Slot state per sequence: `runner.memory.state_bytes` (i32 token counts and three bool masks over the
   vocabulary, the page table, the fixed-size logit_bias / bad_words arrays), replicated over
   'model': every device holds every slot of its data shard.
4. Workspace per device: XLA's temporary bytes (`memory_analysis().temp_size_in_bytes`) of the
   engine's TP-1 bf16 decode step at 256 and at 512 slots (256-page tables: 4k tokens) and of its
   default prefill step (8 chunks of 64 tokens), compiled for the CPU from abstract arguments with
   the Pallas kernels in interpret mode (they read the pool in place, as on the GPU). The decode
   figure is fitted as fixed + per-slot bytes (the [slots, vocab] logits and sampling temporaries
   grow with the slots); the reserve is max(decode fixed part, prefill) plus a fixed
   `--fixed_reserve_gib` (default 4 GiB) for the CUDA context, cuBLAS / Triton workspaces and
   allocator fragmentation, and each sequence is charged the per-slot part. It is a proxy for the
   GPU's workspace (XLA:GPU fuses differently), taken at TP 1: the model axis only shrinks the
   activations, and sampling sees gathered [slots, vocab] logits at any T. `--no_measure` skips the
   compiles and reserves the fixed part only.
5. The most concurrent sequences: floor((HBM - params - reserve) / (KV per sequence + slot state
   per sequence + decode workspace per slot)) per device; 0 where the params alone do not fit.

Prints a markdown table and writes DIR/memory_plan.md and DIR/memory_plan.json (DIR defaults to
experiments/out/memory_plan).

HBM: an H200 has 141 GB (141e9 bytes). JAX's GPU allocator preallocates 75% of it by default;
an engine sized by this plan needs XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 or so.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.layers import kv_cache
from jaxserve.models import llama
from jaxserve.parallel import partition
from jaxserve.quant import quantize_params
from jaxserve.resolve import DecodeShape, ModelImpl, PrefillShape
from jaxserve.runner import memory, steps
from jaxserve.runner.input_batch import PrefillBatch

GB = 1e9
GIB = 2**30
WEIGHTS = {"bf16": None, "int4": ("int4-rtn", 128)}


def abstract_params(config: ModelConfig, weights: str) -> dict:
    """ShapeDtypeStruct params of `config` in bf16, or quantized as `WEIGHTS[weights]`."""
    params = jax.eval_shape(
        functools.partial(llama.init_params, config, dtype=jnp.bfloat16), jax.random.key(0)
    )
    if WEIGHTS[weights] is not None:
        method, group = WEIGHTS[weights]
        params = jax.eval_shape(lambda p: quantize_params(p, config, method, group), params)
    return params


def abstract_partition(params: dict, config: ModelConfig, t: int):
    """(params, specs, config) after the engine's rules at TP t, from abstract params: KV heads
    replicated up to t where t exceeds them, INT4 column weights repacked into t blocks (both
    traced by `jax.eval_shape`, so nothing is computed)."""
    out = {}

    def rules(p):
        p, c = partition.replicate_kv_heads(p, config, t)
        p, out["specs"] = partition.param_specs(p, c, t)
        out["config"] = c
        return p

    params = jax.eval_shape(rules, params)
    return params, out["specs"], out["config"]


def shard_bytes(leaf, spec: P, sizes: dict[str, int]) -> int:
    """Bytes of one device's shard of `leaf` under `spec` (mesh axis sizes `sizes`)."""
    shape = list(leaf.shape)
    for i, entry in enumerate(tuple(spec)):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        for name in names:
            if shape[i] % sizes[name]:
                raise ValueError(f"dim {i} of {leaf.shape} does not split over {name}")
            shape[i] //= sizes[name]
    return int(np.prod(shape)) * jnp.dtype(leaf.dtype).itemsize


def params_bytes_per_device(params, specs, t: int) -> tuple[int, int]:
    """(bytes on one device, bytes of the whole model) of placed params."""
    leaves = jax.tree.leaves(params)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    assert len(leaves) == len(spec_leaves), (len(leaves), len(spec_leaves))
    local = sum(shard_bytes(x, s, {"model": t, "data": 1}) for x, s in zip(leaves, spec_leaves))
    total = sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in leaves)
    return local, total


def _decode_temp(config, params, slots: int, max_pages: int, impl) -> int:
    cache = _abstract_cache(config, slots * max_pages // 4)
    state = jax.eval_shape(lambda: steps.init_slot_state(slots, max_pages, config.vocab_size))
    return (
        steps.generate.trace(
            params,
            cache,
            state,
            np.bool_(False),
            config=config,
            impl=impl,
            shape=DecodeShape(slots, max_pages, 0),
            num_steps=1,
        )
        .lower()
        .compile()
        .memory_analysis()
        .temp_size_in_bytes
    )


def _abstract_cache(config: ModelConfig, num_pages: int, page_size: int = 16):
    return jax.eval_shape(
        lambda: kv_cache.init(
            config.num_layers,
            config.num_kv_heads,
            num_pages,
            page_size,
            config.head_dim,
            "auto",
            jnp.bfloat16,
        )
    )


def measure_workspace(config: ModelConfig, slots=(256, 512), max_pages: int = 256) -> dict:
    """XLA temp bytes of the TP-1 bf16 decode step at two slot counts (fitted as fixed + per
    slot) and of the default prefill step (8 x 64 tokens), compiled for the CPU from abstract
    arguments (Pallas kernels interpreted)."""
    params = abstract_params(config, "bf16")
    impl = ModelImpl(attention="pallas_interpret")
    t0 = time.perf_counter()
    (s0, s1) = slots
    d0, d1 = (_decode_temp(config, params, s, max_pages, impl) for s in slots)
    per_slot = max(0, (d1 - d0) // (s1 - s0))
    rows, chunk = 8, 64
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    batch = PrefillBatch(
        tokens=i32(rows, chunk),
        slots=i32(rows),
        start=i32(rows),
        length=i32(rows),
        is_last=jax.ShapeDtypeStruct((rows,), jnp.bool_),
        forced=i32(rows),
        targets=i32(rows, chunk),
    )
    state = jax.eval_shape(lambda: steps.init_slot_state(s1, max_pages, config.vocab_size))
    prefill = (
        steps.prefill.trace(
            params,
            _abstract_cache(config, s1 * max_pages // 4),
            state,
            batch,
            np.bool_(False),
            config=config,
            impl=impl,
            shape=PrefillShape(rows, chunk, max_pages, False),
        )
        .lower()
        .compile()
        .memory_analysis()
    )
    return {
        "decode_temp_bytes": {s0: int(d0), s1: int(d1)},
        "decode_temp_fixed_bytes": int(d1 - per_slot * s1),
        "decode_temp_bytes_per_slot": int(per_slot),
        "prefill_tokens": rows * chunk,
        "prefill_temp_bytes": int(prefill.temp_size_in_bytes),
        "compile_s": round(time.perf_counter() - t0, 1),
    }


def plan_row(
    preset: str,
    weights: str,
    t: int,
    seq_len: int,
    hbm: float,
    reserve: int,
    workspace_per_slot: int = 0,
    page_size: int = 16,
) -> dict:
    config = ModelConfig.preset(preset)
    params, specs, tp_config = abstract_partition(abstract_params(config, weights), config, t)
    local, total = params_bytes_per_device(params, specs, t)
    c = tp_config
    kv_token = kv_cache.bytes_per_token(
        c.num_layers, c.num_kv_heads, c.head_dim, "auto", "bfloat16"
    )
    kv_token_dev = kv_token // t  # the pool is split over its (replicated) KV heads
    pages = math.ceil(seq_len / page_size)
    engine = EngineConfig(num_slots=1, max_model_len=seq_len, page_size=page_size).for_model(config)
    slot = memory.state_bytes(c, engine, 0)["slot_state"]  # one slot, replicated over 'model'
    per_seq = pages * page_size * kv_token_dev + slot + workspace_per_slot
    free = hbm - local - reserve
    return {
        "model": preset,
        "weights": weights,
        "tp": t,
        "kv_heads_after_replication": c.num_kv_heads,
        "params_total_bytes": total,
        "params_bytes_per_device": local,
        "kv_bytes_per_token_per_device": kv_token_dev,
        "kv_bytes_per_seq_per_device": pages * page_size * kv_token_dev,
        "slot_state_bytes_per_seq": slot,
        "workspace_bytes_per_seq": workspace_per_slot,
        "reserve_bytes": reserve,
        "free_for_kv_bytes": max(0, int(free)),
        "max_seqs": max(0, int(free // per_seq)),
        "fits": free > 0,
    }


def markdown(rows: list[dict], seq_len: int, hbm: float) -> str:
    head = (
        f"| model | weights | TP | params / device (GB) | KV / token / device (KiB) | "
        f"KV / {seq_len}-token seq / device (MB) | slot state + workspace / seq (MB) | "
        f"reserve (GB) | free for KV (GB) | max concurrent {seq_len}-token seqs |\n"
        f"|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        seqs = f"**{r['max_seqs']}**" if r["fits"] else "does not fit"
        lines.append(
            f"| {r['model']} | {r['weights']} | {r['tp']} | {r['params_bytes_per_device'] / GB:.2f} | "
            f"{r['kv_bytes_per_token_per_device'] / 1024:.0f} | "
            f"{r['kv_bytes_per_seq_per_device'] / 1e6:.0f} | "
            f"{(r['slot_state_bytes_per_seq'] + r['workspace_bytes_per_seq']) / 1e6:.1f} | "
            f"{r['reserve_bytes'] / GB:.2f} | "
            f"{r['free_for_kv_bytes'] / GB:.1f} | {seqs} |"
        )
    return head + "\n".join(lines) + f"\n\n(H200: {hbm / GB:.0f} GB per device.)\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama3-8b,llama3-70b", help="comma-separated presets")
    parser.add_argument("--tp", default="1,2,4,8", help="comma-separated tensor-parallel sizes")
    parser.add_argument("--seq_len", type=int, default=4096, help="tokens per sequence (KV)")
    parser.add_argument("--hbm_gb", type=float, default=141.0, help="device memory, 1e9 bytes")
    parser.add_argument(
        "--fixed_reserve_gib",
        type=float,
        default=4.0,
        help="CUDA context, cuBLAS/Triton workspace, fragmentation (GiB per device)",
    )
    parser.add_argument(
        "--no_measure",
        action="store_true",
        help="skip compiling the CPU steps for XLA's temp bytes; reserve the fixed part only",
    )
    parser.add_argument("--out", default="experiments/out/memory_plan", help="output folder")
    args = parser.parse_args()
    hbm = args.hbm_gb * GB
    models = args.models.split(",")
    tps = [int(x) for x in args.tp.split(",")]
    fixed = int(args.fixed_reserve_gib * GIB)
    workspace = {}
    for preset in models:
        if not args.no_measure:
            workspace[preset] = measure_workspace(ModelConfig.preset(preset))
            print(f"{preset}: XLA temp bytes (CPU compile, TP 1 bf16): {workspace[preset]}")
    rows = []
    for preset in models:
        ws = workspace.get(preset)
        temp = 0 if ws is None else max(ws["decode_temp_fixed_bytes"], ws["prefill_temp_bytes"])
        per_slot = 0 if ws is None else ws["decode_temp_bytes_per_slot"]
        for weights in WEIGHTS:
            for t in tps:
                rows.append(plan_row(preset, weights, t, args.seq_len, hbm, fixed + temp, per_slot))
    table = markdown(rows, args.seq_len, hbm)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory_plan.md").write_text(table)
    result = {
        "hbm_bytes": hbm,
        "seq_len": args.seq_len,
        "fixed_reserve_bytes": fixed,
        "workspace": workspace,
        "rows": rows,
    }
    (out / "memory_plan.json").write_text(json.dumps(result, indent=1))
    by = {(r["model"], r["weights"], r["tp"]): r for r in rows}
    for key, what in [
        (("llama3-70b", "int4", 1), "70B INT4 fits one H200"),
        (("llama3-70b", "bf16", 2), "70B bf16 fits TP 2"),
    ]:
        if key in by:
            print(
                f"{what}: {'yes' if by[key]['max_seqs'] > 0 else 'NO'} "
                f"({by[key]['max_seqs']} sequences of {args.seq_len} tokens)"
            )


if __name__ == "__main__":
    main()
