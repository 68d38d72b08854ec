"""What LLVM -O0 (`XLA_FLAGS=--xla_backend_optimization_level=0`, the test suite's level; BUILD.md
Tests) changes against XLA's default level on this CPU: the bits of engine outputs and the time of
a decode step.

Each level runs in a subprocess of its own (XLA reads its flags once). Per engine (tiny f32 with the
CPU default attention, tiny bf16 'ragged', the gemma2 and qwen3_moe goldens in f32, SmolLM2 bf16),
three requests: greedy with logprobs, seeded top-p with logprobs, greedy with prompt logprobs. The
parent reports, per engine, whether the token ids and the logprob bits are the same at both levels.
Then SmolLM2 f32 with 8 slots decodes one sampled request of 64 tokens (after a run that compiles):
milliseconds per token at each level.

    .venv/bin/python experiments/xla_opt_level.py [--out experiments/out/xla_opt_level.json]

Name the CPU beside every figure (NOTES.md): these VMs vary between sessions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden"
ENGINES = {
    "tiny f32 auto": ("tiny", dict(load_format="dummy", dtype="float32", max_model_len=64)),
    "tiny bf16 ragged": (
        "tiny",
        dict(load_format="dummy", dtype="bfloat16", max_model_len=64, attention_impl="ragged"),
    ),
    "gemma2 f32 ragged": (
        str(GOLDEN / "gemma2"),
        dict(dtype="float32", max_model_len=32, page_size=4, attention_impl="ragged"),
    ),
    "qwen3_moe f32 auto": (str(GOLDEN / "qwen3_moe"), dict(dtype="float32", max_model_len=32)),
    "smollm2 bf16 auto": (None, dict(dtype="bfloat16", max_model_len=128)),
}


def child() -> dict:
    import numpy as np

    from jaxserve import LLM, SamplingParams

    def lp_bits(entries):
        return [
            None if d is None else [(k, float(x.logprob).hex()) for k, x in sorted(d.items())]
            for d in entries or []
        ]

    out = {}
    rng = np.random.default_rng(0)
    sps = [
        SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True),
        SamplingParams(
            temperature=0.9, top_p=0.9, seed=5, max_tokens=8, logprobs=2, ignore_eos=True
        ),
        SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, ignore_eos=True),
    ]
    for name, (model, kw) in ENGINES.items():
        llm = LLM(model, num_slots=4, **kw) if model else LLM(num_slots=4, **kw)
        vocab = min(llm.engine.model_config.vocab_size, 500)
        prompts = [{"prompt_token_ids": rng.integers(3, vocab, n).tolist()} for n in (3, 9, 17)]
        res = llm.generate(prompts, sps, use_tqdm=False)
        out[name] = {
            "tokens": [list(r.outputs[0].token_ids) for r in res],
            "logprobs": [[lp_bits(r.outputs[0].logprobs), lp_bits(r.prompt_logprobs)] for r in res],
        }
    llm = LLM(dtype="float32", num_slots=8, max_model_len=384)
    chat = [{"role": "user", "content": "Give a person as JSON."}]
    sp = SamplingParams(temperature=0.8, seed=7, max_tokens=64, ignore_eos=True)
    llm.chat(chat, sp, use_tqdm=False)  # compiles
    t0 = time.perf_counter()
    n = len(llm.chat(chat, sp, use_tqdm=False)[0].outputs[0].token_ids)
    out["smollm2 f32 decode ms/token"] = 1000 * (time.perf_counter() - t0) / n
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="experiments/out/xla_opt_level.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child()))
        return
    from jaxserve.bench.core import cpu_name

    flags = os.environ.get("XLA_FLAGS", "").replace("--xla_backend_optimization_level=0", "")
    levels = {"default": flags.strip(), "O0": f"{flags} --xla_backend_optimization_level=0".strip()}
    runs = {}
    for level, xla_flags in levels.items():
        proc = subprocess.run(
            [sys.executable, __file__, "--child"],
            env={**os.environ, "XLA_FLAGS": xla_flags},
            capture_output=True,
            text=True,
            check=True,
        )
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
        runs[level] = json.loads(line[len("RESULT ") :])
    a, b = runs["default"], runs["O0"]
    report = {"cpu": cpu_name(), "engines": {}}
    print(f"{cpu_name()}\n{'engine':22s} tokens  logprob bits")
    for name in ENGINES:
        same = [a[name][k] == b[name][k] for k in ("tokens", "logprobs")]
        report["engines"][name] = dict(zip(("same_tokens", "same_logprob_bits"), same, strict=True))
        print(f"{name:22s} {'same' if same[0] else 'DIFFER':7s} {'same' if same[1] else 'differ'}")
    key = "smollm2 f32 decode ms/token"
    report["decode_ms_per_token"] = {"default": a[key], "O0": b[key]}
    print(f"SmolLM2 f32, 8 slots, sampled: {a[key]:.1f} ms/token default, {b[key]:.1f} at -O0")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
