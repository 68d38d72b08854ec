"""`jaxserve.resolve`: every backend-dependent choice and shape bucket, made once on the host."""

from __future__ import annotations

import pytest

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.resolve import (
    AUTO_CPU_MATMUL,
    DecodeShape,
    PrefillShape,
    bucket_for,
    pow2_buckets,
    resolve,
)

TINY = ModelConfig.preset("tiny")


def resolved(backend="cpu", cpu_kernel=False, cpu_matmul=None, **kw):
    config = EngineConfig(**kw).for_model(TINY)
    return resolve(config, TINY, backend, cpu_kernel=cpu_kernel, cpu_matmul=cpu_matmul)


def test_a_head_dim_the_gpu_kernels_cannot_tile_takes_xlas_gather_on_gpu():
    """Phi-3-mini's heads are 96 wide; the Triton kernels tile powers of two ('mgpu' hands them
    what its Mosaic kernels refuse). On GPU 'auto' takes 'reference' (XLA's gather); an
    explicit 'pallas' or 'mgpu' is refused at build, naming head_dim, not at the first trace."""
    phi = ModelConfig.preset("phi3-mini")

    def gpu(**kw):
        return resolve(EngineConfig(max_model_len=512, **kw).for_model(phi), phi, "gpu")

    assert gpu().model.attention == "reference"
    for impl in ("pallas", "mgpu", "pallas_interpret"):
        with pytest.raises(ValueError, match="power-of-two head_dim, got 96"):
            gpu(attention_impl=impl)
    assert gpu(attention_impl="ragged").model.attention == "ragged"
    assert resolved("gpu").model.attention == "pallas"  # a 16-wide head: the kernels


def test_backend_choices():
    cpu, gpu = resolved("cpu"), resolved("gpu")
    assert (cpu.model.attention, gpu.model.attention) == ("ragged", "pallas")
    assert (cpu.quant_matmul, gpu.quant_matmul) == ("xla", "pallas")
    assert (cpu.weight_layout, gpu.weight_layout) == ("out_in", "fused")
    # fused q/k/v and gate/up stacks on GPU only on one model shard
    config = EngineConfig(tensor_parallel_size=2).for_model(TINY)
    assert resolve(config, TINY, "gpu").weight_layout == "in_out"
    assert (cpu.model.min_matmul_rows, gpu.model.min_matmul_rows) == (4, 2)
    assert (cpu.model.moe_matmul, gpu.model.moe_matmul) == ("tiled", "ragged_dot")
    # an explicit attention implementation wins on any backend
    assert resolved("gpu", attention_impl="reference").model.attention == "reference"
    assert resolved("cpu", attention_impl="pallas_interpret").model.attention == "pallas_interpret"
    assert resolved("gpu").max_flat == 0  # flat-page buckets are the 'ragged' path's only
    # the quantized weights' kernels: Triton by default on GPU, Mosaic GPU when asked
    assert resolved("gpu", quant_matmul_impl="mgpu").quant_matmul == "mgpu"
    assert resolved("cpu", quant_matmul_impl="mgpu_interpret").quant_matmul == "mgpu_interpret"


def test_quantized_experts_take_the_tiled_kernels_on_gpu():
    """The mixture of experts' path: 'tiled' on CPU whatever the weights; on GPU 'ragged_dot' for
    float experts and 'kernel' for quantized ones whose matmul is a kernel (one tiled launch per
    weight, each expert read in place), 'ragged_dot' again when that matmul is XLA's."""

    def moe(backend, plain, **kw):
        config = EngineConfig(**kw).for_model(TINY)
        return resolve(config, TINY, backend, plain_weights=plain).model.moe_matmul

    assert moe("cpu", False) == moe("cpu", True) == "tiled"
    assert moe("gpu", True) == "ragged_dot"
    assert moe("gpu", False) == moe("gpu", False, quant_matmul_impl="mgpu") == "kernel"
    assert moe("gpu", False, quant_matmul_impl="xla") == "ragged_dot"


def test_cpu_kernel_attention():
    """'auto' on CPU is the C++ kernel where it built (the runner says), else 'ragged'; asking for
    'cpu_kernel' where it cannot run is an error. Its decode programs: one per slot bucket, with
    the whole page table (the kernel reads each row's own pages, whatever the width)."""
    r = resolved("cpu", cpu_kernel=True, num_slots=32, max_model_len=512, page_size=16)
    assert r.model.attention == "cpu_kernel" and r.max_flat == 0 and not r.ragged
    assert resolved("gpu", cpu_kernel=True).model.attention == "pallas"
    assert resolved("cpu", cpu_kernel=True, attention_impl="ragged").model.attention == "ragged"
    assert r.decode_shapes() == [DecodeShape(b, 32, 0) for b in (1, 4, 8, 12, 16, 24, 32)]
    assert r.decode_shape(2, [3, 5, 1]) == DecodeShape(4, 32, 0)
    assert r.decode_shape(20, [32] * 21) == DecodeShape(24, 32, 0)
    assert r.decode_shape(24, [32] * 25) == DecodeShape(32, 32, 0)
    with pytest.raises(ValueError, match="max_pages_per_seq"):
        r.decode_shape(0, [33])
    for backend, built in (("cpu", False), ("gpu", True)):
        with pytest.raises(ValueError, match="cpu_kernel"):
            resolved(backend, cpu_kernel=built, attention_impl="cpu_kernel")


def test_cpu_matmul():
    """'auto' dense matmuls on CPU are the C++ kernel (for every batch size) where it can run
    with a loop in AUTO_CPU_MATMUL (the runner says which loop), for bf16 weights; else XLA's dot.
    An explicit 'cpu_kernel' runs any loop. Asking for it where it cannot run, or for f32
    weights, is an error."""
    for path in ("avx512bf16", "avx2", "portable"):
        assert resolved("cpu", cpu_matmul=path).model.cpu_matmul == (path in AUTO_CPU_MATMUL)
        assert resolved("cpu", cpu_matmul=path, matmul_impl="cpu_kernel").model.cpu_matmul
        assert not resolved("cpu", cpu_matmul=path, matmul_impl="xla").model.cpu_matmul
        assert not resolved("cpu", cpu_matmul=path, dtype="float32").model.cpu_matmul
        assert not resolved("gpu", cpu_matmul=path).model.cpu_matmul
    assert set(AUTO_CPU_MATMUL) == {"avx512bf16", "avx2"}  # not the portable loop
    assert not resolved("cpu", cpu_matmul=None).model.cpu_matmul
    for backend, path, dtype in (("cpu", None, "bfloat16"), ("gpu", "avx2", "bfloat16"),
                                 ("cpu", "avx2", "float32")):  # fmt: skip
        with pytest.raises(ValueError, match="matmul_impl='cpu_kernel'"):
            resolved(backend, cpu_matmul=path, matmul_impl="cpu_kernel", dtype=dtype)


def test_slot_buckets():
    assert resolved("cpu", num_slots=32).slot_buckets == (1, 4, 8, 12, 16, 24, 32)
    assert resolved("cpu", num_slots=20).slot_buckets == (1, 4, 8, 12, 16, 20)
    assert resolved("cpu", num_slots=64).slot_buckets[-3:] == (32, 48, 64)
    assert resolved("cpu", num_slots=4).slot_buckets == (1, 4)
    assert resolved("cpu", num_slots=1).slot_buckets == (1,)
    assert resolved("gpu", num_slots=32).slot_buckets == (32,)
    assert resolved("gpu", num_slots=6, slot_buckets=[2, 6]).slot_buckets == (2, 6)


def test_width_and_prefill_row_buckets():
    # max_model_len 512 in pages of 16: 32 pages per sequence
    r = resolved("gpu", max_model_len=512, page_size=16, prefill_chunk_size=64)
    assert r.widths == (1, 2, 4, 8, 16, 32)
    assert r.prefill_rows == (1, 2, 4, 8)  # 512-token budget / 64-token chunks
    assert r.width_for(1) == 1 and r.width_for(5) == 8 and r.width_for(32) == 32
    with pytest.raises(ValueError, match="max_pages_per_seq"):
        r.width_for(33)
    assert r.chunks == (64,)  # one chunk length off the CPU
    assert r.prefill_shape(3, 10, 5, False) == PrefillShape(4, 64, 8, False)
    # prompt log-probs: one row alone, else all rows
    assert r.prompt_logprob_rows == (1, 8)
    assert r.prefill_shape(1, 10, 5, True) == PrefillShape(1, 64, 8, True)
    assert r.prefill_shape(2, 64, 5, True) == PrefillShape(8, 64, 8, True)
    with pytest.raises(ValueError, match="exceeds the chunk length"):
        r.prefill_shape(1, 65, 5, False)


def test_cpu_prefill_chunk_lengths():
    """On CPU a step whose chunks all fit max(page_size, chunk / 4) tokens runs the short
    program; prompt log-probs always run the full chunk."""
    r = resolved("cpu", max_model_len=512, page_size=16, prefill_chunk_size=64)
    assert r.chunks == (16, 64) and r.chunk == 64
    assert r.prefill_shape(1, 1, 3, False).chunk == 16
    assert r.prefill_shape(3, 16, 3, False).chunk == 16
    assert r.prefill_shape(3, 17, 3, False).chunk == 64
    assert r.prefill_shape(1, 5, 3, True).chunk == 64
    shapes = r.prefill_shapes()
    assert {(s.chunk, s.prompt_logprobs) for s in shapes} == {(16, False), (64, False), (64, True)}
    assert len(shapes) == len(r.widths) * (2 * len(r.prefill_rows) + len(r.prompt_logprob_rows))
    # a chunk no longer than a page keeps one length
    assert resolved("cpu", max_model_len=512, page_size=16, prefill_chunk_size=16).chunks == (16,)
    assert resolved("cpu", max_model_len=512, page_size=4, prefill_chunk_size=32).chunks == (8, 32)


def test_flat_buckets_cover_every_decode_step():
    assert pow2_buckets(100, start=8) == (8, 16, 32, 64, 100)
    assert pow2_buckets(3, start=8) == (3,)
    assert [bucket_for(n, (8, 16, 32, 64, 100)) for n in (0, 8, 9, 33, 99, 100)] == [
        8,
        8,
        16,
        64,
        100,
        100,
    ]
    # Every decode step's page references fit its flat bucket, whatever the pool: a page shared
    # through the prefix cache is listed once per request, so the references can exceed the pool
    # (issue 24: capping the buckets at num_pages dropped pages and gave wrong tokens).
    for num_pages in (3, 8, 9, 4096):
        r = resolved("cpu", num_slots=4, max_model_len=256, page_size=16, num_pages=num_pages)
        shapes = set(r.decode_shapes())
        for max_slot in range(4):
            for per_row in range(r.max_pages + 1):
                pages = [per_row] * (max_slot + 1)
                shape = r.decode_shape(max_slot, pages)
                assert shape in shapes and shape.num_flat >= sum(pages)


def test_decode_shape_follows_the_rows_and_pages():
    cpu = resolved("cpu", num_slots=32, max_model_len=512, page_size=16)
    assert cpu.decode_shape(2, [3, 5, 1]) == DecodeShape(4, 32, 16)  # 9 live pages -> 16
    assert cpu.decode_shape(20, [1] * 21) == DecodeShape(24, 32, 32)
    assert cpu.decode_shape(0, [7]) == DecodeShape(1, 32, 8)
    gpu = resolved("gpu", num_slots=32, max_model_len=512, page_size=16)
    assert gpu.decode_shape(2, [3, 5, 1]) == DecodeShape(32, 8, 0)  # width of the longest
    # Data parallel: each shard's program lists its own rows' pages, so the bucket follows the
    # fullest shard, not the sum over shards (which can exceed one shard's largest bucket).
    shard = resolved("cpu", num_slots=2, max_model_len=32, page_size=8)  # one shard of 2 slots
    assert shard.decode_shape(1, [4, 4, 1, 0], live=8) == DecodeShape(2, 4, 8)
    with pytest.raises(ValueError, match="9 live pages exceed"):
        shard.decode_shape(1, [4, 4, 1, 0])


def test_step_shapes_counts():
    """The warm-up list: a decode shape per (slot bucket, width or flat bucket), a prefill shape
    per (width, row bucket) plus two prompt log-probs variants per width (1 row, all rows)."""
    r = resolved("gpu", num_slots=32, max_model_len=512, page_size=4, prefill_chunk_size=64)
    assert len(r.decode_shapes()) == 1 * 8  # 128 pages: widths 1, 2, ..., 128
    assert len(r.prefill_shapes()) == 8 * (4 + 2)
    assert len(set(r.decode_shapes() + r.prefill_shapes())) == 56


def test_resolve_needs_a_filled_config():
    with pytest.raises(ValueError, match="for_model"):
        resolve(EngineConfig(), TINY, "cpu")
