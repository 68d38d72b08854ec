"""Perplexity of SmolLM2 under every weight quantization: f32, bf16, INT4 (RTN sym/asym, AWQ, GPTQ)
at two group sizes, INT8 and FP8. Writes JSON + a markdown table.

    python experiments/quant_quality.py [--max_tokens 4096] [--calib_tokens 8192] [--out DIR]

Texts (both offline, disjoint):
  calibration  Python's `pydoc_data.topics` (the language reference topics, in the stdlib); with
               --calib_sources pydoc,gnu-info also Debian's GNU info manuals (/usr/share/info)
  evaluation   /usr/share/common-licenses/GPL-3 (Debian base-files), first --max_tokens tokens

Every quantized model is quantized from the f32 weights and evaluated with f32 activations, so rows
differ only in the weights. Rows quantize the linear layers only (the embedding table, tied to the
output projection in SmolLM2, stays f32), except the "+ embed int4" row, which also quantizes the
table (RTN asymmetric, lm_head view) as `quantize_params` does by default. SmolLM2's 576-wide inputs (wq/wk/wv/w_gate/w_up: hidden 576; wo: 9x64)
are not a multiple of 128: at "g128" those weights use g64 and w_down (input 1536) uses g128
(`calibration.group_size_for(..., allow_smaller=True)`); the table names this "g128/64".

Note the source weights are the GGUF's Q4_1 (g32 asymmetric, f16 scale/min) dequantized: asymmetric
INT4 at g32 can reproduce them exactly, so the g32 rows measure little beyond f16 rounding.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # GPTQ's small BLAS calls thrash with 2 threads

import argparse
import json
import logging
import pickle
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.eval.perplexity import perplexity
from jaxserve.loading import load_model
from jaxserve.quant import (
    awq,
    calibration,
    gptq,
    linear_weight_names,
    quantize_embedding_table,
    quantize_params,
    refine,
    replace_weights,
    rtn,
)

log = logging.getLogger("quant_quality")
EVAL_TEXT = "/usr/share/common-licenses/GPL-3"
# Held-out text for the refinement's early stopping (--refine_holdout): Python source code, a kind
# of text unlike both the calibration prose and the evaluation license.
HOLDOUT_MODULES = ("argparse", "dataclasses", "textwrap", "json.decoder", "csv", "heapq", "shlex")


def holdout_text() -> str:
    import importlib
    import inspect

    return "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in HOLDOUT_MODULES)


def _get(params, name):
    for part in name.split("/"):
        params = params[part]
    return params


def rtn_params(params, config, group_size, symmetric):
    """RTN of every linear weight, falling back to a smaller group where group_size does not divide."""
    new = {}
    for name in linear_weight_names(params, config):
        w = _get(params, name)
        g = calibration.group_size_for(name, w.shape[-2], group_size, allow_smaller=True)
        new[name] = rtn.quantize_int4_rtn(w, g, symmetric=symmetric)
    return replace_weights(params, new)


def linear_bytes(params, config) -> tuple[int, int]:
    """(bytes of the linear weights as stored, bytes of the same weights in bf16)."""
    got = want = 0
    for name in linear_weight_names(params, config):
        w = _get(params, name)
        got += w.nbytes if not isinstance(w, jax.Array) else w.size * w.dtype.itemsize
        want += 2 * int(np.prod(w.shape))
    return got, want


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model name or path (default: SmolLM2 GGUF)")
    ap.add_argument("--text", default=EVAL_TEXT, help="evaluation text file")
    ap.add_argument(
        "--extra_text",
        default=None,
        help="a second evaluation text file: every row is also scored on it (ppl_extra)",
    )
    ap.add_argument("--max_tokens", type=int, default=4096, help="evaluation tokens (first N)")
    ap.add_argument("--window", type=int, default=512, help="perplexity window")
    ap.add_argument("--calib_tokens", type=int, default=16384, help="calibration tokens")
    ap.add_argument("--calib_seqlen", type=int, default=512, help="calibration window length")
    ap.add_argument(
        "--calib_sources",
        default="pydoc",
        help="comma-separated calibration texts sharing the windows (calibration."
        "CALIBRATION_SOURCES: pydoc, gnu-info)",
    )
    ap.add_argument("--group_sizes", default="128,32", help="comma-separated INT4 group sizes")
    ap.add_argument(
        "--methods",
        default="rtn,rtn-asym,awq,gptq,gptq-plain,int8,fp8",
        help="comma-separated subset of rtn,rtn-asym,awq,awq-duo,gptq,gptq-act,gptq-seq,"
        "gptq-refine,gptq-refine-act,gptq-plain,int8,fp8 (gptq: the default recipe, GPTQ on AWQ "
        "scales with damp gptq.DEFAULT_DAMP, on float-model statistics; gptq-seq: the same recipe "
        "layer by layer on the quantized prefix's activations, as quantize_params and convert run "
        "it; gptq-refine(-act): gptq-seq (with act-order) plus the block-wise optax refinement of "
        "jaxserve.quant.refine; "
        "gptq-plain: GPTQ without AWQ scales at damp 0.1, the first recipe; awq-duo: AWQ with "
        "the duo scale search)",
    )
    ap.add_argument("--refine_steps", type=int, default=64, help="gptq-refine: Adam steps/layer")
    ap.add_argument("--refine_lr", type=float, default=3e-3, help="gptq-refine: Adam lr")
    ap.add_argument(
        "--refine_per_token",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="gptq-refine: per-token relative output error (else plain MSE)",
    )
    ap.add_argument(
        "--refine_holdout",
        type=int,
        default=0,
        help="gptq-refine: windows of held-out text (stdlib Python source) for early stopping",
    )
    ap.add_argument("--refine_eval_every", type=int, default=16, help="held-out check period")
    ap.add_argument("--out", default="experiments/out/quant_quality", help="output directory")
    ap.add_argument(
        "--stats_cache",
        default=None,
        help="pickle of the calibration statistics: loaded if it exists, else written (reruns)",
    )
    ap.add_argument(
        "--embedding_row",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also score AWQ with the embedding table in INT4 (quantize_params' default)",
    )
    ap.add_argument("--skip_bf16", action="store_true", help="no bf16 row (saves a model load)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    methods = args.methods.split(",")

    t0 = time.perf_counter()
    m32 = load_model(args.model, dtype="float32")
    cfg, p32, tok = m32.config, m32.params, m32.tokenizer
    ids = np.asarray(tok(Path(args.text).read_text(), add_special_tokens=False)["input_ids"])
    ids = ids[: args.max_tokens]
    extra_ids = None
    if args.extra_text:
        extra_ids = np.asarray(
            tok(Path(args.extra_text).read_text(), add_special_tokens=False)["input_ids"]
        )[: args.max_tokens]
    sources = args.calib_sources.split(",")
    calib = calibration.calibration_tokens(
        tok, args.calib_tokens, args.calib_seqlen, sources=sources
    )
    log.info(
        "loaded in %.0f s; eval %d tokens, calib %s",
        time.perf_counter() - t0,
        len(ids),
        calib.shape,
    )

    rows = []
    stats = None
    if args.stats_cache and Path(args.stats_cache).exists():
        with open(args.stats_cache, "rb") as f:
            stats = pickle.load(f)
        log.info("calibration statistics from %s", args.stats_cache)

    def get_stats():
        nonlocal stats
        if stats is None:  # float-model statistics, shared by AWQ, GPTQ and group sizes
            stats = calibration.collect_stats(p32, cfg, calib)
            if args.stats_cache:
                with open(args.stats_cache, "wb") as f:
                    pickle.dump(stats, f)
        return stats

    def record(name, group, params, qtime):
        t = time.perf_counter()
        r = perplexity(params, cfg, ids, window=args.window)
        extra = perplexity(params, cfg, extra_ids, window=args.window) if args.extra_text else {}
        got, want = linear_bytes(params, cfg)
        rows.append(
            dict(
                method=name,
                group=group,
                ppl=r["ppl"],
                ppl_extra=extra.get("ppl"),
                tokens=r["tokens"],
                window=r["window"],
                linear_bytes_vs_bf16=got / want,
                quantize_s=qtime,
                eval_s=time.perf_counter() - t,
            )
        )
        log.info(
            "%s %s ppl %.4f, extra text %s (quantize %.0f s)",
            name,
            group,
            r["ppl"],
            extra.get("ppl"),
            qtime,
        )
        (out / "results.json").write_text(json.dumps(rows, indent=1))

    record("f32", "-", p32, 0.0)
    if not args.skip_bf16:
        record("bf16", "-", load_model(args.model, dtype="bfloat16").params, 0.0)
    for g in [int(x) for x in args.group_sizes.split(",")]:
        label = f"g{g}" if cfg.hidden_size % g == 0 else f"g{g}/{64 if g == 128 else g // 2}"
        for meth in methods:
            t = time.perf_counter()
            if meth in ("rtn", "rtn-asym"):
                q = rtn_params(p32, cfg, g, symmetric=meth == "rtn")
            elif meth in ("awq", "awq-duo"):
                q = awq.quantize_awq(
                    p32, cfg, g, get_stats(), allow_smaller_groups=True, duo=meth == "awq-duo"
                )
            elif meth in ("gptq", "gptq-act"):
                q = gptq.quantize_gptq(
                    p32,
                    cfg,
                    g,
                    get_stats(),
                    act_order=meth == "gptq-act",
                    allow_smaller_groups=True,
                )
            elif meth == "gptq-seq":  # what quantize_params / convert run given tokens
                q = gptq.quantize_gptq(p32, cfg, g, calib, allow_smaller_groups=True)
            elif meth in ("gptq-refine", "gptq-refine-act"):  # gptq-seq + optax refinement
                rc = refine.RefineConfig(
                    steps=args.refine_steps,
                    lr=args.refine_lr,
                    per_token=args.refine_per_token,
                    holdout=args.refine_holdout,
                    eval_every=args.refine_eval_every,
                )
                tokens = calib
                if args.refine_holdout:  # appended: the last windows are the held-out ones
                    n = args.refine_holdout * args.calib_seqlen
                    ho = calibration.calibration_tokens(tok, n, args.calib_seqlen, holdout_text())
                    tokens = np.concatenate([calib, ho])
                q = gptq.quantize_gptq(
                    p32,
                    cfg,
                    g,
                    tokens,
                    act_order=meth == "gptq-refine-act",
                    allow_smaller_groups=True,
                    refine_config=rc,
                )
            elif meth == "gptq-plain":
                q = gptq.quantize_gptq(
                    p32, cfg, g, get_stats(), damp=0.1, allow_smaller_groups=True, awq_scales=False
                )
            else:
                continue
            jax.block_until_ready(q)
            record(f"int4-{meth}", label, q, time.perf_counter() - t)
            if meth == "awq" and args.embedding_row:
                # What quantize_params serves by default: the tied embedding table INT4 too.
                g_e = calibration.group_size_for("embed", cfg.hidden_size, g, allow_smaller=True)
                qe = quantize_embedding_table(q, "int4-awq", g_e)
                record("int4-awq + embed int4", label, qe, time.perf_counter() - t)
    for meth in ("int8", "fp8"):
        if meth in methods:
            t = time.perf_counter()
            q = quantize_params(p32, cfg, meth, quantize_embedding=False)
            jax.block_until_ready(q)
            record(meth, "per-channel", q, time.perf_counter() - t)

    bf16 = next((r["ppl"] for r in rows if r["method"] == "bf16"), rows[0]["ppl"])
    lines = [
        f"SmolLM2-135M-Instruct (source: {m32.source}); eval: {args.text}, {rows[0]['tokens']} "
        f"scored tokens in windows of {args.window}; calibration: {calibration.describe_sources(sources)}, "
        f"{calib.shape[0]}x{calib.shape[1]} tokens. Quantized rows: f32 activations, linear layers "
        "quantized, embedding table f32 unless the row says otherwise.",
        "",
        "| weights | group | perplexity | vs bf16 | linear bytes vs bf16 | quantize s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['group']} | {r['ppl']:.3f} | {100 * (r['ppl'] / bf16 - 1):+.2f}% "
            f"| {r['linear_bytes_vs_bf16']:.3f} | {r['quantize_s']:.0f} |"
        )
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    jnp.zeros(())  # initialize the backend before timing anything
    main()
