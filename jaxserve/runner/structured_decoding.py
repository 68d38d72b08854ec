"""Structured outputs on the device (the host side: `core/structured_outputs.py`): a step's grammar
masks into the slot state, and the decode step made so that they may come late.

    overlaps(data_parallel_size, decode_steps) -> bool    whether the decode step is two programs
    StructuredDecoding(...)
      .overlaps                                           that decision, for this engine
      .install(state, masks) -> state                     `slot_state.set_grammar`: the masks of
                                                          the step's constrained rows
      .decode(params, cache, state, want_top, shape)      -> (cache, state, DecodeOutput)
      .forward(params, cache, state, shape)               -> (cache, logits): the first program
      .sample(state, logits, want_top, shape)             -> (state, DecodeOutput): the second

The host computes a step's masks from the tokens of the step before, once the step is planned. With
one token a step on one device group (`overlaps`), every decode step runs as two programs, the
forward then the sampling (`steps.decode_forward` / `decode_sample`, equal to `generate`'s one
step), so a step with constrained rows can queue its forward before the masks exist and sample
once they are in (vLLM's overlap: `ModelRunner.dispatch(plan, masks_later=True)`, then
`complete(handle, masks)`). Otherwise a decode step is one program (`generate`: decode_steps
tokens in a scan, or every data shard's at once, neither with a seam before its sampling), and the
masks go in before it.
"""

from __future__ import annotations

import numpy as np

from jaxserve.config import ModelConfig, SchedulerConfig
from jaxserve.core.structured_outputs import GrammarMasks
from jaxserve.resolve import DecodeShape, Resolved
from jaxserve.runner import slot_state, steps
from jaxserve.runner.data_shards import DataShards


def overlaps(data_parallel_size: int, decode_steps: int) -> bool:
    """Whether a decode step runs as two programs (forward, then sampling), so that its grammar
    masks may come while the forward runs: one token a step, one device group."""
    return data_parallel_size == 1 and decode_steps == 1


class StructuredDecoding:
    """The grammar masks' way into a step, and the decode step's program(s) (see the module doc):
    `shards`' one-program step (`steps.generate`, or `data_parallel.generate` over data shards)
    or the two, each compiled with the engine's XLA options."""

    def __init__(
        self,
        scheduler: SchedulerConfig,
        resolved: Resolved,
        model_config: ModelConfig,
        shards: DataShards,
    ):
        self.overlaps = overlaps(shards.count, scheduler.decode_steps)
        self._generate = shards.steps.generate
        self._num_steps = scheduler.decode_steps
        self._model = dict(config=model_config, impl=resolved.model)
        self._options = resolved.compiler_options

    def install(self, state, masks: GrammarMasks):
        """The state with `masks` as the step's grammar masks (one host->device transfer)."""
        return slot_state.set_grammar.jit(self._options)(state, masks.bitmask, masks.rows)

    def decode(self, params, cache, state, want_top: bool, shape: DecodeShape):
        """One decode step of the first shape.rows slots -> (cache, state, DecodeOutput)."""
        if self.overlaps:
            cache, logits = self.forward(params, cache, state, shape)
            state, out = self.sample(state, logits, want_top, shape)
            return cache, state, out
        return self._generate.jit(self._options)(
            params,
            cache,
            state,
            np.bool_(want_top),
            shape=shape,
            num_steps=self._num_steps,
            **self._model,
        )

    def forward(self, params, cache, state, shape: DecodeShape):
        """The decode step's forward -> (cache, logits f32[rows, V]); the state is only read."""
        if not self.overlaps:
            raise ValueError("this runner's decode step is one program: masks come before it")
        fn = steps.decode_forward.jit(self._options)
        return fn(params, cache, state, shape=shape, **self._model)

    def sample(self, state, logits, want_top: bool, shape: DecodeShape):
        """The decode step's sampling from `forward`'s logits, under the installed masks."""
        fn = steps.decode_sample.jit(self._options)
        return fn(state, logits, np.bool_(want_top), num_top=shape.num_top)

    def lower(self, params, cache, state, shape: DecodeShape):
        """The decode step's largest program (the forward, where there are two), lowered."""
        if self.overlaps:
            fn = steps.decode_forward.jit(self._options)
            return fn.lower(params, cache, state, shape=shape, **self._model)
        return self._generate.jit(self._options).lower(
            params,
            cache,
            state,
            np.bool_(False),
            shape=shape,
            num_steps=self._num_steps,
            **self._model,
        )
