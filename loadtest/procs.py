"""Start the fleet's parts as real processes on loopback: simulated replicas, a gateway.

Benchmarks and the demo run each part in its own process, as in production, so the
gateway's CPU is its own and the numbers mean what they say.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from router.core.bundled import tokenizer_dir

TOKENIZER = str(tokenizer_dir())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    urls: list[str] = field(default_factory=list)
    stderr: Path | None = None  # where its stderr goes, so a failed start can say why

    def exit_reason(self) -> str:
        """``NAME exited (status N): its last stderr line``, for a process that stopped."""
        last = ""
        if self.stderr is not None:
            with contextlib.suppress(OSError):
                lines = [x for x in self.stderr.read_text(errors="replace").splitlines() if x]
                last = lines[-1] if lines else ""
        return f"{self.name} exited (status {self.popen.poll()})" + (f": {last}" if last else "")

    @property
    def url(self) -> str:
        return self.urls[0]

    def cpu_seconds(self) -> float:
        try:
            stat = Path(f"/proc/{self.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mb(self) -> float:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.popen.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def start(
    name: str,
    cmd: Sequence[str],
    urls: Sequence[str] = (),
    env: dict[str, str] | None = None,
    read_stdout: bool = False,
) -> Proc:
    """Start ``cmd``. Its output is discarded unless ``read_stdout`` (then the caller must keep
    reading it: a chatty process blocks once an unread pipe fills); its stderr goes to a
    temporary file (``Proc.exit_reason`` reads its last line)."""
    log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)  # noqa: SIM115
    with log:
        popen = subprocess.Popen(
            list(cmd),
            stdout=subprocess.PIPE if read_stdout else subprocess.DEVNULL,
            stderr=log,
            env={**os.environ, **(env or {})},
        )
    return Proc(name, popen, list(urls), Path(log.name))


def start_replicas(count: int, *args: str, timeout: float = 60.0) -> Proc:
    """``python -m loadtest.replica --count N`` on free ports; waits for its ``ready`` lines."""
    proc = start(
        "replicas",
        [
            sys.executable,
            "-m",
            "loadtest.replica",
            "--port",
            "0",
            "--count",
            str(count),
            "--log-level",
            "warning",
            *args,
        ],
        read_stdout=True,
    )
    deadline = time.monotonic() + timeout
    assert proc.popen.stdout is not None
    while len(proc.urls) < count:
        line = proc.popen.stdout.readline().decode()
        if not line:
            proc.popen.wait(10)
            raise RuntimeError(proc.exit_reason())
        if line.startswith("ready "):
            proc.urls.append(line.split()[1].strip())
        if time.monotonic() > deadline:
            proc.stop()
            raise RuntimeError("simulated replicas did not start in time")
    # Keep draining its output so it can never block on a full pipe.
    threading.Thread(target=proc.popen.stdout.read, daemon=True).start()
    return proc


def start_gateway(replicas: Sequence[str], *args: str) -> Proc:
    """``prefix-router serve`` on a free port in front of ``replicas``; call ``wait_ready``."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "router.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tokenizer",
        TOKENIZER,
        "--log-level",
        "warning",
        *[x for r in replicas for x in ("--replica", r)],
        *args,
    ]
    return start("prefix-router", cmd, [f"http://127.0.0.1:{port}"])


async def wait_ready(
    url: str, path: str = "/ready", timeout: float = 90.0, proc: Proc | None = None
) -> None:
    """Until ``url + path`` answers 200; with ``proc``, fail as soon as that process exits."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc is not None and proc.popen.poll() is not None:
                raise RuntimeError(proc.exit_reason())
            with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                async with s.get(url + path, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url}{path} not ready after {timeout:.0f}s")


@contextlib.contextmanager
def running() -> Iterator[list[Proc]]:
    """A list to put processes in; all are stopped on exit, last first."""
    procs: list[Proc] = []
    try:
        yield procs
    finally:
        for p in reversed(procs):
            p.stop()
            if p.stderr is not None:
                p.stderr.unlink(missing_ok=True)
