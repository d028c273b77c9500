"""verl's own SGLang server class in Ray actors on one GPU, two replicas, CUDA graphs on,
routed by `KVMigrationLoadBalancer` through verl's router factory: sessions skewed onto
one replica move with their KV, and their next turn is served from the target's cache.
GPU machine only (never in CI):

    KVMIG_GPU_OUT=$OUT python3 -m pytest -m gpu -s test/gpu/test_gpu_verl_actors.py

What runs is verl 0.9.1's and SGLang 0.5.12's, configured as docs/rl-integration.md
("verl") tells a user:
- each replica is verl's `SGLangHttpServer` as a Ray actor, created as
  `SGLangReplica.launch_servers` creates it (standalone: no trainer workers), from verl's
  `RolloutConfig` with the recipe's `engine_kwargs.sglang` (plus what the GPU machine
  needs: Triton attention, PyTorch sampling, a bounded pool) and `enforce_eager` off:
  CUDA graphs on. verl builds `ServerArgs(**args)`, calls `Engine._launch_subprocesses`
  and serves SGLang's app with its own uvicorn; this package's `verl.plugins` entry
  point (installed wheel metadata) makes the flag and the six routes load there;
- the router is verl's `get_router_handle` on the recipe's router YAML: a Ray actor of
  `KVMigrationLoadBalancer`;
- turn 1 of every session runs through verl's `LLMServerClient.generate` (acquire, the
  server actor's `generate`, release) while replica A is the only one; then B joins
  (`add_servers`, as verl adds replicas) and every session's turn 2 is acquired through
  the same client at once. The turn's prompt then goes to the replica's own `/generate`
  (the actor's `generate` does not return SGLang's `cached_tokens`), and is released.

Checked: the replicas' args are this plugin's class; at least one session moved to B
with its KV (`migrated`), and each moved session's turn 2 found at least the migrated
tokens in B's cache; sessions that stayed on A found their history there. Results:
`$KVMIG_GPU_OUT/results.jsonl` (`verl_actors`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
import verl_recipe  # noqa: E402
from real_servers import TINY_LLAMA, record, write_model  # noqa: E402

pytestmark = pytest.mark.gpu

SESSIONS = 8
HISTORY_TOKENS = 2048
OUTPUT_TOKENS = 32
NEW_TOKENS = 16
PAGE = 16
# What the GPU machine needs besides the recipe's flags (../shared/gpu/README.md): FA3 and
# flashinfer's kernels are not carried; two servers share the GPU.
GPU_KWARGS = {
    "attention_backend": "triton",
    "sampling_backend": "pytorch",
    "page_size": PAGE,
    "max_total_tokens": 65536,
    "cuda_graph_max_bs": 16,
}


def _rollout_configs(model_dir: Path) -> tuple[Any, Any]:
    from verl.workers.config import HFModelConfig, RolloutConfig

    engine_kwargs = {**verl_recipe.engine_kwargs(), **GPU_KWARGS}
    rollout = RolloutConfig(
        name="sglang",
        tensor_model_parallel_size=1,
        gpu_memory_utilization=0.25,
        enforce_eager=False,  # CUDA graphs on
        load_format="dummy",
        skip_tokenizer_init=True,
        prompt_length=HISTORY_TOKENS + 2 * (OUTPUT_TOKENS + NEW_TOKENS),
        response_length=OUTPUT_TOKENS,
        engine_kwargs={"sglang": engine_kwargs},
    )
    return rollout, HFModelConfig(path=str(model_dir), load_tokenizer=False)


def _start_replica(rank: int, rollout: Any, model: Any) -> tuple[str, Any]:
    """One replica as `SGLangReplica.launch_servers` starts it; ("host:port", actor)."""
    import ray
    from verl.plugin.platform import get_platform
    from verl.workers.rollout.replica import RolloutMode
    from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangHttpServer

    env = {var: "1" for var in get_platform().ray_noset_envvars()}
    actor = (
        ray.remote(SGLangHttpServer)
        .options(
            runtime_env={"env_vars": {**env, **get_platform().rollout_env_vars()}},
            name=f"sglang_server_{rank}_0",
            max_concurrency=1000,
        )
        .remote(
            config=rollout,
            model_config=model,
            rollout_mode=RolloutMode.STANDALONE,
            workers=[],
            replica_rank=rank,
            node_rank=0,
            nnodes=1,
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES", "0"),
            base_gpu_id=0,
        )
    )
    ray.get(actor.launch_server.remote())
    host, port = ray.get(actor.get_server_address.remote())
    return f"{host}:{port}", actor


async def _turn_one(client: Any, session: str, prompt: list[int]) -> list[int]:
    out = await client.generate(
        session, prompt_ids=prompt, sampling_params=_sampling(OUTPUT_TOKENS)
    )
    return list(out.token_ids)


async def _turn_two(client: Any, session: str, prompt: list[int]) -> dict[str, Any]:
    server_id, _ = await client._acquire_server(session, prompt_ids=prompt)
    try:
        async with httpx.AsyncClient(timeout=300) as http:
            body = {"input_ids": prompt, "sampling_params": _sampling(NEW_TOKENS)}
            reply = await http.post(f"http://{server_id}/generate", json=body)
        reply.raise_for_status()
        meta = reply.json()["meta_info"]
    finally:
        client._release_server(server_id, request_id=session)
    return {"session": session, "server": server_id, "cached_tokens": meta["cached_tokens"]}


def _sampling(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


async def _scenario(lb: Any, client: Any, a: str, b: str, actor_b: Any) -> dict[str, Any]:
    histories = {
        f"session-{i}": [(i * 7919 + t) % 30_000 + 100 for t in range(HISTORY_TOKENS)]
        for i in range(SESSIONS)
    }
    started = time.monotonic()
    outputs = await asyncio.gather(*[_turn_one(client, s, p) for s, p in histories.items()])
    turn_one_s = time.monotonic() - started
    await lb.add_servers.remote({b: actor_b})
    prompts = {
        s: histories[s] + out + list(range(50, 50 + NEW_TOKENS))
        for s, out in zip(histories, outputs, strict=True)
    }
    started = time.monotonic()
    turns = await asyncio.gather(*[_turn_two(client, s, p) for s, p in prompts.items()])
    turn_two_s = time.monotonic() - started
    status = await lb.get_status.remote()
    # The balancer's own records (`MoveRecord`), read on its actor.
    moves = await lb.__ray_call__.remote(lambda b: [dataclasses.asdict(m) for m in b.moves])
    return {
        "turns": turns,
        "moves": moves,
        "status": status,
        "turn_one_s": round(turn_one_s, 3),
        "turn_two_s": round(turn_two_s, 3),
    }


def test_verl_actor_replicas_move_sessions_with_their_kv(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    pytest.importorskip("verl.workers.rollout.sglang_rollout.async_sglang_server")
    from omegaconf import OmegaConf
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    model_dir = write_model({**TINY_LLAMA, "max_position_embeddings": 8192}, tmp_path / "model")
    router_yaml = tmp_path / "kv_migration_router.yaml"
    router_yaml.write_text(yaml.safe_dump(verl_recipe.router_config()))
    ray.init(num_cpus=16, num_gpus=1, include_dashboard=False)
    try:
        rollout, model = _rollout_configs(model_dir)
        # One after the other: two servers starting at once on one GPU size their pools
        # against each other's allocations.
        a, actor_a = _start_replica(0, rollout, model)
        b, actor_b = _start_replica(1, rollout, model)
        args_class = ray.get(
            actor_a.__ray_call__.remote(lambda s: type(s.tokenizer_manager.server_args).__name__)
        )
        lb = get_router_handle({a: actor_a}, router_config_path=str(router_yaml))
        config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "sglang"}}})
        client = LLMServerClient(config=config, load_balancer_handle=lb)
        result = asyncio.run(_scenario(lb, client, a, b, actor_b))
    finally:
        ray.shutdown()
    moves = result["moves"]
    record("verl_actors", {"a": a, "b": b, "server_args_class": args_class, **result})
    assert args_class == "KVMigrationServerArgs"
    by_session = {t["session"]: t for t in result["turns"]}
    migrated = [m for m in moves if m["outcome"] == "migrated" and m["target"] == b]
    assert migrated, result["status"]
    for move in migrated:
        turn = by_session[move["request_id"]]
        assert turn["server"] == b and turn["cached_tokens"] >= move["migrated_tokens"], turn
    for turn in result["turns"]:
        if turn["server"] == a:
            assert turn["cached_tokens"] >= HISTORY_TOKENS // PAGE * PAGE, turn
