"""Diagnostics, none of which changes what a migration does: Prometheus series and the
loop's time per iteration (`metrics.py`), each reply's `steps_ms` (`trace.py`), log lines
kept back until the rank is idle (`deferred_log.py`), and the opt-in profile of a rank
with the cost of small operations on its thread (`profiling.py`, `thread_costs.py`)."""
