"""Online serving benchmark against any OpenAI-compatible /v1/completions endpoint (in the manner of
vLLM's benchmark_serving.py): Poisson arrivals at each request rate, streamed token-id prompts from a
built-in workload, TTFT / TPOT / ITL p50 and p99, output tok/s, goodput under an SLO.

    python -m jaxserve.launch.serve --port 8000 &                       # or any other server
    python experiments/serve_bench.py --base_url http://127.0.0.1:8000/v1 --model NAME \\
        --workload longtail-small --num_requests 64 --rates 1,2,4,inf --out experiments/out/sb.json

Each request: prompt_token_ids as the prompt, max_tokens = the drawn length, temperature 0,
ignore_eos (vLLM's extra; a server that ignores it may stop early, which the output counts show).
Output tokens are the final chunk's `usage.completion_tokens` (`stream_options.include_usage`).
Timings per request: TTFT = first token chunk - send; ITL = gaps between token chunks; TPOT =
(last - first) / (tokens - 1). Goodput = requests/s meeting both --slo_ttft_s and --slo_tpot_s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path

import httpx
import numpy as np

from jaxserve.bench.workloads import make_workload


async def one_request(http, url, model, req, api_key) -> dict:
    body = {
        "model": model,
        "prompt": list(req.prompt_token_ids),
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        # the final chunk's usage is the token count: servers that send no token ids (vLLM) can
        # merge tokens into one chunk or send a token with no text (incomplete UTF-8)
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = time.perf_counter()
    stamps, tokens, usage, error = [], 0, None, None
    try:
        async with http.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        usage = event["usage"].get("completion_tokens")
                    choice = (event.get("choices") or [{}])[0]
                    n = len(choice.get("token_ids") or []) or int(bool(choice.get("text")))
                    if n:
                        stamps.append(time.perf_counter())
                        tokens += n
    except httpx.HTTPError as e:
        error = repr(e)
    end = time.perf_counter()
    if usage is not None:
        tokens = usage
    ttft = stamps[0] - t0 if stamps else None
    tpot = (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 else None
    return {
        "ttft": ttft,
        "tpot": tpot,
        "itl": list(np.diff(stamps)),
        "latency": end - t0,
        "output_tokens": tokens,
        "expected_tokens": req.max_tokens,
        "error": error,
    }


def _pct(xs, q):
    xs = [x for x in xs if x is not None]
    return float(np.percentile(xs, q)) if xs else None


async def run_rate(args, workload, rate: float) -> dict:
    url = args.base_url.rstrip("/") + "/completions"
    rng = np.random.default_rng(args.seed)
    limits = httpx.Limits(max_connections=args.max_concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=args.timeout_s) as http:
        tasks, t0 = [], time.perf_counter()
        for req in workload.requests:
            tasks.append(asyncio.create_task(one_request(http, url, args.model, req, args.api_key)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    ok = [r for r in results if r["error"] is None]
    itl = [x for r in ok for x in r["itl"]]
    out_tokens = sum(r["output_tokens"] for r in ok)
    good = [
        r
        for r in ok
        if r["ttft"] is not None
        and r["ttft"] <= args.slo_ttft_s
        and (r["tpot"] is None or r["tpot"] <= args.slo_tpot_s)
    ]
    return {
        "request_rate": rate if math.isfinite(rate) else "inf",
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": [r["error"] for r in results if r["error"]][:5],
        "short_outputs": sum(r["output_tokens"] < r["expected_tokens"] for r in ok),
        "output_tok_s": out_tokens / duration,
        "request_throughput": len(ok) / duration,
        "goodput_req_s": len(good) / duration,
        **{f"ttft_p{q}_s": _pct([r["ttft"] for r in ok], q) for q in (50, 99)},
        **{f"tpot_p{q}_s": _pct([r["tpot"] for r in ok], q) for q in (50, 99)},
        **{f"itl_p{q}_s": _pct(itl, q) for q in (50, 99)},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base_url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True, help="The served model name.")
    p.add_argument("--api_key", default=None)
    p.add_argument("--workload", default="longtail-small")
    p.add_argument("--num_requests", type=int, default=None)
    p.add_argument("--vocab_size", type=int, default=49152, help="Token ids are drawn below it.")
    p.add_argument("--rates", default="1,2,4,inf", help="Requests/s, comma separated; inf = all.")
    p.add_argument("--max_concurrency", type=int, default=256)
    p.add_argument("--slo_ttft_s", type=float, default=2.0)
    p.add_argument("--slo_tpot_s", type=float, default=0.2)
    p.add_argument("--timeout_s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="Write the results as JSON here.")
    args = p.parse_args()
    workload = make_workload(args.workload, args.vocab_size, args.num_requests, args.seed)
    rows = []
    for rate in [float(r) for r in args.rates.split(",")]:
        row = asyncio.run(run_rate(args, workload, rate))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": rows}, indent=1))


if __name__ == "__main__":
    main()
