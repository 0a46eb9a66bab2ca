"""--cpu-mask and --numa (colibri.placement over colibri._os): the mask and the memory policy a
process is given hold for every thread it starts after, the engine's included; what cannot be
honoured is one clear line. (One socket here: a policy over node 0 is what can be set and read
back; what interleaving buys on a two-socket server is not measured on this machine.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from hypothesis import given, strategies as st

from colibri import _os
from colibri.placement import _os_list
from conftest import ENV

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CPU masks and NUMA policy: Linux")


@given(st.sets(st.integers(0, 300), min_size=1))
def test_a_cpu_list_round_trips(cpus):
    assert set(_os.parse_cpu_list(_os_list(cpus))) == cpus


@pytest.mark.parametrize("text", ["a", "3-1", "-1", "0-", "1,,x"])
def test_a_malformed_cpu_list_is_refused(text):
    with pytest.raises(ValueError):
        _os.parse_cpu_list(text)


PROBE = r"""
import json, os, sys, threading
import colibri
from colibri import _os
from colibri.placement import place
place(sys.argv[2], "interleave")
m = colibri.load(sys.argv[1], threads=2)
list(m.generate(list(range(3, 40)), 4))
masks = {}
for tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{tid}/status") as f:
        masks[tid] = next(l.split()[1] for l in f if l.startswith("Cpus_allowed_list"))
seen = {}
def policy():
    seen["policy"] = _os.memory_policy()
t = threading.Thread(target=policy)
t.start(); t.join()
print(json.dumps({"masks": masks, "policy": seen["policy"], "pid": os.getpid()}))
sys.stdout.flush()
sys.stdin.readline()  # alive while the test asks taskset
"""


@linux_only
def test_the_mask_and_policy_hold_for_every_thread_of_the_engine(converted):
    """A process placed on CPU 0 with memory interleaved over node 0 loads a model and decodes on
    2 threads: every thread it has (the engine's pool included) may run on CPU 0 only (/proc, and
    taskset where it exists), and a thread started after holds the interleave policy."""
    if 0 not in os.sched_getaffinity(0) or not _os.numa_nodes():
        pytest.skip("CPU 0 is not ours or the NUMA nodes are not reported")
    proc = subprocess.Popen(
        [sys.executable, "-c", PROBE, str(converted("qwen3moe_a")), "0"],
        env=ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        report = json.loads(proc.stdout.readline() or "{}")
        assert report, proc.stderr.read()
        assert len(report["masks"]) >= 2 and set(report["masks"].values()) == {"0"}, report
        assert report["policy"] == ["interleave", [0]]
        if shutil.which("taskset"):
            for tid in report["masks"]:
                out = subprocess.run(["taskset", "-cp", tid], capture_output=True, text=True).stdout
                assert out.strip().endswith(": 0"), out
    finally:
        proc.communicate("\n", timeout=60)
    assert proc.returncode == 0


@linux_only
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--cpu-mask", "x"], "--cpu-mask 'x': expected a CPU list"),
        (["--cpu-mask", "100000"], "--cpu-mask 100000: CPUs 100000 are not available to this process"),
        (["--cpu-mask", ","], "--cpu-mask is empty"),
    ],
)
def test_a_mask_that_cannot_be_honoured_is_one_line(flags, message):
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "run", "--prompt", "x", *flags], env=ENV, capture_output=True, text=True
    )
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()] and message in r.stderr, r.stderr


@linux_only
def test_run_says_where_it_was_placed(converted):
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "run", "--model-dir", str(converted("qwen3moe_a")), "--tokens", "5,6,7"]
        + ["--max-new-tokens", "2", "--ids", "--cpu-mask", "0", "--numa", "bind"],
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "[INFO] Placement: CPUs 0, memory bound to NUMA node(s) [0]" in r.stderr
    assert ", 1 threads" in r.stderr  # the default thread count follows the mask
