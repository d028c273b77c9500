"""Soak: every round mixes the faults of the reliability issue, then checks the books.

Three CPU mini servers (real scheduler side, real HTTP with an admin key, signed grants,
real Mooncake TCP on 127.0.0.1): A and B migrate to each other; C has a 1 s watchdog.
Each round, all at once:

- concurrent migrations both ways (every other one with `verify`);
- aborts racing their transfer (abort sent while the transfer is in flight, with or
  without the source's receipts), and a commit after the abort that must not insert;
- bad inputs: malformed and incomplete bodies, a forged grant (the target's bytes are
  compared before and after), a grant for other slots, a replayed grant, commits without
  receipts or for unknown ids, an oversized id and an oversized body;
- commits racing C's watchdog (insert and keep, or 410 and leave nothing).

After every round, on every server: every host slot is free or held by exactly one tree
node once the quarantine windows closed (slots leaked = size - in tree - free), node
locks and host refs 0, device pool as before the round; and every prefix committed in
the round has, page for page, the source's bytes on the target (corrupted pages).

`KVMIG_SOAK_ROUNDS` (CI: 1) or `KVMIG_SOAK_SECONDS` (run rounds until the time is up)
set the length; the figures are printed (`-s`) and written to `KVMIG_SOAK_REPORT` if set.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import torch
from conftest import FAULT_PAIR_KEY
from mini_server import ServerHandle, ServerSpec, start_servers
from multi_rank import host_transfer_body
from sglang_kv_migration.client.migration import AsyncMigrationClient, MigrationFailed

PAGE = 16
KEY = FAULT_PAIR_KEY
AUTH = {"Authorization": f"Bearer {KEY}"}
ROUNDS = int(os.environ.get("KVMIG_SOAK_ROUNDS", "1"))
SECONDS = float(os.environ.get("KVMIG_SOAK_SECONDS", "0"))
PER_SIDE = 8  # concurrent migrations each way per round
ABORTS = 4  # aborts racing their transfer per round
RACES = 2  # commits racing C's watchdog per round


@pytest.fixture
def servers(fault_pair) -> Iterator[tuple[ServerHandle, ServerHandle, ServerHandle | None]]:
    """The fault suite's pair, plus C (1 s watchdog) for a real soak. CI's single round
    leaves C out: starting a server costs more than the round, and the fault suite's
    `test_commit_racing_the_watchdog_is_all_or_nothing` covers that race in CI."""
    a, b = fault_pair
    if not (ROUNDS > 1 or SECONDS):
        yield a, b, None
        return
    (c,) = start_servers([ServerSpec(admin_api_key=KEY, watchdog_timeout_s=1.0, grant_ttl_s=0.4)])
    try:
        yield a, b, c
    finally:
        c.stop()


def test_soak(servers) -> None:
    a, b, c = servers
    stats: Counter[str] = Counter()
    started = time.monotonic()
    rnd = 0
    while rnd < ROUNDS or (SECONDS and time.monotonic() - started < SECONDS):
        _round(rnd, a, b, c, stats, random.Random(rnd))
        rnd += 1
    stats["rounds"] = rnd
    stats["seconds"] = round(time.monotonic() - started)
    report = json.dumps(dict(sorted(stats.items())))
    print(f"soak: {report}")
    if os.environ.get("KVMIG_SOAK_REPORT"):
        with open(os.environ["KVMIG_SOAK_REPORT"], "w") as f:
            f.write(report + "\n")
    assert stats["slots_leaked"] == 0 and stats["stuck_locks"] == 0
    assert stats["corrupted_pages"] == 0 and stats["migrations_failed"] == 0


# --------------------------------------------------------------------------- one round


def _round(
    rnd: int,
    a: ServerHandle,
    b: ServerHandle,
    c: ServerHandle | None,
    stats: Counter[str],
    rng: random.Random,
) -> None:
    base = 1_000_000 * (rnd + 1)
    a_seqs = _seqs(base, PER_SIDE + ABORTS + RACES + 3)
    b_seqs = _seqs(base + 500_000, PER_SIDE)
    handles = [h for h in (a, b, c) if h is not None]
    for handle in handles:
        handle.ask(0, "evict_device")
    for i, seq in enumerate(a_seqs):
        a.ask(0, "insert", seq, rnd * 1000 + i)
    for i, seq in enumerate(b_seqs):
        b.ask(0, "insert", seq, rnd * 1000 + 500 + i)
    devices = {h.url: h.ask(0, "snapshot").device_available for h in handles}
    migrate_a, aborts = a_seqs[:PER_SIDE], a_seqs[PER_SIDE : PER_SIDE + ABORTS]
    races = a_seqs[PER_SIDE + ABORTS : PER_SIDE + ABORTS + RACES]
    bad = a_seqs[-3:]
    committed: list[tuple[ServerHandle, ServerHandle, list[int]]] = []

    async def everything() -> None:
        async with (
            AsyncMigrationClient(timeout=60.0, api_key=KEY) as client,
            httpx.AsyncClient(timeout=60.0, headers=AUTH) as http,
        ):
            jobs = [
                _migrate(client, a, b, s, i % 2 == 0, committed, stats)
                for i, s in enumerate(migrate_a)
            ]
            jobs += [
                _migrate(client, b, a, s, i % 2 == 1, committed, stats)
                for i, s in enumerate(b_seqs)
            ]
            jobs += [
                _abort_racing_transfer(http, a, b, s, i % 2 == 0, rng, stats)
                for i, s in enumerate(aborts)
            ]
            jobs += [
                _race_watchdog(http, a, c, s, i, rng, committed, stats)
                for i, s in enumerate(races if c is not None else [])
            ]
            jobs.append(_bad_inputs(http, a, b, bad, committed, stats))
            await asyncio.gather(*jobs)

    asyncio.run(everything())
    _check_books(handles, devices, stats)
    _check_bytes(committed, stats)


def _seqs(base: int, n: int) -> list[list[int]]:
    return [list(range(base + 1000 * i, base + 1000 * i + (2 + i % 3) * PAGE)) for i in range(n)]


# --------------------------------------------------------------------------- fault kinds


async def _migrate(client, source, target, seq, verify, committed, stats) -> None:
    try:
        result = await client.migrate(source.url, target.url, seq, verify=verify)
    except MigrationFailed as e:
        if _grant_expired(e.status_code, e.message):
            # Liveness, not safety: on a starved box the write queued past its grant's
            # deadline and was refused with nothing sent; it must leave nothing behind.
            assert sum(target.ask(0, "held", seq)) == 0
            stats["refused_grant_expired_under_load"] += 1
            return
        stats["migrations_failed"] += 1
        print(f"soak: migration failed: {e}")
        return
    assert result.migrated_token_size == len(seq)
    committed.append((source, target, seq))
    stats["migrations"] += 1
    stats["verified"] += verify


async def _abort_racing_transfer(http, source, target, seq, with_receipts, rng, stats) -> None:
    """Abort while the transfer is in flight; whatever won, a later commit inserts
    nothing and the slots come back (at once with settled receipts, else after the
    window)."""
    alloc, body = await _allocate(http, source, target, seq)
    transfer = asyncio.create_task(http.post(source.url + "/transfer_request_kvcache", json=body))
    await asyncio.sleep(rng.uniform(0.0, 0.01))
    aborted = await http.post(
        target.url + "/abort_transfer", json={"migration_id": alloc["migration_id"]}
    )
    assert aborted.status_code == 200, aborted.text
    reply = (await transfer).json()
    receipts = [r["receipt"] for r in reply.get("ranks", []) if r.get("receipt")]
    if with_receipts and receipts:
        again = await http.post(
            target.url + "/abort_transfer",
            json={"migration_id": alloc["migration_id"], "receipts": receipts},
        )
        assert again.status_code == 200, again.text
    commit = await http.post(
        target.url + "/commit", json={"migration_id": alloc["migration_id"], "receipts": receipts}
    )
    assert commit.status_code == 409, commit.text  # already aborted: never inserted
    held = target.ask(0, "held", seq)
    assert sum(held) == 0, held
    stats["aborts_mid_transfer"] += 1


async def _race_watchdog(http, source, target, seq, i, rng, committed, stats) -> None:
    """Commit around the target's 1 s watchdog: inserts and keeps, or 410 and nothing."""
    alloc, body = await _allocate(http, source, target, seq)
    reply = (await http.post(source.url + "/transfer_request_kvcache", json=body)).json()
    receipts = [r["receipt"] for r in reply.get("ranks", [])]
    await asyncio.sleep(0.3 + 0.5 * i + rng.uniform(0.0, 0.4))
    commit = await http.post(
        target.url + "/commit", json={"migration_id": alloc["migration_id"], "receipts": receipts}
    )
    held = sum(target.ask(0, "held", seq))
    if commit.status_code == 200:
        assert reply["success"] and held == len(seq), (reply, held)
        committed.append((source, target, seq))
        stats["watchdog_races_committed"] += 1
    else:
        # 410: the watchdog won; 403: the grant expired before the transfer started.
        assert commit.status_code in (403, 410), commit.text
        assert held == 0
        if commit.status_code == 403:
            await http.post(
                target.url + "/abort_transfer", json={"migration_id": alloc["migration_id"]}
            )
            stats["watchdog_races_grant_expired"] += 1
        else:
            stats["watchdog_races_expired"] += 1


async def _bad_inputs(http, source, target, seqs, committed, stats) -> None:
    """Every refusal is checked for its status; the target's bytes must not change."""

    async def expect(status: int, url: str, **kwargs) -> httpx.Response:
        r = await http.post(url, **kwargs)
        assert r.status_code == status, (url, r.status_code, r.text[:300])
        stats["bad_inputs"] += 1
        return r

    await expect(400, target.url + "/allocate_token_for_transfer", content=b"{not json")
    await expect(400, target.url + "/allocate_token_for_transfer", json={"input_ids": seqs[0]})
    await expect(400, target.url + "/commit", json={"migration_id": "x" * 100_000})
    await expect(404, target.url + "/commit", json={"migration_id": "no-such-migration"})
    huge = b'{"input_ids": [' + b"1," * (17 << 20) + b"1]}"
    await expect(
        413,
        target.url + "/get_request_extra_token_size",
        content=huge,
        headers={"content-type": "application/json"},
    )

    # A forged grant (signature changed) and a grant for other slots: 403, no byte moves.
    alloc, body = await _allocate(http, source, target, seqs[0])
    other, other_body = await _allocate(http, source, target, seqs[1])
    slots = alloc["ranks"][0]["kv_indices"]
    other_slots = other["ranks"][0]["kv_indices"]
    before = (target.ask(0, "slot_digest", slots), target.ask(0, "slot_digest", other_slots))
    forged = json.loads(json.dumps(body))
    grant = forged["target_per_rank"][0]["grant"]
    forged["target_per_rank"][0]["grant"] = grant[:-4] + (
        "0000" if grant[-4:] != "0000" else "1111"
    )
    await expect(403, source.url + "/transfer_request_kvcache", json=forged)
    mixed = json.loads(json.dumps(other_body))
    mixed["target_per_rank"][0]["grant"] = body["target_per_rank"][0]["grant"]
    await expect(403, source.url + "/transfer_request_kvcache", json=mixed)
    after = (target.ask(0, "slot_digest", slots), target.ask(0, "slot_digest", other_slots))
    assert after == before, "a refused transfer wrote into the target"
    stats["forged_or_mismatched_grants"] += 2

    # The real transfer, then its replay and a commit without receipts: 403.
    transfer = await http.post(source.url + "/transfer_request_kvcache", json=body)
    reply = transfer.json()
    if _grant_expired(transfer.status_code, reply.get("message", "")):
        stats["refused_grant_expired_under_load"] += 1  # see `_migrate`
        for mid in (alloc["migration_id"], other["migration_id"]):
            await http.post(target.url + "/abort_transfer", json={"migration_id": mid})
        return
    assert reply["success"], reply
    await expect(403, source.url + "/transfer_request_kvcache", json=body)
    mid = alloc["migration_id"]
    await expect(403, target.url + "/commit", json={"migration_id": mid})
    receipts = [r["receipt"] for r in reply["ranks"]]
    ok = await http.post(target.url + "/commit", json={"migration_id": mid, "receipts": receipts})
    assert ok.status_code == 200, ok.text
    committed.append((source, target, seqs[0]))
    aborted = await http.post(
        target.url + "/abort_transfer", json={"migration_id": other["migration_id"]}
    )
    assert aborted.status_code == 200, aborted.text


def _grant_expired(status: int | None, message: str) -> bool:
    return status == 403 and ("grant expired" in message or "deadline passed" in message)


async def _allocate(http, source, target, seq) -> tuple[dict, dict]:
    source_info = (await http.post(source.url + "/get_transfer_session_info")).json()
    target_info = (await http.post(target.url + "/get_transfer_session_info")).json()
    r = await http.post(
        target.url + "/allocate_token_for_transfer",
        json={
            "input_ids": seq,
            "source_fingerprints": [x["fingerprint"] for x in source_info["ranks"]],
            "source_instance": source_info["instance_id"],
        },
    )
    assert r.status_code == 200, r.text
    alloc = r.json()
    body = host_transfer_body(seq, alloc, target_info)
    return alloc, body


# --------------------------------------------------------------------------- the books


def _check_books(handles, devices, stats) -> None:
    for handle in handles:
        deadline = time.monotonic() + 30.0  # the longest write window is 9 s
        while True:
            slots = handle.ask(0, "host_slots")
            leaked = slots["size"] - slots["in_tree"] - slots["free"]
            if leaked == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        stats["slots_leaked"] += leaked
        stats["slots_held_twice"] += slots["in_tree"] - slots["in_tree_unique"]
        stats["slots_freed_twice"] += slots["free"] - slots["free_unique"]
        stats["slots_free_and_in_tree"] += slots["overlap"]
        snap = handle.ask(0, "snapshot")
        stats["stuck_locks"] += snap.total_lock_ref
        stats["stuck_host_refs"] += snap.total_host_ref
        stats["device_slots_changed"] += abs(snap.device_available - devices[handle.url])
    for name in ("slots_held_twice", "slots_freed_twice", "slots_free_and_in_tree"):
        assert stats[name] == 0, name
    assert stats["stuck_host_refs"] == 0 and stats["device_slots_changed"] == 0
    assert stats["slots_leaked"] == 0 and stats["stuck_locks"] == 0


def _check_bytes(committed, stats) -> None:
    """Page for page, what the target serves is what the source held."""
    for source, target, seq in committed:
        got, want = target.ask(0, "kv", seq), source.ask(0, "kv", seq)
        assert len(got) == len(want)
        bad_pages: set[int] = set()
        for g, w in zip(got, want, strict=True):
            differs = (_token_rows(g, len(seq)) != _token_rows(w, len(seq))).any(1)
            bad_pages.update((differs.nonzero().flatten() // PAGE).tolist())
        stats["pages_compared"] += len(seq) // PAGE
        stats["corrupted_pages"] += len(bad_pages)
    assert stats["corrupted_pages"] == 0


def _token_rows(kv: torch.Tensor, n: int) -> torch.Tensor:
    """One row of bytes per token (MHA layers come as (2, n, heads, dim))."""
    if kv.dim() == 4 and kv.shape[0] == 2 and kv.shape[1] == n:
        kv = kv.movedim(1, 0)
    return kv.contiguous().view(torch.uint8).reshape(n, -1)
