"""The shared engine flags: defined once, turned into LLM kwargs / EngineConfig."""

from __future__ import annotations

import pytest
from absl import flags

from jaxserve.config import EngineConfig
from jaxserve.launch import flags as engine_flags


def parsed(*args) -> flags.FlagValues:
    fv = flags.FlagValues()
    for name in engine_flags.LLM_FLAGS:
        fv[name] = engine_flags.FLAGS[name]  # the same Flag objects, parsed on their own
    fv(["prog", *args])
    return fv


def test_unset_flags_are_not_passed():
    fv = parsed()
    assert engine_flags.llm_kwargs(fv) == {"model": None, "load_format": "auto"}
    assert engine_flags.engine_config(fv) == EngineConfig()
    fv.unparse_flags()


def test_set_flags_reach_the_engine():
    fv = parsed(
        "--model=tiny", "--load_format=dummy", "--dtype=float32", "--num_slots=3",
        "--max_model_len=128", "--page_size=8", "--kv_cache_memory=2GiB", "--kv_cache_dtype=int8",
        "--attention_impl=reference", "--seed=5", "--quantization=int4", "--slot_buckets=1,3",
    )  # fmt: skip
    kw = engine_flags.llm_kwargs(fv)
    assert kw == {
        "model": "tiny",
        "load_format": "dummy",
        "quantization": "int4",
        "seed": 5,
        "num_slots": 3,
        "max_model_len": 128,
        "page_size": 8,
        "kv_cache_memory": 2 * 2**30,
        "dtype": "float32",
        "kv_cache_dtype": "int8",
        "attention_impl": "reference",
        "slot_buckets": (1, 3),
    }
    cfg = engine_flags.engine_config(fv)
    assert (cfg.num_slots, cfg.page_size, cfg.kv_cache_memory) == (3, 8, 2 * 2**30)
    assert cfg.slot_buckets == (1, 3)
    fv.unparse_flags()
    with pytest.raises(ValueError, match="slot_buckets"):
        engine_flags.engine_config(parsed("--num_slots=3", "--slot_buckets=2,x"))
    fv.unparse_flags()
    with pytest.raises(ValueError, match="slot_buckets"):
        engine_flags.engine_config(parsed("--num_slots=3", "--slot_buckets=2,4"))
    fv.unparse_flags()
    with pytest.raises(flags.IllegalFlagValueError):
        parsed("--dtype=float64")
    with pytest.raises(flags.IllegalFlagValueError):
        parsed("--num_slots=0")


def test_parse_bytes_and_help():
    assert engine_flags.parse_bytes("512MiB") == 512 * 2**20
    assert engine_flags.parse_bytes("2e9") == 2 * 10**9
    assert engine_flags.parse_bytes("1.5 GB") == 1_500_000_000
    for bad in ("lots", "5 parsecs", "0"):
        with pytest.raises(ValueError, match="kv_cache_memory"):
            engine_flags.parse_bytes(bad)
    for name in engine_flags.LLM_FLAGS:
        assert engine_flags.FLAGS[name].help, name
