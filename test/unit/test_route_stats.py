"""What each data path's finished send reports per route (`SendStats.routes`), the numbers
the source exports on `/metrics` and the cost model learns each route's rate from.

The device path's copy runs on CUDA; here its events are stand-ins that say when each
tier's copy started and ended (CUDA's `elapsed_time` is in milliseconds)."""

from __future__ import annotations

from concurrent.futures import Future

from sglang_kv_migration.paths.base import ROUTE_GPU_TO_GPU, ROUTE_HOST_TO_GPU, KVPoll
from sglang_kv_migration.paths.device.send_job import TierSendJob
from sglang_kv_migration.paths.device.source_side import DEVICE_TIER_ROUTES


class _Event:
    def __init__(self, at_s: float) -> None:
        self.at_s = at_s

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _Event) -> float:
        return (end.at_s - self.at_s) * 1e3


class _Pin:
    released = 0

    def release(self) -> None:
        self.released += 1


def _finished_job(tier_bytes: dict[str, int], tier_events: dict) -> TierSendJob:
    job = TierSendJob(_Pin(), DEVICE_TIER_ROUTES)  # type: ignore[arg-type]
    job.tier_bytes = tier_bytes
    opened: Future[None] = Future()
    opened.set_result(None)
    job.launch_when(opened, lambda: job.launched(_Event(0.0), _Event(0.010), tier_events))
    return job


def test_device_send_reports_each_tier_on_its_route() -> None:
    job = _finished_job(
        {"device": 4096, "host": 8192},
        {"device": (_Event(0.0), _Event(0.002)), "host": (_Event(0.002), _Event(0.010))},
    )
    assert job.poll() is KVPoll.SUCCESS
    routes = job.stats.routes
    assert set(routes) == {ROUTE_GPU_TO_GPU, ROUTE_HOST_TO_GPU}
    assert routes[ROUTE_GPU_TO_GPU][0] == 4096 and routes[ROUTE_HOST_TO_GPU][0] == 8192
    assert abs(routes[ROUTE_GPU_TO_GPU][1] - 0.002) < 1e-9
    assert abs(routes[ROUTE_HOST_TO_GPU][1] - 0.008) < 1e-9
    assert abs(job.stats.seconds - 0.010) < 1e-9


def test_a_tier_with_no_pages_is_no_route() -> None:
    job = _finished_job({"device": 4096, "host": 0}, {"device": (_Event(0.0), _Event(0.001))})
    assert job.poll() is KVPoll.SUCCESS
    assert list(job.stats.routes) == [ROUTE_GPU_TO_GPU]
