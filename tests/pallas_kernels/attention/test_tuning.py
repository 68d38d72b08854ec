"""Tuning configs validate themselves; the static tile plans follow the H200 defaults' reasoning."""

from __future__ import annotations

import pytest

from pallas_kernels.attention.triton_decode import decode_plan
from pallas_kernels.attention.triton_prefill import prefill_plan
from pallas_kernels.attention.tuning import H200_DECODE, H200_PREFILL, DecodeConfig, PrefillConfig


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: DecodeConfig(block_k=96), "DecodeConfig.block_k must be a positive power of two"),
        (lambda: DecodeConfig(num_warps=3), "DecodeConfig.num_warps"),
        (lambda: DecodeConfig(target_programs=0), "target_programs"),
        (lambda: PrefillConfig(block_rows=48), "PrefillConfig.block_rows"),
        (lambda: PrefillConfig(block_rows=16, min_rows=32), "min_rows must not exceed"),
    ],
)
def test_bad_configs_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_decode_splits_small_batches_and_not_large_ones():
    # Llama-3-8B, 4096-token context at page 16 (256 pages): batch 8 has 64 (row, KV head)
    # programs, so it splits the keys 16 ways; batch 64 gives 512 programs -> a 2-way split;
    # batch 256 fills the chip without splitting.
    assert decode_plan(8, 8, 256, 16, H200_DECODE) == (8, 16, 16)
    assert decode_plan(64, 8, 256, 16, H200_DECODE) == (8, 2, 128)
    assert decode_plan(256, 8, 256, 16, H200_DECODE) == (8, 1, 256)
    # A short table never splits past its number of key blocks; big pages take one page a block.
    assert decode_plan(1, 1, 3, 16, H200_DECODE) == (8, 1, 8)
    assert decode_plan(1, 1, 4, 256, H200_DECODE) == (1, 4, 1)


def test_prefill_plan_pads_the_group_and_keeps_rows_at_least_16():
    assert prefill_plan(256, 3, 16, H200_PREFILL) == (4, 16, 4)  # SmolLM2: 64 rows of 16 tokens
    assert prefill_plan(256, 7, 32, H200_PREFILL) == (8, 8, 2)  # Qwen2-7B
    assert prefill_plan(1, 1, 16, H200_PREFILL) == (1, 16, 4)  # a decode row: still 16 rows
