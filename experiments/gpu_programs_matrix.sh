#!/usr/bin/env bash
# The GPU inspector over issue 54's matrix (JOURNAL.md 54): Llama-3-8B decode at 1, 8 and 64 slots
# (4,096 positions) with bf16, INT4, INT8 and FP8 weights; its sampler; a prefill chunk; Llama-3-70B
# decode at TP 8. One JSON line per program in OUT/programs.jsonl, a markdown table in OUT/table.md.
#
#   bash experiments/gpu_programs_matrix.sh OUT [extra inspector flags, e.g. --compiler_options=none]
#
# Run from a checkout (it uses that checkout's jaxserve: run it in a worktree of another revision to
# compare). Needs the gpu-compile extra; ~4 minutes on 2 cores.
set -euo pipefail
OUT=${1:?usage: gpu_programs_matrix.sh OUT [inspector flags]}
shift
mkdir -p "$OUT"
: >"$OUT/programs.jsonl"
PY=${PYTHON:-.venv/bin/python}
run() {  # label, then inspector flags
  local label=$1
  shift
  "$PY" -m jaxserve.launch.gpu_programs --max_model_len=4096 --num_pages=4096 --dtype=bfloat16 \
    --json_out="$OUT/part.jsonl" "$@" "${EXTRA[@]}" >/dev/null 2>"$OUT/last_stderr.txt" ||
    echo "$label: a program did not compile (its row says why)" >&2
  sed "s/^{/{\"case\": \"$label\", /" "$OUT/part.jsonl" >>"$OUT/programs.jsonl"
}
EXTRA=("$@")
for q in none int4-rtn int8 fp8; do
  flag=()
  [ "$q" = none ] || flag=(--quantization="$q")
  for n in 1 8 64; do
    run "8b $q $n slots" --model=llama3-8b --num_slots=$n "${flag[@]}" --programs=decode --select=width=256
  done
done
for n in 1 8 64; do
  run "8b sampler $n slots" --model=llama3-8b --num_slots=$n --programs=sample --select=decode_sample
done
run "8b prefill 8x64" --model=llama3-8b --num_slots=8 --programs=prefill --select='rows=8 chunk=64 width=256' --limit=1
run "70b tp8 8 slots" --model=llama3-70b --num_slots=8 --tensor_parallel_size=8 --programs=decode --select=width=256
rm -f "$OUT/part.jsonl" "$OUT/last_stderr.txt"
"$PY" - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
rows = [json.loads(l) for l in open(f"{out}/programs.jsonl")]
cols = ["case", "compile_s", "kernels", "per_layer", "host_launches", "outside", "host_round_trips",
        "weight_MiB", "collectives"]
lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
for r in rows:
    if "error" in r:
        lines.append(f"| {r['case']} | does not compile: {r['error'][:90]} |" + " |" * 7)
        continue
    vals = [r["case"], f"{r['compile_s']:.1f}", r["kernels"], r["per_layer"], r["host_launches"],
            sum(r["outside_command_buffers"].values()), sum(r["host_round_trips"].values()),
            f"{r['weight_bytes_materialized'] / 2**20:.0f}", sum(r["collectives"].values())]
    lines.append("| " + " | ".join(map(str, vals)) + " |")
open(f"{out}/table.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
