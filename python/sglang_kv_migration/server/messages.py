"""The wire models (`wire/messages.py`) as SGLang requests, for the trip HTTP layer ->
tokenizer manager -> every scheduler rank.

Shaped like SGLang's `io_struct.py`: one `...ReqInput` / `...ReqOutput` pair per
operation, each an SGLang `BaseReq` so SGLang's dispatchers route them (and copy `rid`
and `http_worker_ipc`). They add no field of their own: what they carry is the wire
model's. `sglang_adapter.ipc_message` makes each one the kind of class the installed
SGLang's IPC carries (a dataclass on 0.5.12, a msgspec struct on 0.5.23); copy one with
`replace_message`, never `dataclasses.replace`. They cross processes (pickled, or
msgpack-encoded on 0.5.23): keep them in this module, where the name each is given is
the name it is bound to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from sglang_kv_migration import sglang_adapter
from sglang_kv_migration.wire import messages as wire

_message = partial(sglang_adapter.ipc_message, __name__)
# A copy of a message with changes, whichever kind of class the installed SGLang uses.
replace_message = sglang_adapter.replace_message

GetTransferSessionInfoReqInput = _message("GetTransferSessionInfoReqInput", wire.SessionInfoRequest)
GetTransferSessionInfoReqOutput = _message("GetTransferSessionInfoReqOutput", wire.SessionInfoReply)
GetRequestExtraTokenSizeReqInput = _message(
    "GetRequestExtraTokenSizeReqInput", wire.ExtraTokenSizeRequest
)
GetRequestExtraTokenSizeReqOutput = _message(
    "GetRequestExtraTokenSizeReqOutput", wire.ExtraTokenSizeReply
)
AllocateTokenForTransferReqInput = _message(
    "AllocateTokenForTransferReqInput", wire.AllocateRequest
)
AllocateTokenForTransferReqOutput = _message(
    "AllocateTokenForTransferReqOutput", wire.AllocateReply
)
TransferRequestKVCacheReqInput = _message("TransferRequestKVCacheReqInput", wire.TransferRequest)
TransferRequestKVCacheReqOutput = _message("TransferRequestKVCacheReqOutput", wire.TransferReply)
CommitTransferRequestKVCacheReqInput = _message(
    "CommitTransferRequestKVCacheReqInput", wire.CommitRequest
)
CommitTransferRequestKVCacheReqOutput = _message(
    "CommitTransferRequestKVCacheReqOutput", wire.CommitReply
)
AbortTransferReqInput = _message("AbortTransferReqInput", wire.AbortRequest)
AbortTransferReqOutput = _message("AbortTransferReqOutput", wire.AbortReply)


@dataclass
class StageSync:
    """PP stage 0 -> later stages, in the request stream: the allocations and quarantines
    its watchdog freed, so every stage frees the same ids at the same point."""

    expired_ids: list[str] = field(default_factory=list)


StageSyncReqInput = _message("StageSyncReqInput", StageSync)

# Every (input, output) pair, in protocol order. The scheduler side and the tokenizer
# communicators are built from this one table.
REQUEST_TYPES: list[tuple[str, type, type]] = [
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

__all__ = [
    "REQUEST_TYPES",
    "AbortTransferReqInput",
    "AbortTransferReqOutput",
    "AllocateTokenForTransferReqInput",
    "AllocateTokenForTransferReqOutput",
    "CommitTransferRequestKVCacheReqInput",
    "CommitTransferRequestKVCacheReqOutput",
    "GetRequestExtraTokenSizeReqInput",
    "GetRequestExtraTokenSizeReqOutput",
    "GetTransferSessionInfoReqInput",
    "GetTransferSessionInfoReqOutput",
    "StageSyncReqInput",
    "TransferRequestKVCacheReqInput",
    "TransferRequestKVCacheReqOutput",
    "replace_message",
]
