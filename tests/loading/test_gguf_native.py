"""GGUF Q4_0/Q4_1 -> packed INT4 and Q8_0 -> INT8 without a float round trip, exactly."""

from types import SimpleNamespace

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.quants import dequantize, quantize

from jaxserve.loading import gguf_file, gguf_native, load_model
from jaxserve.quant import Int4Weight, Int8Weight

Q = gguf.GGMLQuantizationType


def _fake_tensor(x: np.ndarray, qtype, name="blk.0.attn_q.weight"):
    """A ReaderTensor-like view of numpy-order x[out, in] quantized to qtype."""
    return SimpleNamespace(
        name=name, tensor_type=qtype, data=quantize(x, qtype), shape=[x.shape[1], x.shape[0]]
    )


def test_block_element_order_low_nibbles_first():
    d, m = np.float16(0.5), np.float16(-1.0)
    qs = np.arange(16, dtype=np.uint8) | (np.arange(15, -1, -1, dtype=np.uint8) << 4)
    raw = np.concatenate([np.frombuffer(d.tobytes() + m.tobytes(), np.uint8), qs])  # one Q4_1 block
    codes, scales, mins = gguf_native.q4_to_codes(raw, Q.Q4_1, 1, 32)
    np.testing.assert_array_equal(codes[0], np.r_[np.arange(16), np.arange(15, -1, -1)])
    np.testing.assert_array_equal(codes * 0.5 - 1.0, dequantize(raw.reshape(1, 20), Q.Q4_1))
    assert scales[0, 0] == d and mins[0, 0] == m


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("heads", [None, 4])
def test_import_linear_is_exact(qtype, heads):
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(64, 96)).astype(np.float32) for _ in range(2)]  # 2 layers [out, in]
    tensors = [_fake_tensor(x, qtype) for x in xs]
    w = gguf_native.import_linear(tensors, heads, stacked=True)
    assert isinstance(w, Int8Weight if qtype == Q.Q8_0 else Int4Weight)
    assert w.shape == (2, 96, 64) and w.group_size == 32
    for i, t in enumerate(tensors):
        ref = dequantize(t.data, qtype).reshape(64, 96)
        if heads is not None:
            ref = gguf_file.unpermute_rows(ref, heads)
        np.testing.assert_array_equal(np.asarray(w.dequantize()[i]), ref.T)


def test_unsupported_type_and_bad_sizes_raise():
    x = np.random.default_rng(1).normal(size=(8, 64)).astype(np.float32)
    with pytest.raises(ValueError, match="type Q5_0, which cannot be imported natively"):
        gguf_native.import_linear([_fake_tensor(x, Q.Q5_0)], None, stacked=False)
    t = _fake_tensor(x, Q.Q4_1)
    with pytest.raises(ValueError, match="expected 8x96 weights"):
        gguf_native.q4_to_codes(t.data, Q.Q4_1, 8, 96)
    with pytest.raises(ValueError, match="needs a .gguf file"):
        load_model("/nonexistent/model.safetensors", quantization="gguf-native")


@pytest.fixture(scope="module")
def smollm2_native(smollm2_gguf_path):
    reader = gguf_file.open_gguf(smollm2_gguf_path)
    config = gguf_file.config_from_gguf(reader)
    return reader, config, gguf_native.import_gguf_params(reader, config, "float32")


@pytest.mark.smollm2
def test_smollm2_every_q4_1_tensor_dequantizes_exactly(smollm2_native):
    reader, config, params = smollm2_native
    checked = 0
    for path, tensors in gguf_file.gguf_tensor_map(reader, config).items():
        if tensors[0].tensor_type != Q.Q4_1:
            continue
        w = params["layers"][path.removeprefix("layers/")]
        assert isinstance(w, Int4Weight) and w.group_size == 32
        deq = np.asarray(w.dequantize())  # (L, in, out)
        heads = gguf_file.unpermute_heads(path, config)
        for i, t in enumerate(tensors):
            ref = dequantize(t.data, t.tensor_type).reshape(int(t.shape[1]), int(t.shape[0]))
            if heads is not None:
                ref = gguf_file.unpermute_rows(ref, heads)
            np.testing.assert_array_equal(deq[i], ref.T, err_msg=t.name)
            checked += 1
    assert checked == 210
    # The Q8_0 token embedding (tied output) as an INT8 [D, V] linear: exact too.
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert emb.tensor_type == Q.Q8_0
    w8 = gguf_native.import_linear([emb], None, stacked=False)
    ref = dequantize(emb.data, Q.Q8_0).reshape(config.vocab_size, config.hidden_size)
    np.testing.assert_array_equal(np.asarray(w8.dequantize()), ref.T)
    # ... and the model's embed is that Int8Weight: lookups (take) and tied logits, no floats.
    assert isinstance(params["embed"], Int8Weight) and params["embed"].group_size == 32
    np.testing.assert_array_equal(np.asarray(params["embed"].q), np.asarray(w8.q))
    np.testing.assert_array_equal(np.asarray(params["embed"].scales), np.asarray(w8.scales))
    ids = np.array([0, 1, 2, config.vocab_size - 1, 12345])
    np.testing.assert_array_equal(np.asarray(params["embed"].take(jnp.asarray(ids))), ref[ids])


@pytest.mark.smollm2
def test_smollm2_gguf_native_greedy_is_coherent(smollm2_native, smollm2_gguf_path):
    from model_testing import greedy_generate

    from jaxserve.loading.tokenizer import load_tokenizer

    reader, config, params = smollm2_native
    tok = load_tokenizer(smollm2_gguf_path, reader=reader)
    prompt = tok("The capital of France is")["input_ids"]
    out, _ = greedy_generate(params, config, [prompt], 6)
    assert "Paris" in tok.decode(out[0]), tok.decode(out[0])
    assert params["layers"]["w_up"].packed.dtype == jnp.uint32
