"""What a caller imports to move KV: `MigrationClient` (sync) and `AsyncMigrationClient`
(asyncio) in `migration.py` (`migrate_many` takes `batch.Move`s), and the
`sglang-kv-migrate` CLI in `cli.py`. The client talks to servers over HTTP only: it
imports nothing from `server/` or `paths/`."""

from sglang_kv_migration.client.batch import Move
from sglang_kv_migration.client.migration import (
    ApiKeys,
    AsyncMigrationClient,
    AuthFailed,
    MigrationClient,
    MigrationFailed,
    MigrationResult,
)

__all__ = [
    "ApiKeys",
    "AsyncMigrationClient",
    "AuthFailed",
    "MigrationClient",
    "MigrationFailed",
    "MigrationResult",
    "Move",
]
