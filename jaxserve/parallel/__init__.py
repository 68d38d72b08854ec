"""Tensor and data parallelism over a `jax.sharding.Mesh` (axes 'data' x 'model').

    mesh.py       make_mesh(tensor_parallel_size, data_parallel_size), the size checks
    partition.py  the partition rules (one table keyed like the params), placing params and the
                  KV pool on their devices, replicating KV heads when T exceeds them

One SPMD program: the runner places the params and the pool with `NamedSharding`s and runs the
jitted steps under `jax.set_mesh(mesh)`; XLA partitions the plain matmuls and inserts the
collectives. What XLA cannot partition runs per device under `jax.shard_map`: the attention
(`layers/attention.py`: heads are split) and the quantized matmuls (`jaxserve.quant`).
"""
