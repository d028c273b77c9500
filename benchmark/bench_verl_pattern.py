"""verl's rollout pattern on one GPU: sticky multi-turn sessions over two servers, skewed.

Two real SGLang servers (Llama-3-8B shape, dummy weights, page 16, CUDA graphs on,
HiCache and this plugin on) share one GPU, started one after another with pools of one
planned size (`gpu_servers.py`); the host tier is sized for the sessions' histories
within half the machine's free memory. Each repeat runs one rollout step per arm, in a
rotated order, on flushed caches:

- `default`: verl's own `GlobalRequestLoadBalancer` (`verl.workers.rollout.router`) when
  it imports; else `KVMigrationLoadBalancer` with re-pinning off (`repin_margin` beyond
  any load), which places exactly as verl's does. The result names which one ran.
- `repin_reprefill`: `KVMigrationLoadBalancer` past `--repin-margin` with the cost model
  forced to recompute (`cost_margin` 1e12): a session moves only when its load gain beats
  re-prefilling what its server holds, and the new server re-prefills.
- `repin_migrate`: the same balancer with the cost model's own verdict: a session moves
  when its load gain beats its migration (or its re-prefill), its KV migrated first.
- `balanced_bound`: the bound: the default balancer with both servers from the first
  turn, so the sessions start spread and every turn finds its history on its own
  server: no skew to undo, nothing re-prefilled or moved.

The skew is verl's own: the balancer starts with server A alone (as with replicas that
register later, `add_servers`); `--skewed` sessions run their first turn there and stick
to A, then B joins and the measured step starts: every session runs `--turns` turns (the
skewed ones resume; `--sessions - --skewed` new ones start), each turn a greedy
/generate (`ignore_eos`, so lengths match) of the history + `--user-tokens` new tokens,
through the balancer's acquire/release as verl's client calls them; the history grows
by the user tokens and the output. First prompts are `--context` tokens, or with
`--context-max` skewed lengths between the two (most short, a long tail; the histories
grow by (turns + 1) x (user + new) tokens from there). Per step: makespan (start to
last turn done) and every turn's latency (acquire to release, so a move's time counts).
Outputs are compared turn by turn across the arms of each repeat. The balancers'
random tie-breaks draw from a seed per repeat.

    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_verl_pattern.py              # 64 x 4 turns
    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_verl_pattern.py --repeat-start 2
    python3 benchmark/bench_verl_pattern.py --merge a.json b.json           # pool repeats
    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_verl_pattern.py --quick      # tiny model

Writes `$KVMIG_GPU_OUT/bench_verl_pattern.json` (`_r<start>` with `--repeat-start`)
after every arm of every repeat (`complete` false until the end) and prints a markdown
table. No repeat starts that the last one's duration says would end after
`--deadline-s` (from this process's start), and no arm starts after it.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import gpu_servers
import httpx
import verl_pattern_stats as stats
from sglang_kv_migration.integrations.verl_balancer import KVMigrationLoadBalancer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "test" / "gpu"))
from real_servers import (  # noqa: E402
    LLAMA3_8B,
    OUT_DIR,
    TINY_LLAMA,
    ServerSpec,
    flush_cache,
    generate,
    write_model,
)


def verl_balancer_class() -> tuple[Any, str]:
    """verl's `GlobalRequestLoadBalancer`, or None with the reason it did not import."""
    try:
        from verl.workers.rollout.router import GlobalRequestLoadBalancer
    except Exception as e:  # verl or Ray absent from the GPU wheel set
        return None, f"{type(e).__name__}: {e}"
    return GlobalRequestLoadBalancer, "verl.workers.rollout.router.GlobalRequestLoadBalancer"


def make_balancer(arm: str, servers: dict[str, Any], args: argparse.Namespace) -> Any:
    if arm in (stats.DEFAULT, stats.BOUND):
        cls, _ = verl_balancer_class()
        if cls is not None:
            return cls(servers)
        return KVMigrationLoadBalancer(servers, {"repin_margin": 10**9})
    config: dict[str, Any] = {"repin_margin": args.repin_margin}
    if arm == stats.REPREFILL:
        config["cost_margin"] = 1e12  # migrate_s * 1e12 < recompute_s never holds
    elif args.prefill_seconds_per_token is not None:
        config["prefill_seconds_per_token"] = args.prefill_seconds_per_token
    return KVMigrationLoadBalancer(servers, config)


class Session:
    """One multi-turn conversation: its id and its growing history of token ids."""

    def __init__(self, sid: str, context: list[int]):
        self.sid = sid
        self.history = list(context)


def user_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 30000) for _ in range(n)]


async def run_turn(
    lb: Any, http: httpx.AsyncClient, session: Session, turn: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One turn through the balancer as verl's client does: acquire, /generate, release."""
    rng = random.Random(f"{session.sid}/{turn}")
    prompt = session.history + user_tokens(rng, args.user_tokens)
    started = time.perf_counter()
    wants_ids = "prompt_ids" in lb.require_acquire_fields()
    acquired = lb.acquire_server(session.sid, **({"prompt_ids": prompt} if wants_ids else {}))
    server_id, _handle = await acquired if inspect.isawaitable(acquired) else acquired
    try:
        body = {
            "input_ids": prompt,
            "sampling_params": {
                "max_new_tokens": args.new_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            },
        }
        reply = await http.post(f"http://{server_id}/generate", json=body)
        reply.raise_for_status()
        out = reply.json()
    finally:
        lb.release_server(server_id, session.sid)
    latency = time.perf_counter() - started
    output_ids = list(out["output_ids"])
    session.history = prompt + output_ids
    return {
        "key": f"{session.sid}/{turn}",
        "server": server_id,
        "latency_s": round(latency, 5),
        "prompt_tokens": len(prompt),
        "cached_tokens": int(out["meta_info"].get("cached_tokens") or 0),
        "output_ids": output_ids,
    }


async def run_session(
    lb: Any, http: httpx.AsyncClient, session: Session, first: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    return [await run_turn(lb, http, session, t, args) for t in range(first, first + args.turns)]


def make_sessions(args: argparse.Namespace) -> list[Session]:
    rng = random.Random(args.seed)
    lengths = stats.context_lengths(args.seed, args.sessions, args.context, args.context_max)
    return [Session(f"s{i}", user_tokens(rng, n)) for i, n in enumerate(lengths)]


async def run_step(arm: str, urls: list[str], args: argparse.Namespace, seed: str) -> dict:
    """Pin the skewed sessions to A alone (the bound: to A and B), add B, run the
    measured step; its record."""
    ids = [u.removeprefix("http://") for u in urls]
    random.seed(seed)  # both balancers break ties with the random module
    first = {i: f"handle-{i}" for i in (ids if arm == stats.BOUND else ids[:1])}
    lb = make_balancer(arm, first, args)
    sessions = make_sessions(args)
    skewed, fresh = sessions[: args.skewed], sessions[args.skewed :]
    limits = httpx.Limits(max_connections=4 * args.sessions)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        pinned = await asyncio.gather(*(run_turn(lb, http, s, 0, args) for s in skewed))
        if arm != stats.BOUND:
            lb.add_servers({ids[1]: f"handle-{ids[1]}"})
        started = time.perf_counter()
        tasks = [run_session(lb, http, s, 1, args) for s in skewed]
        tasks += [run_session(lb, http, s, 0, args) for s in fresh]
        per_session = await asyncio.gather(*tasks)
        makespan = time.perf_counter() - started
    status = lb.get_status() if hasattr(lb, "get_status") else {}
    if hasattr(lb, "aclose"):
        await lb.aclose()
    turns = [t for session_turns in per_session for t in session_turns]
    return {
        "arm": arm,
        "makespan_s": round(makespan, 4),
        "pinned_to_a": sum(t["server"] == ids[0] for t in pinned),
        "turns": turns,
        "moves": status.get("moves", {}),
        "migrated_tokens": status.get("migrated_tokens", 0),
    }


# ---------------------------------------------------------------- servers


def history_tokens(args: argparse.Namespace) -> tuple[int, int]:
    """The longest session's final history and all sessions' together (tokens)."""
    lengths = stats.context_lengths(args.seed, args.sessions, args.context, args.context_max)
    growth = (args.turns + 1) * (args.user_tokens + args.new_tokens)
    return max(lengths) + growth, sum(lengths) + len(lengths) * growth


def server_flags(args: argparse.Namespace, kv_tokens: int, per_token: int) -> list[str]:
    longest, total = history_tokens(args)
    ratio = gpu_servers.host_ratio(
        total, kv_tokens, gpu_servers.mem_available_bytes() // 2, per_token, servers=2
    )
    return [
        "--page-size", "16",
        "--context-length", str(longest + 256),
        "--max-running-requests", str(args.sessions),
        "--cuda-graph-max-bs", str(min(args.sessions, 160)),
        "--hicache-ratio", str(ratio),
    ]  # fmt: skip


# ---------------------------------------------------------------- repeats


class Run:
    def __init__(self, args: argparse.Namespace, config: dict[str, Any]):
        self.args, self.config = args, config
        self.steps: dict[str, list] = {arm: [] for arm in stats.ARMS}
        self.mismatches: dict[int, list[str]] = {}
        suffix = f"_r{args.repeat_start}" if args.repeat_start else ""
        self.path = OUT_DIR / f"bench_verl_pattern{suffix}.json"

    def left_s(self) -> float:
        return self.args.deadline_s - (time.monotonic() - self.args.t0)

    def save(self, done: bool) -> dict[str, Any]:
        """The result file: config, every step (outputs kept as their length), the
        mismatched turns per repeat, the summary."""
        light = {
            arm: [
                {**s, "turns": [{**t, "output_ids": len(t["output_ids"])} for t in s["turns"]]}
                for s in arm_steps
            ]
            for arm, arm_steps in self.steps.items()
        }
        result = {
            "config": self.config,
            "steps": light,
            "mismatched_turns": {str(k): v for k, v in self.mismatches.items()},
            "summary": stats.summarize(self.steps, self.mismatches),
            "wall_s": round(time.monotonic() - self.args.t0, 1),
            "complete": done,
        }
        stats.write_result(self.path, result)
        return result

    def one_repeat(self, urls: list[str], repeat: int) -> None:
        shift = repeat % len(stats.ARMS)
        order = stats.ARMS[shift:] + stats.ARMS[:shift]  # rotated: no order bias
        outputs: dict[str, dict[str, list[int]]] = {}
        for arm in order:
            if self.left_s() <= 0:
                print(f"deadline: repeat {repeat} stops before {arm}", flush=True)
                return
            for url in urls:
                flush_cache(url)
            step = asyncio.run(run_step(arm, urls, self.args, f"{self.args.seed}/{repeat}"))
            step["repeat"] = repeat
            self.steps[arm].append(step)
            outputs[arm] = {t["key"]: t["output_ids"] for t in step["turns"]}
            print(f"repeat {repeat} {arm}: makespan {step['makespan_s']:.2f}s, "
                  f"moves {step['moves']}", flush=True)  # fmt: skip
            if len(outputs) == len(order):
                self.mismatches[repeat] = stats.output_mismatches(outputs)
            self.save(done=False)

    def run(self, urls: list[str]) -> dict[str, Any]:
        last = 0.0
        start = self.args.repeat_start
        for repeat in range(start, start + self.args.repeats):
            if repeat > start and self.left_s() < last:
                print(f"deadline: {self.left_s():.0f} s left, a repeat takes ~{last:.0f} s: "
                      f"stopping before repeat {repeat}", flush=True)  # fmt: skip
                break
            t = time.monotonic()
            self.one_repeat(urls, repeat)
            last = time.monotonic() - t
        return self.save(done=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add = p.add_argument
    add("--repeats", type=int, default=3, help="repeats at most (the deadline may stop sooner)")
    add("--repeat-start", type=int, default=0, help="index (and tie-break seed) of the first")
    add("--merge", nargs="+", type=Path, default=None,
        help="pool these result files' repeats and print the summary (no GPU)")  # fmt: skip
    add("--sessions", type=int, default=64)
    add("--skewed", type=int, default=48, help="sessions first pinned to server A")
    add("--turns", type=int, default=4, help="measured turns per session")
    add("--context", type=int, default=2048, help="first prompt (tokens; the shortest one)")
    add("--context-max", type=int, default=12288,
        help="longest first prompt: lengths skewed between --context and this")  # fmt: skip
    add("--user-tokens", type=int, default=512, help="new tokens each turn adds")
    add("--new-tokens", type=int, default=64, help="greedy tokens generated per turn")
    add("--repin-margin", type=int, default=2)
    add("--prefill-seconds-per-token", type=float, default=None, help="cost model prior")
    add("--max-kv-tokens", type=int, default=163840, help="GPU KV pool per server, at most")
    add("--seed", type=int, default=0)
    add("--deadline-s", type=float, default=520.0, help="seconds from start; see the docstring")
    add("--quick", action="store_true", help="tiny model, short histories (smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.sessions, args.skewed, args.context, args.context_max = 16, 12, 512, 2048
        args.user_tokens, args.new_tokens, args.repeats = 32, 8, 1
    if not 0 < args.skewed <= args.sessions:
        p.error("--skewed must be in 1..--sessions")
    args.t0 = time.monotonic()
    return args


def print_summary(summary: dict[str, Any]) -> None:
    print(stats.table(summary))
    print("ratios:", summary["ratios"])
    print("targets:", summary["targets"])


def merge_files(files: list[Path]) -> None:
    merged = stats.merge([(f.stem, json.loads(f.read_text())) for f in files])
    print_summary(stats.summarize(merged["steps"], merged["mismatches"]))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.merge:
        merge_files(args.merge)
        return
    card = gpu_servers.require_gpu("bench_verl_pattern")
    shape, name = (TINY_LLAMA, "tiny") if args.quick else (LLAMA3_8B, "llama3-8b")
    longest, _ = history_tokens(args)
    shape = {
        **shape,
        "max_position_embeddings": max(shape["max_position_embeddings"], longest + 256),
    }
    weights, per_token = gpu_servers.weight_bytes(shape), gpu_servers.kv_bytes_per_token(shape)
    kv_tokens = gpu_servers.plan_kv_tokens(
        card.free_mib * gpu_servers.MIB, 2, weights, per_token, cap=args.max_kv_tokens
    )
    _, default_balancer = verl_balancer_class()
    flags = server_flags(args, kv_tokens, per_token)
    config = {k: v for k, v in vars(args).items() if k not in ("t0", "merge")}
    config |= {"model": name, "default_balancer": default_balancer, "servers": 2, "gpus": 1,
               "kv_tokens": kv_tokens, "server_flags": flags}  # fmt: skip
    config |= gpu_servers.run_info(card)
    if not default_balancer.startswith("verl."):
        config["default_balancer"] = (
            f"verl did not import ({default_balancer}); KVMigrationLoadBalancer with "
            "re-pinning off (verl's placement) ran instead"
        )
    print("default balancer:", config["default_balancer"], flush=True)
    model_dir = write_model(shape, Path(f"/tmp/kvmig-{name}-verl"))
    specs = {
        n: ServerSpec(port, flags, cuda_graph=True) for n, port in (("A", 30900), ("B", 31000))
    }
    with gpu_servers.sized_servers(model_dir, specs, shape, kv_tokens) as servers:
        config["startup_s"] = {s.name: s.startup_s for s in servers}
        urls = [s.url for s in servers]
        for url in urls:  # compile the prefill and decode shapes before anything is timed
            generate(url, user_tokens(random.Random(1), 2048), 8)
        result = Run(args, config).run(urls)
    print_summary(result["summary"])


if __name__ == "__main__":
    main()
