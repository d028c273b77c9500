"""Mooncake's batch timeout must fit the write window: a stalled batch that outlives it
could land in slots the target already freed and reused. Start-up refuses a longer
`MC_TRANSFER_TIMEOUT` (one line naming both values) and warns when Mooncake's unset
default (30 s) is the longer one. Real `KVMigrationServerArgs`, as `launch_server`
builds them."""

from __future__ import annotations

import logging

import cpu_harness
import pytest

ENV = "MC_TRANSFER_TIMEOUT"


def _args(**fields: object):
    from sglang_kv_migration.server.server_args import KVMigrationServerArgs

    return KVMigrationServerArgs(
        model_path=cpu_harness.write_tiny_model_dir(),
        skip_tokenizer_init=True,
        device="cpu",
        enable_hierarchical_cache=True,
        enable_kv_migration=True,
        **fields,
    )


def test_a_mooncake_timeout_longer_than_the_transfer_timeout_is_refused(monkeypatch) -> None:
    from sglang_kv_migration.server.server_args import KVMigrationArgsError

    # The reported case: a stalled batch stayed submitted 30 s against a 14 s window.
    monkeypatch.setenv(ENV, "30")
    with pytest.raises(KVMigrationArgsError) as refused:
        _args(kv_migration_grant_ttl=2.0, kv_migration_transfer_timeout=6.0)
    message = str(refused.value)
    assert "MC_TRANSFER_TIMEOUT=30 s is longer than --kv-migration-transfer-timeout 6 s" in message
    assert "write window is 14 s after allocate" in message
    assert "\n" not in message


def test_a_mooncake_timeout_that_is_not_a_number_is_refused(monkeypatch) -> None:
    from sglang_kv_migration.server.server_args import KVMigrationArgsError

    monkeypatch.setenv(ENV, "soon")
    with pytest.raises(KVMigrationArgsError, match="must be a number of seconds, got 'soon'"):
        _args()


def test_the_unset_default_longer_than_the_transfer_timeout_is_warned(monkeypatch, caplog) -> None:
    monkeypatch.delenv(ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="sglang_kv_migration.server.server_args"):
        _args(kv_migration_transfer_timeout=10.0)
    warnings = [r.getMessage() for r in caplog.records if ENV in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "default 30 s, longer than --kv-migration-transfer-timeout 10 s" in warnings[0]
    assert f"Set {ENV}=10" in warnings[0]


@pytest.mark.parametrize("mooncake", [None, "6", "2.5"])
def test_a_mooncake_timeout_within_the_window_starts_quietly(
    monkeypatch, caplog, mooncake: str | None
) -> None:
    if mooncake is None:
        monkeypatch.delenv(ENV, raising=False)  # default 30 s = the default transfer timeout
        fields = {}
    else:
        monkeypatch.setenv(ENV, mooncake)
        fields = {"kv_migration_transfer_timeout": 6.0}
    with caplog.at_level(logging.WARNING, logger="sglang_kv_migration.server.server_args"):
        args = _args(**fields)
    assert args.enable_kv_migration
    assert not [r for r in caplog.records if ENV in r.getMessage()]
