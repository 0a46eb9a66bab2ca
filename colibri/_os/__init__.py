"""Residency: the one interface to the operating system's virtual memory (and to the one other
thing the OS lends per process: AMX's tile state, request_tile_data).

Nothing above this module knows the OS. The backend is picked once, here, by platform:

    linux          _linux.py   libc mmap/madvise/mincore/mlock, /proc/self, getrusage,
                               syscall(arch_prctl) for the tile state
    windows        _windows.py kernel32 CreateFileMappingW/MapViewOfFile, PrefetchVirtualMemory,
                               VirtualLock/VirtualUnlock, QueryWorkingSetEx, GetProcessMemoryInfo,
                               EnableProcessOptionalXStateFeatures for the tile state
    posix-generic  _linux.py   the same libc calls on macOS/BSD; Linux-only parts (/proc) degrade

Every backend module imports on every OS (DLLs and symbols are looked up on first use), so the
contract test in tests/test_os.py can check all of them anywhere.

Contracts common to all functions:
- A range is `(address, length)` in bytes. `ranges` is an iterable of such pairs. Before a range
  reaches the OS, it is page-aligned here: the start is rounded down and the end rounded up to
  `page_size()`; empty ranges are dropped, and overlapping or touching ranges are merged.
- A memory hint (prefetch, release, lock, unlock, evict_file_cache) is advice: if the OS refuses,
  it warns once per function with an `AdviceWarning` that says why and what to do, goes on with
  the remaining ranges, and returns False. Success returns True.
- Mapping a file or allocating memory is not advice: failure raises (`OSError` naming the file,
  `MemoryError`).
- A raw address stays valid only while its `Mapping` / `AlignedBuffer` is open. numpy views from
  `as_numpy` keep their owner alive, but `close()` unmaps regardless: drop the views first.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings

import numpy as np

from . import _linux  # imports on every OS (parse_cpu_list is plain Python)

if sys.platform == "win32":
    from . import _windows as _backend

    BACKEND = "windows"
elif sys.platform.startswith("linux"):
    from . import _linux as _backend

    BACKEND = "linux"
else:
    from . import _linux as _backend

    BACKEND = "posix-generic"

# The public interface, documented function by function below. Each backend module defines a
# function of every one of these names (see BACKEND_FUNCTIONS for how the backend forms differ).
INTERFACE = (
    "map_file",  # path -> Mapping                   read-only mapping of a whole file
    "prefetch",  # ranges -> bool                    advice: will be read soon
    "prefetch_chunk",  # path -> int                       bytes one OS prefetch call reads
    "release",  # ranges -> bool                    advice: may be dropped from the process
    "resident_bytes",  # address, length -> int            bytes of the range in memory
    "alloc_aligned",  # nbytes, align -> (address, AlignedBuffer)   anonymous read-write memory
    "lock",  # ranges -> bool                    pin in RAM (mlock / VirtualLock)
    "unlock",  # ranges -> bool                    undo lock
    "small_pages",  # ranges -> bool                    advice: anonymous memory grows page by page
    "page_faults",  # () -> (minor, major)              this process, since it started
    "rss_bytes",  # () -> (current, peak)             resident set / working set
    "evict_file_cache",  # path -> bool                      drop a file from the OS page cache
    "read_io_bytes",  # () -> int | None                  bytes this process read from storage
    "page_size",  # () -> int
    "engine_advice",  # () -> EngineAdvice                the OS functions the layer loop calls
    "cache_advice",  # () -> CacheAdvice                 what the expert cache's reader calls besides
    "memory_limit",  # () -> (bytes | None, source)      the cgroup / job object limit on this process
    "memory_usage",  # () -> (current, peak)             of what enforces that limit (None: unknown)
    "available_memory",  # () -> bytes | None                RAM new allocations can get (MemAvailable)
    "address_space_room",  # () -> (bytes | None, stack | None)  mappable address space left, a thread's stack
    "request_tile_data",  # () -> (granted, why not)         AMX's tile state for this process (once)
    "set_cpus",  # cpus -> None                      run this process's threads on these CPUs only
    "numa_nodes",  # () -> {node: frozenset(cpus)}     ({} where unknown)
    "set_memory_policy",  # policy, nodes -> None            "interleave" | "bind" | "default" memory
    "memory_policy",  # () -> (policy, nodes)            this thread's
)
# What a backend module must define: every interface name, plus the frees that pair with
# map_file/alloc_aligned. Where the forms differ, the backend's is lower-level: map_file(path)
# returns (address, size), alloc_aligned(nbytes) a page-aligned address (the Mapping/AlignedBuffer
# objects are built here, once), evict_file_cache takes a file descriptor opened here, and advice
# raises OSError (the warning is issued here).
BACKEND_FUNCTIONS = INTERFACE + ("unmap_file", "free_aligned")


class AdviceWarning(RuntimeWarning):
    """The OS declined a memory hint; Colibri goes on without it (slower, never wrong)."""


_WARNED: set[str] = set()  # interface functions that have already warned (once per function)


def _warn_once(name: str, error: OSError, stacklevel: int) -> None:
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(
            f"colibri._os.{name} ({BACKEND}): {error} — going on without it; further {name} failures are not reported",
            AdviceWarning,
            stacklevel=stacklevel + 1,
        )


def _advise(name: str, call, ranges) -> bool:
    """Run the backend's advice `call(ranges)`: True, or warn once and False if the OS refused."""
    try:
        call(ranges)
    except OSError as e:
        _warn_once(name, e, stacklevel=3)
        return False
    return True


def page_size() -> int:
    """The virtual-memory page size in bytes (the alignment unit of every range)."""
    return _PAGE


_PAGE = _backend.page_size()
_MASK = ~(_PAGE - 1)


def _aligned(ranges) -> list[tuple[int, int]]:
    """`ranges` rounded out to whole pages, sorted, with overlapping/touching ranges merged."""
    if isinstance(ranges, tuple) and len(ranges) == 2 and all(isinstance(x, int) for x in ranges):
        raise TypeError(
            "ranges must be an iterable of (address, length) pairs; wrap a single range in a list: [(address, length)]"
        )
    spans = []
    for address, length in ranges:
        address, length = int(address), int(length)
        if length < 0 or address < 0:
            raise ValueError(f"bad range (address={address}, length={length}): both must be >= 0")
        if length:
            spans.append((address & _MASK, (address + length + _PAGE - 1) & _MASK))
    spans.sort()
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end - start) for start, end in merged]


# ---- memory objects ------------------------------------------------------------------------------


class _Region:
    """`size` bytes at `address`, owned by this object until `close()`."""

    _writeable = True

    def __init__(self, address: int, size: int):
        self.address = address  # int, 0 when size == 0
        self.size = size  # bytes
        self.closed = False

    def as_numpy(self, dtype=np.uint8, shape=None, offset: int = 0) -> np.ndarray:
        """A numpy view (no copy) of the region from byte `offset`; the view keeps this object
        alive, but must not be used after `close()`. Views of a `Mapping` are read-only."""
        if self.closed:
            raise ValueError(f"{type(self).__name__} is closed")
        dtype = np.dtype(dtype)
        count = (self.size - offset) // dtype.itemsize if shape is None else int(np.prod(shape))
        if offset < 0 or count < 0 or offset + count * dtype.itemsize > self.size:
            raise ValueError(f"view of {count} x {dtype} at offset {offset} does not fit in {self.size} bytes")
        if count == 0:
            return np.empty(shape if shape is not None else 0, dtype)
        raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(self.address + offset)
        raw._owner = self  # the array keeps the mapping alive as long as any view of it lives
        view = np.frombuffer(raw, dtype=dtype, count=count)
        view.flags.writeable = self._writeable
        return view if shape is None else view.reshape(shape)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the backend may already be gone
            pass

    def __repr__(self):
        state = "closed" if self.closed else f"0x{self.address:x}"
        return f"<{type(self).__name__} {state} size={self.size}>"


class Mapping(_Region):
    """A read-only mapping of a whole file (`map_file`)."""

    _writeable = False

    def __init__(self, address: int, size: int, path: str):
        super().__init__(address, size)
        self.path = path

    def close(self) -> None:
        """Unmap the file (idempotent). Raw pointers and numpy views into it become invalid."""
        if not self.closed:
            self.closed = True
            if self.size:
                _backend.unmap_file(self.address, self.size)


class AlignedBuffer(_Region):
    """Anonymous zero-filled read-write memory (`alloc_aligned`); `address` is aligned."""

    def __init__(self, address: int, size: int, base: int, base_size: int):
        super().__init__(address, size)
        self._base, self._base_size = base, base_size  # the OS allocation (may be larger)

    def close(self) -> None:
        """Free the memory (idempotent). Raw pointers and numpy views into it become invalid."""
        if not self.closed:
            self.closed = True
            if self._base_size:
                _backend.free_aligned(self._base, self._base_size)


# ---- the interface -------------------------------------------------------------------------------


def map_file(path) -> Mapping:
    """Map the whole file at `path` read-only and shared with the page cache.

    Linux/POSIX: mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0) through libc, so the address is
    ours to hand to C. Windows: CreateFileW + CreateFileMappingW(PAGE_READONLY) +
    MapViewOfFile(FILE_MAP_READ). Pages are read from storage on first touch (or `prefetch`).
    A zero-length file gives a Mapping with address 0 and size 0 (nothing is mapped).
    Raises OSError naming the file when it cannot be opened or mapped.
    """
    path = str(path)
    address, size = _backend.map_file(path)
    return Mapping(address, size, path)


def prefetch(ranges) -> bool:
    """Advise that the pages of `ranges` will be read soon; the OS starts reading them in.

    Linux/POSIX: madvise(MADV_WILLNEED) (for a file mapping: asynchronous readahead into the page
    cache). On Linux one such call reads at most `prefetch_chunk` bytes of a file and silently
    drops the rest, so the backend splits ranges into pieces of that size.
    Windows: PrefetchVirtualMemory (Windows 8+); where it is missing, one byte per page is read
    instead (synchronously, with ReadProcessMemory, so an unmapped page fails cleanly).
    """
    return _advise("prefetch", _backend.prefetch, _aligned(ranges))


def prefetch_chunk(path) -> int:
    """The most bytes of a mapping of `path` that one OS prefetch call is known to read in full;
    0 means no limit. Code that issues its own prefetch hints (csrc/os_hints.h) must split its
    ranges to this size, as `prefetch` does.

    Linux: one madvise(MADV_WILLNEED) on a file reads at most max(read_ahead_kb, max_sectors_kb)
    of its block device (mm/readahead.c force_page_cache_ra); read from /sys/dev/block, and 128
    KiB (the default read_ahead_kb) where there is no block device to ask. Windows, macOS: 0.
    """
    return _backend.prefetch_chunk(str(path))


def release(ranges) -> bool:
    """Advise that the pages of `ranges` may be dropped from this process (RSS falls).

    Linux/POSIX: madvise(MADV_DONTNEED). For a shared read-only file mapping the pages leave the
    process but stay in the page cache (a later touch is a minor fault, unless the OS evicted
    them); for anonymous memory the contents are LOST (reads give zeros). Locked pages cannot be
    released (EINVAL): unlock them first.
    Windows: VirtualUnlock on the range: for pages that are not locked it removes them from the
    working set (they stay on the standby list, so a later touch is a soft fault); for locked
    pages it only unlocks them. This is the documented trick: there is no ranged "trim" call.
    """
    return _advise("release", _backend.release, _aligned(ranges))


def resident_bytes(address: int, length: int) -> int:
    """How many bytes of [address, address + length) are in memory (whole pages, clipped to the
    range). A measurement, not advice: an OS error raises OSError (on Linux, ENOMEM for a range
    that is not mapped; Windows reports unmapped pages as absent).

    Linux/POSIX: mincore, i.e. the page cache for a file mapping, whether or not this process has
    touched the pages (a read would not go to storage). Since Linux 5.0, for a file the process
    neither owns nor may write, mincore only reports the pages mapped into this process.
    Windows: QueryWorkingSetEx Valid bit, i.e. pages in this process's working set; a page that
    `prefetch` read into the standby list, or that `release` trimmed, counts as absent although a
    touch would not go to storage.
    """
    address, length = int(address), int(length)
    if length <= 0:
        return 0
    ((start, span),) = _aligned([(address, length)])
    total = _backend.resident_bytes(start, span)
    head = address - start  # bytes of the first page before the range
    tail = start + span - (address + length)  # bytes of the last page after the range
    if head and _backend.resident_bytes(start, _PAGE):
        total -= head
    if tail and _backend.resident_bytes(start + span - _PAGE, _PAGE):
        total -= tail
    return total


def alloc_aligned(nbytes: int, align: int = 4096) -> tuple[int, AlignedBuffer]:
    """Anonymous zero-filled read-write memory of `nbytes`, its address a multiple of `align`
    (a power of two), for the KV cache and scratch. Returns (address, buffer); `buffer.as_numpy(
    dtype, shape)` views it without copying; `buffer.close()` frees it.

    Linux/POSIX: mmap(MAP_PRIVATE | MAP_ANONYMOUS); Windows: VirtualAlloc(MEM_COMMIT | MEM_RESERVE,
    PAGE_READWRITE). Both give page-aligned memory; a larger `align` over-allocates by `align`.
    Pages cost RAM when first written. nbytes == 0 gives an empty buffer at address 0.
    Raises MemoryError when the OS refuses.
    """
    nbytes, align = int(nbytes), int(align)
    if nbytes < 0 or align <= 0 or align & (align - 1):
        raise ValueError(
            f"alloc_aligned(nbytes={nbytes}, align={align}): expected nbytes >= 0 and align a power of two"
        )
    if nbytes == 0:
        return 0, AlignedBuffer(0, 0, 0, 0)
    extra = 0 if align <= _PAGE else align
    base_size = (nbytes + extra + _PAGE - 1) & _MASK
    base = _backend.alloc_aligned(base_size)
    address = (base + align - 1) & ~(align - 1)
    return address, AlignedBuffer(address, nbytes, base, base_size)


def zeros(shape, dtype=np.float32, align: int = 64) -> np.ndarray:
    """A zero-filled numpy array in memory from `alloc_aligned` (the KV cache, the engine's scratch):
    its pages cost RAM when first written. The array keeps its buffer alive; the buffer is freed
    when the last view of it goes."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    _, buffer = alloc_aligned(count * dtype.itemsize, align)
    return buffer.as_numpy(dtype, shape) if count else np.zeros(shape, dtype)


def arena(specs, align: int = 64) -> dict:
    """Zero-filled numpy arrays {name: array} for specs {name: (shape, dtype)}, carved from ONE
    `alloc_aligned` region (the engine's scratch): each starts on an `align`-byte boundary, and
    consecutive arrays are staggered by a further `align` * (index % 16) bytes so that arrays of a
    page-multiple size do not all start at the same offset within a page (loads of one and stores
    to another would then share their low 12 address bits: false store-forwarding dependencies,
    "4K aliasing"). The arrays keep the region alive; it is freed when the last of them goes."""
    layout, offset = [], 0
    for i, (name, (shape, dtype)) in enumerate(specs.items()):
        dtype = np.dtype(dtype)
        offset = (offset + align - 1) // align * align + align * (i % 16)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        layout.append((name, shape, dtype, offset))
        offset += nbytes
    _, buffer = alloc_aligned(max(offset, 1), align)
    return {name: buffer.as_numpy(dtype, shape, offset) for name, shape, dtype, offset in layout}


class EngineAdvice(tuple):
    """The OS functions the compiled layer loop calls for an expert's pages (csrc/os_hints.h):
    (kind, will_need, release, will_need_arg, release_arg) — kind "none", "madvise" (POSIX:
    both functions madvise, with the two advice codes) or "win32" (PrefetchVirtualMemory,
    VirtualUnlock); the functions as addresses ctypes resolved (0: none)."""

    __slots__ = ()

    def __new__(cls, kind: str, will_need: int, release: int, will_need_arg: int = 0, release_arg: int = 0):
        if kind not in ("none", "madvise", "win32"):
            raise ValueError(f"advice kind {kind!r} is not one of none, madvise, win32")
        return super().__new__(
            cls, (kind, int(will_need or 0), int(release or 0), int(will_need_arg), int(release_arg))
        )

    kind = property(lambda self: self[0])
    will_need = property(lambda self: self[1])
    release = property(lambda self: self[2])
    will_need_arg = property(lambda self: self[3])
    release_arg = property(lambda self: self[4])


NO_ADVICE = EngineAdvice("none", 0, 0)


def engine_advice() -> EngineAdvice:
    """What the layer loop calls to prefetch and release an expert's pages, resolved here once:
    Linux/POSIX: libc's madvise(MADV_WILLNEED / MADV_DONTNEED), as `prefetch` and `release` use;
    Windows: PrefetchVirtualMemory (absent before Windows 8: no prefetch) and VirtualUnlock."""
    return EngineAdvice(*_backend.engine_advice())


class CacheAdvice(tuple):
    """What the expert cache's reader thread (csrc/expert_cache.h) calls beside EngineAdvice:
    (fadvise, dontneed, read_arg) — posix_fadvise's address and POSIX_FADV_DONTNEED (0, 0: the
    page cache is not told, Windows), and the madvise code of a read (MADV_POPULATE_READ where
    the kernel has it, else MADV_WILLNEED; unused on Windows)."""

    __slots__ = ()

    def __new__(cls, fadvise: int, dontneed: int, read_arg: int):
        return super().__new__(cls, (int(fadvise or 0), int(dontneed), int(read_arg)))

    fadvise = property(lambda self: self[0])
    dontneed = property(lambda self: self[1])
    read_arg = property(lambda self: self[2])


def cache_advice() -> CacheAdvice:
    """The expert cache's OS functions, resolved here once (see CacheAdvice)."""
    return CacheAdvice(*_backend.cache_advice())


def memory_limit() -> tuple:
    """(bytes, source) of the memory limit the OS enforces on this process, or (None, "").

    Linux: the tightest cgroup limit (v2 memory.max / memory.high up the hierarchy, v1
    hierarchical_memory_limit / memory.limit_in_bytes; colibri._os._cgroup). It counts the page
    cache of the files the group reads. Windows: the job object's ProcessMemoryLimit /
    JobMemoryLimit (committed memory; the standby list is not counted). Elsewhere: (None, "")."""
    return _backend.memory_limit()


def memory_usage() -> tuple:
    """(current, peak) bytes of what enforces memory_limit — the cgroup's memory.current /
    memory.peak (v2) or usage_in_bytes / max_usage_in_bytes (v1); Windows: the working set and
    the job's peak — each None where unknown."""
    return _backend.memory_usage()


def available_memory() -> int | None:
    """Bytes of RAM new allocations can get without swapping: Linux /proc/meminfo MemAvailable,
    Windows GlobalMemoryStatusEx ullAvailPhys; None where unknown."""
    return _backend.available_memory()


def address_space_room() -> tuple:
    """(bytes of address space this process may still map, bytes of a new thread's stack), each
    None where unknown. Linux/POSIX: RLIMIT_AS less what is mapped, and RLIMIT_STACK (the default
    pthread stack). Windows: (None, None)."""
    return _backend.address_space_room()


def lock(ranges) -> bool:
    """Pin the pages of `ranges` in RAM (reading them in if needed) until `unlock`.

    Linux/POSIX: mlock, limited by RLIMIT_MEMLOCK (`ulimit -l`) unless privileged. Windows:
    VirtualLock, limited by the working-set minimum; on ERROR_WORKING_SET_QUOTA the minimum and
    maximum are raised by the range's size (SetProcessWorkingSetSize) and the lock retried once.
    """
    return _advise("lock", _backend.lock, _aligned(ranges))


def unlock(ranges) -> bool:
    """Undo `lock` on `ranges` (munlock / VirtualUnlock). The pages stay resident for now."""
    return _advise("unlock", _backend.unlock, _aligned(ranges))


def small_pages(ranges) -> bool:
    """Advise that anonymous memory in `ranges` be backed by base pages only, so that what is
    resident follows what was written (a KV cache filled position by position).

    Linux: madvise(MADV_NOHUGEPAGE): with transparent huge pages "always", the first write into a
    2 MB-aligned region would otherwise make all 2 MB resident. Other POSIX systems and Windows
    have no implicit huge pages: nothing to do (True).
    """
    return _advise("small_pages", _backend.small_pages, _aligned(ranges))


def page_faults() -> tuple[int, int]:
    """(minor, major) page faults of this process since it started.

    Linux/POSIX: getrusage(RUSAGE_SELF) ru_minflt / ru_majflt (major = read from storage).
    Windows: GetProcessMemoryInfo PageFaultCount, which does not tell soft from hard faults: it is
    returned as (total, 0), and it is a DWORD (wraps at 2**32).
    """
    return _backend.page_faults()


def rss_bytes() -> tuple[int, int]:
    """(current, peak) resident bytes of this process; peak >= current.

    Linux: current from /proc/self/statm (resident pages, file-backed included), peak from
    getrusage ru_maxrss. Other POSIX: no /proc, so current is reported as the peak (an upper
    bound). Windows: GetProcessMemoryInfo WorkingSetSize / PeakWorkingSetSize.
    """
    return _backend.rss_bytes()


def evict_file_cache(path) -> bool:
    """Drop the file's clean pages from the OS page cache, for cold-cache benchmarks.

    Linux: posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED). Dirty pages (a file just written: fsync
    it first) and pages mapped into any process (touched and not `release`d) are kept.
    Windows and macOS: not available, returns False without a warning. Raises OSError if the
    file cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))  # raises with the filename
    try:
        return _backend.evict_file_cache(fd)
    except OSError as e:
        _warn_once("evict_file_cache", e, stacklevel=2)
        return False
    finally:
        os.close(fd)


def read_io_bytes() -> int | None:
    """Bytes this process has caused to be read from storage (page-cache hits excluded), or None
    where the OS does not say. Linux: /proc/self/io read_bytes. Windows: None (the I/O counters
    of GetProcessIoCounters count cache hits as reads). Other POSIX: None.
    """
    return _backend.read_io_bytes()


_TILE_DATA: list = []  # request_tile_data's answer, once per process


def request_tile_data() -> tuple[bool, str]:
    """Ask the OS, once per process, to let this process's threads use AMX's tile registers (XSAVE
    component 18, 8 KB of state per thread): (True, "") or (False, why not, in one line). The
    caller first checks that the CPU has AMX and that XCR0 enables its state (cpu.h os_amx).
    Linux lends it only on request (arch_prctl ARCH_REQ_XCOMP_PERM, 5.16+); Windows 11 and Server
    2022 offer it as an optional feature the process turns on (EnableProcessOptionalXStateFeatures);
    other systems: refused."""
    if not _TILE_DATA:
        try:
            _backend.request_tile_data()
            _TILE_DATA.append((True, ""))
        except OSError as e:
            _TILE_DATA.append((False, e.strerror or str(e)))
    return _TILE_DATA[0]


def set_cpus(cpus) -> None:
    """Run this process's threads on `cpus` (a set of CPU numbers) only: the calling thread and
    every thread started after it (the engine's, the server's), so call it before loading a
    model. Not advice: OSError when the OS refuses (a CPU this process may not use)."""
    _backend.set_cpus(set(cpus))


def numa_nodes() -> dict:
    """{node: frozenset of its CPUs}; {} where the OS does not say (Windows, macOS)."""
    return _backend.numa_nodes()


def set_memory_policy(policy: str, nodes) -> None:
    """Where the memory this thread and those it starts later allocate lives — the KV cache, the
    scratch, and the page cache of files they read: "interleave" (spread over `nodes` page by
    page), "bind" (only on `nodes`) or "default". Linux only; OSError elsewhere or when refused."""
    _backend.set_memory_policy(policy, sorted(nodes))


def memory_policy() -> tuple:
    """(policy, nodes) of the calling thread (Linux); OSError elsewhere."""
    return _backend.memory_policy()


parse_cpu_list = _linux.parse_cpu_list  # "0-3,8" -> [0, 1, 2, 3, 8] (Linux's CPU list syntax, on any OS)


def compute_cores() -> int:
    """The threads a compute-bound process should use by default: the CPUs this process may run on
    (its affinity mask, where the OS has one), counting each physical core once (SMT siblings,
    read from Linux's /sys topology, share a core's execution units and its memory bandwidth).
    Falls back to the logical count where the topology cannot be read."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


__all__ = list(INTERFACE) + [
    "compute_cores",
    "parse_cpu_list",
    "zeros",
    "arena",
    "BACKEND",
    "INTERFACE",
    "BACKEND_FUNCTIONS",
    "Mapping",
    "AlignedBuffer",
    "AdviceWarning",
    "EngineAdvice",
    "CacheAdvice",
    "NO_ADVICE",
]
