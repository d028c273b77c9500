"""What runs inside SGLang's processes, by role: `plugin.py` (the entry point and its
table of hooks) and `server_args.py` (the flags) here; `http/` the routes and
communicators; `rank/` what the roles stand on; `source/` and `target/` the two sides of
a migration; `scheduler/` what stands on them (the scheduler's hooks, the step that
builds a rank's migration side, its facade and loop); `same_host/` what only peers on
one host use; `diag/` diagnostics. Nothing outside this folder imports it, except SGLang
itself through the plugin entry point."""
