"""`ModelRunner.warmup`: every program a step can run, compiled once before the first request.

    warmup(runner) -> seconds

Compiles the slot updates (insert, move, set_grammar; a LoRA slot's rewrite), every decode shape
(`Resolved.decode_shapes`), every speculative shape, and every prefill shape, with every row
padding (no slot active, no valid chunk), so the state is left as it was; then records the
largest programs' XLA workspace (`memory.workspace_bytes`). After it nothing recompiles
(tests/runner/test_runner.py). Part of the runner: it drives the runner's own host mirrors.
"""

from __future__ import annotations

import logging
import time

import jax
import numpy as np

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.slot_row import make_slot_row
from jaxserve.core.structured_outputs import GrammarMasks
from jaxserve.runner import memory, slot_state

logger = logging.getLogger(__name__)


def warmup(runner) -> float:
    """Compiles every step program of `runner` (a `ModelRunner`, on its mesh); returns seconds."""
    t0 = time.perf_counter()
    r, s = runner.resolved, runner.num_slots
    saved = runner._active.copy()
    runner._active[:] = False
    runner._dirty = True
    runner._flush()
    max_len = runner.config.scheduler.max_model_len
    row = make_slot_row(SamplingParams(), [0], [], (), 0, max_len)
    runner.state = runner._jit(slot_state.insert)(
        runner.state, np.int32(0), row, np.int32(0), np.int32(0), np.int32(-1)
    )
    if runner.lora is not None:  # slot 0's weights rewritten as they are (compiles the load)
        runner.params = {**runner.params, "lora": runner.lora.rewrite(runner.params["lora"], 0)}
    pad = np.full((s,), s, np.int32)
    runner.state = runner._jit(slot_state.move)(
        runner.state, pad, pad
    )  # every row padding: no move
    words = -(-runner.model_config.vocab_size // 32)
    no_grammar = GrammarMasks(np.full((s, words), -1, np.int32), np.zeros((s,), bool))
    runner.state = runner.structured.install(runner.state, no_grammar)
    decode, prefill = r.decode_shapes(), r.prefill_shapes()
    for shape in decode:
        runner.generate(shape)
    speculative = runner.speculative_shapes()
    for shape, drafts in speculative:
        runner.speculate(shape, np.zeros((s,), np.int32), drafts)
    for shape in prefill:
        runner.prefill(runner.shards.padding_batch(shape), shape)
    runner._active[:] = saved
    runner._dirty = True
    runner._flush()
    jax.block_until_ready(runner.state)
    runner.workspace_bytes = memory.workspace_bytes(runner, decode[-1], prefill[-1])
    dt = time.perf_counter() - t0
    logger.info(
        "warm-up: %d decode, %d speculative and %d prefill programs in %.1f s",
        len(decode),
        len(speculative),
        len(prefill),
        dt,
    )
    logger.info(memory.describe(runner.memory_plan()))
    return dt
