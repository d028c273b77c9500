"""What `--enable-kv-migration` costs a server that serves and never moves: an A/B on one GPU.

Servers side by side on one GPU (GPU machine only), Llama-3-8B shape with dummy weights
(a config written here, 36,864 positions so that a 32K prefix + 16 new tokens fits),
page 16, CUDA graphs on, Triton attention, started one after another with pools of one
planned size (`gpu_servers.py`: what the card has free, shared evenly):

- `stock`: SGLang 0.5.12 as its users run it: no HiCache, and no plugin loaded
  (`SGLANG_PLUGINS=none`: SGLang skips every plugin entry point, this one included);
- `hicache`: the same with `--enable-hierarchical-cache` (what the flag requires);
- `flag`: HiCache, this plugin loaded and `--enable-kv-migration`;
- `hicache_twin` (`--twin on`, or `auto` where the card holds four pools of at least
  `--min-kv-tokens`): a second `hicache` server, for the A/A spread of two identical
  servers. Without it the A/A spread is that of the HiCache server's interleaved rounds.

After one untimed warm-up round (compiles every shape, places the cached prefixes),
every round measures each cell on every server, one server at a time, the servers'
order rotated each round (interleaved: drift over the run reaches every server alike):

- TTFT of a fresh 17-token prompt (`--fresh-samples`) and of a fresh 2K prompt;
- cached TTFT at 4K / 16K / 32K: the prefix (the same tokens on every server) is made
  resident untimed, then prefix + 16 new tokens is timed; a sample whose prefix was not
  served whole from the GPU (`cached_tokens_details.device`, or `cached_tokens` where
  SGLang reports no details) is left out and taken again, and counted in `misses`;
- inter-token latency of one request (1K prompt, streamed, `--itl-tokens`);
- 32 and 64 concurrent requests (128-token prompts, `--decode-tokens` each, greedy,
  `ignore_eos`), streamed: decode throughput and inter-token latency while all of them
  decode (from the last one's first token to the first one's last).

A cell's value in a round is the median of its samples; per server the median over
rounds (min–max, n), the flag's cost against `hicache`, HiCache's own against `stock`,
the A/A spread and the verdict come from `flag_cost_stats.py`. The result file is
rewritten after every cell of every round (a run cut at its limit keeps what it
measured; `complete` false), and no round starts that the last one's duration says
would end after `--deadline-s` (from this process's start).

Settings beside SGLang's defaults, the same on every server: `--page-size 16`,
`--cuda-graph-max-bs 64` and `--max-running-requests 64` (the largest batch measured),
`--chunked-prefill-size 8192`.

    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_flag_cost.py                # ~520 s on H100
    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_flag_cost.py --quick        # tiny model

Writes `$KVMIG_GPU_OUT/bench_flag_cost.json` and prints the table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import flag_cost_stats as stats
import gpu_servers
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "test" / "gpu"))
from real_servers import LLAMA3_8B, OUT_DIR, TINY_LLAMA, ServerSpec, write_model  # noqa: E402

RESULT = OUT_DIR / "bench_flag_cost.json"
POSITIONS = 36864
PORT_BASE = 31200
PAGE = 16
FRESH = {"ttft_fresh_17": 17, "ttft_fresh_2k": 2048}
CACHED = {"ttft_cached_4k": 4096, "ttft_cached_16k": 16384, "ttft_cached_32k": 32768}
SUFFIX = 16  # new tokens after a cached prefix
DECODE_PROMPT = 128
ITL_PROMPT = 1024
SETTLE_S = 0.1  # between servers: the last one's HiCache write-through may still copy
COMPLETION = re.compile(rb'"completion_tokens":\s*(\d+)')
# name -> (HiCache, plugin loaded with --enable-kv-migration)
KINDS = {
    stats.STOCK: (False, False),
    stats.HICACHE: (True, False),
    stats.FLAG: (True, True),
    stats.TWIN: (True, False),
}
SERVER_FLAGS = [
    "--page-size", str(PAGE), "--cuda-graph-max-bs", "64", "--max-running-requests", "64",
    "--chunked-prefill-size", "8192",
]  # fmt: skip

Entries = dict[str, dict[str, Any]]  # cell name -> what one server gave in one round


# ---------------------------------------------------------------- requests


def greedy(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


def fresh(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 120_000) for _ in range(n)]


async def timed(http: httpx.AsyncClient, url: str, ids: list[int]) -> tuple[float, dict]:
    """One token of `ids`: the wall seconds and the reply."""
    t0 = time.perf_counter()
    reply = await http.post(
        url + "/generate", json={"input_ids": ids, "sampling_params": greedy(1)}
    )
    reply.raise_for_status()
    return time.perf_counter() - t0, reply.json()


async def streamed(http: httpx.AsyncClient, url: str, ids: list[int], n: int) -> list:
    """`(seconds since submit, tokens so far)` per chunk of a streamed greedy request.
    Only the counter is read from each chunk (a regex, not a JSON parse of the growing
    output), so 64 streams cost this process little."""
    body = {"input_ids": ids, "sampling_params": greedy(n), "stream": True}
    points: list[tuple[float, int]] = []
    t0 = time.perf_counter()
    async with http.stream("POST", url + "/generate", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            found = COMPLETION.search(line.encode())
            if found:
                count = int(found[1])
                if not points or count > points[-1][1]:
                    points.append((time.perf_counter() - t0, count))
    return points


def device_cached(reply: dict) -> int:
    """Prompt tokens served from the GPU's cache (all of `cached_tokens` where SGLang
    gives no per-tier details: a server without HiCache has no other tier)."""
    meta = reply["meta_info"]
    details = meta.get("cached_tokens_details")
    if details:
        return int(details.get("device") or 0)
    return int(meta.get("cached_tokens") or 0)


# ---------------------------------------------------------------- cells


class Cells:
    """The measurements of one round on one server, each returning its cells' entries."""

    def __init__(self, args: argparse.Namespace, http: httpx.AsyncClient, warm: bool):
        self.args, self.http, self.warm = args, http, warm
        self.prefixes = {cell: fresh(random.Random(n), n) for cell, n in CACHED.items()}

    def steps(self) -> list[tuple[str, Callable[[str, random.Random], Awaitable[Entries]]]]:
        out: list[tuple[str, Callable[[str, random.Random], Awaitable[Entries]]]] = []
        for cell in FRESH:
            out.append((cell, lambda u, r, c=cell: self.fresh(u, r, c)))
        for cell in CACHED:
            out.append((cell, lambda u, r, c=cell: self.cached(u, r, c)))
        out.append(("itl_1", self.itl))
        for n in self.args.concurrency:
            out.append((f"decode_{n}", lambda u, r, n=n: self.decode(u, r, n)))
        return out

    def samples(self, wanted: int) -> int:
        return 1 if self.warm else wanted

    async def fresh(self, url: str, rng: random.Random, cell: str) -> Entries:
        short = cell == "ttft_fresh_17"
        wanted = self.samples(self.args.fresh_samples if short else self.args.samples)
        ms = [
            1e3 * (await timed(self.http, url, fresh(rng, FRESH[cell])))[0] for _ in range(wanted)
        ]
        return {cell: {"samples_ms": [round(v, 3) for v in ms], "value": statistics.median(ms)}}

    async def cached(self, url: str, rng: random.Random, cell: str) -> Entries:
        prefix = self.prefixes[cell]
        whole = len(prefix) // PAGE * PAGE
        await timed(self.http, url, prefix)  # resident, untimed
        ms, misses = [], 0
        for _ in range(self.samples(self.args.samples)):
            for _attempt in range(2):  # a miss re-places the prefix: the retry hits
                seconds, reply = await timed(self.http, url, prefix + fresh(rng, SUFFIX))
                if device_cached(reply) >= whole:
                    ms.append(1e3 * seconds)
                    break
                misses += 1
        value = statistics.median(ms) if ms else None
        return {cell: {"samples_ms": [round(v, 3) for v in ms], "misses": misses, "value": value}}

    async def itl(self, url: str, rng: random.Random) -> Entries:
        n = 16 if self.warm else self.args.itl_tokens
        points = await streamed(self.http, url, fresh(rng, ITL_PROMPT), n)
        ttft = round(1e3 * points[0][0], 3) if points else None
        return {"itl_1": {"value": stats.itl_ms(points), "ttft_ms": ttft, "tokens": len(points)}}

    async def decode(self, url: str, rng: random.Random, n: int) -> Entries:
        gen = 16 if self.warm else self.args.decode_tokens
        prompts = [fresh(rng, DECODE_PROMPT) for _ in range(n)]
        streams = await asyncio.gather(*(streamed(self.http, url, p, gen) for p in prompts))
        window = stats.decode_window(streams)
        return {
            f"decode_{n}": {"value": window["tok_s"], **window},
            f"itl_{n}": {"value": window["itl_ms"]},
        }


# ---------------------------------------------------------------- rounds


class Run:
    """The rounds, the record and its file."""

    def __init__(self, args: argparse.Namespace, config: dict[str, Any], servers: list):
        self.args, self.config = args, config
        self.servers = {s.name: s.url for s in servers}
        self.record: dict[str, Any] = {
            "config": config,
            "servers": [vars(s) for s in servers],
            "warmup_s": None,
            "rounds": [],
            "errors": {},
            "complete": False,
        }

    def save(self) -> None:
        names = list(self.servers)
        self.record["summary"] = stats.summarize(self.record["rounds"], names)
        self.record["wall_s"] = round(time.monotonic() - self.args.t0, 1)
        tmp = RESULT.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.record, indent=1))
        tmp.replace(RESULT)

    def left_s(self) -> float:
        return self.args.deadline_s - (time.monotonic() - self.args.t0)

    async def one_round(self, http: httpx.AsyncClient, index: int, warm: bool) -> dict:
        """One round; a measured one is in the record from its start, so that the file
        written after each cell keeps a round the command's limit cuts."""
        names = list(self.servers)
        order = names[index % len(names) :] + names[: index % len(names)]
        rec: dict[str, Any] = {"round": index, "order": order, "cells": {}}
        if not warm:
            self.record["rounds"].append(rec)
        rng = random.Random(f"{self.args.seed}/{index}/{warm}")
        for step, measure in Cells(self.args, http, warm).steps():
            if self.left_s() <= 0:
                rec["cut"] = f"deadline before {step}"
                break
            for name in order:
                try:
                    entries = await measure(self.servers[name], rng)
                except (httpx.HTTPError, KeyError, ValueError) as exc:
                    self.record["errors"][f"{index}:{step}:{name}"] = repr(exc)[:400]
                    continue
                for cell, entry in entries.items():
                    rec["cells"].setdefault(cell, {})[name] = entry
                await asyncio.sleep(SETTLE_S)
            if not warm:
                self.save()
        return rec

    async def rounds(self) -> None:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            t = time.monotonic()
            await self.one_round(http, 0, warm=True)
            self.record["warmup_s"] = last = round(time.monotonic() - t, 1)
            print(f"warm-up round: {last} s", flush=True)
            for index in range(self.args.rounds):
                if self.left_s() < last:
                    print(f"deadline: {self.left_s():.0f} s left, a round takes ~{last:.0f} s: "
                          f"stopping after {index} rounds", flush=True)  # fmt: skip
                    break
                t = time.monotonic()
                rec = await self.one_round(http, index, warm=False)
                rec["seconds"] = last = round(time.monotonic() - t, 1)
                print(f"round {index}: {last} s", flush=True)
                self.save()
        self.record["complete"] = True
        self.save()


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add = p.add_argument
    add(
        "--rounds",
        type=int,
        default=6,
        help="measured rounds at most (the deadline may stop sooner)",
    )
    add("--deadline-s", type=float, default=520.0,
        help="no round starts that would end after this many seconds from start")  # fmt: skip
    add("--twin", choices=("auto", "on", "off"), default="off",
        help="a second HiCache server for the A/A spread (auto: where four pools fit)")  # fmt: skip
    add("--fresh-samples", type=int, default=5, help="fresh 17-token TTFTs per round")
    add("--samples", type=int, default=3, help="samples per round of the 2K and cached TTFTs")
    add("--itl-tokens", type=int, default=128, help="tokens streamed for one request's ITL")
    add("--decode-tokens", type=int, default=160, help="tokens per request of the decode cells")
    add("--concurrency", type=int, nargs="+", default=[32, 64], help="decode cells' requests")
    add("--max-kv-tokens", type=int, default=98304, help="largest pool per server (tokens)")
    add("--min-kv-tokens", type=int, default=40960,
        help="smallest pool worth running (a 32K prefix + 16 must fit)")  # fmt: skip
    add("--seed", type=int, default=0)
    add("--quick", action="store_true", help="tiny model, two rounds, short decodes (smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.fresh_samples, args.samples = 2, 2, 1
        args.itl_tokens, args.decode_tokens = 32, 32
    if max(args.concurrency) > 64 or min(args.concurrency) < 1:
        p.error("--concurrency: 1..64 (the servers run 64 requests at most)")
    args.t0 = time.monotonic()
    return args


def plan(args: argparse.Namespace, card: gpu_servers.Card, shape: dict) -> tuple[list[str], int]:
    """The servers to start and each one's pool, from the card's free memory."""
    names = [stats.STOCK, stats.HICACHE, stats.FLAG]
    weights, per_token = gpu_servers.weight_bytes(shape), gpu_servers.kv_bytes_per_token(shape)
    free = card.free_mib * gpu_servers.MIB

    def kv(n: int) -> int:
        return gpu_servers.plan_kv_tokens(free, n, weights, per_token, cap=args.max_kv_tokens)

    if args.twin == "on" or (args.twin == "auto" and kv(4) >= args.min_kv_tokens):
        names.append(stats.TWIN)
    tokens = kv(len(names))
    if tokens < args.min_kv_tokens:
        raise SystemExit(
            f"bench_flag_cost: {len(names)} servers get {tokens} KV tokens each on "
            f"{card.name} ({card.free_mib} MiB free); at least {args.min_kv_tokens} needed"
        )
    return names, tokens


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    card = gpu_servers.require_gpu("bench_flag_cost")
    shape, model = (TINY_LLAMA, "tiny") if args.quick else (LLAMA3_8B, "llama3-8b")
    shape = {**shape, "max_position_embeddings": POSITIONS}
    names, kv_tokens = plan(args, card, shape)
    config = {k: v for k, v in vars(args).items() if k != "t0"}
    config |= {"model": model, "kv_tokens": kv_tokens, "server_flags": SERVER_FLAGS,
               "attention_backend": "triton", "cuda_graphs": True,
               **gpu_servers.run_info(card)}  # fmt: skip
    print(f"{card.name}: {len(names)} servers ({', '.join(names)}), {kv_tokens} KV tokens each",
          flush=True)  # fmt: skip
    specs = {}
    for i, name in enumerate(names):
        hicache, plugin = KINDS[name]
        env = {} if plugin else {"SGLANG_PLUGINS": "none"}
        specs[name] = ServerSpec(PORT_BASE + 10 * i, list(SERVER_FLAGS), cuda_graph=True,
                                 migration=plugin, hicache=hicache, env=env)  # fmt: skip
    model_dir = write_model(shape, Path(f"/tmp/kvmig-{model}-flag-cost"))
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    with gpu_servers.sized_servers(model_dir, specs, shape, kv_tokens) as servers:
        run = Run(args, config, servers)
        run.save()
        asyncio.run(run.rounds())
    print(stats.table(run.record["summary"]))
    print("all rows met:", run.record["summary"]["all_met"])


if __name__ == "__main__":
    main()
