"""How a prefill step runs: as one program, or as two, the forward then the sampling.

    splits(resolved, data_parallel_size) -> bool     whether the prefill step is two programs
    PrefillStrategy(...)
      .splits                                        that decision, for this engine
      (params, cache, state, batch, want_top, shape) -> (cache, state, PrefillOutput)
      .lower(params, cache, state, batch, shape)     its largest program, lowered

With page-table width buckets (a GPU's 8-10) on one device group, a prefill step is
`steps.prefill_forward` (one program per rows x width) then `steps.prefill_sample` (one per rows),
which equal `steps.prefill`: the sampler is compiled once per row bucket instead of into every
width's program (JOURNAL.md 45: 'ragged' on CPU warms up in 0.53-0.55x the time). With one width
(the C++ CPU kernel) it would save nothing and cost a program launch per step, and data shards run
one SPMD program (`data_parallel.prefill`), so those prefill steps stay one program.
"""

from __future__ import annotations

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.resolve import PrefillShape, Resolved
from jaxserve.runner import device_state, steps
from jaxserve.runner.data_shards import DataShards


def splits(resolved: Resolved, data_parallel_size: int) -> bool:
    """Whether a prefill step runs as two programs: one device group, several widths."""
    return data_parallel_size == 1 and len({s.width for s in resolved.prefill_shapes()}) > 1


class PrefillStrategy:
    """The prefill step (see the module doc): `shards`' one-program step (`steps.prefill`, or
    `data_parallel.prefill` over data shards) or the two, each compiled with the engine's XLA
    options; mesh: where a split step's batch is put (None: one device)."""

    def __init__(self, resolved: Resolved, model_config: ModelConfig, shards: DataShards, mesh):
        self.splits = splits(resolved, shards.count)
        self._prefill = shards.steps.prefill
        self._model = dict(config=model_config, impl=resolved.model)
        self._options = resolved.compiler_options
        self._mesh = mesh

    def __call__(self, params, cache, state, batch, want_top: bool, shape: PrefillShape):
        """One prefill step of `batch` -> (cache, state, PrefillOutput)."""
        want_top = np.bool_(want_top)
        if not self.splits:
            fn = self._prefill.jit(self._options)
            return fn(params, cache, state, batch, want_top, shape=shape, **self._model)
        batch = device_state.on_device(batch, self._mesh)  # both programs read one transfer
        forward = steps.prefill_forward.jit(self._options)
        cache, logits, prompt = forward(params, cache, state, batch, shape=shape, **self._model)
        rows = batch.replace(tokens=None, targets=None)  # [R] fields only: one program for every T
        sample = steps.prefill_sample.jit(self._options)
        state, out = sample(state, rows, logits, want_top, num_top=shape.num_top)
        return cache, state, out.replace(prompt=prompt)

    def lower(self, params, cache, state, batch, shape: PrefillShape):
        """The prefill step's largest program (the forward, where there are two), lowered."""
        if self.splits:
            batch = device_state.on_device(batch, self._mesh)
            fn = steps.prefill_forward.jit(self._options)
            return fn.lower(params, cache, state, batch, shape=shape, **self._model)
        fn = self._prefill.jit(self._options)
        return fn.lower(params, cache, state, batch, np.bool_(False), shape=shape, **self._model)
