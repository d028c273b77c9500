#!/usr/bin/env bash
# The two-GPU runs (nvidia-h200-x2): the device path across GPUs over NVLink, TP=2 and
# PP=2 servers, memory-saver servers under TP=2, and the attention-CP probe. Each job
# fits one device command of at most ~560 s (the device tool allows 600 s a command).
#
#   bash scripts/x2_runs.sh N        # N = 1..5, one device command each, kind nvidia-h200-x2
#
# Before the first job, on the same warm machine (../shared/gpu/README.md, section 2):
#   install, carry [".whl"]:  python3 -m pip install -q --no-index --no-deps --no-compile \
#                               --no-cache-dir --target /tmp/site .whl/*.whl
#   every job, carry [".whl-mc"], with this package's wheel (`python3 -m pip wheel --no-deps
#   -w .whl-mc .`) and, for job 4, the torch_memory_saver 0.0.10 wheel in .whl-mc/:
#   scripts/gpu_jobs.sh installs .whl-mc/*.whl into /tmp/site itself. If the machine went
#   cold between jobs, /tmp/site is gone: run the install again.
#
# Times below are estimates from the wall times of the same benchmarks and tests on one
# H200 (docs/benchmarks.md). Benchmarks run alone (nothing beside
# them on either GPU); correctness tests may share the GPUs (distinct ports). Results:
# $OUT/NAME.log, NAME-*.json / NAME-results.jsonl, all.tgz (server logs included).
set -u
cd "$(dirname "$0")/.."
call=${1:?usage: bash scripts/x2_runs.sh 1|2|3|4|5}
source scripts/gpu_job_commands.sh  # T, NSA_TEST
case $call in
1)
  # Across GPUs (~520 s): device path GPU 0 -> GPU 1, 1K/4K/16K/32K x 3 rounds
  # (~235 s wall, start-ups side by side), then the any-tier benchmark with the
  # target on GPU 1, page 1: tiers gpu / host / mixed at 4K/16K/32K beside re-prefill, and
  # six concurrent 8K migrations (~150 s start-ups side by side + ~120 s rounds).
  # Targets: 32K device migration <= 2% of re-prefill, copy >= 300 GB/s over NVLink,
  # host tier -> peer GPU >= 45 GB/s (`copy_host` of the host rows).
  exec bash scripts/gpu_jobs.sh 545 \
    "0,1:xgpu:python3 benchmark/bench_device_path.py --target-gpu 1 --repeats 3" \
    "0,1:anytier1x:python3 benchmark/bench_any_tier.py --target-gpu 1 --page-size 1"
  ;;
2)
  # TP=2 and PP=2 tests, then across GPUs at page 16 (~420 s): the device-path and
  # any-tier GPU tests (9 tests: identical output, migrated tokens served from the
  # target's GPU, prefix on the source's host tier / half and half) under TP=2 and under
  # PP=2, side by side (distinct ports; TP=2 ran 7 tests in 101 s, so ~150 s both), then
  # the any-tier benchmark with the target on GPU 1 at page 16, alone (~260 s). The PP job
  # starts 20 s later: both tests write the same small model's config.json at start.
  exec bash scripts/gpu_jobs.sh 545 \
    "+0,1:tp2dev:KVMIG_TP=2 KVMIG_ATTENTION=mha KVMIG_PAGE_SIZE=1 KVMIG_PORT_BASE=30500 $T test/gpu/test_gpu_device_path.py" \
    "+0,1:pp2dev:sleep 20; KVMIG_PP=2 KVMIG_ATTENTION=mha KVMIG_PAGE_SIZE=1 KVMIG_PORT_BASE=31500 $T test/gpu/test_gpu_device_path.py" \
    "0,1:anytier16x:python3 benchmark/bench_any_tier.py --target-gpu 1 --page-size 16"
  ;;
3)
  # TP=2 and PP=2 benchmark rows at 4K/16K/32K with the settled source (SETTLE_S)
  # (~450 s): TP=2 device path vs host path vs re-prefill, 3 rounds (the same benchmark
  # took 161 s for 4 lengths x 2 rounds), then PP=2 through the any-tier
  # benchmark (its `gpu` tier is the device-path row; also host-only and mixed), page 1
  # (~155 s start-ups one after the other + ~120 s rounds).
  exec bash scripts/gpu_jobs.sh 545 \
    "0,1:tp2bench:python3 benchmark/bench_device_path.py --tp-size 2 --lengths 4096 16384 32768 --repeats 3" \
    "0,1:pp2anytier:python3 benchmark/bench_any_tier.py --pp-size 2 --page-size 1"
  ;;
4)
  # Memory saver under TP=2 and the attention-CP probe, side by side (~250 s; at most
  # ~540 s if both CP variants hang until their 240 s start-up bound): release/resume
  # then migrate under TP=2 with memory-saver servers (needs torch_memory_saver in
  # .whl-mc/), and the CP probe (stock SGLang, no plugin: does a HiCache server start
  # with attention CP for a small NSA model).
  exec bash scripts/gpu_jobs.sh 545 \
    "+0,1:saver_tp2:KVMIG_TP=2 $SAVER_MHA16" \
    "+0,1:cp:python3 benchmark/probes/probe_attn_cp.py"
  ;;
5)
  # Data-parallel ranks (issue of DeepSeek-class servers, item 5): `--dp-size 2` without
  # DP attention, DP rank r on GPU r (SGLang 0.5.12 cannot put two DP ranks on one GPU:
  # CUDA refuses a GPU listed twice, error 101, seen on the one-GPU machine): migrations
  # into and out of each DP rank and between two DP servers, greedy output equal, the
  # moved tokens served from cache (~200 s: three servers started one after another).
  # Beside it, the NSA model with the kernels of scripts/fetch-nsa-kernels.sh (carry
  # ".whl-nsa" too; see h200_runs.sh 37).
  exec bash scripts/gpu_jobs.sh 545 \
    "0,1:dp2:$T test/gpu/test_gpu_dp.py" \
    "+0:nsak:$NSA_TEST"
  ;;
*)
  echo "unknown call $call: 1, 2, 3, 4 or 5" >&2
  exit 2
  ;;
esac
