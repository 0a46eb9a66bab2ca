"""The memory limit a Linux control group puts on this process, read from cgroupfs.

A limit on a group holds for every group below it, so the effective limit is the smallest one
between this process's group and the root of its hierarchy:

    cgroup v2   /proc/self/cgroup "0::PATH"; the cgroup2 mount in /proc/self/mountinfo; at each
                level PATH, PATH/.., ... up to the mount: memory.max and memory.high ("max": none).
                Usage: memory.current; peak: memory.peak (Linux 5.19+).
    cgroup v1   /proc/self/cgroup "N:...memory...:PATH"; the cgroup mount with the memory option;
                memory.stat's hierarchical_memory_limit (already the smallest over the ancestors),
                else memory.limit_in_bytes. A value of 2**60 or more means none (the kernel
                writes PAGE_COUNTER_MAX rounded to pages). Usage: memory.usage_in_bytes; peak:
                memory.max_usage_in_bytes.

Both count the page cache of files this group read, which is why the expert cache drops an
evicted expert's pages from it (csrc/expert_cache.h). On a hybrid system (v1 memory controller,
v2 mounted beside it without one) the v2 directory has no memory.max and is skipped. `proc` and
`root` are parameters so that tests can point them at a fake tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

UNLIMITED = 1 << 60


@dataclass(frozen=True)
class CgroupLimit:
    limit: int  # bytes
    source: str  # the file that set it
    usage_file: str | None  # the group's current usage (page cache included)
    peak_file: str | None  # its high-water mark


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _number(text: str | None) -> int | None:
    """A limit file's value in bytes, None for "max", unlimited or unreadable."""
    if text is None:
        return None
    text = text.strip()
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 <= value < UNLIMITED else None


def _mounts(mountinfo: str) -> list:
    """[(fstype, mount root, mount point, super options)] of the cgroup mounts."""
    out = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        out.append((tail[0], fields[3], fields[4].replace("\\040", " "), tail[2].split(",")))
    return out


def _group_dir(root: str, mount_root: str, mount_point: str, path: str) -> str:
    rel = os.path.relpath(path, mount_root) if path.startswith(mount_root) else path.lstrip("/")
    rel = "" if rel == "." else rel
    return os.path.normpath(root + os.path.join(mount_point, rel))


def find(proc: str = "/proc/self", root: str = "") -> CgroupLimit | None:
    """The tightest memory limit of this process's cgroups (v1 and v2), or None."""
    groups, mountinfo = _read(os.path.join(proc, "cgroup")), _read(os.path.join(proc, "mountinfo"))
    if not groups or not mountinfo:
        return None
    mounts = _mounts(mountinfo)
    found = []
    for line in groups.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "" and parts[0] == "0":  # v2
            for fstype, mroot, mpoint, _ in mounts:
                if fstype != "cgroup2":
                    continue
                top = os.path.normpath(root + mpoint)
                d = _group_dir(root, mroot, mpoint, path)
                if not os.path.exists(os.path.join(d, "memory.max")):
                    continue
                level = d
                while True:
                    for name in ("memory.max", "memory.high"):
                        value = _number(_read(os.path.join(level, name)))
                        if value is not None:
                            found.append(
                                CgroupLimit(
                                    value,
                                    os.path.join(level, name),
                                    os.path.join(d, "memory.current"),
                                    os.path.join(d, "memory.peak"),
                                )
                            )
                    if level == top or len(level) <= len(top):
                        break
                    level = os.path.dirname(level)
        elif "memory" in controllers.split(","):  # v1
            for fstype, mroot, mpoint, opts in mounts:
                if fstype != "cgroup" or "memory" not in opts:
                    continue
                d = _group_dir(root, mroot, mpoint, path)
                value, source = None, None
                stat = _read(os.path.join(d, "memory.stat"))
                for row in (stat or "").splitlines():
                    if row.startswith("hierarchical_memory_limit "):
                        value, source = _number(row.split()[1]), os.path.join(d, "memory.stat")
                if value is None:
                    value, source = (
                        _number(_read(os.path.join(d, "memory.limit_in_bytes"))),
                        os.path.join(d, "memory.limit_in_bytes"),
                    )
                if value is not None:
                    found.append(
                        CgroupLimit(
                            value,
                            source,
                            os.path.join(d, "memory.usage_in_bytes"),
                            os.path.join(d, "memory.max_usage_in_bytes"),
                        )
                    )
    return min(found, key=lambda c: c.limit) if found else None


def usage(limit: CgroupLimit) -> tuple:
    """(current, peak) bytes of the group, each None where the kernel does not say."""
    return (
        _number(_read(limit.usage_file)) if limit.usage_file else None,
        _number(_read(limit.peak_file)) if limit.peak_file else None,
    )
