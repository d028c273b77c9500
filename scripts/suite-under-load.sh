#!/usr/bin/env bash
# The CPU suite with N CPU-bound processes running beside it (default 3), as on a shared
# 2-core CI box: shows that no test depends on the machine's speed. Prints pytest's summary
# and the wall time; exits with pytest's code. Usage: bash scripts/suite-under-load.sh [N] [pytest args]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

burners="${1:-3}"
shift || true
pids=()
stop_burners() { [ "${#pids[@]}" -eq 0 ] || kill "${pids[@]}" 2>/dev/null; }
trap stop_burners EXIT
for _ in $(seq "$burners"); do
    python3 -c 'while True: pass' &
    pids+=($!)
done

start=$SECONDS
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
echo "suite-under-load: $burners CPU-bound processes beside it, $(nproc) cores, wall $((SECONDS - start)) s, pytest exit $rc"
exit $rc
