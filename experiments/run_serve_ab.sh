#!/usr/bin/env bash
# jaxserve's OpenAI server at two commits, alternating: the before/after A/B of one change under
# `experiments/serve_bench.py` (JOURNAL.md 39f). Each side runs from its own checkout with this
# checkout's .venv (the checkout's directory comes first on sys.path), pinned to cores 0-1, with
# the server command of run_serve_comparison.sh; sides alternate after, before, before, after.
#
#   git worktree add /tmp/before <REV>
#   [RATES=8,12,inf] [NUM_REQUESTS=48] [ROUNDS=1] experiments/run_serve_ab.sh /tmp/before [OUT_DIR]
#
# Writes OUT_DIR/serve_<i>_<side>.json (serve_bench's output) and the servers' logs; prints the
# output tok/s of every run. Name the CPU beside every figure (shared/NOTES.md).
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=$(cd "${1:?usage: run_serve_ab.sh BEFORE_CHECKOUT [OUT_DIR]}" && pwd)
OUT=${2:-experiments/out/serve_ab}
RATES=${RATES:-8,12,inf}
N=${NUM_REQUESTS:-48}
ROUNDS=${ROUNDS:-1}
NAME=HuggingFaceTB/SmolLM2-135M-Instruct
PIN="taskset -c 0-1"
HERE=$(pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
i=0
for _ in $(seq "$ROUNDS"); do
  for side in after before before after; do
    i=$((i + 1))
    dir=$HERE
    [ "$side" = before ] && dir=$BEFORE
    echo "== $(date -u +%FT%TZ) run $i: $side ($dir)"
    (cd "$dir" && $PIN "$HERE/.venv/bin/python" -m jaxserve.launch.serve --dtype=bfloat16 \
      --num_slots=32 --port 18302 --served_model_name "$NAME" > "$OUT/server_${i}_$side.log" 2>&1) &
    SPID=$!
    for _ in $(seq 900); do
      curl -sf http://127.0.0.1:18302/health > /dev/null && break
      kill -0 $SPID 2> /dev/null || { echo "server exited"; exit 1; }
      sleep 1
    done
    $PIN .venv/bin/python experiments/serve_bench.py --base_url http://127.0.0.1:18302/v1 \
      --model "$NAME" --workload longtail-small --num_requests "$N" --rates "$RATES" \
      --out "$OUT/serve_${i}_$side.json" > "$OUT/bench_${i}_$side.log" 2>&1
    pkill -f "jaxserve.launch.serve --dtype=bfloat16 --num_slots=32 --port 18302" || true
    wait $SPID || true
  done
done
echo "== $(date -u +%FT%TZ) done"
.venv/bin/python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
for f in sorted(Path(sys.argv[1]).glob("serve_*_*.json"), key=lambda p: int(p.stem.split("_")[1])):
    rs = json.loads(f.read_text())["results"]
    print(f.stem, " ".join(f"{r['request_rate']}: {r['output_tok_s']:.1f} tok/s" for r in rs))
PY
