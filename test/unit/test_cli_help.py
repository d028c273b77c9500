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
from sglang_kv_migration.rollout import rebalance_cli
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
    assert "--path {auto,device,host}" in text
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
