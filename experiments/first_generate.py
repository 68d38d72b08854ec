"""Load time, compile time and generate tokens/s of SmolLM2-135M-Instruct on this CPU, f32 and bf16.

    .venv/bin/python experiments/first_generate.py --out experiments/out/first_generate.json

For each dtype: build `LLM()` on the default model (the Q4_1 GGUF, dequantized to the dtype) and time
it (load_s: read + dequantize + move to device + allocate the KV cache); `llm.warmup()` compiles
every step variant (compile_s, with the number of XLA compilations); then, for each batch size B,
one `generate` of B chat prompts, greedy, `ignore_eos` and `max_tokens` fixed so every run makes
B x max_tokens tokens (tokens/s = that over the wall time, prefill included). One completion is
printed so a human can see the text is coherent.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from absl import app, flags

from jaxserve import LLM, SamplingParams
from jaxserve.bench.core import CompileCounter

_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "Dtypes to measure.")
_BATCH = flags.DEFINE_list("batch_sizes", ["1", "8"], "Prompts per generate call.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Tokens generated per prompt.")
_OUT = flags.DEFINE_string("out", None, "Write the JSON results here.")

QUESTIONS = [
    "What is the capital of France?",
    "Explain what a hash table is in two sentences.",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "Give three tips for learning a new language.",
    "What does a CPU cache do?",
    "Name the planets of the solar system.",
    "How do vaccines work?",
]


def measure(dtype: str, batch_sizes: list[int], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    llm = LLM(dtype=dtype, num_slots=max(batch_sizes), max_model_len=512)
    load_s = time.perf_counter() - t0
    with CompileCounter() as cc:
        compile_s = llm.warmup()
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    res = {"dtype": dtype, "load_s": load_s, "compile_s": compile_s, "compiles": cc.count}
    for b in batch_sizes:
        msgs = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(b)]
        with CompileCounter() as cc:
            t0 = time.perf_counter()
            outs = llm.chat(msgs, sp, use_tqdm=False)
            dt = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        res[f"batch{b}"] = {
            "seconds": dt,
            "output_tokens": n,
            "tokens_per_s": n / dt,
            "compiles_after_warmup": cc.count,
            "sample": outs[0].outputs[0].text,
        }
        logging.info("%s B=%d: %d tokens in %.2f s = %.1f tok/s", dtype, b, n, dt, n / dt)
    return res


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    batch_sizes = [int(b) for b in _BATCH.value]
    results = [measure(d, batch_sizes, _MAX_TOKENS.value) for d in _DTYPES.value]
    print(
        "| dtype | load s | compile s (compiles) | "
        + " | ".join(f"B={b} tok/s" for b in batch_sizes)
        + " |"
    )
    print("|---" * (3 + len(batch_sizes)) + "|")
    for r in results:
        cells = " | ".join(f"{r[f'batch{b}']['tokens_per_s']:.1f}" for b in batch_sizes)
        print(
            f"| {r['dtype']} | {r['load_s']:.1f} | {r['compile_s']:.1f} ({r['compiles']}) | {cells} |"
        )
    print("sample:", repr(results[-1][f"batch{batch_sizes[-1]}"]["sample"][:200]))
    if _OUT.value:
        Path(_OUT.value).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    app.run(main)
