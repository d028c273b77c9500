"""The demo servers' CPU stand-ins for what SGLang needs a GPU for (`demo/__init__.py`).

`install()` runs first thing in a demo server process (`cpu_server.py`), before anything
imports SGLang, and nowhere else:

1. torchvision's `nms` / `qnms` operator schemas: with a CPU torch, torchvision's C
   extension (a CUDA build) does not load, and two of its module-level registrations
   then fail the import of SGLang's utilities;
2. `sgl_kernel.kvcacheio`, which SGLang's host pool module imports at import time: the
   demo's pools use layout `layer_first` with I/O backend `direct`, whose one copy
   (`transfer_kv_direct`) is a per-layer row copy, done here with torch indexing; the
   other twelve names raise, saying the demo copies that way only;
3. the host pools' `pin_memory` default, False (pinning needs CUDA).
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Sequence
from typing import Any

from sglang_kv_migration.import_hooks import after_import

KVCACHEIO = "sgl_kernel.kvcacheio"
HOST_POOL_MODULE = "sglang.srt.mem_cache.memory_pool_host"
_UNUSED = (
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
)
_TORCHVISION: list[Any] = []  # keeps the schema library alive (a dropped one unregisters)


def install() -> None:
    """The three stand-ins, in this process; before SGLang is imported."""
    if HOST_POOL_MODULE in sys.modules:
        raise RuntimeError("the demo's CPU stand-ins must be installed before SGLang is imported")
    _define_torchvision_ops()
    module = types.ModuleType(KVCACHEIO, "The demo's CPU stand-in for sgl_kernel.kvcacheio.")
    module.transfer_kv_direct = transfer_kv_direct  # type: ignore[attr-defined]
    for name in _UNUSED:
        setattr(module, name, _not_in_the_demo(name))
    sys.modules[KVCACHEIO] = module
    after_import(HOST_POOL_MODULE, _unpin_host_pools)


def transfer_kv_direct(
    src_layers: Sequence[Any],
    dst_layers: Sequence[Any],
    src_indices: Any,
    dst_indices: Any,
    page_size: int,
) -> None:
    """Token rows ``src_layers[j][src_indices] -> dst_layers[j][dst_indices]``, every j."""
    import torch

    if len(src_layers) != len(dst_layers) or src_indices.numel() != dst_indices.numel():
        raise ValueError("transfer_kv_direct: layers or indices differ in number")
    if src_indices.numel() % page_size:
        raise ValueError("transfer_kv_direct: indices are not whole pages")
    src = src_indices.cpu().to(torch.int64)
    dst = dst_indices.cpu().to(torch.int64)
    for source, destination in zip(src_layers, dst_layers, strict=True):
        destination[dst] = source[src]


def _not_in_the_demo(name: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"{name}: the demo's CPU pools copy with layout layer_first and I/O backend direct only"
        )

    refuse.__name__ = name
    return refuse


def _define_torchvision_ops() -> None:
    import torch

    if torch.version.cuda is not None or hasattr(torch.ops.torchvision, "nms"):
        return  # a CUDA torch: torchvision's own extension defines them
    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TORCHVISION.append(library)


def _unpin_host_pools() -> None:
    module = sys.modules[HOST_POOL_MODULE]
    for cls in (module.MHATokenToKVPoolHost, module.MLATokenToKVPoolHost):
        _set_default(cls.__init__, "pin_memory", False)


def _set_default(fn: Any, name: str, value: Any) -> None:
    """Change the default of parameter `name` of `fn`."""
    params = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    defaults = list(fn.__defaults__ or ())
    position = [p.name for p in params].index(name) - (len(params) - len(defaults))
    if position < 0:
        raise ValueError(f"{fn.__qualname__} has no default for {name}")
    defaults[position] = value
    fn.__defaults__ = tuple(defaults)
