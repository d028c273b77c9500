"""The boundary every data path implements: where migrated KV lands and how it moves.

Three implementations, chosen by name (`--kv-migration-paths`, preference order):

- `device` (`device/path.py`): into the target's GPU through CUDA IPC when both servers
  share a host; commit inserts ordinary device radix nodes.
- `shared_host` (`shared_host/path.py`): into the target's host pool, which it keeps in
  memory a same-host source maps, written from the source's GPU or host pool at memory
  speed (the landing when the target's GPU has no room); commit inserts host-only radix
  nodes, which HiCache loads back as its own.
- `host` (`host/path.py`): host pool -> host pool through the Mooncake Transfer Engine
  (RDMA across hosts, TCP without RDMA); commit inserts host-only radix nodes.

A path plays both roles on every rank. As a **target** it reserves slots for a pending
migration, releases them, and inserts them into the radix tree on commit; the pending
registry (`pending.py`) drives those calls and owns the state machine. As a **source**
it starts a `SendJob` per migration, which the scheduler loop polls (`source/transfers.py`)
in the style of SGLang's disaggregation `KVPoll`.

Call contracts (all methods run on the scheduler thread, in the same order on every TP
rank, unless said otherwise):
- `advertise()` is side-effect free; its dict is published per rank by
  `/get_transfer_session_info` under `paths[<name>]`.
- `held_prefix()` says how much of a key this server already holds *for this path*
  (the host path counts device and host pages, the device path device pages only).
- `reserve(n)` returns exactly `n` slots (whole pages) or raises
  `MigrationError(UNAVAILABLE)` having evicted nothing.
- `release(slots)` and `insert(...)` are each called at most once per reservation.
- `start_send(...)` validates and pins; it raises `MigrationError` before anything moved.
- `SendJob.poll()` never blocks. WAITING must be left on every rank in the same loop
  iteration (the host path waits for device->host copies, which retire in lockstep);
  `release()` is called exactly once, after the job reported SUCCESS or FAILED.

The host path's target also has a staging arena (`TargetStaging`, opened by
`factory.open_staging`): fragmented slots are written into one of its extents and
scattered into the slots at commit.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from sglang_kv_migration.errors import ErrorKind, MigrationError

if TYPE_CHECKING:
    from concurrent.futures import Future

    import torch
    from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

    from sglang_kv_migration.cp_owners import OwnerRun
    from sglang_kv_migration.sglang_adapter import HeldPrefix
    from sglang_kv_migration.wire.messages import TransferRequestKVCacheTarget

logger = logging.getLogger(__name__)

HOST = "host"
DEVICE = "device"
SHARED_HOST = "shared_host"
PATH_NAMES: tuple[str, ...] = (DEVICE, SHARED_HOST, HOST)

# Routes a send's bytes take (`SendStats.routes`), reported on `/metrics` by these names;
# the client's cost model (`rollout/cost_model.py`) prices each by the same names.
ROUTE_GPU_TO_GPU = "gpu_to_gpu"  # device path: pages on the source's GPU
ROUTE_HOST_TO_GPU = "host_to_gpu"  # device path: pages only in the source's pinned host pool
ROUTE_LANDING = "landing"  # into a landing buffer on the target's GPU, scattered from there
ROUTE_HOST_TO_HOST = "host_to_host"  # host path: host pool -> host pool (transfer engine)
# Shared-host path: the source's GPU pages, and its host-only pages, into the target's
# host pool mapped in the source (both written by the source's GPU where it has one).
ROUTE_GPU_TO_SHARED_HOST = "gpu_to_shared_host"
ROUTE_HOST_TO_SHARED_HOST = "host_to_shared_host"
ROUTE_NAMES: tuple[str, ...] = (
    ROUTE_GPU_TO_GPU,
    ROUTE_HOST_TO_GPU,
    ROUTE_LANDING,
    ROUTE_HOST_TO_HOST,
    ROUTE_GPU_TO_SHARED_HOST,
    ROUTE_HOST_TO_SHARED_HOST,
)


# The plan of a write into a granted staging extent, as the source's signed receipt names
# it (`SendStats.plan`): the target scatters that rank's extent before it inserts.
STAGED_PLAN = "staged"


class KVPoll(IntEnum):
    """Where one rank's send stands (after SGLang's disaggregation `KVPoll`)."""

    FAILED = 0
    WAITING = 1  # pages not readable yet (device->host copies in flight)
    TRANSFERRING = 2
    SUCCESS = 3


@dataclass
class SendStats:
    bytes: int = 0
    seconds: float = 0.0  # time the path spent moving bytes (not queueing)
    plan: str = ""  # host path: how the write was shaped (staging.PlanKind)
    entries: int = 0  # host path: transfer-engine entries the write needed
    digest: str = ""  # `verify.py` digest of the pages sent, when the send asked for one
    # Where the time went, seconds (host path: "host_copies" plus the transport's steps).
    steps: dict[str, float] = field(default_factory=dict)
    # Per route (ROUTE_NAMES), (bytes, seconds moving them) on this rank; the rest of the
    # send's time is its fixed cost (`source/transfers.py` reports both on /metrics).
    routes: dict[str, tuple[int, float]] = field(default_factory=dict)


@dataclass
class SendRange:
    """What one source rank sends: tokens [start, end) of `input_ids` to `target`."""

    input_ids: list[int]
    extra_key: str | None
    start: int
    end: int
    target: TransferRequestKVCacheTarget
    target_slots: torch.Tensor  # int64 token slots on the target rank, one per token
    migration_id: str
    # From the grant (unix time): no write starts after `start_by`, no bytes are submitted
    # after `write_until`; `verify` asks for a digest of what was sent (`SendStats.digest`).
    start_by: float = float("inf")
    write_until: float = float("inf")
    verify: bool = False
    # Send what this source holds of [start, end), whole pages from `start` (feature
    # "partial_transfer"); else a source that holds less refuses (CONFLICT).
    partial_ok: bool = False
    # What `DataPath.prepare_send` did for this send while the target allocated, if
    # anything: `start_send` takes it over or leaves it to its caller to release.
    prepared: PreparedSend | None = None
    # Feature "running_slots": the device slots of tokens [0, end), one per token, read
    # from a running request's own row instead of from the radix tree.
    source_slots: torch.Tensor | None = None
    # Owner-sharded CP (`cp_owners.py`): the owner of each page of [start, end), as the
    # target allocated them; this rank sends only its own (None: every page).
    owner_pattern: tuple[int, ...] | None = None
    cp_rank: int = 0

    def owned_offsets(self, num_tokens: int, page_size: int) -> list[int] | None:
        """Token offsets (from `start`) of the pages of the first `num_tokens` this rank
        sends: those it owns; None when it sends them all (no owner pattern)."""
        if self.owner_pattern is None:
            return None
        from sglang_kv_migration.cp_owners import owned_pages

        return owned_pages(self.owner_pattern, self.cp_rank, page_size, num_tokens)

    def owned_page_positions(self, num_pages: int) -> list[int] | None:
        """Positions (from `start`'s page) of the first `num_pages` pages this rank owns
        and sends; None when it sends them all (no owner pattern)."""
        if self.owner_pattern is None:
            return None
        from sglang_kv_migration.cp_owners import owned_positions

        return owned_positions(self.owner_pattern[:num_pages], self.cp_rank)

    def cut_to(self, held: int, where: str) -> SendRange:
        """This send, ending where the source's `held` page-aligned prefix ends when that
        is short of `end` (`partial_ok`; at `start` when it holds nothing past it), else
        itself; CONFLICT when the source holds less and the send is not partial."""
        if held >= self.end:
            return self
        if not self.partial_ok:
            raise MigrationError(
                ErrorKind.CONFLICT,
                f"source holds only {held} of {self.end} tokens {where} (evicted since it "
                "was measured?)",
            )
        end = max(self.start, held)
        return dataclasses.replace(
            self, end=end, target_slots=self.target_slots[: end - self.start]
        )


class PreparedSend(abc.ABC):
    """Work a path did for a send before the target's slots were known (the device path:
    the radix match, and the pin that keeps what it matched); `release()` is idempotent."""

    seconds: float = 0.0  # how long the preparation took (the reply's `prepare` step)

    @abc.abstractmethod
    def release(self) -> None: ...


class SendJob(abc.ABC):
    """One rank's send of one migration."""

    error: MigrationError | None = None
    stats: SendStats
    # Tokens [start, end) it sends: less than asked only for a partial send (`cut_to`).
    end: int

    @abc.abstractmethod
    def poll(self) -> KVPoll:
        """Advance without blocking; FAILED sets `error`, SUCCESS sets `stats`."""

    @abc.abstractmethod
    def release(self) -> None:
        """Unpin what `start_send` pinned. Called exactly once, when the job is over."""

    @property
    def waiting(self) -> bool:
        """True while the job waits for pages (identical on every TP rank)."""
        return False

    @property
    def started_writing(self) -> bool:
        """True once a write may have reached the target (then only completion settles it)."""
        return True

    @property
    def waits_on_helper(self) -> bool:
        """True while the job waits for work on a helper thread of this process, which
        needs the scheduler thread to hand it the GIL (`server/scheduler/loop.py`)."""
        return False

    @property
    def completion_event(self) -> Any:
        """Where the job now waits only for its copy on the GPU: the event (with a
        non-blocking `query()`) after which `poll` reports it done; else None."""
        return None


class NothingWritten(SendJob):
    """A send that writes nothing and is done at once, its range accounted for up to
    `end`: a partial send of a source that holds nothing past its start (`end` = the
    range's start), or an owner-sharded CP rank's send of a range none of whose pages it
    owns (`SendRange.owner_pattern`; `end` = the range's end: its twin on the target is
    written nothing either)."""

    def __init__(self, end: int):
        self.end = end
        self.stats = SendStats()

    def poll(self) -> KVPoll:
        return KVPoll.SUCCESS

    def release(self) -> None:
        pass

    @property
    def started_writing(self) -> bool:
        return False


class DataPath(abc.ABC):
    """One way of moving KV between servers (see the module docstring)."""

    name: ClassVar[str]

    # ------------------------------------------------------------------ both roles

    @abc.abstractmethod
    def advertise(self) -> dict[str, Any]:
        """This rank's endpoint for peers, published in session info."""

    @abc.abstractmethod
    def destination_of(self, target: TransferRequestKVCacheTarget) -> dict[str, Any]:
        """Source role: the part of a transfer body's target entry that says where the
        bytes go, shaped as this path's `advertise()` (the grant binds its digest)."""

    def close(self) -> None:  # noqa: B027 - optional: paths without resources keep it
        """Release process-wide resources (engines, opened peer buffers). Idempotent."""

    # ------------------------------------------------------------------ target role

    @abc.abstractmethod
    def held_prefix(self, input_ids: list[int], extra_key: str | None) -> HeldPrefix:
        """The page-aligned prefix this server keeps (locks) when it receives the rest."""

    @abc.abstractmethod
    def reserve(self, num_tokens: int, owners: OwnerRun | None = None) -> torch.Tensor:
        """Slots for `num_tokens` tokens, whole pages, in prefix order. `owners`: on an
        owner-sharded CP server, the CP rank each page must belong to (`cp_owners.py`)."""

    @abc.abstractmethod
    def release(self, slots: torch.Tensor) -> None:
        """Give reserved slots back (abort, expiry, or the surplus of a lost race)."""

    @abc.abstractmethod
    def retake(self, slots: torch.Tensor) -> None:
        """Take `slots` out of the free list again after a cache reset freed them all
        (they stay quarantined while a granted write may still land)."""

    @abc.abstractmethod
    def insert(
        self, anchor: TreeNode, key: RadixKey, anchor_length: int, slots: torch.Tensor
    ) -> int:
        """Insert key[anchor_length:] holding `slots`; return how many leading tokens were
        already present (the caller releases `slots[:returned]`)."""

    def content_digest(self, slots: torch.Tensor) -> str:
        """`verify.py` digest of what the reserved `slots` hold now (target side of the
        opt-in verify), in the same order as the source's `SendStats.digest`."""
        raise MigrationError(ErrorKind.CONFLICT, f"the {self.name} path cannot verify")

    @property
    def holds_device_slots(self) -> bool:
        """Reserved slots come from the device allocator (SGLang's leak check counts them)."""
        return False

    @property
    def late_write_margin_s(self) -> float:
        """How long after a grant's deadline a write started before it may still land."""
        return 0.0

    @property
    def late_writes_reach_slots(self) -> bool:
        """A late write would land in the reserved slots themselves (so they wait in
        quarantine); False when sources write elsewhere first (a landing arena)."""
        return True

    def open_write_streams(self) -> frozenset[int]:
        """Inbound streams open now that may carry a write granted earlier (the host
        path over TCP: `tcp_streams.py`); none for paths whose writes end on time."""
        return frozenset()

    def close_write_streams(self, streams: frozenset[int]) -> frozenset[int]:
        """Close those of `streams` still open; returns them (empty: none is left)."""
        return frozenset()

    # ------------------------------------------------------------------ memory saver

    def quiesce(self) -> None:  # noqa: B027 - optional: paths without GPU work keep it
        """Wait for this rank's copies in flight (before SGLang unmaps the KV pool)."""

    def release_memory(self) -> None:  # noqa: B027 - optional
        """The KV cache memory was released (`/release_memory_occupation`)."""

    def resume_memory(self) -> None:  # noqa: B027 - optional
        """The KV cache memory is back (`/resume_memory_occupation`)."""

    # ------------------------------------------------------------------ source role

    @abc.abstractmethod
    def start_send(self, send: SendRange) -> SendJob:
        """Validate the peer data, pin the source pages, start (or queue) the copy."""

    @contextlib.contextmanager
    def launching_together(self) -> Iterator[None]:
        """Optional: sends started inside may queue their copies and launch them together
        when the block ends (one launch for every send into one target), instead of one
        launch each. A job whose queued launch failed reports it from `poll()`. Called
        around the sends a scheduler iteration starts at once; nestable."""
        yield

    def prepare_send(self, input_ids: list[int], extra_key: str | None) -> PreparedSend | None:
        """Optional, while a target allocates (feature "source_allocate"): the part of a
        later `start_send` of a prefix of `input_ids` that needs no target slots. None:
        nothing prepared. Raises what the same step of `start_send` would."""
        return None


class TargetStaging(Protocol):
    """The target's staging arena on one rank (host path): registered with the rank's
    transport and published; a fragmented allocation is granted an extent of it, which
    the source writes in a few large entries and the commit scatters into the slots.
    Called on the scheduler thread; the scatter runs on a worker."""

    @property
    def region(self) -> list[int]:
        """``[addr, length]`` of the whole arena, published in the session info."""
        ...

    def grant(self, slots: torch.Tensor, now: float) -> tuple[int, int] | None:
        """An extent ``(addr, length)`` for writing ``slots`` staged, or None (the slots
        are not fragmented enough, or there is no room: the source writes direct)."""
        ...

    def scatter(self, extent: tuple[int, int], slots: torch.Tensor) -> Future[None]:
        """Copy what is not copied yet of the extent into ``slots`` (worker thread)."""
        ...

    def release(self, extent: tuple[int, int], not_before: float | None = None) -> None:
        """Give the extent back, reusable from `not_before` (a granted write may still
        land until then); stops any copy into the migration's slots first."""
        ...

    def close(self) -> None:
        """After the transport it was registered with."""
        ...


def parse_path_names(spec: str | Sequence[str]) -> tuple[str, ...]:
    """`"device,host"` -> ("device", "host"); raises ValueError naming a bad entry."""
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec)]
    names = [n for n in names if n]
    if not names:
        raise ValueError(f"at least one data path is needed ({', '.join(PATH_NAMES)})")
    for n in names:
        if n not in PATH_NAMES:
            raise ValueError(f"unknown data path {n!r} (known: {', '.join(PATH_NAMES)})")
    if len(set(names)) != len(names):
        raise ValueError(f"data path listed twice in {','.join(names)}")
    return tuple(names)
