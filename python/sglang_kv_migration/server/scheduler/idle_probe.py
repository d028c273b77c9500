"""SGLang's state as the migration loop reads it: whether the scheduler is idle and
whether requests wait on its input (tests the scheduler hook builds through
`sglang_adapter`). The brief waits (`loop.py`) and the source's deferred prepares
(`SourceTransfers._defer_prepare`) read them; a bug in either test turns both off."""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


class IdleProbe:
    """(scheduler_idle, input_waiting): None for either means no SGLang state (tests
    that drive a rank directly), so nothing waits and nothing is deferred."""

    def __init__(
        self,
        scheduler_idle: Callable[[], bool] | None = None,
        input_waiting: Callable[[], bool] | None = None,
    ):
        self.scheduler_idle = scheduler_idle
        self.input_waiting = input_waiting
        self.off = False  # after an error: never asks again

    def tests(self) -> tuple[Callable[[], bool], Callable[[], bool]] | None:
        """SGLang's (scheduler_idle, input_waiting) tests; None without them or after an
        error turned them off."""
        if self.off or self.scheduler_idle is None or self.input_waiting is None:
            return None
        return self.scheduler_idle, self.input_waiting

    def requests_waiting(self) -> bool:
        """Whether requests wait on this rank's input while SGLang is idle (then they are
        likely more migrations sent together: `SourceTransfers._defer_prepare`). False
        without SGLang's state and after an error. Never raises."""
        tests = self.tests()
        if tests is None:
            return False
        scheduler_idle, input_waiting = tests
        try:
            return input_waiting() and scheduler_idle()
        except Exception:  # a bug: stop looking, never stop the scheduler
            return self.off_after_error()

    def off_after_error(self) -> bool:
        logger.exception("KV migration: brief waits off after an error")
        self.off = True
        return False
