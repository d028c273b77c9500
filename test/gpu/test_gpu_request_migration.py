"""`move_request` between two real SGLang 0.5.12 servers on one GPU (issue 10).

Run on the lent GPU machine (never in CI), from the repo root, after installing the wheel
sets and this package as `../shared/gpu/README.md` says (nothing else to install):

    KVMIG_GPU_OUT=$OUT/request-migration KVMIG_PAGE_SIZE=16 \
        python3 -m pytest -m gpu -s -p no:cacheprovider test/gpu/test_gpu_request_migration.py

Parameters (environment): `KVMIG_PAGE_SIZE` (default 16), the `--page-size` of both
servers. Results go to `$KVMIG_GPU_OUT/results.jsonl` (`real_servers.record`).

Two servers share GPU 0, both the small dummy Llama (`TEST_MODELS["mha"]`) with
`--enable-priority-scheduling --enable-metrics --mem-fraction-static 0.2
--max-total-tokens 65536`; the source also has `--max-running-requests 1`, so a second
request there waits in its queue for as long as the first one runs. Requests go through
`RequestMigrator` in this process and are moved with `move_request(..., mode="migrate")`
(the cost model is bypassed: these tests are about correctness, not about when it pays).

What "equals an uninterrupted run" compares against. Every prompt is first served once
on the source (one token), as an earlier turn would leave it; so the moved request, the
reference run on the source afterwards (same prompt, same sampling parameters, batch of
one) and a reference run on the target all start from the same cached prefix and do the
same computation. The reference runs on the source are the check the issue asks for; the
one on the target is recorded and checked too (its prefix came over with the migration).
Dummy weights make greedy output degenerate (`distinct_tokens` is recorded): equal
output_ids are weak evidence on their own; the strong checks are the segments (where each
piece ran, how many tokens it made) and `cached_tokens` of the resumed piece.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fail_on import FailOn
from sglang_kv_migration.client.migration import MigrationClient
from sglang_kv_migration.rollout.request_migration import (
    GenerateRequest,
    RequestMigrator,
    RequestOutput,
    SyncRequestHandle,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_servers import (  # noqa: E402
    TEST_MODELS,
    ServerSpec,
    cached_details,
    kv_pool_usage,
    record,
    running_servers,
    settled_used_tokens,
    wait_for_value,
    write_model,
)

pytestmark = pytest.mark.gpu

PAGE_SIZE = int(os.environ.get("KVMIG_PAGE_SIZE", "16"))
MAX_TOTAL_TOKENS = 65536
PROMPT_TOKENS = 1500
MAX_NEW_TOKENS = 256
MIN_TOKENS_BEFORE_MOVE = 32  # the move happens mid-decode: a few pages generated
QUEUED_NEW_TOKENS = 128
# The low-priority request the queued one waits behind: long enough (seconds of decode)
# that it still runs when the queued request is moved.
BLOCKER_PROMPT_TOKENS, BLOCKER_NEW_TOKENS = 1000, 1024
LOW, HIGH = 0, 5  # HIGH - LOW < 10 (SGLang's preemption threshold): HIGH waits its turn


@dataclass(frozen=True)
class Servers:
    source: str  # --max-running-requests 1
    target: str
    vocab_size: int


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    shape, model_dir = TEST_MODELS["mha"]
    write_model(shape, model_dir)
    common = ["--page-size", str(PAGE_SIZE), "--mem-fraction-static", "0.2"]
    common += ["--max-total-tokens", str(MAX_TOTAL_TOKENS), "--enable-metrics"]
    common += ["--enable-priority-scheduling"]
    specs = [
        ServerSpec(30710, [*common, "--max-running-requests", "1"], gpu_id=0),
        ServerSpec(30720, common, gpu_id=0),
    ]
    record(
        "request_migration_config",
        {"page_size": PAGE_SIZE, "model": shape, "source": specs[0].extra, "target": common},
    )
    with running_servers(model_dir, specs) as (source, target):
        yield Servers(source, target, int(shape["vocab_size"]))


# --------------------------------------------------------------------------- helpers


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(3, vocab_size) for _ in range(n)]  # no bos/eos ids


def _aligned(n: int) -> int:
    return n // PAGE_SIZE * PAGE_SIZE


def _params(max_new_tokens: int) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}


def _generate(url: str, request: GenerateRequest) -> dict[str, Any]:
    """One plain, uninterrupted `/generate` of `request`'s prompt and parameters (new rid)."""
    body = {"input_ids": request.input_ids, "sampling_params": request.sampling_params}
    if request.priority is not None:
        body["priority"] = request.priority
    r = httpx.post(url + "/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def _warm(url: str, prompt: list[int]) -> None:
    """Serve `prompt` once (one token): the source caches it, as an earlier turn would."""
    _generate(url, GenerateRequest(prompt, _params(1)))


def _wait_generating(handle: SyncRequestHandle, url: str, base_used: int) -> int:
    """Wait until the running request holds more KV pages than its prompt +
    MIN_TOKENS_BEFORE_MOVE generated tokens need (the server's live pool count from
    `/v1/loads`: pages are allocated as decoding crosses them); returns that count.
    Fails if the request finished first (then raise MAX_NEW_TOKENS)."""
    needed = len(handle.handle.request.input_ids) + MIN_TOKENS_BEFORE_MOVE
    threshold = base_used + -(-needed // PAGE_SIZE) * PAGE_SIZE + 1

    def probe() -> tuple[int, bool]:
        return kv_pool_usage(url)["num_used_tokens"], handle.done()

    used, finished = wait_for_value(
        probe, lambda v: v[0] >= threshold or v[1], timeout_s=60, interval_s=0.05
    )
    assert not finished, "the request finished before it could be moved"
    return used


def _segments(out: RequestOutput) -> list[dict[str, Any]]:
    return [
        {
            "server_url": s.server_url,
            "kind": s.kind,
            "output_tokens": len(s.output_ids),
            "finish_reason": s.finish_reason,
            "cached_tokens": s.cached_tokens,
            "cached_tokens_details": cached_details({"meta_info": s.meta_info}),
        }
        for s in out.segments
    ]


def _summary(out: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": len(out.prompt_ids),
        "output_tokens": len(out.output_ids),
        "distinct_tokens": len(set(out.output_ids)),
        "finish_reason": out.finish_reason,
        "segments": _segments(out),
        "moves": [m.to_dict() for m in out.moves],
        "output_ids": out.output_ids,
    }


# --------------------------------------------------------------------------- tests


def test_running_request_moves_with_its_kv(servers: Servers):
    """A request decoding on the source moves mid-way; the target serves prompt + the
    tokens generated so far from the migrated KV and finishes it."""
    s = servers
    rng = random.Random(10)
    prompt = _tokens(rng, PROMPT_TOKENS, s.vocab_size)
    request = GenerateRequest(prompt, _params(MAX_NEW_TOKENS), priority=LOW)
    _warm(s.source, prompt)
    base = settled_used_tokens(s.source)

    with RequestMigrator() as migrator:
        handle = migrator.submit(s.source, request)
        used_at_move = _wait_generating(handle, s.source, base)
        t0 = time.perf_counter()
        handle.migrator.move_request(handle, s.target, mode="migrate")
        out = handle.result()
        move_to_done_s = time.perf_counter() - t0

    # Uninterrupted runs of the same request, afterwards, from the same cached prefix.
    on_source = _generate(s.source, request)
    on_target = _generate(s.target, request)
    # What the migrator migrates: prompt + the tokens generated on the source, but the last.
    moved_ids = len(prompt) + len(out.segments[0].output_ids) - 1
    record(
        "request_running",
        {
            "page_size": PAGE_SIZE,
            "max_new_tokens": MAX_NEW_TOKENS,
            "source_used_base": base,
            "source_used_at_move": used_at_move,
            "move_to_done_s": move_to_done_s,
            "out": _summary(out),
            "expected_migrated_tokens": _aligned(moved_ids),
            "reference_source_output_ids": on_source["output_ids"],
            "reference_source_cached_details": cached_details(on_source),
            "reference_target_output_ids": on_target["output_ids"],
            "reference_target_cached_details": cached_details(on_target),
            "equals_source_reference": out.output_ids == on_source["output_ids"],
            "equals_target_reference": out.output_ids == on_target["output_ids"],
        },
    )
    first, second = out.segments
    (move,) = out.moves
    migration = move.migration
    # Which parts ran where.
    assert [(seg.server_url, seg.kind) for seg in out.segments] == [
        (s.source, "original"),
        (s.target, "migrated"),
    ]
    assert first.finish_reason["type"] == "abort"
    assert 0 < len(first.output_ids) < MAX_NEW_TOKENS
    assert len(first.output_ids) + len(second.output_ids) == MAX_NEW_TOKENS
    assert move.outcome == "migrated" and move.resumed_on == s.target, move
    assert move.generated_before_move == len(first.output_ids)
    # The whole output, as one request would have given it.
    assert out.prompt_ids == prompt
    assert len(out.output_ids) == MAX_NEW_TOKENS
    assert out.finish_reason == {"type": "length", "length": MAX_NEW_TOKENS}
    assert out.meta_info["completion_tokens"] == MAX_NEW_TOKENS
    assert out.output_ids == on_source["output_ids"]
    assert on_target["output_ids"] == on_source["output_ids"]
    # Prompt + generated tokens (all but the last) moved, and the target served them cached.
    assert migration is not None and migration.path in ("device", "host"), migration
    assert migration.migrated_token_size == _aligned(moved_ids), migration
    assert migration.matched_after_commit >= migration.migrated_token_size
    assert second.cached_tokens is not None
    assert second.cached_tokens >= migration.migrated_token_size


def test_queued_high_priority_request_moves(servers: Servers):
    """The source runs one request at a time; a high-priority request waits behind a long
    low-priority one, is moved while still queued (its cached history goes with it) and
    completes on the target. The request ahead of it is not disturbed."""
    s = servers
    rng = random.Random(20)
    history = _tokens(rng, PROMPT_TOKENS, s.vocab_size)  # an earlier turn, cached on source
    _warm(s.source, history)
    blocker = GenerateRequest(
        _tokens(rng, BLOCKER_PROMPT_TOKENS, s.vocab_size), _params(BLOCKER_NEW_TOKENS), priority=LOW
    )
    request = GenerateRequest(history, _params(QUEUED_NEW_TOKENS), priority=HIGH)

    with RequestMigrator() as migrator:
        blocking = migrator.submit(s.source, blocker)
        wait_for_value(
            lambda: kv_pool_usage(s.source)["num_running_reqs"], lambda n: n == 1, timeout_s=60
        )
        queued = migrator.submit(s.source, request)
        load_at_move = wait_for_value(
            lambda: kv_pool_usage(s.source),
            lambda u: u["num_waiting_reqs"] == 1 or queued.done(),
            timeout_s=60,
            interval_s=0.05,
        )
        queued.migrator.move_request(queued, s.target, mode="migrate")
        out = queued.result()
        blocker_out = blocking.result(timeout=600)

    reference = _generate(s.source, request)
    on_target = _generate(s.target, request)
    record(
        "request_queued",
        {
            "page_size": PAGE_SIZE,
            "source_load_at_move": load_at_move,
            "out": _summary(out),
            "expected_migrated_tokens": _aligned(len(history) - 1),
            "blocker": {k: v for k, v in _summary(blocker_out).items() if k != "output_ids"},
            "reference_source_output_ids": reference["output_ids"],
            "reference_target_output_ids": on_target["output_ids"],
            "equals_source_reference": out.output_ids == reference["output_ids"],
            "equals_target_reference": out.output_ids == on_target["output_ids"],
        },
    )
    first, second = out.segments
    (move,) = out.moves
    migration = move.migration
    assert load_at_move["num_waiting_reqs"] == 1 and load_at_move["num_running_reqs"] == 1
    # Queued: nothing was generated on the source.
    assert (first.server_url, first.kind, first.output_ids) == (s.source, "original", [])
    assert first.finish_reason["type"] == "abort"
    assert (second.server_url, second.kind) == (s.target, "migrated")
    assert move.outcome == "migrated" and move.generated_before_move == 0, move
    assert migration is not None
    assert migration.migrated_token_size == _aligned(len(history) - 1), migration
    assert second.cached_tokens is not None
    assert second.cached_tokens >= migration.migrated_token_size
    assert len(out.output_ids) == QUEUED_NEW_TOKENS
    assert out.finish_reason == {"type": "length", "length": QUEUED_NEW_TOKENS}
    assert out.output_ids == reference["output_ids"]
    assert on_target["output_ids"] == reference["output_ids"]
    # The low-priority request ahead of it ran to its end where it was.
    assert [(seg.server_url, seg.kind) for seg in blocker_out.segments] == [(s.source, "original")]
    assert len(blocker_out.output_ids) == BLOCKER_NEW_TOKENS


PHASE_ROUTES = {
    "allocate": "/allocate_token_for_transfer",
    "transfer": "/transfer_request_kvcache",
    "commit": "/commit",
}


@pytest.mark.parametrize(
    ("phase", "on_failure"),
    [("allocate", "target"), ("transfer", "target"), ("commit", "target"), ("commit", "source")],
)
def test_failed_migration_still_completes_the_request(
    servers: Servers, phase: str, on_failure: str
):
    """One migration route answers 503 (injected in the migration client's transport):
    the request resumes by re-prefill on the target (or on the source, whose cache still
    holds its KV) and completes with its whole output."""
    s = servers
    rng = random.Random(f"fallback-{phase}-{on_failure}")
    prompt = _tokens(rng, PROMPT_TOKENS, s.vocab_size)
    request = GenerateRequest(prompt, _params(MAX_NEW_TOKENS), priority=LOW)
    _warm(s.source, prompt)
    base = settled_used_tokens(s.source)

    transport = FailOn(PHASE_ROUTES[phase])
    client = MigrationClient(http_client=httpx.Client(transport=transport, timeout=120))
    with client, RequestMigrator(client) as migrator:
        handle = migrator.submit(s.source, request)
        _wait_generating(handle, s.source, base)
        handle.migrator.move_request(handle, s.target, mode="migrate", on_failure=on_failure)
        out = handle.result()

    reference = _generate(s.source, request)
    first_ids = out.segments[0].output_ids
    resumed_on = s.target if on_failure == "target" else s.source
    kind = "reprefill" if on_failure == "target" else "resumed_on_source"
    record(
        f"request_fallback_{phase}_{on_failure}",
        {
            "page_size": PAGE_SIZE,
            "calls": transport.paths,
            "injected_hits": transport.hits,
            "out": _summary(out),
            "reference_source_output_ids": reference["output_ids"],
            "equals_source_reference": out.output_ids == reference["output_ids"],
            "first_piece_equals_reference_prefix": first_ids
            == reference["output_ids"][: len(first_ids)],
        },
    )
    first, second = out.segments
    (move,) = out.moves
    assert transport.hits >= 1, transport.paths
    assert move.outcome == "fell_back" and move.resumed_on == resumed_on, move
    assert "injected failure" in move.failure, move.failure
    assert [(seg.server_url, seg.kind) for seg in out.segments] == [
        (s.source, "original"),
        (resumed_on, kind),
    ]
    assert 0 < len(first.output_ids) < MAX_NEW_TOKENS
    # The whole output, however it got there.
    assert len(out.output_ids) == MAX_NEW_TOKENS
    assert out.finish_reason == {"type": "length", "length": MAX_NEW_TOKENS}
    # The source's piece is the same computation as the reference: its tokens match.
    assert first.output_ids == reference["output_ids"][: len(first.output_ids)]
    if on_failure == "target":
        # Nothing was committed on the target: it recomputed the whole prefix.
        assert second.cached_tokens == 0, second.meta_info
    else:
        # The source still held the request's KV: prompt + generated (but the last) hit.
        assert second.cached_tokens == _aligned(len(prompt) + len(first.output_ids) - 1)
        assert out.output_ids == reference["output_ids"]


def _check_live_stages(
    stages: Any, prompt_len: int, generated_on_source: int, resumed_cached: int, mode: str
) -> None:
    """Stage 1 copies, while the request decodes, what its own slots hold then: the prompt
    and the tokens generated so far, whole pages only (feature running_slots). After the
    stop only pages beyond stage 1 are left: with mode "migrate" they move, and when the
    request made no new whole page there is nothing left to move; with "auto" the cost
    model leaves the few delta pages to the target."""
    stage1, delta = stages
    assert stage1.while_decoding and stage1.decision == "migrate", stages
    assert 0 < stage1.generated <= generated_on_source, stages
    assert stage1.migrated_tokens == stage1.held_tokens, stages
    upper = _aligned(prompt_len + generated_on_source)
    assert _aligned(prompt_len) <= stage1.held_tokens <= upper, stages
    assert not delta.while_decoding
    moved_ids = prompt_len + generated_on_source - 1
    left = _aligned(moved_ids) - stage1.held_tokens
    if mode == "migrate" and left > 0:
        assert delta.decision == "migrate" and delta.migrated_tokens == left, stages
        assert resumed_cached >= _aligned(moved_ids)
    else:
        assert delta.migrated_tokens == 0, stages
        assert mode == "auto" or left <= 0, stages
        assert resumed_cached >= stage1.held_tokens


@pytest.mark.parametrize("mode", ["migrate", "auto"])
def test_running_request_moves_live(servers: Servers, mode: str):
    """`live=True`: stage 1 copies the request's held pages while it keeps decoding on
    the source; after the stop the delta migrates (mode "migrate") or, priced by the
    default cost model (mode "auto"), is left to the target. The whole output equals an
    uninterrupted greedy run, and the report gives every stage and the stall."""
    s = servers
    rng = random.Random(f"live-{mode}")
    prompt = _tokens(rng, PROMPT_TOKENS, s.vocab_size)
    request = GenerateRequest(prompt, _params(MAX_NEW_TOKENS), priority=LOW)
    _warm(s.source, prompt)
    base = settled_used_tokens(s.source)

    with RequestMigrator() as migrator:
        handle = migrator.submit(s.source, request)
        _wait_generating(handle, s.source, base)
        handle.migrator.move_request(handle, s.target, mode=mode, live=True)
        out = handle.result()

    reference = _generate(s.source, request)
    on_target = _generate(s.target, request)
    (move,) = out.moves
    record(
        f"request_live_{mode}",
        {
            "page_size": PAGE_SIZE,
            "out": _summary(out),
            "stall_s": move.stall_s,
            "reference_source_output_ids": reference["output_ids"],
            "reference_target_output_ids": on_target["output_ids"],
            "equals_source_reference": out.output_ids == reference["output_ids"],
        },
    )
    first, second = out.segments
    assert [(seg.server_url, seg.kind) for seg in out.segments] == [
        (s.source, "original"),
        (s.target, "migrated"),
    ]
    assert move.live and move.outcome == "migrated", move
    _check_live_stages(move.stages, len(prompt), len(first.output_ids), second.cached_tokens, mode)
    assert move.stall_s is not None and 0 < move.stall_s < move.seconds["total"] + 5
    # The whole output, as one uninterrupted greedy run gave it.
    assert len(out.output_ids) == MAX_NEW_TOKENS
    assert out.finish_reason == {"type": "length", "length": MAX_NEW_TOKENS}
    assert out.output_ids == reference["output_ids"]
