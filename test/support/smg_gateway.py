"""Start the real SGLang model gateway (`smg launch`, from the `smg` pip package in this
environment's bin directory) in front of test servers on 127.0.0.1, and stop it.

The binary is looked up next to `sys.executable` only: a missing one is an install
problem (`scripts/install-cpu.sh` installs it), so `smg_binary()` raises instead of
letting the tests skip.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ports import listen_port

# Starts on ports another listener took meanwhile are tried again on new ones, this often.
BIND_ATTEMPTS = 4


def smg_binary() -> Path:
    path = Path(sys.executable).parent / "smg"
    if not path.exists():
        raise RuntimeError(
            f"{path} is missing: install the model gateway into this environment "
            "(pip install smg==1.13.0, as scripts/install-cpu.sh does)"
        )
    return path


def port_to_restart_on() -> int:
    """A port for a gateway restarted on the same address: below the kernel's ephemeral
    range, so no outgoing connection of any process is handed it while the gateway is
    down (`ports.py`)."""
    return listen_port()


@dataclass
class Gateway:
    url: str
    process: subprocess.Popen
    log_path: Path
    metrics_url: str

    def branch_count(self, policy: str, branch: str) -> float:
        """The gateway's `smg_<policy>_policy_branch_total{branch=...}` counter (0 if unset)."""
        with urllib.request.urlopen(self.metrics_url, timeout=30) as r:
            text = r.read().decode()
        prefix = f'smg_{policy}_policy_branch_total{{branch="{branch}"}} '
        lines = [line for line in text.splitlines() if line.startswith(prefix)]
        return float(lines[0][len(prefix) :]) if lines else 0.0

    def workers(self) -> list[dict]:
        with urllib.request.urlopen(self.url + "/workers", timeout=30) as r:
            return json.loads(r.read())["workers"]

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


@contextlib.contextmanager
def running_gateway(
    worker_urls: Sequence[str],
    policy: str,
    *extra: str,
    timeout_s: float = 60.0,
    port: int | None = None,
) -> Iterator[Gateway]:
    """`smg launch` on free ports (HTTP and metrics, both on 127.0.0.1; HTTP on `port`
    when given) in front of `worker_urls`; yields once every worker is registered and
    healthy; the process is terminated (then killed) on exit. A start that finds a port
    taken (by another listener, between its choice and the gateway's bind) is tried
    again on new ones."""
    for attempt in range(1, BIND_ATTEMPTS + 1):
        gateway = _launch(worker_urls, policy, extra, port or listen_port())
        try:
            _wait_registered(gateway, len(worker_urls), timeout_s)
        except _PortTaken:
            _stop(gateway)
            if attempt == BIND_ATTEMPTS:
                raise
            continue
        except BaseException:
            _stop(gateway)
            raise
        try:
            yield gateway
        finally:
            _stop(gateway)
        return


class _PortTaken(RuntimeError):
    """The gateway exited at start because one of its ports was taken."""


def _launch(worker_urls: Sequence[str], policy: str, extra: Sequence[str], port: int) -> Gateway:
    metrics_port = listen_port()
    log = Path(tempfile.mkstemp(prefix="smg-", suffix=".log")[1])
    args = [
        str(smg_binary()), "launch", "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *worker_urls, "--policy", policy,
        "--prometheus-port", str(metrics_port), "--prometheus-host", "127.0.0.1",
        "--disable-tokenizer-autoload", "--worker-startup-check-interval", "1",
        *extra,
    ]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    return Gateway(f"http://127.0.0.1:{port}", process, log, metrics)


def _stop(gateway: Gateway) -> None:
    """Terminate the gateway (then kill it) and remove its log."""
    process = gateway.process
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
    gateway.log_path.unlink(missing_ok=True)


def _wait_registered(gateway: Gateway, n: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gateway.process.poll() is not None:
            tail = gateway.log_tail()
            error = _PortTaken if "Address already in use" in tail else RuntimeError
            raise error(f"smg exited ({gateway.process.returncode}):\n{tail}")
        try:
            workers = gateway.workers()
        except OSError:
            workers = []
        if len(workers) == n and all(w.get("is_healthy") for w in workers):
            return
        time.sleep(0.2)
    raise TimeoutError(f"smg did not register {n} workers in {timeout_s}s:\n{gateway.log_tail()}")
