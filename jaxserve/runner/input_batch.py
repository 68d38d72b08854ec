"""Host-side packing of a scheduler plan into the fixed-shape numpy arrays a step takes.

    pack_prefill(plan, shape, num_slots)        -> PrefillBatch   the plan's chunks, [R, T]
    pack_prefill_shards(plan, shape, num_slots, D)                 D data shards' blocks, [D*R, T]
    padding_batch(rows, num_slots, chunk)       -> PrefillBatch   all padding (warm-up)
    move_arrays(moves, num_slots)               -> (src, dst)     i32[S] each, S = padding

Numpy only: the runner hands these to the jitted steps, one host->device transfer per call.
"""

from __future__ import annotations

import numpy as np
from flax import struct

from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.resolve import PrefillShape


@struct.dataclass
class PrefillBatch:
    tokens: np.ndarray  # i32[R, T]  chunk tokens, 0-padded
    slots: np.ndarray  # i32[R]  slot of each row; S marks a padding row
    start: np.ndarray  # i32[R]  position of the row's first token
    length: np.ndarray  # i32[R]  valid tokens in the row; 0 = padding row
    is_last: np.ndarray  # bool[R]  the chunk completes the prefill
    forced: np.ndarray  # i32[R]  token to install instead of sampling (-1 = sample)
    targets: np.ndarray  # i32[R, T]  next prompt token for prompt log-probs (-1 = none)


def wants_prompt_logprobs(plan: SchedulerOutput) -> bool:
    """Some chunk of the plan scores prompt tokens (it holds a prompt token with a successor)."""
    return any(
        c.request.sampling_params.prompt_logprobs is not None
        and c.start + 1 < len(c.request.prompt_token_ids)
        for c in plan.prefill
    )


def padding_batch(rows: int, num_slots: int, chunk: int) -> PrefillBatch:
    """A prefill batch of `rows` padding rows (no slot, no valid token)."""
    return PrefillBatch(
        tokens=np.zeros((rows, chunk), np.int32),
        slots=np.full((rows,), num_slots, np.int32),
        start=np.zeros((rows,), np.int32),
        length=np.zeros((rows,), np.int32),
        is_last=np.zeros((rows,), bool),
        forced=np.full((rows,), -1, np.int32),
        targets=np.full((rows, chunk), -1, np.int32),
    )


def pack_prefill(plan: SchedulerOutput, shape: PrefillShape, num_slots: int) -> PrefillBatch:
    """The plan's chunks as rows of a [shape.rows, shape.chunk] batch (the rest padding)."""
    return pack_prefill_shards(plan, shape, num_slots, 1)[0]


def shard_rows(plan: SchedulerOutput, num_slots: int, shards: int) -> list[int]:
    """The row of each plan.prefill[i] within its data shard's block (shards == 1: i)."""
    per_shard = num_slots // shards
    seen = [0] * shards
    rows = []
    for c in plan.prefill:
        d = c.request.slot // per_shard
        rows.append(seen[d])
        seen[d] += 1
    return rows


def pack_prefill_shards(
    plan: SchedulerOutput, shape: PrefillShape, num_slots: int, shards: int
) -> tuple[PrefillBatch, list[int]]:
    """The plan's chunks as D = `shards` blocks of shape.rows rows ([D * rows, shape.chunk]),
    each chunk at most shape.chunk tokens long (`Resolved.prefill_shape` chose it so): block d
    holds the chunks of data shard d's slots, numbered locally (slot - d * S/D; S/D = padding).
    Returns (batch, packed row of each plan.prefill[i])."""
    per_shard = num_slots // shards
    batch = padding_batch(shape.rows * shards, per_shard, shape.chunk)
    local = shard_rows(plan, num_slots, shards)
    packed = []
    for c, row in zip(plan.prefill, local):
        d = c.request.slot // per_shard
        packed.append(d * shape.rows + row)
    for j, (i, c) in enumerate(zip(packed, plan.prefill)):
        req = c.request
        ids = req.all_token_ids
        batch.tokens[i, : c.length] = ids[c.start : c.start + c.length]
        batch.slots[i], batch.start[i], batch.length[i] = req.slot % per_shard, c.start, c.length
        batch.is_last[i] = c.is_last
        if plan.forced[j]:
            batch.forced[i] = req.output_token_ids[-1]  # complete: no token of it is in flight
        n_prompt = len(req.prompt_token_ids)
        if req.sampling_params.prompt_logprobs is not None and c.start + 1 < n_prompt:
            end = min(c.start + c.length, n_prompt - 1)
            batch.targets[i, : end - c.start] = req.prompt_token_ids[c.start + 1 : end + 1]
    return batch, packed


def move_arrays(moves: list[tuple[int, int]], num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Slot moves (from, to) as the i32[S] src/dst arrays of `slot_state.move` (S = padding)."""
    src = np.full((num_slots,), num_slots, np.int32)
    dst = src.copy()
    for i, (a, b) in enumerate(moves):
        src[i], dst[i] = a, b
    return src, dst
