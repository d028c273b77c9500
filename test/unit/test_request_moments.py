"""The opt-in request moments (`server/diag/request_moments.py`) and what they read
(`sglang_adapter/request_facts.py`), against real SGLang 0.5.12 classes on CPU: a real
`Req` in a real `HiRadixCache` released by SGLang's own `cache_finished_req`, real
`AbortReq` / `TokenizedGenerateReqInput` / `ScheduleBatch` objects, and the plugin's
registration in a fresh interpreter with and without the environment variable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from sglang_kv_migration.server.diag import request_moments as moments

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def log_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process records into `tmp_path` (a fresh log; no writer thread left behind
    writes into another test's directory: each log writes to its own path)."""
    monkeypatch.setenv(moments.ENV, str(tmp_path))
    monkeypatch.setattr(moments, "_log", None)
    return tmp_path


def _records(directory: Path) -> list[dict]:
    moments.moment_log().flush()
    lines = (directory / f"moments-{os.getpid()}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _req(rid: str, prompt: list[int], output: list[int]):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid, "", list(prompt), SamplingParams(max_new_tokens=64))
    req.output_ids = list(output)
    return req


def test_released_records_sglangs_own_release_of_an_aborted_request(
    harness_factory, log_dir, monkeypatch
):
    """The hook runs SGLang's `cache_finished_req` (the tree then holds the request's
    whole pages) and records the rid, its length, the finish and how long it took."""
    import sglang.srt.server_args as sglang_server_args
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.mem_cache.radix_cache import RadixCache

    h = harness_factory(attention="mha", page_size=16)
    # A request's release reads the scheduler's global arguments, as in a scheduler.
    monkeypatch.setattr(sglang_server_args, "_global_server_args", h.server_args)
    tokens = list(range(500, 540))  # 40 tokens: two whole pages and a partial one
    req = _req("moved-1", tokens[:30], tokens[30:])
    pool = h.cache.req_to_token_pool
    assert pool.alloc([req]) is not None
    slots = h.allocator.alloc(48)[: len(tokens)]
    pool.req_to_token[req.req_pool_idx, : len(tokens)] = slots.to(pool.req_to_token.dtype)
    req.kv_committed_len = len(tokens)
    req.finished_reason = FINISH_ABORT()
    assert len(h.match(tokens).device_indices) == 0

    moments.around_cache_finished_req(RadixCache.cache_finished_req, h.cache, req)

    assert len(h.match(tokens).device_indices) == 32  # SGLang's release ran
    (released,) = [r for r in _records(log_dir) if r["event"] == "released"]
    assert released["rid"] == "moved-1" and released["tokens"] == 40
    assert released["finish"] == "abort" and released["ms"] >= 0
    assert released["pid"] == os.getpid()


def test_abort_seen_says_whether_the_abort_found_its_request(log_dir):
    from sglang.srt.managers.io_struct import AbortReq

    running = _req("abc-1", [1, 2, 3], [4])
    queued = _req("xyz-1", [5, 6], [])
    scheduler = SimpleNamespace(
        running_batch=SimpleNamespace(reqs=[running]), last_batch=None, waiting_queue=[queued]
    )
    seen: list[object] = []

    def original(sched, abort):
        seen.append(abort)
        return "done"

    assert moments.around_abort_request(original, scheduler, AbortReq(rid="abc")) == "done"
    moments.around_abort_request(original, scheduler, AbortReq(rid="xyz"))
    moments.around_abort_request(original, scheduler, AbortReq(rid="nope"))
    assert [a.rid for a in seen] == ["abc", "xyz", "nope"]  # each abort went on as asked
    found = [r for r in _records(log_dir) if r["event"] == "abort_seen"]
    assert [(r["rid"], r["running"], r["waiting"]) for r in found] == [
        ("abc", True, False),
        ("xyz", False, True),
        ("nope", False, False),
    ]
    assert all(r["batch_size"] == 1 and not r["abort_all"] for r in found)


def test_batches_and_received_requests_are_recorded(log_dir):
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams

    reqs = [_req(f"r{i}", [1, 2, 3], [4]) for i in range(20)]
    decode = ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.DECODE)
    extend = ScheduleBatch(reqs=reqs[:1], forward_mode=ForwardMode.EXTEND)
    extend.extend_num_tokens = 17
    scheduler = SimpleNamespace()
    assert moments.around_run_batch(lambda s, b: "result", scheduler, decode) == "result"
    moments.around_process_batch_result(lambda s, b, r: None, scheduler, extend, "result")
    moments.around_run_batch(lambda s, b: None, scheduler, None)  # an idle iteration
    request = TokenizedGenerateReqInput(
        input_text="", input_ids=list(range(33)), mm_inputs=None,
        sampling_params=SamplingParams(), return_logprob=False, logprob_start_len=-1,
        top_logprobs_num=0, token_ids_logprob=None, stream=True, rid="resumed-1",
    )  # fmt: skip
    moments.around_handle_generate_request(lambda s, r: None, scheduler, request)
    got = {r["event"]: r for r in _records(log_dir)}
    assert set(got) == {"launched", "processed", "received"}
    launched = got["launched"]
    assert launched["mode"] == "decode" and launched["size"] == 20
    assert launched["rids"] == [f"r{i}" for i in range(16)]  # the first 16 of 20
    assert launched["extend_tokens"] is None
    processed = got["processed"]
    assert (processed["mode"], processed["size"], processed["extend_tokens"]) == ("extend", 1, 17)
    assert got["received"]["rid"] == "resumed-1" and got["received"]["tokens"] == 33


def test_a_failing_record_never_fails_the_call(log_dir, caplog):
    """What the hook reads is wrong (no running batch): the call still runs and returns."""
    from sglang.srt.managers.io_struct import AbortReq

    result = moments.around_abort_request(lambda s, a: "went on", object(), AbortReq(rid="r"))
    assert result == "went on"
    assert "a record failed" in caplog.text


def test_the_writer_thread_writes_without_a_flush(tmp_path):
    log = moments.MomentLog(tmp_path, flush_s=0.01)
    log.record("tm_abort", 1.5, rid="r1")
    path = tmp_path / f"moments-{os.getpid()}.jsonl"
    from timing import wait_until

    assert wait_until(lambda: path.exists() and path.read_text().strip(), 10.0, interval_s=0.01)
    assert json.loads(path.read_text()) == {
        "t": 1.5, "pid": os.getpid(), "event": "tm_abort", "rid": "r1"
    }  # fmt: skip


_REGISTER = """
import cpu_harness
cpu_harness.install_cpu_shims()
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang_kv_migration.server import plugin
from sglang_kv_migration.sglang_adapter import hook_targets as upstream
plugin.register()
counts = [len(HookRegistry._hooks[t]) for t in upstream.MOMENT_HOOK_TARGETS]
HookRegistry.apply_hooks()
print("COUNTS", counts, "MISSING", plugin.missing_hooks())
"""


@pytest.mark.parametrize("on", [True, False])
def test_the_plugin_hooks_the_moments_only_when_asked(tmp_path: Path, on: bool) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO / "python"), str(REPO / "test" / "support"), os.environ.get("PYTHONPATH", "")]
    )}  # fmt: skip
    env.pop(moments.ENV, None)
    if on:
        env[moments.ENV] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", _REGISTER], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    expected = [1] * 6 if on else [0] * 6
    assert line == f"COUNTS {expected} MISSING []", line


def test_the_moments_are_hooked_on_the_0_5_12_line_only() -> None:
    """What they read (`request_facts.py`) is 0.5.12's requests and batches."""
    from sglang_kv_migration.sglang_adapter import hook_targets as upstream
    from sglang_kv_migration.sglang_adapter.installed import HIRADIX_LINE, UNIFIED_LINE

    assert upstream.moment_hook_targets(HIRADIX_LINE) == upstream.MOMENT_HOOK_TARGETS
    assert upstream.moment_hook_targets(UNIFIED_LINE) == ()
    assert len(set(upstream.MOMENT_HOOK_TARGETS)) == len(moments.hook_table()) == 6
