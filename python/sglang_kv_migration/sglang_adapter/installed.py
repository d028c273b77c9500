"""Which SGLang this process runs on, decided once, by what the installed package has.

The plugin runs on two lines of SGLang whose caches differ in kind, not in detail:

- ``0.5.12``: ``HiRadixCache`` (``mem_cache/hiradix_cache.py``), a radix tree of Python
  ``TreeNode`` objects with their device and host values, and the host pools of
  ``mem_cache/memory_pool_host.py``. What this line needs is in ``radix_tree.py`` and
  ``pools.py``.
- ``0.5.23``: ``UnifiedRadixCache`` (``mem_cache/unified_radix_cache.py``) with HiCache
  attached by ``init_hicache``; its tree lives in a tree core (a Rust extension by
  default) reached only by node ids, and every host pool sits in a ``HostPoolGroup`` of
  ``mem_cache/pool_host/``. What this line needs is in ``unified_tree.py`` and
  ``unified_pools.py``.

The line is read off the installed package's modules (never by importing them, so the
check is free in every SGLang process): ``sglang_adapter/__init__.py`` binds each
version-dependent function once, from here. Nothing outside `sglang_adapter/` asks
which line runs; what one line lacks is refused at start by `missing_for_migration`.
"""

from __future__ import annotations

import importlib.util
from functools import cache

HIRADIX_LINE = "0.5.12"
UNIFIED_LINE = "0.5.23"
SUPPORTED_LINES = (HIRADIX_LINE, UNIFIED_LINE)

# The module each line's cache is defined in (one exists per line, never both).
_LINE_MODULES = {
    HIRADIX_LINE: "sglang.srt.mem_cache.hiradix_cache",
    UNIFIED_LINE: "sglang.srt.mem_cache.unified_radix_cache",
}


@cache
def sglang_line() -> str:
    """The line of the installed SGLang: ``HIRADIX_LINE`` or ``UNIFIED_LINE``. Where no
    SGLang is installed (a client-only environment) the 0.5.12 line: nothing runs it."""
    if _module_exists(_LINE_MODULES[HIRADIX_LINE]):
        return HIRADIX_LINE
    if _module_exists(_LINE_MODULES[UNIFIED_LINE]):
        return UNIFIED_LINE
    return HIRADIX_LINE


def is_unified_line() -> bool:
    return sglang_line() == UNIFIED_LINE


def sglang_version() -> str:
    """The installed SGLang's version string ("" when none is installed)."""
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return ""


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False
