"""What a client knows of each server between migrations: its session info (cached per
URL until the server's epoch changes), the pairs of servers found compatible, and the
device destinations each source was sent in full (feature "destination_digest"); the
session-info step and the epoch check that turns a restart into one retry."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from sglang_kv_migration.client.calls import Call, CallReply, step
from sglang_kv_migration.client.results import MigrationFailed
from sglang_kv_migration.fingerprint import LayoutFingerprint, explain
from sglang_kv_migration.grants import destination_digest
from sglang_kv_migration.wire.messages import SessionInfoReply
from sglang_kv_migration.wire.version import PROTOCOL_VERSION


class SessionCache:
    """Session info per server URL, reused across migrations until the server's epoch
    changes (a restart); a stale entry is dropped and the migration restarts once."""

    def __init__(self) -> None:
        self._infos: dict[str, SessionInfoReply] = {}
        # Feature "destination_digest": (source URL, its instance, digest) of the device
        # destinations each source was sent in full and accepted.
        self._sent: set[tuple[str, str, str]] = set()
        self._digests: dict[int, tuple[dict[str, Any], str]] = {}  # id -> (it, digest)
        # (source info, target info) pairs found compatible, by identity: the check
        # parses and compares every rank's fingerprint (0.15 ms a migration on CPU,
        # `bench_control_plane.py --profile`).
        self._compatible: dict[tuple[int, int], tuple[SessionInfoReply, SessionInfoReply]] = {}

    def get(self, url: str) -> SessionInfoReply | None:
        return self._infos.get(url.rstrip("/"))

    def put(self, url: str, info: SessionInfoReply) -> None:
        self._infos[url.rstrip("/")] = info
        self._forget_memos()

    def drop(self, url: str) -> None:
        self._infos.pop(url.rstrip("/"), None)
        self._forget_memos()

    def _forget_memos(self) -> None:
        # Memos of replaced infos' dicts would keep them alive (and their ids reused).
        self._digests.clear()
        self._compatible.clear()

    def check_compatible(
        self, source_info: SessionInfoReply, target_info: SessionInfoReply
    ) -> None:
        """`_check_compatible`, once per pair of cached infos."""
        key = (id(source_info), id(target_info))
        known = self._compatible.get(key)
        if known is not None and known[0] is source_info and known[1] is target_info:
            return
        _check_compatible(source_info, target_info)
        self._compatible[key] = (source_info, target_info)

    def digest_of(self, device_kv: dict[str, Any]) -> str:
        """`grants.destination_digest` of a target rank's `paths["device"]`, once per
        session info read (the dict is the cached info's own)."""
        known = self._digests.get(id(device_kv))
        if known is None or known[0] is not device_kv:
            known = self._digests[id(device_kv)] = (device_kv, destination_digest(device_kv))
        return known[1]

    def source_knows(self, url: str, instance: str, digest: str) -> bool:
        return (url.rstrip("/"), instance, digest) in self._sent

    def sent(self, url: str, instance: str, digest: str, known: bool) -> None:
        key = (url.rstrip("/"), instance, digest)
        if known:
            self._sent.add(key)
        else:
            self._sent.discard(key)


class StaleSession(Exception):
    """A server restarted since its session info was read: the attempt starts over."""

    def __init__(self, url: str):
        super().__init__(f"{url} restarted since its session info was read")
        self.url = url


def session_info_step(
    url: str, sessions: SessionCache
) -> Generator[Call, CallReply, SessionInfoReply]:
    """The session info of `url`: the cached one, else asked once and cached."""
    info = sessions.get(url)
    if info is None:
        call = Call("session_info", url, "/get_transfer_session_info", None)
        info = yield from step(call, SessionInfoReply)
        sessions.put(url, info)
    return info


def check_epoch(url: str, info: SessionInfoReply, epoch: str) -> None:
    """A reply's `server_epoch` that is not the one `info` was read with: a restart."""
    if epoch and epoch != info.server_epoch:
        raise StaleSession(url)


def _check_compatible(source_info: SessionInfoReply, target_info: SessionInfoReply) -> None:
    """Refuse before anything is allocated when the two servers cannot exchange pages."""
    for name, info in (("source", source_info), ("target", target_info)):
        if info.protocol_version != PROTOCOL_VERSION:
            raise MigrationFailed(
                "session_info",
                f"{name} speaks protocol {info.protocol_version}, this client {PROTOCOL_VERSION}",
            )
    source_ranks = {(r.tp_rank, r.pp_rank): r for r in source_info.ranks}
    target_ranks = {(r.tp_rank, r.pp_rank): r for r in target_info.ranks}
    if set(source_ranks) != set(target_ranks):
        raise MigrationFailed(
            "session_info",
            f"rank sets differ: source (tp, pp) {sorted(source_ranks)} vs target "
            f"{sorted(target_ranks)}",
        )
    for position, source_rank in source_ranks.items():
        source_fp = LayoutFingerprint.from_dict(source_rank.fingerprint)
        target_fp = LayoutFingerprint.from_dict(target_ranks[position].fingerprint)
        mismatch = source_fp.first_mismatch(target_fp)
        if mismatch is not None:
            raise MigrationFailed("session_info", f"KV layouts differ: {explain(mismatch)}")
