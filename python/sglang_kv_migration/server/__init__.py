"""What runs inside SGLang's processes, by role: `plugin.py` (the entry point and its
table of hooks), `server_args.py` (the flags) and `compose.py` (builds a rank's migration
side) here; `http/` the routes and
communicators; `rank/` what the scheduler calls on every rank; `source/` and `target/`
the two sides of a migration; `same_host/` what only peers on one host use; `diag/`
diagnostics. Nothing outside this folder imports it, except SGLang itself through the
plugin entry point."""
