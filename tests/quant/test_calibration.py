"""Calibration: the text source, token windows, the per-layer forward and its statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ptq_testing import tiny_params

from jaxserve.config import ModelConfig
from jaxserve.layers import kv_cache as kvc
from jaxserve.layers.attention import AttentionMetadata
from jaxserve.layers.norm import rms_norm
from jaxserve.models import llama
from jaxserve.quant import calibration

_forward = jax.jit(llama.forward, static_argnums=(4,))


def _char_tokenizer(text, add_special_tokens=False):
    return {"input_ids": [ord(ch) % 128 for ch in text]}


def test_calibration_text_is_the_stdlib_reference_topics():
    text = calibration.calibration_text()
    assert len(text) > 100_000
    assert 'The "if" statement' in text  # a topic of the language reference
    assert "pydoc_data" in calibration.CALIBRATION_SOURCE


def test_calibration_tokens_are_evenly_spaced_windows():
    text = "".join(chr(32 + i % 90) for i in range(10_000))
    toks = calibration.calibration_tokens(_char_tokenizer, 1024, 256, text=text)
    assert toks.shape == (4, 256) and toks.dtype == np.int32
    ids = np.asarray(_char_tokenizer(text)["input_ids"])
    np.testing.assert_array_equal(toks[0], ids[:256])
    np.testing.assert_array_equal(toks[-1], ids[-256:])
    with pytest.raises(ValueError, match="fewer than num_tokens"):
        calibration.calibration_tokens(_char_tokenizer, 20_000, 256, text=text)
    with pytest.raises(ValueError, match="num_tokens >= seqlen"):
        calibration.calibration_tokens(_char_tokenizer, 100, 256, text=text)


def _info_file(path, manual, nodes):
    """A gzipped info file: preamble, then one \\x1f-separated node per (name, body), a tag table."""
    import gzip

    parts = [f"This is {manual}.info.\n\nCopyright notice of the preamble.\n"]
    for name, body in nodes:
        parts.append(f"\x1f\nFile: {manual}.info,  Node: {name},  Up: Top\n\n{body}\n")
    parts.append("\x1f\nTag Table:\nNode: Top\x7f100\n\x1f\nEnd Tag Table\n")
    path.write_bytes(gzip.compress("".join(parts).encode()))


def test_gnu_info_source_keeps_manual_prose_only(tmp_path, monkeypatch):
    _info_file(
        tmp_path / "alpha.info.gz",
        "alpha",
        [
            ("Top", "Permission is granted to copy (Top node)"),
            ("Invoking alpha", "alpha prints its input backwards."),
            ("GNU Free Documentation License", "FDL TEXT"),
            ("Concept index", "* backwards: Invoking."),
        ],
    )
    _info_file(
        tmp_path / "beta.info-1.gz",
        "beta",
        [("Overview", "beta sorts lines."), ("GNU GPL", "GPL TEXT"), ("Copying", "COPYING")],
    )
    monkeypatch.setattr(calibration, "INFO_DIR", str(tmp_path))
    text = calibration.calibration_text("gnu-info")
    assert text == "alpha prints its input backwards.\n\nbeta sorts lines."
    monkeypatch.setattr(calibration, "INFO_DIR", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="gnu-info.*no info manuals"):
        calibration.calibration_text("gnu-info")


def test_calibration_sources_share_the_windows_interleaved(monkeypatch):
    texts = {
        "pydoc": "".join(chr(32 + i % 40) for i in range(5_000)),
        "gnu-info": "".join(chr(80 + i % 40) for i in range(9_000)),
    }
    monkeypatch.setattr(calibration, "calibration_text", lambda source="pydoc": texts[source])
    toks = calibration.calibration_tokens(
        _char_tokenizer, 5 * 256, 256, sources=["pydoc", "gnu-info"]
    )
    assert toks.shape == (5, 256)
    a = calibration.calibration_tokens(_char_tokenizer, 3 * 256, 256, text=texts["pydoc"])
    b = calibration.calibration_tokens(_char_tokenizer, 2 * 256, 256, text=texts["gnu-info"])
    # 3 windows from the first source, 2 from the second, alternating.
    for got, want in zip(toks, [a[0], b[0], a[1], b[1], a[2]]):
        np.testing.assert_array_equal(got, want)
    alone = calibration.calibration_tokens(_char_tokenizer, 3 * 256, 256)
    np.testing.assert_array_equal(alone, a)  # the default is pydoc alone
    assert "pydoc_data" in calibration.describe_sources(["pydoc", "gnu-info"])
    assert "info manuals" in calibration.describe_sources(["pydoc", "gnu-info"])
    with pytest.raises(ValueError, match="unknown calibration source 'wiki'"):
        calibration.calibration_tokens(_char_tokenizer, 1024, 256, sources=["pydoc", "wiki"])
    with pytest.raises(ValueError, match="1 to 1 sources for 1 windows"):
        calibration.calibration_tokens(_char_tokenizer, 256, 256, sources=["pydoc", "gnu-info"])


def _paged_forward(params, c, tokens):
    """The serving model (paged cache, contiguous pages) on whole sequences from position 0."""
    b, t = tokens.shape
    ps = 16
    cache = kvc.init(c.num_layers, c.num_kv_heads, b * t // ps, ps, c.head_dim, "auto", jnp.float32)
    meta = AttentionMetadata.contiguous(np.full((b,), t), t, ps)
    return _forward(params, jnp.asarray(tokens), meta, cache, c)[0]


def test_layer_forward_matches_the_paged_model_and_stats_are_second_moments():
    c = ModelConfig.preset("tiny")
    p = tiny_params(c)
    tokens = np.random.default_rng(0).integers(0, c.vocab_size, (3, 32)).astype(np.int32)
    x = p["embed"][tokens]
    inputs0 = None
    for i in range(c.num_layers):
        x, inputs = calibration.layer_forward(calibration.layer_slice(p, i), x, c)
        inputs0 = inputs if inputs0 is None else inputs0
    want = _paged_forward(p, c, tokens)
    np.testing.assert_allclose(
        np.asarray(rms_norm(x, p["final_norm"], c.rms_norm_eps)), np.asarray(want), atol=1e-4
    )
    assert inputs0["o"].shape == (3, 32, c.num_heads * c.head_dim)
    assert inputs0["down"].shape == (3, 32, c.intermediate_size)

    stats = calibration.collect_stats(p, c, tokens, batch=2)  # 2 minibatches: sums accumulate
    assert len(stats) == c.num_layers and stats[0].count == 3 * 32
    for name, a in inputs0.items():
        xf = np.asarray(a, np.float64).reshape(-1, a.shape[-1])
        np.testing.assert_allclose(
            stats[0].hessian[name], xf.T @ xf / len(xf), rtol=1e-4, atol=1e-6
        )
        np.testing.assert_allclose(stats[0].absmean[name], np.abs(xf).mean(0), rtol=1e-4, atol=1e-7)


def test_bad_calibration_tokens_are_rejected():
    c = ModelConfig.preset("tiny")
    p = {"embed": jnp.zeros((c.vocab_size, c.hidden_size))}
    with pytest.raises(ValueError, match=r"int\[N, T\]"):
        calibration.collect_stats(p, c, np.zeros((8,), np.int32))
    with pytest.raises(ValueError, match="must lie in"):
        calibration.collect_stats(p, c, np.full((1, 4), c.vocab_size, np.int32))
