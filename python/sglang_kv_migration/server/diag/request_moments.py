"""Opt-in record of the moments a request passes through a server: where a live move's
stall and stop spend their time (a diagnosis aid, off by default; nothing is hooked
when off).

With `SGLANG_KV_MIGRATION_MOMENTS_DIR` set in a server's environment, the plugin hooks
(`plugin.py`, targets in `hook_targets.MOMENT_HOOK_TARGETS`), in every process of that
server, with or without ``--enable-kv-migration`` (so a server without the flag can be
timed the same way):

- the tokenizer manager's `abort_request`  -> ``tm_abort``    {rid}
- the scheduler's `abort_request`          -> ``abort_seen``  {rid, running, waiting,
  batch_size}: the scheduler read the abort (a running request still runs one step)
- the scheduler's `handle_generate_request` -> ``received``   {rid, tokens}
- the scheduler's `run_batch`              -> ``launched``    {mode, size, rids,
  extend_tokens, ms}: the batch's launch (with the overlap schedule it returns before the
  device finishes: ``ms`` is the host's cost of launching it, eager or a graph replay)
- the scheduler's `process_batch_result`   -> ``processed``   {mode, size, rids, ms}:
  waiting for the device's result, then the output (tokens, finishes, streaming)
- the radix cache's `cache_finished_req`   -> ``released``    {rid, tokens, finish, ms}:
  a finished or aborted request leaves the batch and its KV goes into the tree

Each record is one JSON line ``{"t": time.time() at the start, "pid", "event", ...}`` in
`<dir>/moments-<pid>.jsonl`, kept in memory and written by a daemon thread every
`FLUSH_S` (never on the scheduler thread; what was not written when the process is
killed is lost). `time.time()` is the clock of SGLang's own `meta_info` timestamps
(``--enable-metrics``) and of the request migrator's `MoveReport.moments`, so one move
reads as one line across the client and both servers of one host.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from sglang_kv_migration import sglang_adapter

logger = logging.getLogger(__name__)

ENV = "SGLANG_KV_MIGRATION_MOMENTS_DIR"
FLUSH_S = 0.25


def enabled() -> bool:
    """Whether this process records moments (the environment names a directory)."""
    return bool(os.environ.get(ENV))


class MomentLog:
    """One process's moments: `record` appends, a daemon thread writes them out."""

    def __init__(self, directory: Path, flush_s: float = FLUSH_S):
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"moments-{os.getpid()}.jsonl"
        self._pending: list[bytes] = []
        self._lock = threading.Lock()
        self._flush_s = flush_s
        self._writer = threading.Thread(target=self._run, name="kvmig-moments", daemon=True)
        self._writer.start()

    def record(self, event: str, at: float, **fields: Any) -> None:
        line = orjson.dumps({"t": at, "pid": os.getpid(), "event": event, **fields})
        with self._lock:
            self._pending.append(line + b"\n")

    def flush(self) -> None:
        with self._lock:
            lines, self._pending = self._pending, []
        if lines:
            with self.path.open("ab") as out:
                out.write(b"".join(lines))

    def _run(self) -> None:
        while True:
            time.sleep(self._flush_s)
            try:
                self.flush()
            except OSError:
                logger.exception("request moments: cannot write %s", self.path)


_log: MomentLog | None = None
_log_lock = threading.Lock()


def moment_log() -> MomentLog:
    """This process's log (made at its first record)."""
    global _log
    with _log_lock:
        if _log is None:
            _log = MomentLog(Path(os.environ[ENV]))
        return _log


def hook_table() -> list[tuple[str, Callable[..., Any]]]:
    """(target, AROUND hook) for every moment, in `plugin.py`'s registration order."""
    from sglang_kv_migration.sglang_adapter import hook_targets as upstream

    return [
        (upstream.TOKENIZER_ABORT_REQUEST, around_tokenizer_abort),
        (upstream.SCHEDULER_ABORT_REQUEST, around_abort_request),
        (upstream.SCHEDULER_HANDLE_GENERATE, around_handle_generate_request),
        (upstream.SCHEDULER_RUN_BATCH, around_run_batch),
        (upstream.SCHEDULER_PROCESS_RESULT, around_process_batch_result),
        (upstream.RADIX_CACHE_FINISHED_REQ, around_cache_finished_req),
    ]


# ------------------------------------------------------------------ hooks (AROUND)


def around_tokenizer_abort(original: Any, tokenizer: Any, *args: Any, **kwargs: Any) -> Any:
    at = time.time()
    rid = kwargs.get("rid", args[0] if args else "")
    _safely(lambda: moment_log().record("tm_abort", at, rid=str(rid)))
    return original(tokenizer, *args, **kwargs)


def around_abort_request(original: Any, scheduler: Any, abort: Any, *args: Any, **kw: Any) -> Any:
    at = time.time()

    def record() -> None:
        facts = sglang_adapter.abort_facts(scheduler, abort)
        moment_log().record("abort_seen", at, **dataclasses.asdict(facts))

    _safely(record)  # before the abort acts: what it found
    return original(scheduler, abort, *args, **kw)


def around_handle_generate_request(
    original: Any, scheduler: Any, request: Any, *args: Any, **kwargs: Any
) -> Any:
    at = time.time()

    def record() -> None:
        rid, tokens = sglang_adapter.generate_facts(request)
        moment_log().record("received", at, rid=rid, tokens=tokens)

    _safely(record)
    return original(scheduler, request, *args, **kwargs)


def around_run_batch(original: Any, scheduler: Any, batch: Any, *args: Any, **kw: Any) -> Any:
    at = time.time()
    result = original(scheduler, batch, *args, **kw)
    _record_batch("launched", at, batch)
    return result


def around_process_batch_result(
    original: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any
) -> Any:
    at = time.time()
    result = original(scheduler, batch, *args, **kwargs)
    _record_batch("processed", at, batch)
    return result


def around_cache_finished_req(original: Any, cache: Any, req: Any, *args: Any, **kw: Any) -> Any:
    at = time.time()
    result = original(cache, req, *args, **kw)
    ms = (time.time() - at) * 1e3

    def record() -> None:
        rid, tokens, finish = sglang_adapter.request_facts(req)
        moment_log().record("released", at, rid=rid, tokens=tokens, finish=finish, ms=ms)

    _safely(record)
    return result


# ------------------------------------------------------------------ helpers


def _record_batch(event: str, at: float, batch: Any) -> None:
    ms = (time.time() - at) * 1e3

    def record() -> None:
        facts = sglang_adapter.batch_facts(batch)
        if facts is not None:
            moment_log().record(event, at, ms=ms, **dataclasses.asdict(facts))

    _safely(record)


def _safely(record: Callable[[], None]) -> None:
    """A diagnosis record never fails the call it watches."""
    try:
        record()
    except Exception:  # noqa: BLE001 - logged; the scheduler's call goes on
        logger.exception("request moments: a record failed")
