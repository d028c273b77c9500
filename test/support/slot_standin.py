"""TEST STAND-IN: the `/generate` stand-in (`generate_standin.py`) decoding into real
token slots, as SGLang 0.5.12 does, for the live move's rounds from a running request's
own slots (feature "running_slots").

Each admitted request is a real SGLang `Req` in the mini scheduler's
``running_batch.reqs``, with a row of the real `ReqToTokenPool`: admission takes the
prefix the tree holds (host hits loaded back onto the device), allocates slots for the
rest of the prompt (page by page, seeded random KV) and inserts the prompt's whole pages
into the tree with those slots (``cache_unfinished_req``); each step writes the KV of
the last token into a fresh slot and appends the next token (``kv_committed_len``
counts the written positions plus the one in flight, as SGLang's
``prepare_for_decode``); a finished or aborted request inserts prompt + output[:-1]
with its own slots (``cache_finished_req``: what the tree already held is kept, the
duplicates and the unaligned tail are freed). So the tree and the running rows hold the
very same bytes, and pages migrated from either can be compared byte for byte. Each
server seeds its KV differently, so bytes equal on two servers were migrated, not
written alike.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
from fastapi import Request
from generate_standin import GenerateStandin, StandinConfig, _Req, standin_factory


def slot_standin_factory(config: StandinConfig) -> Any:
    """A picklable `ServerSpec.extension` building a `SlotStandin`."""
    return standin_factory(config, SlotStandin)


class SlotStandin(GenerateStandin):
    def __init__(self, config: StandinConfig, harness: Any):
        super().__init__(config, harness)
        self.scheduler: Any = None
        self.sglang_reqs: dict[str, Any] = {}  # rid -> Req
        self.locked: dict[str, Any] = {}  # rid -> the tree node its prompt is locked by
        # Each server writes KV of its own: equal bytes on two servers were migrated,
        # never computed alike.
        self._seed = config.seed * 7919 + (os.getpid() << 24)
        self._armed: set[str] = set()  # rids to finish once a copy starts
        self._armed_lock = threading.Lock()
        self._paths_wrapped = False

    def add_routes(self, app: Any) -> None:
        super().add_routes(app)

        @app.post("/standin/finish_during_copy", response_model=None)
        async def finish_during_copy(request: Request) -> Any:
            """Arm: the running request `rid` finishes right after the next copy of
            KV starts on this server, before that copy is seen done (a race the GPU's
            asynchronous copies open; the CPU's are synchronous)."""
            rid = str((await request.json())["rid"])
            with self._armed_lock:
                self._armed.add(rid)
            return {"armed": rid}

    def tick(self) -> None:
        migration = getattr(self.scheduler, "kv_migration", None)
        if migration is not None and not self._paths_wrapped:
            self._paths_wrapped = True
            for path in migration.paths.values():
                path.start_send = self._finishing_armed_after(path.start_send)
        super().tick()

    def _finishing_armed_after(self, start_send: Any) -> Any:
        def start_then_finish(send: Any) -> Any:
            job = start_send(send)
            with self._armed_lock:
                armed, self._armed = self._armed, set()
            for req in [r for r in self.running if r.rid in armed]:
                req.abort = True
                self._emit(req)  # its last step: aborted, its slots leave its row
            return job

        return start_then_finish

    def attach(self, scheduler: Any) -> None:
        """The mini scheduler whose running batch lists the running `Req`s."""
        self.scheduler = scheduler

    @property
    def pool(self) -> Any:
        return self.harness.cache.req_to_token_pool

    # -- the stand-in's steps, on real slots ---------------------------------------------

    def _step(self) -> None:
        for req in list(self.running):
            if not self.held(req):
                self._emit(req)
        self.waiting.sort(key=lambda r: (-r.priority, r.order))
        while self.waiting and len(self.running) < self.config.max_running:
            req = self.waiting.pop(0)
            if not self._admit(req):
                self.waiting.insert(0, req)
                break
            self.running.append(req)
            self._emit(req)

    def _admit(self, req: _Req) -> bool:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        sreq = Req(
            req.rid, "", list(req.input_ids), SamplingParams(max_new_tokens=req.max_new_tokens)
        )
        if self.pool.alloc([sreq]) is None:
            return False
        match = self.harness.match(req.input_ids)
        req.cached_tokens = len(match.device_indices) + match.host_hit_length
        # Host hits (a migration commits into the host pool) are loaded back onto the
        # device, as SGLang's scheduler does, never recomputed: a recomputed page would
        # hide a migrated one in the device tier.
        cached = self.harness.load_back(req.input_ids).to(torch.int64)
        self._write_row(sreq, 0, cached)
        self._extend(sreq, len(cached), len(req.input_ids))
        sreq.kv_committed_len = len(req.input_ids)
        self.sglang_reqs[req.rid] = sreq
        self.scheduler.running_batch.reqs.append(sreq)
        self._insert_own(sreq, list(req.input_ids), finished=False)
        return True

    def _emit(self, req: _Req) -> None:
        sreq = self.sglang_reqs[req.rid]
        if req.output_ids:  # this step's forward writes the last token's KV
            position = len(req.input_ids) + len(req.output_ids) - 1
            self._extend(sreq, position, position + 1)
            sreq.kv_committed_len = position + 1
        before = len(req.output_ids)
        super()._emit(req)
        sreq.output_ids = list(req.output_ids)
        if req not in self.running and len(req.output_ids) > before:
            self._finish(req, sreq)

    def _abort(self, rid: str) -> None:
        super()._abort(rid)  # waiting requests have no Req yet

    def _insert(self, token_ids: list[int]) -> None:
        """Finished requests go through `_finish`; nothing else inserts here."""

    def _finish(self, req: _Req, sreq: Any) -> None:
        tokens = list(req.input_ids) + list(req.output_ids[:-1])
        self._insert_own(sreq, tokens, finished=True)
        self.scheduler.running_batch.reqs.remove(sreq)
        sreq.kv_committed_freed = True
        self.pool.free(sreq)
        del self.sglang_reqs[req.rid]

    # -- slots ------------------------------------------------------------------------

    def _row(self, sreq: Any, end: int) -> torch.Tensor:
        return self.pool.req_to_token[sreq.req_pool_idx, :end].to(torch.int64)

    def _write_row(self, sreq: Any, start: int, slots: torch.Tensor) -> None:
        if len(slots):
            self.pool.req_to_token[sreq.req_pool_idx, start : start + len(slots)] = slots.to(
                self.pool.req_to_token.dtype
            )

    def _extend(self, sreq: Any, start: int, end: int) -> None:
        """Slots (and seeded random KV) for positions [start, end): a fresh page when a
        position begins one, else the next slot of the page already taken."""
        ps = self.harness.cfg.page_size
        for position in range(start, end):
            if position % ps == 0:
                page = self.harness.allocator.alloc(ps)
                if page is None:
                    raise RuntimeError("the stand-in's device pool is full")
                self._write_row(sreq, position, page)
            else:
                prior = int(self.pool.req_to_token[sreq.req_pool_idx, position - 1])
                self._write_row(sreq, position, torch.tensor([prior + 1]))
        slots = self._row(sreq, end)[start:end]
        if len(slots):
            self.harness._fill_random(slots, seed=self._seed + start)

    def _insert_own(self, sreq: Any, tokens: list[int], finished: bool) -> None:
        """Insert the whole pages of `tokens` with the request's own slots; what the tree
        held already stays, the request's duplicates of it are freed (its row then
        points at the tree's slots); when `finished`, the unaligned tail is freed too."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        cache, ps = self.harness.cache, self.harness.cfg.page_size
        aligned = len(tokens) - len(tokens) % ps
        row = self._row(sreq, len(tokens))
        if aligned:
            key = RadixKey(token_ids=tokens[:aligned], extra_key=None)
            cache.insert(InsertParams(key=key, value=row[:aligned].clone()))
            held = cache.match_prefix(MatchPrefixParams(key=key))
            tree = held.device_indices.to(torch.int64)
            own = row[: len(tree)]
            dup = own[own != tree]
            if len(dup):
                self.harness.allocator.free(_page_starts_only(dup, ps))
            self._write_row(sreq, 0, tree)
            old = self.locked.pop(sreq.rid, None)
            if not finished:
                cache.inc_lock_ref(held.last_device_node)
                self.locked[sreq.rid] = held.last_device_node
            if old is not None:
                cache.dec_lock_ref(old)
        elif finished and sreq.rid in self.locked:
            cache.dec_lock_ref(self.locked.pop(sreq.rid))
        self.harness.write_back_all()
        if finished and len(tokens) > aligned:  # the unaligned tail's page
            self.harness.allocator.free(self._row(sreq, len(tokens))[aligned : aligned + 1])


def _page_starts_only(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """The paged allocator frees whole pages by any slot of them: one slot per page."""
    pages = torch.unique(slots // page_size)
    return pages * page_size
