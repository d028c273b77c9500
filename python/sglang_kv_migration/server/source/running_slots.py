"""Feature "running_slots": a live move reads a decoding request's KV from its own slots.

SGLang 0.5.12 inserts nothing into the radix tree while a request decodes, so what a
request generated is, until it stops, only in its `req_to_token_pool` row. A size query
or transfer that names `running_rid` measures and reads that row instead of the tree.

What a body may make this source read: only positions of the request named, only those
whose KV is written, and only when the body's `input_ids` are exactly that request's
tokens there (prompt + output so far): `check` refuses anything else, naming the field.
The grant still binds the target's slots and the digest of those ids, so a client can
neither read another request's slots nor write anything the target did not grant.

IMPORTANT: a transfer reaches `check` only once its grant verified (`validation.py`),
and a refusal names the field, never where the ids differ: a caller must not learn a
running request's tokens from refusals, one position at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.errors import ErrorKind, MigrationError

if TYPE_CHECKING:
    import torch

__all__ = ["RunningSlots"]


class RunningSlots:
    """The source's view of the requests its scheduler runs (one per rank)."""

    def __init__(self, requests: sglang_adapter.RunningRequests, page_size: int):
        self.requests = requests
        self.page_size = page_size

    def held(self, rid: str, input_ids: list[int]) -> int:
        """Size query: the page-aligned prefix of `input_ids` request `rid` holds in its
        slots; -1 when it does not run here or its tokens differ from `input_ids`."""
        running = self.requests.find(rid)
        if running is None or not _is_prefix(input_ids, running.token_ids):
            return -1
        held = min(len(input_ids), running.kv_length)
        return held - held % self.page_size

    def check(self, rid: str, input_ids: list[int], end: int) -> sglang_adapter.RunningRequest:
        """Transfer: the running request whose slots [0, end) may be read for
        `input_ids`; MigrationError naming the field otherwise (nothing was read)."""
        running = self.requests.find(rid)
        if running is None:
            state = "waits in the queue" if self.requests.waiting(rid) else "does not run"
            raise MigrationError(
                ErrorKind.CONFLICT,
                f"running_rid {rid!r} {state} on this source (finished, aborted or unknown): "
                "nothing was read; migrate from the radix tree instead",
            )
        if not _is_prefix(input_ids[:end], running.token_ids):
            raise MigrationError(
                ErrorKind.BAD_REQUEST,
                f"input_ids are not the tokens running_rid {rid!r} holds (its prompt and "
                "output so far): nothing was read",
            )
        if end > running.kv_length:
            raise MigrationError(
                ErrorKind.CONFLICT,
                f"running_rid {rid!r} holds the KV of {running.kv_length} tokens, not of "
                f"{end}: nothing was read",
            )
        return running

    def slots(self, running: sglang_adapter.RunningRequest, start: int, end: int) -> torch.Tensor:
        """The device slots of positions [start, end) of `running`."""
        return self.requests.slots_of(running, start, end)

    def lost(self, running: sglang_adapter.RunningRequest, end: int) -> MigrationError | None:
        """Asked once the copy of positions [0, end) of `running` is done: None while the
        request still holds the slots it held when they were read (the same request,
        running, never finished nor retracted since: only those free a running request's
        slots, so they were its own throughout the copy). Otherwise what the copy read
        may be another request's KV: the error fails the transfer, and the target
        commits nothing."""
        if self.requests.still_holds(running, end):
            return None
        return MigrationError(
            ErrorKind.CONFLICT,
            f"running_rid {running.rid!r} does not run on this source any more with the "
            "slots the copy read (it finished, was aborted or retracted during the copy): "
            "nothing is committed",
        )


def _is_prefix(asked: list[int], held: list[int]) -> bool:
    """Whether `asked` is a prefix of `held` (where they first differ is not kept)."""
    return len(asked) <= len(held) and held[: len(asked)] == asked
