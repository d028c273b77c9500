"""Time in tests: a clock the test moves by hand, and a bounded poll of a condition."""

from __future__ import annotations

import time
from collections.abc import Callable


class FakeClock:
    """A `time.monotonic` stand-in: returns `now`, which only the test advances."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def wait_until(check: Callable[[], bool], timeout_s: float, interval_s: float = 0.2) -> bool:
    """Poll `check` every `interval_s` until it holds, at most `timeout_s` (then once
    more); True if it did."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval_s)
    return check()
