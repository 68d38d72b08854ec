"""GGUF import of the issue-26 families (qwen3, gemma2, gemma3, phi3, qwen3moe) on files converted
here from the tiny golden HF checkpoints (`tests/gguf_testing.py`) the way llama.cpp's convert_hf_to_gguf.py does it:
tensor names from gguf-py's own `get_tensor_name_map`, Gemma's norms stored as (1 + w), phi3's
fused attn_qkv / ffn_up kept fused with its LongRoPE factors as rope_factors_* tensors, qwen3moe's
experts stacked into one 3-D tensor per layer, and the metadata keys each converter writes.

Loading the GGUF must give the same config and the same f32 logits as loading the HF folder
(`hf.load_hf_dir`; HF's own logits are checked against it in tests/models/test_families.py). What
llama.cpp's files cannot say is set in the reference folder's config.json instead: Gemma's
query_pre_attn_scalar follows llama.cpp's rule (head_dim below 27B).
"""

from __future__ import annotations

import dataclasses

import gguf
import jax
import numpy as np
import pytest
from gguf.quants import quantize
from gguf_testing import Q, convert, reference_dir
from model_testing import forward_logits, load_golden_logits

from jaxserve.loading import gguf_archs, gguf_file, hf, load_model
from jaxserve.loading.loaded import ModelLoadError

FAMILIES = ["qwen3", "gemma2", "gemma3", "phi3", "qwen3_moe", "qwen3_moe_sparse2"]
# f32 GGUF vs the f32 HF folder: the same weights (Gemma's norms read back as f32(1 + w) - 1, whose
# 1 + that is f32(1 + w) again) and f32 metadata (rms eps, LongRoPE factors): measured 0.
ATOL = 1e-5


def assert_same_config(got, want):
    """Equal configs but for the name; floats at f32 precision (GGUF stores f32 metadata)."""

    def close(x, y, where):
        if isinstance(y, dict):
            assert x.keys() == y.keys(), where
            for k in y:
                close(x[k], y[k], f"{where}.{k}")
        elif isinstance(y, float) or (isinstance(y, tuple) and y and isinstance(y[0], float)):
            np.testing.assert_allclose(x, y, rtol=1e-6, err_msg=where)
        else:
            assert x == y, (where, x, y)

    a, b = dataclasses.asdict(got), dataclasses.asdict(want)
    a["name"] = b["name"] = ""
    close(a, b, "config")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (reference HF dir, F32 GGUF path), converted once per module."""
    root = tmp_path_factory.mktemp("gguf_archs")
    out = {}
    for name in FAMILIES:
        ref = reference_dir(root, name)
        convert(ref, root / f"{name}.gguf")
        out[name] = (ref, root / f"{name}.gguf")
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_converted_gguf_matches_hf_folder(converted, name):
    ref, path = converted[name]
    want_config, want_params = hf.load_hf_dir(ref, "float32")
    lm = load_model(str(path))
    assert_same_config(lm.config, want_config)
    tokens, _ = load_golden_logits(name)
    got = forward_logits(lm.params, lm.config, tokens)
    want = forward_logits(want_params, want_config, tokens)
    diff = float(np.abs(got - want).max())
    print(f"{name}: max |logit diff| GGUF f32 vs HF folder = {diff:.3g}")
    assert diff <= ATOL


def round_trip(path: str, w: np.ndarray, qtype, norm_offset: float) -> np.ndarray:
    """A param's values after llama.cpp's F16 / Q8_0 storage of its GGUF tensor."""
    stacked = path.startswith("layers/")
    if norm_offset and path.endswith("norm"):  # stored as f32(1 + w), read back as that - 1
        return (w + np.float32(norm_offset)) - np.float32(norm_offset)
    if w.ndim - stacked < 2:
        return w  # norms, biases: F32
    if qtype == Q.F16:
        return w.astype(np.float16).astype(np.float32)
    # the GGUF rows' input axis in our layout: [in, out] linears, [E, in, out] experts, embed [V, D]
    axis = {"linear": -2, "experts": -2, "plain": -1}[gguf_archs.param_kind(path)]
    x = np.moveaxis(w, axis, -1)
    flat = x.reshape(-1, x.shape[-1])
    back = gguf.quants.dequantize(quantize(flat, qtype), qtype).reshape(x.shape)
    return np.moveaxis(back, -1, axis)


@pytest.mark.parametrize(
    "name, qtype", [("phi3", Q.Q8_0), ("qwen3_moe", Q.Q8_0), ("gemma3", Q.F16)]
)
def test_quantized_gguf_is_the_hf_weights_rounded(tmp_path, name, qtype):
    """F16 / Q8_0 files: every weight is the HF folder's weight rounded as the file stores it, and
    the logits are those weights' logits; `gguf-native` (Q8_0 linears as Int8Weight, phi3's fused
    rows split on the blocks, the MoE router and experts as floats) gives the float import's."""
    ref = reference_dir(tmp_path, name)
    path = tmp_path / f"{name}.gguf"
    convert(ref, path, qtype)
    want_config, want_params = hf.load_hf_dir(ref, "float32")
    tokens, _ = load_golden_logits(name)
    want = forward_logits(want_params, want_config, tokens)
    lm = load_model(str(path))

    # Every weight is exactly the HF weight through the file's format (Q8_0 blocks of 32 along
    # each row's inputs; 1-D tensors stay F32), so the logits equal those of those weights.
    def rounded(key, w):
        p = "/".join(k.key for k in key)
        return round_trip(p, np.asarray(w), qtype, want_config.norm_offset)

    want_rounded = jax.tree_util.tree_map_with_path(rounded, want_params)
    for (key, g), w in zip(
        jax.tree_util.tree_leaves_with_path(lm.params), jax.tree_util.tree_leaves(want_rounded)
    ):
        np.testing.assert_array_equal(np.asarray(g), w, err_msg=jax.tree_util.keystr(key))
    got = forward_logits(lm.params, lm.config, tokens)
    diff = float(np.abs(got - forward_logits(want_rounded, want_config, tokens)).max())
    print(
        f"{name} {qtype.name}: max |logit diff| vs the HF folder's weights in {qtype.name} = "
        f"{diff:.3g}; vs f32 = {float(np.abs(got - want).max()):.3g} "
        f"(|logits| up to {np.abs(want).max():.3g})"
    )
    assert diff <= ATOL
    if qtype != Q.Q8_0:
        return
    native = load_model(str(path), quantization="gguf-native")
    assert type(native.params["layers"]["wq"]).__name__ == "Int8Weight"
    got_native = forward_logits(native.params, native.config, tokens)
    diff = float(np.abs(got_native - got).max())
    print(f"{name} gguf-native vs float import of the same file: {diff:.3g}")
    assert diff <= 1e-4  # the same weight values; Int8 matmuls sum in another order


@pytest.fixture(scope="module")
def phi3_ref(tmp_path_factory):
    return reference_dir(tmp_path_factory.mktemp("phi3_ref"), "phi3")


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("qwen3_moe", dict(drop_keys={"expert_count"}), r"qwen3moe\.expert_count is missing"),
        (
            "qwen3_moe",
            dict(drop={"blk.1.ffn_up_exps.weight"}),
            r"missing tensor blk\.1\.ffn_up_exps",
        ),
        ("qwen3", dict(drop={"blk.1.attn_k_norm.weight"}), r"missing tensor blk\.1\.attn_k_norm"),
        (
            "gemma2",
            dict(drop={"blk.0.post_ffw_norm.weight"}),
            r"missing tensor blk\.0\.post_ffw_norm",
        ),
        ("phi3", dict(drop={"rope_factors_long.weight"}), r"needs both 1-D rope_factors_short"),
        (
            "phi3",
            dict(drop_keys={"rope.scaling.original_context_length"}),
            r"phi3\.rope\.scaling\.original_context_length is missing",
        ),
        (
            "phi3",
            dict(drop_keys={"rope.dimension_count"}, extra_keys={"rope.dimension_count": 8}),
            r"rope\.dimension_count=8 != head_dim 16: partial rotary",
        ),
        (
            "gemma2",
            dict(extra_keys={"attention.sliding_window_pattern": 0}),
            r"gemma2\.attention\.sliding_window_pattern must be positive",
        ),
        (
            "gemma3",
            dict(
                drop_keys={"attention.sliding_window_pattern"},
                extra_keys={"attention.sliding_window": -1.0},
            ),
            r"gemma3\.attention\.sliding_window must be an integer",
        ),
    ],
)
def test_bad_file_raises_model_load_error(tmp_path, name, kwargs, message):
    ref = reference_dir(tmp_path, name)
    path = tmp_path / f"{name}.gguf"
    kwargs = dict(kwargs)  # the parametrize dict is shared: do not pop from it
    drop_keys = set(kwargs.pop("drop_keys", ())) | set(kwargs.get("extra_keys", {}))
    convert(ref, path, drop_keys=drop_keys, **kwargs)
    with pytest.raises(ModelLoadError, match=message) as e:
        load_model(str(path))
    assert e.value.path == str(path)


def test_phi3_fused_tensor_shape_is_checked(tmp_path, phi3_ref):
    path = tmp_path / "phi3.gguf"
    short = np.zeros((96, 64), np.float32)  # q and k rows only: [q | k | v] is 128 rows
    convert(phi3_ref, path, replace={"blk.0.attn_qkv.weight": short})
    with pytest.raises(
        ModelLoadError, match=r"blk\.0\.attn_qkv\.weight has shape \[64, 96\], expected \[64, 128\]"
    ):
        load_model(str(path))
    convert(phi3_ref, path, drop={"blk.1.attn_qkv.weight"})  # else separate q/k/v are read
    with pytest.raises(ModelLoadError, match=r"missing tensor blk\.1\.attn_q\.weight"):
        load_model(str(path))


def test_default_sliding_patterns(tmp_path):
    """Without the pattern key, llama.cpp's periods: gemma2 2 (its golden's [s, f, s]), gemma3 6
    (all four golden layers slide); gemma3 without a window has none."""
    ref = reference_dir(tmp_path, "gemma3")
    path = tmp_path / "g3.gguf"
    convert(ref, path, drop_keys={"attention.sliding_window_pattern"})
    config = gguf_file.read_config(path, gguf_file.open_gguf(path))
    assert config.layer_types == ("sliding_attention",) * 4 and config.sliding_window == 6
    convert(ref, path, drop_keys={"attention.sliding_window_pattern", "attention.sliding_window"})
    config = gguf_file.read_config(path, gguf_file.open_gguf(path))
    assert config.sliding_window is None and config.rope_local_theta == 100.0
