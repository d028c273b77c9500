"""How often a call chain enters each module of the package: the "walk" of a request.

`ModuleWalk` is a `sys.setprofile` hook. On every call into a package module it takes the
chain of frames above it (outermost first) and counts, per module, how many times the
chain enters it: once per run of consecutive frames in that module. A chain that goes
routes -> communicators -> routes enters `routes` twice. The walk keeps, per module,
the most entries any chain made and that chain, to show where the hops are.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

PACKAGE = "sglang_kv_migration"


def _module_of(frame: FrameType) -> str | None:
    name = frame.f_globals.get("__name__", "")
    if name == PACKAGE or name.startswith(PACKAGE + "."):
        return name
    return None


def chain_of(frame: FrameType | None) -> list[str]:
    """The package modules of `frame`'s stack, outermost first, one per run of frames in
    one module (a frame of other code between two of the same module ends the run: the
    module was entered again, from elsewhere)."""
    modules: list[str | None] = []
    while frame is not None:
        modules.append(_module_of(frame))
        frame = frame.f_back
    modules.reverse()
    runs = [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]
    return [m for m in runs if m is not None]


class ModuleWalk:
    """Per package module, the most times one call chain entered it (`entries`), and
    that chain (`chains`); `reached`: every module any chain reached."""

    def __init__(self) -> None:
        self.entries: dict[str, int] = {}
        self.chains: dict[str, list[str]] = {}
        self.reached: set[str] = set()

    def _profile(self, frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call" or _module_of(frame) is None:
            return
        chain = chain_of(frame)
        counts: dict[str, int] = {}
        for module in chain:
            counts[module] = counts.get(module, 0) + 1
        for module, count in counts.items():
            self.reached.add(module)
            if count > self.entries.get(module, 0):
                self.entries[module] = count
                self.chains[module] = chain

    @contextmanager
    def recording(self) -> Iterator[ModuleWalk]:
        """Record the calls of this thread while the block runs (the chains from the
        route; helper threads start chains of their own)."""
        previous = sys.getprofile()
        sys.setprofile(self._profile)
        try:
            yield self
        finally:
            sys.setprofile(previous)

    def over(self, limit: int) -> dict[str, list[str]]:
        """The modules some chain entered more than `limit` times, with that chain."""
        return {m: self.chains[m] for m, n in self.entries.items() if n > limit}
