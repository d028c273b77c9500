"""Make torchvision importable beside a CPU build of torch (test environments only).

Only a CUDA build of torchvision 0.28.0 exists for torch 2.13. On a CPU torch its C
extension fails to load, and torchvision then calls ``register_fake`` for
``torchvision::nms`` / ``torchvision::qnms`` unguarded, which raises
``operator torchvision::nms does not exist``. SGLang's utils and transformers' image
processors import torchvision, so ``python -m sglang.launch_server --help`` dies with it.

Defining the two operator schemas before torchvision is imported is enough. This module
is copied into the venv's site-packages by ``scripts/install-cpu.sh`` and imported from a
``.pth`` file. It installs a meta-path hook that acts on the first ``import torchvision``
only, so interpreter start-up does not pay for importing torch. Never part of the package.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

_OPS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
# The Library object must stay alive: dropping it would unregister the schemas.
_LIBRARY: Any = None


def define_torchvision_ops() -> None:
    """Define the two schemas once, and only where torchvision's own extension has not."""
    global _LIBRARY
    import torch

    if _LIBRARY is not None or hasattr(torch.ops.torchvision, "nms"):
        return
    lib = torch.library.Library("torchvision", "DEF")
    for schema in _OPS:
        lib.define(schema)
    _LIBRARY = lib


class _TorchvisionImportHook(importlib.abc.MetaPathFinder):
    """Runs the fix just before the first ``import torchvision``, then steps aside."""

    _done = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname == "torchvision" and not self._done:
            # Stays in sys.meta_path (inert): removing it while the import system
            # iterates over that list would make it skip the next finder.
            self._done = True
            define_torchvision_ops()
        # Returning None lets the normal finders import the real module.
        return None


def install() -> None:
    if "torchvision" in sys.modules:
        return
    if any(isinstance(f, _TorchvisionImportHook) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _TorchvisionImportHook())


install()
