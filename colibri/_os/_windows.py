"""The Windows backend of colibri._os (kernel32, with psapi as the fallback for old systems).

Importing this module does nothing Windows-specific: the structures below are plain ctypes (so a
contract test can check their sizes on any OS), and DLLs and functions are looked up on first use.
Every prototype (restype, argtypes) is declared once, from the table `_PROTOTYPES`, then cached.
Optional functions (PrefetchVirtualMemory, Windows 8+) are looked up the GetProcAddress way: a
missing one gives None and the caller falls back. Ranges arrive page-aligned from the interface;
advice failures raise OSError (the interface warns); every range of a call is tried first.
"""

from __future__ import annotations

import ctypes
import functools
import mmap

import numpy as np

DWORD = ctypes.c_uint32
DWORD64 = ctypes.c_uint64
ULONG = ctypes.c_uint32
BOOL = ctypes.c_int
HANDLE = ctypes.c_void_p
SIZE_T = ctypes.c_size_t
ULONG_PTR = ctypes.c_size_t
LPCWSTR = ctypes.c_wchar_p

GENERIC_READ = 0x80000000
FILE_SHARE_READ = 0x1
FILE_SHARE_DELETE = 0x4
OPEN_EXISTING = 3
FILE_ATTRIBUTE_NORMAL = 0x80
PAGE_READONLY = 0x02
PAGE_READWRITE = 0x04
FILE_MAP_READ = 0x0004
MEM_COMMIT = 0x1000
MEM_RESERVE = 0x2000
MEM_RELEASE = 0x8000
INVALID_HANDLE_VALUE = ctypes.c_void_p(-1).value
ERROR_NOT_LOCKED = 158
ERROR_WORKING_SET_QUOTA = 1453
XSTATE_AMX_TILE_CONFIG = 17  # winnt.h: the XSAVE components of AMX's tile configuration
XSTATE_AMX_TILE_DATA = 18  # and of its tile registers


class WIN32_MEMORY_RANGE_ENTRY(ctypes.Structure):  # memoryapi.h; 16 bytes on x64
    _fields_ = [("VirtualAddress", ctypes.c_void_p), ("NumberOfBytes", SIZE_T)]


class PSAPI_WORKING_SET_EX_BLOCK(ctypes.Union):  # psapi.h; one ULONG_PTR
    class _Bits(ctypes.Structure):
        _fields_ = [
            ("Valid", ULONG_PTR, 1),  # the page is in the working set
            ("ShareCount", ULONG_PTR, 3),
            ("Win32Protection", ULONG_PTR, 11),
            ("Shared", ULONG_PTR, 1),
            ("Node", ULONG_PTR, 6),
            ("Locked", ULONG_PTR, 1),
            ("LargePage", ULONG_PTR, 1),
            ("Reserved", ULONG_PTR, 7),
            ("Bad", ULONG_PTR, 1),
        ]

    _anonymous_ = ("bits",)
    _fields_ = [("Flags", ULONG_PTR), ("bits", _Bits)]


class PSAPI_WORKING_SET_EX_INFORMATION(ctypes.Structure):  # psapi.h; 16 bytes on x64
    _fields_ = [("VirtualAddress", ctypes.c_void_p), ("VirtualAttributes", PSAPI_WORKING_SET_EX_BLOCK)]


class PROCESS_MEMORY_COUNTERS(ctypes.Structure):  # psapi.h; 72 bytes on x64
    _fields_ = [
        ("cb", DWORD),
        ("PageFaultCount", DWORD),
        ("PeakWorkingSetSize", SIZE_T),
        ("WorkingSetSize", SIZE_T),
        ("QuotaPeakPagedPoolUsage", SIZE_T),
        ("QuotaPagedPoolUsage", SIZE_T),
        ("QuotaPeakNonPagedPoolUsage", SIZE_T),
        ("QuotaNonPagedPoolUsage", SIZE_T),
        ("PagefileUsage", SIZE_T),
        ("PeakPagefileUsage", SIZE_T),
    ]


class GROUP_AFFINITY(ctypes.Structure):  # winnt.h; 16 bytes on x64
    _fields_ = [("Mask", ULONG_PTR), ("Group", ctypes.c_uint16), ("Reserved", ctypes.c_uint16 * 3)]


class MEMORYSTATUSEX(ctypes.Structure):  # sysinfoapi.h; 64 bytes
    _fields_ = [("dwLength", DWORD), ("dwMemoryLoad", DWORD)] + [
        (name, ctypes.c_uint64)
        for name in (
            "ullTotalPhys",
            "ullAvailPhys",
            "ullTotalPageFile",
            "ullAvailPageFile",
            "ullTotalVirtual",
            "ullAvailVirtual",
            "ullAvailExtendedVirtual",
        )
    ]


_K32 = (("kernel32", None),)  # (dll, symbol) candidates, tried in order; None: the same name
# name: (candidates, restype, argtypes)
_PROTOTYPES = {
    "CreateFileW": (_K32, HANDLE, (LPCWSTR, DWORD, DWORD, ctypes.c_void_p, DWORD, DWORD, HANDLE)),
    "GetFileSizeEx": (_K32, BOOL, (HANDLE, ctypes.POINTER(ctypes.c_int64))),
    "CreateFileMappingW": (_K32, HANDLE, (HANDLE, ctypes.c_void_p, DWORD, DWORD, DWORD, LPCWSTR)),
    "MapViewOfFile": (_K32, ctypes.c_void_p, (HANDLE, DWORD, DWORD, DWORD, SIZE_T)),
    "UnmapViewOfFile": (_K32, BOOL, (ctypes.c_void_p,)),
    "CloseHandle": (_K32, BOOL, (HANDLE,)),
    "VirtualAlloc": (_K32, ctypes.c_void_p, (ctypes.c_void_p, SIZE_T, DWORD, DWORD)),
    "VirtualFree": (_K32, BOOL, (ctypes.c_void_p, SIZE_T, DWORD)),
    "VirtualLock": (_K32, BOOL, (ctypes.c_void_p, SIZE_T)),
    "VirtualUnlock": (_K32, BOOL, (ctypes.c_void_p, SIZE_T)),
    "GetCurrentProcess": (_K32, HANDLE, ()),
    "ReadProcessMemory": (_K32, BOOL, (HANDLE, ctypes.c_void_p, ctypes.c_void_p, SIZE_T, ctypes.POINTER(SIZE_T))),
    "GetProcessWorkingSetSize": (_K32, BOOL, (HANDLE, ctypes.POINTER(SIZE_T), ctypes.POINTER(SIZE_T))),
    "SetProcessWorkingSetSize": (_K32, BOOL, (HANDLE, SIZE_T, SIZE_T)),
    # Windows 8+; missing on Windows 7, where prefetch reads one byte per page instead.
    "PrefetchVirtualMemory": (_K32, BOOL, (HANDLE, ULONG_PTR, ctypes.POINTER(WIN32_MEMORY_RANGE_ENTRY), ULONG)),
    # In kernel32 with a K32 prefix since Windows 7; in psapi.dll before.
    "QueryWorkingSetEx": (
        (("kernel32", "K32QueryWorkingSetEx"), ("psapi", None)),
        BOOL,
        (HANDLE, ctypes.c_void_p, DWORD),
    ),
    "GetProcessMemoryInfo": (
        (("kernel32", "K32GetProcessMemoryInfo"), ("psapi", None)),
        BOOL,
        (HANDLE, ctypes.POINTER(PROCESS_MEMORY_COUNTERS), DWORD),
    ),
    # the job this process is in (hJob NULL), JOBOBJECT_EXTENDED_LIMIT_INFORMATION: its memory limits
    "QueryInformationJobObject": (_K32, BOOL, (HANDLE, ctypes.c_int, ctypes.c_void_p, DWORD, ctypes.POINTER(DWORD))),
    "GlobalMemoryStatusEx": (_K32, BOOL, (ctypes.POINTER(MEMORYSTATUSEX),)),
    # Windows 7 SP1+: the XSAVE components the system enables (optional ones included)
    "GetEnabledXStateFeatures": (_K32, DWORD64, ()),
    # Windows 11 / Server 2022+: those enabled for the calling thread; a process's optional ones on
    "GetThreadEnabledXStateFeatures": (_K32, DWORD64, ()),
    "EnableProcessOptionalXStateFeatures": (_K32, BOOL, (DWORD64,)),
    # CPU affinity: the process's within group 0, a thread's within any processor group
    "SetProcessAffinityMask": (_K32, BOOL, (HANDLE, ULONG_PTR)),
    "GetActiveProcessorCount": (_K32, DWORD, (ctypes.c_uint16,)),
    "GetActiveProcessorGroupCount": (_K32, ctypes.c_uint16, ()),
    "GetCurrentThread": (_K32, HANDLE, ()),
    "SetThreadGroupAffinity": (
        _K32,
        BOOL,
        (HANDLE, ctypes.POINTER(GROUP_AFFINITY), ctypes.POINTER(GROUP_AFFINITY)),
    ),
}


@functools.lru_cache(maxsize=None)
def _dll(name: str):
    try:
        return ctypes.WinDLL(name, use_last_error=True)  # ctypes.WinDLL exists only on Windows
    except (AttributeError, OSError):
        return None


@functools.lru_cache(maxsize=None)
def _lookup(name: str):
    """The function `name` with its prototype declared (once), or None where the OS lacks it."""
    candidates, restype, argtypes = _PROTOTYPES[name]
    for dll, symbol in candidates:
        lib = _dll(dll)
        f = getattr(lib, symbol or name, None) if lib is not None else None
        if f is not None:
            f.restype, f.argtypes = restype, argtypes
            return f
    return None


def _fn(name: str):
    f = _lookup(name)
    if f is None:
        raise OSError(f"{name} is not available on this system (colibri._os needs Windows 7+)")
    return f


def _last_error() -> int:
    return ctypes.get_last_error()  # Windows only, like every caller of it


def _describe(code: int) -> str:
    """The system's message for a Win32 error code (FormatMessage; just the number off Windows)."""
    format_error = getattr(ctypes, "FormatError", None)
    return format_error(code).strip() if format_error is not None else f"Windows error {code}"


def _error(call: str, code: int, path: str | None = None, hint: str = "") -> OSError:
    """OSError(winerror=code): on Windows its errno (and subclass) follows from the code."""
    msg = f"{call} failed: {_describe(code)}" + (f". {hint}" if hint else "")
    return OSError(None, msg, path, code)


def page_size() -> int:
    return mmap.PAGESIZE  # GetSystemInfo().dwPageSize


def _process():
    return _fn("GetCurrentProcess")()  # a pseudo-handle: never closed


# ---- mappings and memory -------------------------------------------------------------------------


def map_file(path: str) -> tuple[int, int]:
    close = _fn("CloseHandle")
    f = _fn("CreateFileW")(
        path, GENERIC_READ, FILE_SHARE_READ | FILE_SHARE_DELETE, None, OPEN_EXISTING, FILE_ATTRIBUTE_NORMAL, None
    )
    if f in (None, INVALID_HANDLE_VALUE):
        raise _error("CreateFileW", _last_error(), path)
    try:
        size = ctypes.c_int64()
        if not _fn("GetFileSizeEx")(f, ctypes.byref(size)):
            raise _error("GetFileSizeEx", _last_error(), path)
        if size.value == 0:
            return 0, 0  # CreateFileMappingW refuses empty files
        m = _fn("CreateFileMappingW")(f, None, PAGE_READONLY, 0, 0, None)
        if not m:
            raise _error("CreateFileMappingW", _last_error(), path)
        try:
            address = _fn("MapViewOfFile")(m, FILE_MAP_READ, 0, 0, 0)
            if not address:
                raise _error(f"MapViewOfFile({size.value} bytes)", _last_error(), path)
        finally:
            close(m)  # the view keeps the mapping object alive
        return address, size.value
    finally:
        close(f)


def unmap_file(address: int, size: int) -> None:
    if not _fn("UnmapViewOfFile")(address):
        raise _error(f"UnmapViewOfFile(0x{address:x})", _last_error())


def alloc_aligned(nbytes: int) -> int:
    address = _fn("VirtualAlloc")(None, nbytes, MEM_COMMIT | MEM_RESERVE, PAGE_READWRITE)
    if not address:
        raise MemoryError(f"cannot allocate {nbytes} bytes (VirtualAlloc): {_describe(_last_error())}")
    return address


def free_aligned(address: int, nbytes: int) -> None:
    if not _fn("VirtualFree")(address, 0, MEM_RELEASE):
        raise _error(f"VirtualFree(0x{address:x})", _last_error())


# ---- advice --------------------------------------------------------------------------------------


def _each(ranges, call, name: str, ok_codes=(), hint=None) -> None:
    """`call(address, length)` on every range; raise the first failure (not in ok_codes) last."""
    first = None
    for address, length in ranges:
        if not call(address, length):
            code = _last_error()
            if code not in ok_codes and first is None:
                first = _error(f"{name}(0x{address:x}, {length})", code, hint=hint(code) if hint else "")
    if first is not None:
        raise first


def _touch(address: int, length: int) -> bool:
    """Read one byte per page, through ReadProcessMemory so an unmapped page fails cleanly."""
    read, byte, proc, page = _fn("ReadProcessMemory"), ctypes.c_char(), _process(), page_size()
    return all(read(proc, a, ctypes.byref(byte), 1, None) for a in range(address, address + length, page))


def prefetch(ranges) -> None:
    fn = _lookup("PrefetchVirtualMemory")
    if fn is None:  # Windows 7: fault the pages in ourselves
        _each(ranges, _touch, "ReadProcessMemory")
        return
    if ranges:
        entries = (WIN32_MEMORY_RANGE_ENTRY * len(ranges))(*ranges)
        if not fn(_process(), len(ranges), entries, 0):
            raise _error(f"PrefetchVirtualMemory({len(ranges)} ranges)", _last_error())


def release(ranges) -> None:
    # On pages that are not locked, VirtualUnlock "fails" with ERROR_NOT_LOCKED after removing
    # them from the working set: that is the release we asked for.
    _each(ranges, _fn("VirtualUnlock"), "VirtualUnlock", ok_codes=(ERROR_NOT_LOCKED,))


def _grow_working_set(extra: int) -> bool:
    lo, hi = SIZE_T(), SIZE_T()
    proc = _process()
    if not _fn("GetProcessWorkingSetSize")(proc, ctypes.byref(lo), ctypes.byref(hi)):
        return False
    return bool(_fn("SetProcessWorkingSetSize")(proc, lo.value + extra, hi.value + extra))


def _lock_one(address: int, length: int) -> bool:
    virtual_lock = _fn("VirtualLock")
    if virtual_lock(address, length):
        return True
    if _last_error() != ERROR_WORKING_SET_QUOTA or not _grow_working_set(length):
        return False
    return bool(virtual_lock(address, length))


def lock(ranges) -> None:
    _each(
        ranges,
        _lock_one,
        "VirtualLock",
        hint=lambda code: (
            "the working-set quota is too small; SetProcessWorkingSetSize could not raise it enough"
            if code == ERROR_WORKING_SET_QUOTA
            else ""
        ),
    )


def unlock(ranges) -> None:
    _each(ranges, _fn("VirtualUnlock"), "VirtualUnlock")


def small_pages(ranges) -> None:
    """Windows backs memory with large pages only when asked (MEM_LARGE_PAGES): nothing to do."""


def resident_bytes(address: int, length: int) -> int:
    query, proc, page = _fn("QueryWorkingSetEx"), _process(), page_size()
    chunk = 1 << 16  # entries per call: 1 MiB of PSAPI_WORKING_SET_EX_INFORMATION
    total = 0
    for start in range(address, address + length, chunk * page):
        n = min(chunk, (address + length - start) // page)
        info = np.zeros((n, 2), np.uintp)  # [n, (VirtualAddress, VirtualAttributes)]
        info[:, 0] = start + np.arange(n, dtype=np.uintp) * page
        if not query(proc, info.ctypes.data, info.nbytes):
            raise _error(f"QueryWorkingSetEx(0x{start:x}, {n} pages)", _last_error())
        total += int(np.count_nonzero(info[:, 1] & 1))  # the Valid bit
    return total * page


# ---- statistics ----------------------------------------------------------------------------------


def _memory_counters() -> PROCESS_MEMORY_COUNTERS:
    pmc = PROCESS_MEMORY_COUNTERS()
    pmc.cb = ctypes.sizeof(pmc)
    if not _fn("GetProcessMemoryInfo")(_process(), ctypes.byref(pmc), pmc.cb):
        raise _error("GetProcessMemoryInfo", _last_error())
    return pmc


def page_faults() -> tuple[int, int]:
    return _memory_counters().PageFaultCount, 0  # soft and hard faults together


def rss_bytes() -> tuple[int, int]:
    pmc = _memory_counters()
    return pmc.WorkingSetSize, max(pmc.PeakWorkingSetSize, pmc.WorkingSetSize)


def engine_advice() -> tuple:
    """(kind, will_need, release, will_need_arg, release_arg) for the compiled layer loop:
    PrefetchVirtualMemory (0 where the OS lacks it: no prefetch) and VirtualUnlock."""
    prefetch = _lookup("PrefetchVirtualMemory")
    unlock = _lookup("VirtualUnlock")
    address = lambda f: ctypes.cast(f, ctypes.c_void_p).value if f is not None else 0  # noqa: E731
    return "win32", address(prefetch), address(unlock), 0, 0


def cache_advice() -> tuple:
    """No page-cache drop (a trimmed page goes to the standby list, which a job limit does not
    count); reads are PrefetchVirtualMemory, which takes no code."""
    return 0, 0, 0


JobObjectExtendedLimitInformation = 9
JOB_OBJECT_LIMIT_PROCESS_MEMORY = 0x100
JOB_OBJECT_LIMIT_JOB_MEMORY = 0x200


class IO_COUNTERS(ctypes.Structure):  # winnt.h
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "ReadOperationCount",
            "WriteOperationCount",
            "OtherOperationCount",
            "ReadTransferCount",
            "WriteTransferCount",
            "OtherTransferCount",
        )
    ]


class JOBOBJECT_BASIC_LIMIT_INFORMATION(ctypes.Structure):  # winnt.h; 64 bytes on x64
    _fields_ = [
        ("PerProcessUserTimeLimit", ctypes.c_int64),
        ("PerJobUserTimeLimit", ctypes.c_int64),
        ("LimitFlags", DWORD),
        ("MinimumWorkingSetSize", SIZE_T),
        ("MaximumWorkingSetSize", SIZE_T),
        ("ActiveProcessLimit", DWORD),
        ("Affinity", ULONG_PTR),
        ("PriorityClass", DWORD),
        ("SchedulingClass", DWORD),
    ]


class JOBOBJECT_EXTENDED_LIMIT_INFORMATION(ctypes.Structure):  # winnt.h; 144 bytes on x64
    _fields_ = [
        ("BasicLimitInformation", JOBOBJECT_BASIC_LIMIT_INFORMATION),
        ("IoInfo", IO_COUNTERS),
        ("ProcessMemoryLimit", SIZE_T),
        ("JobMemoryLimit", SIZE_T),
        ("PeakProcessMemoryUsed", SIZE_T),
        ("PeakJobMemoryUsed", SIZE_T),
    ]


def _job_limits():
    info = JOBOBJECT_EXTENDED_LIMIT_INFORMATION()
    query = _lookup("QueryInformationJobObject")
    if query is None or not query(
        None, JobObjectExtendedLimitInformation, ctypes.addressof(info), ctypes.sizeof(info), None
    ):
        return None  # not in a job (or an old system)
    return info


def memory_limit() -> tuple:
    """(bytes, what set it) of the job object's memory limit on this process, or (None, "")."""
    info = _job_limits()
    if info is None:
        return None, ""
    flags = info.BasicLimitInformation.LimitFlags
    limits = []
    if flags & JOB_OBJECT_LIMIT_PROCESS_MEMORY:
        limits.append((info.ProcessMemoryLimit, "job object ProcessMemoryLimit"))
    if flags & JOB_OBJECT_LIMIT_JOB_MEMORY:
        limits.append((info.JobMemoryLimit, "job object JobMemoryLimit"))
    return min(limits) if limits else (None, "")


def memory_usage() -> tuple:
    """(current, peak): the working set, and the job's peak of committed memory where known."""
    info = _job_limits()
    current = _memory_counters().WorkingSetSize
    return current, (info.PeakJobMemoryUsed or info.PeakProcessMemoryUsed) if info is not None else None


def available_memory() -> int | None:
    status = MEMORYSTATUSEX()
    status.dwLength = ctypes.sizeof(status)
    f = _lookup("GlobalMemoryStatusEx")
    if f is None or not f(ctypes.byref(status)):
        return None
    return status.ullAvailPhys


def prefetch_chunk(path: str) -> int:
    return 0  # PrefetchVirtualMemory takes whole ranges


def address_space_room() -> tuple:
    """Windows has no address-space rlimit (a job limits committed memory, and a thread's stack
    commits little of what it reserves): unknown."""
    return None, None


def evict_file_cache(fd: int) -> bool:
    return False  # no per-file page-cache eviction on Windows


def _thread_has_tile_data() -> bool:
    f = _lookup("GetThreadEnabledXStateFeatures")
    return f is not None and bool(f() >> XSTATE_AMX_TILE_DATA & 1)


def request_tile_data() -> None:
    """Windows 11 and Windows Server 2022 offer AMX's tile state as an optional XSAVE feature: the
    system enables it (GetEnabledXStateFeatures lists XSTATE_AMX_TILE_DATA), yet every thread has
    it off until its process turns it on (EnableProcessOptionalXStateFeatures with the tile config
    and data, for all its threads); then GetThreadEnabledXStateFeatures lists it. A no-op where it
    is on already; OSError naming the cause where the system lacks it or refuses."""
    if not _fn("GetEnabledXStateFeatures")() >> XSTATE_AMX_TILE_DATA & 1:
        raise OSError(
            "this Windows does not offer AMX's tile state (XSTATE_AMX_TILE_DATA); Windows 11 or "
            "Windows Server 2022 or later does"
        )
    if _thread_has_tile_data():
        return
    enable = _lookup("EnableProcessOptionalXStateFeatures")
    if enable is None:
        raise OSError(
            "EnableProcessOptionalXStateFeatures is missing: Windows 11 or Windows Server 2022 or later "
            "lends AMX's tile state"
        )
    if not enable((1 << XSTATE_AMX_TILE_CONFIG) | (1 << XSTATE_AMX_TILE_DATA)):
        raise _error("EnableProcessOptionalXStateFeatures", _last_error())
    if not _thread_has_tile_data():
        raise OSError(
            "EnableProcessOptionalXStateFeatures returned success, yet this thread's XSAVE features "
            "lack XSTATE_AMX_TILE_DATA"
        )


def read_io_bytes() -> int | None:
    return None  # GetProcessIoCounters counts page-cache hits as reads


# ---- where the threads run and the memory lives -------------------------------------------------


def set_cpus(cpus) -> None:
    """Run on `cpus`, numbered across the processor groups in order (group 0's first, as Linux
    and Task Manager count them), all in one group. Group 0: the process's mask
    (SetProcessAffinityMask: every thread, those started later included). Another group: this
    thread's group affinity (SetThreadGroupAffinity), and Windows starts every thread in its
    creator's group, so the engine's threads run there. A set spanning groups is refused: one
    process per group or NUMA node (`start /NODE N`)."""
    cpus = sorted(cpus)
    first, groups = 0, []
    for group in range(_fn("GetActiveProcessorGroupCount")()):
        count = _fn("GetActiveProcessorCount")(group)
        groups.append((group, first, count))
        first += count
    held = {g: [c - start for c in cpus if start <= c < start + count] for g, start, count in groups}
    used = [g for g, members in held.items() if members]
    outside = [c for c in cpus if c >= first]
    if outside or len(used) != 1:
        raise OSError(
            f"CPUs {outside or cpus} are not within one of this machine's {len(groups)} processor group(s) "
            f"({first} CPUs); on Windows run one process per group or NUMA node (start /NODE N)"
        )
    group, mask = used[0], sum(1 << c for c in held[used[0]])
    if group == 0:
        if not _fn("SetProcessAffinityMask")(_process(), mask):
            raise _error("SetProcessAffinityMask", _last_error())
        return
    affinity = GROUP_AFFINITY(mask, group)
    if not _fn("SetThreadGroupAffinity")(_fn("GetCurrentThread")(), ctypes.byref(affinity), None):
        raise _error("SetThreadGroupAffinity", _last_error())


def numa_nodes() -> dict:
    """{} : the NUMA nodes are not read on Windows (start /NODE N places a whole process)."""
    return {}


def set_memory_policy(policy: str, nodes) -> None:
    raise OSError(
        "a NUMA memory policy is not set on Windows: start one process per node with start /NODE N "
        "(its threads and memory then prefer that node)"
    )


def memory_policy() -> tuple:
    raise OSError("the NUMA memory policy is not read on Windows")
