"""A first run to watch: `sglang-kv-migrate demo` starts two CPU servers, moves a prefix
from one to the other and shows the target serving it from cache.

A CPU cannot run SGLang's model or its GPU copy kernels, so each demo server is a
scheduler stand-in in its own process around SGLang's real cache code: `HiRadixCache`,
its device and host pools and allocator on CPU, with this plugin's real scheduler hooks,
routes and Mooncake TCP transfers (`cpu_server.py`). Three things are replaced there,
and only there (`cpu_stand_ins.py`): two torchvision operator schemas, SGLang's
`sgl_kernel.kvcacheio` copy module (with a CPU copy for its one layout and I/O backend),
and the host pools' pinned-memory default. `run.py` drives the two servers.

Nothing else in the package imports this folder (the console script loads `run.py` for
`demo` only; `test/unit/test_package_boundaries.py` checks it), so no server that runs
the plugin ever gets these stand-ins.
"""
