"""verl's rollout pattern on one H200: sticky multi-turn sessions over two servers, skewed.

Two real SGLang servers (Llama-3-8B shape, dummy weights, CUDA graphs on, HiCache and
this plugin on) share one GPU. Each repeat runs one rollout step per arm, in a rotated
order, on flushed caches:

- `default`: verl's own `GlobalRequestLoadBalancer` (`verl.workers.rollout.router`) when
  it imports; else `KVMigrationLoadBalancer` with re-pinning off (`repin_margin` beyond
  any load), which places exactly as verl's does. The result names which one ran.
- `repin_reprefill`: `KVMigrationLoadBalancer` past `--repin-margin` with the cost model
  forced to recompute (`cost_margin` 1e12): a session moves only when its load gain beats
  re-prefilling what its server holds, and the new server re-prefills.
- `repin_migrate`: the same balancer with the cost model's own verdict: a session moves
  when its load gain beats its migration (or its re-prefill), its KV migrated first.

The skew is verl's own: the balancer starts with server A alone (as with replicas that
register later, `add_servers`); `--skewed` sessions run their first turn there and stick
to A, then B joins and the measured step starts: every session runs `--turns` turns (the
skewed ones resume; `--sessions - --skewed` new ones start), each turn a greedy
/generate (`ignore_eos`, so lengths match) of the history + `--user-tokens` new tokens,
through the balancer's acquire/release as verl's client calls them; the history grows
by the user tokens and the output. Per step: makespan (start to last turn done) and
every turn's latency (acquire to release, so a move's time counts). Outputs are compared
turn by turn across the arms of each repeat.

    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_verl_pattern.py --repeats 3
    KVMIG_GPU_OUT=$OUT python3 benchmark/bench_verl_pattern.py --quick   # tiny model

Writes `$KVMIG_GPU_OUT/bench_verl_pattern.json` after every arm of every repeat
(`complete` false until the end) and prints a markdown table. No repeat starts after
`--deadline-s`.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from sglang_kv_migration.integrations.verl_balancer import KVMigrationLoadBalancer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "test" / "gpu"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import verl_pattern_stats as stats  # noqa: E402
from real_servers import (  # noqa: E402
    LLAMA3_8B,
    OUT_DIR,
    TINY_LLAMA,
    ServerSpec,
    flush_cache,
    running_servers,
    write_model,
)

RESULT = OUT_DIR / "bench_verl_pattern.json"


def verl_balancer_class() -> tuple[Any, str]:
    """verl's `GlobalRequestLoadBalancer`, or None with the reason it did not import."""
    try:
        from verl.workers.rollout.router import GlobalRequestLoadBalancer
    except Exception as e:  # verl or Ray absent from the GPU wheel set
        return None, f"{type(e).__name__}: {e}"
    return GlobalRequestLoadBalancer, "verl.workers.rollout.router.GlobalRequestLoadBalancer"


def make_balancer(arm: str, servers: dict[str, Any], args: argparse.Namespace) -> Any:
    if arm == stats.DEFAULT:
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


async def run_step(arm: str, urls: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Pin the skewed sessions to A alone, add B, run the measured step; its record."""
    ids = [u.removeprefix("http://") for u in urls]
    lb = make_balancer(arm, {ids[0]: f"handle-{ids[0]}"}, args)
    rng = random.Random(args.seed)
    sessions = [Session(f"s{i}", user_tokens(rng, args.context)) for i in range(args.sessions)]
    skewed, fresh = sessions[: args.skewed], sessions[args.skewed :]
    limits = httpx.Limits(max_connections=4 * args.sessions)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        pinned = await asyncio.gather(*(run_turn(lb, http, s, 0, args) for s in skewed))
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


def server_flags(args: argparse.Namespace) -> list[str]:
    per_session = args.context + (args.turns + 1) * (args.user_tokens + args.new_tokens)
    return [
        "--mem-fraction-static", str(args.mem_fraction_static),
        "--context-length", str(per_session + 256),
        "--max-running-requests", str(2 * args.sessions),
        "--hicache-ratio", "2",
    ]  # fmt: skip


def save(
    config: dict[str, Any], steps: dict[str, list], mismatches: dict, started: float, done: bool
) -> dict[str, Any]:
    """The result file: config, every step (outputs kept as their length), the summary."""
    light = {
        arm: [
            {**s, "turns": [{**t, "output_ids": len(t["output_ids"])} for t in s["turns"]]}
            for s in arm_steps
        ]
        for arm, arm_steps in steps.items()
    }
    result = {
        "config": config,
        "steps": light,
        "summary": stats.summarize(steps, mismatches),
        "wall_s": round(time.monotonic() - started, 1),
        "complete": done,
    }
    stats.write_result(RESULT, result)
    return result


def run_repeats(urls: list[str], args: argparse.Namespace, config: dict[str, Any]) -> dict:
    started = time.monotonic()
    steps: dict[str, list] = {arm: [] for arm in stats.ARMS}
    mismatches: dict[int, list[str]] = {}
    for repeat in range(args.repeats):
        if repeat and time.monotonic() - args.t0 > args.deadline_s:
            print(f"deadline: stopping before repeat {repeat}", flush=True)
            break
        order = stats.ARMS[repeat % 3 :] + stats.ARMS[: repeat % 3]  # rotated: no order bias
        outputs: dict[str, dict[str, list[int]]] = {}
        for arm in order:
            for url in urls:
                flush_cache(url)
            step = asyncio.run(run_step(arm, urls, args))
            step["repeat"] = repeat
            steps[arm].append(step)
            outputs[arm] = {t["key"]: t["output_ids"] for t in step["turns"]}
            print(f"repeat {repeat} {arm}: makespan {step['makespan_s']:.2f}s, "
                  f"moves {step['moves']}", flush=True)  # fmt: skip
            if len(outputs) == len(order):
                mismatches[repeat] = stats.output_mismatches(outputs)
            save(config, steps, mismatches, started, done=False)
    return save(config, steps, mismatches, started, done=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = p.add_argument
    add("--repeats", type=int, default=3)
    add("--sessions", type=int, default=16)
    add("--skewed", type=int, default=12, help="sessions first pinned to server A")
    add("--turns", type=int, default=4, help="measured turns per session")
    add("--context", type=int, default=8192, help="each session's first prompt (tokens)")
    add("--user-tokens", type=int, default=256, help="new tokens each turn adds")
    add("--new-tokens", type=int, default=32, help="greedy tokens generated per turn")
    add("--repin-margin", type=int, default=2)
    add("--prefill-seconds-per-token", type=float, default=None, help="cost model prior")
    add("--mem-fraction-static", type=float, default=0.35, help="per server (two on one GPU)")
    add("--seed", type=int, default=0)
    add("--deadline-s", type=float, default=420.0, help="no repeat starts after this")
    add("--quick", action="store_true", help="tiny model, short histories (smoke run)")
    args = p.parse_args()
    if args.quick:
        args.context, args.user_tokens, args.new_tokens = 512, 32, 8
    if not 0 < args.skewed <= args.sessions:
        p.error("--skewed must be in 1..--sessions")
    args.t0 = time.monotonic()
    return args


def main() -> None:
    args = parse_args()
    shape, name = (TINY_LLAMA, "tiny") if args.quick else (LLAMA3_8B, "llama3-8b")
    model_dir = write_model(shape, Path(f"/tmp/kvmig-{name}-verl"))
    _, default_balancer = verl_balancer_class()
    config = {k: v for k, v in vars(args).items() if k != "t0"}
    config |= {"model": name, "default_balancer": default_balancer, "servers": 2, "gpus": 1}
    if not default_balancer.startswith("verl."):
        config["default_balancer"] = (
            f"verl did not import ({default_balancer}); KVMigrationLoadBalancer with "
            "re-pinning off (verl's placement) ran instead"
        )
    print("default balancer:", config["default_balancer"], flush=True)
    flags = server_flags(args)
    specs = [ServerSpec(30900, flags, cuda_graph=True), ServerSpec(31000, flags, cuda_graph=True)]
    with running_servers(model_dir, specs, sequential=True) as urls:
        result = run_repeats(urls, args, config)
    print(stats.table(result["summary"]))
    print("ratios:", result["summary"]["ratios"])
    print("targets:", result["summary"]["targets"])


if __name__ == "__main__":
    main()
