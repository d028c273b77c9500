"""`sglang-kv-migrate`, the console script: one command, three jobs.

    sglang-kv-migrate --source URL --target URL --input-ids ...   move one prefix
    sglang-kv-migrate rebalance --server URL --server URL ...     move whole requests
    sglang-kv-migrate demo                                        watch one move on CPU

The first is `client/cli.py`, the second `integrations/rebalance_cli.py` (same exit
statuses), the third `demo/run.py`. The dispatch lives here, above them, so that
`client/` never imports `integrations/` (which is built on it), and only `demo` loads
the demo (its servers run SGLang's cache on CPU, in processes of their own).
"""

from __future__ import annotations

import sys

from sglang_kv_migration.client import cli as migrate_cli


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["rebalance"]:
        from sglang_kv_migration.integrations import rebalance_cli

        return rebalance_cli.main(argv[1:])
    if argv[:1] == ["demo"]:
        from sglang_kv_migration.demo import run

        return run.main(argv[1:])
    return migrate_cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
