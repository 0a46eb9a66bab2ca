"""colibri._os's Windows backend (ctypes over kernel32/psapi), tested on any OS.

Two things are checked here, neither needing Windows:

1. Every prototype `_windows._PROTOTYPES` declares against GOLDEN, a table written from
   Microsoft's documentation (the C signature of each function, the DLL and export name it lives
   under), through one mapping of Win32 C types to ctypes types with their Win64 sizes. A
   mutation test changes one prototype at a time (a return type, an argument type, an argument
   dropped) and shows the comparison catches it.
2. The backend's behaviour against FakeWindows, a recording fake of kernel32 and psapi whose
   functions are real C function pointers (ctypes callbacks built from GOLDEN's signatures), so
   every call crosses libffi with the backend's own argtypes and arrives with the values a DLL
   would see. The fake keeps the state the calls act on (handles, views, allocations, a working
   set, locks, a working-set quota, the thread's last error) and the tests assert the arguments
   passed: access and share flags, page protection, page-aligned ranges, the
   WIN32_MEMORY_RANGE_ENTRY contents, MEM_RELEASE with size 0, handles closed, and the fallbacks
   when a function is missing (PrefetchVirtualMemory before Windows 8, K32QueryWorkingSetEx
   before Windows 7). The interface (`colibri._os`) runs on top, its backend swapped for this one.

Memory behind the fake's views and allocations is the Linux backend's (mmap): the backend reads
and writes real memory at the addresses the fake hands it.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys

import numpy as np
import pytest

from colibri import _os

w = importlib.import_module("colibri._os._windows")

pytestmark = pytest.mark.skipif(ctypes.sizeof(ctypes.c_void_p) != 8, reason="the golden sizes are 64-bit Windows's")

PAGE = w.page_size()

# ---- the golden table: Microsoft's documentation ---------------------------------------------------

# Win32 C type -> (its ctypes type in the backend, its size on Win64). Pointers to structures
# the backend passes by reference are typed; opaque or untyped ones are c_void_p.
C_TYPES = {
    "BOOL": (ctypes.c_int, 4),
    "DWORD": (ctypes.c_uint32, 4),
    "DWORD64": (ctypes.c_uint64, 8),
    "WORD": (ctypes.c_uint16, 2),
    "DWORD_PTR": (ctypes.c_size_t, 8),
    "ULONG": (ctypes.c_uint32, 4),
    "JOBOBJECTINFOCLASS": (ctypes.c_int, 4),  # an enum
    "SIZE_T": (ctypes.c_size_t, 8),
    "ULONG_PTR": (ctypes.c_size_t, 8),
    "HANDLE": (ctypes.c_void_p, 8),
    "LPVOID": (ctypes.c_void_p, 8),
    "LPCVOID": (ctypes.c_void_p, 8),
    "PVOID": (ctypes.c_void_p, 8),
    "LPSECURITY_ATTRIBUTES": (ctypes.c_void_p, 8),  # always NULL here
    "LPCWSTR": (ctypes.c_wchar_p, 8),
    "PLARGE_INTEGER": (ctypes.POINTER(ctypes.c_int64), 8),
    "PSIZE_T": (ctypes.POINTER(ctypes.c_size_t), 8),
    "SIZE_T *": (ctypes.POINTER(ctypes.c_size_t), 8),
    "LPDWORD": (ctypes.POINTER(ctypes.c_uint32), 8),
    "PWIN32_MEMORY_RANGE_ENTRY": (ctypes.POINTER(w.WIN32_MEMORY_RANGE_ENTRY), 8),
    "PPROCESS_MEMORY_COUNTERS": (ctypes.POINTER(w.PROCESS_MEMORY_COUNTERS), 8),
    "LPMEMORYSTATUSEX": (ctypes.POINTER(w.MEMORYSTATUSEX), 8),
    "const GROUP_AFFINITY *": (ctypes.POINTER(w.GROUP_AFFINITY), 8),
    "PGROUP_AFFINITY": (ctypes.POINTER(w.GROUP_AFFINITY), 8),
}

K32 = (("kernel32", "{name}"),)
# name: (where it is exported, in the order to try; "C return type", ("C argument types", ...))
GOLDEN = {
    # fileapi.h: HANDLE CreateFileW(LPCWSTR lpFileName, DWORD dwDesiredAccess, DWORD dwShareMode,
    #   LPSECURITY_ATTRIBUTES lpSecurityAttributes, DWORD dwCreationDisposition,
    #   DWORD dwFlagsAndAttributes, HANDLE hTemplateFile)
    "CreateFileW": (K32, "HANDLE", ("LPCWSTR", "DWORD", "DWORD", "LPSECURITY_ATTRIBUTES", "DWORD", "DWORD", "HANDLE")),
    # fileapi.h: BOOL GetFileSizeEx(HANDLE hFile, PLARGE_INTEGER lpFileSize)
    "GetFileSizeEx": (K32, "BOOL", ("HANDLE", "PLARGE_INTEGER")),
    # memoryapi.h: HANDLE CreateFileMappingW(HANDLE hFile, LPSECURITY_ATTRIBUTES lpFileMappingAttributes,
    #   DWORD flProtect, DWORD dwMaximumSizeHigh, DWORD dwMaximumSizeLow, LPCWSTR lpName)
    "CreateFileMappingW": (K32, "HANDLE", ("HANDLE", "LPSECURITY_ATTRIBUTES", "DWORD", "DWORD", "DWORD", "LPCWSTR")),
    # memoryapi.h: LPVOID MapViewOfFile(HANDLE hFileMappingObject, DWORD dwDesiredAccess,
    #   DWORD dwFileOffsetHigh, DWORD dwFileOffsetLow, SIZE_T dwNumberOfBytesToMap)
    "MapViewOfFile": (K32, "LPVOID", ("HANDLE", "DWORD", "DWORD", "DWORD", "SIZE_T")),
    # memoryapi.h: BOOL UnmapViewOfFile(LPCVOID lpBaseAddress)
    "UnmapViewOfFile": (K32, "BOOL", ("LPCVOID",)),
    # handleapi.h: BOOL CloseHandle(HANDLE hObject)
    "CloseHandle": (K32, "BOOL", ("HANDLE",)),
    # memoryapi.h: LPVOID VirtualAlloc(LPVOID lpAddress, SIZE_T dwSize, DWORD flAllocationType, DWORD flProtect)
    "VirtualAlloc": (K32, "LPVOID", ("LPVOID", "SIZE_T", "DWORD", "DWORD")),
    # memoryapi.h: BOOL VirtualFree(LPVOID lpAddress, SIZE_T dwSize, DWORD dwFreeType)
    "VirtualFree": (K32, "BOOL", ("LPVOID", "SIZE_T", "DWORD")),
    # memoryapi.h: BOOL VirtualLock(LPVOID lpAddress, SIZE_T dwSize); VirtualUnlock alike
    "VirtualLock": (K32, "BOOL", ("LPVOID", "SIZE_T")),
    "VirtualUnlock": (K32, "BOOL", ("LPVOID", "SIZE_T")),
    # processthreadsapi.h: HANDLE GetCurrentProcess(void)
    "GetCurrentProcess": (K32, "HANDLE", ()),
    # memoryapi.h: BOOL ReadProcessMemory(HANDLE hProcess, LPCVOID lpBaseAddress, LPVOID lpBuffer,
    #   SIZE_T nSize, SIZE_T *lpNumberOfBytesRead)
    "ReadProcessMemory": (K32, "BOOL", ("HANDLE", "LPCVOID", "LPVOID", "SIZE_T", "SIZE_T *")),
    # memoryapi.h: BOOL GetProcessWorkingSetSize(HANDLE hProcess, PSIZE_T lpMinimumWorkingSetSize,
    #   PSIZE_T lpMaximumWorkingSetSize)
    "GetProcessWorkingSetSize": (K32, "BOOL", ("HANDLE", "PSIZE_T", "PSIZE_T")),
    # memoryapi.h: BOOL SetProcessWorkingSetSize(HANDLE hProcess, SIZE_T dwMinimumWorkingSetSize,
    #   SIZE_T dwMaximumWorkingSetSize)
    "SetProcessWorkingSetSize": (K32, "BOOL", ("HANDLE", "SIZE_T", "SIZE_T")),
    # memoryapi.h (Windows 8+): BOOL PrefetchVirtualMemory(HANDLE hProcess, ULONG_PTR NumberOfEntries,
    #   PWIN32_MEMORY_RANGE_ENTRY VirtualAddresses, ULONG Flags)
    "PrefetchVirtualMemory": (K32, "BOOL", ("HANDLE", "ULONG_PTR", "PWIN32_MEMORY_RANGE_ENTRY", "ULONG")),
    # psapi.h: BOOL QueryWorkingSetEx(HANDLE hProcess, PVOID pv, DWORD cb): kernel32's
    #   K32QueryWorkingSetEx since Windows 7 (PSAPI_VERSION 2), psapi.dll's QueryWorkingSetEx before
    "QueryWorkingSetEx": (
        (("kernel32", "K32QueryWorkingSetEx"), ("psapi", "QueryWorkingSetEx")),
        "BOOL",
        ("HANDLE", "PVOID", "DWORD"),
    ),
    # psapi.h: BOOL GetProcessMemoryInfo(HANDLE Process, PPROCESS_MEMORY_COUNTERS ppsmemCounters, DWORD cb)
    "GetProcessMemoryInfo": (
        (("kernel32", "K32GetProcessMemoryInfo"), ("psapi", "GetProcessMemoryInfo")),
        "BOOL",
        ("HANDLE", "PPROCESS_MEMORY_COUNTERS", "DWORD"),
    ),
    # jobapi2.h: BOOL QueryInformationJobObject(HANDLE hJob, JOBOBJECTINFOCLASS JobObjectInformationClass,
    #   LPVOID lpJobObjectInformation, DWORD cbJobObjectInformationLength, LPDWORD lpReturnLength)
    "QueryInformationJobObject": (K32, "BOOL", ("HANDLE", "JOBOBJECTINFOCLASS", "LPVOID", "DWORD", "LPDWORD")),
    # sysinfoapi.h: BOOL GlobalMemoryStatusEx(LPMEMORYSTATUSEX lpBuffer)
    "GlobalMemoryStatusEx": (K32, "BOOL", ("LPMEMORYSTATUSEX",)),
    # winbase.h: DWORD64 GetEnabledXStateFeatures(void)
    "GetEnabledXStateFeatures": (K32, "DWORD64", ()),
    # processthreadsapi.h: DWORD64 GetThreadEnabledXStateFeatures(void)
    "GetThreadEnabledXStateFeatures": (K32, "DWORD64", ()),
    # processthreadsapi.h: BOOL EnableProcessOptionalXStateFeatures(DWORD64 Features)
    "EnableProcessOptionalXStateFeatures": (K32, "BOOL", ("DWORD64",)),
    # winbase.h: BOOL SetProcessAffinityMask(HANDLE hProcess, DWORD_PTR dwProcessAffinityMask)
    "SetProcessAffinityMask": (K32, "BOOL", ("HANDLE", "DWORD_PTR")),
    # winbase.h: DWORD GetActiveProcessorCount(WORD GroupNumber)
    "GetActiveProcessorCount": (K32, "DWORD", ("WORD",)),
    # winbase.h: WORD GetActiveProcessorGroupCount(void)
    "GetActiveProcessorGroupCount": (K32, "WORD", ()),
    # processthreadsapi.h: HANDLE GetCurrentThread(void)
    "GetCurrentThread": (K32, "HANDLE", ()),
    # processtopologyapi.h: BOOL SetThreadGroupAffinity(HANDLE hThread, const GROUP_AFFINITY *GroupAffinity,
    #   PGROUP_AFFINITY PreviousGroupAffinity)
    "SetThreadGroupAffinity": (K32, "BOOL", ("HANDLE", "const GROUP_AFFINITY *", "PGROUP_AFFINITY")),
}


def golden_prototype(name: str):
    """(candidates as the backend spells them, restype, argtypes) of GOLDEN's entry `name`."""
    where, restype, argtypes = GOLDEN[name]
    candidates = tuple((dll, None if symbol in ("{name}", name) else symbol) for dll, symbol in where)
    return candidates, C_TYPES[restype][0], tuple(C_TYPES[t][0] for t in argtypes)


def same_type(a, b) -> bool:
    """ctypes makes POINTER(T) once per T, but compare by what they are, not identity."""
    if a is b:
        return True
    if issubclass(a, ctypes._Pointer) and issubclass(b, ctypes._Pointer):
        return a._type_ is b._type_
    return False


def prototype_differences(prototypes: dict) -> list:
    """Every way `prototypes` (the backend's table) differs from GOLDEN; [] when they agree."""
    problems = [f"{name}: not in the golden table" for name in prototypes if name not in GOLDEN]
    problems += [f"{name}: missing from the backend" for name in GOLDEN if name not in prototypes]
    for name in sorted(set(prototypes) & set(GOLDEN)):
        candidates, restype, argtypes = prototypes[name]
        want_candidates, want_restype, want_argtypes = golden_prototype(name)
        if tuple(candidates) != want_candidates:
            problems.append(f"{name}: looked up in {candidates}, documented in {want_candidates}")
        if not same_type(restype, want_restype):
            problems.append(f"{name}: returns {restype.__name__}, documented {GOLDEN[name][1]}")
        if len(argtypes) != len(want_argtypes):
            problems.append(f"{name}: {len(argtypes)} arguments, documented {len(want_argtypes)}")
        for i, (got, want) in enumerate(zip(argtypes, want_argtypes)):
            if not same_type(got, want):
                problems.append(f"{name}: argument {i} is {got.__name__}, documented {GOLDEN[name][2][i]}")
    return problems


def test_the_c_types_have_their_win64_sizes():
    for c_name, (ctype, win64_bytes) in C_TYPES.items():
        assert ctypes.sizeof(ctype) == win64_bytes, c_name


def test_every_prototype_is_the_documented_one():
    assert prototype_differences(w._PROTOTYPES) == []


def _mutations():
    """(label, a copy of the backend's table with one prototype changed)."""
    for name, (candidates, restype, argtypes) in w._PROTOTYPES.items():
        table = dict(w._PROTOTYPES)
        wrong = ctypes.c_uint64 if restype is not ctypes.c_uint64 else ctypes.c_int
        yield f"{name}-restype", {**table, name: (candidates, wrong, argtypes)}
        if argtypes:
            last = argtypes[-1]
            swapped = ctypes.c_uint32 if last is not ctypes.c_uint32 else ctypes.c_size_t
            yield f"{name}-argtype", {**table, name: (candidates, restype, argtypes[:-1] + (swapped,))}
            yield f"{name}-dropped", {**table, name: (candidates, restype, argtypes[:-1])}
        yield f"{name}-extra", {**table, name: (candidates, restype, argtypes + (ctypes.c_void_p,))}


@pytest.mark.parametrize("label, table", list(_mutations()), ids=lambda v: v if isinstance(v, str) else "")
def test_a_changed_prototype_is_caught(label, table):
    assert prototype_differences(table), label


def test_no_prototype_sets_an_errcheck():
    """The backend checks every return value itself (`if not f(...)`, then GetLastError): an
    errcheck would run before that and change what the callers see. The fake's functions record
    whether one was set."""
    with FakeWindows() as fake:
        fake.install()
        for name in GOLDEN:
            f = w._lookup(name)
            assert f is not None and f.errcheck is None, name


# ---- the fake -------------------------------------------------------------------------------------

PSEUDO_PROCESS = ctypes.c_void_p(-1).value  # GetCurrentProcess()'s pseudo-handle
PSEUDO_THREAD = ctypes.c_void_p(-2).value  # GetCurrentThread()'s
ERROR_FILE_NOT_FOUND = 2
ERROR_INVALID_HANDLE = 6
ERROR_NOT_ENOUGH_MEMORY = 8
ERROR_INVALID_PARAMETER = 87
ERROR_PARTIAL_COPY = 299
ERROR_FILE_INVALID = 1006


class FakeDLL:
    """A DLL of C function pointers; a name it lacks is an AttributeError, as with ctypes.WinDLL."""

    def __init__(self, functions: dict):
        self._functions = functions
        self.looked_up: set = set()

    def __getattr__(self, name):
        try:
            f = self._functions[name]
        except KeyError:
            raise AttributeError(name) from None
        self.looked_up.add(name)
        return f


class FakeWindows:
    """kernel32 and psapi as the backend sees them, with the state their calls act on.

    `missing` names exports to leave out (as on an older Windows); `calls` records
    (function, arguments) in order; `errors` collects exceptions raised inside a callback (ctypes
    would otherwise print them and return 0)."""

    def __init__(self, missing=(), quota=(200 * PAGE, 400 * PAGE)):
        if sys.platform == "win32":
            pytest.skip("the fake's memory is the Linux backend's; on Windows test_os.py runs the real one")
        self.missing = set(missing)
        self.calls: list = []
        self.errors: list = []
        self.last_error = 0
        self.handles: dict = {}  # handle -> ("file", fd, path) | ("mapping", fd, path, protect)
        self.views: dict = {}  # base address -> size (Linux mappings)
        self.allocations: dict = {}  # base address -> size (Linux anonymous memory)
        self.working_set: set = set()  # page addresses in this process's working set
        self.locked: set = set()
        self.range_entries: list = []  # the WIN32_MEMORY_RANGE_ENTRY arrays PrefetchVirtualMemory got
        self.quota = list(quota)  # the working-set (minimum, maximum)
        self.xstate = 0x2E7  # GetEnabledXStateFeatures: x87 .. AVX-512, PKRU; no AMX
        self.optional = 0  # of those, the ones a thread has off until its process turns them on
        self.turned_on = 0  # what EnableProcessOptionalXStateFeatures turned on
        self._next_handle = 0x100
        self._keep = []  # the callbacks, alive while their pointers are
        self.dlls = {"kernel32": FakeDLL({}), "psapi": FakeDLL({})}
        for name, (where, restype, argtypes) in GOLDEN.items():
            impl = getattr(self, name)
            prototype = ctypes.CFUNCTYPE(C_TYPES[restype][0], *(C_TYPES[t][0] for t in argtypes))
            for dll, symbol in where:
                symbol = symbol.format(name=name)
                if symbol in self.missing:
                    continue
                callback = prototype(self._recorded(name, impl))
                address = ctypes.cast(callback, ctypes.c_void_p).value
                self._keep.append(callback)
                # a fresh function pointer at the callback: the backend sets its prototype
                self.dlls[dll]._functions[symbol] = ctypes.CFUNCTYPE(None)(address)

    # -- plumbing --
    def _recorded(self, name, impl):
        def call(*args):
            self.calls.append((name, args))
            try:
                return impl(*args)
            except Exception as e:  # noqa: BLE001 - reported by the test, not lost in ctypes
                self.errors.append((name, repr(e)))
                return 0

        return call

    def install(self, monkeypatch=None):
        """Point the backend's DLL lookup and GetLastError at this fake."""
        self._saved = (w._dll, w._last_error)
        w._dll = lambda name: self.dlls.get(name)
        w._last_error = lambda: self.last_error
        w._lookup.cache_clear()
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if hasattr(self, "_saved"):
            w._dll, w._last_error = self._saved
            w._lookup.cache_clear()
        from colibri._os import _linux

        for address, size in self.views.items():
            _linux.unmap_file(address, size)
        for address, size in self.allocations.items():
            _linux.free_aligned(address, size)
        self.views.clear()
        self.allocations.clear()

    def prototype_errors(self) -> list:
        """Every function the backend looked up whose prototype (as set on the fake's pointer)
        is not GOLDEN's."""
        problems = []
        for name, (where, restype, argtypes) in GOLDEN.items():
            for dll, symbol in where:
                symbol = symbol.format(name=name)
                if symbol not in self.dlls[dll].looked_up:
                    continue
                f = self.dlls[dll]._functions[symbol]
                _, want_restype, want_argtypes = golden_prototype(name)
                if not (
                    same_type(f.restype, want_restype)
                    and len(f.argtypes) == len(want_argtypes)
                    and all(same_type(a, b) for a, b in zip(f.argtypes, want_argtypes))
                ):
                    declared = ", ".join(t.__name__ for t in f.argtypes)
                    problems.append(
                        f"{name}: declared ({declared}) -> {getattr(f.restype, '__name__', None)}, "
                        f"documented ({', '.join(argtypes)}) -> {restype}"
                    )
        return problems

    def fail(self, code: int, result=0):
        self.last_error = code
        return result

    def named(self, name: str) -> list:
        return [args for called, args in self.calls if called == name]

    def _new_handle(self, value) -> int:
        self._next_handle += 4
        self.handles[self._next_handle] = value
        return self._next_handle

    def _region_of(self, address: int, length: int = 1):
        for base, size in (*self.views.items(), *self.allocations.items()):
            if base <= address and address + length <= base + -(-size // PAGE) * PAGE:  # whole pages
                return base, size
        return None

    def _pages(self, address: int, length: int) -> range:
        return range(address & ~(PAGE - 1), address + length, PAGE)

    def pages_resident(self, address: int, length: int) -> int:
        return sum(p in self.working_set for p in self._pages(address, length))

    # -- kernel32 --
    def CreateFileW(self, path, access, share, security, disposition, flags, template):
        if not os.path.exists(path):
            return self.fail(ERROR_FILE_NOT_FOUND, w.INVALID_HANDLE_VALUE)
        return self._new_handle(("file", os.open(path, os.O_RDONLY), path))

    def GetFileSizeEx(self, handle, size):
        entry = self.handles.get(handle)
        if entry is None or entry[0] != "file":
            return self.fail(ERROR_INVALID_HANDLE)
        size[0] = os.fstat(entry[1]).st_size
        return 1

    def CreateFileMappingW(self, handle, security, protect, high, low, name):
        entry = self.handles.get(handle)
        if entry is None or entry[0] != "file":
            return self.fail(ERROR_INVALID_HANDLE, None)
        if os.fstat(entry[1]).st_size == 0 and high == low == 0:
            return self.fail(ERROR_FILE_INVALID, None)  # Windows refuses to map an empty file
        return self._new_handle(("mapping", os.dup(entry[1]), entry[2], protect))

    def MapViewOfFile(self, mapping, access, high, low, nbytes):
        entry = self.handles.get(mapping)
        if entry is None or entry[0] != "mapping":
            return self.fail(ERROR_INVALID_HANDLE, None)
        from colibri._os import _linux

        address, size = _linux.map_file(entry[2])
        self.views[address] = size
        return address

    def UnmapViewOfFile(self, address):
        if address not in self.views:
            return self.fail(ERROR_INVALID_PARAMETER)
        from colibri._os import _linux

        size = self.views.pop(address)
        self.working_set -= set(self._pages(address, size))
        _linux.unmap_file(address, size)
        return 1

    def CloseHandle(self, handle):
        entry = self.handles.pop(handle, None)
        if entry is None:
            return self.fail(ERROR_INVALID_HANDLE)
        os.close(entry[1])
        return 1

    def VirtualAlloc(self, address, size, allocation_type, protect):
        if size > 1 << 40:
            return self.fail(ERROR_NOT_ENOUGH_MEMORY, None)
        from colibri._os import _linux

        base = _linux.alloc_aligned(size)
        self.allocations[base] = size
        return base

    def VirtualFree(self, address, size, free_type):
        if address not in self.allocations or (free_type == w.MEM_RELEASE and size != 0):
            return self.fail(ERROR_INVALID_PARAMETER)  # MEM_RELEASE frees a whole allocation: size 0
        from colibri._os import _linux

        _linux.free_aligned(address, self.allocations.pop(address))
        return 1

    def VirtualLock(self, address, size):
        if self._region_of(address, size) is None:
            return self.fail(ERROR_INVALID_PARAMETER)
        pages = set(self._pages(address, size))
        if len(self.locked | pages) * PAGE > self.quota[0]:
            return self.fail(w.ERROR_WORKING_SET_QUOTA)
        self.locked |= pages
        self.working_set |= pages
        return 1

    def VirtualUnlock(self, address, size):
        if self._region_of(address, size) is None:
            return self.fail(ERROR_INVALID_PARAMETER)
        pages = set(self._pages(address, size))
        if not pages & self.locked:  # not locked: trimmed from the working set, and "fails"
            self.working_set -= pages
            return self.fail(w.ERROR_NOT_LOCKED)
        self.locked -= pages
        return 1

    def GetCurrentProcess(self):
        return PSEUDO_PROCESS

    def ReadProcessMemory(self, process, address, buffer, nbytes, nread):
        if process != PSEUDO_PROCESS:
            return self.fail(ERROR_INVALID_HANDLE)
        if self._region_of(address, nbytes) is None:
            return self.fail(ERROR_PARTIAL_COPY)
        ctypes.memmove(buffer, address, nbytes)
        self.working_set |= set(self._pages(address, nbytes))
        return 1

    def GetProcessWorkingSetSize(self, process, minimum, maximum):
        minimum[0], maximum[0] = self.quota
        return 1

    def SetProcessWorkingSetSize(self, process, minimum, maximum):
        if process != PSEUDO_PROCESS or minimum > maximum:
            return self.fail(ERROR_INVALID_PARAMETER)
        self.quota = [minimum, maximum]
        return 1

    def PrefetchVirtualMemory(self, process, count, entries, flags):
        if process != PSEUDO_PROCESS or flags != 0 or count == 0:
            return self.fail(ERROR_INVALID_PARAMETER)
        passed = [(entries[i].VirtualAddress, entries[i].NumberOfBytes) for i in range(count)]
        self.range_entries.append(passed)  # read now: the array is the caller's
        for address, size in passed:
            if self._region_of(address, size) is None:
                return self.fail(ERROR_INVALID_PARAMETER)
            self.working_set |= set(self._pages(address, size))
        return 1

    def QueryWorkingSetEx(self, process, info, nbytes):
        entry = ctypes.sizeof(w.PSAPI_WORKING_SET_EX_INFORMATION)
        if process != PSEUDO_PROCESS or nbytes % entry:
            return self.fail(ERROR_INVALID_PARAMETER)
        for i in range(nbytes // entry):
            item = w.PSAPI_WORKING_SET_EX_INFORMATION.from_address(info + i * entry)
            item.VirtualAttributes.Flags = int((item.VirtualAddress or 0) in self.working_set)
        return 1

    def GetProcessMemoryInfo(self, process, counters, nbytes):
        if nbytes != ctypes.sizeof(w.PROCESS_MEMORY_COUNTERS) or counters[0].cb != nbytes:
            return self.fail(ERROR_INVALID_PARAMETER)
        counters[0].WorkingSetSize = len(self.working_set) * PAGE
        counters[0].PeakWorkingSetSize = counters[0].WorkingSetSize
        counters[0].PageFaultCount = 7
        return 1

    def QueryInformationJobObject(self, job, klass, info, nbytes, returned):
        return self.fail(ERROR_INVALID_PARAMETER)  # not in a job

    def GlobalMemoryStatusEx(self, status):
        if status[0].dwLength != ctypes.sizeof(w.MEMORYSTATUSEX):
            return self.fail(ERROR_INVALID_PARAMETER)
        status[0].ullAvailPhys = 3 << 30
        return 1

    def GetEnabledXStateFeatures(self):
        return self.xstate

    def GetThreadEnabledXStateFeatures(self):
        return self.xstate & ~(self.optional & ~self.turned_on)

    def EnableProcessOptionalXStateFeatures(self, features):
        if features & ~self.optional:  # not an optional feature of this system
            return self.fail(ERROR_INVALID_PARAMETER)
        self.turned_on |= features
        return 1

    GROUPS = (8, 4)  # logical processors of the fake's processor groups

    def GetActiveProcessorGroupCount(self):
        return len(self.GROUPS)

    def GetActiveProcessorCount(self, group):
        return self.GROUPS[group] if group < len(self.GROUPS) else 0

    def SetProcessAffinityMask(self, process, mask):
        if process != PSEUDO_PROCESS or not 0 < mask < 1 << self.GROUPS[0]:
            return self.fail(ERROR_INVALID_PARAMETER)
        return 1

    def GetCurrentThread(self):
        return PSEUDO_THREAD

    def SetThreadGroupAffinity(self, thread, affinity, previous):
        a = affinity[0]
        if thread != PSEUDO_THREAD or a.Group >= len(self.GROUPS) or not 0 < a.Mask < 1 << self.GROUPS[a.Group]:
            return self.fail(ERROR_INVALID_PARAMETER)
        self.thread_group = (a.Group, a.Mask)
        return 1


@pytest.fixture
def fake(monkeypatch):
    """The fake installed under colibri._os: the interface runs on the Windows backend."""
    with FakeWindows() as f:
        f.install()
        monkeypatch.setattr(_os, "_backend", w)
        monkeypatch.setattr(_os, "BACKEND", "windows")
        monkeypatch.setattr(_os, "_WARNED", set())
        yield f
        assert f.errors == []
        assert f.prototype_errors() == []


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(7).integers(0, 256, 16 * PAGE + 100, dtype=np.uint8)
    path = tmp_path / "expert.bin"
    path.write_bytes(data.tobytes())
    return str(path), data


def test_map_file_opens_maps_and_closes_as_documented(fake, data_file):
    path, data = data_file
    with _os.map_file(path) as m:
        assert np.array_equal(m.as_numpy(np.uint8), data) and m.size == data.size
        ((name, share, security, disposition, flags, template),) = [a[1:] for a in fake.named("CreateFileW")]
        assert fake.named("CreateFileW")[0][0] == path
        assert (name, share) == (w.GENERIC_READ, w.FILE_SHARE_READ | w.FILE_SHARE_DELETE)
        assert (security, disposition, flags, template) == (None, w.OPEN_EXISTING, w.FILE_ATTRIBUTE_NORMAL, None)
        ((file_handle, sa, protect, high, low, mapping_name),) = fake.named("CreateFileMappingW")
        assert (sa, protect, high, low, mapping_name) == (None, w.PAGE_READONLY, 0, 0, None)
        ((mapping, access, off_high, off_low, nbytes),) = fake.named("MapViewOfFile")
        assert (access, off_high, off_low, nbytes) == (w.FILE_MAP_READ, 0, 0, 0)
        assert sorted(h for (h,) in fake.named("CloseHandle")) == sorted([file_handle, mapping])
        assert fake.handles == {}  # the view keeps the mapping alive by itself
        address = m.address
    assert fake.named("UnmapViewOfFile") == [(address,)] and fake.views == {}


def test_map_file_of_a_missing_or_empty_file(fake, tmp_path):
    missing = str(tmp_path / "nope.bin")
    with pytest.raises(OSError) as e:
        _os.map_file(missing)
    assert e.value.filename == missing and "CreateFileW failed: Windows error 2" in str(e.value)
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with _os.map_file(empty) as m:
        assert (m.address, m.size) == (0, 0)
    assert fake.named("CreateFileMappingW") == [] and fake.handles == {}


def test_prefetch_passes_page_aligned_range_entries(fake, data_file):
    path, _ = data_file
    with _os.map_file(path) as m:
        ranges = [(m.address + 10 * PAGE + 5, 100), (m.address + 1, 2 * PAGE), (m.address + 2 * PAGE, 10)]
        assert _os.prefetch(ranges) is True
        ((process, count, _, flags),) = fake.named("PrefetchVirtualMemory")
        assert (process, count, flags) == (PSEUDO_PROCESS, 2, 0)
        (passed,) = fake.range_entries
        assert passed == [(m.address, 3 * PAGE), (m.address + 10 * PAGE, PAGE)]  # sorted, merged, whole pages
        assert all(a % PAGE == 0 and n % PAGE == 0 for a, n in passed)
        assert _os.resident_bytes(m.address, m.size) == 4 * PAGE
        for process, info, nbytes in fake.named("QueryWorkingSetEx"):
            assert process == PSEUDO_PROCESS and nbytes % ctypes.sizeof(w.PSAPI_WORKING_SET_EX_INFORMATION) == 0


def test_release_trims_the_working_set_and_not_locked_is_success(fake, data_file):
    path, _ = data_file
    with _os.map_file(path) as m:
        _os.prefetch([(m.address, m.size)])
        assert _os.resident_bytes(m.address, m.size) == m.size
        assert _os.release([(m.address + PAGE, 2 * PAGE - 1)]) is True  # VirtualUnlock: ERROR_NOT_LOCKED
        assert fake.named("VirtualUnlock") == [(m.address + PAGE, 2 * PAGE)]
        assert _os.resident_bytes(m.address, m.size) == m.size - 2 * PAGE
        with pytest.warns(_os.AdviceWarning, match="VirtualUnlock"):  # a real failure warns once
            assert _os.release([(PAGE, PAGE)]) is False


def test_prefetch_without_prefetchvirtualmemory_touches_every_page(monkeypatch, data_file):
    """Windows 7: no PrefetchVirtualMemory; one byte per page is read with ReadProcessMemory, and
    an unmapped page fails cleanly (a warning, not a crash)."""
    path, _ = data_file
    with FakeWindows(missing={"PrefetchVirtualMemory"}) as fake:
        fake.install()
        monkeypatch.setattr(_os, "_backend", w)
        monkeypatch.setattr(_os, "_WARNED", set())
        assert w.engine_advice()[1] == 0  # the engine gets no prefetch either
        with _os.map_file(path) as m:
            assert _os.prefetch([(m.address, 3 * PAGE)]) is True
            reads = fake.named("ReadProcessMemory")
            assert [(a[0], a[1], a[3]) for a in reads] == [(PSEUDO_PROCESS, m.address + i * PAGE, 1) for i in range(3)]
            assert fake.pages_resident(m.address, m.size) == 3
            with pytest.warns(_os.AdviceWarning, match="ReadProcessMemory"):
                assert _os.prefetch([(PAGE, PAGE)]) is False
        assert fake.errors == []


def test_query_working_set_falls_back_to_psapi(monkeypatch, data_file):
    path, _ = data_file
    with FakeWindows(missing={"K32QueryWorkingSetEx"}) as fake:
        fake.install()
        monkeypatch.setattr(_os, "_backend", w)
        assert w._lookup("QueryWorkingSetEx") is fake.dlls["psapi"]._functions["QueryWorkingSetEx"]
        with _os.map_file(path) as m:
            _os.prefetch([(m.address, PAGE)])
            assert _os.resident_bytes(m.address, m.size) == PAGE
    with FakeWindows(missing={"K32QueryWorkingSetEx", "QueryWorkingSetEx"}) as fake:
        fake.install()
        with pytest.raises(OSError, match="QueryWorkingSetEx is not available"):
            w.resident_bytes(PAGE, PAGE)


def test_alloc_aligned_commits_and_releases_whole_allocations(fake):
    address, buf = _os.alloc_aligned(3 * PAGE + 1, align=1 << 16)
    ((at, size, allocation_type, protect),) = fake.named("VirtualAlloc")
    assert at is None and (allocation_type, protect) == (w.MEM_COMMIT | w.MEM_RESERVE, w.PAGE_READWRITE)
    assert size % PAGE == 0 and size >= 3 * PAGE + 1 + (1 << 16) and address % (1 << 16) == 0
    view = buf.as_numpy(np.uint8)
    assert not view.any()
    view[:] = 3
    base = next(iter(fake.allocations))
    del view
    buf.close()
    assert fake.named("VirtualFree") == [(base, 0, w.MEM_RELEASE)] and fake.allocations == {}
    with pytest.raises(MemoryError, match=r"VirtualAlloc.*Windows error 8"):
        _os.alloc_aligned(1 << 41)


def test_set_cpus_sets_the_process_mask_in_group_0_and_the_thread_group_beyond(fake):
    """CPUs numbered across the groups (8 in group 0, 4 in group 1): group 0's set the process
    mask; group 1's (8..11) this thread's group affinity, which the threads it starts inherit."""
    _os.set_cpus({0, 2, 3})
    assert fake.named("SetProcessAffinityMask") == [(PSEUDO_PROCESS, 0b1101)]
    _os.set_cpus({9, 11})
    assert fake.thread_group == (1, 0b1010)
    for bad in ({1, 8}, {12}):
        with pytest.raises(OSError, match=r"not within one of this machine's 2 processor group\(s\) \(12 CPUs\)"):
            _os.set_cpus(bad)
    assert _os.numa_nodes() == {}
    with pytest.raises(OSError, match="start /NODE N"):
        _os.set_memory_policy("interleave", [0])


def test_lock_raises_the_working_set_quota_when_it_must(fake):
    address, buf = _os.alloc_aligned(300 * PAGE)
    fake.quota = [100 * PAGE, 200 * PAGE]
    assert _os.lock([(address, 150 * PAGE)]) is True  # over the minimum: grow it, then lock
    assert fake.named("SetProcessWorkingSetSize") == [(PSEUDO_PROCESS, 250 * PAGE, 350 * PAGE)]
    assert len(fake.named("VirtualLock")) == 2 and fake.pages_resident(address, 150 * PAGE) == 150
    assert _os.unlock([(address, 150 * PAGE)]) is True and not fake.locked
    buf.close()


def test_statistics_pass_their_structure_sizes(fake, data_file):
    path, _ = data_file
    with _os.map_file(path) as m:
        _os.prefetch([(m.address, 2 * PAGE)])
        assert _os.rss_bytes() == (2 * PAGE, 2 * PAGE)
        assert _os.page_faults() == (7, 0)
    ((process, counters, nbytes),) = fake.named("GetProcessMemoryInfo")[:1]
    assert process == PSEUDO_PROCESS and nbytes == 72
    assert _os.memory_limit() == (None, "")  # QueryInformationJobObject: not in a job
    assert _os.available_memory() == 3 << 30


def test_the_fake_sees_a_wrong_prototype_the_backend_set(monkeypatch, data_file):
    """The dynamic half of the mutation test: with MapViewOfFile's byte count declared a DWORD
    where the documentation has a SIZE_T (a mistake that works until a view passes 4 GiB),
    map_file still runs against the fake, and the prototype the backend set on the fake's
    function pointer is caught."""
    path, _ = data_file
    candidates, restype, argtypes = w._PROTOTYPES["MapViewOfFile"]
    monkeypatch.setitem(w._PROTOTYPES, "MapViewOfFile", (candidates, restype, argtypes[:-1] + (ctypes.c_uint32,)))
    with FakeWindows() as fake:
        fake.install()
        address, size = w.map_file(path)
        w.unmap_file(address, size)
        uint32 = ctypes.c_uint32.__name__
        assert fake.prototype_errors() == [
            f"MapViewOfFile: declared (c_void_p, {uint32}, {uint32}, {uint32}, {uint32}) "
            "-> c_void_p, documented (HANDLE, DWORD, DWORD, DWORD, SIZE_T) -> LPVOID"
        ]


AMX_CONFIG, AMX_DATA = 1 << 17, 1 << 18  # winnt.h's XSTATE_MASK_AMX_TILE_CONFIG / _DATA


@pytest.mark.parametrize(
    "system, optional, missing, granted, named",
    [
        (0, 0, (), False, "Windows 11"),  # no AMX in this Windows
        (AMX_CONFIG, AMX_CONFIG, (), False, "XSTATE_AMX_TILE_DATA"),  # the config alone is not the tiles
        (AMX_CONFIG | AMX_DATA, AMX_CONFIG | AMX_DATA, (), True, ""),  # Windows 11: turned on, then held
        (AMX_CONFIG | AMX_DATA, 0, (), True, ""),  # already on for every thread
        (
            AMX_CONFIG | AMX_DATA,
            AMX_CONFIG | AMX_DATA,
            ("EnableProcessOptionalXStateFeatures",),
            False,
            "EnableProcessOptionalXStateFeatures is missing",
        ),
    ],
)
def test_the_tile_state_is_turned_on_for_the_process(monkeypatch, system, optional, missing, granted, named):
    """Windows offers AMX's tile state as an optional XSAVE feature: request_tile_data checks the
    system has it (GetEnabledXStateFeatures, bit 18), turns it on for the process
    (EnableProcessOptionalXStateFeatures with bits 17 and 18) only where the thread lacks it, and
    checks the thread has it then (GetThreadEnabledXStateFeatures); a refusal is one line naming
    its cause. Asked once per process."""
    with FakeWindows(missing=missing) as fake:
        fake.install()
        monkeypatch.setattr(_os, "_backend", w)
        monkeypatch.setattr(_os, "_TILE_DATA", [])
        fake.xstate |= system
        fake.optional = optional
        got, why = _os.request_tile_data()
        assert got is granted and named in why and "\n" not in why and (why == "") == granted
        assert _os.request_tile_data() == (got, why)
        calls = fake.named("EnableProcessOptionalXStateFeatures")
        assert calls == ([(AMX_CONFIG | AMX_DATA,)] if system & AMX_DATA and optional and not missing else [])
        assert fake.errors == [] and fake.prototype_errors() == []
