"""A dispatched step's device outputs (`StepHandle`) and their one trip to the host.

    StepHandle.of(plan)                      an empty handle for a plan's outputs
    handle.arrays()                          the arrays to bring back, under StepResult's names
    handle.start_copies()                    their device->host copies started (asynchronous)
    fetch_outputs(handle, shards, per_shard) -> {StepResult field: numpy array}, in the engine's
                                                indexing: decode [S, k, ...] by global slot,
                                                prefill / prompt rows in plan.prefill's order

One `jax.device_get` per step (a multi-host mesh gathers with `process_allgather`: every process
runs the same steps, so every process calls it). The decode scan stacks steps first, (k, S), and
comes back as (S, k); data-parallel rows (the first B slots of each shard, D blocks of prefill rows)
are put back at their global slots and plan order.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.runner import steps


@dataclasses.dataclass
class StepHandle:
    """A dispatched step's device outputs, not yet on the host."""

    decode: steps.DecodeOutput | None = None
    decode_top: bool = False  # some decoding request asked for top log-probs
    prefill: steps.PrefillOutput | None = None
    prefill_top: bool = False
    prefill_rows: list[int] | None = None  # packed row of each plan.prefill[i]
    # (plan, logits, shape) of a decode forward whose sampling waits for the step's grammar
    # masks (`ModelRunner.complete`)
    pending: tuple | None = None

    @classmethod
    def of(cls, plan: SchedulerOutput) -> StepHandle:
        """An empty handle for `plan`, knowing which of its parts bring back top log-probs
        (logprobs=0 too: the top entries give the sampled token's rank)."""
        return cls(
            decode_top=any(q.sampling_params.logprobs is not None for q in plan.decode),
            prefill_top=any(c.request.sampling_params.logprobs is not None for c in plan.prefill),
        )

    def start_copies(self) -> None:
        """Starts each output's device->host copy, to run as soon as the step is computed."""
        for x in self.arrays().values():
            if x.is_fully_addressable:  # (a multi-host step's outputs are gathered in fetch)
                x.copy_to_host_async()

    def arrays(self) -> dict[str, jax.Array]:
        """The arrays to bring back, under StepResult's field names."""
        out = {}
        if self.decode is not None:
            d = self.decode
            out.update(decode_tokens=d.tokens, decode_valid=d.valid, decode_logprobs=d.logprobs)
            if self.decode_top:
                out.update(
                    decode_top_ids=d.top_ids,
                    decode_top_logprobs=d.top_logprobs,
                    decode_ranks=d.ranks,
                )
        if self.prefill is not None:
            p = self.prefill
            out.update(prefill_tokens=p.tokens, prefill_logprobs=p.logprobs)
            if self.prefill_top:
                out.update(
                    prefill_top_ids=p.top_ids,
                    prefill_top_logprobs=p.top_logprobs,
                    prefill_ranks=p.ranks,
                )
            if p.prompt is not None:
                out.update(
                    prompt_logprobs=p.prompt.logprobs,
                    prompt_top_ids=p.prompt.top_ids,
                    prompt_top_logprobs=p.prompt.top_logprobs,
                    prompt_ranks=p.prompt.ranks,
                )
        return out


def fetch_outputs(handle: StepHandle, data_shards: int, slots_per_shard: int) -> dict:
    """The handle's outputs on the host ({} when the step ran nothing)."""
    arrays = handle.arrays()
    if not arrays:
        return {}
    host = _to_host(arrays)
    for name in ("tokens", "valid", "logprobs", "ranks"):
        if "decode_" + name in host:  # scan stacks steps first: (k, S) -> (S, k)
            host["decode_" + name] = np.asarray(host["decode_" + name]).T
    for name in ("top_ids", "top_logprobs"):
        if "decode_" + name in host:
            host["decode_" + name] = np.asarray(host["decode_" + name]).transpose(1, 0, 2)
    if data_shards > 1:
        _to_global_rows(host, handle, data_shards, slots_per_shard)
    return host


def _to_host(arrays: dict[str, jax.Array]) -> dict:
    """Device arrays -> numpy. Arrays spanning other processes' devices (a multi-host mesh) are
    gathered: every process runs the same steps, so every process calls this collective."""
    if all(x.is_fully_addressable for x in arrays.values()):
        return jax.device_get(arrays)
    from jax.experimental import multihost_utils

    return {
        k: np.asarray(v) for k, v in multihost_utils.process_allgather(arrays, tiled=True).items()
    }


def _to_global_rows(host: dict, handle: StepHandle, d: int, per: int) -> None:
    """Data-parallel outputs in the engine's indexing: decode rows [D*B] (the first B slots of each
    shard) -> global slots [S]; prefill rows [D*R] -> plan.prefill's order."""
    for name, x in host.items():
        x = np.asarray(x)
        if name.startswith("decode_"):
            b = x.shape[0] // d
            full = np.zeros((d, per, *x.shape[1:]), x.dtype)
            full[:, :b] = x.reshape(d, b, *x.shape[1:])
            host[name] = full.reshape(d * per, *x.shape[1:])
        else:  # prefill_* and prompt_*: rows of the packed blocks
            host[name] = x[handle.prefill_rows]
