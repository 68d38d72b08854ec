r"""What structured outputs cost: output tokens/s with 0%, 50% and 100% of the requests constrained
(issue 25).

One `LLM` (SmolLM2-135M-Instruct, --dtype, --num_slots slots), --num_requests chat requests of
--max_tokens tokens each. A constrained request follows a regex that never completes
(`(word )+` over a few words), so it runs to max_tokens like the unconstrained ones
(ignore_eos) and every variant generates the same number of tokens; each of its tokens needs a
llguidance mask on the host and the masked sampler on the device. The variants alternate within
one process, --reps times each after one untimed run; the table gives the median tok/s and the
ratio to the default at 0%. Modes: "split" (the default on one device: a decode step is a
forward program then a sampling program, and a constrained step's masks are computed while the
forward runs, vLLM's overlap), "fused" (one program per decode step, the masks computed before it:
the overlap's baseline and the old decode path), "sync" (split with async scheduling off, as the
engine runs while a constrained request is active). A JSON-schema run (--json_schema, natural
lengths, ended by the grammar) is timed the same way for a realistic grammar.

    .venv/bin/python experiments/structured_outputs_cost.py [--reps 3] [--json out.json]

Name the CPU beside every figure (NOTES.md): these VMs vary between sessions.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

from absl import app, flags

from jaxserve import LLM, SamplingParams, StructuredOutputsParams
from jaxserve.bench.core import cpu_name

_REPS = flags.DEFINE_integer("reps", 3, "Timed runs per variant (after one untimed run).")
_N = flags.DEFINE_integer("num_requests", 64, "Requests per run.")
_SLOTS = flags.DEFINE_integer("num_slots", 32, "Engine slots.")
_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Output tokens per request.")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Model dtype.")
_FRACTIONS = flags.DEFINE_list("fractions", ["0", "0.5", "1"], "Constrained fractions.")
_JSON_SCHEMA = flags.DEFINE_bool("json_schema", True, "Also time a JSON-schema grammar.")
_OUT = flags.DEFINE_string("json", None, "Write the results here.")

WORDS = r"((the|a|cat|dog|sat|on|mat|and|then|ran) )+"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    },
    "required": ["name", "age", "skills"],
}


def _requests(n: int, fraction: float, constraint: StructuredOutputsParams, ignore_eos: bool):
    chats, sps = [], []
    k = round(n * fraction)
    for i in range(n):
        chats.append([{"role": "user", "content": f"Tell me about item {i}."}])
        so = constraint if i < k else None  # the first k constrained
        sps.append(
            SamplingParams(
                temperature=0.8,
                seed=i,
                max_tokens=_TOKENS.value,
                ignore_eos=ignore_eos and so is None,
                structured_outputs=so,
            )
        )
    return chats, sps


def _run(llm: LLM, chats, sps) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.chat(chats, sps, use_tqdm=False)
    dt = time.perf_counter() - t0
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error][:1]
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def main(_):
    llm = LLM(dtype=_DTYPE.value, num_slots=_SLOTS.value, max_model_len=512, warmup=True)
    runner = llm.engine.runner
    # (grammar, constrained fraction, mode): "split" is the default (a decode step as forward +
    # sample programs, the masks computed while the forward runs), "fused" one program per step
    # (the masks computed before it), "sync" the default with async scheduling off.
    variants = [("regex", 0.0, "split"), ("regex", 0.0, "fused"), ("regex", 0.0, "sync")]
    for f in _FRACTIONS.value:
        if float(f) > 0:
            variants.append(("regex", float(f), "split"))
    variants.append(("regex", 1.0, "fused"))
    if _JSON_SCHEMA.value:
        variants += [("json", float(f), "split") for f in _FRACTIONS.value if float(f) > 0]
    grammars = {
        "regex": StructuredOutputsParams(regex=WORDS),
        "json": StructuredOutputsParams(json=SCHEMA),
    }
    runs = {v: [] for v in variants}
    config = llm.engine.config
    for rep in range(_REPS.value + 1):
        for kind, frac, mode in variants:
            chats, sps = _requests(_N.value, frac, grammars[kind], ignore_eos=kind != "json")
            runner.overlaps_grammar = mode != "fused"
            if mode == "sync":
                llm.engine.config = dataclasses.replace(config, async_scheduling=False)
            dt, toks = _run(llm, chats, sps)
            llm.engine.config, runner.overlaps_grammar = config, True
            if rep:  # the first round is untimed (compiles of the fused programs, grammars)
                runs[(kind, frac, mode)].append((dt, toks))
    base = statistics.median(t / d for d, t in runs[("regex", 0.0, "split")])
    rows = []
    print(f"CPU: {cpu_name()}; {_N.value} requests, {_SLOTS.value} slots, {_DTYPE.value}")
    print(f"{'grammar':8} {'constrained':>11} {'mode':>6} {'tok/s (median)':>15} {'vs 0%':>6}")
    for kind, frac, mode in variants:
        rates = [t / d for d, t in runs[(kind, frac, mode)]]
        med = statistics.median(rates)
        toks = runs[(kind, frac, mode)][0][1]
        rows.append(
            dict(grammar=kind, fraction=frac, mode=mode, tok_s=med, ratio=med / base, tokens=toks)
        )
        print(f"{kind:8} {frac:>11.0%} {mode:>6} {med:>15.1f} {med / base:>6.2f}  ({toks} tokens)")
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(
                dict(cpu=cpu_name(), rows=rows, date=time.strftime("%Y-%m-%d %H:%M")), f, indent=1
            )


if __name__ == "__main__":
    app.run(main)
