"""Pallas kernels, one per file, each with its pure-jnp reference at the end of the same file."""
