#!/usr/bin/env bash
# The kernels SGLang 0.5.12's NSA (DeepSeek-V3.2) path needs on an H200 that the trimmed
# GPU wheel set (../shared/gpu/build-wheels.sh) leaves out, into the ignored .whl-nsa/:
#   - sgl_kernel/flashmla_ops.abi3.so (14.5 MB, 3 MB gzipped), taken from the untrimmed
#     sglang-kernel wheel in .whl-src/: flash_mla_sparse_fwd for the sparse prefill and,
#     with --nsa-decode-backend flashmla_sparse, the decode;
#   - sgl-deep-gemm 0.1.0 (4.5 MB): the indexer's fp8 MQA logits (JIT-compiled with nvcc).
# The decode default on Hopper with a bf16 KV cache, fa3, lives in flash_ops.abi3.so
# (1.07 GB): too large for one device call (64 MiB), so the job names the decode backend.
# Run after build-wheels.sh; `bash scripts/h200_runs.sh 37` uses the folder when carried.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
grep -qx '/.whl-nsa/' .git/info/exclude 2>/dev/null || echo '/.whl-nsa/' >> .git/info/exclude
mkdir -p .whl-nsa
unzip -p .whl-src/sglang_kernel-0.4.2.post2-*.whl sgl_kernel/flashmla_ops.abi3.so \
  | gzip -c > .whl-nsa/flashmla_ops.abi3.so.gz
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 -d .whl-nsa sgl-deep-gemm==0.1.0
du -sh --apparent-size .whl-nsa
