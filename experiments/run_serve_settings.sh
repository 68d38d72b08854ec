#!/usr/bin/env bash
# jaxserve's OpenAI server under several flag settings, interleaved: the A/B/C... of engine settings
# under `experiments/serve_bench.py`, one server at a time with run_serve_comparison.sh's command
# (ENGINES=jaxserve), the settings in turn, ROUNDS times, so drift on a noisy VM falls on all.
#
#   [RATES=8,16,inf] [NUM_REQUESTS=48] [ROUNDS=2] experiments/run_serve_settings.sh OUT_DIR \
#     'NAME=--flag=1 --other=2' 'NAME2=...'
#
# Writes OUT_DIR/NAME_ROUND/serve_jaxserve.json (and the server's log) for every run; then prints
# experiments/serve_settings_table.py's table. Name the CPU beside every figure (shared/NOTES.md).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: run_serve_settings.sh OUT_DIR NAME=FLAGS ...}
shift
[ $# -gt 0 ] || { echo "no settings given"; exit 2; }
ROUNDS=${ROUNDS:-2}
export RATES=${RATES:-8,16,inf}
mkdir -p "$OUT"
for r in $(seq "$ROUNDS"); do
  for setting in "$@"; do
    name=${setting%%=*}
    flags=${setting#*=}
    echo "== $(date -u +%FT%TZ) round $r: $name ($flags)"
    ENGINES=jaxserve JAXSERVE_FLAGS="$flags" bash experiments/run_serve_comparison.sh \
      "$OUT/${name}_$r" > "$OUT/${name}_$r.log" 2>&1
  done
done
echo "== $(date -u +%FT%TZ) done"
.venv/bin/python experiments/serve_settings_table.py "$OUT"
