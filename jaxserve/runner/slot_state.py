"""The slot state of the device (`SlotState`: each slot's newest token, lengths, page table,
sampling row, LoRA slot) and JetStream's slot API over it, the jitted updates the runner applies
before a step's forward pass:

    init_slot_state(num_slots, max_pages, vocab_size, history_len) -> SlotState
    insert(state, slot, row, ...)     one request's sampling row and counters into slot `slot`
    sync(state, page_table, active)   the host's page table and decode mask
    set_grammar(state, bitmask, rows) the step's structured-output masks (constrained slots only)
    move(state, src, dst)             slot rows src[i] -> dst[i] (the scheduler packing requests)
    take_rows / set_rows              slots [0, rows) of the state, for a step over fewer rows

The state is donated to every update, so XLA writes it in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxserve.parallel.partition import pin_slots
from jaxserve.runner import sampling, token_history
from jaxserve.runner.jit_step import step


@struct.dataclass
class SlotState:
    last_token: jax.Array  # i32[S]  newest token, not yet in the cache (the next decode feeds it)
    seq_len: jax.Array  # i32[S]  tokens whose K/V are cached = position of last_token
    max_total_len: jax.Array  # i32[S]  decoding stops when prompt + output reach this
    num_generated: jax.Array  # i32[S]  output tokens so far (the step of the sampling key)
    active: jax.Array  # bool[S]  the slot decodes
    page_table: jax.Array  # i32[S, max_pages_per_seq]
    sampling: sampling.SamplingState  # [S, ...] per-slot sampling parameters, keys, counts
    # i32[S, L]: every token of the slot's sequence at its position, prompt and output (what the
    # n-gram proposer of `spec_decode.py` searches), L = max_model_len; None (no leaf) unless the
    # engine speculates
    history: jax.Array | None
    lora: jax.Array  # i32[S]  the slot's LoRA adapter slot (`layers/lora.py`), -1 = none


def init_slot_state(
    num_slots: int, max_pages: int, vocab_size: int, history_len: int = 0
) -> SlotState:
    """history_len: max_model_len when the engine speculates (`SlotState.history`), else 0."""
    zeros = lambda: jnp.zeros((num_slots,), jnp.int32)  # distinct buffers: the state is donated
    return SlotState(
        last_token=zeros(),
        seq_len=zeros(),
        max_total_len=zeros(),
        num_generated=zeros(),
        active=jnp.zeros((num_slots,), bool),
        page_table=jnp.zeros((num_slots, max_pages), jnp.int32),
        sampling=sampling.init_state(num_slots, vocab_size),
        history=jnp.zeros((num_slots, history_len), jnp.int32) if history_len else None,
        lora=jnp.full((num_slots,), -1, jnp.int32),
    )


@step(donate_argnames=("state",))
def insert(state: SlotState, slot, row, num_generated, max_total_len, lora=-1) -> SlotState:
    """JetStream `insert`: one request's row into slot `slot` (i32[]); the slot stays inactive.
    lora: the request's adapter slot (i32[], -1 = none)."""
    return pin_slots(
        state.replace(
            sampling=sampling.set_slot(state.sampling, slot, row),
            num_generated=state.num_generated.at[slot].set(num_generated),
            max_total_len=state.max_total_len.at[slot].set(max_total_len),
            seq_len=state.seq_len.at[slot].set(0),
            active=state.active.at[slot].set(False),
            history=token_history.set_row(state.history, slot, row),
            lora=state.lora.at[slot].set(lora),
        )
    )


@step(donate_argnames=("state",))
def sync(state: SlotState, page_table, active) -> SlotState:
    """Installs the host's page table i32[S, max_pages] and decode mask bool[S]."""
    return pin_slots(state.replace(page_table=page_table, active=active))


@step(donate_argnames=("state",))
def set_grammar(state: SlotState, bitmask, rows) -> SlotState:
    """Installs this step's grammar masks i32[S, ceil(V / 32)] and constrained slots bool[S]."""
    masks = state.sampling.replace(grammar_mask=bitmask, constrained=rows)
    return pin_slots(state.replace(sampling=masks))


@step(donate_argnames=("state",))
def move(state: SlotState, src, dst) -> SlotState:
    """Copies slot rows src[i] -> dst[i] (i32[S] each; dst = S marks padding, dropped)."""
    s = state.last_token.shape[0]
    moved = jax.tree.map(lambda a: a.at[dst].set(a[jnp.minimum(src, s - 1)], mode="drop"), state)
    return pin_slots(moved)


def take_rows(state: SlotState, rows: int) -> SlotState:
    """Slots [0, rows) of the state (all of it when rows covers every slot)."""
    if rows < state.last_token.shape[0]:
        return jax.tree.map(lambda a: a[:rows], state)
    return state


def set_rows(full: SlotState, part: SlotState) -> SlotState:
    """`full` with slots [0, rows) replaced by `part`'s."""
    rows = part.last_token.shape[0]
    if rows < full.last_token.shape[0]:
        return jax.tree.map(lambda f, b: f.at[:rows].set(b), full, part)
    return part
