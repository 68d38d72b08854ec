"""Hugging Face transformers baseline: SmolLM2 `generate` in static padded batches on the CPU.

Runs in a Python 3.11 venv with torch 2.13.0 (CPU) + transformers + gguf + accelerate (jaxserve needs
Python 3.12, for which no CPU torch wheel exists here):

    PYENV_VERSION=3.11.7 python3 -m venv .venv-hf
    .venv-hf/bin/pip install torch==2.13.0 transformers gguf accelerate numpy
    .venv-hf/bin/python experiments/hf_baseline.py --workload_json W.json --gguf SmolLM2.gguf \
        --batch_size 32 --threads 2 --out hf.json

Dataflow: the workload JSON (written by `jaxserve.bench.workloads.Workload.to_json`, so both sides serve
identical token prompts) is cut in input order into batches of `batch_size` requests; each batch is
left-padded to its longest prompt (`input_ids`, `attention_mask`: (B, T_max)) and run through greedy
`generate` with EOS disabled for max(max_tokens of the batch) new tokens: a static batch runs as long as
its longest request. Throughput counts *useful* tokens, the ones each request asked for
(sum of max_tokens), over the wall time of all batches; `raw_tokens_per_s` counts every generated
position including those past a request's own length.

`--export_hf_dir DIR` instead saves the GGUF, dequantized, as a plain HF folder (safetensors +
config + tokenizer) for engines that cannot read GGUF (vLLM): `hf_quantizer` is dropped first so
`save_pretrained` writes ordinary weights.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

log = logging.getLogger("hf_baseline")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def load(gguf: Path, dtype: str):
    t0 = time.perf_counter()
    # dequantize=True: plain dense weights in `dtype`. Without it transformers 5.x keeps the Q4_1
    # blocks packed and runs its GGUF matmul kernels in f32 (~100x slower here), not a bf16 model.
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        dtype=DTYPES[dtype],
        quantization_config=GgufConfig(gguf_file=str(gguf), dequantize=True),
    )
    model.eval()
    model.hf_quantizer = None  # the weights are dense now; also lets save_pretrained write them
    log.info("q_proj: %s %s", type(model.model.layers[0].self_attn.q_proj).__name__, model.dtype)
    return model, time.perf_counter() - t0


def export_hf_dir(gguf: Path, out_dir: Path, dtype: str) -> None:
    model, _ = load(gguf, dtype)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out_dir)
    log.info("saved %s (%s) to %s", gguf.name, dtype, out_dir)


def run_batch(model, reqs: list[dict], pad_id: int) -> tuple[float, int]:
    """Generates one left-padded static batch; returns (seconds, new positions per row)."""
    t_max = max(len(r["prompt_token_ids"]) for r in reqs)
    ids = torch.full((len(reqs), t_max), pad_id, dtype=torch.long)  # (B, T_max)
    mask = torch.zeros((len(reqs), t_max), dtype=torch.long)  # (B, T_max)
    for i, r in enumerate(reqs):
        p = r["prompt_token_ids"]
        ids[i, t_max - len(p) :] = torch.tensor(p)
        mask[i, t_max - len(p) :] = 1
    new = max(r["max_tokens"] for r in reqs)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=pad_id,
            eos_token_id=None,
        )
    dt = time.perf_counter() - t0
    if out.shape[1] - t_max != new:
        raise RuntimeError(f"HF generated {out.shape[1] - t_max} positions, expected {new}")
    return dt, new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workload_json", type=Path)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--max_batches", type=int, default=0, help="0 = every batch")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--export_hf_dir", type=Path, help="save a dequantized HF folder and exit")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    if args.export_hf_dir:
        export_hf_dir(args.gguf, args.export_hf_dir, args.dtype)
        return
    if args.workload_json is None or args.batch_size <= 0:
        raise ValueError("--workload_json and a positive --batch_size are required")
    workload = json.loads(args.workload_json.read_text())
    reqs = workload["requests"]
    batches = [reqs[i : i + args.batch_size] for i in range(0, len(reqs), args.batch_size)]
    if args.max_batches:
        batches = batches[: args.max_batches]

    model, load_s = load(args.gguf, args.dtype)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    warm_s, _ = run_batch(model, [{"prompt_token_ids": [40] * 8, "max_tokens": 4}] * 2, pad_id)

    times, useful, raw, done = [], 0, 0, 0
    for i, b in enumerate(batches):
        dt, new = run_batch(model, b, pad_id)
        times.append(dt)
        useful += sum(r["max_tokens"] for r in b)
        raw += new * len(b)
        done += len(b)
        log.info(
            "batch %d/%d: %d rows x %d new tokens in %.1f s", i + 1, len(batches), len(b), new, dt
        )
        total = float(np.sum(times))
        summary = {
            "engine": f"hf-transformers {transformers.__version__} torch {torch.__version__}",
            "dtype": args.dtype,
            "threads": args.threads,
            "workload": workload["name"],
            "num_requests": done,
            "num_batches_done": i + 1,
            "num_batches": len(batches),
            "batch_size": args.batch_size,
            "load_s": load_s,
            "warmup_s": warm_s,
            "elapsed_s": total,
            "output_tokens": useful,
            "output_tokens_per_s": useful / total,
            "raw_tokens_per_s": raw / total,
            "requests_per_s": done / total,
            "batch_seconds": times,
        }
        if args.out:  # after every batch, so a run cut short still reports what it measured
            args.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "batch_seconds"}, indent=1))


if __name__ == "__main__":
    main()
