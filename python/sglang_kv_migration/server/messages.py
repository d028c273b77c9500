"""The wire models (`wire/messages.py`) as SGLang requests, for the trip HTTP layer ->
tokenizer manager -> every scheduler rank.

Shaped like SGLang's `io_struct.py`: one `...ReqInput` / `...ReqOutput` pair per
operation, each deriving from `BaseReq` so SGLang's communicators route them (and copy
`rid` and `http_worker_ipc`). They add no field of their own: what they carry is the
wire model's. Pickled between processes: keep them in this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang.srt.managers.io_struct import BaseReq

from sglang_kv_migration.wire import messages as wire


@dataclass
class GetTransferSessionInfoReqInput(wire.SessionInfoRequest, BaseReq):
    pass


@dataclass
class GetTransferSessionInfoReqOutput(wire.SessionInfoReply, BaseReq):
    pass


@dataclass
class GetRequestExtraTokenSizeReqInput(wire.ExtraTokenSizeRequest, BaseReq):
    pass


@dataclass
class GetRequestExtraTokenSizeReqOutput(wire.ExtraTokenSizeReply, BaseReq):
    pass


@dataclass
class AllocateTokenForTransferReqInput(wire.AllocateRequest, BaseReq):
    pass


@dataclass
class AllocateTokenForTransferReqOutput(wire.AllocateReply, BaseReq):
    pass


@dataclass
class TransferRequestKVCacheReqInput(wire.TransferRequest, BaseReq):
    pass


@dataclass
class TransferRequestKVCacheReqOutput(wire.TransferReply, BaseReq):
    pass


@dataclass
class CommitTransferRequestKVCacheReqInput(wire.CommitRequest, BaseReq):
    pass


@dataclass
class CommitTransferRequestKVCacheReqOutput(wire.CommitReply, BaseReq):
    pass


@dataclass
class AbortTransferReqInput(wire.AbortRequest, BaseReq):
    pass


@dataclass
class AbortTransferReqOutput(wire.AbortReply, BaseReq):
    pass


@dataclass
class StageSyncReqInput(BaseReq):
    """PP stage 0 -> later stages, in the request stream: the allocations and quarantines
    its watchdog freed, so every stage frees the same ids at the same point."""

    expired_ids: list[str] = field(default_factory=list)


# Every (input, output) pair, in protocol order. The scheduler side and the tokenizer
# communicators are built from this one table.
REQUEST_TYPES: list[tuple[str, type[BaseReq], type[BaseReq]]] = [
    (
        "get_transfer_session_info",
        GetTransferSessionInfoReqInput,
        GetTransferSessionInfoReqOutput,
    ),
    (
        "get_request_extra_token_size",
        GetRequestExtraTokenSizeReqInput,
        GetRequestExtraTokenSizeReqOutput,
    ),
    (
        "allocate_token_for_transfer",
        AllocateTokenForTransferReqInput,
        AllocateTokenForTransferReqOutput,
    ),
    (
        "transfer_request_kvcache",
        TransferRequestKVCacheReqInput,
        TransferRequestKVCacheReqOutput,
    ),
    (
        "commit_transfer_request_kvcache",
        CommitTransferRequestKVCacheReqInput,
        CommitTransferRequestKVCacheReqOutput,
    ),
    ("abort_transfer", AbortTransferReqInput, AbortTransferReqOutput),
]
