"""One piece's streamed `/generate` as the request migrator reads it: the progress it
saw (when the call was sent, its first and last new token, the output so far), the fold
of SGLang's server-sent events into the reply a non-streaming call returns, and the
body sent ready-encoded.

Times here are `time.monotonic()`; `wall_clock` turns one into `time.time()`, the clock
SGLang's own `meta_info` timestamps (``--enable-metrics``) and a server's diagnosis
records use, so a move's moments can be laid beside the servers' on one line.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

JSON_HEADERS = {"content-type": "application/json"}


class GenerateFailed(Exception):
    """A `/generate` call answered with an error status or could not be sent."""


def wall_clock(monotonic_at: float) -> float:
    """`time.time()` at the moment `time.monotonic()` read `monotonic_at`."""
    return monotonic_at + (time.time() - time.monotonic())


def encoded_body(body: dict[str, Any]) -> bytes:
    """`body` as JSON bytes. orjson writes a resumed request's input ids (tens of
    thousands of ints at a long context) in a fraction of the milliseconds the standard
    library's encoder, which `httpx`'s ``json=`` uses, spends on them; the move's stall
    waits for it."""
    return orjson.dumps(body)


@dataclass
class PieceProgress:
    """What the migrator saw of one piece's streamed `/generate` so far (times are
    `time.monotonic()`); `on_first_token` is called with the first token's time."""

    first_token_at: float | None = None  # time.monotonic() of the first output token
    tokens: int = 0
    last_token_at: float | None = None  # when the last new output token arrived
    output_ids: list[int] = field(default_factory=list)  # the piece's output so far
    on_first_token: Callable[[float], None] | None = None
    sent_at: float | None = None  # when its `/generate` was sent (None: not the migrator's)

    def saw(self, output_ids: list[int]) -> None:
        """One chunk was folded: `output_ids` is the whole output so far."""
        if len(output_ids) > self.tokens:
            now = time.monotonic()
            self.last_token_at = now
            if self.first_token_at is None:
                self.first_token_at = now
                if self.on_first_token is not None:
                    self.on_first_token(now)
        self.tokens = len(output_ids)
        self.output_ids = output_ids


async def read_generate_stream(
    lines: AsyncIterator[str], progress: PieceProgress, where: str
) -> dict[str, Any]:
    """Fold SGLang's server-sent events for one request into the non-streaming reply.

    Chunks carry every output id so far, or only the new ones when the server runs with
    ``--incremental-streaming-output``, and an abort's chunk repeats the last token;
    ``meta_info.completion_tokens`` (the running total) tells which. The last chunk's
    ``meta_info`` is the reply's. Without
    incremental output each chunk repeats the whole output, so long generations cost the
    server O(n^2) bytes: servers that stream long outputs should enable it.
    """
    last: dict[str, Any] | None = None
    output_ids: list[int] = []
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        chunk = orjson.loads(data)
        if "error" in chunk:
            raise GenerateFailed(f"{where}: {chunk['error']}")
        ids = chunk.get("output_ids") or []
        total = (chunk.get("meta_info") or {}).get("completion_tokens")
        if total is None or len(output_ids) + len(ids) == total:
            output_ids.extend(ids)  # only the new tokens
        elif len(ids) == total:
            output_ids = list(ids)  # the whole output so far
        elif len(output_ids) >= total:
            # An abort's chunk repeats the last token it already sent: nothing new.
            del output_ids[total:]
        else:
            raise GenerateFailed(
                f"{where}: a chunk of {len(ids)} ids after {len(output_ids)} does not make "
                f"completion_tokens={total}"
            )
        progress.saw(output_ids)
        last = chunk
    if last is None:
        raise GenerateFailed(f"{where}: the stream ended without a reply")
    return {**last, "output_ids": output_ids}
