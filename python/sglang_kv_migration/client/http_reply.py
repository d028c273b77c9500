"""What both of the client's HTTP/1.1 implementations share: the request's bytes and the
reply head's parse (`http11.py` on sockets, `aio_http11.py` on asyncio streams).

The six routes answer with a Content-Length body; chunked replies and replies that end
with the connection are read too (a proxy or another server may send them).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

MAX_BODY_BYTES = 256 << 20  # far above any reply of the six routes
MAX_HEAD_BYTES = 64 << 10


class ProtocolError(ValueError):
    """The server's reply is not HTTP/1.1 this client can read."""


# What a failed call raises (the caller turns it into a failed phase): a timeout is an
# OSError, a reply cut short an EOFError (asyncio's IncompleteReadError is one).
ERRORS = (OSError, EOFError, ProtocolError)

Origin = tuple[str, str, int]  # (scheme, host, port): one pool of connections each


@dataclass(frozen=True)
class ReplyHead:
    status: int
    length: int | None  # Content-Length; None: chunked, or until the server closes
    chunked: bool
    keep_alive: bool  # the connection may carry another request


def prepare_post(url: str, body: bytes, headers: dict[str, str]) -> tuple[Origin, bytes]:
    """Where a POST of `body` to `url` goes, and its bytes."""
    parts = urlsplit(url)
    scheme = parts.scheme or "http"
    origin = (scheme, parts.hostname or "", parts.port or (443 if scheme == "https" else 80))
    return origin, request_bytes(parts, body, headers)


def request_bytes(parts: SplitResult, body: bytes, headers: dict[str, str]) -> bytes:
    """A POST of `body` as one buffer: head and body in one write (no Nagle delay between)."""
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    head = [f"POST {target} HTTP/1.1", f"Host: {parts.netloc}"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def parse_head(head: bytes) -> ReplyHead:
    """The reply's status line and header fields (`head` without its final CRLF CRLF)."""
    status_line, *lines = head.decode("latin-1").split("\r\n")
    version, _, rest = status_line.partition(" ")
    code = rest.partition(" ")[0]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise ProtocolError(f"not an HTTP/1.x reply: {status_line[:80]!r}")
    fields: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep:
            raise ProtocolError(f"bad reply header {line[:80]!r}")
        fields[name.strip().lower()] = value.strip()
    keep = version == "HTTP/1.1" and fields.get("connection", "").lower() != "close"
    if "chunked" in fields.get("transfer-encoding", "").lower():
        return ReplyHead(int(code), None, True, keep)
    if "content-length" in fields:
        length = fields["content-length"]
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            raise ProtocolError(f"bad Content-Length {length[:20]!r}")
        return ReplyHead(int(code), int(length), False, keep)
    return ReplyHead(int(code), None, False, False)  # the body ends with the connection


def chunk_size(line: bytes) -> int:
    """A chunk's size line (extensions after ';' ignored)."""
    size_line = line.split(b";")[0].strip()
    try:
        return int(size_line, 16)
    except ValueError:
        raise ProtocolError(f"bad chunk size {size_line[:20]!r}") from None
