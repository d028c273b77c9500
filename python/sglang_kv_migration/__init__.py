"""Runtime KV-cache migration between SGLang servers (overlay plugin for sglang==0.5.12).

Reading order: see README.md in this folder.
"""

# The wire contract lives in `wire/`; these names stay importable from the package root.
from sglang_kv_migration.wire.features import EPOCH_CHECK as EPOCH_CHECK_FEATURE
from sglang_kv_migration.wire.features import TRANSFER_BATCH as TRANSFER_BATCH_FEATURE
from sglang_kv_migration.wire.version import PROTOCOL_VERSION

__version__ = "0.1.0"

__all__ = ["EPOCH_CHECK_FEATURE", "PROTOCOL_VERSION", "TRANSFER_BATCH_FEATURE", "__version__"]
