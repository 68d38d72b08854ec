#!/usr/bin/env bash
# Perplexity of a converted checkpoint against SmolLM2 bf16 on several texts, first 4,096 tokens of
# each (512-token windows), so a quantization recipe is judged on more than one text. None of the
# texts is in the calibration sources (pydoc topics, GNU info manuals without their license nodes).
#
#   [TEXTS="a.txt b.txt"] [MAX_TOKENS=4096] [MODELS="bf16"] experiments/int4_texts.sh CHECKPOINT_DIR [OUT_DIR]
#
# Writes OUT_DIR/results.jsonl (one line per text and model, from experiments/perplexity.py) and
# OUT_DIR/table.md (bf16 and checkpoint perplexity, and the relative change, per text). A (text,
# model) pair already in results.jsonl is not rerun, so MODELS=bf16 can score the float model
# while the checkpoint is still being converted.
set -euo pipefail
cd "$(dirname "$0")/.."
CKPT=${1:?usage: experiments/int4_texts.sh CHECKPOINT_DIR [OUT_DIR]}
OUT=${2:-experiments/out/int4_texts}
MAX_TOKENS=${MAX_TOKENS:-4096}
DOC=/usr/share/vim/vim90/doc
TEXTS=${TEXTS:-"/usr/share/common-licenses/GPL-3 $DOC/usr_02.txt /usr/share/common-licenses/MPL-2.0 \
$DOC/usr_03.txt $DOC/usr_10.txt /usr/share/perl/5.36/pod/perldiag.pod"}
mkdir -p "$OUT"
touch "$OUT/results.jsonl"
for T in $TEXTS; do
  [ -f "$T" ] || { echo "missing text: $T" >&2; exit 1; }
  for MODEL in ${MODELS:-bf16 $CKPT}; do
    if grep -qF "\"label\": \"$MODEL\", \"text\": \"$T\"" "$OUT/results.jsonl"; then continue; fi
    ARGS=(--text "$T" --max_tokens "$MAX_TOKENS" --dtype bfloat16)
    [ "$MODEL" = bf16 ] || ARGS+=(--model "$MODEL")
    echo "== $(date -u +%FT%TZ) $MODEL on $T" >&2
    .venv/bin/python experiments/perplexity.py "${ARGS[@]}" 2>/dev/null | tail -1 \
      | .venv/bin/python -c "import json,sys; r=json.load(sys.stdin); print(json.dumps({'label': '$MODEL', 'text': r.pop('text'), **r}))" \
      >> "$OUT/results.jsonl"
  done
done
[ -z "${MODELS:-}" ] || exit 0  # a partial run: no table yet
.venv/bin/python - "$OUT" "$CKPT" <<'PY'
import json, statistics, sys
from pathlib import Path
out, ckpt = Path(sys.argv[1]), sys.argv[2]
rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
by = {(r["text"], r["label"]): r for r in rows}
texts = list(dict.fromkeys(r["text"] for r in rows))
md = [f"| text (first tokens) | tokens | bf16 ppl | {ckpt} ppl | change |", "|---|---|---|---|---|"]
changes = []
for t in texts:
    b, q = by[(t, "bf16")], by[(t, ckpt)]
    d = q["ppl"] / b["ppl"] - 1
    changes.append(d)
    md.append(f"| {t} | {b['tokens']} | {b['ppl']:.3f} | {q['ppl']:.3f} | {100 * d:+.1f}% |")
md.append(
    f"| median of {len(changes)} | | | | {100 * statistics.median(changes):+.1f}% "
    f"(within +5%: {sum(d <= 0.05 for d in changes)} of {len(changes)}) |"
)
(out / "table.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
PY
