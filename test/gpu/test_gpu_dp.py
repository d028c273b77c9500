"""Migration into and out of each DP rank of a real `--dp-size 2` SGLang 0.5.12 server.

Three servers on two GPUs (tiny Llama, dummy weights): `dp` and `dp_peer` with
`--dp-size 2` (no DP attention; DP rank r on GPU r) and `single` with one DP rank on
GPU 0. SGLang 0.5.12 cannot put two DP ranks on one GPU (see `real_servers.launch`), so
on a machine with fewer than two GPUs the tests are skipped, saying so
(`scripts/x2_runs.sh 5`). A prefix lives on one DP rank; the target's allocate
lands on the DP rank holding the longest prefix of the request (ties: the least loaded,
then the lowest). So each test first puts a short head of the prompt on the DP rank it
wants (a `/generate` routed there): the migration must land beside it, report that rank
as `MigrationResult.target_dp_rank`, and the continuation routed there must be served
from cache with the source's greedy output. Out of a DP rank: the prompt is prefilled
on one DP rank of `dp`, and the client's size query must find it there.

Greedy outputs are compared with the source serving the same prompt from its own cache
(a second request, on the same DP rank), as in `test_gpu_device_path.py`.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sglang_kv_migration.client.migration import MigrationClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_servers import (  # noqa: E402
    TINY_LLAMA,
    ServerSpec,
    cached_tokens,
    generate,
    record,
    running_servers,
    write_model,
)

pytestmark = pytest.mark.gpu

DP_SIZE = 2
PAGE_SIZE = int(os.environ.get("KVMIG_PAGE_SIZE", "16"))
PORT_BASE = int(os.environ.get("KVMIG_PORT_BASE", "30700"))
HEAD_TOKENS = 64  # the prompt's head put on the wanted DP rank before a migration
PROMPT_TOKENS = 1500


@dataclass(frozen=True)
class Servers:
    dp: str
    dp_peer: str
    single: str


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    import torch

    if torch.cuda.device_count() < DP_SIZE:
        pytest.skip(
            f"--dp-size {DP_SIZE} needs {DP_SIZE} GPUs: SGLang 0.5.12 gives DP rank r GPU "
            f"base + r, and CUDA refuses a GPU listed twice (error 101)"
        )
    model_dir = write_model(TINY_LLAMA, Path("/tmp/kvmig-tiny-llama"))
    common = ["--page-size", str(PAGE_SIZE), "--mem-fraction-static", "0.15"]
    common += ["--max-total-tokens", "32768"]
    specs = [
        ServerSpec(PORT_BASE + 10, common, gpu_id=0, dp_size=DP_SIZE),
        ServerSpec(PORT_BASE + 20, common, gpu_id=0, dp_size=DP_SIZE),
        ServerSpec(PORT_BASE + 30, common, gpu_id=0),
    ]
    record("dp_config", {"dp_size": DP_SIZE, "page_size": PAGE_SIZE, "model": TINY_LLAMA})
    try:
        with running_servers(model_dir, specs, sequential=True) as (dp, dp_peer, single):
            yield Servers(dp, dp_peer, single)
    except (RuntimeError, TimeoutError) as exc:
        pytest.fail(f"a --dp-size {DP_SIZE} server did not start:\n{exc}")


@pytest.fixture(scope="module")
def client() -> Iterator[MigrationClient]:
    with MigrationClient() as c:
        yield c


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, int(TINY_LLAMA["vocab_size"])) for _ in range(PROMPT_TOKENS)]


def _aligned(n: int) -> int:
    return n // PAGE_SIZE * PAGE_SIZE


def _moved(
    client: MigrationClient,
    source: str,
    target: str,
    prompt: list[int],
    source_dp_rank: int | None,
) -> dict[str, Any]:
    """Migrate `prompt` less its last token; the continuation on the target (routed to
    the DP rank the migration reports) and the source's own cached reply."""
    reference = generate(source, prompt, 16, dp_rank=source_dp_rank)
    result = client.migrate(source, target, prompt[:-1])
    on_target = generate(target, prompt, 16, dp_rank=result.target_dp_rank)
    return {"result": result, "reference": reference, "on_target": on_target}


def _check_served_from_cache(moved: dict[str, Any]) -> None:
    result, on_target = moved["result"], moved["on_target"]
    expected = _aligned(PROMPT_TOKENS - 1)
    assert result.migrated_token_size > 0, result
    assert result.matched_after_commit == expected, result
    assert on_target["output_ids"] == moved["reference"]["output_ids"]
    # What the target already held plus what moved: the whole page-aligned prefix.
    assert cached_tokens(on_target) >= expected
    assert cached_tokens(on_target) >= result.migrated_token_size


def _record(name: str, moved: dict[str, Any], **extra: Any) -> None:
    record(
        name,
        {
            **extra,
            "result": moved["result"].to_dict(),
            "target_cached_tokens": cached_tokens(moved["on_target"]),
            "outputs_equal": moved["on_target"]["output_ids"] == moved["reference"]["output_ids"],
        },
    )


def test_session_info_lists_both_dp_ranks(servers: Servers, client: MigrationClient):
    info = client.session_info(servers.dp)
    assert info.dp_size == DP_SIZE
    assert sorted({rank.dp_rank for rank in info.ranks}) == list(range(DP_SIZE))


@pytest.mark.parametrize("dp_rank", range(DP_SIZE))
def test_migrate_into_each_dp_rank(servers: Servers, client: MigrationClient, dp_rank: int):
    prompt = _prompt(10 + dp_rank)
    generate(servers.single, prompt, 1)
    generate(servers.dp, prompt[:HEAD_TOKENS], 1, dp_rank=dp_rank)  # the head, on dp_rank

    moved = _moved(client, servers.single, servers.dp, prompt, None)
    _record("dp_into_rank", moved, dp_rank=dp_rank)
    assert moved["result"].target_dp_rank == dp_rank, moved["result"]
    assert moved["result"].target_matched_token_size == _aligned(HEAD_TOKENS)
    _check_served_from_cache(moved)


@pytest.mark.parametrize("dp_rank", range(DP_SIZE))
def test_migrate_out_of_each_dp_rank(servers: Servers, client: MigrationClient, dp_rank: int):
    prompt = _prompt(20 + dp_rank)
    generate(servers.dp, prompt, 1, dp_rank=dp_rank)

    moved = _moved(client, servers.dp, servers.single, prompt, dp_rank)
    _record("dp_out_of_rank", moved, dp_rank=dp_rank)
    assert moved["result"].target_dp_rank is None, moved["result"]
    assert moved["result"].migrated_token_size == _aligned(PROMPT_TOKENS - 1)
    _check_served_from_cache(moved)


@pytest.mark.parametrize("source_rank,target_rank", [(0, 1), (1, 0)])
def test_migrate_between_dp_ranks_of_two_servers(
    servers: Servers, client: MigrationClient, source_rank: int, target_rank: int
):
    prompt = _prompt(30 + source_rank)
    generate(servers.dp, prompt, 1, dp_rank=source_rank)
    generate(servers.dp_peer, prompt[:HEAD_TOKENS], 1, dp_rank=target_rank)

    moved = _moved(client, servers.dp, servers.dp_peer, prompt, source_rank)
    _record("dp_between_servers", moved, source_rank=source_rank, target_rank=target_rank)
    assert moved["result"].target_dp_rank == target_rank, moved["result"]
    _check_served_from_cache(moved)
