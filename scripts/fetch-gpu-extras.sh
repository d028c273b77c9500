#!/usr/bin/env bash
# Wheels the GPU machine's image lacks, next to ../shared/gpu/build-wheels.sh's .whl-mc/:
# torch_memory_saver (for --enable-memory-saver servers: test/gpu/test_gpu_memory_saver.py,
# benchmark/probes/probe_memory_saver.py) and httptools (uvicorn's C HTTP parser; without it every
# request is parsed in pure Python). Then rebuild this package's wheel into .whl-mc/:
#   bash scripts/fetch-gpu-extras.sh && .venv/bin/python -m pip wheel -q --no-deps -w .whl-mc .
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p .whl-mc
PY=${PY:-.venv/bin/python}
"$PY" -m pip download -q --no-deps -d .whl-mc torch_memory_saver==0.0.10
"$PY" -m pip download -q --no-deps --only-binary :all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl-mc httptools
# .whl/ (~58 MiB) and the working tree together pass the 64 MiB a device call carries;
# two of its wheels travel with .whl-mc/ instead (gpu_jobs.sh installs .whl-mc/*.whl).
for w in .whl/tokenizers-*.whl .whl/apache_tvm_ffi-*.whl; do
  [ -e "$w" ] && mv "$w" .whl-mc/
done
ls .whl-mc
