"""EngineConfig: every setting once with its default and help, checks naming the field, and
`for_model` filling the model-dependent defaults."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from jaxserve.config import EngineConfig, ModelConfig

TINY = ModelConfig.preset("tiny")  # max_position_embeddings 512


def test_defaults_and_help():
    c = EngineConfig()
    assert (c.model, c.load_format, c.quantization, c.seed, c.warmup) == (
        None,
        "auto",
        None,
        0,
        False,
    )
    assert (c.num_slots, c.page_size, c.dtype, c.kv_cache_dtype) == (32, 16, "bfloat16", "auto")
    # Model-dependent: left None until for_model.
    assert c.max_model_len is c.prefill_chunk_size is c.max_num_batched_tokens is None
    assert not c.is_filled
    for f in dataclasses.fields(EngineConfig):
        assert "Default:" in f.metadata["help"], f.name
    assert "fuse_prefill" not in {f.name for f in dataclasses.fields(EngineConfig)}
    with pytest.raises(TypeError):
        EngineConfig(32)  # keyword-only: the field order is not an API


@pytest.mark.parametrize(
    "kw, want",
    [
        ({}, (512, 64, 512)),  # min(512, 2048); 64-token chunks, 8 per step
        (dict(max_model_len=20), (20, 32, 256)),  # the chunk capped at pow2 >= 20
        (dict(max_model_len=64, prefill_chunk_size=16), (64, 16, 128)),
        (dict(max_model_len=64, prefill_chunk_size=16, max_num_batched_tokens=32), (64, 16, 32)),
        (dict(prefill_chunk_size=256), (512, 256, 2048)),  # an explicit chunk is not capped
    ],
)
def test_for_model_fills_the_model_dependent_defaults(kw, want):
    filled = EngineConfig(**kw).for_model(TINY)
    assert (filled.max_model_len, filled.prefill_chunk_size, filled.max_num_batched_tokens) == want
    assert filled.is_filled
    assert filled.for_model(TINY) == filled  # idempotent
    assert filled.max_pages_per_seq == -(-want[0] // 16)


def test_for_model_caps_max_model_len_at_2048_and_checks_the_model():
    long = dataclasses.replace(TINY, max_position_embeddings=131072)
    assert EngineConfig().for_model(long).max_model_len == 2048
    with pytest.raises(ValueError, match=r"max_model_len=1000.*max_position_embeddings=512"):
        EngineConfig(max_model_len=1000).for_model(TINY)
    with pytest.raises(ValueError, match="max_model_len.*for_model"):
        _ = EngineConfig().max_pages_per_seq


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(num_slots=0), "num_slots"),
        (dict(num_slots=True), "num_slots"),
        (dict(max_model_len=1), "max_model_len"),
        (dict(page_size=12), "page_size"),
        (dict(prefill_chunk_size=48), "prefill_chunk_size"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(num_pages=-1), "num_pages"),
        (dict(kv_cache_memory=0), "kv_cache_memory"),
        (dict(decode_steps=0), "decode_steps"),
        (dict(dtype="float16"), "dtype"),
        (dict(kv_cache_dtype="int4"), "kv_cache_dtype"),
        (dict(attention_impl="flash"), "attention_impl"),
        (dict(load_format="safetensors"), "load_format"),
        (dict(batching="dynamic"), "batching"),
        (dict(async_scheduling=1), "async_scheduling"),
        (dict(enable_prefix_caching="yes"), "enable_prefix_caching"),
        (dict(warmup=None), "warmup"),
        (dict(seed="0"), "seed"),
        (dict(quantization=4), "quantization"),
        (dict(model=3), "model"),
        (dict(model=TINY), "load_format='dummy'"),  # a ModelConfig has no weights to read
        (dict(slot_buckets=(8, 16)), "slot_buckets"),  # must end at num_slots (32)
        (dict(slot_buckets=(16, 8, 32)), "slot_buckets"),
        (dict(slot_buckets="none"), "slot_buckets"),
    ],
)
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kw)


def test_model_forms():
    assert EngineConfig(model=Path("/x/model.gguf")).model == "/x/model.gguf"  # kept as a str
    c = EngineConfig(model=TINY, load_format="dummy")
    assert c.model is TINY and hash(c) == hash(EngineConfig(model=TINY, load_format="dummy"))
    assert EngineConfig(slot_buckets=[8, 32]).slot_buckets == (8, 32)


def test_a_page_larger_than_a_sequence_is_refused():
    """Issue 24: page_size 65536 with max_model_len 64 used to waste 1,024x the KV silently."""
    with pytest.raises(ValueError, match=r"page_size=128.*max_model_len=64.*page_size <= 64"):
        EngineConfig(page_size=128, max_model_len=64).for_model(TINY)
    assert EngineConfig(page_size=64, max_model_len=50).for_model(TINY).max_pages_per_seq == 1


def test_too_many_slots_fail_before_any_allocation():
    """Issue 24: num_slots 10**6 failed as an opaque XLA RESOURCE_EXHAUSTED; now a ValueError
    naming num_slots and num_pages and the bytes they need, before the pool is allocated."""
    from jaxserve import LLM

    with pytest.raises(ValueError, match=r"num_slots=1000000 and num_pages=.*GiB"):
        LLM("tiny", load_format="dummy", dtype="float32", num_slots=10**6, max_model_len=64)
