"""What a one-call transfer body's `device_kv` costs on CPU, in full vs named by digest.

Feature "destination_digest" (`server/source/known_destinations.py`). The description is built
as `cuda_ipc.export_tensor` describes buffers (64 of them: Llama-3-8B's K and V per
layer). Per transfer, both forms interleaved, medians in µs, of each place the body is
handled on its way:

- client: `orjson.dumps` of the body (as `client/http11.py` sends it);
- HTTP layer: `orjson.loads` and `TransferBody` validation (the route's parse);
- hop: pickle and unpickle of the scheduler request (tokenizer manager -> scheduler);
- scheduler: `KnownDestinations.resolve`, the grant's destination digest and `remember`.

    .venv/bin/python benchmark/probes/probe_destination_digest.py [--repeats 500]
"""

from __future__ import annotations

import argparse
import base64
import copy
import os
import pickle
import statistics
import time
from typing import Any

import orjson
from sglang_kv_migration import grants
from sglang_kv_migration.server.messages import TransferRequestKVCacheReqInput
from sglang_kv_migration.server.source.known_destinations import KnownDestinations
from sglang_kv_migration.wire.bodies import TransferBody
from sglang_kv_migration.wire.messages import AllocateOnTarget, TransferRequestKVCacheTarget

BUFFERS = 64  # 32 layers x (K, V)


def _b64(n: int) -> str:
    return base64.b64encode(os.urandom(n)).decode()


def device_kv() -> dict[str, Any]:
    buffer = {
        "storage_size": 1 << 30,
        "storage_offset": 0,
        "ref_counter_offset": 0,
        "event_sync_required": True,
        "offset_bytes": 0,
        "nbytes": 1 << 30,
    }
    return {
        "host_identity": "h" * 36,
        "gpu_uuid": "GPU-" + "0" * 36,
        "instance_id": "i" * 32,
        "row_bytes": [2048] * BUFFERS,
        "num_rows": [106512] * BUFFERS,
        "buffers": [
            {
                **buffer,
                "handle": _b64(64),
                "ref_counter_handle": "/torch_1_" + _b64(6),
                "event_handle": _b64(64),
            }  # fmt: skip
            for _ in range(BUFFERS)
        ],
        "tiers": ["device", "host"],
    }


def body(destination: dict[str, Any]) -> dict[str, Any]:
    fingerprint = {"model": "llama", "page_size": 1, "dtype": "bfloat16", "layers": 32}
    return {
        "input_ids": [7, 8],
        "target_per_rank": [
            {"tp": 0, "pp": 0, "path": "device", "fingerprint": fingerprint, **destination}
        ],
        "partial_ok": True,
        "allocate_on_target": {
            "address": "ipc:///dev/shm/kvmig-alloc-1-2-" + "a" * 32 + "/s",
            "secret": "0" * 32,
            "allocate": {"source_fingerprints": [fingerprint], "path": "device"},
        },
    }


def one(form: dict[str, Any], known: KnownDestinations, times: dict[str, list[float]]) -> None:
    clock = time.perf_counter
    t0 = clock()
    raw = orjson.dumps(form)
    t1 = clock()
    parsed = TransferBody.model_validate(orjson.loads(raw))
    t2 = clock()
    entry = parsed.target_per_rank[0]
    target = TransferRequestKVCacheTarget(
        tp=0, pp=0, path="device", device_kv=entry.device_kv,
        device_kv_digest=entry.device_kv_digest, fingerprint=entry.fingerprint,
    )  # fmt: skip
    req = TransferRequestKVCacheReqInput(
        input_ids=[7, 8],
        target_per_rank=[target],
        allocate_on_target=AllocateOnTarget("a", "0" * 32, b"{}"),
    )
    t3 = clock()
    req = pickle.loads(pickle.dumps(req))
    t4 = clock()
    resolved = req.target_per_rank[0]
    known.resolve(resolved)
    digest = known.digest_of(resolved.device_kv)
    known.remember(resolved, digest)  # (what the source does once the grant verified)
    t5 = clock()
    for name, seconds in (
        ("client", t1 - t0),
        ("http", t2 - t1),
        ("hop", t4 - t3),
        ("scheduler", t5 - t4),
    ):
        times[name].append(seconds)
    times["bytes"].append(len(raw))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=500)
    args = parser.parse_args()
    wire = device_kv()
    digest = grants.destination_digest(wire)
    forms = {"full": body({"device_kv": wire}), "digest": body({"device_kv_digest": digest})}
    known = KnownDestinations()
    known.remember(TransferRequestKVCacheTarget(tp=0, pp=0, path="device", device_kv=wire), digest)
    times: dict[str, dict[str, list[float]]] = {
        name: {k: [] for k in ("client", "http", "hop", "scheduler", "bytes")} for name in forms
    }
    for _ in range(args.repeats):  # interleaved: the same machine state for both
        for name, form in forms.items():
            one(copy.deepcopy(form) if name == "full" else form, known, times[name])
    print(f"{'form':<8} {'bytes':>7} {'client':>8} {'http':>8} {'hop':>8} {'sched':>8} {'sum':>8}")
    for name, t in times.items():
        med = {k: statistics.median(v) * 1e6 for k, v in t.items() if k != "bytes"}
        print(
            f"{name:<8} {int(t['bytes'][0]):>7} {med['client']:>8.1f} {med['http']:>8.1f} "
            f"{med['hop']:>8.1f} {med['scheduler']:>8.1f} {sum(med.values()):>8.1f}"
        )


if __name__ == "__main__":
    main()
