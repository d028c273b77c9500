"""The model part of a server's layout fingerprint, from its server args: the identity of
the model's `config.json` (`fingerprint.model_identity`) and the served name where one
was given.

The file is read as written, from the model folder or, for a hub id, from the local
Hugging Face cache SGLang loaded it into (no download: SGLang already has it by the time
the scheduler starts). A model without a readable `config.json` (a single GGUF file, a
custom loader) falls back to its path, with a warning: such replicas must then share
the path.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from sglang_kv_migration.fingerprint import model_identity

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"


def server_model_identity(server_args: Any) -> tuple[str, str]:
    """(`model` for the fingerprint, `model_name`: --served-model-name where it was set
    apart from the path SGLang defaults it to, else "")."""
    path = str(server_args.model_path)
    served = server_args.served_model_name
    name = served if served and served != path else ""
    config = _read_config(path, getattr(server_args, "revision", None))
    if config is None:
        logger.warning(
            "KV migration: no readable %s for %s; the model is identified by its path, so "
            "only servers started with the same --model-path can migrate with this one",
            CONFIG_FILE,
            path,
        )
        return f"path:{path}", name
    return model_identity(config, _overrides(server_args)), name


def _overrides(server_args: Any) -> dict[str, Any]:
    raw = getattr(server_args, "json_model_override_args", None) or "{}"
    overrides = json.loads(raw) if isinstance(raw, str) else dict(raw)
    return overrides if isinstance(overrides, dict) else {}


def _read_config(path: str, revision: str | None) -> dict[str, Any] | None:
    if os.path.isdir(path):
        file = os.path.join(path, CONFIG_FILE)
    else:
        file = _cached_hub_file(path, revision)
    if file is None or not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _cached_hub_file(repo_id: str, revision: str | None) -> str | None:
    """`config.json` of a hub model in the local cache, or None (never downloads)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, CONFIG_FILE, revision=revision)
    except ValueError:  # not a repo id
        return None
    return found if isinstance(found, str) else None
