"""What the scheduler calls on every (tp, pp) rank: the hooks SGLang runs (`hooks.py`),
the facade they call (`scheduler_side.py`) over the loop policy (`loop.py`), the session
info (`session_info.py`) and the handler wrapping (`dispatch.py`); the rank's identity,
settings and view of SGLang's state (`identity.py`, `settings.py`, `idle_probe.py`); the
rank's view of the scheduler with the named cross-rank agreement steps (`context.py`),
and how PP stages answer as one server (`pp_stages.py`)."""
