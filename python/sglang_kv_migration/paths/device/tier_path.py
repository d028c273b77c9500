"""What the two paths that copy a send's pages from where they lie on this server share
as a `DataPath`: the device path (`path.py`) and the shared-host path
(`paths/shared_host/path.py`). Each is a target role of its own (`TargetRole`: the
device path's `target_side.py`, the shared-host path's) and a `TierSource` source role
(`tier_source.py`) over one `TierCopier`; this class hands each call to its role.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.paths.base import DataPath, PreparedSend, SendJob, SendRange

if TYPE_CHECKING:
    import torch
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

    from sglang_kv_migration.cp_owners import OwnerRun
    from sglang_kv_migration.paths.device.tier_copies import TierCopier
    from sglang_kv_migration.paths.device.tier_source import TierSource


class TargetRole(Protocol):
    """A path's target role: `DataPath`'s target-role calls, with the same contracts."""

    def held_prefix(
        self, input_ids: list[int], extra_key: str | None
    ) -> sglang_adapter.HeldPrefix: ...

    def reserve(self, num_tokens: int, owners: OwnerRun | None = None) -> torch.Tensor: ...

    def release(self, slots: torch.Tensor) -> None: ...

    def retake(self, slots: torch.Tensor) -> None: ...

    def insert(
        self, anchor: TreeNode, key: RadixKey, anchor_length: int, slots: torch.Tensor
    ) -> int: ...

    def content_digest(self, slots: torch.Tensor) -> str: ...


class TierPath(DataPath):
    """A `DataPath` of a target role and a `TierSource` source role (see the module
    docstring); a subclass builds the two and says what it advertises."""

    cache: HiRadixCache
    target: TargetRole
    source: TierSource
    copier: TierCopier  # the source's

    # ------------------------------------------------------------------ both roles

    def close(self) -> None:
        self.source.close()

    # ------------------------------------------------------------------ memory saver

    def quiesce(self) -> None:
        """Wait for the copies this rank launched as a source (before SGLang unmaps the
        KV pool they read)."""
        self.copier.synchronize()

    # ------------------------------------------------------------------ target role

    def held_prefix(self, input_ids: list[int], extra_key: str | None) -> sglang_adapter.HeldPrefix:
        return self.target.held_prefix(input_ids, extra_key)

    def reserve(self, num_tokens: int, owners: OwnerRun | None = None) -> torch.Tensor:
        return self.target.reserve(num_tokens, owners)

    def release(self, slots: torch.Tensor) -> None:
        self.target.release(slots)

    def retake(self, slots: torch.Tensor) -> None:
        self.target.retake(slots)

    def insert(
        self, anchor: TreeNode, key: RadixKey, anchor_length: int, slots: torch.Tensor
    ) -> int:
        return self.target.insert(anchor, key, anchor_length, slots)

    def content_digest(self, slots: torch.Tensor) -> str:
        return self.target.content_digest(slots)

    @property
    def late_write_margin_s(self) -> float:
        # The copy is launched before the grant's deadline and runs for milliseconds
        # (a CPU server copies within the launch).
        return 2.0

    # ------------------------------------------------------------------ source role

    def start_send(self, send: SendRange) -> SendJob:
        return self.source.start_send(send)

    @contextlib.contextmanager
    def launching_together(self) -> Iterator[None]:
        with self.source.launching_together():
            yield

    def prepare_send(self, input_ids: list[int], extra_key: str | None) -> PreparedSend:
        return self.source.prepare_send(input_ids, extra_key)
