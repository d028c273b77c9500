"""The source role of a path that copies a send's pages from where they lie on this
server (its GPU, or its pinned host pool read in place) into a destination on the same
host: the device path (the target's GPU, `source_side.py`) and the host landing (the
target's host pool, `paths/shared_host/`). A subclass says where the bytes go
(`open_destination`); the rest is this class's:

    start_send  match the prefix by tier (or take what `prepare_send` matched), plan the
                pages, open the destination (off this thread when it must be mapped
                first), pin the source pages, then launch the copy once the
                destination is open (`TierSendJob.poll_launch`)
    poll        the copy's end event, then the verify digest if one was asked for
    release     unpin (after the copy)

Sends started inside `launching_together` queue their copies and launch them when the
block ends: one launch per tier for all the sends into one destination.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.errors import ErrorKind, MigrationError
from sglang_kv_migration.paths.base import NothingWritten, SendJob, SendRange
from sglang_kv_migration.paths.device import tiers
from sglang_kv_migration.paths.device.send_job import TierSendJob
from sglang_kv_migration.paths.device.source_prefix import (
    PreparedPrefix,
    TierPin,
    prepare_tiered_send,
)
from sglang_kv_migration.paths.device.tier_copies import CopyDestination, TierCopier, launch_error

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache


@dataclass
class Opening:
    """A destination being opened for one send: `future` is done once it is mapped (at
    once when it was already), `resolve` checks the result on the scheduler thread and
    gives what the copy writes."""

    future: Future[Any]
    resolve: Callable[[Any], CopyDestination]
    into_landing: bool = False  # a landing arena (the target copies the rows again)


@dataclass
class _QueuedLaunch:
    """A send's copy, queued by `TierSource.launching_together`."""

    plan: tiers.TierPlan
    dst: CopyDestination
    job: TierSendJob


class TierSource(abc.ABC):
    """See the module docstring."""

    def __init__(self, cache: HiRadixCache, copier: TierCopier, tier_routes: Mapping[str, str]):
        self.cache = cache
        self.copier = copier
        self.page_size = copier.page_size
        self.tier_routes = dict(tier_routes)
        # Inside `launching_together`: the launches its sends queued (None outside).
        self._together: list[_QueuedLaunch] | None = None

    @abc.abstractmethod
    def close(self) -> None:
        """Let go of the destinations opened so far (peers' buffers or pools). Idempotent."""

    @abc.abstractmethod
    def check_destination(self, send: SendRange) -> Any:
        """The send's destination (its target entry: hostile input) parsed, before
        anything is matched or pinned; raises MigrationError naming what is wrong."""

    @abc.abstractmethod
    def open_destination(self, destination: Any) -> Opening:
        """Check what `check_destination` returned against this source (raises
        MigrationError) and start opening it; called once the send is known to write."""

    @property
    def host_tier_refusal(self) -> str:
        """Why host-only pages cannot be sent from here ("" when they can)."""
        return self.copier.host_refusal

    # ------------------------------------------------------------------ sends

    def start_send(self, send: SendRange) -> SendJob:
        destination = self.check_destination(send)
        started = time.perf_counter()
        prepared = send.prepared if isinstance(send.prepared, PreparedPrefix) else None
        if prepared is not None and (send.source_slots is not None or not prepared.serves(send)):
            prepared = None  # matched less than this send asks: match again
        tiered = prepare_tiered_send(
            self.cache, send, self.page_size, prepared.prefix if prepared else None
        )
        if tiered is None:
            return NothingWritten(send.start)
        owned = tiered.send.owned_page_positions(tiered.plan.num_pages)
        if owned is not None:  # owner-sharded CP: this rank copies only its own pages
            if not owned:
                return NothingWritten(tiered.send.end)
            tiered = dataclasses.replace(tiered, plan=tiers.owned_part(tiered.plan, owned))
        matched = time.perf_counter()
        send, plan = tiered.send, tiered.plan
        opening = self.open_destination(destination)
        if plan.tokens(tiers.HOST_TIER) and self.copier.host is None:
            raise MigrationError(
                ErrorKind.CONFLICT,
                f"source holds {plan.tokens(tiers.HOST_TIER)} of the tokens on host only "
                f"and cannot read its host pool in place ({self.copier.host_refusal}): use "
                "the host path",
            )
        pin = prepared.take_pin() if prepared else TierPin.take(self.cache, tiered.prefix)
        job = self._job(pin, send, plan, opening)
        try:
            job.poll_launch()
        except BaseException:
            job.release()
            raise
        # The handler's own time (the reply's steps): the radix match and plan, then
        # the checks, the pin and the copy's launch (the mapping's open, if it ran here).
        job.stats.steps["match"] = matched - started
        job.stats.steps["launch"] = time.perf_counter() - matched
        if prepared is not None:  # done while the target allocated
            job.stats.steps["prepare"] = prepared.seconds
        return job

    def _job(
        self, pin: TierPin, send: SendRange, plan: tiers.TierPlan, opening: Opening
    ) -> TierSendJob:
        copier = self.copier
        job = TierSendJob(pin, self.tier_routes)
        job.end = send.end
        job.stats.bytes = plan.num_pages * self.page_size * copier.bytes_per_token
        job.tier_bytes = {t: plan.tokens(t) * copier.bytes_per_token for t in plan.tiers}
        job.into_landing = opening.into_landing
        if send.verify:
            job.digest_pieces = copier.digest_pieces(plan)

        def launch() -> None:
            # On the scheduler thread, once the destination is open (at once when it
            # was already): checks the mapping, then only enqueues the copy.
            if time.time() > send.start_by:
                raise MigrationError(
                    ErrorKind.FORBIDDEN,
                    "copy refused: the grant expired while the target's buffers were being "
                    "opened; nothing was written",
                )
            dst = opening.resolve(opening.future.result())
            job.first_into_mapping = dst.first_use and not job.into_landing
            if self._together is not None:  # launched with the others at the block's end
                self._together.append(_QueuedLaunch(plan, dst, job))
                job.queue_launch()
                return
            job.cold_tiers = copier.cold_tiers(plan)
            job.launched(*copier.launch(plan, dst))

        job.launch_when(opening.future, launch)
        return job

    @contextlib.contextmanager
    def launching_together(self) -> Iterator[None]:
        """Sends started inside launch their copies when the block ends: one launch per
        tier for all the sends into one destination (each launch costs ~1 ms of a
        server's scheduler thread, where its torch and CUDA calls run cold), not one
        each."""
        if self._together is not None:
            yield  # nested: the outer block launches
            return
        self._together = []
        try:
            yield
        finally:
            queued, self._together = self._together, None
            self._launch_queued(queued)

    def prepare_send(self, input_ids: list[int], extra_key: str | None) -> PreparedPrefix:
        """The radix match of the whole of `input_ids`, pinned: what `start_send` of any
        prefix of it reads (the target's answer says from where)."""
        started = time.perf_counter()
        prefix = sglang_adapter.match_tiered_prefix(self.cache, input_ids, extra_key)
        pin = TierPin.take(self.cache, prefix)
        try:
            # The device slots' GPU sync now, not once the target answered.
            prefix.segments = tiers.segments_on_host(prefix.segments)
        except BaseException:
            pin.release()
            raise
        prepared = PreparedPrefix(input_ids, extra_key, prefix, pin)
        prepared.seconds = time.perf_counter() - started
        return prepared

    def _launch_queued(self, queued: list[_QueuedLaunch]) -> None:
        """Launch what `launching_together` queued: per destination, one launch of all
        its sends' pages. Sends released meanwhile are left out (their pages are
        unpinned)."""
        groups: dict[int, list[_QueuedLaunch]] = {}
        for q in queued:
            if not q.job.released:
                groups.setdefault(q.dst.key, []).append(q)
        copier = self.copier
        for group in groups.values():
            started = time.perf_counter()
            plans = [q.plan for q in group]
            try:
                plan = tiers.merge_plans(plans) if len(plans) > 1 else plans[0]
                cold = copier.cold_tiers(plan)
                events = copier.launch(plan, group[0].dst)
            except Exception as e:  # every send of the group fails; none may be copying
                copier.synchronize()
                for q in group:
                    q.job.launch_failed(launch_error(e))
                continue
            seconds = time.perf_counter() - started
            tier_bytes = {t: plan.tokens(t) * copier.bytes_per_token for t in plan.tiers}
            for q in group:
                q.job.cold_tiers = cold
                q.job.launched(*events, group_tier_bytes=tier_bytes if len(group) > 1 else None)
                q.job.stats.steps["launch"] = q.job.stats.steps.get("launch", 0.0) + seconds
