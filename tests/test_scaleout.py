"""The scale-out example (examples/nginx): two replicas on loopback behind nginx with least_conn,
started by the example's own script, answer requests through nginx — both of them — and stop
cleanly on SIGTERM. Skipped, saying why, where nginx is not installed (.ci/run installs it).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ENV

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

START = Path(__file__).resolve().parents[1] / "examples" / "nginx" / "start.sh"
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None)


def free_ports(n: int) -> list:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def served_ok(port: int) -> float:
    """The replica's count of chat requests answered (its /metrics)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("colibri_requests_total{") and 'outcome="200"' in line and "chat" in line
    )


@pytest.mark.skipif(NGINX is None, reason="nginx is not installed (Debian: apt-get install nginx-light)")
def test_two_replicas_behind_nginx_both_answer(chat_model_dir, tmp_path):
    listen, p1, p2 = free_ports(3)
    env = dict(ENV, WORKDIR=str(tmp_path / "work"), PYTHON=sys.executable, THREADS="1")
    proc = subprocess.Popen(
        ["bash", str(START), str(chat_model_dir), str(listen), str(p1), str(p2)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{listen}"
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "nginx did not come up"
            time.sleep(0.2)
        body = {"model": "model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        answers = []
        for _ in range(6):
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            answers.append(r.json()["choices"][0]["message"]["content"])
        assert len(set(answers)) == 1  # greedy: the same answer from either replica
        with httpx.stream("POST", url + "/v1/chat/completions", json=dict(body, stream=True), timeout=60) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) > 2  # streamed through, not buffered into one
        counts = [served_ok(p1), served_ok(p2)]
        assert all(c >= 1 for c in counts) and sum(counts) == 7, counts
    finally:
        os.killpg(proc.pid, signal.SIGTERM) if proc.poll() is None else None
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    for port in (listen, p1, p2):  # nothing left listening
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, port
