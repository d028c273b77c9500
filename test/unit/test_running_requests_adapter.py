"""`sglang_adapter.running_requests` against real SGLang 0.5.12 classes on CPU: a real
`Req` in a scheduler's running batch with a row of the real `ReqToTokenPool`, and the
copy of its device slots into the real host pool."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from sglang_kv_migration import sglang_adapter as adapter


def _running(h, rid: str, tokens: list[int], generated: int):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid, "", tokens[: len(tokens) - generated], SamplingParams(max_new_tokens=64))
    req.output_ids = tokens[len(tokens) - generated :]
    pool = h.cache.req_to_token_pool
    assert pool.alloc([req]) is not None
    slots = h.allocator.alloc(64)[: len(tokens)]
    h._fill_random(slots, seed=3)
    pool.req_to_token[req.req_pool_idx, : len(tokens)] = slots.to(pool.req_to_token.dtype)
    req.kv_committed_len = len(tokens)  # the last position's forward is in flight
    scheduler = SimpleNamespace(
        running_batch=SimpleNamespace(reqs=[req]), waiting_queue=[], req_to_token_pool=pool
    )
    return adapter.RunningRequests(scheduler), req, slots


def test_finds_the_running_request_and_its_written_slots(harness_factory):
    h = harness_factory(attention="mha", page_size=16)
    tokens = list(range(100, 140))
    requests, req, slots = _running(h, "r1", tokens, generated=8)
    assert requests.find("nope") is None
    found = requests.find("r1")
    assert found is not None and found.token_ids == tokens
    assert found.kv_length == len(tokens) - 1  # the position in flight is not read
    assert torch.equal(requests.slots_of(found, 0, 32), slots[:32].to(torch.int64))
    req.kv_committed_freed = True
    assert requests.find("r1") is None


def test_still_holds_until_the_request_finishes_or_is_retracted(harness_factory):
    """What the source asks once a copy of a running request's slots is done."""
    h = harness_factory(attention="mha", page_size=16)
    requests, req, _slots = _running(h, "r3", list(range(300, 340)), generated=8)
    read = requests.find("r3")
    assert read is not None
    assert requests.still_holds(read, 32)
    assert not requests.still_holds(read, 40)  # more than it has written
    req.reset_for_retract()  # SGLang's retraction frees the slots, the Req stays
    req.kv_committed_len = 40  # ... and a re-prefill gives it slots again
    assert requests.find("r3") is not None and not requests.still_holds(read, 32)
    again = requests.find("r3")
    req.finished_reason = SimpleNamespace(to_json=lambda: {"type": "abort"})
    assert requests.find("r3") is None and not requests.still_holds(again, 32)


def test_copy_device_to_host_is_byte_exact(harness_factory):
    h = harness_factory(attention="mha", page_size=16)
    requests, _req, slots = _running(h, "r2", list(range(200, 240)), generated=4)
    device = requests.slots_of(requests.find("r2"), 0, 32)
    host = adapter.alloc_host_slots(h.cache, 32)
    adapter.copy_device_to_host(h.cache, device, host)
    pool = h.host_pool
    for layer in range(h.cfg.layer_num):
        for dev_buf, host_buf in ((h.device_pool.k_buffer, pool.k_buffer),
                                  (h.device_pool.v_buffer, pool.v_buffer)):  # fmt: skip
            want = dev_buf[layer][device].view(torch.uint8)
            got = host_buf[layer][host].view(torch.uint8)
            assert torch.equal(want, got)
