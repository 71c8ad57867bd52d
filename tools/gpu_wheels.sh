#!/usr/bin/env bash
# The wheels bench/gpu_check.py needs on a lent GPU machine (no network there; its image has PyTorch,
# Triton, transformers, typer, rich, scipy, xxhash, safetensors, tokenizers, but not DeepSpeed,
# pydantic or Liger Kernel). Run here, in the repository root, once per session; the device call then
# carries .whl (docs/gpu/README.md, "Issue 45's check"). Python 3.12, manylinux x86-64.
#
#   bash tools/gpu_wheels.sh          # -> .whl/*.whl (ignored by git through .git/info/exclude)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
PY=${PYTHON:-python3}
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
# DeepSpeed's needs beyond the image, pinned to what the suite runs with; Liger Kernel (pure Python + Triton)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 hjson==3.1.0 \
  dill==0.4.1 liger-kernel==0.8.5
# DeepSpeed has no wheel on PyPI: built from its sdist without compiled ops (the check uses none)
if ! ls .whl/deepspeed-0.19.8-*.whl >/dev/null 2>&1; then
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl
fi
ls -1 .whl
du -sh .whl
