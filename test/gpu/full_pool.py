"""A server whose GPU KV pool is held full by its own running requests (GPU machine).

`FullPool` starts `decodes` greedy requests of `prompt_tokens` random tokens each (on a
flushed server: nothing else is cached, so nothing is evictable), waits until all of
them run, then pauses the server in place (SGLang's `/pause_generation` with mode
`in_place`): the requests keep their KV and their slots, the scheduler runs no batch,
and it still handles control requests, migrations among them. What is left free is
`free_tokens` (SGLang's own count: allocator free plus tree evictable). On exit the
server continues, the requests are aborted, and it is idle again.

Size it so the requests are admitted together: SGLang admits a request while the pool
holds every running request's prompt plus its `max_new_tokens` times the new-token
ratio (0.7 at first).
"""

from __future__ import annotations

import random
import threading
import time
from types import TracebackType

import httpx
from real_servers import kv_pool_usage, wait_for_value

START_TIMEOUT_S = 240.0


class FullPool:
    """See the module docstring."""

    def __init__(
        self,
        url: str,
        *,
        decodes: int,
        prompt_tokens: int,
        max_new_tokens: int,
        vocab_size: int,
        seed: int = 0,
    ):
        self.url = url
        self.decodes = decodes
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.free_tokens = -1  # set once paused
        self.usage: dict[str, int] = {}
        self._threads: list[threading.Thread] = []
        self.paused_after_s = 0.0

    def __enter__(self) -> FullPool:
        started = time.monotonic()
        for _ in range(self.decodes):
            prompt = [self.rng.randrange(3, self.vocab_size) for _ in range(self.prompt_tokens)]
            thread = threading.Thread(target=self._run, args=(prompt,), daemon=True)
            thread.start()
            self._threads.append(thread)
        try:
            wait_for_value(
                lambda: kv_pool_usage(self.url)["num_running_reqs"],
                lambda running: running >= self.decodes,
                START_TIMEOUT_S,
                interval_s=0.05,
            )
            _post(self.url, "/pause_generation", {"mode": "in_place"})
        except BaseException:
            self._end()
            raise
        self.paused_after_s = time.monotonic() - started
        self.usage = kv_pool_usage(self.url)
        self.free_tokens = self.usage["max_total_num_tokens"] - self.usage["num_used_tokens"]
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._end()

    def _end(self) -> None:
        _post(self.url, "/continue_generation", {})
        _post(self.url, "/abort_request", {"abort_all": True})
        for thread in self._threads:
            thread.join(timeout=120)
        wait_for_value(
            lambda: kv_pool_usage(self.url)["num_running_reqs"],
            lambda running: running == 0,
            60.0,
        )

    def _run(self, prompt: list[int]) -> None:
        params = {"max_new_tokens": self.max_new_tokens, "temperature": 0.0, "ignore_eos": True}
        try:
            httpx.post(
                self.url + "/generate",
                json={"input_ids": prompt, "sampling_params": params},
                timeout=900,
            )
        except httpx.HTTPError:
            pass  # aborted at the end: its reply does not matter


def _post(url: str, route: str, body: dict) -> None:
    r = httpx.post(url + route, json=body, timeout=120)
    r.raise_for_status()
