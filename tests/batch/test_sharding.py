"""Sharding by a stable hash of the row key: same on every host, a partition of the rows."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxserve.batch.sharding import check_shards, derived_seed, shard_of, stable_hash


def test_hash_is_stable_across_processes():
    # Python's hash() of a str changes per process (PYTHONHASHSEED); ours must not.
    code = "from jaxserve.batch.sharding import stable_hash; print(stable_hash('\"row-17\"'))"
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123"},
    )
    assert int(other.stdout) == stable_hash('"row-17"')
    assert stable_hash("") == 0xE3B0C44298FC1C14  # first 8 bytes of sha256(b"")


def test_shards_partition_and_balance():
    keys = [f'"id-{i}"' for i in range(4000)] + [str(i) for i in range(1000)]
    for n in (1, 2, 3, 8):
        shards = [shard_of(k, n) for k in keys]
        assert set(shards) == set(range(n))
        counts = [shards.count(s) for s in range(n)]
        assert max(counts) - min(counts) < 0.1 * len(keys) / n + 50  # roughly even
    assert all(shard_of(k, 1) == 0 for k in keys)


def test_check_shards_and_seeds():
    check_shards(4, 3)
    for bad in [(0, 0), (2, 2), (2, -1)]:
        with pytest.raises(ValueError):
            check_shards(*bad)
    s = derived_seed(0, '"a"')
    assert 0 <= s < 2**63 and s == derived_seed(0, '"a"')
    assert s != derived_seed(1, '"a"') and s != derived_seed(0, '"b"')
