"""Pallas kernels, one per file: the matmuls each with its pure-jnp reference at the end of the same
file; paged attention as one family in `attention/` (one `PagedKV` argument, one shared reference
module for every backend)."""
