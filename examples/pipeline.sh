#!/usr/bin/env bash
# A CI pipeline: tokenize -> pretrain -> eval -> export on one recipe, chained through each
# command's `--json` result and exit code (0 ok, 2 user error, 1 internal failure).
#
#   examples/pipeline.sh                                         # recipes/debug.yaml
#   RECIPE=recipes/mine.yaml examples/pipeline.sh --set train.max_steps=50 --set eval.limit=20
#
# Arguments are extra `--set KEY.PATH=VALUE` options for tokenize and pretrain. eval and export
# get only the checkpoint: it carries its resolved recipe, so `--set eval.limit=...` or
# `--set export.verify=false` given here reach them too.
# Environment:
#   RECIPE    the recipe (default recipes/debug.yaml, relative to the repository)
#   NCPCTL    the ncpctl command, split on spaces (default `ncpctl` on PATH; e.g. "python -m ncpctl")
#   PYTHON    reads the JSON results (default python3; the standard library is enough)
#   OUT_DIR   where each step's JSON result is kept, e.g. a CI artifact folder
#             (default: a new temporary directory)
# The first failing step stops the pipeline with that step's exit code. On success the last
# line on stdout is one JSON object: {"checkpoint", "eval_results", "export", "results_dir"}.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RECIPE="${RECIPE:-$here/../recipes/debug.yaml}"
read -r -a ncpctl <<<"${NCPCTL:-ncpctl}"
PYTHON="${PYTHON:-python3}"
OUT_DIR="${OUT_DIR:-$(mktemp -d -t ncpctl-pipeline.XXXXXX)}"
mkdir -p "$OUT_DIR"

# step NAME ARGS...: `ncpctl NAME ARGS... --json` with its result in $OUT_DIR/NAME.json;
# a failure ends the pipeline with the command's own exit code (its errors are on stderr).
step() {
  local name="$1" rc=0
  shift
  echo "== ncpctl $name $*" >&2
  "${ncpctl[@]}" "$name" "$@" --json >"$OUT_DIR/$name.json" || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "pipeline: ncpctl $name failed (exit code $rc); stopping" >&2
    exit "$rc"
  fi
}

# field FILE KEY.PATH: a value from the JSON result in FILE (its last line: under the
# deepspeed launcher DeepSpeed's own log lines come first); empty when absent or null.
field() {
  "$PYTHON" - "$1" "$2" <<'PY'
import json, sys
value = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
for part in sys.argv[2].split("."):
    value = value.get(part) if isinstance(value, dict) else None
print("" if value is None else value)
PY
}

step tokenize "$RECIPE" "$@"
step pretrain "$RECIPE" "$@"
checkpoint="$(field "$OUT_DIR/pretrain.json" checkpoint)"
if [ -z "$checkpoint" ]; then
  echo "pipeline: pretrain reported no checkpoint (see $OUT_DIR/pretrain.json)" >&2
  exit 1
fi
step eval "$checkpoint"
step export "$checkpoint"

"$PYTHON" - "$checkpoint" "$(field "$OUT_DIR/eval.json" files.json)" "$(field "$OUT_DIR/export.json" out)" \
  "$OUT_DIR" <<'PY'
import json, sys
print(json.dumps(dict(zip(("checkpoint", "eval_results", "export", "results_dir"), sys.argv[1:]))))
PY
