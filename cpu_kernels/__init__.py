"""CPU kernels for XLA's CPU backend, in C++ through XLA's FFI: one kernel per file pair (`NAME.cc`
and `NAME.py`, the wrapper that compiles it on first use). The matmul's pure-jnp reference is in its
wrapper; the paged attention takes the attention family's `PagedKV` and is held to its references
(`pallas_kernels/attention/paged_kv.py`, `reference.py`: jax only, no GPU kernel)."""
