#!/usr/bin/env bash
# Build a CPU test environment: real SGLang on a CPU build of torch, the Mooncake transfer
# engine without CUDA, and this package in editable mode.
#
# For Debian 12 with Python 3.11 and no GPU, run as root from anywhere in the repo:
#     bash scripts/install-cpu.sh            # SGLang 0.5.12 in .venv (the default)
#     bash scripts/install-cpu.sh 0.5.23     # SGLang 0.5.23 in .venv-0.5.23
# Safe to run again: an existing venv is reused and satisfied requirements are skipped.
# Never installs sglang-kernel, flashinfer or nvidia-* packages (GPU only).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3.11}"
SGLANG_VERSION="${1:-0.5.12}"
# What differs between the SGLang versions this package runs on: the venv, the pins of
# transformers and openai as each SGLang pins them, and what each import chain needs.
case "$SGLANG_VERSION" in
    0.5.12)
        VENV=.venv
        VERSION_DEPS=(transformers==5.6.0 openai==2.6.1)
        ;;
    0.5.23)
        VENV=.venv-0.5.23
        # apache-tvm-ffi: imported unguarded by sglang.kernels (through layers.dp_attention);
        # xgrammar: by the HTTP server (function_call).
        VERSION_DEPS=(transformers==5.19.0 openai==2.8.0 apache-tvm-ffi==0.1.11 xgrammar==0.2.7)
        ;;
    *)
        echo "install-cpu.sh: SGLang $SGLANG_VERSION is not one this package runs on (0.5.12, 0.5.23)" >&2
        exit 2
        ;;
esac

# Mooncake's non-CUDA wheel links libibverbs.so.1 even when it only speaks TCP.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
    if [ "$(id -u)" -eq 0 ]; then
        apt-get update
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libibverbs1
    else
        echo "install-cpu.sh: libibverbs1 is missing; run as root or 'apt-get install libibverbs1'" >&2
        exit 1
    fi
fi

# iproute2 (`ip netns`, veth) for the test that runs two servers in two network namespaces.
if ! command -v ip >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends iproute2
fi

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
# pip's output goes to a log, shown only when a step fails. On success it is noise: after
# the deliberate --no-deps install of sglang below, every later step ends with pip's
# "ERROR: pip's dependency resolver ... requires X, which is not installed" lines for the
# GPU packages and pins this CPU environment leaves out on purpose (exit status 0), and a
# machine's pip configuration may add "WARNING: Location ... is ignored" lines.
PIP_LOG="$(mktemp -t kvm-install-pip.XXXXXX)"
trap 'rm -f "$PIP_LOG"' EXIT
pip_quietly() {
    echo "install-cpu.sh: pip install $*" | cut -c1-100
    if ! "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off \
        "$@" >"$PIP_LOG" 2>&1; then
        cat "$PIP_LOG" >&2
        echo "install-cpu.sh: 'pip install $*' failed; its output is above" >&2
        exit 1
    fi
}
PIP=(pip_quietly)

# A CPU build of torch 2.13.0 lies on these machines' local package index and pip
# prefers it; first, so nothing below can pull a CUDA build in as a dependency.
"${PIP[@]}" torch==2.13.0

# --no-deps: sglang pins torch (0.5.12: 2.11.0, 0.5.23: 2.14.1, a CUDA build) and GPU-only packages (sglang-kernel, flashinfer,
# nvidia-*). torchvision 0.28.0 exists only as a CUDA build for torch 2.13; it imports on
# CPU with the fix installed at the end. pip then reports sglang's unmet pins after each
# later step: harmless, and kept in the log (see pip_quietly).
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION" torchvision==0.28.0

# What SGLang's import chain needs on CPU (the HiCache classes, ServerArgs and
# `python -m sglang.launch_server --help`). triton imports without a GPU although its
# kernels cannot run; transformers and openai are pinned as that SGLang pins them.
# uvloop, jsonschema and soundfile: imported by sglang.srt.entrypoints.http_server.
LIGHT_DEPS=(
    triton numpy pillow pybase64 psutil packaging tqdm pyyaml requests pydantic orjson
    msgspec pyzmq setproctitle xxhash fastapi uvicorn httpx prometheus-client
    python-multipart IPython aiohttp partial_json_parser dill sentencepiece einops
    compressed-tensors gguf uvloop jsonschema soundfile httptools "${VERSION_DEPS[@]}"
)
"${PIP[@]}" "${LIGHT_DEPS[@]}"

# This package, the non-CUDA Mooncake engine (extra cpu) and pytest + ruff (extra test).
"${PIP[@]}" -e '.[cpu,test]'

# The gateway and verl integrations are tested on 0.5.12 only (verl 0.9.1 pins it).
install_gateway_and_verl() {
    # The SGLang model gateway (`smg`, its binary in $VENV/bin) for the tests that put it in
    # front of the servers (test/integration/test_gateway_migration.py). Its own needs
    # (grpcio, grpcio-health-checking, protobuf, setproctitle, pyyaml) leave torch alone.
    "${PIP[@]}" smg==1.13.0

    # verl 0.9.1 for the verl integration's tests (test/integration/test_verl_*.py), without
    # its GPU dependencies (--no-deps), plus what its router, LLM server client and SGLang
    # server module import; tensordict within verl's range and --no-deps, so torch stays the
    # CPU build above.
    "${PIP[@]}" --no-deps verl==0.9.1 "tensordict>=0.8.0,<=0.10.0,!=0.9.0"
    "${PIP[@]}" ray omegaconf cachetools codetiming cloudpickle pyvers
}

install_torchvision_fix() {
    # Test environment only, never part of the package: define the two torchvision operator
    # schemas on the first `import torchvision` (see scripts/cpu_torchvision_fix.py).
    SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    cp scripts/cpu_torchvision_fix.py "$SITE/_kvm_cpu_torchvision_fix.py"
    echo "import _kvm_cpu_torchvision_fix" > "$SITE/kvm_cpu_torchvision_fix.pth"
}

if [ "$SGLANG_VERSION" = 0.5.12 ]; then
    install_gateway_and_verl
fi
install_torchvision_fix

# Fail here, not in the tests, if the environment does not import.
"$VENV/bin/python" -c 'import torchvision, mooncake.engine, sglang_kv_migration' >/dev/null
echo "install-cpu.sh: environment ready in $VENV"
