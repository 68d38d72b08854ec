"""`runner.blueprint`: the GPU's fused weight layout is chosen only where it fits."""

import jax
import jax.numpy as jnp
import pytest

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.models import llama
from jaxserve.runner.blueprint import blueprint

GIB = 2**30


@pytest.mark.parametrize("memory_gib,layout", [(40, "fused"), (20, "in_out")])
def test_the_gpu_fuses_q_k_v_and_gate_up_only_where_the_fused_stack_fits(memory_gib, layout):
    """Llama-3-8B bf16 on one GPU: 15.0 GiB of weights, and the fused gate/up stack (7.0 GiB)
    is written while the separate stacks still live. A device of 40 GiB gets the fused layout
    (4 GEMMs a layer); one of 20 GiB keeps the weights as loaded instead of failing to lay
    them out."""
    c = ModelConfig.preset("llama3-8b")
    params = jax.eval_shape(lambda k: llama.init_params(c, k, jnp.bfloat16), jax.random.key(0))
    e = EngineConfig(num_slots=1, max_model_len=256, num_pages=16).for_model(c)
    b = blueprint(
        params,
        c,
        e,
        backend="gpu",
        device_kind="NVIDIA H100 80GB HBM3",
        memory_bytes=memory_gib * GIB,
    )
    assert b.resolved.weight_layout == layout
