"""Prefix caching A/B on SmolLM2 (CPU): a few-shot batch job and n > 1 sampling, caching off vs on.

Workload (a research batch job of the common kind): every row is a chat with the same long
few-shot system message (~300 tokens) and a short question of its own, greedy, 32 new tokens; then
16 prompts with n=4 seeded samples. Both engines live in one process (they share the jit caches, so
only the first warms up) and run in the order off, on, on, off (--rounds 2), so drift in machine load
hits both; the table reports each run and the ratio of the medians.

    .venv/bin/python experiments/prefix_caching.py --rows 192 --json experiments/out/prefix_caching.json
"""

from __future__ import annotations

import json
import statistics
import time

from absl import app, flags

from jaxserve import LLM, SamplingParams

_ROWS = flags.DEFINE_integer("rows", 192, "Few-shot rows per run.")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "off/on pairs (ABBA order).")
_SLOTS = flags.DEFINE_integer("num_slots", 32, "Slots.")
_JSON = flags.DEFINE_string("json", None, "Write the results here.")

SYSTEM = (
    "You are a careful assistant that answers questions about Python's standard library in one "
    "short sentence. Follow the style of these examples exactly.\n"
    "Q: What does the json module do?\nA: It encodes Python objects as JSON text and decodes JSON "
    "text back into Python objects.\n"
    "Q: What is pathlib for?\nA: It represents filesystem paths as objects with methods for "
    "joining, reading, writing and globbing.\n"
    "Q: What does itertools.chain do?\nA: It returns one iterator that yields the items of each "
    "given iterable in turn.\n"
    "Q: When should I use collections.deque?\nA: Use it when you append and pop at both ends of a "
    "sequence, which it does in constant time.\n"
    "Q: What does functools.lru_cache do?\nA: It memoizes a function, keeping the results of the "
    "most recent calls keyed by their arguments.\n"
    "Q: What is the purpose of the logging module?\nA: It lets libraries and programs emit "
    "messages at severity levels that handlers route to files, streams or services.\n"
    "Q: What does subprocess.run return?\nA: It returns a CompletedProcess holding the command's "
    "arguments, exit code and, if captured, its output.\n"
    "Q: How does dataclasses.dataclass help?\nA: It generates __init__, __repr__ and comparison "
    "methods from a class's annotated fields.\n"
    "Answer the next question the same way."
)
MODULES = ["os", "sys", "re", "time", "math", "random", "heapq", "bisect", "csv", "sqlite3",
           "argparse", "typing", "enum", "shutil", "tempfile", "hashlib", "struct", "zipfile",
           "threading", "asyncio", "socket", "unittest", "decimal", "fractions"]  # fmt: skip
ASKS = ["What does the {} module do?", "When should I use {}?", "What is {} for?"]


def chats(n: int, offset: int = 0) -> list[list[dict]]:
    out = []
    for i in range(offset, offset + n):
        q = ASKS[i % len(ASKS)].format(MODULES[(i // len(ASKS)) % len(MODULES)])
        out.append([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
    return out


def run(llm: LLM, rows: list, n_rows: list) -> dict:
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    sampled = SamplingParams(n=4, temperature=0.8, seed=1, max_tokens=32, ignore_eos=True)
    s0 = llm.stats()
    t = time.perf_counter()
    outs = llm.chat(rows, greedy, use_tqdm=False)
    t1 = time.perf_counter()
    n_outs = llm.chat(n_rows, sampled, use_tqdm=False)
    t2 = time.perf_counter()
    s1 = llm.stats()
    tok = sum(len(o.outputs[0].token_ids) for o in outs)
    n_tok = sum(len(c.token_ids) for o in n_outs for c in o.outputs)
    return {
        "fewshot_seconds": t1 - t,
        "fewshot_output_tok_per_s": tok / (t1 - t),
        "n4_seconds": t2 - t1,
        "n4_output_tok_per_s": n_tok / (t2 - t1),
        "prefill_tokens_computed": s1["num_prefill_tokens"] - s0["num_prefill_tokens"],
        "prefill_tokens_cached": s1["num_cached_prefill_tokens"] - s0["num_cached_prefill_tokens"],
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs)
        + 4 * sum(len(o.prompt_token_ids) for o in n_outs),
        "tokens": [o.outputs[0].token_ids for o in outs]
        + [c.token_ids for o in n_outs for c in o.outputs],
    }


def main(argv):
    del argv
    kw = dict(dtype="bfloat16", num_slots=_SLOTS.value, max_model_len=512, page_size=16)
    llms = {
        False: LLM(None, enable_prefix_caching=False, warmup=True, **kw),
        True: LLM(None, enable_prefix_caching=True, **kw),
    }
    rows, n_rows = chats(_ROWS.value), chats(16, offset=1000)
    for llm in llms.values():  # untimed: first calls of every shape this workload uses
        llm.chat(
            chats(40, offset=2000), SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
        )
    runs = {False: [], True: []}
    order = [False, True, True, False] * (_ROUNDS.value // 2) + [False, True] * (_ROUNDS.value % 2)
    for caching in order:
        r = run(llms[caching], rows, n_rows)
        runs[caching].append(r)
        print(
            f"caching={'on ' if caching else 'off'}  few-shot {r['fewshot_seconds']:6.1f} s "
            f"{r['fewshot_output_tok_per_s']:6.1f} tok/s   n=4 {r['n4_seconds']:5.1f} s "
            f"{r['n4_output_tok_per_s']:6.1f} tok/s   prefill computed {r['prefill_tokens_computed']}"
            f" cached {r['prefill_tokens_cached']} of {r['prompt_tokens']}",
            flush=True,
        )
    off, on = runs[False], runs[True]
    same = sum(a == b for a, b in zip(off[0]["tokens"], on[0]["tokens"]))
    summary = {
        "rows": _ROWS.value,
        "num_slots": _SLOTS.value,
        "fewshot_speedup_median": statistics.median(r["fewshot_seconds"] for r in off)
        / statistics.median(r["fewshot_seconds"] for r in on),
        "n4_speedup_median": statistics.median(r["n4_seconds"] for r in off)
        / statistics.median(r["n4_seconds"] for r in on),
        "prefill_tokens_computed": {
            "off": off[0]["prefill_tokens_computed"],
            "on": on[0]["prefill_tokens_computed"],
        },  # fmt: skip
        "identical_outputs": f"{same}/{len(off[0]['tokens'])}",
        "runs": {
            k: [{x: y for x, y in r.items() if x != "tokens"} for r in v]
            for k, v in (("off", off), ("on", on))
        },  # fmt: skip
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    app.run(main)
