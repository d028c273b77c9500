"""Helpers shared by the multi-rank (TP, PP, TP x PP) server tests: a client that keeps
every reply, and comparisons of per-rank KV."""

from __future__ import annotations

from typing import Any

import httpx
import torch
from sglang_kv_migration.client import MigrationClient

HTTP_TIMEOUT_S = 120.0


class Recorder:
    """Keeps the reply of every call a client makes, by path (httpx event hook): JSON when
    the body is JSON, else its text."""

    def __init__(self) -> None:
        self.replies: list[tuple[str, int, Any]] = []

    def hook(self, response: httpx.Response) -> None:
        response.read()
        try:
            body = response.json()
        except ValueError:
            body = response.text
        self.replies.append((response.request.url.path, response.status_code, body))

    def last(self, path: str) -> tuple[int, Any]:
        for p, status, body in reversed(self.replies):
            if p == path:
                return status, body
        raise AssertionError(f"no call to {path} was recorded")

    def client(self) -> MigrationClient:
        http = httpx.Client(timeout=HTTP_TIMEOUT_S, event_hooks={"response": [self.hook]})
        return MigrationClient(http_client=http)


def post(url: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.post(url + path, json=body or {}, timeout=HTTP_TIMEOUT_S)


def session_info(url: str) -> dict[str, Any]:
    r = post(url, "/get_transfer_session_info")
    assert r.status_code == 200, r.text
    return r.json()


def kv_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Byte-for-byte equality of two lists of KV tensors (any dtype)."""
    return len(a) == len(b) and all(
        torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


def aligned(ids: list[int], page: int) -> list[int]:
    """The whole pages of `ids`: what a migration moves."""
    return ids[: len(ids) // page * page]
