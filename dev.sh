#!/usr/bin/env bash
# One entry point for newcomers and CI (needs only Python 3.11 on the PATH).
#   ./dev.sh demo    set up, then run the main job on the built-in corpus (recipes/debug.yaml)
#   ./dev.sh test    set up, then run the whole test suite (what CI runs)
#   ./dev.sh setup   only create .venv and install ncpctl with its dev extras
# TORCH_SPEC picks the torch build (default: the CPU wheel torch==2.13.0; a GPU box can use
# e.g. TORCH_SPEC="torch>=2.5"). PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
VENV=.venv
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-1}"

setup() {
  # Re-install only when pyproject.toml or the torch choice changed (stamp in the venv).
  local stamp="$VENV/.ncpctl-setup" want
  want="$(cat pyproject.toml; echo "$TORCH_SPEC")"
  if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" == "$want" ]; then
    return 0
  fi
  echo "== setting up $VENV (torch: $TORCH_SPEC)" >&2
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # torch first and pinned, so the range in pyproject.toml does not pull a multi-GB CUDA build
  "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
  "$VENV/bin/python" -m pip install -q -e ".[dev,plots]"
  echo "$want" > "$stamp"
}

demo() {
  local recipe="${1:-recipes/debug.yaml}"
  echo "== ncpctl tokenize $recipe" >&2
  "$VENV/bin/ncpctl" tokenize "$recipe"
  echo "== ncpctl pretrain $recipe" >&2
  "$VENV/bin/ncpctl" pretrain "$recipe"   # resume: auto -> a second run only re-evaluates
  echo "== ncpctl eval $recipe" >&2
  "$VENV/bin/ncpctl" eval "$recipe"
}

case "${1:-}" in
  setup) setup ;;
  demo) setup; shift; demo "$@" ;;
  # --durations=15: CI's output ends with the 15 slowest tests (the suite's time budget is watched);
  # --dist loadgroup: a module's tests that share a module-scoped fixture stay on one worker
  # (tests/conftest.py marks them), so the fixture is built once, not once per worker
  test) setup; shift; exec "$VENV/bin/python" -m pytest -n 2 --dist loadgroup -q --durations=15 "$@" ;;
  *) sed -n '2,8p' "$0" >&2; exit 2 ;;
esac
