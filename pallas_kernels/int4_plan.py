"""The INT4 kernel's tiles (`int4_matmul.py`): one launch's block sizes and split-K, chosen from
the shape by a heuristic for the H200 (JOURNAL.md 48c, 61b) until a GPU run times them.

    plan(m, k, n, group_size) -> Int4MatmulConfig                  a plain or stacked call
    tiled_plan(num_tiles, tile_rows, k, n, group_size) -> ...      a tiled call (`tiles.py`)
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.int4_layout import PACK

H200_SMS = 132
DECODE_BLOCK_M = 16  # tl.dot's smallest M tile; the decode grid runs over row blocks (`plan`)


@dataclasses.dataclass(frozen=True)
class Int4MatmulConfig:
    """One launch's tiles: block_m rows, block_c packed columns (8 * block_c outputs), splits."""

    block_m: int
    block_c: int
    splits: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for f in ("block_m", "block_c", "num_warps"):
            v = getattr(self, f)
            if v <= 0 or v & (v - 1):
                raise ValueError(f"Int4MatmulConfig.{f} must be a positive power of two, got {v}")
        if self.block_m < 16 or self.block_c < 16:
            raise ValueError("Int4MatmulConfig.block_m and block_c must be >= 16 (tl.dot tiles)")
        if self.splits <= 0 or self.num_stages <= 0:
            raise ValueError("Int4MatmulConfig.splits and num_stages must be positive")


def plan(m: int, k: int, n: int, group_size: int, num_sms: int = H200_SMS) -> Int4MatmulConfig:
    """Chooses tiles for x[m, k] @ W[k, n] from the shape (a heuristic for the H200, see module doc).

    Decode (m <= 64): 16-row blocks (the grid runs over them), split-K over groups until the
    grid has ~2 programs per SM (each split is a divisor of the group count). Prefill: 64-row
    tiles (128 from 1024 rows), no split.

    Why 16 rows at every decode size: on the H200 (JOURNAL.md 48c, Llama-3-8B 4096 x 14336) the
    kernel took 45 us at 8 rows (one 16-row block per column block) and 206 us at 32 rows (one
    32-row block), 4.5x the time for 2x the rows a block; two 16-row blocks per column block are
    the 8-row case's code twice. Each 16-row block reads the layer's 4-bit weight again (4x at 64 rows:
    the bytes of one bf16 read). Not yet timed on a GPU: the prepared run times it at 32 and 64
    rows (`experiments/gpu_quant_matmul.py`), and the GPU kernel table takes it only if it wins.
    """
    n8 = n // PACK
    # 32 packed columns (256 outputs) unless 16 wastes fewer masked columns on a ragged N.
    block_c = min((32, 16), key=lambda bc: (-(-n8 // bc) * bc - n8, -bc))
    if m <= 64:
        programs = -(-m // DECODE_BLOCK_M) * -(-n8 // block_c)
        splits = _splits(k // group_size, programs, num_sms)
        return Int4MatmulConfig(DECODE_BLOCK_M, block_c, splits, num_warps=4, num_stages=3)
    # Eight f32 accumulators of [block_m, block_c]: 8 warps keep a 128-row tile at 64 registers
    # per thread (4 warps suffice for 64 rows).
    if m >= 1024:
        return Int4MatmulConfig(128, block_c, 1, num_warps=8, num_stages=3)
    return Int4MatmulConfig(64, block_c, 1, num_warps=4, num_stages=3)


def _splits(groups: int, programs: int, num_sms: int) -> int:
    """Split-K over the groups (a divisor of their count, at most 32) until the grid has ~2
    programs per SM."""
    splits = next(
        (d for d in range(1, groups + 1) if groups % d == 0 and programs * d >= 2 * num_sms),
        groups,
    )
    return max(d for d in range(1, min(splits, 32) + 1) if groups % d == 0)


def tiled_plan(
    num_tiles: int, tile_rows: int, k: int, n: int, group_size: int, num_sms: int = H200_SMS
) -> Int4MatmulConfig:
    """Tiles of a tiled call (`tiles.py`): one row block per tile (block_m = tile_rows), the
    columns as `plan`'s, split-K as at decode when the tiles are decode-sized (16 rows), where
    the grid must fill the SMs with few rows; none for larger tiles (a prefill chunk's)."""
    base = plan(1, k, n, group_size, num_sms)  # its columns
    if tile_rows > DECODE_BLOCK_M:
        warps = 8 if tile_rows >= 128 else 4
        return Int4MatmulConfig(tile_rows, base.block_c, 1, num_warps=warps, num_stages=3)
    programs = num_tiles * -(-(n // PACK) // base.block_c)
    splits = _splits(k // group_size, programs, num_sms)
    return Int4MatmulConfig(tile_rows, base.block_c, splits, num_warps=4, num_stages=3)
