"""TEST STAND-IN for the discovery routes of an SGLang 0.5.12 server that the model
gateway reads before it registers a worker (found by running `smg launch` in front of
plain HTTP servers: it probes `/health`, then `/v1/models`, `/server_info` and
`/version`, and registers nothing from a server without a model list).

SGLang serves `/health`, `/v1/models`, `/model_info` (`/get_model_info`) and
`/server_info` (`/get_server_info`); it has no `/version`, and neither has this. The
replies carry the fields those routes name in SGLang, filled for the harness's tiny
model. `discovery_factory(inner)` wraps another `ServerSpec.extension` (e.g.
`generate_standin.standin_factory(...)`) and adds these routes next to its own.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

MODEL_NAME = "tiny-llama"  # mini_server's served_model_name


def discovery_factory(inner: Any) -> Any:
    """A picklable `ServerSpec.extension`: `inner`'s routes plus the discovery routes."""
    return _Factory(inner)


@dataclasses.dataclass
class _Factory:
    inner: Any

    def __call__(self, harness: Any) -> _WithDiscovery:
        return _WithDiscovery(self.inner(harness))


class _WithDiscovery:
    def __init__(self, inner: Any):
        self.inner = inner
        self.started = int(time.time())

    def tick(self) -> None:
        self.inner.tick()

    def add_routes(self, app: Any) -> None:
        self.inner.add_routes(app)

        @app.get("/health", response_model=None)
        async def health() -> Any:
            return {}

        @app.get("/v1/models", response_model=None)
        async def models() -> Any:
            card = {"id": MODEL_NAME, "object": "model", "created": self.started}
            return {"object": "list", "data": [{**card, "owned_by": "sglang", "root": MODEL_NAME}]}

        @app.get("/model_info", response_model=None)
        @app.get("/get_model_info", response_model=None)
        async def model_info() -> Any:
            return {"model_path": MODEL_NAME, "is_generation": True, "weight_version": "default"}

        @app.get("/server_info", response_model=None)
        @app.get("/get_server_info", response_model=None)
        async def server_info() -> Any:
            return {
                "model_path": MODEL_NAME,
                "served_model_name": MODEL_NAME,
                "tp_size": 1,
                "dp_size": 1,
                "skip_tokenizer_init": True,
                "version": "0.5.12",
            }
