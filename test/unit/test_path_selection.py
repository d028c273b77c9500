"""The client's choice of data path from the two servers' session info and the size query.

Same host: the device path, whatever tier the source holds the prefix in, when every
source rank advertises that it reads its host pool in place (`tiers` lists "host");
a source that does not (older servers, an unpinned or page_head host pool) keeps the
old rule and falls back to the host path for host-only tokens, saying why. Auto tries
the paths in turn: the target's GPU, its host tier through shared memory, the host path.
"""

from __future__ import annotations

import orjson
import pytest
from sglang_kv_migration.client.path_choice import path_order
from sglang_kv_migration.client.plan import choose_path
from sglang_kv_migration.wire.messages import ExtraTokenSizeReply, RankSessionInfo, SessionInfoReply


def _info(host: str, tiers: list[str] | None, ranks: int = 1) -> SessionInfoReply:
    device = {"host_identity": host}
    if tiers is not None:
        device["tiers"] = tiers
    return SessionInfoReply(
        success=True,
        ranks=[
            RankSessionInfo(r, 0, 1, {}, paths={"device": dict(device), "host": {}})
            for r in range(ranks)
        ],
    )


HOST_ONLY = ExtraTokenSizeReply(success=True, matched_token_size=16000, device_token_size=0)
ON_DEVICE = ExtraTokenSizeReply(success=True, matched_token_size=16000, device_token_size=16000)


def test_device_path_for_host_held_prefix_when_the_source_reads_its_host_pool():
    source, target = _info("h1", ["device", "host"], ranks=2), _info("h1", ["device"])
    assert choose_path(None, source, target, HOST_ONLY) == ("device", "")
    assert choose_path("auto", source, target, ON_DEVICE) == ("device", "")


def test_host_path_with_a_reason_when_a_source_rank_reads_device_pages_only():
    source = _info("h1", ["device", "host"], ranks=2)
    source.ranks[1].paths["device"]["tiers"] = ["device"]
    path, reason = choose_path(None, source, _info("h1", None), HOST_ONLY)
    assert path == "host" and "16000 of the tokens on host only" in reason
    # An older source (no `tiers`) on one host: device pages still take the device path.
    assert choose_path(None, _info("h1", None), _info("h1", None), ON_DEVICE) == ("device", "")


def test_other_host_takes_the_host_path_whatever_the_tier():
    path, reason = choose_path(None, _info("h1", ["device", "host"]), _info("h2", None), ON_DEVICE)
    assert path == "host" and reason.startswith("servers are on different hosts")


def _compat_info(page_size: int) -> SessionInfoReply:
    from sglang_kv_migration import PROTOCOL_VERSION
    from sglang_kv_migration.fingerprint import KVCacheShape, LayoutFingerprint

    shape = KVCacheShape("bfloat16", "mha", 0, 2, 2, 16, 0, 0, page_size, "layer_first")
    fingerprint = LayoutFingerprint(PROTOCOL_VERSION, "m", shape, 1, 0, 1, 0).to_dict()
    rank = RankSessionInfo(0, 0, page_size, fingerprint)
    return SessionInfoReply(success=True, ranks=[rank], protocol_version=PROTOCOL_VERSION)


def test_the_compatibility_check_is_kept_per_pair_of_infos_until_one_is_replaced(monkeypatch):
    from sglang_kv_migration.client import sessions as client_sessions
    from sglang_kv_migration.client.migration import MigrationFailed, SessionCache

    checked: list[tuple[SessionInfoReply, SessionInfoReply]] = []
    real = client_sessions._check_compatible

    def counting(source: SessionInfoReply, target: SessionInfoReply) -> None:
        checked.append((source, target))
        real(source, target)

    monkeypatch.setattr(client_sessions, "_check_compatible", counting)
    sessions = SessionCache()
    source, target = _compat_info(16), _compat_info(16)
    sessions.put("http://s", source)
    sessions.put("http://t", target)
    sessions.check_compatible(source, target)
    sessions.check_compatible(source, target)
    assert len(checked) == 1  # the same pair: checked once
    restarted = _compat_info(64)  # the target came back with another layout
    sessions.put("http://t", restarted)
    try:
        sessions.check_compatible(source, restarted)
    except MigrationFailed as e:
        assert "page_size" in str(e)
    else:
        raise AssertionError("a changed layout passed the check")
    sessions.check_compatible(source, target)  # memos were dropped with the put
    assert len(checked) == 3


# --------------------------------------------------------------------------- auto, in turn
#
# The whole protocol generator (`migration_steps`) against two scripted servers on one
# host: every call it makes is answered as a real server would, so what is asked of which
# server on which path, and what the result says, are the client's own.

SHM = {"host_identity": "h1", "tiers": ["device", "host"], "pid": 1}
GPU_FULL = "device KV pool is full: 8208 token slots needed, 6400 free and 0 evictable"


def _server(host: str, paths: tuple[str, ...], name: str) -> SessionInfoReply:
    info = _compat_info(16)
    advertised = {
        "device": {"host_identity": host, "tiers": ["device", "host"]},
        "shared_host": {**SHM, "host_identity": host},
        "host": {"session_id": f"{name}:1"},
    }
    rank = info.ranks[0]
    rank.paths = {p: dict(advertised[p]) for p in paths}
    rank.session_id, rank.host_kv_data_ptrs = f"{name}:1", [4096]
    rank.host_kv_data_lens, rank.host_kv_item_lens = [1 << 20], [64]
    info.instance_id, info.server_epoch = name, f"{name}-epoch"
    return info


class _Scripted:
    """Answers the client's calls; `refuse[path]`: the allocate on that path fails so."""

    def __init__(self, refuse: dict[str, tuple[int, str]]):
        self.refuse = refuse
        self.calls: list[tuple[str, str, dict]] = []  # (phase, url, body)

    def answer(self, call) -> tuple[int, dict]:
        from sglang_kv_migration.client.calls import encode

        body = orjson.loads(encode(call.body)) if call.body is not None else {}
        self.calls.append((call.phase, call.url, body))
        if call.phase == "extra_token_size":
            return 200, {"success": True, "matched_token_size": 8192, "device_token_size": 8192,
                         "total_token_size": 8192, "server_epoch": "s-epoch"}  # fmt: skip
        if call.phase == "allocate":
            if body["path"] in self.refuse:
                status, message = self.refuse[body["path"]]
                return status, {"success": False, "message": message, "error_kind": "unavailable"}
            rank = {"tp_rank": 0, "pp_rank": 0, "kv_indices": [], "kv_pages": list(range(512)),
                    "grant": "g"}  # fmt: skip
            reply = {"success": True, "migration_id": f"m-{body['path']}", "ranks": [rank],
                     "matched_token_size": 0, "extra_token_size": 8192, "path": body["path"],
                     "page_size": 16, "server_epoch": "t-epoch"}  # fmt: skip
            return 200, reply
        if call.phase == "transfer":
            return 200, {"success": True, "transferred_token_size": 8192,
                         "transferred_bytes": 8192 * 64,
                         "ranks": [{"tp_rank": 0, "pp_rank": 0, "success": True,
                                    "receipt": "r"}]}  # fmt: skip
        if call.phase == "commit":
            return 200, {"success": True, "matched_after_commit": 8192}
        return 200, {"success": True}  # abort

    def allocated_paths(self) -> list[str]:
        return [body["path"] for phase, _url, body in self.calls if phase == "allocate"]


def _migrate(
    source: SessionInfoReply,
    target: SessionInfoReply,
    server: _Scripted,
    path: str | None = None,
):
    from sglang_kv_migration.client.migration import SessionCache
    from sglang_kv_migration.client.steps import migration_steps

    sessions = SessionCache()
    sessions.put("http://s", source)
    sessions.put("http://t", target)
    steps = migration_steps("http://s", "http://t", list(range(8200)), None, path, sessions)
    try:
        call = next(steps)
        for _ in range(32):  # bounded: a migration makes a handful of calls
            call = steps.send(server.answer(call))
    except StopIteration as done:
        return done.value
    raise AssertionError("the migration did not end")


def test_a_full_gpu_pool_lands_in_the_targets_host_tier_through_shared_memory():
    paths = ("device", "shared_host", "host")
    source, target = _server("h1", paths, "s"), _server("h1", paths, "t")
    server = _Scripted({"device": (503, GPU_FULL)})
    result = _migrate(source, target, server)
    assert server.allocated_paths() == ["device", "shared_host"]  # never the host path
    transfer = next(body for phase, _u, body in server.calls if phase == "transfer")
    entry = transfer["target_per_rank"][0]
    assert entry["path"] == "shared_host" and entry["shared_host_kv"]["pid"] == 1
    assert "session_id" not in entry or not entry["session_id"]
    assert (result.path, result.landing_tier) == ("shared_host", "host")
    assert "device path failed at allocate" in result.fallback_reason
    assert GPU_FULL in result.fallback_reason
    assert result.migrated_token_size == 8192 and result.matched_after_commit == 8192


def test_with_room_on_the_gpu_the_device_path_lands_it_there():
    paths = ("device", "shared_host", "host")
    server = _Scripted({})
    result = _migrate(_server("h1", paths, "s"), _server("h1", paths, "t"), server)
    assert server.allocated_paths() == ["device"]
    assert (result.path, result.landing_tier, result.fallback_reason) == ("device", "gpu", "")


def test_the_host_path_comes_last_and_says_why_each_before_it_failed():
    paths = ("device", "shared_host", "host")
    full_host = "host pool is full: 8192 token slots needed, 0 free and 0 evictable"
    server = _Scripted({"device": (503, GPU_FULL), "shared_host": (503, full_host)})
    result = _migrate(_server("h1", paths, "s"), _server("h1", paths, "t"), server)
    assert server.allocated_paths() == ["device", "shared_host", "host"]
    assert (result.path, result.landing_tier) == ("host", "host")
    assert "device path failed" in result.fallback_reason
    assert "shared_host path failed at allocate: " in result.fallback_reason
    assert result.fallback_reason.endswith(full_host)


def test_servers_on_two_hosts_skip_both_same_host_paths():
    paths = ("device", "shared_host", "host")
    server = _Scripted({})
    result = _migrate(_server("h1", paths, "s"), _server("h2", paths, "t"), server)
    assert server.allocated_paths() == ["host"]
    assert result.path == "host" and "different hosts" in result.fallback_reason


def test_a_target_without_the_shared_host_path_falls_back_to_the_host_path():
    source = _server("h1", ("device", "shared_host", "host"), "s")
    target = _server("h1", ("device", "host"), "t")
    server = _Scripted({"device": (503, GPU_FULL)})
    result = _migrate(source, target, server)
    assert server.allocated_paths() == ["device", "host"]
    assert result.path == "host" and GPU_FULL in result.fallback_reason


def test_a_pinned_path_is_tried_alone():
    from sglang_kv_migration.client.migration import MigrationFailed

    paths = ("device", "shared_host", "host")
    server = _Scripted({"shared_host": (503, "host pool is full")})
    with pytest.raises(MigrationFailed) as failed:
        _migrate(_server("h1", paths, "s"), _server("h1", paths, "t"), server, "shared_host")
    assert server.allocated_paths() == ["shared_host"]
    assert "host pool is full" in str(failed.value)
    server = _Scripted({})
    result = _migrate(_server("h1", paths, "s"), _server("h1", paths, "t"), server, "shared_host")
    assert (result.path, result.landing_tier, server.allocated_paths()) == (
        "shared_host", "host", ["shared_host"],
    )  # fmt: skip


def test_host_only_pages_take_the_shared_host_path_only_where_the_source_reads_them():
    paths = ("device", "shared_host", "host")
    source = _server("h1", paths, "s")
    source.ranks[0].paths["device"]["tiers"] = ["device"]
    order, reason = path_order(None, source, _server("h1", paths, "t"), HOST_ONLY)
    assert order == ["shared_host", "host"] and "16000 of the tokens on host only" in reason
    source.ranks[0].paths["shared_host"]["tiers"] = ["device"]
    order, reason = path_order(None, source, _server("h1", paths, "t"), HOST_ONLY)
    assert order == ["host"] and "shared_host path: source holds 16000" in reason
    assert path_order(None, source, _server("h1", paths, "t"), ON_DEVICE) == (
        ["device", "shared_host", "host"], "",
    )  # fmt: skip
