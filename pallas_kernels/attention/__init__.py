"""Paged attention as one family (the shape of jax's `pallas/ops/tpu/ragged_paged_attention/`): every
backend's decode and prefill forms, their shared parts and tuned sizes, one module each."""
