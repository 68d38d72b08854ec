"""Issue 23's target read off run_serve_comparison.sh outputs: for each OUT_DIR, jaxserve / vLLM-CPU
output tok/s at every rate, then at the lowest rate where vLLM-CPU's TTFT p99 reaches 2 s, the
ratio, both TPOT p50 and jaxserve's TTFT p99.

    python3 experiments/serve_target.py experiments/out/RUN [experiments/out/RUN2 ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    for out in sys.argv[1:]:
        v = json.loads((Path(out) / "serve_vllm.json").read_text())["results"]
        j = json.loads((Path(out) / "serve_jaxserve.json").read_text())["results"]
        rates = " | ".join(
            f"{a['request_rate']}: {a['output_tok_s']:.1f} / {b['output_tok_s']:.1f} = "
            f"{b['output_tok_s'] / a['output_tok_s']:.2f}x"
            for a, b in zip(v, j)
        )
        print(f"{Path(out).name}: vLLM / jaxserve tok/s  {rates}")
        i = next((i for i, a in enumerate(v) if a["ttft_p99_s"] >= 2.0), None)
        if i is None:
            print("  vLLM-CPU's TTFT p99 stays under 2 s at every rate")
            continue
        a, b = v[i], j[i]
        print(
            f"  vLLM-CPU's TTFT p99 reaches 2 s at {a['request_rate']} req/s "
            f"({a['ttft_p99_s']:.2f} s): jaxserve {b['output_tok_s'] / a['output_tok_s']:.2f}x "
            f"its tok/s, TPOT p50 {a['tpot_p50_s']:.3f} (vLLM) / {b['tpot_p50_s']:.3f} s, "
            f"jaxserve TTFT p99 {b['ttft_p99_s']:.2f} s"
        )


if __name__ == "__main__":
    main()
