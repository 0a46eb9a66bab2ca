"""Where the engine's threads run and its memory lives: `--cpu-mask` and `--numa`, checked and
applied through colibri._os before a model loads (threads and memory policy are inherited by
every thread started after, the engine's OpenMP pool and the server's included).

--cpu-mask takes Linux's CPU list syntax ("0-15,32-47", as taskset -c and numactl
--physcpubind); the default thread count then follows it (colibri._os.compute_cores counts the
physical cores of the mask). --numa interleave spreads the process's new pages (KV cache,
scratch, and the page cache of the weights it reads first) over the nodes of the mask's CPUs
(every node without a mask) page by page: one process using a two-socket machine's memory
bandwidth evenly. --numa bind keeps them on those nodes: with --cpu-mask naming one node's CPUs,
one replica per node, as `numactl --cpunodebind N --membind N` does. Pages already in the page
cache stay where they are (a model read before by another process on another node): drop the
cache or start each replica on a freshly read copy.
"""

from __future__ import annotations

import os

from . import _os
from .errors import ColibriError

NUMA_POLICIES = ("interleave", "bind")


def place(cpu_mask: str | None = None, numa: str | None = None) -> str | None:
    """Apply --cpu-mask (a CPU list) and --numa ("interleave" | "bind"); a line saying what was set,
    or None when neither was given. ColibriError naming the value when it cannot be honoured."""
    if cpu_mask is None and numa is None:
        return None
    said = []
    cpus = None
    if cpu_mask is not None:
        try:
            cpus = set(_os.parse_cpu_list(cpu_mask))
        except ValueError:
            raise ColibriError(f"--cpu-mask {cpu_mask!r}: expected a CPU list such as 0-7 or 0-3,8-11") from None
        if not cpus:
            raise ColibriError("--cpu-mask is empty: name at least one CPU (e.g. 0-7)")
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        if allowed is not None and not cpus <= allowed:
            raise ColibriError(
                f"--cpu-mask {cpu_mask}: CPUs {_os_list(cpus - allowed)} are not available to this process "
                f"(it may use {_os_list(allowed)})"
            )
        try:
            _os.set_cpus(cpus)
        except OSError as e:
            raise ColibriError(f"--cpu-mask {cpu_mask}: {e.strerror or e}") from None
        said.append(f"CPUs {_os_list(cpus)}")
    if numa is not None:
        if numa not in NUMA_POLICIES:
            raise ColibriError(f"--numa must be one of {', '.join(NUMA_POLICIES)}, got {numa!r}")
        nodes = _os.numa_nodes()
        if not nodes:
            raise ColibriError(
                "--numa: this system does not report its NUMA nodes (Linux's /sys/devices/system/node); "
                "on Windows start one process per node with start /NODE N"
            )
        chosen = sorted(n for n, node_cpus in nodes.items() if cpus is None or node_cpus & cpus)
        try:
            _os.set_memory_policy(numa, chosen)
        except OSError as e:
            raise ColibriError(f"--numa {numa}: {e.strerror or e}") from None
        said.append(f"memory {'interleaved over' if numa == 'interleave' else 'bound to'} NUMA node(s) {chosen}")
    return ", ".join(said)


def _os_list(cpus) -> str:
    """A CPU set in CPU list syntax: {0, 1, 2, 5} -> "0-2,5"."""
    runs, cpus = [], sorted(cpus)
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)
