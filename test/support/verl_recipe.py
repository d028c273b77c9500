"""The verl recipe as docs/rl-integration.md ("## verl") states it: the tests run exactly
what the docs tell a verl user to set."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

DOC = Path(__file__).resolve().parents[2] / "docs" / "rl-integration.md"


def _yaml_blocks() -> list[dict[str, Any]]:
    text = DOC.read_text()
    section = text[text.index("\n## verl\n") :]
    section = section[: section.index("\n## ", 1)]
    return [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", section, re.S)]


def engine_kwargs() -> dict[str, Any]:
    """`actor_rollout_ref.rollout.engine_kwargs.sglang` of the recipe."""
    return dict(_yaml_blocks()[0]["actor_rollout_ref"]["rollout"]["engine_kwargs"]["sglang"])


def router_config() -> dict[str, Any]:
    """The recipe's router YAML (`rollout.router_config_path`)."""
    return dict(_yaml_blocks()[1])
