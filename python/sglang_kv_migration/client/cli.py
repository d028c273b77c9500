"""`sglang-kv-migrate`: run one migration from the shell.

    sglang-kv-migrate --source http://10.0.0.1:30000 --target http://10.0.0.2:30000 \\
        --input-ids 1,2,3,... [--extra-key K] [--path auto|device|host] \\
        [--api-key KEY] [--admin-api-key KEY] [--json]

`--input-ids-file F` reads ids from a JSON list or whitespace/comma separated text
("-" for stdin). Exit status: 0 migrated (or nothing to move), 1 migration failed,
2 bad arguments.

`sglang-kv-migrate rebalance ...` is `integrations/rebalance_cli.py`, dispatched by the
console script (`sglang_kv_migration/cli.py`), so the client never imports what stands
on it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable

from sglang_kv_migration.client.migration import (
    DEFAULT_TIMEOUT_S,
    PATHS,
    MigrationClient,
    MigrationFailed,
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every valued option's default in its help line; the epilog printed as written.

    Flags (store_true / store_false) show none: a flag is off unless given, and the
    default of a `--no-X` flag's destination would read as the flag being on."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


def _number_type(convert: type, name: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {name}") from None
        if value != value or not ok(value):  # NaN is never in range
            raise argparse.ArgumentTypeError(f"must be {name}, got {text}")
        return value

    parse.__name__ = name  # argparse names the type in its messages
    return parse


# argparse `type=`s: a bad value exits 2 with argparse's one-line error.
positive_float = _number_type(float, "a positive number", lambda v: v > 0)
non_negative_float = _number_type(float, "a number >= 0", lambda v: v >= 0)
positive_int = _number_type(int, "an integer >= 1", lambda v: v >= 1)
non_negative_int = _number_type(int, "an integer >= 0", lambda v: v >= 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        input_ids = _read_ids(args.input_ids, args.input_ids_file)
    except (OSError, ValueError) as e:
        parser.error(str(e))

    client = MigrationClient(
        timeout=args.timeout, api_key=args.api_key, admin_api_key=args.admin_api_key
    )
    with client:
        try:
            result = client.migrate(
                args.source,
                args.target,
                input_ids,
                args.extra_key,
                path=args.path,
                verify=args.verify,
            )
        except MigrationFailed as e:
            if args.json:
                print(
                    json.dumps(
                        {
                            "success": False,
                            "phase": e.phase,
                            "status_code": e.status_code,
                            "message": e.message,
                            "rolled_back": e.rolled_back,
                            "migration_id": e.migration_id,
                        }
                    )
                )
            else:
                rollback = " (target allocation released)" if e.rolled_back else ""
                print(f"migration failed: {e}{rollback}", file=sys.stderr)
            return 1

    if args.json:
        print(json.dumps({"success": True, **result.to_dict()}))
    elif result.migrated_token_size == 0:
        print(
            f"nothing to migrate: source holds {result.source_held_token_size} tokens, "
            f"target already holds {result.target_matched_token_size}"
        )
    else:
        total_ms = result.timings.get("total", 0.0) * 1e3
        print(
            f"migrated {result.migrated_token_size} tokens ({result.migrated_bytes} bytes) "
            f"in {total_ms:.1f} ms; target now matches {result.matched_after_commit} tokens "
            f"[{result.migration_id}]"
        )
    return 0


EPILOG = """\
exit status:
  0  migrated, or nothing to move (the source holds no whole page of the ids, or the
     target already holds them)
  1  the migration failed, including a key a server refused (401/403): the phase,
     route and HTTP status are printed, and whether the target's allocation was
     released
  2  bad arguments

keys (SGLang's rules): with only --api-key set on the servers, that key opens every
route; with --admin-api-key also set, the six migration routes take only the admin key.
Pass the one your servers use, or both.

subcommands:
  sglang-kv-migrate rebalance --server URL --server URL [...]
     watch servers' load, or run a batch of requests and move queued ones off
     KV-pressured servers (sglang-kv-migrate rebalance --help)
  sglang-kv-migrate demo [--tokens N]
     a first run on this machine's CPU: two servers start, a prefix moves between
     them, and the second serves it from cache (sglang-kv-migrate demo --help)
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-kv-migrate",
        description="Move the KV cache of a token prefix from one SGLang server to another "
        "(the `rebalance` subcommand moves whole requests off pressured servers).",
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--source", required=True, help="URL of the server holding the KV")
    parser.add_argument("--target", required=True, help="URL of the server to move it to")
    ids = parser.add_mutually_exclusive_group(required=True)
    ids.add_argument("--input-ids", help="comma-separated token ids")
    ids.add_argument("--input-ids-file", help="token ids file (JSON list or text), - for stdin")
    parser.add_argument("--extra-key", default=None, help="radix-cache namespace (e.g. LoRA id)")
    parser.add_argument(
        "--path",
        choices=("auto", *PATHS),
        default="auto",
        help="data path: auto tries device (same host, into the target's GPU), "
        "shared_host (same host, into its host tier) and host (Mooncake) in turn; one of "
        "them pins it (fails unless both servers offer it)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="the servers' --api-key (also sent as the admin key "
        "when --admin-api-key is not given)",
    )
    parser.add_argument(
        "--admin-api-key",
        default=None,
        help="the servers' --admin-api-key: sent on the migration routes instead of --api-key",
    )
    parser.add_argument(
        "--timeout", type=positive_float, default=DEFAULT_TIMEOUT_S, help="seconds per call"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (MigrationResult's fields, or phase/status/message)",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="the target checks a digest of what landed before inserting it",
    )
    return parser


def _read_ids(inline: str | None, path: str | None) -> list[int]:
    if inline is not None:
        text = inline
    elif path == "-":
        text = sys.stdin.read()
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    text = text.strip()
    values = json.loads(text) if text.startswith("[") else re.split(r"[\s,]+", text)
    try:
        ids = [int(v) for v in values if str(v) != ""]
    except (TypeError, ValueError):
        raise ValueError("input ids must be integers") from None
    if not ids or any(i < 0 for i in ids):
        raise ValueError("input ids must be a non-empty list of non-negative integers")
    return ids


if __name__ == "__main__":
    sys.exit(main())
