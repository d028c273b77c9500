"""The card a GPU benchmark runs on, and servers that share its memory by plan.

A record must name its card: `require_gpu` reads it from `nvidia-smi` before anything
starts (a machine without one exits with status 2 and one line, no traceback), and
`run_info` adds the versions and the commit to the record's config.

Servers that share one GPU are started one after another, each with a KV pool of the
same planned size. SGLang sizes a pool as `free_before_load * mem_fraction_static -
weights` (`_profile_available_bytes`), where "free" is what the GPU has left when that
server starts: one `--mem-fraction-static` for all makes every later server's pool
smaller (two servers at 0.35 on an 80 GB card: ~100K tokens, then ~15K). So before each
start the fraction is computed from the memory free at that moment, a little above
what weights + the planned pool need, and `--max-total-tokens` caps the pool at the
plan: every server gets the same pool, and what is left stays for the later servers.
The arithmetic is pure and tested on CPU (`test/unit/test_gpu_servers.py`).
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

GIB = 1 << 30
MIB = 1 << 20
# Per server beyond weights and KV: CUDA context, captured graphs (batch <= 64),
# prefill activations at a chunk of 8192 tokens, the caching allocator's slack.
SERVER_OVERHEAD_BYTES = 4 * GIB
# Asked above weights + pool, so that the profiled pool is never below the cap (the
# server's own CUDA context and load-time buffers come out of what it measures; what
# is left above the cap stays free).
FRACTION_MARGIN_BYTES = 3 * GIB // 2
SMI_ENV = "KVMIG_NVIDIA_SMI"  # the nvidia-smi to run (tests point it at nothing)


class NoGPU(RuntimeError):
    """No GPU could be read on this machine."""


@dataclass(frozen=True)
class Card:
    name: str
    total_mib: int
    free_mib: int
    driver: str
    index: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _gpu_index() -> str:
    """The GPU this process may use, as nvidia-smi numbers it (the first of
    CUDA_VISIBLE_DEVICES when it is a number; nvidia-smi ignores that variable)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return first if first.isdigit() else "0"


def query_card() -> Card:
    """The card's name and memory now, from nvidia-smi; `NoGPU` when it cannot be read."""
    smi = os.environ.get(SMI_ENV, "nvidia-smi")
    index = _gpu_index()
    query = "--query-gpu=name,memory.total,memory.free,driver_version"
    try:
        out = subprocess.run(
            [smi, "-i", index, query, "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        raise NoGPU(f"{smi} could not be run: {exc}") from exc
    fields = [f.strip() for f in out.strip().splitlines()[0].split(",")] if out.strip() else []
    if len(fields) != 4:
        raise NoGPU(f"{smi} answered {out!r}")
    name, total, free, driver = fields
    return Card(name, int(float(total)), int(float(free)), driver, index)


def require_gpu(prog: str) -> Card:
    """The card, or exit 2 with one line saying why this benchmark cannot run here."""
    try:
        return query_card()
    except NoGPU as exc:
        print(f"{prog}: needs a GPU machine (no GPU found: {exc})", file=sys.stderr)
        raise SystemExit(2) from None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_info(card: Card) -> dict[str, Any]:
    """What a record says about where it ran: the card, the versions, the commit
    (`KVMIG_COMMIT`, which the device command sets: the copy there has no .git)."""
    return {
        "card": card.to_dict(),
        "commit": os.environ.get("KVMIG_COMMIT") or None,
        "versions": {d: _version(d) for d in ("sglang", "torch", "sglang-kv-migration")},
    }


# ---------------------------------------------------------------- memory arithmetic


def kv_bytes_per_token(shape: Mapping[str, int], dtype_bytes: int = 2) -> int:
    """K and V of every layer of an MHA/GQA model (Llama-3-8B: 128 KiB)."""
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * dtype_bytes


def weight_bytes(shape: Mapping[str, int], dtype_bytes: int = 2) -> int:
    """A Llama-shaped model's weights: embeddings and LM head (untied), per layer the
    attention projections, the gated MLP and two norms, and the final norm."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * hidden // shape["num_attention_heads"]
    per_layer = hidden * (2 * hidden + 2 * kv) + 3 * hidden * inter + 2 * hidden
    params = 2 * shape["vocab_size"] * hidden + shape["num_hidden_layers"] * per_layer + hidden
    return params * dtype_bytes


def plan_kv_tokens(
    free_bytes: int,
    servers: int,
    weights: int,
    kv_per_token: int,
    *,
    cap: int,
    quantum: int = 4096,
    overhead: int = SERVER_OVERHEAD_BYTES,
) -> int:
    """The largest pool (tokens, a multiple of `quantum`, at most `cap`) that `servers`
    servers with these weights can each have on a card with `free_bytes` free; 0 when
    not even one quantum fits."""
    per_server = free_bytes // servers - weights - overhead
    if per_server <= 0:
        return 0
    return min(cap, per_server // kv_per_token // quantum * quantum)


def mem_fraction(
    free_bytes: int, weights: int, kv_tokens: int, kv_per_token: int,
    margin: int = FRACTION_MARGIN_BYTES,
) -> float:  # fmt: skip
    """`--mem-fraction-static` for a server starting now, with `free_bytes` free: its
    profiled pool (`free * f - weights`) is the planned one plus `margin`."""
    need = weights + kv_tokens * kv_per_token + margin
    if need >= free_bytes:
        raise ValueError(
            f"a server needs {need / GIB:.1f} GiB for weights and a {kv_tokens}-token pool; "
            f"{free_bytes / GIB:.1f} GiB are free"
        )
    return math.ceil(need / free_bytes * 1000) / 1000


def host_ratio(
    needed_tokens: int, pool_tokens: int, host_budget_bytes: int, kv_per_token: int,
    servers: int = 1, floor: float = 1.5,
) -> float:  # fmt: skip
    """`--hicache-ratio` for a host tier that holds `needed_tokens` (at least `floor`,
    which SGLang needs above 1), bounded so that `servers` such pinned pools take at most
    `host_budget_bytes`."""
    wanted = max(floor, needed_tokens / pool_tokens + 0.25)
    most = host_budget_bytes / servers / (pool_tokens * kv_per_token)
    return round(max(floor, min(wanted, most)), 2)


def mem_available_bytes() -> int:
    """MemAvailable of /proc/meminfo (0 where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# ---------------------------------------------------------------- sized servers


@dataclass
class StartedServer:
    name: str
    url: str
    startup_s: float
    mem_fraction_static: float
    free_mib_before: int
    pool_tokens: int | None = None  # the server's own count (/v1/loads), not the plan
    flags: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


@contextmanager
def sized_servers(
    model_dir: Path,
    specs: Mapping[str, Any],
    shape: Mapping[str, int],
    kv_tokens: int,
    fraction: float | None = None,
) -> Iterator[list[StartedServer]]:
    """Start `specs` (name -> `real_servers.ServerSpec`) one after another, each with a
    `kv_tokens` pool (`fraction`: one `--mem-fraction-static` for all instead of one
    computed at each start); time each start (launch to /health); stop them all on exit.
    Needs `real_servers` importable (test/gpu on sys.path)."""
    from real_servers import kv_pool_usage, launch, stop, wait_ready

    procs = []
    started: list[StartedServer] = []
    try:
        for name, spec in specs.items():
            free = query_card().free_mib
            f = fraction or mem_fraction(
                free * MIB, weight_bytes(shape), kv_tokens, kv_bytes_per_token(shape)
            )
            sized = ["--mem-fraction-static", str(f), "--max-total-tokens", str(kv_tokens)]
            t0 = time.monotonic()
            procs.append(_launch(spec, model_dir, [*spec.extra, *sized], launch))
            wait_ready(spec.url, procs[-1])
            seconds = round(time.monotonic() - t0, 1)
            pool = kv_pool_usage(spec.url)["max_total_num_tokens"]
            print(f"server {name} ({spec.url}) ready in {seconds} s, pool {pool} tokens, "
                  f"mem_fraction_static {f}, {free} MiB free before", flush=True)  # fmt: skip
            flags = [*spec.extra, *sized]
            started.append(StartedServer(name, spec.url, seconds, f, free, pool, flags, spec.env))
        yield started
    finally:
        stop(procs)


def _launch(spec: Any, model_dir: Path, extra: list[str], launch: Any) -> Any:
    return launch(
        spec.port, model_dir, extra, spec.gpu_id, cuda_graph=spec.cuda_graph,
        migration=spec.migration, hicache=spec.hicache, env=spec.env,
    )  # fmt: skip
