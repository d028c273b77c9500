"""The client's choice of data path from the two servers' session info and the size query.

Same host: the device path, whatever tier the source holds the prefix in, when every
source rank advertises that it reads its host pool in place (`tiers` lists "host");
a source that does not (older servers, an unpinned or page_head host pool) keeps the
old rule and falls back to the host path for host-only tokens, saying why.
"""

from __future__ import annotations

from sglang_kv_migration.client.migration import _choose_path
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
    assert _choose_path(None, source, target, HOST_ONLY) == ("device", "")
    assert _choose_path("auto", source, target, ON_DEVICE) == ("device", "")


def test_host_path_with_a_reason_when_a_source_rank_reads_device_pages_only():
    source = _info("h1", ["device", "host"], ranks=2)
    source.ranks[1].paths["device"]["tiers"] = ["device"]
    path, reason = _choose_path(None, source, _info("h1", None), HOST_ONLY)
    assert path == "host" and "16000 of the tokens on host only" in reason
    # An older source (no `tiers`) on one host: device pages still take the device path.
    assert _choose_path(None, _info("h1", None), _info("h1", None), ON_DEVICE) == ("device", "")


def test_other_host_takes_the_host_path_whatever_the_tier():
    path, reason = _choose_path(None, _info("h1", ["device", "host"]), _info("h2", None), ON_DEVICE)
    assert (path, reason) == ("host", "servers are on different hosts")


def _compat_info(page_size: int) -> SessionInfoReply:
    from sglang_kv_migration import PROTOCOL_VERSION
    from sglang_kv_migration.fingerprint import KVCacheShape, LayoutFingerprint

    shape = KVCacheShape("bfloat16", "mha", 0, 2, 2, 16, 0, 0, page_size, "layer_first")
    fingerprint = LayoutFingerprint(PROTOCOL_VERSION, "m", shape, 1, 0, 1, 0).to_dict()
    rank = RankSessionInfo(0, 0, page_size, fingerprint)
    return SessionInfoReply(success=True, ranks=[rank], protocol_version=PROTOCOL_VERSION)


def test_the_compatibility_check_is_kept_per_pair_of_infos_until_one_is_replaced(monkeypatch):
    from sglang_kv_migration.client import migration
    from sglang_kv_migration.client.migration import MigrationFailed, SessionCache

    checked: list[tuple[SessionInfoReply, SessionInfoReply]] = []
    real = migration._check_compatible

    def counting(source: SessionInfoReply, target: SessionInfoReply) -> None:
        checked.append((source, target))
        real(source, target)

    monkeypatch.setattr(migration, "_check_compatible", counting)
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
