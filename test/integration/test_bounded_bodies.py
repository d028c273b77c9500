"""What a body can make a server keep, and how a server answers any body, on a real
server (a `mini_server` on 127.0.0.1, without the device path, no signing key).

Attacks, each measured in the server's own process: refused transfers carrying large
`device_kv` descriptions (nothing from them is remembered: resident memory and the
source's count of known destinations), refused transfers with the cyclic garbage
collector off (nothing of theirs waits for it: resident memory, and what a collection
then finds), and bodies nested deeper than any parser recurses, or huge, on all six
routes (a 4xx naming the problem, never a 5xx or a dropped connection).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from mini_server import ServerHandle, ServerSpec, start_server
from sglang_kv_migration.wire.bodies import MAX_RANKS, MAX_TOKENS
from test_hostile_input import _info, _transfer_body

PAGE = 16
MIB = 1 << 20
ROUTES = [
    "/get_transfer_session_info",
    "/get_request_extra_token_size",
    "/allocate_token_for_transfer",
    "/transfer_request_kvcache",
    "/commit",
    "/abort_transfer",
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerHandle]:
    handle = start_server(ServerSpec())
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=120.0) as client:
        yield client


def _post_raw(
    http: httpx.Client, server: ServerHandle, path: str, raw: bytes, content_type: str
) -> httpx.Response:
    return http.post(server.url + path, content=raw, headers={"content-type": content_type})


def _refused_transfer(http: httpx.Client, server: ServerHandle, ids: int) -> dict[str, Any]:
    """A transfer of one page of an `ids`-token prefix into the server's own host pool,
    with no grant: the source refuses it (403) after parsing and checking all of it."""
    allocation = {
        "matched_token_size": 0,
        "extra_token_size": PAGE,
        "migration_id": "refused",
        "ranks": [{"grant": "", "kv_page_ranges": [[0, 1]]}],
    }
    return _transfer_body(_info(http, server), allocation, list(range(ids)))


def _device_entry(body: dict[str, Any], device_kv: dict[str, Any]) -> dict[str, Any]:
    entry = body["target_per_rank"][0]
    for name in ("session_id", "host_kv_data_ptrs", "host_kv_data_lens", "host_kv_item_lens"):
        entry.pop(name)
    entry.update(path="device", device_kv=device_kv)
    return body


def _description(instance: str, buffers: list[Any]) -> dict[str, Any]:
    return {
        "host_identity": "h",
        "gpu_uuid": "GPU-0",
        "instance_id": instance,
        "row_bytes": [1],
        "num_rows": [1],
        "buffers": buffers,
    }


# --------------------------------------------------------------------------- device_kv


def test_refused_device_descriptions_are_not_kept(server: ServerHandle, http: httpx.Client) -> None:
    """Large `device_kv` descriptions of `{}` entries (each ~25x its JSON size once
    parsed), each a new destination, to a source without the device path: refused, and
    the source's memory after a full collection is what it was."""
    small = _device_entry(_refused_transfer(http, server, PAGE), _description("small", [{}]))
    r = http.post(server.url + "/transfer_request_kvcache", json=small)
    assert 400 <= r.status_code < 500, r.text
    assert server.ask(0, "known_destinations") == 0  # no grant named it

    before = server.ask(0, "gc_rss")
    for i in range(3):
        body = _device_entry(
            _refused_transfer(http, server, PAGE), _description(f"big-{i}", [{}] * (MIB))
        )
        r = http.post(server.url + "/transfer_request_kvcache", json=body)
        assert 400 <= r.status_code < 500, r.text
        assert r.json()["error_kind"] == "bad_request", r.text
        assert "device_kv" in r.json()["message"] and "limit" in r.json()["message"], r.text
    grown = server.ask(0, "gc_rss") - before

    # Kept, the three would be ~200 MiB (1M dicts and a list of them each).
    assert grown < 40 * MIB, f"{grown / MIB:.0f} MiB kept"
    assert server.ask(0, "known_destinations") == 0
    assert _info(http, server)["ranks"]


def test_refused_transfers_wait_for_no_garbage_collection(
    server: ServerHandle, http: httpx.Client
) -> None:
    """With the cyclic collector off, refused transfers of 2**19 tokens each (~3.5 MB of
    JSON, ~20 MiB parsed on the scheduler): all of each is freed as its reply goes out,
    so memory does not grow with their number and a collection finds nothing of theirs."""
    body = _refused_transfer(http, server, 1 << 19)
    raw = json.dumps(body).encode()
    warm = _post_raw(http, server, "/transfer_request_kvcache", raw, "application/json")
    assert warm.status_code == 403, warm.text
    before = server.ask(0, "gc_off")
    try:
        for _ in range(6):
            r = _post_raw(http, server, "/transfer_request_kvcache", raw, "application/json")
            assert r.status_code == 403, r.text
            assert r.json()["error_kind"] == "forbidden"
        grown = server.ask(0, "rss") - before
    finally:
        garbage = server.ask(0, "gc_garbage_types")
    # Kept until a collection, the six would be over 100 MiB.
    assert grown < 40 * MIB, f"{grown / MIB:.0f} MiB left for the collector"
    ours = {"InflightTransfer", "TransferRequestKVCacheReqInput", "MigrationError", "traceback"}
    assert not ours & set(garbage), garbage[:20]


def _over_limit_bodies() -> dict[str, bytes]:
    """A ~6 MB body over a limit of each typed route (every route with a body model):
    one id more than `MAX_TOKENS`, one receipt more than `MAX_RANKS`."""
    ids = [1] * (MAX_TOKENS + 1)
    receipts = ["r" * 4096] * (MAX_RANKS + 1)
    return {
        "/get_request_extra_token_size": json.dumps({"input_ids": ids}).encode(),
        "/allocate_token_for_transfer": json.dumps(
            {"input_ids": ids, "source_fingerprints": [{}]}
        ).encode(),
        "/commit": json.dumps({"migration_id": "m", "receipts": receipts}).encode(),
        "/abort_transfer": json.dumps({"migration_id": "m", "receipts": receipts}).encode(),
    }


@pytest.mark.parametrize("route", list(_over_limit_bodies()))
def test_refused_bodies_on_typed_routes_wait_for_no_garbage_collection(
    server: ServerHandle, http: httpx.Client, route: str
) -> None:
    """With the cyclic collector off, over-limit bodies on a typed route (its 400 comes
    from the route's body model): each is freed as its reply goes out, so memory does
    not grow with their number and a collection finds nothing of theirs."""
    raw = _over_limit_bodies()[route]
    warm = _post_raw(http, server, route, raw, "application/json")
    assert warm.status_code == 400, warm.text
    server.ask(0, "gc_off")
    try:
        for i in range(7):
            r = _post_raw(http, server, route, raw, "application/json")
            assert r.status_code == 400, r.text
            assert r.json()["error_kind"] == "bad_request"
            assert "limit" in r.json()["message"], r.text
            if i == 0:  # the heap's one-time growth for a body this size, then none
                before = server.ask(0, "rss")
        grown = server.ask(0, "rss") - before
    finally:
        garbage = server.ask(0, "gc_garbage_types")
    # Kept until a collection, the six after the first would be over 100 MiB (each ~2M
    # ids or 1,025 receipts parsed, and the raw body).
    assert grown < 40 * MIB, f"{route}: {grown / MIB:.0f} MiB left for the collector"
    ours = {"RequestValidationError", "ValidationError", "Request", "traceback", "frame"}
    assert not ours & set(garbage), garbage[:20]


# --------------------------------------------------------------------------- any body


def _nested_list(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _nested_object(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


def _deep_bodies(depth: int) -> dict[str, bytes]:
    """Bodies with something `depth` levels deep: as the whole body, under a field no
    route has, and in each field that takes free-form JSON."""
    deep = _nested_list(depth).decode()
    entry = {"tp": 0, "pp": 0, "path": "device", "fingerprint": {}, "kv_indices": [1]}
    return {
        "list": _nested_list(depth),
        "object": _nested_object(depth),
        "unknown_field": f'{{"input_ids": [1], "x": {deep}}}'.encode(),
        "input_ids": f'{{"input_ids": {deep}}}'.encode(),
        "source_fingerprints": f'{{"input_ids": [1], "source_fingerprints": [{deep}]}}'.encode(),
        "source_fingerprint_value": (
            f'{{"input_ids": [1], "source_fingerprints": [{{"a": {deep}}}]}}'.encode()
        ),
        "fingerprint": _transfer_with(entry, "fingerprint", {"a": deep}),
        "device_kv": _transfer_with(entry, "device_kv", {"buffers": deep}),
        "moves": f'{{"moves": [{deep}]}}'.encode(),
        "receipts": f'{{"migration_id": "m", "receipts": {deep}}}'.encode(),
    }


def _transfer_with(entry: dict[str, Any], field: str, value: dict[str, str]) -> bytes:
    """A transfer body whose target entry's `field` holds `value` (raw JSON values)."""
    inner = ", ".join(f'"{k}": {v}' for k, v in value.items())
    fields = {k: v for k, v in entry.items() if k != field}
    head = json.dumps({"input_ids": [1], "extra_token_size": 1, "migration_id": "m"})[:-1]
    entry_json = f'{json.dumps(fields)[:-1]}, "{field}": {{{inner}}}}}'
    return f'{head}, "target_per_rank": [{entry_json}]}}'.encode()


def _answers_4xx(r: httpx.Response, route: str, what: str) -> None:
    if route == "/get_transfer_session_info" and r.status_code == 200:
        return  # it reads no body
    assert 400 <= r.status_code < 500, (route, what, r.status_code, r.text[:300])
    assert r.json().get("error_kind") not in (None, "", "internal"), (route, what, r.text[:300])


@pytest.mark.parametrize("depth", [1000, 1100, 100_000])
def test_deep_bodies_on_every_route_answer_4xx(
    server: ServerHandle, http: httpx.Client, depth: int
) -> None:
    """Nested below orjson's limit (1,024: the fast path parses it), just above it (the
    route's own parser), and far beyond any recursion limit; as JSON and as a body
    declared text (FastAPI's own body handling)."""
    for what, raw in _deep_bodies(depth).items():
        for route in ROUTES:
            for content_type in ("application/json", "text/plain"):
                r = _post_raw(http, server, route, raw, content_type)
                _answers_4xx(r, route, f"{what} ({content_type})")
    assert _info(http, server)["ranks"]


def _huge_bodies() -> dict[str, bytes]:
    many = 1 << 21  # over MAX_TOKENS
    return {
        "ids": json.dumps({"input_ids": list(range(many + 1))}).encode(),
        "string": json.dumps({"input_ids": [1], "extra_key": "k" * (4 * MIB)}).encode(),
        "fingerprints": json.dumps(
            {"input_ids": [1], "source_fingerprints": [{"a": 1}] * 300_000}
        ).encode(),
        "fingerprint": _transfer_with(
            {"tp": 0, "pp": 0, "kv_indices": [1]}, "fingerprint", {"a": json.dumps([{}] * MIB)}
        ),
        "receipts": json.dumps({"migration_id": "m", "receipts": ["r"] * MIB}).encode(),
        "over_the_body_limit": b" " * (33 * MIB),
    }


def test_huge_bodies_on_every_route_answer_4xx(server: ServerHandle, http: httpx.Client) -> None:
    for what, raw in _huge_bodies().items():
        for route in ROUTES:
            r = _post_raw(http, server, route, raw, "application/json")
            _answers_4xx(r, route, what)
    assert _info(http, server)["ranks"]
