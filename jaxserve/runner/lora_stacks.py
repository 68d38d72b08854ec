"""An engine's LoRA adapter stacks on the device (`layers/lora.py`): allocated and split over the
mesh like their base weights, and each adapter written into its slot in place.

    lora = LoRAStacks(params, model_config, lora_config, mesh, kv_cols)  (ModelRunner, with its
                                                   blueprint's model config and KV columns)
    params["lora"] = lora.stacks                 zeros, every slot
    params["lora"] = lora.write(params["lora"], slot, adapter)    one program, any slot / adapter
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxserve.config import LoRAConfig, ModelConfig
from jaxserve.layers import lora as lora_layers
from jaxserve.models.params import model_dtype
from jaxserve.parallel import partition


class LoRAStacks:
    def __init__(
        self,
        params,
        model_config: ModelConfig,
        lora_config: LoRAConfig,
        mesh,
        kv_cols: np.ndarray | None,
    ):
        """model_config: the runner's (KV heads replicated up to T where T exceeds them);
        kv_cols: `partition.kv_columns` of the checkpoint's config, or None: an adapter's wk / wv
        columns are copied the same way when it is written."""
        c = lora_config
        self.model_config, self.max_rank, self.kv_cols = model_config, c.max_lora_rank, kv_cols

        def init():
            return lora_layers.init(model_config, c.max_loras, c.max_lora_rank, model_dtype(params))

        if mesh is None:
            self.stacks = init()
        else:  # each factor split with its base weight (`partition.lora_specs`)
            specs = partition.lora_specs(jax.eval_shape(init))
            self.stacks = jax.jit(init, out_shardings=partition.named(mesh, specs))()
        # the stacks donated and updated in place, kept split as they are
        self._set = jax.jit(
            lora_layers.set_slot,
            donate_argnums=0,
            out_shardings=jax.tree.map(lambda a: a.sharding, self.stacks),
        )

    def write(self, stacks: dict, slot: int, adapter) -> dict:
        """`stacks` with adapter `adapter` (a `lora.peft.LoRAAdapter`; None: zeros) in `slot`."""
        if adapter is not None and self.kv_cols is not None:  # KV heads replicated: wk / wv too
            adapter = dataclasses.replace(
                adapter,
                weights={
                    n: (a, b[..., self.kv_cols] if n in ("wk", "wv") else b)
                    for n, (a, b) in adapter.weights.items()
                },
            )
        weights = lora_layers.slot_arrays(adapter, self.model_config, self.max_rank, np.float32)
        return self._set(stacks, np.int32(slot), weights)

    def rewrite(self, stacks: dict, slot: int) -> dict:
        """`stacks` with slot `slot` written as it is (warm-up: compiles `write`'s program)."""
        return self._set(stacks, np.int32(slot), lora_layers.get_slot(stacks, slot))
