"""The engine's jitted steps, as a GPU engine builds them, lower for CUDA (no GPU needed).

`python -m pallas_kernels.check` lowers each kernel on its own; this lowers the whole step
functions (`runner._generate`, `_prefill`, `_mixed`) with the Pallas attention and, for INT4
params, the fused dequantize-matmul, at SmolLM2 and Llama-3-8B shapes and the engine's bucket
shapes. It catches
what only shows when the kernels sit inside the model: block shapes the engine's buckets produce,
the GQA group of 3, the 576-wide hidden size, dtypes across kernel boundaries.

The shapes are abstract (`jax.eval_shape`); the device is an abstract "NVIDIA H200"
(`pallas_kernels.check.h200_mesh`). Code that picks a path with `jax.default_backend()` at trace
time sees "gpu" here, as it would on the GPU.
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
from jaxserve.quant import quantize_params
from jaxserve.runner import runner as runner_lib
from pallas_kernels.check import h200_mesh

NUM_SLOTS, MAX_PAGES, NUM_PAGES, PAGE_SIZE, CHUNK = 32, 16, 512, 16, 64


@pytest.fixture
def on_gpu(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    yield
    jax.clear_caches()  # no trace made while "on the GPU" may serve a later CPU call


def abstract_model(model: str, quantization: str | None):
    c = ModelConfig.preset(model)
    params = jax.eval_shape(lambda k: llama.init_params(c, k, jnp.bfloat16), jax.random.key(0))
    if quantization:
        params = jax.eval_shape(lambda p: quantize_params(p, c, quantization, 64), params)
    return c, params


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


def abstract_batch(rows: int) -> runner_lib.PrefillBatch:
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    return runner_lib.PrefillBatch(
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


def lower_step(kind: str, v: dict, c, params, cache, state, mixed_width: int = 8) -> str:
    """Lowers one step program, given as `ModelRunner.step_variants` lists them."""
    flag = np.bool_(False)
    static = dict(config=c, impl="auto")
    if kind == "generate":
        return lower(runner_lib._generate, params, cache, state, flag, num_steps=1, **v, **static)
    if kind == "prefill":
        batch = abstract_batch(v["rows"])
        pf = dict(width=v["width"], prompt_logprobs=v["prompt_logprobs"])
        return lower(runner_lib._prefill, params, cache, state, batch, flag, **pf, **static)
    args = (params, cache, state, abstract_batch(1), flag, flag)
    return lower(runner_lib._mixed, *args, prefill_width=mixed_width, **v, **static)


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


EXPECTED = {
    "generate": {"paged_decode"},
    "prefill": {"paged_prefill"},
    "mixed": {"paged_decode", "paged_prefill"},
}


@pytest.mark.parametrize(
    "model,quantization,kv_cache_dtype",
    [
        ("smollm2-135m", None, "auto"),
        ("smollm2-135m", "int4-rtn", "auto"),
        ("smollm2-135m", None, "int8"),
        ("llama3-8b", "int4-rtn", "fp8"),  # head_dim 128, GQA group 4, 128k vocab
    ],
)
def test_engine_steps_lower_for_cuda(on_gpu, model, quantization, kv_cache_dtype):
    c, params = abstract_model(model, quantization)
    cache = abstract_cache(c, kv_cache_dtype)
    state = jax.eval_shape(lambda: runner_lib.init_slot_state(NUM_SLOTS, MAX_PAGES, c.vocab_size))
    decode = dict(rows=NUM_SLOTS, width=MAX_PAGES, num_flat=0)
    variants = [
        ("generate", decode),
        ("prefill", dict(rows=8, width=8, prompt_logprobs=False)),
        ("mixed", decode),
    ]
    int4 = {"int4_matmul"} if quantization else set()  # the INT8 tied table runs in XLA
    for kind, v in variants:
        text = lower_step(kind, v, c, params, cache, state)
        assert kernels(text) == EXPECTED[kind] | int4, kind
        if quantization:
            # Each layer's INT4 kernel gets the whole stack of its weight, [L * K, N/8] codes,
            # and reads the scan's layer in place: no per-layer slice is copied out for it. (An
            # untied lm_head [D, V] is one weight.)
            shapes = int4_codes_shapes(text)
            layer_calls = {(r, k) for r, k, n in shapes if n != c.vocab_size}
            assert layer_calls and all(r == c.num_layers * k for r, k in layer_calls), shapes


def test_every_warmup_program_lowers_for_cuda(on_gpu):
    """A GPU engine's whole warm-up set (`ModelRunner.step_variants`): every decode, prefill and
    fused bucket of the benchmark's engine shape, SmolLM2 bf16 with fuse_prefill on."""
    c, params = abstract_model("smollm2-135m", None)
    ec = EngineConfig(
        num_slots=NUM_SLOTS,
        max_model_len=2048,
        page_size=PAGE_SIZE,
        num_pages=NUM_PAGES,
        prefill_chunk_size=CHUNK,
        max_num_batched_tokens=512,
        fuse_prefill=True,
    )
    runner = runner_lib.ModelRunner(params, c, ec, NUM_PAGES)
    assert not runner.ragged and runner.slot_buckets == (NUM_SLOTS,)  # the GPU's choices
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    cache, state = jax.tree.map(spec, runner.cache), jax.tree.map(spec, runner.state)
    seen = []
    for kind, v in runner.step_variants():
        text = lower_step(kind, v, c, params, cache, state, runner.mixed_width)
        assert kernels(text) == EXPECTED[kind], (kind, v)
        seen.append(kind)
    # 8 page-table widths (1..128 pages): 8 decode, 8 x (4 row buckets + prompt log-probs)
    # prefill, 8 fused programs.
    assert [seen.count(k) for k in ("generate", "prefill", "mixed")] == [8, 40, 8]
