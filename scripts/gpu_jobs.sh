#!/usr/bin/env bash
# Run GPU jobs on the lent machine, side by side where they use different GPUs, and pack
# what they wrote into $OUT. Used from the `device` tool after the wheels are installed
# into /tmp/site (see ../shared/gpu/README.md):
#
#   bash scripts/gpu_jobs.sh SECONDS "GPUS:NAME:COMMAND" ...
#
# Each job runs with CUDA_VISIBLE_DEVICES=GPUS and KVMIG_GPU_OUT=/tmp/o/NAME, bounded by
# SECONDS; jobs on different GPUs run concurrently, a job on one GPU waits for the job
# listed before it on that GPU, and a job on several GPUs ("0,1") waits for every job
# listed before it. A leading "+" ("+1:NAME:...") starts the job at once, waiting for none
# (for small jobs that fit beside another on the same GPU). $OUT gets NAME.log (the tail of its output), its JSON/PNG results and
# one all.tgz with every log.
set -u
budget=$1
shift
start=$(date +%s)  # the budget covers the install below too
# --upgrade: on a warm machine /tmp/site already holds these; without it pip keeps the
# old copies (a package wheel rebuilt since the last call would not be installed).
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir \
  --target /tmp/site .whl-mc/*.whl
export PYTHONPATH=/tmp/site CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH
export LD_LIBRARY_PATH=$PWD/.whl-mc/lib:${LD_LIBRARY_PATH:-} PYTHONUNBUFFERED=1
export MC_TCP_SLICE_SIZE=1048576
rm -rf /tmp/o  # a warm machine keeps /tmp between calls
mkdir -p /tmp/o

collect() {
  # What the jobs wrote so far, into $OUT (at most 8 files come back: one log and one
  # result file a job, and all.tgz at the end). Run every 15 s as well as at the end:
  # a call cut at its limit returns what is under $OUT, and nothing else.
  local log f dest
  for log in /tmp/o/*.log; do
    [ -e "$log" ] || continue
    tail -c 20000 "$log" >"$OUT/.part" && mv "$OUT/.part" "$OUT/$(basename "$log")"
  done
  while IFS= read -r f; do
    dest="$OUT/$(basename "$(dirname "$f")")-$(basename "$f")"
    cp "$f" "$OUT/.part" && mv "$OUT/.part" "$dest"
  done < <(find /tmp/o -maxdepth 2 \( -name '*.json' -o -name '*.png' -o -name '*.jsonl' \) -size -4M)
}
(while sleep 15; do collect; done) >/dev/null 2>&1 &
collector=$!
declare -A last_pid
pids=()
for job in "$@"; do
  gpus=${job%%:*}
  rest=${job#*:}
  name=${rest%%:*}
  cmd=${rest#*:}
  mkdir -p "/tmp/o/$name"
  if [[ $gpus == +* ]]; then
    gpus=${gpus#+}
    waitfor=""
  elif [[ $gpus == *,* ]]; then
    waitfor="${pids[*]:-}"
  else
    waitfor=${last_pid[$gpus]:-}
  fi
  (
    for pid in $waitfor; do
      while kill -0 "$pid" 2>/dev/null; do sleep 1; done
    done
    left=$((budget - ($(date +%s) - start)))
    echo "== $name on GPUs $gpus, $left s left: $cmd"
    CUDA_VISIBLE_DEVICES=$gpus KVMIG_GPU_OUT=/tmp/o/$name timeout -k 10 "$left" bash -c "$cmd"
    echo "== $name exit $?"
  ) >"/tmp/o/$name.log" 2>&1 &
  for g in ${gpus//,/ }; do last_pid[$g]=$!; done
  pids+=($!)
done
wait "${pids[@]}"
kill "$collector" 2>/dev/null
wait "$collector" 2>/dev/null
collect
rm -f "$OUT/.part"
tar czf "$OUT/all.tgz" -C /tmp/o . 2>/dev/null
ls -la "$OUT"
