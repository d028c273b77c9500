"""Helpers for tests that drive a one-rank `MigrationSchedulerSide` directly."""

from __future__ import annotations


def transfer_to_self(side: object, input_ids: list[int], kv_indices: list[int], **fields: object):
    """A transfer request from `side` into its own host slots `kv_indices` (loopback)."""
    from sglang_kv_migration.io_types import (
        TransferRequestKVCacheReqInput,
        TransferRequestKVCacheTarget,
    )

    target = TransferRequestKVCacheTarget(
        tp=0,
        pp=0,
        session_id=side.transport.session_id,
        host_kv_data_ptrs=side.layout.data_ptrs,
        host_kv_data_lens=side.layout.data_lens,
        host_kv_item_lens=side.layout.item_lens,
        kv_indices=kv_indices,
        fingerprint=side.fingerprint.to_dict(),
    )
    return TransferRequestKVCacheReqInput(
        input_ids=input_ids,
        matched_token_size=0,
        extra_token_size=len(kv_indices),
        target_per_rank=[target],
        **fields,
    )
