"""Helpers for the post-training-quantization tests: tiny random params without compiling anything."""

import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.quant import calibration


def tiny_params(config: ModelConfig, seed: int = 0, dtype=jnp.float32) -> dict:
    """Like `llama.init_params` (normal std 0.02, norms at 1) but drawn with numpy: no XLA compile."""
    rng = np.random.default_rng(seed)

    def make(name, shape):
        if isinstance(shape, dict):
            return {k: make(k, v) for k, v in shape.items()}
        if "norm" in name:
            return jnp.ones(shape, dtype)
        return jnp.asarray(rng.normal(0.0, 0.02, size=shape).astype(np.float32), dtype)

    return {k: make(k, v) for k, v in llama.param_shapes(config).items()}


def hidden_states(params: dict, embed: jnp.ndarray, config: ModelConfig) -> jnp.ndarray:
    """Final hidden states of every layer of `params` (quantized weights dequantized) run over the
    embedded calibration windows `embed` f32[N, T, D] (no final norm, no logits)."""
    x = embed
    for i in range(config.num_layers):
        lp = calibration.float_view(calibration.layer_slice(params, i))
        x, _ = calibration.layer_forward(lp, x, config)
    return x
