"""KV-cache quantization quality on SmolLM2-135M: perplexity and attention-output error per KV dtype.

    python experiments/kv_quant_quality.py [--windows 4] [--window_tokens 256] [--out DIR]

Text: the CPython documentation topics shipped in the standard library (`pydoc_data.topics.topics`,
all entries concatenated in sorted key order), so the run is offline and reproducible. It is
tokenized with the model's tokenizer and cut into `--windows` consecutive windows of
`--window_tokens` tokens (a BOS token first), run as one batch.

Weights stay f32 (the default GGUF dequantized) so only the KV cache changes between runs:

* perplexity: `llama.forward` over each window as one prefill through the paged cache whose pages
  are f32, bf16, int8 or fp8 (e4m3) -- the model writes K/V (quantizing them) before attention
  reads them back, so every attention read goes through the stored format;
* attention-output error: the real per-layer queries and the f32 K/V of the same run, attention
  recomputed with K/V stored as bf16 / int8 / fp8 (`kv_cache.quantize`, per token and KV head);
  relative RMS error ||o - o_f32|| / ||o_f32|| over real tokens, mean and max over the 30 layers.

Writes DIR/kv_quant_quality.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import pydoc_data.topics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.layers import kv_cache as kvc
from jaxserve.layers.attention import AttentionMetadata
from jaxserve.layers.norm import rms_norm
from jaxserve.loading import load_model
from jaxserve.models import llama
from jaxserve.resolve import REFERENCE_IMPL
from pallas_kernels.attention.paged_kv import PagedKV
from pallas_kernels.attention.reference import prefill_reference

log = logging.getLogger("kv_quant_quality")
PAGE_SIZE = 16
# name -> (kv_cache_dtype, page dtype for 'auto')
KV_VARIANTS = {
    "f32": ("auto", "float32"),
    "bf16": ("auto", "bfloat16"),
    "int8": ("int8", "float32"),
    "fp8": ("fp8", "float32"),
}


def text_windows(tokenizer, windows: int, length: int, bos: int | None) -> np.ndarray:
    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    # ~4 characters per token in English prose; 8x leaves ample margin and keeps tokenizing fast.
    ids = tokenizer.encode(text[: windows * length * 8], add_special_tokens=False)
    body = length - (bos is not None)
    if len(ids) < windows * body:
        raise ValueError(f"text has {len(ids)} tokens, fewer than {windows} x {body}")
    rows = [ids[i * body : (i + 1) * body] for i in range(windows)]
    if bos is not None:
        rows = [[bos] + r for r in rows]
    return np.asarray(rows, np.int32)  # (B, T)


def prefill_meta(b: int, t: int) -> AttentionMetadata:
    """Each row in its own contiguous pages, the whole window as one chunk."""
    return AttentionMetadata.contiguous(np.full((b,), t), t, PAGE_SIZE)


def new_cache(config, b, t, variant):
    kv_dtype, page_dtype = KV_VARIANTS[variant]
    pages = b * -(-t // PAGE_SIZE)
    c = config
    return kvc.init(
        c.num_layers, c.num_kv_heads, pages, PAGE_SIZE, c.head_dim, kv_dtype, page_dtype
    )


@jax.jit
def _nll(logits, tokens):
    """Mean next-token negative log-likelihood: logits f32[B, T, V], tokens i32[B, T]."""
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def perplexity(params, config, tokens, variant) -> float:
    b, t = tokens.shape
    cache = new_cache(config, b, t, variant)
    step = jax.jit(
        lambda p, x, m, c: llama.compute_logits(p, llama.forward(p, x, m, c, config)[0], config)
    )
    logits = step(params, jnp.asarray(tokens), prefill_meta(b, t), cache)
    return float(np.exp(_nll(logits, jnp.asarray(tokens))))


def layer_queries(params, config, tokens):
    """The f32 run layer by layer (`llama.decoder_layer`, the scanned layer of `llama.forward`),
    keeping each layer's queries. Returns (q f32[L, B, T, H, Dh], f32 cache, final hidden)."""
    c = config
    b, t = tokens.shape
    meta = prefill_meta(b, t)

    @jax.jit
    def one(x, cache, lp, li):
        attend = llama.paged_attend(cache, li, meta, REFERENCE_IMPL)
        x, cache, taps = llama.decoder_layer(lp, x, meta.positions, attend, c)
        return x, cache, taps["q"]

    x = params["embed"][jnp.asarray(tokens)]
    cache = new_cache(config, b, t, "f32")
    qs = []
    for li in range(c.num_layers):
        lp = jax.tree.map(lambda a, li=li: a[li], params["layers"])
        x, cache, q = one(x, cache, lp, jnp.int32(li))
        qs.append(q)
    return jnp.stack(qs), cache, rms_norm(x, params["final_norm"], c.rms_norm_eps)


def attention_errors(qs, cache, b, t) -> dict:
    """Relative RMS error of each layer's attention output with K/V stored as bf16/int8/fp8."""
    meta = prefill_meta(b, t)

    @jax.jit
    def rel_err(q, k32, v32, k, v, ks, vs, layer):
        rows = (meta.positions, meta.seq_lens, meta.page_table)
        ref = prefill_reference(q, PagedKV(k32, v32, layer=layer), *rows)
        out = prefill_reference(q, PagedKV(k, v, ks, vs, layer), *rows)
        return jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)

    stored = {
        "bf16": (cache.k.astype(jnp.bfloat16), cache.v.astype(jnp.bfloat16), None, None),
        "int8": (*kvc.quantize(cache.k, jnp.int8), *kvc.quantize(cache.v, jnp.int8)),
        "fp8": (*kvc.quantize(cache.k, kvc.FP8_DTYPE), *kvc.quantize(cache.v, kvc.FP8_DTYPE)),
    }
    out = {}
    for name, st in stored.items():
        k, v, ks, vs = (st[0], st[2], st[1], st[3]) if name != "bf16" else st
        errs = [
            float(rel_err(qs[li], cache.k, cache.v, k, v, ks, vs, jnp.int32(li)))
            for li in range(qs.shape[0])
        ]
        out[name] = dict(mean=float(np.mean(errs)), max=float(np.max(errs)), per_layer=errs)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="load_model's model argument (default SmolLM2)"
    )
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--window_tokens", type=int, default=256)
    parser.add_argument("--out", default="experiments/out/kv_quant_quality")
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    start = time.monotonic()
    loaded = load_model(opts.model, dtype="float32")
    config, params = loaded.config, loaded.params
    tokens = text_windows(loaded.tokenizer, opts.windows, opts.window_tokens, config.bos_token_id)
    b, t = tokens.shape
    print(f"{config.name or loaded.source}: {b} windows x {t} tokens of pydoc_data.topics")

    res = dict(
        model=loaded.source,
        text="pydoc_data.topics.topics (CPython stdlib), sorted keys",
        windows=b,
        window_tokens=t,
        perplexity={},
        bytes_per_token={},
    )
    for variant, (kv_dtype, page_dtype) in KV_VARIANTS.items():
        res["perplexity"][variant] = perplexity(params, config, tokens, variant)
        res["bytes_per_token"][variant] = kvc.bytes_per_token(
            config.num_layers, config.num_kv_heads, config.head_dim, kv_dtype, page_dtype
        )
        print(f"  KV {variant:5s}: perplexity {res['perplexity'][variant]:.4f}")

    qs, cache, hidden = layer_queries(params, config, tokens)
    ref_hidden, _ = jax.jit(lambda p, x, m, c: llama.forward(p, x, m, c, config))(
        params, jnp.asarray(tokens), prefill_meta(b, t), new_cache(config, b, t, "f32")
    )
    drift = float(jnp.max(jnp.abs(hidden - ref_hidden)))
    if drift > 1e-3:  # the layer-by-layer replica must be the model's own math
        raise RuntimeError(f"layer-by-layer run differs from llama.forward by {drift}")
    res["attention_rel_err"] = attention_errors(qs, cache, b, t)

    lines = [
        "| KV | bytes/token | perplexity | attn rel. err mean | max (over layers) |",
        "|---|---|---|---|---|",
    ]
    for v in KV_VARIANTS:
        e = res["attention_rel_err"].get(v)
        err = f"{e['mean']:.2e} | {e['max']:.2e}" if e else "0 (baseline) | 0"
        lines.append(f"| {v} | {res['bytes_per_token'][v]} | {res['perplexity'][v]:.4f} | {err} |")
    table = "\n".join(lines)
    res["seconds"] = time.monotonic() - start
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_quant_quality.json").write_text(json.dumps(res, indent=1))
    (out / "kv_quant_quality.md").write_text(table + "\n")
    print(table)
    print(f"wrote {out / 'kv_quant_quality.json'} in {res['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
