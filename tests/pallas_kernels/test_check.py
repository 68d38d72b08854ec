"""`python -m pallas_kernels.check`: every registered kernel lowers for CUDA on an abstract H200."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import check

# jax warns on every Triton-backend pallas_call (upstream deprecation; see the kernel files).
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def test_registry_covers_engine_configurations():
    names = [c.name for c in check.CHECKS]
    assert len(names) == len(set(names))
    for kernel in ("decode", "prefill"):
        for model in ("smollm2-135m", "llama3.2-1b", "llama3-8b", "qwen2-7b"):
            for kv in ("auto", "int8", "fp8"):
                for ps in (16, 32):
                    for q in ("bfloat16", "float32"):
                        assert any(
                            n.startswith(f"{kernel}/{model}/ps{ps}/{q}/kv-{kv}") for n in names
                        )


def test_every_case_lowers(capsys):
    assert check.main([]) == 0
    out = capsys.readouterr().out
    n = len(check.CHECKS)
    assert f"{n}/{n} cases lowered" in out


def _bad_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0  # an (8, 576) tile: Triton needs power-of-two tiles


def _bad_fn(x):
    return pl.pallas_call(
        _bad_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
    )(x)


def test_a_kernel_that_cannot_lower_is_reported(capsys):
    bad = check.KernelCheck(
        "bad/non-pow2-tile", _bad_fn, (jax.ShapeDtypeStruct((8, 576), jnp.float32),)
    )
    [(name, ok, _, err)] = check.run([bad])
    assert name == "bad/non-pow2-tile" and not ok and err


def test_main_exits_nonzero_on_a_failure(monkeypatch, capsys):
    bad = check.KernelCheck(
        "bad/non-pow2-tile", _bad_fn, (jax.ShapeDtypeStruct((8, 576), jnp.float32),)
    )
    monkeypatch.setattr(check, "CHECKS", [bad])
    assert check.main([]) == 1
    assert "FAIL" in capsys.readouterr().out
