"""The table and latency plot of `run_serve_comparison.sh`: vLLM-CPU's and jaxserve's
`serve_bench.py` results side by side per request rate, from one or more of its output folders
(each holding serve_vllm.json and serve_jaxserve.json; rates merged and sorted, a later folder's
run of a rate replacing an earlier one's).

    .venv/bin/python experiments/plot_serve.py OUT_DIR [OUT_DIR ...] --out DIR [--title TEXT]

Writes DIR/serve_comparison.md and DIR/serve_latency.png (TTFT p99 and TPOT p50 against output
tok/s, one point per rate).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

ENGINES = {"vllm": "vLLM-CPU 0.32", "jaxserve": "jaxserve"}


def rate_key(r) -> float:
    return math.inf if r == "inf" else float(r)


def load(dirs: list[str]) -> dict[str, dict[float, dict]]:
    """engine -> {rate: result}, from every folder in order."""
    runs: dict[str, dict[float, dict]] = {e: {} for e in ENGINES}
    for d in dirs:
        for e in ENGINES:
            f = Path(d) / f"serve_{e}.json"
            if f.exists():
                for r in json.loads(f.read_text())["results"]:
                    runs[e][rate_key(r["request_rate"])] = r
    return runs


def table(runs: dict[str, dict[float, dict]]) -> str:
    md = [
        "| rate (req/s) | engine | output tok/s | TTFT p50 / p99 s | TPOT p50 s | goodput req/s "
        "| jaxserve / vLLM tok/s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for rate in sorted(set(runs["vllm"]) | set(runs["jaxserve"])):
        v, j = runs["vllm"].get(rate), runs["jaxserve"].get(rate)
        ratio = f"{j['output_tok_s'] / v['output_tok_s']:.2f}x" if v and j else ""
        for e, r in (("vllm", v), ("jaxserve", j)):
            if r is None:
                continue
            md.append(
                f"| {r['request_rate']} | {ENGINES[e]} | {r['output_tok_s']:.1f} | "
                f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | {r['tpot_p50_s']:.3f} | "
                f"{r['goodput_req_s']:.2f} | {ratio if e == 'jaxserve' else ''} |"
            )
    return "\n".join(md) + "\n"


def plot(runs: dict[str, dict[float, dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for e, rs in runs.items():
        pts = [rs[k] for k in sorted(rs)]
        if not pts:
            continue
        x = [r["output_tok_s"] for r in pts]
        ax[0].plot(x, [r["ttft_p99_s"] for r in pts], "o-", label=ENGINES[e])
        ax[1].plot(x, [r["tpot_p50_s"] for r in pts], "o-", label=ENGINES[e])
    ax[0].axhline(2.0, color="grey", lw=0.8, ls="--")
    ax[0].set(xlabel="output tok/s", ylabel="TTFT p99 (s)", yscale="log")
    ax[1].set(xlabel="output tok/s", ylabel="TPOT p50 (s)")
    for a in ax:
        a.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", help="run_serve_comparison.sh output folders")
    ap.add_argument("--out", required=True, help="where to write the table and the plot")
    ap.add_argument(
        "--title",
        default="SmolLM2-135M bf16, 2-core CPU: latency vs throughput over request rates",
    )
    a = ap.parse_args()
    runs = load(a.dirs)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    md = table(runs)
    (out / "serve_comparison.md").write_text(md)
    print(md, end="")
    try:
        plot(runs, out / "serve_latency.png", a.title)
    except ImportError:
        raise SystemExit("matplotlib missing: no plot (pip install -e '.[experiments]')") from None


if __name__ == "__main__":
    main()
