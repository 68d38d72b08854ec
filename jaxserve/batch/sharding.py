"""Deterministic sharding of a batch job's rows by a stable hash of each row's key.

Every host of a sharded job reads the whole input and keeps the rows whose key hashes to its
shard, so `num_shards` processes (a SLURM array, a Kubernetes indexed job) partition the input
with no coordination. The hash is SHA-256, never Python's `hash()` (salted per process).
"""

from __future__ import annotations

import hashlib


def stable_hash(key: str) -> int:
    """A 64-bit hash of `key` that is the same in every process, on every machine."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")


def shard_of(key: str, num_shards: int) -> int:
    """The shard (0 <= shard < num_shards) that owns the row with this key."""
    return stable_hash(key) % num_shards


def check_shards(num_shards: int, shard_index: int) -> None:
    """Raises ValueError unless 0 <= shard_index < num_shards."""
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
    if not isinstance(shard_index, int) or not 0 <= shard_index < num_shards:
        raise ValueError(
            f"shard_index must be in [0, num_shards={num_shards}), got {shard_index!r}"
        )


def derived_seed(base_seed: int, key: str) -> int:
    """A per-row sampling seed in [0, 2**63) from the job's base seed and the row's key.

    A row's seed depends on nothing else, so sampled outputs do not change with sharding, input
    order, or restarts.
    """
    return stable_hash(f"{base_seed}/{key}") >> 1
