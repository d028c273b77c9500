"""What the migration handlers need from one scheduler rank, and the cross-rank helpers.

SGLang broadcasts every control request to all TP ranks of a stage; only the first
rank's reply reaches the tokenizer manager. Handlers therefore exchange their per-rank
parts with `all_gather` on the stage's TP CPU (gloo) group. IMPORTANT: every rank must
enter each collective the same number of times in the same order.

PP stages see a request one after the other (`pp_stages.py`), so collectives spanning
stages run only at start-up (`all_gather_world`), never in a handler.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from sglang_kv_migration.errors import ErrorKind, MigrationError, detached
from sglang_kv_migration.fingerprint import LayoutFingerprint, explain

if TYPE_CHECKING:
    from sglang.srt.managers.io_struct import BaseReq
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class RankContext:
    """One scheduler rank, decoupled from SGLang's `Scheduler` (tests drive it directly)."""

    tree_cache: HiRadixCache
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    cpu_group: Any  # torch.distributed ProcessGroup spanning this stage's TP ranks, or None
    model: str  # model identity for the layout fingerprint
    # (output, request it answers): SGLang's socket on stage 0, ours on later stages, a
    # no-op on every TP rank but the first.
    send_output: Callable[[BaseReq, BaseReq], None]
    world_group: Any = None  # CPU group over every (tp, pp) rank; None: `cpu_group`
    # Shared by every scheduler of one server launch (`KVMigrationServerArgs`): the DP
    # ranks of a `--dp-size N` server, which share no process group, take it as the
    # server's epoch. "" : the first rank mints one at start-up.
    launch_id: str = ""
    # This scheduler's data-parallel rank (0 without DP): a grant naming a DP rank is
    # claimed only there, and receipts of such grants name it (feature "source_dp_rank").
    dp_rank: int = 0
    # --served-model-name where it was set apart from the path, else "" (fingerprint).
    model_name: str = ""

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    def all_gather_world(self, obj: Any) -> list[Any]:
        """Every (tp, pp) rank's `obj`. Start-up only: stages run handlers at different
        times, so a collective across stages inside a handler would deadlock."""
        if self.world_group is None:
            return self.all_gather(obj)
        return _all_gather(self.world_group, obj)

    def all_gather(self, obj: Any) -> list[Any]:
        """Every TP rank's `obj` in this stage, in tp_rank order ([obj] on a single rank)."""
        if self.cpu_group is None:
            return [obj]
        return _all_gather(self.cpu_group, obj)

    # ------------------------------------------------------------------ agreement steps
    # Each step is one collective over the stage's TP ranks (every rank enters it, in the
    # same order) and gives every rank the same answer.

    def all_ranks_agree(self, ok: bool) -> bool:
        """All ranks agree that `ok` holds: True only when it does on every rank."""
        return all(self.all_gather(ok))

    def first_error_on_any_rank(self, error: T | None) -> T | None:
        """The first rank's (tp order) error, None when no rank has one."""
        return next((e for e in self.all_gather(error) if e is not None), None)

    def first_error_and_any_flag(self, error: T | None, flag: bool) -> tuple[T | None, bool]:
        """`first_error_on_any_rank(error)` and whether `flag` holds on any rank, in one
        collective."""
        gathered = self.all_gather((error, flag))
        first = next((e for e, _ in gathered if e is not None), None)
        return first, any(f for _, f in gathered)

    def first_failure_on_any_rank(self, output: T) -> tuple[list[T], T | None]:
        """Every rank's output (tp order), and the first with `success` False (None when
        every rank succeeded)."""
        outputs = self.all_gather(output)
        return outputs, next((o for o in outputs if not o.success), None)  # type: ignore[attr-defined]

    def union_on_all_ranks(self, ids: list[str]) -> list[str]:
        """The ids any rank named, sorted: every rank then acts on the same ones."""
        return sorted({i for rank_ids in self.all_gather(ids) for i in rank_ids})

    def first_rank_value_on_world(self, obj: T) -> T:
        """The first (tp, pp) rank's `obj` on every rank (start-up only)."""
        return self.all_gather_world(obj)[0]

    def merged_on_world(self, mapping: dict[str, T]) -> dict[str, T]:
        """Every (tp, pp) rank's `mapping` merged (later ranks win a key; start-up only)."""
        return {k: v for rank in self.all_gather_world(mapping) for k, v in rank.items()}


def _all_gather(group: Any, obj: Any) -> list[Any]:
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world == 1:
        return [obj]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def guarded(run: Callable[[], Any], output_type: type) -> Any:
    """Run a handler body; turn every exception into a failed output of `output_type`."""
    try:
        return run()
    except MigrationError as e:
        return output_type(success=False, message=e.message, error_kind=e.kind.value)
    except Exception as e:
        logger.exception("KV migration handler %s failed", output_type.__name__)
        return output_type(
            success=False,
            message=f"internal error: {type(e).__name__}: {e}",
            error_kind=ErrorKind.INTERNAL.value,
        )


def error_of(run: Callable[[], None]) -> MigrationError | None:
    """Run a step; return its error as a `MigrationError` instead of raising it.

    IMPORTANT: returned without its traceback (`errors.detached`): callers keep it in a
    transfer's record, which the traceback's frames hold."""
    try:
        run()
        return None
    except MigrationError as e:
        return detached(e)
    except ValueError as e:  # layout planning rejects inconsistent peer data
        return MigrationError(ErrorKind.BAD_REQUEST, str(e))
    except Exception as e:
        logger.exception("KV migration step failed")
        return MigrationError(ErrorKind.INTERNAL, f"{type(e).__name__}: {e}")


def check_peer_fingerprint(
    mine: LayoutFingerprint, peer_fingerprints: list[dict], role: str
) -> None:
    """Compare this rank's fingerprint with the `role` peer rank at the same (tp, pp).
    Owner-sharded CP ranks compare their owner function too (`cp_owner`): each moves only
    the pages it owns, to its twin (`server/source/owned_pages.py`)."""
    for raw in peer_fingerprints:
        if _same_as(raw, mine.wire):  # the usual case: no parse, no field-by-field walk
            return
        try:
            peer = LayoutFingerprint.from_dict(raw)
        except ValueError as e:
            raise MigrationError(ErrorKind.BAD_REQUEST, f"{role} fingerprint: {e}") from None
        if (peer.tp_rank, peer.pp_rank) == (mine.tp_rank, mine.pp_rank):
            this_side = "target" if role == "source" else "source"
            mismatch = peer.first_mismatch(mine, self_name=role, other_name=this_side)
            if mismatch is not None:
                raise MigrationError(
                    ErrorKind.CONFLICT,
                    f"KV layouts differ between {role} and this server: {explain(mismatch)}",
                )
            return
    raise MigrationError(
        ErrorKind.BAD_REQUEST,
        f"no {role} fingerprint for tp_rank={mine.tp_rank} pp_rank={mine.pp_rank} "
        f"({len(peer_fingerprints)} given)",
    )


def _same_as(raw: Any, wire: dict[str, Any]) -> bool:
    """`raw` is exactly `wire`: equal, and no value of another type (True == 1, 1.0 == 1
    compare equal; `from_dict` would refuse them)."""
    return (
        isinstance(raw, dict)
        and raw == wire
        and all(type(raw[k]) is type(v) for k, v in wire.items())
    )
