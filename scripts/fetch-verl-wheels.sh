#!/usr/bin/env bash
# The wheels verl 0.9.1 and Ray need on the GPU machine (h200_runs.sh job verlray:
# test/gpu/test_gpu_verl_actors.py), into the ignored folder .whl-verl/, which travels in a
# device call of its own (one call carries at most 64 MiB; see ../shared/gpu/README.md).
#
#   bash scripts/fetch-verl-wheels.sh        # from the repo root, once; ~45 MiB
#
# Ray's wheel is ~78 MB, more than a call carries: it is trimmed (trim_wheel.py: members
# dropped, RECORD rewritten, no file changed) of what a Python-only local cluster never
# loads: the Java worker (ray/jars, 31 MB compressed), the dashboard's web client build
# (started with include_dashboard=False), and RLlib. Everything else of Ray stays: the
# raylet, the GCS server, _raylet.so, the dashboard agent's Python. Versions are the CPU
# test environment's (where test/integration/test_verl_*.py run verl), for CPython 3.12.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-.venv/bin/python}
TRIM=${TRIM:-../shared/gpu/trim_wheel.py}
exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.whl-verl/' "$exclude" 2>/dev/null || printf '/.whl-verl/\n/.whl-verl-src/\n' >> "$exclude"
mkdir -p .whl-verl .whl-verl-src
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
dl() { "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$1" "${@:2}"; }

dl .whl-verl-src ray==2.60.0
"$PY" "$TRIM" .whl-verl-src/ray-2.60.0-cp312-*.whl \
  .whl-verl/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl \
  'ray/jars/*' 'ray/dashboard/client/build/*' 'ray/rllib/*'

# verl's rollout server, router and client import path beyond SGLang's own set (.whl/),
# and Ray's: what `import verl.workers.rollout.sglang_rollout.async_sglang_server` loads
# in the CPU environment that the SGLang wheel set does not carry.
for p in verl==0.9.1 omegaconf==2.4.0 codetiming==1.4.0 cachetools==8.0.3 \
  tensordict==0.10.0 cloudpickle==3.1.3 pyvers==0.2.3 click==8.5.1 protobuf==7.36.2 \
  opentelemetry-api==1.45.3 aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 \
  frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1 attrs==26.1.0 \
  rich==15.0.0 markdown-it-py mdurl pygments filelock==4.3.2 pyyaml
do dl .whl-verl "$p"; done
du -sh --apparent-size .whl-verl
