"""Paged attention as one family, a package in the shape of jax's
`pallas/ops/tpu/ragged_paged_attention/`: every form of decode and prefill attention takes the
same arguments and is held to the same definition.

    paged_kv.py        the one paged-KV argument (`PagedKV`: pools, scales, layer), the input
                       checks and the logit options (window, soft-cap, scale); jax only
    reference.py       the pure-jnp definitions, `decode_reference` and `prefill_reference`,
                       which every backend's tests compare against; jax only
    triton_decode.py   the Pallas Triton kernels (flash-decoding; ragged chunked prefill) and
    triton_prefill.py  their CUDA lowering cases; triton_common.py their shared `pallas_call`
    mgpu_decode.py     the Pallas Mosaic GPU kernels (Hopper: TMA + wgmma), refusing what they
    mgpu_prefill.py    do not support (their Triton twins serve it); mgpu_common.py their K/V
                       page ring, online-softmax step and input check
    xla.py             the plain-XLA forms the CPU runs where the C++ kernels do not build
    tuning.py          the Triton and Mosaic GPU kernels' tuned tile sizes

The C++ CPU kernels (`cpu_kernels/paged_decode_attention.py`) take the same `PagedKV` and are held
to the same references. The engine picks a form per step in `jaxserve/layers/attention.py`.
"""
