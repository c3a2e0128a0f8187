"""A real, throwaway ``redis-server`` process for tests (and the Redis index benchmark).

``RedisServer`` starts ``redis-server`` on a free loopback port with persistence off, waits
until it answers ``PING`` (polling against a deadline, never a fixed sleep), and can ``stop()``
it, ``kill()`` it (SIGKILL, a crash) or ``restart()`` it on the same port with its data gone; ``pause()``
(SIGSTOP) and ``resume()`` simulate a hung server.

The binary is ``$PREFIX_ROUTER_REDIS_SERVER`` or ``redis-server`` on ``PATH``; the
``redis_server`` fixture skips the test when neither exists. Make the fixture available to a
test module (or to every test, from ``conftest.py``) with
``from tests.redis_server import redis_server_fixture  # noqa: F401``; tests then take a
``redis_server: RedisServer`` argument.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from types import TracebackType

import pytest

ENV_BINARY = "PREFIX_ROUTER_REDIS_SERVER"


def find_redis_server() -> str | None:
    """Path to the ``redis-server`` binary, or None."""
    path = os.environ.get(ENV_BINARY)
    if path:
        return path if os.access(path, os.X_OK) else None
    return shutil.which("redis-server")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ping(port: int, timeout: float = 0.2) -> bool:
    """True when a Redis server on ``port`` answers PING (raw RESP; no client needed)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` child process on ``127.0.0.1:<port>``; a context manager."""

    def __init__(
        self,
        binary: str | None = None,
        port: int | None = None,
        start_timeout: float = 10.0,
        extra_args: tuple[str, ...] = (),
        config_file: str | None = None,
    ) -> None:
        found = binary or find_redis_server()
        if not found:
            raise FileNotFoundError(f"redis-server not found (set ${ENV_BINARY})")
        self.binary = found
        self.port = port or _free_port()
        self.start_timeout = start_timeout
        self.extra_args = extra_args
        self.config_file = config_file  # first argument (a sentinel needs a writable one)
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix="prefix-router-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> RedisServer:
        if self.running:
            return self
        for attempt in range(3):
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    *([self.config_file] if self.config_file else []),
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    self._dir,
                    "--protected-mode",
                    "no",
                    "--loglevel",
                    "warning",
                    *self.extra_args,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            deadline = time.monotonic() + self.start_timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break  # exited: most likely the port was taken meanwhile
                if _ping(self.port):
                    return self
                time.sleep(0.005)
            err = b""
            if self.proc.poll() is None:
                self._terminate(signal.SIGKILL)
            elif self.proc.stderr is not None:
                err = self.proc.stderr.read()
            self.proc = None
            if attempt == 2 or b"Address already in use" not in err:
                raise RuntimeError(
                    f"redis-server on port {self.port} did not come up: "
                    f"{err.decode(errors='replace').strip()}"
                )
            self.port = _free_port()
        raise AssertionError("unreachable")

    def _terminate(self, sig: signal.Signals) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
            if sig != signal.SIGKILL:
                proc.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
        self.proc = None

    def stop(self) -> None:
        """Graceful shutdown (SIGTERM); nothing is saved."""
        self._terminate(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-conversation, as in a crash."""
        self._terminate(signal.SIGKILL)

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing (a hung Redis)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after ``pause``."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> RedisServer:
        """Kill (if running) and start again on the same port, with an empty dataset."""
        self.kill()
        return self.start()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


@pytest.fixture(name="redis_server")
def redis_server_fixture() -> Iterator[RedisServer]:
    """A fresh, empty redis-server per test. Without the binary the test is skipped, unless
    ``PREFIX_ROUTER_REQUIRE_REDIS=1`` (as in CI), where a missing binary is a failure."""
    if find_redis_server() is None:
        if os.environ.get("PREFIX_ROUTER_REQUIRE_REDIS") == "1":
            pytest.fail(f"redis-server not installed (set ${ENV_BINARY})")
        pytest.skip(f"redis-server not installed (set ${ENV_BINARY})")
    with RedisServer() as server:
        yield server
