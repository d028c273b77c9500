"""Shared pytest setup: CPU shims first, then fixtures for real SGLang HiCache objects."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# IMPORTANT: the shims must be in place before anything imports sglang, and child
# processes started with "spawn" find cpu_harness through the inherited sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import cpu_harness  # noqa: E402

cpu_harness.install_cpu_shims()
# Before any child process starts: they inherit the tag their temp-dir entries carry.
cpu_harness.session_tag()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if it left model folders or IPC sockets in the temp dir (each test
    helper removes what it made); they are removed here, so runs do not pile them up."""
    leftovers = cpu_harness.leftover_temp_entries()
    if not leftovers:
        return
    import shutil
    import tempfile

    for name in leftovers:
        path = os.path.join(tempfile.gettempdir(), name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = f"the tests left {len(leftovers)} entries in the temp dir: {', '.join(leftovers)}"
    if reporter is not None:
        reporter.write_line(f"ERROR: {message}", red=True)
    else:
        print(f"ERROR: {message}", file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def tp_group() -> object:
    """The single-rank gloo group used as the tp cache group (one per test session)."""
    return cpu_harness.init_gloo()


@pytest.fixture(scope="session")
def migration_peers() -> Iterator[tuple[object, object]]:
    """One source and one target peer process (`_migration_peer.py`), shared by the
    two-process migration modules (spawning one costs a full SGLang import)."""
    from core_peers import peer_pair

    with peer_pair() as pair:
        yield pair


@pytest.fixture
def harness_factory(tp_group: object) -> Iterator[Callable[..., cpu_harness.Harness]]:
    """``make(cfg=None, **fields)`` builds a Harness; every one is closed at teardown."""
    built: list[cpu_harness.Harness] = []

    def make(cfg: cpu_harness.HarnessConfig | None = None, **fields: object) -> cpu_harness.Harness:
        if cfg is None:
            cfg = cpu_harness.HarnessConfig(**fields)  # type: ignore[arg-type]
        elif fields:
            raise TypeError("pass either a HarnessConfig or its fields, not both")
        harness = cpu_harness.build_harness(cfg)
        built.append(harness)
        return harness

    yield make
    for harness in built:
        harness.close()


@pytest.fixture(autouse=True)
def _reset_sglang_hooks() -> Iterator[None]:
    """Drop plugin hooks a test registered, so the next test starts from none.

    Only when a test has imported SGLang's hook registry; importing it here would slow
    down tests that never touch it.
    """
    yield
    registry = sys.modules.get("sglang.srt.plugins.hook_registry")
    if registry is not None:
        registry.HookRegistry.reset()


@pytest.fixture
def side_factory(
    harness_factory: Callable[..., cpu_harness.Harness],
) -> Iterator[Callable[..., object]]:
    """``make(grant_key=None, watchdog_timeout_s=60.0, pp_rank=0, pp_size=1,
    **harness_fields)``: a real one-rank `MigrationSchedulerSide` on a harness cache
    (metrics on; with ``pp_size > 1`` one stage's only rank), replying into
    `side.replies`; `side.harness` is the harness it runs on.

    The watchdog (and with it the grants, at half of it) is long: on a loaded machine a
    loopback write may start seconds after its allocate. A test of an expiry moves the
    side's clock (`side.target.pending.clock`) or asks for a short watchdog and waits past it."""
    from sglang_kv_migration.paths.host.mooncake import TransportConfig
    from sglang_kv_migration.server.diag.metrics import MigrationMetrics
    from sglang_kv_migration.server.rank.settings import RankSettings
    from sglang_kv_migration.server.scheduler.compose import compose_rank
    from sglang_kv_migration.server.scheduler.scheduler_side import MigrationSchedulerSide
    from side_helpers import one_rank_context

    built: list[MigrationSchedulerSide] = []

    def make(
        grant_key: bytes | None = None,
        watchdog_timeout_s: float = 60.0,
        pp_rank: int = 0,
        pp_size: int = 1,
        **fields: object,
    ) -> MigrationSchedulerSide:
        harness = harness_factory(**fields)
        replies: list = []
        ctx = one_rank_context(
            harness.cache, "tiny", lambda out, req: replies.append(out), pp_rank, pp_size
        )
        side = compose_rank(
            ctx,
            RankSettings(
                watchdog_timeout_s=watchdog_timeout_s,
                transport_config=TransportConfig(hostname="127.0.0.1", transfer_timeout_s=5.0),
                metrics=MigrationMetrics("tiny", 0, 0),
                grant_key=grant_key,
            ),
        )
        side.replies = replies  # test-only handles
        side.harness = harness
        built.append(side)
        return side

    yield make
    for side in built:
        side.close()


@pytest.fixture
def side(side_factory: Callable[..., object]) -> object:
    return side_factory(page_size=16)


# Admin key of the shared pair below: the servers sign grants with a key derived from it.
FAULT_PAIR_KEY = "fault-pair-admin-key"


@pytest.fixture(scope="session")
def fault_pair() -> Iterator[tuple[object, object]]:
    """Two CPU mini servers with signed grants, shared by the fault suite and the soak
    (starting servers is most of their time on a small box)."""
    from mini_server import ServerSpec, start_servers

    # 5 s grants: under load (the soak on a shared 2-core box) a write may queue behind
    # others to the same peer for over a second; its grant must not expire meanwhile.
    spec = ServerSpec(admin_api_key=FAULT_PAIR_KEY, grant_ttl_s=5.0)
    a, b = start_servers([spec, spec])
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()
