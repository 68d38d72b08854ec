"""Prefix caching A/B on SmolLM2 (CPU): a few-shot batch job, n > 1 sampling and multi-turn chats,
caching off vs on.

--parts=fewshot (a research batch job of the common kind): every row is a chat with the same long
few-shot system message (~300 tokens) and a short question of its own, greedy, 32 new tokens; then
16 prompts with n=4 seeded samples.

--parts=multiturn: --convs chats of three turns, each turn one `chat` call over all of them. Turn
t + 1's conversation is turn t's plus its answer (the text) and a follow-up question, so its prompt
begins with turn t's prompt and answer. Since the sixteenth session only pages a prefill computed
are cached (decode-written K/V round differently in bf16, issue 24), so a hit stops at turn t's
prompt and the answer is recomputed. Greedy, up to 64 new tokens, stopping at EOS as a chat does.

--parts=unshared: what caching costs when nothing is shared (it is on by default): --rows
prompts of distinct random token ids (16-200 tokens), greedy, 64 new tokens, ignore_eos; every
lookup misses and every full prompt page is registered.

Both engines live in one process (they share the jit caches, so only the first warms up) and run in
the order off, on, on, off (--rounds 2), so drift in machine load hits both; the table reports each
run and the ratio of the medians. Every run starts from an empty prefix cache
(`LLM.reset_prefix_cache`); the untimed warm-up's prompts are not reused.

    .venv/bin/python experiments/prefix_caching.py --rows 192 --json experiments/out/prefix_caching.json
    .venv/bin/python experiments/prefix_caching.py --parts=multiturn --json experiments/out/prefix_multiturn.json
    .venv/bin/python experiments/prefix_caching.py --parts=unshared --rows 64 --rounds 4
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
_PARTS = flags.DEFINE_list("parts", ["fewshot"], "fewshot (and n=4 sampling), multiturn.")
_CONVS = flags.DEFINE_integer("convs", 32, "Conversations in the multiturn part.")

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


FOLLOW_UPS = ["Show it in a one-line code example.", "Name one common mistake people make with it."]


def multiturn(llm: LLM, n: int) -> dict:
    """Three turns of `n` chats; turn t + 1 = turn t's conversation, its answer and a follow-up."""
    sp = SamplingParams(temperature=0, max_tokens=64)
    page = llm.engine_config.page_size
    convs = [[c[1]] for c in chats(n, offset=3000)]  # the user questions alone, no few-shot system
    turns, prev = [], None
    for t in range(1 + len(FOLLOW_UPS)):
        s0, t0 = llm.stats(), time.perf_counter()
        outs = llm.chat(convs, sp, use_tqdm=False)
        seconds, s1 = time.perf_counter() - t0, llm.stats()
        cached = [o.num_cached_tokens for o in outs]
        lens = [len(o.prompt_token_ids) for o in outs]
        turns.append(
            {
                "seconds": seconds,
                "prompt_tokens": sum(lens),
                "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                "prefill_tokens_computed": s1["num_prefill_tokens"] - s0["num_prefill_tokens"],
                "prefill_tokens_cached": sum(cached),
                # hits past the full pages of the turn before's prompt: generated-token pages
                "cached_past_previous_prompt": 0
                if prev is None
                else sum(max(0, c - page * (p // page)) for c, p in zip(cached, prev)),
                "tokens": [o.outputs[0].token_ids for o in outs],
            }
        )
        prev = lens
        if t < len(FOLLOW_UPS):
            convs = [
                c + [{"role": "assistant", "content": o.outputs[0].text},
                     {"role": "user", "content": FOLLOW_UPS[t]}]
                for c, o in zip(convs, outs)
            ]  # fmt: skip
    total = sum(x["seconds"] for x in turns)
    return {
        "seconds": total,
        "output_tok_per_s": sum(x["output_tokens"] for x in turns) / total,
        "prefill_tokens_computed": sum(x["prefill_tokens_computed"] for x in turns),
        "prefill_tokens_cached": sum(x["prefill_tokens_cached"] for x in turns),
        "cached_past_previous_prompt": sum(x["cached_past_previous_prompt"] for x in turns),
        "prompt_tokens": sum(x["prompt_tokens"] for x in turns),
        "turns": [{k: v for k, v in x.items() if k != "tokens"} for x in turns],
        "tokens": [tok for x in turns for tok in x["tokens"]],
    }


def unshared(llm: LLM, n: int) -> dict:
    """n prompts of random ids (no two share a page), greedy, 64 tokens each."""
    import numpy as np

    rng = np.random.default_rng(5)
    prompts = [
        {"prompt_token_ids": rng.integers(100, 40000, int(k)).tolist()}
        for k in rng.integers(16, 200, n)
    ]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    s0, t0 = llm.stats(), time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    seconds, s1 = time.perf_counter() - t0, llm.stats()
    return {
        "seconds": seconds,
        "output_tok_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / seconds,
        "prefill_tokens_computed": s1["num_prefill_tokens"] - s0["num_prefill_tokens"],
        "prefill_tokens_cached": s1["num_cached_prefill_tokens"] - s0["num_cached_prefill_tokens"],
        "tokens": [o.outputs[0].token_ids for o in outs],
    }


def ab(llms: dict, one_run, describe) -> tuple[list, list]:
    """Runs `one_run(llm)` in the order off, on, on, off (--rounds 2); returns (off, on) runs."""
    runs = {False: [], True: []}
    order = [False, True, True, False] * (_ROUNDS.value // 2) + [False, True] * (_ROUNDS.value % 2)
    for caching in order:
        if not llms[caching].reset_prefix_cache():  # every run starts from a cold cache
            raise RuntimeError("the engine still has requests")
        r = one_run(llms[caching])
        runs[caching].append(r)
        print(f"caching={'on ' if caching else 'off'}  {describe(r)}", flush=True)
    return runs[False], runs[True]


def both(off: list, on: list) -> dict:
    """What every part reports of its off and on runs: prefill work, identical outputs, the runs."""
    same = sum(a == b for a, b in zip(off[0]["tokens"], on[0]["tokens"]))
    return {
        "prefill_tokens_computed": {
            "off": off[0]["prefill_tokens_computed"],
            "on": on[0]["prefill_tokens_computed"],
        },
        "identical_outputs": f"{same}/{len(off[0]['tokens'])}",
        "runs": {
            k: [{x: y for x, y in r.items() if x != "tokens"} for r in runs]
            for k, runs in (("off", off), ("on", on))
        },
    }


def median_ratio(off: list, on: list, key: str) -> float:
    return statistics.median(r[key] for r in off) / statistics.median(r[key] for r in on)


def main(argv):
    del argv
    unknown = set(_PARTS.value) - {"fewshot", "multiturn", "unshared"}
    if unknown:
        raise app.UsageError(
            f"unknown --parts {sorted(unknown)}; known: fewshot, multiturn, unshared"
        )
    kw = dict(dtype="bfloat16", num_slots=_SLOTS.value, max_model_len=512, page_size=16)
    llms = {
        False: LLM(None, enable_prefix_caching=False, warmup=True, **kw),
        True: LLM(None, enable_prefix_caching=True, **kw),
    }
    for llm in llms.values():  # untimed: first calls of every shape this workload uses
        llm.chat(
            chats(40, offset=2000), SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
        )
    summary: dict = {"num_slots": _SLOTS.value}
    if "fewshot" in _PARTS.value:
        rows, n_rows = chats(_ROWS.value), chats(16, offset=1000)
        off, on = ab(
            llms,
            lambda llm: run(llm, rows, n_rows),
            lambda r: (
                f"few-shot {r['fewshot_seconds']:6.1f} s {r['fewshot_output_tok_per_s']:6.1f} tok/s"
                f"   n=4 {r['n4_seconds']:5.1f} s {r['n4_output_tok_per_s']:6.1f} tok/s   prefill"
                f" computed {r['prefill_tokens_computed']} cached {r['prefill_tokens_cached']} of"
                f" {r['prompt_tokens']}"
            ),
        )
        summary["fewshot"] = {
            "rows": _ROWS.value,
            "fewshot_speedup_median": median_ratio(off, on, "fewshot_seconds"),
            "n4_speedup_median": median_ratio(off, on, "n4_seconds"),
            **both(off, on),
        }
    if "multiturn" in _PARTS.value:
        off, on = ab(
            llms,
            lambda llm: multiturn(llm, _CONVS.value),
            lambda r: (
                f"multi-turn {r['seconds']:6.1f} s {r['output_tok_per_s']:6.1f} tok/s   prefill"
                f" computed {r['prefill_tokens_computed']} cached {r['prefill_tokens_cached']}"
                f" ({r['cached_past_previous_prompt']} past the previous turn's prompt) of"
                f" {r['prompt_tokens']}"
            ),
        )
        summary["multiturn"] = {
            "convs": _CONVS.value,
            "speedup_median": median_ratio(off, on, "seconds"),
            **both(off, on),
        }
    if "unshared" in _PARTS.value:
        off, on = ab(
            llms,
            lambda llm: unshared(llm, _ROWS.value),
            lambda r: (
                f"unshared {r['seconds']:6.1f} s {r['output_tok_per_s']:6.1f} tok/s   prefill"
                f" computed {r['prefill_tokens_computed']} cached {r['prefill_tokens_cached']}"
            ),
        )
        summary["unshared"] = {
            "rows": _ROWS.value,
            "off_over_on_seconds_median": median_ratio(off, on, "seconds"),
            **both(off, on),
        }
    printed = {
        part: {k: v for k, v in d.items() if k != "runs"} if isinstance(d, dict) else d
        for part, d in summary.items()
    }
    print(json.dumps(printed, indent=1))
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    app.run(main)
