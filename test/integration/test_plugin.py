"""The plugin on the installed SGLang (either supported line): hook targets exist, flags
parse, bad flags refuse."""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import cpu_harness
import pytest
from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.sglang_adapter import hook_targets as upstream

REPO = Path(__file__).resolve().parents[2]
# Every test here runs on both SGLang lines (CI runs the marker on 0.5.23 too).
pytestmark = pytest.mark.any_sglang


@pytest.mark.parametrize(
    "symbol",
    upstream.hook_targets() + upstream.moment_hook_targets() + upstream.required_symbols(),
)
def test_upstream_symbol_exists(symbol: str) -> None:
    try:
        upstream.resolve(symbol)
    except (ImportError, AttributeError) as e:
        pytest.fail(
            f"the installed SGLang has no {symbol} ({e}); sglang-kv-migration runs on "
            f"sglang {upstream.SGLANG_VERSION}: re-check every hook before adding a version"
        )


def test_installed_sglang_is_a_supported_release_of_its_line() -> None:
    from importlib.metadata import version

    from sglang_kv_migration import sglang_adapter

    assert version("sglang") == sglang_adapter.sglang_line()
    assert sglang_adapter.sglang_line() in sglang_adapter.SUPPORTED_LINES


def test_entry_point_is_registered() -> None:
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "kv_migration"]
    assert len(eps) == 1
    assert eps[0].value == "sglang_kv_migration.server.plugin:register"


_REGISTER_SCRIPT = """
import cpu_harness
cpu_harness.install_cpu_shims()
import sglang.srt.server_args as upstream_server_args
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang_kv_migration.server import plugin
from sglang_kv_migration.sglang_adapter import hook_targets as upstream
from sglang_kv_migration.server.server_args import KVMigrationServerArgs

assert plugin.missing_hooks(), "nothing is hooked before register()"
plugin.register()
plugin.register()
counts = {t: len(HookRegistry._hooks[t]) for t in upstream.hook_targets()}
# One hook per target, but two (BEFORE and AFTER) on the scheduler's request dispatch.
expected = {t: 2 if t == upstream.SCHEDULER_PROCESS_INPUT else 1 for t in counts}
assert counts == expected, counts
HookRegistry.apply_hooks()
assert plugin.missing_hooks() == [], plugin.missing_hooks()
assert upstream_server_args.ServerArgs is KVMigrationServerArgs
print("HOOKS-OK")
"""


def test_register_applies_every_hook_and_is_idempotent(fresh_interpreters) -> None:
    # In a fresh interpreter: applied hooks patch SGLang for the life of the process.
    proc = fresh_interpreters["register"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("HOOKS-OK")


def test_server_args_pickle_keeps_migration_fields() -> None:
    from sglang_kv_migration.server.server_args import KVMigrationServerArgs

    args = KVMigrationServerArgs(
        model_path=cpu_harness.write_tiny_model_dir(),
        skip_tokenizer_init=True,
        device="cpu",
        enable_hierarchical_cache=True,
        enable_kv_migration=True,
        kv_migration_watchdog_timeout=12.5,
        kv_migration_protocol="rdma",
        kv_migration_rdma_devices="mlx5_0",
    )
    # ServerArgs reaches the scheduler processes pickled.
    copy = pickle.loads(pickle.dumps(args))
    assert type(copy) is KVMigrationServerArgs
    assert copy.enable_kv_migration is True
    assert copy.kv_migration_watchdog_timeout == 12.5
    assert copy.kv_migration_protocol == "rdma"
    assert copy.kv_migration_rdma_devices == "mlx5_0"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"enable_hierarchical_cache": False}, "add --enable-hierarchical-cache"),
        ({"kv_migration_watchdog_timeout": 0.0}, "--kv-migration-watchdog-timeout must be"),
        ({"kv_migration_watchdog_timeout": -5.0}, "--kv-migration-watchdog-timeout must be"),
        ({"kv_migration_max_batch_entries": 0}, "--kv-migration-max-batch-entries"),
        ({"pp_size": 2, "nnodes": 2}, "needs every stage on one node"),
        ({"dp_size": 2, "pp_size": 2, "tp_size": 2}, "does not support --pp-size > 1 yet"),
        ({"tokenizer_worker_num": 2}, "drop --tokenizer-worker-num > 1 and --enable-http2"),
        ({"enable_http2": True}, "drop --tokenizer-worker-num > 1 and --enable-http2"),
    ],
)
def test_invalid_flags_are_refused(overrides: dict, expected: str) -> None:
    from sglang_kv_migration.server.server_args import KVMigrationArgsError, KVMigrationServerArgs

    kwargs = {
        "model_path": cpu_harness.write_tiny_model_dir(),
        "skip_tokenizer_init": True,
        "device": "cpu",
        "enable_hierarchical_cache": True,
        "enable_kv_migration": True,
        **overrides,
    }
    with pytest.raises(KVMigrationArgsError) as info:
        KVMigrationServerArgs(**kwargs)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_pipeline_parallel_flags_are_accepted() -> None:
    """--pp-size > 1 on one node is served: every stage answers for its own layers."""
    from sglang_kv_migration.server.server_args import KVMigrationServerArgs

    args = KVMigrationServerArgs(
        model_path=cpu_harness.write_tiny_model_dir(),
        skip_tokenizer_init=True,
        device="cpu",
        enable_hierarchical_cache=True,
        enable_kv_migration=True,
        pp_size=2,
    )
    assert (args.pp_size, args.enable_kv_migration) == (2, True)
    # SGLang's own rule for PP, which our servers inherit.
    assert cpu_harness.resolved_server_args(args).disable_overlap_schedule is True


# Refused on SGLang 0.5.23, naming why: test/unit/test_sglang_0_5_23_refusals.py.
ON_0_5_12_ONLY = pytest.mark.skipif(
    sglang_adapter.is_unified_line(), reason="refused on SGLang 0.5.23 (its refusal tests)"
)


@ON_0_5_12_ONLY
@pytest.mark.parametrize("dp_attention", [False, True])
def test_data_parallel_flags_are_accepted(dp_attention: bool) -> None:
    """--dp-size > 1, with and without DP attention, starts with migration; every
    scheduler process gets the same launch id (the DP ranks' shared epoch)."""
    from sglang_kv_migration.server.server_args import KVMigrationServerArgs

    args = KVMigrationServerArgs(
        model_path=cpu_harness.write_tiny_model_dir(),
        skip_tokenizer_init=True,
        device="cpu",
        enable_hierarchical_cache=True,
        enable_kv_migration=True,
        dp_size=2,
        tp_size=2,
        enable_dp_attention=dp_attention,
    )
    assert (args.dp_size, args.enable_dp_attention) == (2, dp_attention)
    copy = pickle.loads(pickle.dumps(args))
    assert copy.kv_migration_launch_id == args.kv_migration_launch_id != ""
    again = KVMigrationServerArgs(
        model_path=args.model_path,
        skip_tokenizer_init=True,
        device="cpu",
        enable_hierarchical_cache=True,
        enable_kv_migration=True,
    )
    assert again.kv_migration_launch_id != args.kv_migration_launch_id  # a new launch


@ON_0_5_12_ONLY
@pytest.mark.parametrize(("tp_size", "attn_cp_size"), [(2, 2), (4, 2)])
def test_context_parallel_flags_are_accepted(tp_size: int, attn_cp_size: int) -> None:
    """--attn-cp-size > 1 is served: SGLang 0.5.12 keeps every page on every CP rank, so
    ranks pair by tp rank as without CP (docs/protocol.md, "Rank pairing")."""
    from sglang_kv_migration.server.server_args import KVMigrationServerArgs

    args = KVMigrationServerArgs(
        model_path=cpu_harness.write_tiny_model_dir(),
        skip_tokenizer_init=True,
        device="cpu",
        enable_hierarchical_cache=True,
        enable_kv_migration=True,
        tp_size=tp_size,
        attn_cp_size=attn_cp_size,
    )
    assert (args.tp_size, args.attn_cp_size, args.enable_kv_migration) == (
        tp_size,
        attn_cp_size,
        True,
    )


def _launch_server_argv(*argv: str) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", *argv]


def _fresh_interpreter_runs() -> dict[str, tuple[list[str], Path]]:
    """Every command of this module that needs a fresh interpreter (each imports SGLang,
    ~15 s of CPU): name -> (argv, cwd)."""
    model = cpu_harness.write_tiny_model_dir()
    return {
        "register": ([sys.executable, "-c", _REGISTER_SCRIPT], REPO / "test" / "support"),
        "help": (_launch_server_argv("--help"), REPO),
        "no_hicache": (
            _launch_server_argv("--model-path", model, "--device", "cpu", "--enable-kv-migration"),
            REPO,
        ),
        "zero_watchdog": (
            _launch_server_argv(
                "--model-path",
                model,
                "--device",
                "cpu",
                "--enable-hierarchical-cache",
                "--enable-kv-migration",
                "--kv-migration-watchdog-timeout",
                "0",
            ),
            REPO,
        ),
    }


@pytest.fixture(scope="module")
def fresh_interpreters() -> Iterator[dict[str, subprocess.CompletedProcess]]:
    """Runs every fresh-interpreter command at once and waits for all: one at a time,
    each left the other core idle. Output goes to files, so no run blocks on a pipe."""
    # The CPU test environment's .pth hook makes torchvision import beside CPU torch.
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with contextlib.ExitStack() as stack:
        started = {}
        for name, (argv, cwd) in _fresh_interpreter_runs().items():
            out = stack.enter_context(tempfile.TemporaryFile("w+"))
            err = stack.enter_context(tempfile.TemporaryFile("w+"))
            proc = subprocess.Popen(argv, stdout=out, stderr=err, text=True, env=env, cwd=cwd)
            stack.callback(_kill_if_running, proc)
            started[name] = (argv, proc, out, err)
        done = {}
        for name, (argv, proc, out, err) in started.items():
            returncode = proc.wait(timeout=300)
            out.seek(0)
            err.seek(0)
            done[name] = subprocess.CompletedProcess(argv, returncode, out.read(), err.read())
        yield done


def _kill_if_running(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def launch_help(fresh_interpreters) -> subprocess.CompletedProcess:
    return fresh_interpreters["help"]


def test_launch_server_help_lists_the_flags(launch_help: subprocess.CompletedProcess) -> None:
    assert launch_help.returncode == 0, launch_help.stderr[-3000:]
    for flag in (
        "--enable-kv-migration",
        "--kv-migration-watchdog-timeout",
        "--kv-migration-hostname",
        "--kv-migration-protocol",
        "--kv-migration-rdma-devices",
        "--kv-migration-max-batch-entries",
    ):
        assert flag in launch_help.stdout
    # The CPU environment has no sgl_kernel: SGLang's scheduler and HTTP server cannot
    # import there, and hooks on them must not be attempted (one traceback each).
    assert "Traceback" not in launch_help.stderr, launch_help.stderr[-3000:]
    assert "Failed to apply hooks" not in launch_help.stderr


def test_launch_server_refuses_migration_without_hierarchical_cache(fresh_interpreters) -> None:
    proc = fresh_interpreters["no_hicache"]
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        "error: --enable-kv-migration requires --enable-hierarchical-cache (migrated pages "
        "land in the hierarchical cache's host pool); add --enable-hierarchical-cache."
    )


def test_launch_server_refuses_non_positive_watchdog(fresh_interpreters) -> None:
    proc = fresh_interpreters["zero_watchdog"]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--kv-migration-watchdog-timeout must be a positive number" in proc.stderr


def test_flag_off_installs_nothing_on_the_scheduler() -> None:
    """Without --enable-kv-migration the hooks leave the scheduler as upstream made it."""
    from types import SimpleNamespace

    from sglang.utils import TypeBasedDispatcher
    from sglang_kv_migration.server.http import communicators
    from sglang_kv_migration.server.messages import REQUEST_TYPES
    from sglang_kv_migration.server.scheduler import hooks as scheduler_hooks
    from sglang_kv_migration.server.server_args import KVMigrationServerArgs

    args = KVMigrationServerArgs(
        model_path=cpu_harness.write_tiny_model_dir(), skip_tokenizer_init=True, device="cpu"
    )
    dispatcher = TypeBasedDispatcher([])
    scheduler = SimpleNamespace(server_args=args, _request_dispatcher=dispatcher, pp_rank=1)
    scheduler_hooks.after_init_ipc_channels(None, scheduler, SimpleNamespace())
    scheduler_hooks.after_init_request_dispatcher(None, scheduler)
    scheduler_hooks.after_process_input_requests(None, scheduler, [])
    assert scheduler.kv_migration is None
    assert scheduler.kv_migration_stage_reply is None  # no socket opened
    for _name, input_type, _output_type in REQUEST_TYPES:
        assert input_type not in dispatcher._mapping

    tokenizer = SimpleNamespace(_result_dispatcher=TypeBasedDispatcher([]), server_args=args)
    communicators.after_init_communicators(None, tokenizer)
    assert tokenizer.kv_migration_communicators is None
    assert tokenizer._result_dispatcher._mapping == {}


def test_every_hook_takes_the_arguments_its_target_is_called_with() -> None:
    """The registry calls an AFTER hook with (result, *the target's arguments), a BEFORE
    hook with the target's arguments, an AROUND hook with (original, *arguments): each of
    ours must take what the installed SGLang's target is called with (a signature that
    differs between SGLang lines would fail only when a real server starts)."""
    import inspect

    from sglang.srt.plugins.hook_registry import HookType
    from sglang_kv_migration.server import plugin

    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    checked = 0
    table = plugin._hook_table()
    for target, hook, hook_type in table:
        if hook_type == HookType.REPLACE:
            continue
        original = upstream.resolve(target)
        params = inspect.signature(original).parameters.values()
        required = [p for p in params if p.kind in positional and p.default is p.empty]
        leading = {HookType.AFTER: [None], HookType.BEFORE: [], HookType.AROUND: [original]}
        arguments = [*leading[hook_type], *(object() for _ in required)]
        try:
            inspect.signature(hook).bind(*arguments)
        except TypeError as e:
            pytest.fail(f"{hook.__qualname__} cannot take {target}'s arguments: {e}")
        checked += 1
    assert checked == sum(1 for row in table if row[2] != HookType.REPLACE) > 5
