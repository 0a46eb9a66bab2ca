"""A benchmark's servers: one process on a free loopback port, healthy once made, stopped with
SIGTERM (also at exit), its log kept in a temporary file for the error it exits with."""

from __future__ import annotations

import atexit
import socket
import subprocess
import tempfile
import time


STARTUP_SECONDS = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on a free loopback port, healthy once made; stop() ends it (SIGTERM)."""

    def __init__(self, argv_for_port, name: str):
        import httpx

        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # its log to a file: a pipe nobody reads would stop a server that logs every request
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(argv_for_port(self.port), stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        atexit.register(self.stop)  # also when a request fails and the script exits
        deadline = time.time() + STARTUP_SECONDS
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{name} exited at start: {self.tail()}")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
            except httpx.TransportError:
                r = None
            if r is not None and r.status_code == 200:
                return
            if r is not None and r.status_code != 503:  # 503: still loading
                self.stop()
                raise SystemExit(f"{name}: /health says {r.status_code} {r.text[:500]}")
            time.sleep(0.2)
        self.proc.kill()
        raise SystemExit(f"{name} did not become healthy in {STARTUP_SECONDS} s")

    def tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-2000:]

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
