#!/usr/bin/env bash
# A Python site with the NSA kernels of .whl-nsa/ (scripts/fetch-nsa-kernels.sh) on top of
# the GPU wheel set in /tmp/site: a copy of sgl_kernel with flashmla_ops put back, and
# sgl-deep-gemm. Put it before /tmp/site on PYTHONPATH; /tmp/site itself is left as the
# recipe builds it, so jobs beside this one still run on the stock set.
#   bash scripts/nsa_site.sh /tmp/site-nsa
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
site=${1:?usage: bash scripts/nsa_site.sh DIR}
rm -rf "$site"
mkdir -p "$site"
cp -r /tmp/site/sgl_kernel "$site/"
gunzip -c .whl-nsa/flashmla_ops.abi3.so.gz >"$site/sgl_kernel/flashmla_ops.abi3.so"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
  .whl-nsa/*.whl
