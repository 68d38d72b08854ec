#!/usr/bin/env bash
# BUILD.md's GPU list as one prepared run on a lent H100 / H200 (device tool, carry [".whl"], the
# gguf wheel BUILD.md's GPU section downloads):
#
#   bash experiments/gpu_checks.sh [STEP ...]    # default: env decode (about 6 minutes)
#
# Steps: env decode kernels int4 w8 moe engine warmup tp cvs. Each runs under `timeout`, capped by its own
# limit and by what is left of GPU_CHECKS_BUDGET_S (default 420 s: a session has 15 minutes of
# device time, the machine's start included, so one run must leave room to rerun a step); a step
# with under 20 s left is skipped. By default only env and decode run: decode
# (experiments/gpu_decode.py, issue 54) times the engine's Llama-3-8B decode step, bf16, INT4 and
# INT8 at 1-64 slots (INT4 at 64 also with its kernel, 'int4-k64'), under the engine's XLA options
# against the same without the layer loop unrolled into its CUDA graph ('no_unroll') and XLA's
# defaults, profiles one case and saves
# the device's GpuTargetConfigProto (decode/target_config.txtpb, for deviceless compiles on the
# CPU); it takes what the 7 minutes leave. The other steps (SmolLM2-135M shapes) still run when
# named, e.g. `bash experiments/gpu_checks.sh env kernels int4`, at most a few per run.
# Everything printed goes to $OUT/log.txt, and every step's files to $OUT/results.tar.gz, re-packed
# after each step, so a run cut short keeps what finished (the tool brings back 8 files at most).
# No model files travel: the GGUF is over the tool's 64 MiB carry limit, so every step uses random
# weights. After `kernels` or `w8`, the GPU kernel table their timings propose
# (`python -m jaxserve.bench.kernel_choices`, issue 55) is written to $OUT/gpu_kernel_choices.toml
# (commit it as jaxserve/config/gpu_kernel_choices.toml) and its RESULTS table to
# $OUT/kernel_choices.md; COMMIT=<the checkout's commit> names the run in the table's sources
# (the device's copy has no git).
set -u
OUT=${OUT:-experiments/out/gpu_checks}
DEADLINE=$(($(date +%s) + ${GPU_CHECKS_BUDGET_S:-420}))
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
  env) step env 60 bash -c 'nvidia-smi; python3 -c "import jax, jaxserve; print(jax.__version__, jax.devices())"' ;;
  decode)
    # its own budget stops it starting a case it cannot finish; the timeout is the backstop
    step decode 390 python3 experiments/gpu_decode.py --out "$R/decode" --budget_s 340 --profile
    ;;
  kernels) step kernels 260 python3 experiments/gpu_kernels.py --out "$R/kernels" --budget_s 150 ;;
  int4) step int4 130 python3 experiments/gpu_int4.py --out "$R/int4" --no-sweep --iters 50 ;;
  w8) step w8 200 python3 experiments/gpu_quant_matmul.py --out "$R/w8" --budget_s 150 ;;
  moe) step moe 200 python3 experiments/gpu_moe.py --out "$R/moe" --budget_s 150 ;;
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
((${#steps[@]})) || steps=(env decode)
for s in "${steps[@]}"; do run_step "$s"; done
if [ -e "$R/kernels/gpu_kernels.json" ] || [ -e "$R/w8/gpu_quant_matmul.json" ]; then
  echo "== kernel table: python3 -m jaxserve.bench.kernel_choices $R"
  python3 -m jaxserve.bench.kernel_choices "$R" --commit "${COMMIT:-}" \
    --table "$R/kernel_choices.md" >"$R/gpu_kernel_choices.toml" &&
    cp "$R/gpu_kernel_choices.toml" "$R/kernel_choices.md" "$OUT/"
  tar czf "$OUT/results.tar.gz" -C "$R" .
fi
echo "== done $(date -u +%T)"
