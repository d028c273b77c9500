"""What the fleet simulation's operations cost, derived in code from the raw GPU records.

Every constant of `CostProfile` is computed here from the records the results page
quotes (`results.RUNS`: a new run that `RUNS` points at updates them), and
`CostProfile.sources` names the record and the rows each came from. Nothing is typed in
by hand except where a record cannot say (`ASSUMED`, listed with the reason).

The shapes the constants fill (one server, Llama-3-8B shape, one H200):

- a request's fixed latency outside the scheduler (HTTP, tokenizer manager, detokenizer):
  ``request_overhead_s`` = the fresh 17-token TTFT less one eager forward;
- a forward pass never takes less than ``eager_floor_s`` when it is not a CUDA-graph
  replay (every prefill, and every decode of a server without CUDA graphs): the eager
  decode step of a lone request (host-path stall record);
- prefill work of ``n`` new tokens over a ``p``-token cached prefix:
  ``b * n + c * n * n / 2 + max(c * n * p, e * p)`` — per token (``b``), attention over
  the new tokens' triangle (``c``), and over the prefix: read by many queries at the
  rate the fresh prompts show, or, for few queries, bound by one sequence's latency (the
  target's cached TTFT grows by ``e`` per prefix token); ``b`` and ``c`` are a
  least-squares fit of the fresh re-prefill TTFTs, ``e`` the median slope of the cached
  TTFTs;
- a decode step (CUDA graphs): ``d0 + max(c_seq * longest context, c_kv * sum of
  contexts)``: a lone long request is bound by its own attention (the live-move record's
  decode step at 5K–34K), a batch by reading every context's KV (``c_kv`` solved from the
  busy record's decode throughput of 40 mixed requests, its prefills taken out);
- moves: a fixed cost plus a cost per token, per route — ``gpu`` (device path, prefix on
  the source's GPU), ``host`` (device path, prefix only in its host pool), ``cross_host``
  (the host path, Mooncake TCP: the stand-in for a move between hosts) — fitted to the
  idle-server move rows; a move from or to a busy scheduler waits
  ``busy_wait_iterations`` of its loop iterations more (busy-source rows);
- HiCache's load-back of a host-tier prefix: the host-tier move's extra cost per token
  over the GPU tier's (the same pinned host -> GPU copy).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import results
from busy_batch import BUSY_OUTPUTS, BUSY_PROMPTS

GPU, HOST, CROSS_HOST = "gpu", "host", "cross_host"
ROUTES = (GPU, HOST, CROSS_HOST)

# What no record says, with why.
ASSUMED = {
    "bytes_per_token": "Llama-3-8B shape: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes",
    "gpu_memory_bytes": "an H200's 141 GiB class memory (143,771 MiB as CUDA reports it)",
    "weights_bytes": "8.03e9 parameters in bf16",
}
BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2
GPU_MEMORY_BYTES = 143_771 * 2**20
WEIGHTS_BYTES = int(8.03e9 * 2)


@dataclass(frozen=True)
class Linear:
    """``fixed_s + per_token_s * tokens``."""

    fixed_s: float
    per_token_s: float

    def __call__(self, tokens: float) -> float:
        return self.fixed_s + self.per_token_s * tokens


@dataclass(frozen=True)
class CostProfile:
    cuda_graphs: bool
    request_overhead_s: float
    eager_floor_s: float
    prefill_s_per_token: float  # b
    prefill_attention_s: float  # c, per (new token x attended token)
    prefill_cached_s_per_token: float  # e
    decode_base_s: float  # d0
    decode_seq_s_per_token: float  # c_seq
    decode_kv_s_per_token: float  # c_kv
    load_back_s_per_token: float
    moves: Mapping[str, Linear]
    busy_wait_iterations: float
    bytes_per_token: int = BYTES_PER_TOKEN
    sources: Mapping[str, str] = field(default_factory=dict)

    def prefill_work(self, new: int, cached: int) -> float:
        """GPU seconds of prefilling `new` tokens over a `cached`-token prefix (no floor)."""
        if new <= 0:
            return 0.0
        # Attention over the cached prefix: bound by the tokens read when many queries
        # fill the GPU, by one sequence's latency when few do (the cached TTFT's slope).
        prefix = max(
            self.prefill_attention_s * new * cached, self.prefill_cached_s_per_token * cached
        )
        return self.prefill_s_per_token * new + self.prefill_attention_s * new * new / 2 + prefix

    def decode_work(self, sum_context: int, max_context: int) -> float:
        """GPU seconds of one decode step of a batch (no floor)."""
        attention = max(
            self.decode_seq_s_per_token * max_context, self.decode_kv_s_per_token * sum_context
        )
        return self.decode_base_s + attention

    def decode_floor(self) -> float:
        """A decode step's shortest time: a graph replay has none beyond its work."""
        return 0.0 if self.cuda_graphs else self.eager_floor_s

    def move_s(self, route: str, tokens: int) -> float:
        return self.moves[route](tokens) if tokens > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("moves", "sources")}
        out["moves"] = {
            r: {"fixed_s": m.fixed_s, "per_token_s": m.per_token_s} for r, m in self.moves.items()
        }
        out["sources"] = dict(self.sources)
        return out


def kv_capacity_tokens(mem_fraction_static: float, started_before: int = 0) -> int:
    """A server's GPU KV pool from `--mem-fraction-static`, by SGLang 0.5.12's rule
    (`_profile_available_bytes`): free memory after loading the weights less
    ``(1 - fraction)`` of the free memory before; `started_before` servers on the same GPU
    started first and each took ``fraction`` of what was free then (servers on one GPU
    start one after the other). An estimate: CUDA graphs and activations are left out."""
    free_before = GPU_MEMORY_BYTES * (1 - mem_fraction_static) ** started_before
    rest = free_before - WEIGHTS_BYTES - free_before * (1 - mem_fraction_static)
    return max(0, int(rest // BYTES_PER_TOKEN))


# ---------------------------------------------------------------------------- fitting


def fit_linear(points: Sequence[tuple[float, float]]) -> Linear:
    """Least squares ``y = fixed + slope * x`` (fixed and slope kept >= 0)."""
    xs = np.array([p[0] for p in points], dtype=float)
    ys = np.array([p[1] for p in points], dtype=float)
    slope, fixed = np.polyfit(xs, ys, 1)
    if fixed < 0:  # through the origin instead
        return Linear(0.0, float(max(0.0, (xs @ ys) / (xs @ xs))))
    return Linear(float(fixed), float(max(0.0, slope)))


def fit_prefill(fresh: Sequence[tuple[int, float]], overhead_s: float) -> tuple[float, float]:
    """(b, c) of ``TTFT - overhead = b n + c n^2 / 2``, least squares on relative error
    (the long prompts would otherwise decide everything)."""
    rows = [(n, t - overhead_s) for n, t in fresh if n >= 1024 and t > overhead_s]
    a = np.array([[n / y, n * n / 2 / y] for n, y in rows])
    (b, c), *_ = np.linalg.lstsq(a, np.ones(len(rows)), rcond=None)
    return float(max(b, 0.0)), float(max(c, 0.0))


# ---------------------------------------------------------------------------- readers


# Prefill is never a CUDA-graph replay: every record's re-prefill and cached TTFTs count,
# whichever way its servers ran decode.
PREFILL_RECORDS = ("device_p16", "anytier_p16", "busy")


def _fresh_ttfts() -> tuple[list[tuple[int, float]], str]:
    """(prompt tokens, re-prefill TTFT s) of fresh prompts, and the records read."""
    out: list[tuple[int, float]] = []
    for name in ("device_p16", "anytier_p16"):
        out += [(r["tokens"], r["reprefill_ttft_ms"] / 1e3) for r in results.load(name)["rows"]]
    out += [(r["tokens"], r["reprefill_ms"] / 1e3) for r in results.load("busy")["rows"]]
    notes = [f"{results.RUNS[n]} rows[].reprefill_ttft_ms" for n in PREFILL_RECORDS[:2]]
    return out, "; ".join([*notes, f"{results.RUNS['busy']} rows[].reprefill_ms"])


def _cached_ttfts() -> tuple[list[tuple[int, float]], str]:
    """(cached prefix tokens, TTFT s) of a prompt whose prefix the target holds on GPU:
    served right after a move there."""
    out = [(r["tokens"], r["device"]["ttft_ms"] / 1e3) for r in results.load("device_p16")["rows"]]
    out += [
        (r["tokens"], r["device"]["ttft_ms"] / 1e3)
        for r in results.load("anytier_p16")["rows"]
        if r["tier"] == "gpu"
    ]
    out += [
        (r["idle"]["gpu"]["migrated_tokens"], r["idle"]["gpu"]["ttft_after_ms"] / 1e3)
        for r in results.load("busy")["rows"]
    ]
    notes = (
        f"{results.RUNS['device_p16']} and {results.RUNS['anytier_p16']} (gpu tier) "
        f"rows[].device.ttft_ms; {results.RUNS['busy']} rows[].idle.gpu.ttft_after_ms"
    )
    return out, notes


def eager_floor() -> tuple[float, str]:
    stall = results.load("host_stall")["stall"]["quiet"]
    return stall["p50_ms"] / 1e3, f"{results.RUNS['host_stall']} stall.quiet.p50_ms"


def request_overhead(floor_s: float) -> tuple[float, str]:
    """The smallest prompt's re-prefill TTFT (one page) less one eager forward."""
    rows = results.load("device_p16")["rows"]
    smallest = min(r["tokens"] for r in rows)
    ttft = statistics.median(r["reprefill_ttft_ms"] for r in rows if r["tokens"] == smallest)
    note = f"{results.RUNS['device_p16']} median reprefill_ttft_ms at {smallest} tokens - floor"
    return max(0.0, ttft / 1e3 - floor_s), note


def cached_slope(cached: Sequence[tuple[int, float]], overhead_s: float) -> float:
    """e: median of (TTFT - overhead) / prefix over prefixes of 8K and more."""
    slopes = [(t - overhead_s) / p for p, t in cached if p >= 8000]
    return max(0.0, statistics.median(slopes)) if slopes else 0.0


def decode_batch1() -> tuple[Linear, str]:
    """d0 and c_seq: the live-move record's decode step of one request, by its context
    (the prompt plus what it generated)."""
    rows = results.load("live_h200")["rows"]
    fit = fit_linear([(r["context"] + r["generated"], r["decode_step_s"]) for r in rows])
    return fit, f"{results.RUNS['live_h200']} rows[].decode_step_s by context + generated"


def busy_iteration() -> tuple[float, int, str]:
    """The busy source's mean loop iteration (s) and its batch: the batch over its decode
    throughput without moves."""
    record = results.load("busy")
    batch = record["config"]["busy"]
    tok_s = record["decode"]["without_tok_s"]["median"]
    return batch / tok_s, batch, f"{results.RUNS['busy']} decode.without_tok_s, config.busy"


def decode_kv_slope(
    d0: float, c_seq: float, b: float, c: float, floor_s: float
) -> tuple[float, str]:
    """c_kv from the busy batch: its iteration less the prefills of the requests that
    replace those finishing (one per `mean output` steps each), less d0, over the sum of
    the batch's contexts (each request half-way through its output on average)."""
    iteration, batch, where = busy_iteration()
    prompts, outputs = BUSY_PROMPTS, BUSY_OUTPUTS
    mean_out = statistics.mean(outputs)
    prefill = statistics.mean(max(floor_s, b * p + c * p * p / 2) for p in prompts)
    per_step_prefill = batch / mean_out * prefill
    contexts = [p + o / 2 for p in prompts for o in outputs]
    sum_ctx = batch * statistics.mean(contexts)
    attention = iteration - per_step_prefill - d0
    seq = c_seq * max(contexts)
    slope = max(attention, seq) / sum_ctx
    note = f"{where}; prompts and outputs of busy_batch.BUSY_PROMPTS / BUSY_OUTPUTS"
    return slope, note


def move_fits() -> tuple[dict[str, Linear], dict[str, str]]:
    """Idle-server moves by route: busy record (GPU and host tier, device path) and the
    host-path table (Mooncake TCP)."""
    busy = results.load("busy")
    fits, notes = {}, {}
    for tier, route in (("gpu", GPU), ("host", HOST)):
        pts = [
            (r["idle"][tier]["migrated_tokens"], r["idle"][tier]["total_ms"] / 1e3)
            for r in busy["rows"]
            if r["idle"][tier]["migrated_tokens"] > 0
        ]
        fits[route] = fit_linear(pts)
        notes[f"moves.{route}"] = f"{results.RUNS['busy']} rows[].idle.{tier}.total_ms"
    table = results.load("host_table_p1")["table_fresh"]
    fits[CROSS_HOST] = fit_linear([(c["migrated_tokens"], c["migrate_ms"] / 1e3) for c in table])
    notes[f"moves.{CROSS_HOST}"] = f"{results.RUNS['host_table_p1']} table_fresh[].migrate_ms"
    return fits, notes


def busy_wait() -> tuple[float, str]:
    """Loop iterations a move waits on a busy source: (busy - idle move) / iteration,
    median over the lengths (GPU tier, moves of the whole prefix)."""
    iteration, _, where = busy_iteration()
    rows = results.load("busy")["rows"]
    waits = [
        (r["busy"]["gpu"]["total_ms"] - r["idle"]["gpu"]["total_ms"]) / 1e3 / iteration
        for r in rows
        if r["busy"]["gpu"]["migrated_tokens"] > 0
    ]
    note = f"{results.RUNS['busy']} rows[].busy.gpu.total_ms - idle; {where}"
    return max(0.0, statistics.median(waits)), note


def derive(cuda_graphs: bool = True) -> CostProfile:
    """Every constant from the records (see the module docstring)."""
    floor_s, floor_note = eager_floor()
    overhead_s, overhead_note = request_overhead(floor_s)
    fresh, fresh_note = _fresh_ttfts()
    b, c = fit_prefill(fresh, overhead_s)
    cached, cached_note = _cached_ttfts()
    e = cached_slope(cached, overhead_s)
    batch1, batch1_note = decode_batch1()
    c_kv, c_kv_note = decode_kv_slope(batch1.fixed_s, batch1.per_token_s, b, c, floor_s)
    moves, move_notes = move_fits()
    wait, wait_note = busy_wait()
    load_back = max(0.0, moves[HOST].per_token_s - moves[GPU].per_token_s)
    sources = {
        "eager_floor_s": floor_note,
        "request_overhead_s": overhead_note,
        "prefill_s_per_token": fresh_note + " (least squares with c)",
        "prefill_attention_s": "as prefill_s_per_token",
        "prefill_cached_s_per_token": cached_note,
        "decode_base_s": batch1_note,
        "decode_seq_s_per_token": batch1_note,
        "decode_kv_s_per_token": c_kv_note,
        "load_back_s_per_token": "moves.host.per_token_s - moves.gpu.per_token_s",
        "busy_wait_iterations": wait_note,
        **move_notes,
        **{f"assumed.{k}": v for k, v in ASSUMED.items()},
    }
    return CostProfile(
        cuda_graphs=cuda_graphs,
        request_overhead_s=overhead_s,
        eager_floor_s=floor_s,
        prefill_s_per_token=b,
        prefill_attention_s=c,
        prefill_cached_s_per_token=e,
        decode_base_s=batch1.fixed_s,
        decode_seq_s_per_token=batch1.per_token_s,
        decode_kv_s_per_token=c_kv,
        load_back_s_per_token=load_back,
        moves=moves,
        busy_wait_iterations=wait,
        sources=sources,
    )
