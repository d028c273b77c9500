"""What stands on the source and target roles, as SGLang's scheduler runs a rank: the
hooks SGLang calls (`hooks.py`), the one step that builds a rank's migration side
(`compose.py`), the facade the hooks and the dispatcher call (`scheduler_side.py`) over
the loop policy (`loop.py`, with SGLang's idle state read by `idle_probe.py`) and the
session info (`session_info.py`), and on a `--dp-size N` server the handlers that act
only on their DP rank's requests (`dp_filter.py`)."""
