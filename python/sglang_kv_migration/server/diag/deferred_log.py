"""Log lines of a scheduler rank written once its migrations are out of the way.

A log line costs ~0.1-0.2 ms of a server's scheduler thread (cProfile of an H200 server:
`Logger.info` under our reply). Written where a move finishes, it delays
the reply of the next move finished in the same poll and every move behind it; kept
here, the lines go out when the rank has nothing of ours in flight (`flush`, called by
the scheduler side's poll), or once `MAX_KEPT` wait.
"""

from __future__ import annotations

import logging
from typing import Any

MAX_KEPT = 32  # written together: ~5 ms of the thread at most


class DeferredLog:
    """`info` now, written by `flush`, in order, each through its own logger."""

    def __init__(self) -> None:
        self._kept: list[tuple[logging.Logger, str, tuple[Any, ...]]] = []

    def info(self, logger: logging.Logger, message: str, *args: Any) -> None:
        if not logger.isEnabledFor(logging.INFO):
            return
        self._kept.append((logger, message, args))
        if len(self._kept) >= MAX_KEPT:
            self.flush()

    def flush(self) -> None:
        kept, self._kept = self._kept, []
        for logger, message, args in kept:
            logger.info(message, *args)

    def __len__(self) -> int:
        return len(self._kept)
