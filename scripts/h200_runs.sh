#!/usr/bin/env bash
# The one-GPU runs: the device path's latency against re-prefill, concurrent moves to
# one target, the any-tier table, the live move, the busy source, the RL scene and the
# host-tier landing into a full target GPU, with the GPU tests beside them. Each job
# fits one device command of at most ~560 s (the device tool allows 600 s a command).
#
#   bash scripts/h200_runs.sh N        # N = 1..39, one device command each, kind nvidia-h200
#   bash scripts/h200_runs.sh NAME     # the named jobs below (flagcost, verl64, rl8k-both-r0, ...)
#
# The named jobs take KVMIG_BUDGET_S (default 560: the command's limit less the start of
# the call) and stop their benchmark's rounds 40 s before it; set KVMIG_COMMIT=<sha> in
# the command so that the record names the commit (the copy on the device has no .git).
#
# Before the first job, on the same warm machine (../shared/gpu/README.md, section 2):
#   install, carry [".whl"]:  python3 -m pip install -q --no-index --no-deps --no-compile \
#                               --no-cache-dir --target /tmp/site .whl/*.whl
#   every job, carry [".whl-mc"], holding this package's wheel (rebuilt: `rm
#   .whl-mc/sglang_kv_migration-*.whl; .venv/bin/python -m pip wheel -q --no-deps -w
#   .whl-mc .`), httptools and torch_memory_saver 0.0.10 (`scripts/fetch-gpu-extras.sh`,
#   which also moves two wheels of .whl/ there: .whl/ and the tree passed 64 MiB).
#   If the machine went cold between jobs, /tmp/site is gone: run the install again.
#   Job verlray (verl and Ray) needs one more install call before it, carry [".whl-verl"]
#   (`bash scripts/fetch-verl-wheels.sh`, ~50 MiB):  python3 -m pip install -q --no-index \
#     --no-deps --no-compile --no-cache-dir --target /tmp/site-verl .whl-verl/*.whl
#
# Results: $OUT/NAME.log, NAME-*.json / NAME-results.jsonl, all.tgz (server logs).
set -u
cd "$(dirname "$0")/.."
call=${1:?usage: bash scripts/h200_runs.sh 1|2|...|39|NAME}
budget=${KVMIG_BUDGET_S:-560}
deadline=$((budget - 40))
source scripts/gpu_job_commands.sh  # T, DEVTEST_*, SAVER_*, NSA_TEST, CONC16
case $call in
1)
  # One-call latency with the one-trip client (the default: the source allocates on the
  # target through its channel, partial transfers, binary ids, the source commits through
  # the target's mailbox) beside the two-trip client (--two-trips: the client's own
  # allocate trip) in every round: one-page migrations (2 tokens at page 1, 17 at page 16:
  # the benchmark migrates each prompt less its last token), 1K, 2K, 4K, 32K beside
  # re-prefill, each trip's steps_ms per row. Targets: one page <= 5 ms p50, 1K <= 8 ms,
  # 32K <= 1% of re-prefill, migration + TTFT below re-prefill from 2K up.
  exec bash scripts/gpu_jobs.sh 560 \
    "0:dp1:python3 benchmark/bench_device_path.py --page-size 1 --lengths 2 1024 2048 4096 32768 --repeats 3 --no-host --two-trips" \
    "0:dp16:python3 benchmark/bench_device_path.py --page-size 16 --lengths 17 1024 2048 4096 32768 --repeats 3 --no-host --two-trips"
  ;;
2)
  # Concurrency (six concurrent 8K migrations to one target within 1.5x of one) at
  # page 16, three rounds (the first after start-up stalls ~17-20 ms once), with the
  # one-trip client; the device-path GPU tests at MHA page 16 beside it (a tiny model:
  # distinct ports, little memory), then the memory-saver GPU test (release/resume and
  # the landing arena's rounds, each a one-trip move).
  exec bash scripts/gpu_jobs.sh 560 \
    "0:conc16:$CONC16" \
    "+0:devtest16:sleep 240; KVMIG_PORT_BASE=31500 $DEVTEST_MHA16" \
    "0:saver16:$SAVER_MHA16"
  ;;
5)
  # Both comparisons on fresh servers: one-call vs two-trip rows at page 1 (one page,
  # 1K, 32K; each row after the target settled), then six concurrent 8K moves, each
  # round with the one-call client and then the two-trip client.
  exec bash scripts/gpu_jobs.sh 540 \
    "0:dp1:python3 benchmark/bench_device_path.py --page-size 1 --lengths 2 1024 32768 --repeats 3 --no-host --two-trips" \
    "0:conc16:python3 benchmark/bench_any_tier.py --page-size 16 --only-concurrency --concurrency-rounds 3 --two-trips"
  ;;
6)
  # One-call latency with "prepare while the target allocates" and "destination_digest":
  # page 1, each round one call (device_kv named by digest), two trips, and one call with
  # the device_kv in full (--full-destination), each row after the target settled; then
  # six concurrent 8K moves, one-call and two-trip rounds.
  exec bash scripts/gpu_jobs.sh 560 \
    "0:dp1:python3 benchmark/bench_device_path.py --page-size 1 --lengths 2 1024 2048 32768 --repeats 3 --no-host --two-trips --full-destination" \
    "0:conc16:python3 benchmark/bench_any_tier.py --page-size 16 --only-concurrency --concurrency-rounds 3 --two-trips"
  ;;
7)
  # The rows of job 6 at page 16, then the memory-saver GPU test (MHA page 16) and the
  # device-path GPU tests at MLA page 64.
  exec bash scripts/gpu_jobs.sh 560 \
    "0:dp16:python3 benchmark/bench_device_path.py --page-size 16 --lengths 17 1024 2048 32768 --repeats 3 --no-host --two-trips --full-destination" \
    "0:saver16:$SAVER_MHA16" \
    "0:devtest64:$DEVTEST_MLA64"
  ;;
8)
  # Concurrency with "transfer_batch" and the launches together: page 16, three
  # rounds of one move, six from six threads, and the same six in one migrate_many; the
  # device-path GPU tests (MHA page 16, the batched-moves test among them) beside it.
  exec bash scripts/gpu_jobs.sh 560 \
    "0:conc16:$CONC16" \
    "+0:devtest16:sleep 240; KVMIG_PORT_BASE=31500 $DEVTEST_MHA16"
  ;;
9)
  # One-call latency (page 1: one page, 1K, 2K, 32K beside re-prefill, each row after
  # the target settled; the scheduler-thread calibration before and after the rows), then
  # two concurrency rounds on the same servers (threads, and one migrate_many); then the
  # memory-saver GPU test (the landing arena's one-call moves, release/resume).
  exec bash scripts/gpu_jobs.sh 560 \
    "0:dp1:python3 benchmark/bench_device_path.py --page-size 1 --lengths 2 1024 2048 32768 --repeats 3 --no-host --calibrate --concurrency-rounds 2" \
    "0:saver16:$SAVER_MHA16"
  ;;
3)
  # The any-tier table at page 1 (tiers gpu / host / mixed at 4K/16K/32K beside
  # re-prefill and the host path), then the memory-saver test at MLA page 64.
  exec bash scripts/gpu_jobs.sh 560 \
    "0:anytier1:python3 benchmark/bench_any_tier.py --page-size 1" \
    "0:saver64:$SAVER_MLA64"
  ;;
4)
  # The live move beside today's moves, arm by arm, and its GPU tests.
  exec bash scripts/gpu_jobs.sh 560 \
    "0:live:python3 benchmark/bench_live_arms.py" \
    "0:livetests:KVMIG_PAGE_SIZE=16 $T test/gpu/test_gpu_request_migration.py -k 'live or running_request_moves_with'"
  ;;
10)
  # Latency and concurrency with the target serving its allocate channel before unrelated
  # mailbox commits and the source handing the GIL to its IPC opener thread: the
  # memory-saver test (the first move after a resume maps a fresh landing arena), the
  # device-path tests at MLA page 64, then page 16 rows beside re-prefill and two
  # concurrency rounds (six 8K moves from threads, and in one migrate_many).
  exec bash scripts/gpu_jobs.sh 560 \
    "0:saver16:$SAVER_MHA16" \
    "0:devtest64:$DEVTEST_MLA64" \
    "0:dp16:python3 benchmark/bench_device_path.py --page-size 16 --lengths 17 1024 2048 32768 --repeats 3 --no-host --concurrency-rounds 2"
  ;;
11)
  # The device-path tests at MLA page 64 (the route-metrics test, with the first copy
  # into a kept mapping no longer a rate sample; the first channel allocate without the
  # import), the memory-saver test at MLA page 64, then the page-16 concurrency rounds.
  exec bash scripts/gpu_jobs.sh 560 \
    "0:devtest64:$DEVTEST_MLA64" \
    "0:saver64:$SAVER_MLA64" \
    "0:conc16:$CONC16"
  ;;
12)
  # One-call latency with the HTTP trip's fast paths (the routes' fast path without
  # Starlette's router and FastAPI, the client's socket HTTP/1.1): page 1 rows beside
  # re-prefill and two concurrency rounds, then the device-path tests at MLA page 64
  # (the route-metrics test).
  exec bash scripts/gpu_jobs.sh 560 \
    "0:dp1:python3 benchmark/bench_device_path.py --page-size 1 --lengths 2 1024 2048 32768 --repeats 3 --no-host --concurrency-rounds 2" \
    "0:devtest64:$DEVTEST_MLA64"
  ;;
13)
  # The rest of job 11: the memory-saver test at MLA page 64, then page 16
  # rows beside re-prefill with two concurrency rounds (threads, one migrate_many).
  exec bash scripts/gpu_jobs.sh 560 \
    "0:saver64:$SAVER_MLA64" \
    "0:dp16:python3 benchmark/bench_device_path.py --page-size 16 --lengths 17 1024 2048 32768 --repeats 3 --no-host --concurrency-rounds 2"
  ;;
14)
  # The any-tier table at page 16 (tiers gpu / host /
  # mixed at 4K/16K/32K beside re-prefill and the host path, then its concurrency
  # round), then the device-path GPU tests at MHA page 16.
  exec bash scripts/gpu_jobs.sh 560 \
    "0:anytier16:python3 benchmark/bench_any_tier.py --page-size 16" \
    "0:devtest16:$DEVTEST_MHA16"
  ;;
15)
  # Latency and concurrency with the adapter's radix walk comparing node keys as whole
  # lists (SGLang's own walk loops over tokens at page 1, pages above): page 1 rows
  # beside re-prefill with two concurrency rounds.
  exec bash scripts/gpu_jobs.sh 280 \
    "0:dp1:python3 benchmark/bench_device_path.py --page-size 1 --lengths 2 1024 2048 32768 --repeats 3 --no-host --concurrency-rounds 2"
  ;;
16)
  # Job 15 at page 16: rows and concurrency with the adapter's walk, and the device-path
  # GPU tests at MHA page 16.
  exec bash scripts/gpu_jobs.sh 560 \
    "0:dp16:python3 benchmark/bench_device_path.py --page-size 16 --lengths 17 1024 2048 32768 --repeats 3 --no-host --concurrency-rounds 2" \
    "0:devtest16:$DEVTEST_MHA16"
  ;;
17)
  # One-call latency with the scheduler-thread cuts (the page lists uploaded through
  # kept buffers, the device slots copied to the host while the target allocates, the
  # idle scheduler's brief wait for allocate replies and copy events, log lines kept
  # back): the page-copy self-check with the kept buffers' tests, then page 1 rows (five
  # repeats) beside re-prefill and two concurrency rounds.
  exec bash scripts/gpu_jobs.sh 400 \
    "0:copytest:$T test/gpu/test_gpu_page_copy.py" \
    "0:dp1:python3 benchmark/bench_device_path.py --page-size 1 --lengths 2 1024 2048 32768 --repeats 5 --no-host --concurrency-rounds 2"
  ;;
18)
  # Job 17 at page 16 (rows and concurrency), then the device-path GPU tests at MHA
  # page 16.
  exec bash scripts/gpu_jobs.sh 560 \
    "0:dp16:python3 benchmark/bench_device_path.py --page-size 16 --lengths 17 1024 2048 32768 --repeats 5 --no-host --concurrency-rounds 2" \
    "0:devtest16:$DEVTEST_MHA16"
  ;;
19)
  # The memory-saver and device-path GPU tests at MLA page 64.
  exec bash scripts/gpu_jobs.sh 560 \
    "0:saver64:$SAVER_MLA64" \
    "0:devtest64:$DEVTEST_MLA64"
  ;;
20)
  # Where a one-page move's time goes after the target's answer at page 16 (the transfer
  # reply's `answer`, `start`, `copy_wait`, `finish`): page 16 one page and 2K, then
  # page 1 the same, eight repeats each. A fresh machine's first server start takes
  # ~2.5 min, so a job much shorter than this one ends before the rows.
  exec bash scripts/gpu_jobs.sh 560 \
    "0:steps16:python3 benchmark/bench_device_path.py --page-size 16 --lengths 17 2048 --repeats 8 --no-host" \
    "0:steps1:python3 benchmark/bench_device_path.py --page-size 1 --lengths 2 2048 --repeats 8 --no-host"
  ;;
21)
  # One-call latency with the source waiting in the poll for the answer it prepared for
  # and for the copy it started (without the wait, a one-page move replied a pass of
  # SGLang's loop after its 60 us copy): page 16 then page 1 rows beside re-prefill
  # (one page, 1K, 2K, 32K; five repeats) with two concurrency rounds each, then the
  # device-path GPU tests at MHA page 16.
  exec bash scripts/gpu_jobs.sh 570 \
    "0:dp16:python3 benchmark/bench_device_path.py --page-size 16 --lengths 17 1024 2048 32768 --repeats 5 --no-host --concurrency-rounds 2" \
    "0:dp1:python3 benchmark/bench_device_path.py --page-size 1 --lengths 2 1024 2048 32768 --repeats 5 --no-host --concurrency-rounds 2" \
    "0:devtest16:$DEVTEST_MHA16"
  ;;
22)
  # The device-path GPU tests at MHA page 16 that job 21's limit can cut (flush, tiers
  # host-only and half/half, batched moves, route metrics), with the copy's launch
  # stamped after the launch. With less device time left, pass a smaller limit to
  # `gpu_jobs.sh` for the same job.
  exec bash scripts/gpu_jobs.sh 400 \
    "0:devtest16:KVMIG_ATTENTION=mha KVMIG_PAGE_SIZE=16 $T test/gpu/test_gpu_device_path.py -k 'flush or only_on_host or half or batched or route_metrics'"
  ;;
23)
  # The whole device-path GPU test file at MHA page 16, where a tier's first launch is
  # no rate sample (the route-metrics test fails if the host-tier kernel's compile
  # counts as a 1.6 GB/s copy), then the memory-saver test (the landing
  # arena's moves with the in-poll waits), then the device-path tests at MLA page 64.
  exec bash scripts/gpu_jobs.sh 570 \
    "0:devtest16:$DEVTEST_MHA16" \
    "0:saver16:$SAVER_MHA16" \
    "0:devtest64:$DEVTEST_MLA64"
  ;;
24)
  # Whether the in-poll waits paid, side by side in one run: page 16 rows (one page, 2K,
  # 32K; five repeats) and two concurrency rounds, then the same on a fresh pair (the
  # waits' switch is gone and they are off, so both pairs now run the same code).
  exec bash scripts/gpu_jobs.sh 570 \
    "0:ab16:python3 benchmark/bench_device_path.py --page-size 16 --lengths 17 2048 32768 --repeats 5 --no-host --concurrency-rounds 2"
  ;;
25)
  # Whether moves sent together should ask their targets before any is
  # prepared (SourceTransfers._defer_prepare), side by side in one run with that off
  # and with the in-poll waits off (both switches are gone: this runs the default
  # only): page 16, one page and 8K rows, three
  # concurrency rounds on each pair. `python3 benchmark/read_concurrency.py` reads it.
  exec bash scripts/gpu_jobs.sh 570 \
    "0:ask16:python3 benchmark/bench_device_path.py --page-size 16 --lengths 17 8192 --repeats 5 --no-host --concurrency-rounds 3"
  ;;
26)
  # The device-path GPU tests at MHA page 1 (the any-tier tests among them), then one
  # page and 2K beside re-prefill at pages 16 and 1 with nine repeats each (the one-page
  # p50 on another machine; the result file is written after every row, so a cut job
  # keeps its rows). KVMIG_BUDGET_S: less than the command's limit when less device time
  # is left.
  exec bash scripts/gpu_jobs.sh "${KVMIG_BUDGET_S:-570}" \
    "0:devtest1:KVMIG_ATTENTION=mha KVMIG_PAGE_SIZE=1 $T test/gpu/test_gpu_device_path.py" \
    "0:one16:python3 benchmark/bench_device_path.py --page-size 16 --lengths 17 2048 --repeats 9 --no-host" \
    "0:one1:python3 benchmark/bench_device_path.py --page-size 1 --lengths 2 2048 --repeats 9 --no-host"
  ;;
27)
  # Busy source (CUDA graphs on): 1K / 8K / 32K prefixes from the source's GPU and from
  # its host tier, moved between idle servers and from a source decoding 40 requests of
  # mixed lengths, beside re-prefill on the target; three repeats; then the busy batch's
  # decode throughput alone and during a stream of 8K moves. Targets: busy <= 2x idle,
  # decode kept >= 95%. Settings it changes are named in its docstring.
  exec bash scripts/gpu_jobs.sh 560 \
    "0:busy:python3 benchmark/bench_busy_source.py --repeats 3"
  ;;
29)
  # The RL scene, CUDA graphs on, 4K histories: 24 high-priority turns,
  # three repeats (none / recompute / migrate each), p99 over all 72 turns with the
  # per-repeat spread; the rebalancer plans against B's GPU then host headroom.
  # Targets: high p99 migrate/recompute <= 0.4, migrate/none <= 0.15; low p99 <= 1.05x.
  exec bash scripts/gpu_jobs.sh 560 \
    "0:rl4k:python3 benchmark/bench_rl_scene.py --context 4096 --repeats 3"
  ;;
30)
  # The same at 8K: two repeats here, the third in job 31 (a job cut at its limit
  # keeps the modes it finished: the file is written after each).
  exec bash scripts/gpu_jobs.sh 560 \
    "0:rl8k:python3 benchmark/bench_rl_scene.py --context 8192 --repeats 2"
  ;;
31)
  exec bash scripts/gpu_jobs.sh 560 \
    "0:rl8k:python3 benchmark/bench_rl_scene.py --context 8192 --repeats 1 --repeat-start 2"
  ;;
32|33|34)
  # The same at 16K, one repeat a job (job 32: repeat 0, 33: 1, 34: 2). Pool them
  # here afterwards: python3 benchmark/bench_rl_scene.py --merge \
  #   rl16k-bench_rl_scene_16384.json rl16k-bench_rl_scene_16384_r1.json ...
  exec bash scripts/gpu_jobs.sh 560 \
    "0:rl16k:python3 benchmark/bench_rl_scene.py --context 16384 --repeats 1 --repeat-start $((call - 32)) --mode-timeout 200"
  ;;
35)
  # The live move from the running request's own slots (feature running_slots), CUDA
  # graphs on: 4K / 16K / 32K context x 1K tokens generated before the move, then 8K
  # where the call's time allows (a row starts only when the 1K row at its context
  # predicts it ends 30 s before KVMIG_BUDGET_S), three staggered requests a row.
  # Per move the stall taken apart (the servers' request moments, SGLang's meta_info
  # timestamps and the migrator's moments on one clock: the stop's and the resume's
  # phases) beside SGLang's own cached resume of the same request on the same target,
  # and the target's decode step. Targets: stall <= that resume + 10 ms + one target
  # decode step; at 4K, <= 40 ms. Shortest rows first, the file rewritten after each.
  exec bash scripts/gpu_jobs.sh "$budget" \
    "0:live:python3 benchmark/bench_live_move.py --budget-s $((budget - 30)) --moments-dir /tmp/kvmig-live-moments"
  ;;
36)
  # verl's pattern at its first size: 16 sticky sessions x 4 turns of 8K histories, 12
  # first pinned to A (the benchmark's defaults are now verl64's scale, below).
  exec bash scripts/gpu_jobs.sh 560 \
    "0:verl:python3 benchmark/bench_verl_pattern.py --repeats 3 --deadline-s 420 --sessions 16 --skewed 12 --context 8192 --context-max 0 --user-tokens 256 --new-tokens 32"
  ;;
flagcost)
  # What --enable-kv-migration costs a server that never moves (issue: the flag's cost,
  # A/B on one GPU): SGLang as users run it (no plugin loaded), + HiCache, + HiCache +
  # the flag, side by side on the one GPU, Llama-3-8B shape, page 16, CUDA graphs on,
  # started one after another with one planned pool size each; interleaved rounds of
  # fresh 17-token and 2K TTFT, cached TTFT at 4K/16K/32K, one request's inter-token
  # latency, decode throughput and ITL at 32 and 64 concurrent. Target: the flag within
  # 1% of HiCache alone on every row, or within the A/A spread. Start-ups ~300 s (the
  # log says each), then rounds until the deadline (~4 on an H100).
  # `python3 benchmark/results.py --show flag-cost flagcost-bench_flag_cost.json`.
  exec bash scripts/gpu_jobs.sh "$budget" \
    "0:flagcost:python3 benchmark/bench_flag_cost.py --deadline-s $deadline"
  ;;
flagcost-twin)
  # The same with a second HiCache server, the A/A spread of two identical servers
  # (needs four pools of >= 40K tokens: an H200; on an H100 it refuses at once).
  exec bash scripts/gpu_jobs.sh "$budget" \
    "0:flagcost:python3 benchmark/bench_flag_cost.py --twin on --deadline-s $deadline"
  ;;
verl64|verl64-r*)
  # verl's pattern at the scale verl runs: 64 sticky sessions x 4 turns over two servers
  # on one GPU (CUDA graphs on, page 16), 48 first pinned to A, first prompts 2K-12K
  # skewed (most short), growing by 576 tokens a turn to 5K-15K; verl's balancer vs
  # re-pin with re-prefill vs re-pin with migration, beside the balanced bound (sessions
  # spread from their first turn). Makespan and turn p50/p99, outputs compared. Targets:
  # migrate <= 0.8x re-prefill and <= 0.85x default makespan. Repeats until the
  # deadline (one repeat ~2-3 min of four arms); verl64-rN starts at repeat N (more
  # repeats from another call). Pool them: python3 benchmark/bench_verl_pattern.py
  # --merge verl-bench_verl_pattern.json verl-bench_verl_pattern_r2.json ...
  start=0
  [[ $call == verl64-r* ]] && start=${call#verl64-r}
  exec bash scripts/gpu_jobs.sh "$budget" \
    "0:verl:python3 benchmark/bench_verl_pattern.py --repeats 3 --repeat-start $start --deadline-s $deadline"
  ;;
rl4k-*|rl8k-*|rl16k-*)
  # The RL scene (24 high-priority turns a repeat, p99 over all of them, CUDA graphs on)
  # at one context, one repeat of none / recompute / migrate per variant:
  # rl<4|8|16>k-<room|full|both>-r<N>, e.g. rl8k-both-r0. `room`: B's GPU has room for
  # the moved histories; `full`: B's own low-priority decodes take 90% of its pool (the
  # seed's scene: a move lands in B's host tier, or takes the host path where the client
  # has no such landing; each move's path and landing tier are recorded). Targets:
  # high p99 migrate / recompute <= 0.4, migrate / none <= 0.15, low p99 <= 1.05x none.
  # No mode starts after the deadline; 8K both variants ~1 repeat a call, 16K one
  # variant. Pool the calls: python3 benchmark/bench_rl_scene.py --merge FILES...
  ctx=${call%%k-*}
  ctx=$((${ctx#rl} * 1024))
  rest=${call#*k-}
  variant=${rest%-r*}
  rep=${rest##*-r}
  [[ $variant == both ]] && variant="room full"
  exec bash scripts/gpu_jobs.sh "$budget" \
    "0:rl${ctx}:python3 benchmark/bench_rl_scene.py --context $ctx --target-gpu $variant --repeats 1 --repeat-start $rep --mode-timeout 180 --deadline-s $deadline"
  ;;
37)
  # The DeepSeek-V3.2-shaped (NSA) tiny model between two servers, with the kernels of
  # `scripts/fetch-nsa-kernels.sh` (carry ".whl-nsa" too) in a site of their own:
  # flashmla_sparse for prefill and decode (fa3's 1 GB library cannot travel), and
  # SGLANG_NSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD=0 so that short prefills take the
  # sparse path too instead of the dense one-shot MHA, which calls fa3. With the wheel
  # set as the GPU recipe builds it the server does not start (deep_gemm missing); with
  # the kernels but without the threshold its first prefill fails importing fa3: both
  # seen on 7a68348 (docs/benchmarks.md). The DP=2 GPU test needs two GPUs: x2_runs.sh 5.
  exec bash scripts/gpu_jobs.sh "${KVMIG_BUDGET_S:-400}" \
    "0:nsak:$NSA_TEST"
  ;;
38)
  # The GPU tests on the code as it stands, before any benchmark: the device-path tests
  # at MHA page 16, the memory-saver test and the device-path tests at MLA page 64 one
  # after the other (one job: at most 8 files come back from a call); beside them the
  # request-migration tests (page 16, the live move among them) and the host path
  # through Mooncake (page 1), each on its own ports.
  exec bash scripts/gpu_jobs.sh "${KVMIG_BUDGET_S:-560}" \
    "0:devtests:$DEVTEST_MHA16; $SAVER_MHA16; $DEVTEST_MLA64" \
    "+0:reqmig16:sleep 20; KVMIG_PAGE_SIZE=16 $T test/gpu/test_gpu_request_migration.py" \
    "+0:host1:sleep 40; KVMIG_PAGE_SIZE=1 $T test/gpu/test_gpu_migration.py"
  ;;
ttftsplit)
  # Where a fresh 17-token prompt's time to first token goes (the move-latency rows'
  # ~66 ms re-prefill): HiCache + --enable-kv-migration (eager, as those rows), stock
  # SGLang without HiCache, + HiCache, then the first with CUDA graphs, one server at a
  # time alone on the GPU, eight repeats of each request kind (a client per call as those
  # rows timed it, a kept client, after a flush, streamed; SGLang's own cached resume at
  # 4K / 16K / 32K), each taken apart by SGLang's meta_info timestamps and the request
  # moments. No server starts that the one before predicts to end past the deadline.
  exec bash scripts/gpu_jobs.sh "$budget" \
    "0:ttft:python3 benchmark/bench_ttft_split.py --budget-s $deadline"
  ;;
28|39)
  # (28, which busied the target instead, never ran: the same job now.)
  # Six concurrent 8K moves against one, from an idle source and from a source decoding
  # a full batch (32 greedy decodes of mixed lengths, CUDA graphs on), page 16, five
  # rounds: one alone, six from six threads, the same six in one call. Per move the
  # tier it was copied from and the loop iterations of its trip on each side (`polls`,
  # `first_poll`, `target_iteration`; `allocate_ahead`: the busy source's HTTP layer
  # asked the target). Targets: six <= 1.5x one; <= 2x from the busy source. No round
  # starts after 450 s (~4 min of server start-up and rounds expected).
  exec bash scripts/gpu_jobs.sh "$budget" \
    "0:conc:python3 benchmark/bench_busy_source.py --only-concurrency --concurrency-rounds 5 --busy 32 --deadline-s $((budget - 110))"
  ;;
landing)
  # The host-tier landing: a same-host move into a target whose GPU pool is full (held by
  # four of its own requests, paused in place: ~6K of 49K tokens free, nothing evictable)
  # lands in the target's host tier through shared memory (path shared_host), never over
  # Mooncake TCP. First the host-landing GPU test (tiny model, page 16, ~2.5 min), then
  # the benchmark: 8K and 32K prefixes on the source's GPU and on its host tier, beside the
  # device-path move of the same length into a target with room and beside re-prefill;
  # three repeats (medians with range), CUDA graphs on, Llama-3-8B shape, page 16; each
  # move's path, landing tier and the target's cached_tokens_details. Targets: landing
  # <= 3x the device-path move and <= 10% of re-prefill. The benchmark (~4 min of server
  # starts, then ~20-30 s a repeat) starts no row that would not end 25 s before the
  # budget, and rewrites its record after every row.
  end=$(($(date +%s) + budget - 25))
  exec bash scripts/gpu_jobs.sh "$budget" \
    "0:landtest:KVMIG_PAGE_SIZE=16 $T test/gpu/test_gpu_host_landing.py" \
    "0:landing:python3 benchmark/bench_host_landing.py --repeats 3 --end-at $end"
  ;;
landtests)
  # The host-landing GPU test alone (page 16, then page 1), and the device-path tests at
  # MHA page 16 beside it (the device path's source and target, now two modules, and its
  # tiered copies, now shared with the host landing): when the landing job ran out of time.
  exec bash scripts/gpu_jobs.sh "$budget" \
    "0:landtest:KVMIG_PAGE_SIZE=16 $T test/gpu/test_gpu_host_landing.py; KVMIG_PAGE_SIZE=1 KVMIG_PORT_BASE=30800 $T test/gpu/test_gpu_host_landing.py" \
    "+0:devtest16:sleep 30; KVMIG_PORT_BASE=31500 $DEVTEST_MHA16"
  ;;
verlray)
  # verl's own SGLang server class (SGLangHttpServer) in Ray actors: two replicas on one
  # GPU, CUDA graphs on, the recipe's engine kwargs (docs/rl-integration.md, "verl"),
  # routed by KVMigrationLoadBalancer through verl's get_router_handle and client: 8
  # sessions' 2K-token histories on replica A, then B joins and every second turn is
  # acquired at once; moved sessions' turns must find the migrated KV in B's cache.
  # /tmp/site-verl from the install call above (.whl-verl); ~4-6 min (two server
  # starts, ~150 s and ~50 s). Result: verlray/results.jsonl ("verl_actors").
  exec bash scripts/gpu_jobs.sh "$budget" \
    "0:verlray:PYTHONPATH=/tmp/site:/tmp/site-verl $T test/gpu/test_gpu_verl_actors.py"
  ;;
*)
  echo "usage: bash scripts/h200_runs.sh 1|2|...|39|flagcost|flagcost-twin|verl64[-rN]|rl<4|8|16>k-<room|full|both>-rN|ttftsplit|landing|landtests|verlray" >&2
  exit 2
  ;;
esac
