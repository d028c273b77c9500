"""One line gives SGLang's `ServerArgs` this plugin's flags in this process:

    import sglang_kv_migration.sglang_flags  # noqa: F401

for a process that builds `ServerArgs(enable_kv_migration=True)` itself before SGLang
loads its plugins (slime's Ray actors, verl with `VERL_USE_EXTERNAL_PLUGINS=none`, a
launcher of your own). It acts as soon as SGLang's `server_args` module is imported, or
at once if it already is, and imports nothing of SGLang's until then
(`server/plugin.py`, `take_server_args`). `sglang.Engine(..., enable_kv_migration=True)`
and `launch_server` need nothing: they load SGLang's plugins before they build their
args.

Without this line and before SGLang loads its plugins, `ServerArgs` is SGLang's own and
the call is Python's `TypeError: ... unexpected keyword argument 'enable_kv_migration'`
(nothing of this package runs there to say more). On an SGLang without the plugin
framework (0.5.10.post1) this logs a warning naming the plugin and the SGLang it needs.
"""

from __future__ import annotations

import logging

from sglang_kv_migration.import_hooks import after_import

logger = logging.getLogger(__name__)

SGLANG_SERVER_ARGS_MODULE = "sglang.srt.server_args"


def _take_sglang_server_args() -> None:
    # Runs inside SGLang's import of its server_args module: it must not raise there.
    try:
        from sglang_kv_migration.server.plugin import take_server_args

        take_server_args()
    except Exception:
        logger.warning(
            "sglang-kv-migration: could not add its flags to this SGLang's ServerArgs "
            "(it needs sglang==0.5.12 and its plugin framework, sglang.srt.plugins); "
            "ServerArgs(enable_kv_migration=...) will raise TypeError here",
            exc_info=True,
        )


after_import(SGLANG_SERVER_ARGS_MODULE, _take_sglang_server_args)
