"""The C++ CPU matmul equals its jnp reference for every batch size, weight shape (K not a
multiple of the vector width included), layer of a stack and output dtype; a row's result never
depends on the other rows; its portable (non-AVX512-BF16) path does too."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import matmul as mm

kernel = jax.jit(mm.matmul, static_argnames="out_dtype")
reference = jax.jit(mm.matmul_reference, static_argnames="out_dtype")


def test_builds_here():
    assert mm.available(), mm.build_error()


def case(m, n, k, layers=3, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(layers, n, k)) / np.sqrt(k), jnp.bfloat16)
    return x, w


def close(got, want):
    """f32 results agree to f32 summation order; bf16 ones to one rounding of those (1 ulp)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 1e-5 if got.dtype == jnp.float32 else 8e-3
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol
    )


@pytest.mark.parametrize("m", [1, 3, 4, 5, 8, 17, 64, 65, 130])
@pytest.mark.parametrize("n,k", [(4, 32), (7, 33), (20, 80), (96, 576), (33, 1), (6, 1000)])
def test_equals_the_reference(m, n, k):
    x, w = case(m, n, k)
    for layer in (0, 2):
        for out in (jnp.bfloat16, jnp.float32):
            close(kernel(x, w, jnp.int32(layer), out_dtype=out), reference(x, w, layer, out))


def test_leading_dims_and_a_single_layer():
    x, w = case(12, 40, 64, layers=1)
    x3 = x.reshape(2, 6, 64)
    got = kernel(x3, w[0], 0)  # a 2-D weight is one layer
    assert got.shape == (2, 6, 40)
    close(got, reference(x3, w, 0))
    assert kernel(x[:0], w, 0).shape == (0, 40)


def test_row_result_does_not_depend_on_other_rows():
    """Bitwise: a row alone, or at any place among others, gets the same output (batch
    invariance across the engine's decode buckets and prefill chunks)."""
    x, w = case(37, 100, 576)
    full = np.asarray(kernel(x, w, 1, out_dtype=jnp.float32))
    for i in (0, 5, 36):
        for rows in (slice(i, i + 1), slice(max(0, i - 3), i + 1), slice(0, 37)):
            part = np.asarray(kernel(x[rows], w, 1, out_dtype=jnp.float32))
            np.testing.assert_array_equal(part[i - rows.start], full[i])


def test_inside_a_layer_scan_with_a_traced_layer():
    x, w = case(8, 48, 96, layers=4)

    def body(h, layer):
        return h, mm.matmul(h, w, layer)

    _, ys = jax.jit(lambda x: jax.lax.scan(body, x, jnp.arange(4)))(x)
    for layer in range(4):
        close(ys[layer], reference(x, w, layer))


@pytest.mark.parametrize("m", [0, 1, 5, 32, 70])
def test_many_weights_in_one_call_give_each_its_own_bits(m):
    """`matmul_many`: q, k, v (or gate, up) in one call, one space of work tiles over all of
    them; each result bitwise what `matmul` gives it alone, in both output dtypes, with the layer
    traced inside a scan."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(m, 96)), jnp.bfloat16)
    ws = [jnp.asarray(rng.normal(size=(3, n, 96)) / 10, jnp.bfloat16) for n in (96, 32, 7)]
    for out in (jnp.bfloat16, jnp.float32):
        ys = jax.jit(mm.matmul_many, static_argnums=3)(x, ws, 2, out)
        assert [y.shape for y in ys] == [(m, 96), (m, 32), (m, 7)]
        for y, w in zip(ys, ws):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(kernel(x, w, 2, out)))

    def body(h, layer):
        return h, mm.matmul_many(h, ws[:2], layer)

    _, (a, b) = jax.jit(lambda x: jax.lax.scan(body, x, jnp.arange(3)))(x)
    for layer in range(3):
        np.testing.assert_array_equal(np.asarray(a[layer]), np.asarray(kernel(x, ws[0], layer)))
        np.testing.assert_array_equal(np.asarray(b[layer]), np.asarray(kernel(x, ws[1], layer)))
    with pytest.raises(ValueError, match="does not fit"):
        mm.matmul_many(x, [ws[0], ws[1][:2]], 0)  # layer counts differ


def test_bad_inputs_are_errors():
    x, w = case(4, 8, 16)
    with pytest.raises(ValueError, match="bfloat16"):
        mm.matmul(x.astype(jnp.float32), w, 0)
    with pytest.raises(ValueError, match="does not fit"):
        mm.matmul(x[:, :8], w, 0)
    with pytest.raises(ValueError, match="out_dtype"):
        mm.matmul(x, w, 0, out_dtype=jnp.float16)


CASES = [(1, 5, 33), (8, 96, 576), (65, 7, 1000), (3, 9, 31), (70, 13, 1601)]


def run_build(march: str, tmp_path) -> tuple[str, list[np.ndarray]]:
    """The kernel built for `march` in a fresh process and cache (a build is loaded once per
    process): its path and its f32 results on CASES, each checked against the reference there."""
    out = tmp_path / f"{march}.npz"
    code = (
        "import sys, jax, jax.numpy as jnp, numpy as np\n"
        "from cpu_kernels import matmul as mm\n"
        "assert mm.available(), mm.build_error()\n"
        "rng = np.random.default_rng(0)\n"
        "ys = []\n"
        f"for m, n, k in {CASES!r}:\n"
        "    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)\n"
        "    w = jnp.asarray(rng.normal(size=(2, n, k)) / np.sqrt(k), jnp.bfloat16)\n"
        "    got = mm.matmul(x, w, 1, jnp.float32)\n"
        "    want = mm.matmul_reference(x, w, 1, jnp.float32)\n"
        "    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)\n"
        "    ys.append(np.asarray(got))\n"
        "np.savez(sys.argv[1], *ys)\n"
        "print(mm.path())\n"
    )
    env = {**os.environ, "JAXSERVE_CPU_KERNELS_MARCH": march, "JAXSERVE_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(out) as z:
        return proc.stdout.split()[-1], [z[f"arr_{i}"] for i in range(len(CASES))]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 -march levels")
def test_every_path_gives_the_same_bits(tmp_path):
    """Built for plain x86-64 the kernel runs its portable loop, for x86-64-v3 its AVX2 + FMA loop;
    each equals the reference and the two agree bit for bit (their lanes and reduction are one
    order), as does this CPU's native build unless it runs VDPBF16PS: that instruction is defined
    to sum in the same order (Intel's manual), which is checked to f32 rounding only."""
    built = {march: run_build(march, tmp_path) for march in ("x86-64", "x86-64-v3")}
    assert {march: path for march, (path, _) in built.items()} == {
        "x86-64": "portable",
        "x86-64-v3": "avx2",
    }
    rng = np.random.default_rng(0)
    for i, (m, n, k) in enumerate(CASES):
        x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
        w = jnp.asarray(rng.normal(size=(2, n, k)) / np.sqrt(k), jnp.bfloat16)
        portable, avx2 = built["x86-64"][1][i], built["x86-64-v3"][1][i]
        np.testing.assert_array_equal(portable, avx2)
        native = np.asarray(kernel(x, w, 1, out_dtype=jnp.float32))
        if mm.path() == "avx512bf16":
            np.testing.assert_allclose(native, avx2, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(native, avx2)
