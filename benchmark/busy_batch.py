"""What the busy-server benchmarks share (`bench_busy_source.py`, `busy_concurrency.py`):
a full batch of decodes kept running on a server, random prompts, and the size query
that says where a server holds a prompt's prefix (GPU machine only: it talks to real
SGLang servers)."""

from __future__ import annotations

import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from sglang_kv_migration.client.migration import MigrationClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "test" / "gpu"))
from real_servers import kv_pool_usage  # noqa: E402

BUSY_PROMPTS = (256, 512, 1024, 2048, 3072)  # mixed lengths, cycled
BUSY_OUTPUTS = (256, 512, 768, 1024)


class BusyBatch:
    """`n` threads, each keeping one greedy decode running on `url` (mixed prompt and
    output lengths, `ignore_eos`), resubmitted as it ends, until `stop`."""

    def __init__(self, url: str, n: int, seed: int):
        self.url, self.n, self.rng = url, n, random.Random(seed)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self, min_running: int, timeout_s: float = 120.0) -> None:
        for i in range(self.n):
            prompt_len = BUSY_PROMPTS[i % len(BUSY_PROMPTS)]
            gen = BUSY_OUTPUTS[i % len(BUSY_OUTPUTS)]
            args = (tokens(self.rng, prompt_len), gen)
            thread = threading.Thread(target=self._keep, args=args, daemon=True)
            thread.start()
            self._threads.append(thread)
        deadline = time.monotonic() + timeout_s
        while kv_pool_usage(self.url)["num_running_reqs"] < min_running:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.url}: {min_running} decodes not running")
            time.sleep(0.2)

    def running(self) -> int:
        return kv_pool_usage(self.url)["num_running_reqs"]

    def stop(self) -> None:
        self._stop.set()
        httpx.post(self.url + "/abort_request", json={"abort_all": True}, timeout=30)
        for thread in self._threads:
            thread.join(timeout=60)

    def _keep(self, prompt: list[int], gen: int) -> None:
        params = {"max_new_tokens": gen, "temperature": 0.0, "ignore_eos": True}
        with httpx.Client(timeout=600) as http:
            while not self._stop.is_set():
                body = {"input_ids": prompt, "sampling_params": params}
                try:
                    http.post(self.url + "/generate", json=body)
                except httpx.HTTPError:
                    return
                prompt = prompt[1:] + prompt[:1]  # a new prompt: it is prefilled again


def held(client: MigrationClient, url: str, prompt: list[int]) -> dict[str, Any]:
    """The server's size query for the prompt less its last token (what a move moves)."""
    return client.call(url, "/get_request_extra_token_size", {"input_ids": prompt[:-1]})


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 128000) for _ in range(n)]
