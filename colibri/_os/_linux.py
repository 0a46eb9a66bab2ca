"""The Linux backend of colibri._os, also serving other POSIX systems ("posix-generic").

libc is opened on first use and every prototype (restype, argtypes) is declared once, from the
table `_PROTOTYPES`, then cached; importing this module on Windows does nothing OS-specific.
Ranges arrive page-aligned from the interface. Advice failures raise OSError (the interface warns);
every range of a call is tried before the first error is raised.
Linux-only parts (/proc/self/statm, /proc/self/io, posix_fadvise) degrade elsewhere as the
interface documents.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import sys

import numpy as np

# Constants from Python's mmap module where it has them (right for the running OS); the Linux
# values otherwise, only so that this module imports on Windows (where they are never used).
PROT_READ = getattr(mmap, "PROT_READ", 0x1)
PROT_WRITE = getattr(mmap, "PROT_WRITE", 0x2)
MAP_SHARED = getattr(mmap, "MAP_SHARED", 0x01)
MAP_PRIVATE = getattr(mmap, "MAP_PRIVATE", 0x02)
MAP_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", getattr(mmap, "MAP_ANON", 0x20))
MADV_WILLNEED = getattr(mmap, "MADV_WILLNEED", 3)
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
MADV_NOHUGEPAGE = getattr(mmap, "MADV_NOHUGEPAGE", 15)  # Linux only
MADV_POPULATE_READ = 22  # Linux 5.14+: read in and map, synchronously
POSIX_FADV_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", 4)
MAP_FAILED = ctypes.c_void_p(-1).value
# AMX's tile state (Linux 5.16+, x86-64): arch_prctl through syscall(2), which older C libraries
# do not wrap; the kernel's uapi/asm/prctl.h numbers, and XSAVE component 18 (XTILEDATA)
SYS_ARCH_PRCTL = 158
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
# NUMA memory policy through syscall(2) (glibc leaves set_mempolicy / get_mempolicy to libnuma):
# the kernel's syscall numbers per architecture and uapi/linux/mempolicy.h's modes
SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}
SYS_GET_MEMPOLICY = {"x86_64": 239, "aarch64": 236}
MEMORY_POLICIES = {"default": 0, "bind": 2, "interleave": 3}  # MPOL_DEFAULT, MPOL_BIND, MPOL_INTERLEAVE
MAX_NODES = 1024  # the node mask's bits

_c_off_t = ctypes.c_int64 if sys.platform == "darwin" else ctypes.c_long  # glibc mmap: off_t = long

# name: (restype, argtypes)
_PROTOTYPES = {
    "mmap": (ctypes.c_void_p, (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, _c_off_t)),
    "munmap": (ctypes.c_int, (ctypes.c_void_p, ctypes.c_size_t)),
    "madvise": (ctypes.c_int, (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)),
    "mincore": (ctypes.c_int, (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)),
    "mlock": (ctypes.c_int, (ctypes.c_void_p, ctypes.c_size_t)),
    "munlock": (ctypes.c_int, (ctypes.c_void_p, ctypes.c_size_t)),
    "posix_fadvise": (ctypes.c_int, (ctypes.c_int, _c_off_t, _c_off_t, ctypes.c_int)),
    "syscall": (ctypes.c_long, None),  # variadic: each call passes ctypes-typed arguments
}


@functools.lru_cache(maxsize=None)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)  # the process's own symbols: libc is among them


@functools.lru_cache(maxsize=None)
def _fn(name: str):
    """The libc function `name`, its prototype declared (once) from _PROTOTYPES."""
    restype, argtypes = _PROTOTYPES[name]
    f = getattr(_libc(), name)
    f.restype, f.argtypes = restype, argtypes
    return f


def _error(call: str, address: int, length: int, hint: str = "") -> OSError:
    err = ctypes.get_errno()
    msg = f"{call}(0x{address:x}, {length}) failed: {os.strerror(err)}"
    return OSError(err, msg + (f". {hint}" if hint else ""))


def _each(ranges, name: str, *extra, hint=None) -> None:
    """Call `name(address, length, *extra)` on every range; raise the first failure at the end."""
    f, first = _fn(name), None
    for address, length in ranges:
        if f(address, length, *extra) != 0 and first is None:
            first = _error(name, address, length, hint(ctypes.get_errno()) if hint else "")
    if first is not None:
        raise first


def page_size() -> int:
    return mmap.PAGESIZE


# One madvise(MADV_WILLNEED) on a file mapping reads at most max(read_ahead_kb, max_sectors_kb)
# of the file's device (mm/readahead.c force_page_cache_ra; read_ahead_kb alone before Linux
# 4.10); the rest of the range is silently ignored. So prefetch splits ranges into pieces of that
# size: the smallest over the files mapped so far, DEFAULT_PREFETCH_CHUNK before any (the default
# read_ahead_kb, never too big).
DEFAULT_PREFETCH_CHUNK = 128 << 10
_prefetch_chunk = 0  # 0: no file mapped yet


@functools.lru_cache(maxsize=None)
def _device_prefetch_chunk(dev: int) -> int:
    """The readahead limit in bytes of the block device `dev` (st_dev), or the default."""

    def kib(queue: str, name: str) -> int:
        with open(f"{queue}/{name}") as f:
            return int(f.read())

    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for queue in (base + "/queue", base + "/../queue"):  # a partition's queue is its disk's
        try:
            limit = max(kib(queue, "read_ahead_kb"), kib(queue, "max_sectors_kb")) << 10
        except (OSError, ValueError):
            continue
        return max(limit, mmap.PAGESIZE) // mmap.PAGESIZE * mmap.PAGESIZE
    return DEFAULT_PREFETCH_CHUNK  # no block device (tmpfs, NFS, btrfs, macOS): be safe


def engine_advice() -> tuple:
    """(kind, will_need, release, will_need_arg, release_arg) for the compiled layer loop: libc's
    madvise for both, with MADV_WILLNEED / MADV_DONTNEED."""
    madvise = ctypes.cast(_fn("madvise"), ctypes.c_void_p).value
    return "madvise", madvise, madvise, MADV_WILLNEED, MADV_DONTNEED


@functools.lru_cache(maxsize=None)
def _populate_read_works() -> bool:
    """Whether this kernel knows MADV_POPULATE_READ (EINVAL before 5.14): tried on one page."""
    if not sys.platform.startswith("linux"):
        return False
    page = mmap.PAGESIZE
    address = alloc_aligned(page)
    try:
        return _fn("madvise")(address, page, MADV_POPULATE_READ) == 0
    finally:
        free_aligned(address, page)


def cache_advice() -> tuple:
    """(posix_fadvise, POSIX_FADV_DONTNEED, read code) for the expert cache's reader: the read is
    MADV_POPULATE_READ where the kernel has it (the pages are read in one request and mapped, so
    the loop takes no fault), else MADV_WILLNEED (asynchronous readahead)."""
    try:
        fadvise = ctypes.cast(_fn("posix_fadvise"), ctypes.c_void_p).value
    except AttributeError:  # macOS has no posix_fadvise
        fadvise = 0
    return fadvise or 0, POSIX_FADV_DONTNEED, MADV_POPULATE_READ if _populate_read_works() else MADV_WILLNEED


def memory_limit() -> tuple:
    """(bytes, what set it) of the cgroup limit on this process, or (None, "")."""
    from . import _cgroup

    found = _cgroup.find()
    return (found.limit, found.source) if found else (None, "")


def memory_usage() -> tuple:
    """(current, peak) bytes of the enforcing cgroup, page cache included; Nones without one."""
    from . import _cgroup

    found = _cgroup.find()
    return _cgroup.usage(found) if found else (None, None)


def available_memory() -> int | None:
    """/proc/meminfo MemAvailable: what new allocations can get without swapping."""
    text = None
    try:
        with open("/proc/meminfo") as f:
            text = f.read()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def prefetch_chunk(path: str) -> int:
    return _device_prefetch_chunk(os.stat(path).st_dev) if sys.platform.startswith("linux") else 0


# ---- mappings and memory -------------------------------------------------------------------------


def map_file(path: str) -> tuple[int, int]:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))  # raises with the filename
    try:
        st = os.fstat(fd)
        size = st.st_size
        if size == 0:
            return 0, 0
        if sys.platform.startswith("linux"):
            global _prefetch_chunk
            chunk = _device_prefetch_chunk(st.st_dev)
            _prefetch_chunk = min(_prefetch_chunk, chunk) if _prefetch_chunk else chunk
        address = _fn("mmap")(None, size, PROT_READ, MAP_SHARED, fd, 0)
        if address in (None, MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"cannot map {size} bytes read-only: {os.strerror(err)}", path)
        return address, size
    finally:
        os.close(fd)  # the mapping keeps its own reference to the file


def unmap_file(address: int, size: int) -> None:
    if _fn("munmap")(address, size) != 0:
        raise _error("munmap", address, size)


def alloc_aligned(nbytes: int) -> int:
    address = _fn("mmap")(None, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    if address in (None, MAP_FAILED):
        raise MemoryError(f"cannot allocate {nbytes} bytes of anonymous memory: {os.strerror(ctypes.get_errno())}")
    return address


def free_aligned(address: int, nbytes: int) -> None:
    unmap_file(address, nbytes)


# ---- advice --------------------------------------------------------------------------------------


def _pieces(ranges, chunk: int):
    for address, length in ranges:
        for start in range(address, address + length, chunk):
            yield start, min(chunk, address + length - start)


def prefetch(ranges) -> None:
    if sys.platform.startswith("linux"):
        ranges = _pieces(ranges, _prefetch_chunk or DEFAULT_PREFETCH_CHUNK)
    _each(ranges, "madvise", MADV_WILLNEED)


def _release_hint(err: int) -> str:
    return "Locked pages cannot be released; unlock them first" if err == 22 else ""


def release(ranges) -> None:
    _each(ranges, "madvise", MADV_DONTNEED, hint=_release_hint)


def _memlock_hint(err: int) -> str:
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ImportError, AttributeError, OSError):
        return ""
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
    return (
        f"RLIMIT_MEMLOCK is {limit}: raise it (`ulimit -l`, /etc/security/limits.conf, "
        "LimitMEMLOCK= in systemd) or run without locking"
    )


def lock(ranges) -> None:
    _each(ranges, "mlock", hint=_memlock_hint)


def unlock(ranges) -> None:
    _each(ranges, "munlock")


def small_pages(ranges) -> None:
    if sys.platform.startswith("linux"):  # the only POSIX with transparent huge pages
        _each(ranges, "madvise", MADV_NOHUGEPAGE)


def resident_bytes(address: int, length: int) -> int:
    page = mmap.PAGESIZE
    chunk = 1 << 20  # pages per mincore call: a 1 MiB vector covers 4 GiB of 4 KiB pages
    vec = np.empty(min(chunk, length // page), np.uint8)
    total = 0
    for start in range(address, address + length, chunk * page):
        n = min(chunk * page, address + length - start)
        if _fn("mincore")(start, n, vec.ctypes.data) != 0:
            raise _error("mincore", start, n)
        total += int(np.count_nonzero(vec[: n // page] & 1))
    return total * page


# ---- statistics ----------------------------------------------------------------------------------


def page_faults() -> tuple[int, int]:
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_minflt, ru.ru_majflt


def rss_bytes() -> tuple[int, int]:
    """Linux: VmRSS and VmHWM of /proc/self/status (the high-water mark restarts at exec, unlike
    getrusage's ru_maxrss, which a child started by a big parent inherits). Elsewhere: ru_maxrss."""
    try:
        with open("/proc/self/status", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        current = int(fields[b"VmRSS"].split()[0]) * 1024
        peak = int(fields[b"VmHWM"].split()[0]) * 1024
        return current, max(current, peak)
    except (OSError, KeyError, ValueError):
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
    return peak, peak


def address_space_room() -> tuple:
    """(bytes of address space this process may still map, bytes of a new thread's stack), each
    None where unknown: RLIMIT_AS (ulimit -v) less VmSize of /proc/self/status; the stack as glibc
    sizes it, RLIMIT_STACK (ulimit -s) where finite, else 8 MiB (or threading.stack_size())."""
    import resource
    import threading

    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    room = None
    if soft != resource.RLIM_INFINITY:
        try:
            with open("/proc/self/status", "rb") as f:
                fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
            room = max(soft - int(fields[b"VmSize"].split()[0]) * 1024, 0)
        except (OSError, KeyError, ValueError):
            room = None
    stack = threading.stack_size() or resource.getrlimit(resource.RLIMIT_STACK)[0]
    if stack == resource.RLIM_INFINITY or stack <= 0:
        stack = 8 << 20
    return room, stack


def evict_file_cache(fd: int) -> bool:
    fadvise = getattr(os, "posix_fadvise", None)  # Linux/BSD; not macOS
    if fadvise is None:
        return False
    fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # OSError on failure: the interface warns
    return True


def _tile_data_permitted(syscall) -> bool:
    """Does this process already hold XTILEDATA's permission (ARCH_GET_XCOMP_PERM)? OSError if the
    kernel cannot say (before 5.16)."""
    mask = ctypes.c_uint64(0)
    if syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(ARCH_GET_XCOMP_PERM), ctypes.byref(mask)) != 0:
        err = ctypes.get_errno()
        raise OSError(
            err,
            f"arch_prctl(ARCH_GET_XCOMP_PERM) failed: {os.strerror(err)} (Linux 5.16 or later lends AMX's tile state)",
        )
    return bool(mask.value >> XFEATURE_XTILEDATA & 1)


def _tile_data_hint(err: int) -> str:
    if err in (errno.EOPNOTSUPP, errno.ENOTSUP):
        return "this CPU or kernel has no AMX tile state to lend"
    if err == errno.EINVAL:
        return "the kernel does not know the tile state (Linux 5.16 or later lends it)"
    if err == errno.ENOSPC:
        return "an alternate signal stack of this process (sigaltstack) is too small for the tile state"
    return os.strerror(err)


def request_tile_data() -> None:
    """Ask Linux for AMX's tile state (XSAVE component 18), which it lends a process only on request
    (arch_prctl ARCH_REQ_XCOMP_PERM; the permission then holds for every thread, once per process).
    A no-op if already held; OSError naming the cause where refused or not x86-64 Linux."""
    machine = os.uname().machine if hasattr(os, "uname") else "?"
    if (
        not sys.platform.startswith("linux")
        or machine not in ("x86_64", "amd64")
        or ctypes.sizeof(ctypes.c_void_p) != 8
    ):
        raise OSError(
            f"AMX's tile state is an x86-64 Linux request; this is a {8 * ctypes.sizeof(ctypes.c_void_p)}-bit "
            f"process on {sys.platform} {machine}"
        )
    syscall = _fn("syscall")
    if _tile_data_permitted(syscall):
        return
    if (
        syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(ARCH_REQ_XCOMP_PERM), ctypes.c_ulong(XFEATURE_XTILEDATA))
        != 0
    ):
        err = ctypes.get_errno()
        raise OSError(err, f"arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) refused: {_tile_data_hint(err)}")
    if not _tile_data_permitted(syscall):
        raise OSError("arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) returned success, yet the permission is not held")


def read_io_bytes() -> int | None:
    try:
        with open("/proc/self/io", "rb") as f:
            for line in f:
                if line.startswith(b"read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


# ---- where the threads run and the memory lives -------------------------------------------------


def set_cpus(cpus) -> None:
    """Run every thread of this process (those started at import by numpy's BLAS among them), and
    every thread started from now on, on `cpus` only (sched_setaffinity per thread)."""
    if not hasattr(os, "sched_setaffinity"):
        raise OSError(f"this system ({sys.platform}) has no CPU affinity call")
    os.sched_setaffinity(0, cpus)  # this thread first: what it starts inherits the mask
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return  # not Linux: this thread's mask is what the system lets one set
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            pass  # the thread ended meanwhile


def numa_nodes() -> dict:
    """{node: frozenset of its CPUs} from /sys/devices/system/node; {} where not known."""
    nodes = {}
    try:
        entries = os.listdir("/sys/devices/system/node")
    except OSError:
        return {}
    for name in entries:
        if name.startswith("node") and name[4:].isdigit():
            try:
                with open(f"/sys/devices/system/node/{name}/cpulist") as f:
                    nodes[int(name[4:])] = frozenset(parse_cpu_list(f.read().strip()))
            except (OSError, ValueError):
                continue
    return nodes


def parse_cpu_list(text: str) -> list:
    """The CPUs of a Linux CPU list ("0-3,8,10-11"; "" is none); ValueError if malformed."""
    cpus = []
    for part in filter(None, text.split(",")):
        lo, sep, hi = part.partition("-")
        first, last = int(lo), int(hi) if sep else int(lo)
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.extend(range(first, last + 1))
    return cpus


def _mempolicy_syscall(table: dict) -> int:
    machine = os.uname().machine if hasattr(os, "uname") else "?"
    if not sys.platform.startswith("linux") or machine not in table:
        raise OSError(f"NUMA memory policy is a Linux call on x86-64 or arm64; this is {sys.platform} {machine}")
    return table[machine]


def set_memory_policy(policy: str, nodes) -> None:
    """This thread's (and the threads it starts') memory policy: "interleave" (pages spread over
    `nodes` in turn), "bind" (only on `nodes`) or "default" (the local node); set_mempolicy(2)."""
    number = _mempolicy_syscall(SYS_SET_MEMPOLICY)
    mask = (ctypes.c_ulong * (MAX_NODES // (8 * ctypes.sizeof(ctypes.c_ulong))))()
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    for node in nodes if policy != "default" else ():
        mask[node // bits] |= 1 << (node % bits)
    ok = _fn("syscall")(
        ctypes.c_long(number),
        ctypes.c_int(MEMORY_POLICIES[policy]),
        mask if policy != "default" else None,
        ctypes.c_ulong(MAX_NODES + 1 if policy != "default" else 0),
    )
    if ok != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"set_mempolicy({policy}, nodes {sorted(nodes)}) refused: {os.strerror(err)}")


def memory_policy() -> tuple:
    """(policy name, sorted nodes) of this thread's memory policy (get_mempolicy(2))."""
    number = _mempolicy_syscall(SYS_GET_MEMPOLICY)
    mode = ctypes.c_int(0)
    mask = (ctypes.c_ulong * (MAX_NODES // (8 * ctypes.sizeof(ctypes.c_ulong))))()
    ok = _fn("syscall")(
        ctypes.c_long(number), ctypes.byref(mode), mask, ctypes.c_ulong(MAX_NODES + 1), None, ctypes.c_ulong(0)
    )
    if ok != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"get_mempolicy refused: {os.strerror(err)}")
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    nodes = [i for i in range(MAX_NODES) if mask[i // bits] >> (i % bits) & 1]
    names = {code: name for name, code in MEMORY_POLICIES.items()}
    return names.get(mode.value, f"mode {mode.value}"), nodes if mode.value else []
