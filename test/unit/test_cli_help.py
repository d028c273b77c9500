"""`--help` of `sglang-kv-migrate` and `sglang-kv-migrate rebalance`: every option has a
help text, the top-level help names the subcommand and the exit codes, and the
rebalance epilog lists every field its JSON lines carry (read from the dataclasses that
produce them, so the help cannot drift from the output)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from sglang_kv_migration import cli
from sglang_kv_migration.client import cli as migrate_cli
from sglang_kv_migration.integrations import rebalance_cli
from sglang_kv_migration.rollout.rebalancer import ServerLoad
from sglang_kv_migration.rollout.request_migration import MoveReport, RequestOutput, Segment


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("parser", [migrate_cli._parser(), rebalance_cli._parser()])
def test_every_option_has_help_and_shows_its_default(parser: argparse.ArgumentParser) -> None:
    text = parser.format_help()
    for action in options(parser):
        assert action.help and action.help.strip(), action.option_strings
        assert action.option_strings[0] in text
    # The formatter adds each option's default to its line.
    assert "(default: 120.0)" in text
    assert "exit status:" in text
    for code in ("0  ", "1  ", "2  "):
        assert code in parser.epilog


def test_top_level_help_mentions_rebalance_and_path(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "sglang-kv-migrate rebalance" in text
    assert "--path {auto,device,shared_host,host}" in text
    assert "(default: auto)" in text
    with pytest.raises(SystemExit) as usage:
        cli.main(["--source", "a", "--target", "b", "--input-ids", "1", "--path", "gpu"])
    assert usage.value.code == 2


def test_rebalance_help_describes_its_json_lines(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["rebalance", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "watch mode" in text and "batch mode" in text
    produced = [
        *(f.name for f in dataclasses.fields(ServerLoad)),
        *(f.name for f in dataclasses.fields(MoveReport)),
        *(f.name for f in dataclasses.fields(Segment)),
        *(f.name for f in dataclasses.fields(RequestOutput)),
    ]
    missing = [name for name in produced if f'"{name}"' not in rebalance_cli.EPILOG]
    assert missing == []


def test_flags_show_no_default_and_the_epilog_points_up() -> None:
    """A flag is off unless given: `--no-kv-headroom` must not read "(default: True)",
    `--move-running` must not carry two defaults, and the epilog (printed after the
    options) must not send the reader to options "below"."""
    parser = rebalance_cli._parser()
    for action in options(parser):
        if action.nargs == 0:  # store_true / store_false
            assert "default" not in parser._get_formatter()._expand_help(action), (
                action.option_strings
            )
    text = parser.format_help()
    headroom = text[text.index("--no-kv-headroom  ") : text.index("--interval INTERVAL  ")]
    assert "(default: True)" not in headroom
    running = text[text.index("--move-running  ") : text.index("--live  ")]
    assert running.count("default") == 0
    assert "options below" not in text
    assert "policy options above" in text


def _parse_error(parse, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as done:
        parse(argv)
    assert done.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--live"], "--live moves decoding requests: it needs --move-running"),
        (["--timeout", "-1"], "argument --timeout: must be a positive number, got -1"),
        (["--timeout", "0"], "argument --timeout: must be a positive number"),
        (["--max-concurrent", "0"], "argument --max-concurrent: must be an integer >= 1"),
        (["--max-moves-per-round", "0"], "argument --max-moves-per-round: must be an integer"),
        (["--max-moves-per-request", "0"], "argument --max-moves-per-request: must be"),
        (["--max-rounds", "0"], "argument --max-rounds: must be an integer >= 1"),
        (["--max-failed-rounds", "0"], "argument --max-failed-rounds: must be an integer"),
        (["--interval", "-0.5"], "argument --interval: must be a number >= 0"),
        (["--drain-timeout", "-1"], "argument --drain-timeout: must be a number >= 0"),
        (["--kv-pressure", "-0.1"], "argument --kv-pressure: must be a number >= 0"),
        (["--target-max-ratio", "nan"], "argument --target-max-ratio: must be a positive"),
        (["--min-waiting", "-1"], "argument --min-waiting: must be an integer >= 0"),
        (["--min-held-tokens", "-5"], "argument --min-held-tokens: must be an integer >= 0"),
        (["--max-concurrent", "two"], "argument --max-concurrent: 'two' is not an integer"),
    ],
)
def test_rebalance_refuses_bad_values_with_exit_2(argv: list[str], expected: str, capsys) -> None:
    # One quick round if a value were accepted (watch mode against a closed port), so an
    # accepted value fails this test at once instead of watching for minutes.
    quick = ["--server", "http://127.0.0.1:1", "--max-rounds", "1", "--interval", "0"]
    line = _parse_error(cli.main, ["rebalance", *quick, *argv], capsys)
    assert line.endswith(expected) or expected in line, line


@pytest.mark.parametrize("value", ["-1", "0", "nan", "soon"])
def test_migrate_refuses_a_bad_timeout_with_exit_2(value: str, capsys) -> None:
    argv = ["--source", "http://a", "--target", "http://b", "--input-ids", "1", "--timeout", value]
    line = _parse_error(cli.main, argv, capsys)
    assert "argument --timeout:" in line
