"""jaxserve/layers/kv_cache.py: the pool's byte counts and the page counts the GPU kernels read
right."""

from __future__ import annotations

import pytest

from jaxserve.layers import kv_cache
from jaxserve.layers.kv_cache import TRITON_OFFSET_LIMIT, triton_safe_num_pages

# Llama-3-8B, one device: 32 layers x 8 KV heads x 16 tokens x 128 dims per page
PAGE = 32 * 8 * 16 * 128


@pytest.mark.parametrize(
    "num_pages, itemsize, shards, want",
    [
        (TRITON_OFFSET_LIMIT // PAGE - 1, 1, 1, TRITON_OFFSET_LIMIT // PAGE - 1),  # under 2^31
        (TRITON_OFFSET_LIMIT // PAGE, 1, 1, (TRITON_OFFSET_LIMIT - 1) // PAGE),  # 2 GiB int8
        (3 * TRITON_OFFSET_LIMIT // (2 * PAGE), 1, 1, (TRITON_OFFSET_LIMIT - 1) // PAGE),  # 3 GiB
        (2 * TRITON_OFFSET_LIMIT // PAGE - 1, 1, 1, (TRITON_OFFSET_LIMIT - 1) // PAGE),  # < 4 GiB
        (2 * TRITON_OFFSET_LIMIT // PAGE, 1, 1, 2 * TRITON_OFFSET_LIMIT // PAGE),  # 4 GiB: 64-bit
        (
            3 * TRITON_OFFSET_LIMIT // (2 * PAGE),
            2,
            1,
            3 * TRITON_OFFSET_LIMIT // (2 * PAGE),
        ),  # bf16
        # two data shards: each holds half the pages, and the shards stay equal
        (3 * TRITON_OFFSET_LIMIT // PAGE, 1, 2, 2 * ((TRITON_OFFSET_LIMIT - 1) // PAGE)),
        (TRITON_OFFSET_LIMIT // PAGE, 1, 2, TRITON_OFFSET_LIMIT // PAGE),  # 1 GiB per shard
    ],
)
def test_triton_safe_num_pages(num_pages, itemsize, shards, want):
    got = triton_safe_num_pages(num_pages, PAGE, itemsize, shards)
    assert got == want
    local = got // shards * PAGE
    assert local < TRITON_OFFSET_LIMIT or local * itemsize >= 2**32
    assert got <= num_pages and got % shards == 0


def test_bytes_per_token_counts_scales_of_quantized_pools():
    # 2 (K and V) x layers x heads x (head_dim x itemsize + a 4-byte scale for int8 / fp8)
    assert kv_cache.bytes_per_token(32, 8, 128, "auto", "bfloat16") == 2 * 32 * 8 * 256
    assert kv_cache.bytes_per_token(32, 8, 128, "int8", "bfloat16") == 2 * 32 * 8 * 132
    assert kv_cache.bytes_per_token(32, 8, 128, "fp8", "float32") == 2 * 32 * 8 * 132
