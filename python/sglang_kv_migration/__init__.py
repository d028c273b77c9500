"""Runtime KV-cache migration between SGLang servers (overlay plugin for sglang==0.5.12).

Reading order: see README.md in this folder.
"""

__version__ = "0.1.0"

# Wire-protocol version carried by every cross-server message.
# History:
#   1 - host pool -> host pool over Mooncake TE.
#   2 - data paths: session info lists each rank's `paths` (device: CUDA IPC on one host;
#       host: Mooncake) and a `server_epoch`; allocate takes `path`, `index_format`
#       ("pages" puts page ids on the wire) and `nothing_ok`; transfer targets carry
#       `path`, `kv_pages`, `device_kv`. Protocol-1 fields keep their meaning.
# Additions no older peer can receive are advertised in session info `features` instead
# of a version bump (clients use one only when both servers list it): "page_ranges",
# "bound_grants" (allocate's `source_instance`; grants bind destination and source),
# "partial_transfer", "binary_ids", "source_commit", "epoch_check", "source_allocate",
# "destination_digest", "transfer_batch", "dp_ranks" (`io_types.py`).
PROTOCOL_VERSION = 2

# Wire feature: allocate takes `expect_epoch` (the target's session info `server_epoch`)
# and refuses a stale one before it reserves anything.
EPOCH_CHECK_FEATURE = "epoch_check"

# Wire feature: `/transfer_request_kvcache` takes `{"moves": [transfer, ...]}`, several
# transfers in one call (`server/http/routes.py`, `TransferBatchBody`).
TRANSFER_BATCH_FEATURE = "transfer_batch"

# Wire feature: session info lists every data-parallel rank's scheduler ranks (`dp_rank`
# per rank, `dp_size`); size query, allocate and transfer take an optional `dp_rank` and
# their replies name the DP rank they used (`server/http/dp_ranks.py`).
DP_RANKS_FEATURE = "dp_ranks"
