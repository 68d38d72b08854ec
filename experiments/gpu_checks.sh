#!/usr/bin/env bash
# BUILD.md's GPU list as one prepared run on the lent H200 (device tool, carry [".whl"], the gguf
# wheel BUILD.md's GPU section downloads):
#
#   bash experiments/gpu_checks.sh [STEP ...]    # default: every step, in this order
#
# Steps: env kernels int4 engine warmup tp cvs. Each runs under `timeout`, capped by its own limit
# and by what is left of GPU_CHECKS_BUDGET_S (default 560 s, inside the tool's 600 s per call); a
# step with under 20 s left is skipped. Everything printed goes to $OUT/log.txt, and every step's
# files to $OUT/results.tar.gz, re-packed after each step, so a run cut short keeps what finished
# (the tool brings back 8 files at most). No model files travel: the GGUF is over the tool's
# 64 MiB carry limit, so every step uses SmolLM2-135M's shapes with random weights.
set -u
OUT=${OUT:-experiments/out/gpu_checks}
DEADLINE=$(($(date +%s) + ${GPU_CHECKS_BUDGET_S:-560}))
R=/tmp/gpu_checks  # outside $OUT: only log.txt and the tarball come back
rm -rf "$R"
mkdir -p "$R" "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi

step() {
  local name=$1 cap=$2 left t rc
  shift 2
  left=$((DEADLINE - $(date +%s)))
  t=$((cap < left ? cap : left))
  if ((t < 20)); then
    echo "== $name skipped: ${left} s left"
    return
  fi
  echo "== $name start $(date -u +%T) (timeout ${t} s): $*"
  timeout "$t" "$@"
  rc=$?
  echo "== $name rc=$rc end $(date -u +%T)"
  tar czf "$OUT/results.tar.gz" -C "$R" .
}

run_step() {
  case $1 in
  env) step env 90 bash -c 'nvidia-smi; python3 -c "import jax, jaxserve; print(jax.__version__, jax.devices())"' ;;
  kernels) step kernels 260 python3 experiments/gpu_kernels.py --out "$R/kernels" --budget_s 150 ;;
  int4) step int4 130 python3 experiments/gpu_int4.py --out "$R/int4" --no-sweep --iters 50 ;;
  engine) step engine 170 python3 experiments/gpu_engine_check.py --out "$R/engine" --budget_s 90 ;;
  warmup)
    step warmup 150 python3 experiments/warmup_cost.py --model=smollm2-135m --load_format=dummy \
      --attention_impls=auto --out "$R/warmup.jsonl"
    ;;
  tp) step tp 150 python3 experiments/gpu_tp.py --out "$R/tp" --tp 1 ;;
  cvs)
    step cvs 420 python3 experiments/continuous_vs_static.py --model=smollm2-135m \
      --load_format=dummy --dtype=bfloat16 --parts=side_by_side --num_requests=1024 \
      --out_dir="$R/cvs"
    ;;
  *) echo "unknown step $1" ;;
  esac
}

steps=("$@")
((${#steps[@]})) || steps=(env kernels int4 engine warmup tp cvs)
for s in "${steps[@]}"; do run_step "$s"; done
echo "== done $(date -u +%T)"
