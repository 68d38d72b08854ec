"""Speculative decoding in the runner: n-gram (prompt-lookup) drafts proposed, verified and
accepted in one step on the device (`spec_decode.speculate`).

    SpeculativeDecoding(...)
      .shapes() -> [(DecodeShape, drafts a row)]     what a speculative step may run (warm-up)
      .limits(plan, num_slots) -> i32[S]             the most tokens each slot may make
      (params, cache, state, limit, shape, drafts)   -> (cache, state, DecodeOutput of drafts + 1)

The scheduler plans a speculative step (`SchedulerOutput.speculative`) only when every decoding
row is greedy and plain; it counts each row's drafts + 1 tokens and gives the rows pages for them,
and `limits` hands the device those counts, so no row writes K/V past its pages and a row the plan
left out does not move.
"""

from __future__ import annotations

import numpy as np

from jaxserve.config import ModelConfig, SpeculativeConfig
from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.resolve import DecodeShape, Resolved
from jaxserve.runner import spec_decode


class SpeculativeDecoding:
    """The speculative step of an engine (`SpeculativeConfig.num_speculative_tokens`; none: it
    has no shapes and never runs)."""

    def __init__(
        self,
        speculative: SpeculativeConfig,
        resolved: Resolved,
        model_config: ModelConfig,
    ):
        self._config = speculative
        self._resolved = resolved
        self._options = resolved.compiler_options
        self._static = dict(
            config=model_config,
            impl=resolved.model,
            min_n=speculative.prompt_lookup_min,
            max_n=speculative.prompt_lookup_max,
        )

    def shapes(self) -> list[tuple[DecodeShape, int]]:
        """`Resolved.speculative_shapes`: the (shape, drafts) pairs a step may run (none without
        speculation)."""
        return self._resolved.speculative_shapes(self._config)

    @staticmethod
    def limits(plan: SchedulerOutput, num_slots: int) -> np.ndarray:
        """i32[num_slots]: the tokens the plan counted for each decoding slot (0 elsewhere)."""
        limit = np.zeros((num_slots,), np.int32)
        limit[plan.decode_slots] = plan.decode_steps
        return limit

    def __call__(self, params, cache, state, limit, shape: DecodeShape, drafts: int):
        """A speculative step of the first shape.rows slots, `drafts` a row."""
        fn = spec_decode.speculate.jit(self._options)
        return fn(params, cache, state, limit, shape=shape, num_spec=drafts, **self._static)
