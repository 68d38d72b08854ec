"""Quantized weights under tensor parallelism: the shard-aware INT4 layout, partition specs, exact
column selection, and (in a 4-device subprocess, `tp_worker.py`) matmul and take on a mesh."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxserve.quant import int4
from jaxserve.quant.int8 import Int8Weight, quantize_fp8, quantize_int8
from pallas_kernels import int4_layout

REPO = Path(__file__).resolve().parents[2]


def _int4(rng, lead=(), k=128, n=64, g=32, shards=1):
    codes = rng.integers(0, 16, size=(*lead, k, n), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, size=(*lead, k // g, n)).astype(np.float32)
    mins = rng.uniform(-1.0, 0.0, size=(*lead, k // g, n)).astype(np.float32)
    return codes, int4.pack(codes, scales, mins, g, shards=shards)


def _same(a, b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_shards_1_is_the_plain_layout_bit_for_bit():
    codes, w = _int4(np.random.default_rng(0), n=32)
    packed = np.asarray(w.packed)
    n8 = 32 // 8
    for k in range(0, 128, 17):
        for c in range(n8):
            for j in range(8):
                assert (int(packed[k, c]) >> (4 * j)) & 0xF == codes[k, j * n8 + c]
    _same(int4_layout.pack_codes(jnp.asarray(codes)), packed)
    assert w.shards == 1


@pytest.mark.parametrize("shards", [2, 4])
def test_a_shard_slice_is_a_shards_1_weight_of_its_columns(shards):
    codes, w = _int4(np.random.default_rng(1), lead=(2,), n=64, shards=shards)
    n, n8s = 64, 64 // (8 * shards)
    for s in range(shards):
        cols = slice(s * n // shards, (s + 1) * n // shards)
        plain = int4_layout.pack_codes(jnp.asarray(codes[..., cols]))
        _same(w.packed[..., s * n8s : (s + 1) * n8s], plain)


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_repack_is_lossless(shards):
    codes, w = _int4(np.random.default_rng(2), lead=(3,), n=128)
    r = int4.repack(w, shards)
    assert r.shards == shards and r.packed.shape == w.packed.shape
    _same(int4.unpack(r)[0], codes)
    _same(r.dequantize(), w.dequantize())
    _same(r.scales, w.scales)
    back = int4.repack(r, 1)
    _same(back.packed, w.packed)
    assert back.shards == 1
    _same(int4.repack(int4.repack(r, 2), shards).packed, r.packed)


@pytest.mark.parametrize("impl", ["xla", "reference", "pallas_interpret"])
@pytest.mark.parametrize("shards", [2, 4])
def test_sharded_layout_matmul_and_take_match_shards_1(impl, shards):
    rng = np.random.default_rng(3)
    _, w = _int4(rng, lead=(2,), n=64)
    ws = int4.repack(w, shards).replace(impl=impl)
    w = w.replace(impl=impl)
    x = jnp.asarray(rng.normal(size=(3, 128)), jnp.float32)
    for layer in (0, 1):
        want = w.matmul(x, layer=layer)
        got = jax.jit(lambda w, x, layer: w.matmul(x, layer=layer))(ws, x, layer)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    one, ones = jax.tree.map(lambda a: a[1], w), jax.tree.map(lambda a: a[1], ws)
    np.testing.assert_allclose(
        np.asarray(ones.matmul(x)), np.asarray(one.matmul(x)), rtol=1e-6, atol=1e-6
    )
    ids = jnp.asarray([[0, 7, 8, 63], [-1, 70, 31, 32]])
    _same(ones.take(ids), one.take(ids))


def test_layout_errors_name_the_numbers():
    rng = np.random.default_rng(4)
    codes, w = _int4(rng, n=48)
    with pytest.raises(ValueError, match=r"N=48 must be a multiple of 8 \* shards = 32"):
        int4.repack(w, 4)
    with pytest.raises(ValueError, match=r"N=48 must be a multiple of 8 \* shards = 32"):
        int4.pack(codes, w.scales.astype(np.float32), w.mins.astype(np.float32), 32, shards=4)
    with pytest.raises(ValueError, match="positive int"):
        int4.repack(w, 0)


def test_partition_specs_int4():
    _, w = _int4(np.random.default_rng(5), lead=(3,), k=128, n=64, shards=2)
    col = w.partition_specs("column")
    assert isinstance(col, int4.Int4Weight) and col.shards == 2
    assert (col.packed, col.scales, col.mins) == (P(None, None, "model"),) * 3
    row = w.partition_specs("row", axis="tp")
    assert (row.packed, row.scales, row.mins) == (P(None, "tp", None),) * 3
    rep = w.partition_specs("replicated")
    assert (rep.packed, rep.scales, rep.mins) == (P(None, None, None),) * 3
    w.partition_specs("column", size=2)
    w.partition_specs("row", size=4)  # K/T = 32 = one group
    with pytest.raises(ValueError, match="T=4 devices must be packed with shards=4, got shards=2"):
        w.partition_specs("column", size=4)
    with pytest.raises(ValueError, match="K=128 over T=8 .* group_size=32"):
        w.partition_specs("row", size=8)
    with pytest.raises(ValueError, match="role must be one of"):
        w.partition_specs("diagonal")
    with pytest.raises(ValueError, match="parallel must be one of"):
        w.replace(parallel="diagonal").check()


def test_partition_specs_int8_and_fp8():
    rng = np.random.default_rng(6)
    w = quantize_int8(rng.normal(size=(2, 96, 32)).astype(np.float32))  # per-channel, g = K
    col, row = w.partition_specs("column"), w.partition_specs("row")
    assert (col.q, col.scales) == (P(None, None, "model"), P(None, None, "model"))
    assert (row.q, row.scales) == (P(None, "model", None), P(None, None, None))  # one group
    w.partition_specs("row", size=3)  # per-channel: any T dividing K
    with pytest.raises(ValueError, match="K=96 over T=5"):
        w.partition_specs("row", size=5)
    g = Int8Weight(jnp.zeros((96, 32), jnp.int8), jnp.ones((3, 32), jnp.float32), group_size=32)
    assert g.partition_specs("row").scales == P("model", None)
    with pytest.raises(ValueError, match="K=96 over T=2 .* group_size=32"):
        g.partition_specs("row", size=2)
    f = quantize_fp8(rng.normal(size=(64, 32)).astype(np.float32))
    assert f.partition_specs("column", size=4).q == P(None, "model")
    with pytest.raises(ValueError, match="N=32 over T=3"):
        f.partition_specs("column", size=3)


def test_without_a_mesh_parallel_changes_nothing():
    rng = np.random.default_rng(7)
    _, w = _int4(rng, n=64, shards=2)
    x = jnp.asarray(rng.normal(size=(2, 128)), jnp.float32)
    _same(w.replace(parallel="column").matmul(x), w.matmul(x))
    q = quantize_int8(rng.normal(size=(128, 64)).astype(np.float32))
    _same(q.replace(parallel="row").matmul(x), q.matmul(x))
    _same(q.replace(parallel="column").take(jnp.asarray([3, 9])), q.take(jnp.asarray([3, 9])))


@pytest.mark.parametrize("src_shards,dst_shards", [(1, 1), (2, 1), (1, 2), (4, 3)])
def test_int4_take_columns_is_exact(src_shards, dst_shards):
    codes, w = _int4(np.random.default_rng(8), lead=(2,), n=64, shards=src_shards)
    dh = 8  # replicate each of 8 heads 3 times, as KV heads are when T > num_kv_heads
    idx = np.concatenate([np.arange(h * dh, (h + 1) * dh) for h in range(8) for _ in range(3)])
    t = w.take_columns(idx, shards=dst_shards)
    assert isinstance(t, int4.Int4Weight) and t.shape == (2, 128, 192) and t.shards == dst_shards
    _same(int4.unpack(t)[0], codes[..., idx])
    _same(t.scales, w.scales[..., idx])
    _same(t.mins, w.mins[..., idx])
    _same(t.dequantize(), w.dequantize()[..., idx])
    with pytest.raises(ValueError, match=r"column 64 is outside \[0, N=64\)"):
        w.take_columns([0, 64])
    with pytest.raises(ValueError, match="multiple of 8"):
        w.take_columns([0, 1, 2])


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_fp8])
def test_8bit_take_columns_is_exact(quantize):
    w = quantize(np.random.default_rng(9).normal(size=(2, 64, 48)).astype(np.float32))
    idx = np.array([5, 5, 0, 47, 12])
    t = w.take_columns(idx)
    assert type(t) is type(w) and t.shape == (2, 64, 5) and t.group_size == w.group_size
    _same(t.q.astype(jnp.float32), w.q[..., idx].astype(jnp.float32))
    _same(t.scales, w.scales[..., idx])
    _same(t.dequantize(), w.dequantize()[..., idx])
    with pytest.raises(ValueError, match="outside"):
        w.take_columns([-1])


@pytest.fixture(scope="module")
def mesh_results():
    env = {
        **os.environ,
        # 4 host devices; XLA's CPU backend at LLVM -O0: the worker compares programs compiled
        # alike (on the mesh and on one device), compiling is most of its time, and -O0 leaves
        # the programs' HLO, sharding and collectives unchanged
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("tp_worker.py"))],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_on_a_mesh_matmul_and_take_equal_one_device(mesh_results):
    """INT4 (xla, pallas_interpret), INT8 (per-channel and g32), FP8; T = 2, 4; column and row;
    one weight, a stack read at a traced layer=, a lax.scan over layers, take (embedding),
    TP 2 x DP 2 with the batch split over 'data', and Auto axes: f32 within 1e-5 of one device;
    per-device bytes of the placed leaves = total / T (per-channel 8-bit scales, [1, N], are
    whole on every device of a row split)."""
    ok = {k: v for k, v in mesh_results.items() if not k.startswith("error/")}
    assert len(ok) >= 60
    failed = {k: v.get("error") for k, v in ok.items() if v["error"]}
    assert not failed, json.dumps(failed, indent=1)
    for name, r in ok.items():
        assert r["err"] <= 1e-5, (name, r["err"])
        if name.startswith("take/"):
            assert r["err"] == 0.0, (name, r["err"])  # a gather; the psum adds only zeros
        assert r["bytes"][0] == r["bytes"][1], (name, r["bytes"])


def test_on_a_mesh_bad_splits_raise_clear_errors(mesh_results):
    mismatch = mesh_results["error/shards_mismatch"]["error"]
    assert "ValueError" in mismatch and "T=2" in mismatch and "shards=1" in mismatch
    boundary = mesh_results["error/group_boundary"]["error"]
    assert "ValueError" in boundary
    assert all(s in boundary for s in ("K=96", "T=2", "group_size=32"))


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_pallas_kernel_in_shard_map_lowers_for_cuda_at_tp8(axis_type):
    """Llama-3-70B's MLP stacks at TP 8 on an abstract mesh of 8 H200s: the Pallas kernel runs
    inside the shard_map (one Triton call per device program), row-parallel adds an all-reduce."""
    from jax.sharding import AxisType, NamedSharding

    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    types = (getattr(AxisType, axis_type),) * 2
    mesh = jax.sharding.AbstractMesh((1, 8), ("data", "model"), types, abstract_device=dev)
    sds = jax.ShapeDtypeStruct
    layers, d, f, g = 80, 8192, 28672, 128
    for role, (k, n) in (("column", (d, f)), ("row", (f, d))):
        w = int4.Int4Weight(
            sds((layers, k, n // 8), jnp.uint32),
            sds((layers, k // g, n), jnp.float16),
            sds((layers, k // g, n), jnp.float16),
            group_size=g,
            impl="pallas",
            shards=8 if role == "column" else 1,
            parallel=role,
        )
        placed = jax.tree.map(
            lambda a, s: sds(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
            w,
            w.partition_specs(role),
        )
        x = sds((8, k), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
        with jax.sharding.use_abstract_mesh(mesh):
            traced = jax.jit(lambda w, x, i: w.matmul(x, layer=i)).trace(
                placed, x, sds((), jnp.int32)
            )
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text and text.count("custom_call") == 1
        assert ("all_reduce" in text) == (role == "row")


@pytest.mark.parametrize("qtype_name", ["Q4_0", "Q4_1"])
def test_gguf_native_q4_imports_straight_into_shards(qtype_name):
    """The sharded import holds GGUF's values exactly: the shards=1 import, repacked."""
    from types import SimpleNamespace

    import gguf

    from jaxserve.config import ModelConfig
    from jaxserve.loading import gguf_native

    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    rng = np.random.default_rng(10)
    xs = [rng.normal(size=(96, 64)).astype(np.float32) for _ in range(2)]  # [out, in] per layer
    tensors = [
        SimpleNamespace(name="blk.0.attn_q.weight", tensor_type=qtype, shape=[64, 96], data=d)
        for d in (gguf.quants.quantize(x, qtype) for x in xs)
    ]
    plain = gguf_native.import_linear(tensors, 4, stacked=True)
    sharded = gguf_native.import_linear(tensors, 4, stacked=True, shards=3)
    assert sharded.shards == 3 and sharded.shape == plain.shape == (2, 64, 96)
    _same(sharded.packed, int4.repack(plain, 3).packed)
    _same(sharded.dequantize(), plain.dequantize())
    with pytest.raises(ValueError, match=r"N=96 must be a multiple of 8 \* shards = 64"):
        gguf_native.import_linear(tensors, 4, stacked=True, shards=8)
    config = ModelConfig.preset("tiny")
    assert gguf_native._shards_of({"layers/wq": 2}, config)("layers/wk") == 1
    with pytest.raises(ValueError, match="unknown param path"):
        gguf_native._shards_of({"layers/nope": 2}, config)


def test_checkpoint_keeps_the_shard_layout_and_records_it(tmp_path):
    from ptq_testing import tiny_params

    from jaxserve.config import ModelConfig
    from jaxserve.loading import checkpoint
    from jaxserve.quant import quantize_params, replace_weights

    config = ModelConfig.preset("tiny")
    params = quantize_params(tiny_params(config), config, "int4-rtn", 32)
    wq = params["layers"]["wq"]
    params = replace_weights(params, {"layers/wq": int4.repack(wq, 2).replace(parallel="column")})
    recipe = {"quantization": "int4-rtn", "group_size": 32}
    path = checkpoint.save_checkpoint(tmp_path / "ck", config, params, None, recipe)
    layout = checkpoint.read_recipe(path)["int4_layout"]["shards"]
    assert layout["layers/wq"] == 2 and layout["layers/wk"] == 1
    loaded = checkpoint.load_checkpoint(path).params["layers"]["wq"]
    assert loaded.shards == 2 and loaded.parallel is None
    _same(loaded.packed, int4.repack(wq, 2).packed)
