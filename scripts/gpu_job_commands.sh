# The GPU test commands that more than one job of scripts/h200_runs.sh and
# scripts/x2_runs.sh runs, sourced by both (from the repo root) so that a job names one
# instead of spelling it out again. Each is a command line for a job of
# scripts/gpu_jobs.sh ("GPUS:NAME:COMMAND"); a job may put settings before it
# ("KVMIG_PORT_BASE=31500 $DEVTEST_MHA16").
T="python3 -m pytest -q -m gpu -p no:cacheprovider -s"
# The device-path GPU tests and the memory-saver GPU test, MHA at page 16 / MLA at page 64.
DEVTEST_MHA16="KVMIG_ATTENTION=mha KVMIG_PAGE_SIZE=16 $T test/gpu/test_gpu_device_path.py"
DEVTEST_MLA64="KVMIG_ATTENTION=mla KVMIG_PAGE_SIZE=64 $T test/gpu/test_gpu_device_path.py"
SAVER_MHA16="KVMIG_ATTENTION=mha KVMIG_PAGE_SIZE=16 $T test/gpu/test_gpu_memory_saver.py"
SAVER_MLA64="KVMIG_ATTENTION=mla KVMIG_PAGE_SIZE=64 $T test/gpu/test_gpu_memory_saver.py"
# The NSA (DeepSeek-V3.2-shaped) tiny model's GPU test, with the kernels of
# scripts/fetch-nsa-kernels.sh (carry ".whl-nsa") in a site of their own: see
# h200_runs.sh 37 for why these flags.
NSA_TEST="bash scripts/nsa_site.sh /tmp/site-nsa && PYTHONPATH=/tmp/site-nsa:/tmp/site KVMIG_PORT_BASE=30900 SGLANG_NSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD=0 KVMIG_EXTRA_SERVER_FLAGS='--nsa-decode-backend flashmla_sparse' $T test/gpu/test_gpu_nsa.py"
# Six concurrent 8K moves to one target at page 16, three rounds (bench_any_tier.py).
CONC16="python3 benchmark/bench_any_tier.py --page-size 16 --only-concurrency --concurrency-rounds 3"
