"""The engine flags: one per EngineConfig field, with its help text, turned into LLM kwargs."""

from __future__ import annotations

import dataclasses

import pytest
from absl import flags

from jaxserve.config import EngineConfig
from jaxserve.launch import flags as engine_flags


def test_every_field_has_a_flag_with_its_help():
    fields = dataclasses.fields(EngineConfig)
    assert engine_flags.FLAG_NAMES == tuple(f.name for f in fields)
    for f in fields:
        flag = engine_flags.FLAGS[f.name]
        assert flag.help.endswith(f.metadata["help"]), f.name  # enums: "<a|b>: " first
        assert "Default:" in flag.help, f.name
        assert flag.default is None, f.name  # unset: the engine's default applies
    types = {name: engine_flags.FLAGS[name].flag_type() for name in engine_flags.FLAG_NAMES}
    assert types["num_slots"] == types["seed"] == types["prefill_chunk_size"] == "int"
    assert types["warmup"] == types["async_scheduling"] == "bool"
    assert types["model"] == types["quantization"] == "string"
    assert types["dtype"] == types["load_format"] == types["batching"] == "string enum"
    assert types["kv_cache_memory"] == "bytes"
    assert "fuse_prefill" not in engine_flags.FLAGS


def test_unset_flags_are_not_passed(parsed):
    fv = parsed()
    assert engine_flags.llm_kwargs(fv) == {}
    assert engine_flags.engine_config(fv) == EngineConfig()


def test_set_flags_reach_the_engine(parsed):
    fv = parsed(
        "--model=tiny", "--load_format=dummy", "--dtype=float32", "--num_slots=3",
        "--max_model_len=128", "--page_size=8", "--kv_cache_memory=2GiB", "--kv_cache_dtype=int8",
        "--attention_impl=reference", "--matmul_impl=xla", "--quant_matmul_impl=xla", "--seed=5", "--quantization=int4-rtn", "--slot_buckets=1,3",
        "--prefill_chunk_size=32", "--max_num_batched_tokens=64", "--decode_steps=2",
        "--batching=static", "--noasync_scheduling", "--enable_prefix_caching", "--warmup",
        "--num_pages=40", "--tensor_parallel_size=2", "--data_parallel_size=3",
        "--max_logprobs=5", "--on_bad_request=raise", "--num_speculative_tokens=0",
        "--prompt_lookup_max=4", "--prompt_lookup_min=2", "--speculative_disable_by_batch_size=8",
        "--compilation_cache=off", "--revision=v2", "--scheduling_policy=priority",
        "--noenable_lora", "--max_loras=3", "--max_lora_rank=8", "--max_cpu_loras=4",
    )  # fmt: skip
    kw = engine_flags.llm_kwargs(fv)
    assert kw == {
        "model": "tiny",
        "revision": "v2",
        "load_format": "dummy",
        "quantization": "int4-rtn",
        "dtype": "float32",
        "kv_cache_dtype": "int8",
        "num_slots": 3,
        "max_model_len": 128,
        "page_size": 8,
        "num_pages": 40,
        "kv_cache_memory": 2 * 2**30,
        "attention_impl": "reference",
        "matmul_impl": "xla",
        "quant_matmul_impl": "xla",
        "max_num_batched_tokens": 64,
        "prefill_chunk_size": 32,
        "decode_steps": 2,
        "batching": "static",
        "scheduling_policy": "priority",
        "async_scheduling": False,
        "enable_prefix_caching": True,
        "slot_buckets": (1, 3),
        "seed": 5,
        "warmup": True,
        "tensor_parallel_size": 2,
        "data_parallel_size": 3,
        "max_logprobs": 5,
        "on_bad_request": "raise",
        "num_speculative_tokens": 0,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
        "speculative_disable_by_batch_size": 8,
        "compilation_cache": "off",
        "enable_lora": False,
        "max_loras": 3,
        "max_lora_rank": 8,
        "max_cpu_loras": 4,
    }
    # every field is reachable (the schedule needs speculation, which decode_steps=2 refuses:
    # test_speculative_schedule_flag)
    assert set(kw) == set(engine_flags.FLAG_NAMES) - {"num_speculative_tokens_per_batch_size"}
    assert engine_flags.engine_config(fv) == EngineConfig(**kw)
    assert fv["slot_buckets"].serialize() == "--slot_buckets=1,3"
    assert engine_flags.llm_kwargs(parsed("--slot_buckets=auto")) == {"slot_buckets": "auto"}


def test_bad_flags_fail_naming_the_field(parsed):
    # Text that is not of the flag's type fails while parsing ...
    for bad in (
        "--dtype=float64",
        "--slot_buckets=2,x",
        "--kv_cache_memory=lots",
        "--seed=x",
        "--num_speculative_tokens_per_batch_size=[[2, 4, 1]]",
    ):
        with pytest.raises(flags.IllegalFlagValueError, match=bad.split("=")[0][2:]):
            parsed(bad)
    # ... a value EngineConfig refuses when the kwargs are built.
    for args, field in [
        (("--num_slots=0",), "num_slots"),
        (("--page_size=12",), "page_size"),
        (("--num_slots=3", "--slot_buckets=2,4"), "slot_buckets"),
        (("--max_model_len=1",), "max_model_len"),
    ]:
        fv = parsed(*args)
        with pytest.raises(ValueError, match=field):
            engine_flags.llm_kwargs(fv)
        with pytest.raises(ValueError, match=field):
            engine_flags.engine_config(fv)


def test_speculative_schedule_flag(parsed):
    fv = parsed(
        "--num_speculative_tokens=3", "--num_speculative_tokens_per_batch_size=[[5, 32, 1], [1, 4, 3]]"
    )  # fmt: skip
    assert engine_flags.llm_kwargs(fv) == {
        "num_speculative_tokens": 3,
        "num_speculative_tokens_per_batch_size": ((1, 4, 3), (5, 32, 1)),
    }
    assert fv["num_speculative_tokens_per_batch_size"].serialize() == (
        "--num_speculative_tokens_per_batch_size=[[1, 4, 3], [5, 32, 1]]"
    )
    with pytest.raises(ValueError, match="needs num_speculative_tokens"):
        engine_flags.llm_kwargs(parsed("--num_speculative_tokens_per_batch_size=[[1, 4, 3]]"))


def test_speculative_config_flag_takes_vllms_json(parsed):
    fv = parsed(
        '--speculative_config={"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_max": 4, "num_speculative_tokens_per_batch_size": [[1, 16, 3], [17, 32, 0]]}'
    )
    assert engine_flags.llm_kwargs(fv) == {
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
        "num_speculative_tokens_per_batch_size": [[1, 16, 3], [17, 32, 0]],
    }
    assert engine_flags.engine_config(fv).num_speculative_tokens_per_batch_size == (
        (1, 16, 3),
        (17, 32, 0),
    )
    for args, match in [
        (('--speculative_config={"method": "eagle", "num_speculative_tokens": 3}',), "ngram"),
        (('--speculative_config={"method": "ngram", "num_speculative_tokens": 3, "x": 1}',), "x"),
        (("--speculative_config=ngram",), "not JSON"),
        (
            ('--speculative_config={"method": "ngram", "num_speculative_tokens": 3}',
             "--num_speculative_tokens=2"),
            "set twice",
        ),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            engine_flags.llm_kwargs(parsed(*args))


def test_parse_bytes_and_slot_buckets():
    assert engine_flags.parse_bytes("512MiB") == 512 * 2**20
    assert engine_flags.parse_bytes("2e9") == 2 * 10**9
    assert engine_flags.parse_bytes("1.5 GB") == 1_500_000_000
    for bad in ("lots", "5 parsecs", "0"):
        with pytest.raises(ValueError, match="kv_cache_memory"):
            engine_flags.parse_bytes(bad)
    assert engine_flags.parse_slot_buckets("8,16,32") == (8, 16, 32)
    assert engine_flags.parse_slot_buckets("auto") == "auto"
    with pytest.raises(ValueError, match="slot_buckets"):
        engine_flags.parse_slot_buckets("8;16")
