"""The settings in groups (jaxserve/config/groups.py): every setting in exactly one group, each
group built from the filled config with the flat values, frozen, and the scheduler's only once
the model's defaults are filled."""

import dataclasses

import pytest

from jaxserve.config import (
    PRESETS,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
    groups,
)

TINY = PRESETS["tiny"]


def test_every_setting_is_in_exactly_one_group():
    settings = [f.name for f in dataclasses.fields(EngineConfig)]
    grouped = [f.name for cls in groups.GROUPS.values() for f in dataclasses.fields(cls)]
    assert sorted(grouped) == sorted(settings)  # none left out, none twice
    assert len(grouped) == len(set(grouped))
    for f in dataclasses.fields(EngineConfig):
        assert f.metadata["group"] in groups.GROUPS, f.name


def test_a_group_has_its_settings_defaults_and_help():
    for f in dataclasses.fields(EngineConfig):
        cls = groups.GROUPS[f.metadata["group"]]
        (mine,) = [g for g in dataclasses.fields(cls) if g.name == f.name]
        assert mine.default == f.default and mine.metadata["help"] == f.metadata["help"]
        assert mine.kw_only


def test_the_config_exposes_each_group_with_its_values():
    c = EngineConfig(
        model="tiny",
        load_format="dummy",
        num_slots=8,
        page_size=8,
        tensor_parallel_size=2,
        data_parallel_size=2,
        num_speculative_tokens=0,
        enable_lora=False,
        attention_impl="reference",
        seed=7,
        warmup=True,
    ).for_model(TINY)
    for name, cls in groups.GROUPS.items():
        group = getattr(c, name)
        assert type(group) is cls
        for f in dataclasses.fields(cls):
            assert getattr(group, f.name) == getattr(c, f.name), (name, f.name)
        assert getattr(c, name) is group  # built once
    assert c.scheduler.num_slots == 8 and c.cache.page_size == 8
    assert c.parallel.data_parallel_size == 2 and c.requests.seed == 7
    assert c.compilation.warmup and c.kernels.attention_impl == "reference"
    assert c.load.model == "tiny" and c.load.load_format == "dummy"
    assert c.scheduler.max_prefill_rows == c.max_num_batched_tokens // c.prefill_chunk_size


def test_groups_are_frozen():
    c = EngineConfig().for_model(TINY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.cache.page_size = 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.scheduler.num_slots = 1


def test_the_scheduler_group_needs_a_filled_config():
    c = EngineConfig()
    assert c.cache.page_size == 16 and c.parallel.tensor_parallel_size == 1  # any config
    with pytest.raises(ValueError, match="for_model"):
        _ = c.scheduler
    assert c.for_model(TINY).scheduler.max_model_len == 512
    with pytest.raises(ValueError, match="max_model_len"):
        SchedulerConfig(prefill_chunk_size=64, max_num_batched_tokens=512)


def test_replace_rebuilds_the_groups():
    c = EngineConfig().for_model(TINY)
    assert c.scheduler.num_slots == 32
    d = dataclasses.replace(c, num_slots=8)
    assert d.scheduler.num_slots == 8 and c.scheduler.num_slots == 32


def test_speculative_drafts_by_batch_size():
    s = SpeculativeConfig(num_speculative_tokens=3, speculative_disable_by_batch_size=4)
    assert [s.draft_tokens(n) for n in (1, 4, 5)] == [3, 3, 0]
    assert SpeculativeConfig().draft_tokens(1) == 0  # off
    c = EngineConfig(num_speculative_tokens=3, num_speculative_tokens_per_batch_size=[[1, 2, 3]])
    assert [c.speculative.draft_tokens(n) for n in (1, 2, 9)] == [3, 3, 3]
