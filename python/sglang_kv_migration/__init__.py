"""Runtime KV-cache migration between SGLang servers (overlay plugin for sglang==0.5.12).

Reading order: see README.md in this folder.

Importing the package (any module of it) makes SGLang's `ServerArgs` take this plugin's
flags in this process, as soon as SGLang's `server_args` module is imported, or at once
if it already is: what lets a process build `ServerArgs(enable_kv_migration=True)`
itself before SGLang loads its plugins (slime's and other frameworks' actors). It imports
nothing of SGLang's until then (`server/plugin.py`, `take_server_args`).
"""

import logging

from sglang_kv_migration import import_hooks as _import_hooks
from sglang_kv_migration.wire.features import EPOCH_CHECK as EPOCH_CHECK_FEATURE
from sglang_kv_migration.wire.features import TRANSFER_BATCH as TRANSFER_BATCH_FEATURE
from sglang_kv_migration.wire.version import PROTOCOL_VERSION

__version__ = "0.1.0"

__all__ = ["EPOCH_CHECK_FEATURE", "PROTOCOL_VERSION", "TRANSFER_BATCH_FEATURE", "__version__"]

SGLANG_SERVER_ARGS_MODULE = "sglang.srt.server_args"


def _take_sglang_server_args() -> None:
    # Runs inside SGLang's import of its server_args module: it must not raise there.
    try:
        from sglang_kv_migration.server.plugin import take_server_args

        take_server_args()
    except Exception:
        logging.getLogger(__name__).warning(
            "sglang-kv-migration: could not add its flags to this SGLang's ServerArgs "
            "(it needs sglang==0.5.12 and its plugin framework, sglang.srt.plugins); "
            "ServerArgs(enable_kv_migration=...) will raise TypeError here",
            exc_info=True,
        )


_import_hooks.after_import(SGLANG_SERVER_ARGS_MODULE, _take_sglang_server_args)
