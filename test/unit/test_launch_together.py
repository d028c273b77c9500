"""The device path's sends launched together (`DevicePath.launching_together`): the
copies of the sends a scheduler iteration starts at once go in one launch per target.

Real DevicePath and HiRadixCache on CPU; only CUDA is replaced: the target's buffers are
"opened" as this pool's own (the sends copy into other slots of it), and the launch runs
the torch reference copy (`tiers.copy_plan_torch`, the Triton kernel's addressing) with
stand-in events whose elapsed time is one ms per page.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any

import pytest
import torch
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.paths.base import KVPoll, SendRange
from sglang_kv_migration.paths.device import tiers
from sglang_kv_migration.paths.device.path import DevicePath
from sglang_kv_migration.paths.device.source_side import DeviceSourceSide
from sglang_kv_migration.paths.device.tier_copies import CopyDestination, TierCopier
from sglang_kv_migration.paths.device.tier_source import Opening
from sglang_kv_migration.wire.messages import TransferRequestKVCacheTarget

PAGE = 16


class _Event:
    """A CUDA event stand-in: done at once, `at` ms into the copy."""

    def __init__(self, at: float):
        self.at = at

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _Event) -> float:
        return end.at - self.at


class _CpuSide(DeviceSourceSide):
    """The device source role with the target's buffers "opened" as this pool's own and
    the launch recorded (or refused), then run with the torch reference copy."""

    def __init__(self, cache: Any, copier: TierCopier, fail: bool):
        super().__init__(cache, copier)
        self.launches: list[tiers.TierPlan] = []
        self.fail = fail
        flats = [b.view(-1).view(torch.uint8) for b in copier.buffers]
        pages = int(copier.buffers[0].shape[0]) // copier.page_size
        self.opened = CopyDestination(flats=flats, pointers=None, page_limit=pages, key=1)
        self.opening: Future[CopyDestination] | None = None  # None: open at once
        self.used = False  # a copy went into the "mapping" (the real one keeps this)
        copier.launch = self._launch  # type: ignore[method-assign]

    def check_destination(self, send: SendRange) -> None:
        return None

    def open_destination(self, destination: Any) -> Opening:
        future = self.opening
        if future is None:
            future = Future()
            future.set_result(self.opened)
        return Opening(future, self._resolve)

    def _resolve(self, opened: CopyDestination) -> CopyDestination:
        first, self.used = not self.used, True
        return dataclasses.replace(opened, first_use=first)

    def _launch(self, plan: tiers.TierPlan, dst: CopyDestination) -> Any:
        self.launches.append(plan)
        if self.fail:
            raise MigrationError(ErrorKind.CONFLICT, "the copy kernel refused")
        copier = self.copier
        destination = tiers.TierBuffers.of_device(copier.buffers, copier.page_size)
        tiers.copy_plan_torch(plan, copier.source_tiers(), destination)
        at, events = 0.0, {}
        for tier, pages in plan.tiers.items():
            events[tier] = (_Event(at), _Event(at + pages.num_pages))
            at += pages.num_pages
        ordered = list(events.values())
        return ordered[0][0], ordered[-1][1], events


class _CpuSource(DevicePath):
    """A DevicePath whose GPU parts run on the CPU (see the module docstring)."""

    def __init__(self, cache: Any, fail: bool = False):
        super().__init__(cache)
        self.source = _CpuSide(cache, self.copier, fail)
        self.buffers = self.copier.buffers

    @property
    def launches(self) -> list[tiers.TierPlan]:
        return self.source.launches


def _moves(h: Any, path: DevicePath, pages: list[int]) -> list[tuple[SendRange, Any]]:
    """Prefixes of `pages[i]` pages on the source's GPU, each with its own target slots;
    returns each send and the KV it must land."""
    entry = TransferRequestKVCacheTarget(tp=0, pp=0, path="device", device_kv=path.advertise())
    moves = []
    for i, n in enumerate(pages):
        tokens = list(range(10_000 * (i + 1), 10_000 * (i + 1) + n * PAGE))
        kv = h.read_device_kv(h.insert_random(tokens, seed=i + 1))
        send = SendRange(tokens, None, 0, len(tokens), entry, h.allocator.alloc(len(tokens)), "m")
        moves.append((send, kv))
    return moves


def _landed(h: Any, send: SendRange, kv: list[torch.Tensor]) -> bool:
    got = h.read_device_kv(send.target_slots)
    return all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, kv, strict=True)
    )


def test_sends_started_together_launch_once_and_each_lands_its_own_pages(harness_factory):
    h = harness_factory(page_size=PAGE, layer_num=2)
    path = _CpuSource(h.cache)
    moves = _moves(h, path, [1, 2, 3])
    baseline_locks = h.snapshot().total_lock_ref
    with path.launching_together():
        jobs = [path.start_send(send) for send, _ in moves]
        assert path.launches == []  # queued, not launched
        assert all(job.poll() is KVPoll.TRANSFERRING for job in jobs)
    assert len(path.launches) == 1 and path.launches[0].num_pages == 6
    for (send, kv), job, pages in zip(moves, jobs, [1, 2, 3], strict=True):
        assert job.poll() is KVPoll.SUCCESS and job.started_writing
        assert _landed(h, send, kv)
        # Each send's share of the launch's 6 ms, by its bytes.
        assert job.stats.seconds == pytest.approx(6e-3 * pages / 6)
        assert job.stats.steps["copy_device"] == pytest.approx(6e-3 * pages / 6)
        job.release()
    assert h.snapshot().total_lock_ref == baseline_locks


def test_outside_the_block_every_send_launches_at_once(harness_factory):
    h = harness_factory(page_size=PAGE, layer_num=2)
    path = _CpuSource(h.cache)
    moves = _moves(h, path, [1, 2])
    jobs = [path.start_send(send) for send, _ in moves]
    assert len(path.launches) == 2
    for (send, kv), job in zip(moves, jobs, strict=True):
        assert job.poll() is KVPoll.SUCCESS and _landed(h, send, kv)
        job.release()


def test_a_send_released_before_the_launch_is_left_out(harness_factory):
    h = harness_factory(page_size=PAGE, layer_num=2)
    path = _CpuSource(h.cache)
    (kept, kept_kv), (dropped, dropped_kv) = _moves(h, path, [2, 1])
    before = h.read_device_kv(dropped.target_slots)
    with path.launching_together():
        kept_job = path.start_send(kept)
        dropped_job = path.start_send(dropped)
        dropped_job.release()  # e.g. its transfer failed before the block ended
    assert [plan.num_pages for plan in path.launches] == [2]
    assert kept_job.poll() is KVPoll.SUCCESS and _landed(h, kept, kept_kv)
    after = h.read_device_kv(dropped.target_slots)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    kept_job.release()


def test_a_failed_launch_fails_every_send_of_it_and_unpins(harness_factory):
    h = harness_factory(page_size=PAGE, layer_num=2)
    path = _CpuSource(h.cache, fail=True)
    moves = _moves(h, path, [1, 1])
    baseline_locks = h.snapshot().total_lock_ref
    with path.launching_together():
        jobs = [path.start_send(send) for send, _ in moves]
    for job in jobs:
        assert job.poll() is KVPoll.FAILED
        assert "the copy kernel refused" in job.error.message
        assert not job.started_writing
        job.release()
    assert h.snapshot().total_lock_ref == baseline_locks


def test_merge_plans_concatenates_each_tier_in_order():
    def plan(device: list[int], host: list[int]) -> tiers.TierPlan:
        parts, runs = {}, []
        for tier, pages in (("device", device), ("host", host)):
            if pages:
                t = torch.tensor(pages, dtype=torch.int64)
                parts[tier] = tiers.TierPages(t, t + 100)
                runs.append((tier, len(pages)))
        return tiers.TierPlan(page_size=PAGE, tiers=parts, runs=tuple(runs))

    merged = tiers.merge_plans([plan([1, 2], [7]), plan([3], []), plan([], [8, 9])])
    assert merged.tiers["device"].src_pages.tolist() == [1, 2, 3]
    assert merged.tiers["device"].dst_pages.tolist() == [101, 102, 103]
    assert merged.tiers["host"].src_pages.tolist() == [7, 8, 9]
    assert merged.num_pages == 6
    with pytest.raises(ValueError):
        tiers.merge_plans([])


class _OpeningSource(_CpuSource):
    """Its peer's buffers open only when the test says so (the opener thread's work)."""

    def __init__(self, cache: Any):
        super().__init__(cache)
        self.opening: Future[CopyDestination] = Future()
        self.source.opening = self.opening
        self.opened = self.source.opened


def test_a_send_waiting_for_its_peers_mapping_waits_on_a_helper_thread(harness_factory):
    """While the opener thread maps the peer's buffers, the scheduler must hand it the
    GIL (`on_helper_threads`): a spinning loop would give it one turn per 5 ms."""
    from types import SimpleNamespace

    from sglang_kv_migration.server.source.transfers import InflightTransfer, SourceTransfers

    h = harness_factory(page_size=PAGE)
    path = _OpeningSource(h.cache)
    [(send, kv)] = _moves(h, path, [2])
    job = path.start_send(send)
    inflight = InflightTransfer(request=None, path=path, send=send)  # type: ignore[arg-type]
    inflight.sending(job)
    transfers = SimpleNamespace(inflight=[inflight])
    assert job.waits_on_helper and SourceTransfers.on_helper_threads(transfers)  # type: ignore[arg-type]
    path.opening.set_result(path.opened)
    assert not job.waits_on_helper  # mapped: the copy needs no helper
    assert not SourceTransfers.on_helper_threads(transfers)  # type: ignore[arg-type]
    assert job.poll() is KVPoll.SUCCESS and _landed(h, send, kv)
    job.release()


def test_the_first_copy_into_a_kept_mapping_is_no_sample_of_the_routes_rates(harness_factory):
    """Its copy has taken up to 80 ms on the H200 whatever its size (a one-off): it
    reports no route (the cost model's rates), so its time counts as the send's fixed
    cost."""
    h = harness_factory(page_size=PAGE)
    path = _CpuSource(h.cache)
    jobs = []
    for send, _kv in _moves(h, path, [2, 3]):
        job = path.start_send(send)
        assert job.poll() is KVPoll.SUCCESS
        jobs.append(job)
    assert [j.first_into_mapping for j in jobs] == [True, False]
    assert jobs[0].stats.routes == {} and jobs[0].stats.seconds > 0
    assert set(jobs[1].stats.routes) == {"gpu_to_gpu"}
    for job in jobs:
        job.release()


def test_a_tiers_first_launch_is_no_sample_of_its_routes_rate(harness_factory):
    """A copy kernel's first launch in a process compiles it (or loads it from Triton's
    cache) inside the copy's events: 42 ms for 33 MB from the host tier on a fresh H200.
    The sends of that launch report no route for the tier; later launches do."""
    h = harness_factory(page_size=PAGE)
    path = _CpuSource(h.cache)
    path.source.used = True  # a mapping copied into before: only the kernel is cold
    first, second, third = _moves(h, path, [2, 1, 3])
    with path.launching_together():
        together = [path.start_send(first[0]), path.start_send(second[0])]
    later = path.start_send(third[0])
    jobs = [*together, later]
    assert all(job.poll() is KVPoll.SUCCESS for job in jobs)
    assert not any(job.first_into_mapping for job in jobs)
    assert [set(job.cold_tiers) for job in jobs] == [{tiers.DEVICE_TIER}] * 2 + [set()]
    assert [job.stats.routes for job in together] == [{}, {}]
    assert all(job.stats.seconds > 0 for job in jobs)  # the time still counts (fixed cost)
    assert set(later.stats.routes) == {"gpu_to_gpu"}
    for job in jobs:
        job.release()
