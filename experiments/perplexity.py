"""Perplexity of a model on a text file, over non-overlapping windows; prints one JSON line.

    python experiments/perplexity.py --model <name or path> --text <file> [--dtype float32]
        [--quantization int4-awq --group_size 64] [--window 512] [--max_tokens N]

--model is anything `jaxserve.loading.load_model` accepts (unset: SmolLM2; a converted
checkpoint directory is evaluated as stored). --quantization quantizes the loaded float weights
first; int4-awq / int4-gptq calibrate on the stdlib's pydoc topics (`jaxserve.quant.calibration`),
so evaluate them on a different text.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxserve.eval.perplexity import perplexity
from jaxserve.loading import load_model
from jaxserve.models import llama
from jaxserve.quant import calibration, quantize_params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model name or path (unset: SmolLM2)")
    ap.add_argument("--text", required=True, help="text file to score")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype")
    ap.add_argument("--quantization", default=None, help="e.g. int4-rtn, int4-awq, int8, fp8")
    ap.add_argument("--group_size", type=int, default=128, help="INT4 group size")
    ap.add_argument("--window", type=int, default=512, help="tokens per window")
    ap.add_argument("--max_tokens", type=int, default=None, help="score only the first N tokens")
    ap.add_argument("--batch", type=int, default=1, help="windows per forward")
    ap.add_argument("--kv_cache_dtype", default="auto", choices=["auto", "int8", "fp8"])
    ap.add_argument("--calib_tokens", type=int, default=16384, help="AWQ/GPTQ calibration tokens")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    m = load_model(args.model, dtype=args.dtype)
    if m.tokenizer is None:
        raise SystemExit(f"error: {m.source} has no tokenizer to encode --text")
    params = m.params
    if args.quantization:
        calib = None
        if args.quantization in ("int4-awq", "int4-gptq"):
            calib = calibration.calibration_tokens(m.tokenizer, args.calib_tokens, 512)
        params = quantize_params(params, m.config, args.quantization, args.group_size, calib)
    ids = m.tokenizer(Path(args.text).read_text(), add_special_tokens=False)["input_ids"]
    ids = np.asarray(ids[: args.max_tokens] if args.max_tokens else ids)
    t = time.perf_counter()
    r = perplexity(
        params,
        m.config,
        ids,
        window=args.window,
        batch=args.batch,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    r.update(
        model=m.source,
        text=args.text,
        dtype=str(jnp.dtype(llama.model_dtype(params))),  # a checkpoint keeps its stored dtype
        quantization=args.quantization,
        seconds=round(time.perf_counter() - t, 1),
    )
    print(json.dumps(r))


if __name__ == "__main__":
    main()
