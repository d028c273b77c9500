"""Raw device-path copy between two processes (GPU machine only): no SGLang, just
`sglang_kv_migration.paths.device.cuda_ipc` and the page copy the device path runs.

A "target" process allocates Llama-3-8B-shaped per-layer KV buffers (64 buffers of
`rows` x 2 KiB) and exports them; a "source" process with its own buffers maps them
through CUDA IPC into its GPU 0 and copies N random pages into random target pages of
every buffer, twice: with torch (index_select + index_copy_ per buffer) and with the
fused Triton kernel the device path uses (`page_copy.copy_pages`). The target checks
the bytes. Reports GB/s, on one GPU or from GPU 0 into GPU 1.

    python3 benchmark/probes/probe_cuda_ipc.py --tokens 32768 [--target-gpu 1]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

LAYERS, ROW_BYTES = 32, 8 * 128 * 2  # 8 KV heads x head dim 128 x bf16


def _target(conn, gpu: int, rows: int) -> None:
    import torch
    from sglang_kv_migration.paths.device import cuda_ipc

    torch.cuda.set_device(gpu)
    bufs = [torch.zeros(rows, ROW_BYTES, dtype=torch.uint8, device=gpu) for _ in range(2 * LAYERS)]
    conn.send(
        {
            "descs": [cuda_ipc.export_tensor(b) for b in bufs],
            "uuid": cuda_ipc.gpu_uuid(gpu),
            "host": cuda_ipc.host_identity(),
        }
    )
    dst_rows = conn.recv()
    checksum = sum(int(b[dst_rows].to(torch.int64).sum()) for b in bufs)
    conn.send(checksum)
    conn.recv()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--rows", type=int, default=70016)
    parser.add_argument("--target-gpu", type=int, default=0)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import torch
    from sglang_kv_migration.paths.device import cuda_ipc, page_copy

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, args.target_gpu, args.rows))
    proc.start()
    info = parent.recv()
    assert info["host"] == cuda_ipc.host_identity()
    assert cuda_ipc.local_device_of(info["uuid"]) == args.target_gpu
    t0 = time.perf_counter()
    # Mapped into GPU 0's address space, as the device path does: kernels on GPU 0 write
    # the target's memory directly (peer access over NVLink for another GPU).
    peer = cuda_ipc.PeerBuffers().get("target", info["descs"], 0)
    open_ms = (time.perf_counter() - t0) * 1e3
    src = [
        torch.randint(0, 256, (args.rows, ROW_BYTES), dtype=torch.uint8, device=0)
        for _ in range(2 * LAYERS)
    ]
    ps = args.page_size
    n_pages, pages_total = args.tokens // ps, args.rows // ps
    g = torch.Generator().manual_seed(0)
    src_pages = torch.randperm(pages_total, generator=g)[:n_pages]
    dst_pages = torch.randperm(pages_total, generator=g)[:n_pages]
    si, di = src_pages.to(0), dst_pages.to(0)
    src_ptrs = torch.tensor([t.data_ptr() for t in src], dtype=torch.int64, device=0)
    page_bytes = ROW_BYTES * ps
    stream = torch.cuda.Stream(0)

    def fused() -> None:
        page_copy.copy_pages(src_ptrs, peer.pointers, si, di, page_bytes)

    def per_buffer() -> None:
        page_copy.copy_pages_torch([s.view(-1) for s in src], peer.buffers, si, di, page_bytes)

    result = {"tokens": args.tokens, "page_size": ps, "target_gpu": args.target_gpu}
    nbytes = n_pages * page_bytes * 2 * LAYERS
    result["bytes"] = nbytes
    result["open_ms"] = open_ms
    for name, fn in (("torch", per_buffer), ("fused", fused)):
        times = []
        for _ in range(args.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                fn()
                end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        times.sort()
        med = times[len(times) // 2]
        result[f"{name}_ms"] = med * 1e3
        result[f"{name}_gb_s"] = nbytes / med / 1e9
    torch.cuda.synchronize()
    dst_rows = (dst_pages[:, None] * ps + torch.arange(ps)).reshape(-1)
    src_rows = (src_pages[:, None] * ps + torch.arange(ps)).reshape(-1).to(0)
    parent.send(dst_rows)
    remote_sum = parent.recv()
    local_sum = sum(int(s[src_rows].to(torch.int64).sum()) for s in src)
    parent.send("bye")
    proc.join(30)
    result["bytes_equal"] = remote_sum == local_sum
    print(json.dumps(result))
    assert result["bytes_equal"], "copied bytes differ"


if __name__ == "__main__":
    main()
