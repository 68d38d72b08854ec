"""One process of the many-host loading test (tests/launch/test_distributed.py), run as a script:

    python many_hosts_loads.py CASES.json OUT.json [COORDINATOR NUM_PROCESSES PROCESS_ID]

CASES.json: [{"name": ..., "model": ..., **LLM settings}]. For each case the process builds
`LLM(model, tensor_parallel_size=T, ...)` as a notebook user would (T = every device of every
process), decodes the same greedy prompts and records their token ids and log-probs, or the error.
With the three distributed arguments it joins a jax.distributed run first (gloo collectives on
CPU); without them it is the one-process reference. Process 0 writes OUT.json.
"""

from __future__ import annotations

import json
import sys

PROMPTS = [[1, 5, 9, 33], [7, 3], [100, 2, 40, 40, 41, 8, 9], [250, 17, 17]]


def main(cases_path: str, out_path: str, *dist: str) -> None:
    import jax

    if dist:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=dist[0],
            num_processes=int(dist[1]),
            process_id=int(dist[2]),
            heartbeat_timeout_seconds=20,
        )
    from jaxserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=0)
    results = {}
    for case in json.load(open(cases_path)):
        name, settings = case.pop("name"), case
        try:
            llm = LLM(
                tensor_parallel_size=jax.device_count(),
                dtype="float32",
                num_slots=4,
                max_model_len=64,
                **settings,
            )
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
            results[name] = [
                {
                    "token_ids": o.outputs[0].token_ids,
                    "logprobs": [
                        lp[t].logprob
                        for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)
                    ],
                }
                for o in outs
            ]
            del llm
        except Exception as e:  # noqa: BLE001 - the test names the case and its error
            results[name] = f"{type(e).__name__}: {e}"
    if jax.process_index() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
