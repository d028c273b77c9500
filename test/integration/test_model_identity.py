"""Replicas of one model at different paths migrate; servers whose KV would not be valid
on each other refuse, naming what sets the field that differs.

The fingerprint's model is the identity of the model's own `config.json`
(`fingerprint.model_identity`), not `--served-model-name`, which SGLang defaults to the
model path (verl sets no name, so every replica at its own local copy had its own
"model"). Three CPU mini servers (real HiRadixCache, real routes, Mooncake TCP), none
with a served name: the source's model folder, a copy of it at another path, and a
folder whose config differs in one field that changes the KV (`rope_theta`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import cpu_harness
import pytest
from mini_server import ServerHandle, ServerSpec, serving
from sglang_kv_migration.client.migration import MigrationClient, MigrationFailed
from sglang_kv_migration.fingerprint import LayoutFingerprint, model_identity
from sglang_kv_migration.server.model_identity import server_model_identity

PAGE = 16
IDS = list(range(300, 300 + 4 * PAGE))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    (root / "checkpoint").mkdir()
    first = cpu_harness.write_tiny_model_dir(str(root / "checkpoint"))
    copy = str(root / "elsewhere" / "checkpoint-copy")
    shutil.copytree(first, copy)
    other = str(root / "other-rope")
    shutil.copytree(first, other)
    config = json.loads((Path(other) / "config.json").read_text())
    (Path(other) / "config.json").write_text(json.dumps({**config, "rope_theta": 1e6}))
    return {"first": first, "copy": copy, "other": other}


@pytest.fixture(scope="module")
def servers(model_dirs: dict[str, str]) -> Iterator[dict[str, ServerHandle]]:
    def spec(folder: str, preload: list) -> ServerSpec:
        harness = cpu_harness.HarnessConfig(model_dir=folder)
        return ServerSpec(harness=harness, served_model_name=None, preload=preload)

    specs = [spec(model_dirs["first"], [(IDS, 5)]), spec(model_dirs["copy"], [])]
    specs.append(spec(model_dirs["other"], []))
    with serving(specs) as handles:
        yield dict(zip(("first", "copy", "other"), handles, strict=True))


def test_replicas_at_different_paths_migrate(servers: dict[str, ServerHandle]) -> None:
    source, target = servers["first"].url, servers["copy"].url
    with MigrationClient() as client:
        fingerprints = [
            LayoutFingerprint.from_dict(client.session_info(url).ranks[0].fingerprint)
            for url in (source, target)
        ]
        result = client.migrate(source, target, IDS + [1])
    # Neither fingerprint carries a path, nor a name (none was set).
    assert fingerprints[0].model == fingerprints[1].model
    assert fingerprints[0].model.startswith("LlamaForCausalLM:")
    assert "checkpoint" not in fingerprints[0].model and fingerprints[0].model_name == ""
    assert result.migrated_token_size == len(IDS), result
    device, host = servers["copy"].ask(0, "held", IDS)
    assert max(device, host) == len(IDS)  # the copy's server now holds the prefix


def test_a_config_that_changes_the_kv_is_refused_naming_what_sets_it(
    servers: dict[str, ServerHandle],
) -> None:
    with MigrationClient() as client, pytest.raises(MigrationFailed) as refused:
        client.migrate(servers["first"].url, servers["other"].url, IDS + [1])
    message = str(refused.value)
    assert "model: source=LlamaForCausalLM:" in message, message
    assert "config.json" in message and "the model path does not count" in message, message


def test_the_identity_is_the_files_not_the_path_nor_sglangs(model_dirs: dict[str, str]) -> None:
    """What the server computes from its own args: the file's identity, the same for a
    copy; and a served name only where one was set apart from the path."""
    from sglang_kv_migration.server.server_args import KVMigrationServerArgs

    def args(folder: str, name: str | None = None, overrides: str = "{}") -> object:
        return KVMigrationServerArgs(
            model_path=folder,
            served_model_name=name,
            json_model_override_args=overrides,
            skip_tokenizer_init=True,
            device="cpu",
        )

    first, copy = server_model_identity(args(model_dirs["first"]))
    assert first == server_model_identity(args(model_dirs["copy"]))[0] and copy == ""
    config = json.loads((Path(model_dirs["first"]) / "config.json").read_text())
    assert first == model_identity(config)
    # File metadata does not count; a KV-shaping field and an override do.
    assert model_identity({**config, "transformers_version": "9.9", "_name_or_path": "x"}) == first
    assert model_identity({**config, "rope_theta": 1e6}) != first
    overridden = server_model_identity(args(model_dirs["first"], overrides='{"rope_theta": 1e6}'))
    assert overridden[0] == model_identity({**config, "rope_theta": 1e6})
    assert server_model_identity(args(model_dirs["first"], name="policy"))[1] == "policy"
