"""Which CUDA sharing works with torch_memory_saver's allocations? (GPU machine only.)

    KVMIG_GPU_OUT=$OUT python3 benchmark/probes/probe_memory_saver.py

In one process with torch_memory_saver (hook mode "torch", as a test can set it), one
buffer allocated inside a saver region (how SGLang allocates its KV pool) and one outside
it (how the device path allocates its landing arena). For each: does CUDA IPC export it
(`cudaIpcGetMemHandle`, through torch's `_share_cuda_`), does the driver's VMM export
(`cuMemRetainAllocationHandle` + `cuMemExportToShareableHandle`, POSIX fd) work, and does
a second process that opens the IPC handle see the bytes the first wrote. Then a pause and
resume of the region: does the inside buffer keep its virtual address. Writes
`probe_memory_saver.json`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any


def _child(desc: dict[str, Any], out: Any) -> None:
    """Open the exported buffer in another process and report its first bytes' sum."""
    import torch
    from sglang_kv_migration.paths.device.cuda_ipc import open_tensor

    flat = open_tensor(desc, 0)
    out.put(int(flat[:4096].to(torch.int64).sum()))


def _vmm_export(ptr: int) -> str:
    from cuda.bindings import driver

    err, handle = driver.cuMemRetainAllocationHandle(ptr)
    if err != driver.CUresult.CUDA_SUCCESS:
        return f"cuMemRetainAllocationHandle: {err.name}"
    kind = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    err, _fd = driver.cuMemExportToShareableHandle(handle, kind, 0)
    driver.cuMemRelease(handle)
    if err != driver.CUresult.CUDA_SUCCESS:
        return f"cuMemExportToShareableHandle: {err.name}"
    return "ok"


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    import torch
    from sglang_kv_migration.paths.device.cuda_ipc import export_tensor
    from torch_memory_saver import torch_memory_saver as saver

    saver.hook_mode = "torch"
    nbytes = 64 << 20
    with saver.region(tag="kv_cache"):
        inside = torch.full((nbytes,), 3, dtype=torch.uint8, device="cuda")
    outside = torch.full((nbytes,), 5, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    results: dict[str, Any] = {"torch": torch.__version__}
    ctx = mp.get_context("spawn")
    for name, t in (("inside_region", inside), ("outside_region", outside)):
        entry: dict[str, Any] = {"vmm_export": _vmm_export(t.data_ptr())}
        try:
            desc = export_tensor(t)
            entry["ipc_export"] = "ok"
            queue = ctx.Queue()
            child = ctx.Process(target=_child, args=(desc, queue))
            child.start()
            child.join(120)
            entry["peer_sum"] = queue.get(timeout=5) if child.exitcode == 0 else child.exitcode
            entry["peer_sees_bytes"] = entry["peer_sum"] == int(t[:4096].to(torch.int64).sum())
        except Exception as e:  # what the issue measured: "invalid argument"
            entry["ipc_export"] = f"{type(e).__name__}: {e}"
        results[name] = entry
    address = inside.data_ptr()
    saver.pause("kv_cache")
    saver.resume("kv_cache")
    results["inside_keeps_address_across_pause"] = inside.data_ptr() == address
    out = Path(os.environ.get("KVMIG_GPU_OUT", "/tmp/kvmig-gpu-out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_memory_saver.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    # torch_memory_saver's torch hook aborts when the interpreter frees tensors at exit.
    os._exit(0)


if __name__ == "__main__":
    main()
