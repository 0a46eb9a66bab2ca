"""tools/bench/soak.py for a few seconds against the bundled demo model: its results file has its
fields, no valid request got a 5xx, /metrics counted every request that reached the app once,
nothing was left queued, and the stop signal (SIGHUP here: the server stops on it as on SIGTERM)
let the running streams finish and the server exit 0. Not a timing test: the figures are the
harness's, the 30-minute run's are in tools/bench/results/."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ENV, REPO

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")


def test_a_short_soak_has_no_5xx_and_counts_every_request(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(REPO / "tools" / "bench" / "soak.py"), "--seconds", "5", "--clients", "4"]
    cmd += ["--sample-every", "1", "--stop-signal", "hup", "--out", str(out)]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert {"command", "host", "date", "git_commit", "settings"} <= set(doc)
    s = doc["summary"]
    assert {
        "requests",
        "by_outcome",
        "five_xx_valid",
        "rss_mb",
        "fds",
        "threads",
        "metrics",
        "latency_by_minute",
    } <= set(s)
    assert s["requests"] > 0 and s["by_outcome"].get("200", 0) > 0
    assert s["five_xx_valid"] == 0 and s["five_xx_all"] == 0, doc["server_errors"]
    assert s["metrics"]["equal"] and not any(s["metrics"]["left"].values()), s["metrics"]
    assert s["rss_mb"]["last"] > 0 and s["fds"]["last"] > 0 and doc["samples"]
    assert s["drain"]["exit_code"] == 0 and s["drain"]["streams"] == {"completed": 3}, s["drain"]
    assert s["drain"]["new_connection_refused"] and s["log"]["tracebacks"] == 0
