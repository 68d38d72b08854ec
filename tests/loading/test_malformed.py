"""Malformed and hostile model files: every one fails fast with a ValueError naming the file and
what is wrong (issue 24), before anything is allocated from a size the files do not back, and no
file outside the model directory is ever opened.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import time

import numpy as np
import pytest
from model_testing import GOLDEN_DIR
from ptq_testing import tiny_params
from safetensors.numpy import load_file, save_file
from test_gguf_loader import write_gguf

from jaxserve.config import ModelConfig
from jaxserve.loading import ModelLoadError, checkpoint, dummy, hf, load_model
from jaxserve.quant import quantize_params

# --- HF config.json -------------------------------------------------------------------------


@pytest.fixture
def hf_dir(tmp_path):
    """A writable copy of the tiny llama HF checkpoint."""
    d = tmp_path / "llama"
    shutil.copytree(GOLDEN_DIR / "llama", d)
    return d


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def test_corrupt_config_json_is_named(hf_dir):
    (hf_dir / "config.json").write_text('{"model_type": "llama", ')
    with pytest.raises(ModelLoadError, match=r"config\.json.*not valid JSON"):
        load_model(str(hf_dir))


def test_config_json_not_an_object_is_named(hf_dir):
    (hf_dir / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match=r"config\.json.*JSON object"):
        load_model(str(hf_dir))


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(vocab_size=None), r"vocab_size.*missing"),
        (dict(num_attention_heads=0, head_dim=None), r"num_attention_heads.*positive.*0"),
        (dict(num_attention_heads=-4), r"num_attention_heads.*positive.*-4"),
        (dict(hidden_size="abc"), r"hidden_size.*integer.*'abc'"),
        (dict(hidden_size=64.5), r"hidden_size.*integer.*64\.5"),
        (dict(intermediate_size=-128), r"intermediate_size.*positive.*-128"),
        (dict(num_hidden_layers=True), r"num_hidden_layers.*integer.*True"),
        (dict(rms_norm_eps="x"), r"rms_norm_eps.*number.*'x'"),
        (dict(rope_theta=-1.0), r"rope_theta.*positive"),
        (dict(rope_scaling=[1, 2]), r"rope_scaling.*object"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), r"rope_scaling.*low_freq"),
        (
            dict(
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 4.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                }
            ),
            r"high_freq_factor.*must exceed",
        ),
        (dict(eos_token_id="two"), r"eos_token_id.*integer"),
    ],
)
def test_bad_config_field_is_named_with_path(hf_dir, changes, match):
    _edit_config(hf_dir, **changes)
    with pytest.raises(ModelLoadError, match=match) as e:
        load_model(str(hf_dir))
    assert str(hf_dir / "config.json") in str(e.value)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("num_hidden_layers", 10**7, r"num_hidden_layers.*10000000.*at most 10000"),
        ("vocab_size", 10**8, r"vocab_size.*100000000.*at most"),
        ("intermediate_size", 10**12, r"intermediate_size.*at most"),
    ],
)
def test_absurd_config_size_fails_fast(hf_dir, field, value, match):
    _edit_config(hf_dir, **{field: value})
    t0 = time.perf_counter()
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(hf_dir))
    assert time.perf_counter() - t0 < 5


def test_layer_count_not_backed_by_files_is_named(hf_dir):
    _edit_config(hf_dir, num_hidden_layers=5000)
    with pytest.raises(ModelLoadError, match=r"num_hidden_layers=5000 but .* hold 2 layers"):
        load_model(str(hf_dir))


def test_config_sizes_checked_against_headers_before_any_read(hf_dir, monkeypatch):
    """A shape that the safetensors headers do not back fails before any tensor is read."""
    tensors = load_file(hf_dir / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] = np.zeros((64, 64), np.float32)
    save_file(tensors, hf_dir / "model.safetensors")
    reads = []
    real = hf.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self._h = real(*a, **k)

        def __enter__(self):
            self._h.__enter__()
            return self

        def __exit__(self, *exc):
            return self._h.__exit__(*exc)

        def __getattr__(self, name):
            if name == "get_tensor":
                reads.append(name)
            return getattr(self._h, name)

    monkeypatch.setattr(hf, "safe_open", Spy)
    with pytest.raises(ModelLoadError, match=r"down_proj\.weight has shape \(64, 64\)"):
        hf.load_hf_dir(hf_dir)
    assert reads == []


# --- safetensors files ----------------------------------------------------------------------


def test_truncated_safetensors_is_named(hf_dir):
    f = hf_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*not a readable safetensors"):
        load_model(str(hf_dir))


@pytest.mark.parametrize("header_len", [2**60, 2**40, 3])
def test_oversized_or_bad_safetensors_header_is_named(hf_dir, header_len):
    f = hf_dir / "model.safetensors"
    f.write_bytes(struct.pack("<Q", header_len) + f.read_bytes()[8:])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*not a readable safetensors"):
        load_model(str(hf_dir))


def _sharded_copy(tmp_path):
    d = tmp_path / "llama31"
    shutil.copytree(GOLDEN_DIR / "llama31", d)
    return d


def _edit_index(d, fn):
    index = json.loads((d / "model.safetensors.index.json").read_text())
    fn(index["weight_map"])
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_index_naming_a_file_outside_the_model_dir_is_refused(tmp_path, kind):
    d = _sharded_copy(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    shard = "model-00001-of-00003.safetensors"
    shutil.move(d / shard, outside / shard)  # a valid shard: today's loader reads it happily
    if kind == "dotdot":
        target = f"../outside/{shard}"
    elif kind == "absolute":
        target = str(outside / shard)
    else:
        os.symlink(outside / shard, d / shard)
        target = shard
    _edit_index(d, lambda wm: wm.update({k: target for k, v in wm.items() if v == shard}))
    with pytest.raises(ModelLoadError, match=r"outside the model directory"):
        load_model(str(d))


def test_single_file_symlinked_outside_is_refused(tmp_path, hf_dir):
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(hf_dir / "model.safetensors", outside)
    os.symlink(outside, hf_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"outside the model directory"):
        load_model(str(hf_dir))


def test_hub_cache_snapshot_symlinks_are_allowed(tmp_path):
    """The Hugging Face cache layout: snapshots/<rev>/* are symlinks to ../../blobs/<hash>."""
    repo = tmp_path / "models--org--llama"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(GOLDEN_DIR / "llama" / f, blobs / f"hash-{f}")
        os.symlink(f"../../blobs/hash-{f}", snap / f)
    assert load_model(str(snap)).config.num_layers == 2


@pytest.mark.parametrize(
    "text, match",
    [
        ("{", r"not valid JSON"),
        ('{"weight_map": [1]}', r"weight_map.*object"),
        ('{"metadata": {}}', r"weight_map.*missing"),
        ('{"weight_map": {"model.norm.weight": 3}}', r"model\.norm\.weight.*file name"),
        ('{"weight_map": {"model.norm.weight": "nope.safetensors"}}', r"nope\.safetensors.*not"),
    ],
)
def test_malformed_shard_index_is_named(tmp_path, text, match):
    d = _sharded_copy(tmp_path)
    (d / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors\.index\.json.*" + match):
        load_model(str(d))


# --- the model argument -----------------------------------------------------------------------


@pytest.mark.parametrize("model", [123, 1.5, ["tiny"], {"name": "tiny"}, b"tiny"])
def test_model_argument_of_wrong_type_names_the_type(model):
    with pytest.raises(TypeError, match=rf"model must be .* got {type(model).__name__}"):
        load_model(model)


# --- GGUF -------------------------------------------------------------------------------------


@pytest.fixture
def gguf_path(tmp_path):
    p = tmp_path / "m.gguf"
    write_gguf(p, "llama")
    return p


def _set_u32_key(path, key: str, value: int) -> None:
    """Overwrites a UINT32 metadata value in place (key length, key bytes, u32 type 4, value)."""
    data = bytearray(path.read_bytes())
    k = key.encode()
    at = data.index(struct.pack("<Q", len(k)) + k) + 8 + len(k)
    assert struct.unpack_from("<I", data, at)[0] == 4  # GGUFValueType.UINT32
    struct.pack_into("<I", data, at + 4, value)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("offset, what", [(8, "tensor count"), (16, "kv count"), (24, "key")])
def test_gguf_absurd_header_counts_are_named(gguf_path, offset, what):
    data = gguf_path.read_bytes()
    gguf_path.write_bytes(data[:offset] + struct.pack("<Q", 2**40) + data[offset + 8 :])
    with pytest.raises(ModelLoadError, match=r"m\.gguf.*not a readable GGUF file"):
        load_model(str(gguf_path))


def test_gguf_truncated_is_named(gguf_path):
    gguf_path.write_bytes(gguf_path.read_bytes()[:4000])
    with pytest.raises(ModelLoadError, match=r"m\.gguf.*not a readable GGUF file"):
        load_model(str(gguf_path))


def test_gguf_absurd_block_count_fails_fast(gguf_path):
    _set_u32_key(gguf_path, "llama.block_count", 10**8)
    t0 = time.perf_counter()
    with pytest.raises(ModelLoadError, match=r"m\.gguf.*block_count.*100000000.*at most 10000"):
        load_model(str(gguf_path))
    with pytest.raises(ModelLoadError, match=r"block_count"):
        load_model(str(gguf_path), quantization="gguf-native")
    assert time.perf_counter() - t0 < 10


def test_gguf_block_count_not_backed_by_tensors_is_named(gguf_path):
    _set_u32_key(gguf_path, "llama.block_count", 9000)
    with pytest.raises(ModelLoadError, match=r"block_count=9000 but the file holds 2 blocks"):
        load_model(str(gguf_path))


def test_gguf_zero_heads_is_named(gguf_path):
    _set_u32_key(gguf_path, "llama.attention.head_count", 0)
    with pytest.raises(ModelLoadError, match=r"m\.gguf.*head_count.*positive"):
        load_model(str(gguf_path))


# --- converted checkpoints --------------------------------------------------------------------

TINY = ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def int4_checkpoint(tmp_path_factory):
    params = quantize_params(tiny_params(TINY), TINY, "int4-rtn", 32)
    recipe = {"quantization": "int4-rtn", "group_size": 32}
    return checkpoint.save_checkpoint(
        tmp_path_factory.mktemp("ck") / "ck", TINY, params, None, recipe
    )


def _tamper(meta):
    return meta["weights"]["layers/wq"]


@pytest.mark.parametrize(
    "tamper",
    [
        lambda m: _tamper(m)["static"].update(bogus=1),  # TypeError inside Int4Weight today
        lambda m: _tamper(m).update(static=[1]),
        lambda m: _tamper(m).pop("type"),
        lambda m: _tamper(m).update(shape="LKN"),
        lambda m: m.update(weights=[]),
        lambda m: m.update(recipe=None),
        lambda m: m["config"].update(num_layers="two"),
        lambda m: m["config"].update(num_layers=10**7),
        lambda m: m["config"].update(rope_scaling={"factor": 1}),
        lambda m: m.update(config=None),
    ],
)
def test_tampered_checkpoint_metadata_is_named(tmp_path, int4_checkpoint, tamper):
    ck = tmp_path / "ck"
    shutil.copytree(int4_checkpoint, ck)
    meta_file = ck / checkpoint.META_FILE
    meta = json.loads(meta_file.read_text())
    tamper(meta)
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ModelLoadError, match=r"jaxserve_checkpoint\.json"):
        load_model(str(ck))


def test_checkpoint_metadata_symlinked_outside_is_refused(tmp_path, int4_checkpoint):
    ck = tmp_path / "ck"
    shutil.copytree(int4_checkpoint, ck)
    outside = tmp_path / "meta.json"
    shutil.move(ck / checkpoint.META_FILE, outside)
    os.symlink(outside, ck / checkpoint.META_FILE)
    with pytest.raises(ModelLoadError, match=r"outside the model directory"):
        load_model(str(ck))


def test_orbax_files_symlinked_outside_are_refused(tmp_path, int4_checkpoint):
    """Orbax's own files under params/ may not leave the checkpoint either (issue 24)."""
    ck = tmp_path / "ck"
    shutil.copytree(int4_checkpoint, ck)
    victim = next(p for p in sorted((ck / "params").rglob("*")) if p.is_file())
    outside = tmp_path / "elsewhere"
    shutil.move(victim, outside)
    os.symlink(outside, victim)
    with pytest.raises(ModelLoadError, match=r"outside the model directory"):
        load_model(str(ck))


def test_orbax_arrays_larger_than_the_config_allows_are_refused_before_restore(tmp_path):
    """A float checkpoint whose params/ hold a larger model than its config (a swapped or
    tampered params/): the arrays orbax's metadata lists are checked against the config's largest
    parameter before orbax allocates anything. Before, the restore read them all first."""
    big = dataclasses.replace(TINY, vocab_size=4096)
    ck = checkpoint.save_checkpoint(tmp_path / "ck", big, tiny_params(big), None, {})
    meta_file = ck / checkpoint.META_FILE
    meta = json.loads(meta_file.read_text())
    meta["config"] = checkpoint.config_to_dict(TINY)
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(
        ModelLoadError, match=r"params: array embed of shape \[4096, 64\] is larger"
    ):
        load_model(str(ck))


def test_corrupt_checkpoint_json_is_named(tmp_path, int4_checkpoint):
    ck = tmp_path / "ck"
    shutil.copytree(int4_checkpoint, ck)
    (ck / checkpoint.META_FILE).write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"jaxserve_checkpoint\.json.*not valid JSON"):
        load_model(str(ck))


# --- the dummy format -------------------------------------------------------------------------


def test_dummy_refuses_params_larger_than_memory(monkeypatch):
    monkeypatch.setattr(dummy, "memory_limit_bytes", lambda: 100_000, raising=False)
    with pytest.raises(ValueError, match=r"dummy.*tiny.*bytes.*exceed.*100000"):
        load_model("tiny", load_format="dummy")


def test_dummy_refuses_a_huge_config_without_allocating():
    huge = dataclasses.replace(
        TINY, num_layers=10_000, hidden_size=16384, intermediate_size=65536, name="huge"
    )
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"dummy:huge.*exceed"):
        load_model(huge, load_format="dummy", dtype="bfloat16")
    assert time.perf_counter() - t0 < 5


# --- tokenizer files and the chat template ----------------------------------------------------


def _write_tokenizer(d, chat_template=None, jinja=None):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "hello", "world"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    if jinja is not None:
        (d / "chat_template.jinja").write_text(jinja)


GOOD_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
BAD_TEMPLATE = "{% for m in messages %}{{ m['content'] }"


def test_good_chat_template_loads(hf_dir):
    _write_tokenizer(hf_dir, jinja=GOOD_TEMPLATE)
    tok = load_model(str(hf_dir)).tokenizer
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False) == (
        "hello"
    )


@pytest.mark.parametrize(
    "where, file", [("jinja", "chat_template.jinja"), ("config", "tokenizer_config.json")]
)
def test_malformed_chat_template_is_named_at_load(hf_dir, where, file):
    if where == "jinja":
        _write_tokenizer(hf_dir, jinja=BAD_TEMPLATE)
    else:
        _write_tokenizer(hf_dir, chat_template=BAD_TEMPLATE)
    with pytest.raises(ModelLoadError, match=rf"{file.replace('.', r'\.')}.*chat template"):
        load_model(str(hf_dir))


def test_chat_template_not_utf8_is_named(hf_dir):
    _write_tokenizer(hf_dir)
    (hf_dir / "chat_template.jinja").write_bytes(b"\xff\xfe{{ bad }}")
    with pytest.raises(ModelLoadError, match=r"chat_template\.jinja"):
        load_model(str(hf_dir))


def test_corrupt_tokenizer_config_is_named(hf_dir):
    _write_tokenizer(hf_dir)
    (hf_dir / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ModelLoadError, match=r"tokenizer"):
        load_model(str(hf_dir))


def test_tokenizer_file_symlinked_outside_is_refused(tmp_path, hf_dir):
    _write_tokenizer(hf_dir)
    outside = tmp_path / "secret.json"
    shutil.move(hf_dir / "tokenizer.json", outside)
    os.symlink(outside, hf_dir / "tokenizer.json")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json.*outside the model directory"):
        load_model(str(hf_dir))
