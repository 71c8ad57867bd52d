#!/usr/bin/env bash
# Two seeds of two debug designs, evaluated during and after training, compared as seed arms
# (the seed-arm output in docs/evaluation.md, "Seed arms"; about 10 minutes on 2 busy CPU cores):
#
#   examples/seed_arms.sh            # from the repository root; runs/ gets debug-s{1,2}, debug-base-s{1,2}
#
#   * ConceptLM (recipes/debug.yaml) and its base model (model.concept.enabled=false), seeds 1 and 2,
#     on one tokenized corpus; ncp_cloze scored inside the loop every 100 steps (train.eval_tasks)
#   * ncpctl eval of each run on ncp_offline (per-example scores kept for the paired bootstrap)
#   * ncpctl eval --compare of the two arms: mean ± std per arm, paired bootstrap interval
#   * ncpctl eval --proxy on the four checkpoints against ncp_cloze:acc
# Environment: NCPCTL, the ncpctl command split on spaces (default `ncpctl` on PATH).
set -euo pipefail

read -r -a ncpctl <<<"${NCPCTL:-ncpctl}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
data=(--set data.train_prefix=runs/debug/data/train --set data.val_prefix=runs/debug/data/val)
loop=(--set 'train.eval_tasks=[ncp_cloze]' --set train.eval_tasks_every=100)

"${ncpctl[@]}" tokenize recipes/debug.yaml
for s in 1 2; do
  "${ncpctl[@]}" pretrain recipes/debug.yaml --set run.dir=runs/debug-s$s --set train.seed=$s "${data[@]}" "${loop[@]}"
  "${ncpctl[@]}" pretrain recipes/debug.yaml --set run.dir=runs/debug-base-s$s --set train.seed=$s "${data[@]}" \
    "${loop[@]}" --set model.concept.enabled=false
done
for r in debug-s1 debug-s2 debug-base-s1 debug-base-s2; do
  "${ncpctl[@]}" eval runs/$r --tasks ncp_offline
done
"${ncpctl[@]}" eval --compare runs/debug-s1,runs/debug-s2 runs/debug-base-s1,runs/debug-base-s2 --out runs/compare
"${ncpctl[@]}" eval --proxy examples/proxy/python_packages.jsonl runs/debug-s1 runs/debug-s2 runs/debug-base-s1 \
  runs/debug-base-s2 --against ncp_cloze:acc --out runs/proxy
