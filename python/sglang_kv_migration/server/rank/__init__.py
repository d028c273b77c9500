"""What the scheduler calls on every (tp, pp) rank: the hooks SGLang runs (`hooks.py`),
the handlers, poll and watchdog behind them (`scheduler_side.py`), the rank's view of the
scheduler with the named cross-rank agreement steps (`context.py`), and how PP stages
answer as one server (`pp_stages.py`)."""
