"""What the source and target roles of one (tp, pp) rank stand on: the rank's view of
the scheduler with the named cross-rank agreement steps (`context.py`), its identity
(`identity.py`), the settings it is built from (`settings.py`), how a handler runs
(`dispatch.py`), and how PP stages answer as one server (`pp_stages.py`). Nothing here
imports the roles or what stands on them (`scheduler/`)."""
