"""CPU kernels for XLA's CPU backend, in C++ through XLA's FFI: one kernel per file pair (`NAME.cc`
and `NAME.py`, the wrapper that compiles it on first use, with its pure-jnp reference)."""
