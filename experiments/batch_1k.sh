#!/usr/bin/env bash
# Issue 6 report: a 1,000-row batch job on SmolLM2 on this CPU, one process vs --num_shards 2 as two
# processes. Short chat prompts, greedy, 32 new tokens. Writes under experiments/out/batch_1k/.
#   bash experiments/batch_1k.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=experiments/out/batch_1k
rm -rf "$OUT" && mkdir -p "$OUT"
"$PY" - "$OUT/prompts.jsonl" <<'PYEOF'
import json, sys
topics = ["the ocean", "mountains", "a city", "music", "rain", "coffee", "trains", "the moon"]
kinds = ["Write one sentence about", "Give a short fact about", "Describe in a few words"]
with open(sys.argv[1], "w") as f:
    for i in range(1000):
        prompt = f"{kinds[i % 3]} {topics[i % 8]} (#{i})."
        f.write(json.dumps({"id": i, "prompt": prompt}) + "\n")
PYEOF
COMMON=(--input "$OUT/prompts.jsonl" --use_chat_template --max_tokens 32 --temperature 0
        --num_slots 64 --max_model_len 256 --dtype bfloat16 --noprogress)
t0=$(date +%s)
"$PY" -m jaxserve.launch.generate "${COMMON[@]}" --output "$OUT/single.jsonl"
t1=$(date +%s)
"$PY" -m jaxserve.launch.generate "${COMMON[@]}" --num_shards 2 --shard_index 0 --output "$OUT/shard0.jsonl" &
"$PY" -m jaxserve.launch.generate "${COMMON[@]}" --num_shards 2 --shard_index 1 --output "$OUT/shard1.jsonl" &
wait
t2=$(date +%s)
"$PY" -m jaxserve.launch.merge --inputs "$OUT/shard0.jsonl,$OUT/shard1.jsonl" --output "$OUT/merged.jsonl" \
  --expected_input "$OUT/prompts.jsonl"
"$PY" -c "print(f'single process: 1000 rows in {$t1 - $t0} s wall (incl. load + compile) = {1000 / ($t1 - $t0):.2f} rows/s')"
"$PY" -c "print(f'2 shards as 2 processes: 1000 rows in {$t2 - $t1} s wall = {1000 / ($t2 - $t1):.2f} rows/s')"
grep -h '"rows_per_s"\|"completion_tokens_per_s"' "$OUT"/single.summary.json "$OUT"/shard*.summary.json || true
