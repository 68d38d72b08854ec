"""The engine's jitted steps, as a GPU engine builds them, lower for CUDA (no GPU needed).

`python -m pallas_kernels.check` lowers each kernel on its own; this lowers the whole step
functions (`runner.steps.generate`, `prefill`) with the Pallas attention and, for INT4
params, the fused dequantize-matmul, at SmolLM2 and Llama-3-8B shapes and the engine's bucket
shapes. It catches
what only shows when the kernels sit inside the model: block shapes the engine's buckets produce,
the GQA group of 3, the 576-wide hidden size, dtypes across kernel boundaries.

The shapes are abstract (`jax.eval_shape`); the device is an abstract "NVIDIA H200"
(`pallas_kernels.check.h200_mesh`). The GPU engine's choices come from `jaxserve.resolve` with
backend "gpu", exactly as a GPU engine makes them: nothing reads the backend while tracing, so
nothing needs patching here.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.layers import kv_cache
from jaxserve.models import llama
from jaxserve.quant import quantize_params, with_matmul_impl
from jaxserve.resolve import DecodeShape, PrefillShape, resolve
from jaxserve.runner import runner as runner_lib
from jaxserve.runner import slot_state, steps
from jaxserve.runner.blueprint import blueprint
from jaxserve.runner.input_batch import PrefillBatch
from pallas_kernels.check import h200_mesh

NUM_SLOTS, MAX_PAGES, NUM_PAGES, PAGE_SIZE, CHUNK = 32, 16, 512, 16, 64
# A GPU engine's choices (the step shapes below are given explicitly).
_TINY = ModelConfig.preset("tiny")
GPU = resolve(
    EngineConfig(num_slots=NUM_SLOTS, max_model_len=256, page_size=PAGE_SIZE).for_model(_TINY),
    _TINY,
    "gpu",
)


def abstract_model(model: str, quantization: str | None):
    c = ModelConfig.preset(model)
    params = jax.eval_shape(lambda k: llama.init_params(c, k, jnp.bfloat16), jax.random.key(0))
    if quantization:
        params = jax.eval_shape(lambda p: quantize_params(p, c, quantization, 64), params)
    return c, with_matmul_impl(params, GPU.quant_matmul)


def abstract_cache(c: ModelConfig, kv_cache_dtype: str):
    return jax.eval_shape(
        lambda: kv_cache.init(
            c.num_layers,
            c.num_kv_heads,
            NUM_PAGES,
            PAGE_SIZE,
            c.head_dim,
            kv_cache_dtype,
            jnp.bfloat16,
        )
    )


def abstract_batch(rows: int) -> PrefillBatch:
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    return PrefillBatch(
        tokens=i32(rows, CHUNK),
        slots=i32(rows),
        start=i32(rows),
        length=i32(rows),
        is_last=jax.ShapeDtypeStruct((rows,), jnp.bool_),
        forced=i32(rows),
        targets=i32(rows, CHUNK),
    )


def lower(fn, *args, **static) -> str:
    with jax.sharding.use_abstract_mesh(h200_mesh()):
        text = fn.trace(*args, **static).lower(lowering_platforms=("cuda",)).as_text()
    return text


def kernels(text: str) -> set[str]:
    """The Pallas kernels (Triton calls) in a lowered module, by kind."""
    names = set(re.findall(r'name = "(paged_decode|paged_prefill|int4_matmul)_', text))
    assert "__gpu$xla.gpu.triton" in text or not names
    return names


def lower_step(shape, c, params, cache, state, impl=None) -> str:
    """Lowers one step program, a `DecodeShape` or a `PrefillShape` as `Resolved` lists them."""
    flag = np.bool_(False)
    static = dict(config=c, impl=impl or GPU.model, shape=shape)
    if isinstance(shape, DecodeShape):
        return lower(steps.generate, params, cache, state, flag, num_steps=1, **static)
    # one GPU runs the prefill's forward, then its sampling (`prefill_sample`, lowered below)
    return lower(steps.prefill_forward, params, cache, state, abstract_batch(shape.rows), **static)


def int4_codes_shapes(text: str) -> set[tuple[int, int, int]]:
    """(rows of the codes operand, K, N) of every INT4 kernel call in a lowered module."""
    out = set()
    for line in text.splitlines():
        if "int4_matmul_" in line and "__gpu$xla.gpu.triton" in line:
            # operands: (layer i32[1], x [M, K], codes u32[rows, N/8], scales, mins)
            types = re.search(r":\s*\((.*)\)\s*->", line).group(1)
            x_shape, codes_shape = re.findall(r"tensor<([\dx]+)x\w+>", types)[1:3]
            rows, n8 = map(int, codes_shape.split("x"))
            out.add((rows, int(x_shape.split("x")[-1]), 8 * n8))
    return out


EXPECTED = {DecodeShape: {"paged_decode"}, PrefillShape: {"paged_prefill"}}


@pytest.mark.parametrize(
    "model,quantization,kv_cache_dtype",
    [
        ("smollm2-135m", None, "auto"),
        ("smollm2-135m", "int4-rtn", "auto"),
        ("smollm2-135m", None, "int8"),
        ("llama3-8b", "int4-rtn", "fp8"),  # head_dim 128, GQA group 4, 128k vocab
        # issue 26's dense families: per-head q/k norms (Qwen3); Gemma 2's per-layer windows
        # (traced, scanned with the layers), soft-caps, query_pre_attn_scalar and head_dim 256;
        # Gemma 3's two RoPE tables per layer under INT4; Phi-3's head_dim 96 and window 2047.
        ("qwen3-8b", None, "auto"),
        ("gemma2-9b", None, "auto"),
        ("gemma3-12b", "int4-rtn", "int8"),
        pytest.param(
            "phi3-mini",
            None,
            "auto",
            marks=pytest.mark.xfail(
                strict=True,
                raises=ValueError,
                reason="the Pallas attention kernels need a power-of-two head_dim (Phi-3: 96)",
            ),
        ),
    ],
)
def test_engine_steps_lower_for_cuda(model, quantization, kv_cache_dtype):
    c, params = abstract_model(model, quantization)
    cache = abstract_cache(c, kv_cache_dtype)
    state = jax.eval_shape(lambda: slot_state.init_slot_state(NUM_SLOTS, MAX_PAGES, c.vocab_size))
    # INT4 weights run the fused kernel for up to 16 rows (a decode batch of 8) and XLA's
    # unpack + dot beyond (32 slots, a prefill of 8 x 64 tokens): int4.PALLAS_MAX_ROWS.
    variants = [DecodeShape(8, MAX_PAGES, 0), DecodeShape(NUM_SLOTS, MAX_PAGES, 0)]
    variants.append(PrefillShape(8, CHUNK, 8, False))
    for shape in variants:
        text = lower_step(shape, c, params, cache, state)
        # (an untied INT4 lm_head [D, V] is one more call, on the prefill's 8 last tokens too;
        # the INT8 tied table runs in XLA)
        assert kernels(text) - {"int4_matmul"} == EXPECTED[type(shape)], shape
        shapes = int4_codes_shapes(text)
        layer_calls = {(r, k) for r, k, n in shapes if n != c.vocab_size}
        fused = quantization and isinstance(shape, DecodeShape) and shape.rows <= 16
        assert bool(layer_calls) == bool(fused), (shape, shapes)
        # Each layer's INT4 kernel gets the whole stack of its weight, [L * K, N/8] codes, and
        # reads the scan's layer in place: no per-layer slice is copied out for it.
        assert all(r == c.num_layers * k for r, k in layer_calls), shapes


def test_every_warmup_program_lowers_for_cuda():
    """A GPU engine's whole warm-up set (`Resolved.decode_shapes` + `prefill_shapes`): every
    decode and prefill bucket of the benchmark's engine shape, SmolLM2 bf16."""
    c, params = abstract_model("smollm2-135m", None)
    ec = EngineConfig(
        num_slots=NUM_SLOTS,
        max_model_len=2048,
        page_size=PAGE_SIZE,
        num_pages=NUM_PAGES,
        prefill_chunk_size=CHUNK,
        max_num_batched_tokens=512,
    )
    runner = runner_lib.ModelRunner(params, blueprint(params, c, ec, NUM_PAGES, backend="gpu"))
    r = runner.resolved
    assert r.model.attention == "pallas" and r.slot_buckets == (NUM_SLOTS,)  # the GPU's choices
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    cache, state = jax.tree.map(spec, runner.cache), jax.tree.map(spec, runner.state)
    shapes = r.decode_shapes() + r.prefill_shapes()
    for shape in shapes:
        assert kernels(lower_step(shape, c, params, cache, state, r.model)) == EXPECTED[type(shape)]
    # 8 page-table widths (1..128 pages): 8 decode, 8 x (4 row buckets + prompt log-probs at 1
    # and 8 rows) prefill.
    assert [sum(isinstance(s, k) for s in shapes) for k in (DecodeShape, PrefillShape)] == [8, 48]
    # the prefill's sampling half, one program per row bucket (XLA only: no Pallas kernel)
    for shape in {s.rows: s for s in r.prefill_shapes()}.values():
        logits = jax.ShapeDtypeStruct((shape.rows, c.vocab_size), jnp.float32)
        batch, flag = abstract_batch(shape.rows), np.bool_(False)
        text = lower(steps.prefill_sample, state, batch, logits, flag, num_top=shape.num_top)
        assert kernels(text) == set() and "chlo.top_k" in text, shape


# --- mixture-of-experts (issue 26) ---
# A GPU engine's choices for quantized weights (the experts' 'kernel' path, `layers/moe_tiles.py`)
GPU_QUANTIZED = resolve(
    EngineConfig(num_slots=NUM_SLOTS, max_model_len=256, page_size=PAGE_SIZE).for_model(_TINY),
    _TINY,
    "gpu",
    plain_weights=False,
)
# The experts' tile rows per step: None where they take XLA's ragged_dot (float experts, and
# INT4's prefill chunk: 1,024 pairs in 16-row tiles are past 4 tiles an expert)
MOE_TILES = {
    None: {DecodeShape: None, PrefillShape: None},
    "int4-rtn": {DecodeShape: 16, PrefillShape: None},
    "int8": {DecodeShape: 16, PrefillShape: 64},
}


@pytest.mark.parametrize("quantization", [None, "int4-rtn", "int8"])
def test_moe_steps_lower_for_cuda(quantization):
    """Mixtral-8x7B's decode (8 slots) and prefill (8 x 64 tokens) steps as a GPU engine builds
    them, beside the Pallas attention (and the INT4 kernel for the dense projections): float
    experts take XLA's `chlo.ragged_dot` inside the layer scan (3 per layer body: gate, up,
    down); quantized ones take the tiled INT4 / W8A16 kernel calls over the expert stack where
    their tiles fit (`MOE_TILES`), else ragged_dot over the layer's dequantized experts."""
    c, params = abstract_model("mixtral-8x7b", quantization)
    impl = (GPU if quantization is None else GPU_QUANTIZED).model
    assert impl.moe_matmul == ("ragged_dot" if quantization is None else "kernel")
    cache = abstract_cache(c, "auto")
    state = jax.eval_shape(lambda: slot_state.init_slot_state(NUM_SLOTS, MAX_PAGES, c.vocab_size))
    for shape in [DecodeShape(8, MAX_PAGES, 0), PrefillShape(8, CHUNK, 8, False)]:
        text = lower_step(shape, c, params, cache, state, impl)
        assert kernels(text) - {"int4_matmul"} == EXPECTED[type(shape)], shape
        fused = quantization == "int4-rtn" and isinstance(shape, DecodeShape)  # 8 rows
        layer_calls = {s for s in int4_codes_shapes(text) if s[2] != c.vocab_size}
        assert bool(layer_calls) == fused, shape
        tiles = {int(b) for b in re.findall(r'name = "(?:int4|w8)_matmul_t(\d+)_', text)}
        want = MOE_TILES[quantization][type(shape)]
        assert tiles == ({want} if want else set()), shape
        assert len(re.findall(r"chlo\.ragged_dot\"", text)) == (0 if want else 3), shape


# --- end mixture-of-experts ---
