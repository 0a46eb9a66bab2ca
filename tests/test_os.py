"""colibri._os: the contract (which functions exist on which platform, Windows structure layouts)
on every OS, then the behaviour of the backend of the OS the tests run on.

The Linux tests map a 64 MiB file of random bytes and watch the page cache and the process's RSS
through the interface itself: eviction empties the cache, prefetch fills it, release takes the
pages out of the process. Windows behaviour tests skip elsewhere.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import os
import sys
import time
import warnings
import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri import _os

LINUX = sys.platform.startswith("linux")
WINDOWS = sys.platform == "win32"
only_linux = pytest.mark.skipif(not LINUX, reason="Linux backend behaviour (mincore, /proc/self)")
only_windows = pytest.mark.skipif(not WINDOWS, reason="Windows backend behaviour (kernel32)")

FILE_BYTES = 64 << 20  # the mapped test file
PAGE = _os.page_size()
MOSTLY = 0.95  # "present": at least this fraction of the bytes resident
HARDLY = 0.05  # "absent": at most this fraction resident
RSS_DROP = 0.80  # release must take at least this fraction of the mapping off RSS
POLL_SECONDS = 2.0  # how long prefetch may take to bring a cold file in


def _poll(predicate, seconds=POLL_SECONDS):
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# ---- contract: runs on every OS ------------------------------------------------------------------


def test_backend_is_chosen_by_platform():
    expected = "windows" if WINDOWS else "linux" if LINUX else "posix-generic"
    assert _os.BACKEND == expected


@pytest.mark.parametrize("module", ["colibri._os._linux", "colibri._os._windows"])
def test_every_backend_imports_and_defines_the_interface(module):
    backend = importlib.import_module(module)
    missing = [name for name in _os.BACKEND_FUNCTIONS if not callable(getattr(backend, name, None))]
    assert not missing, f"{module} lacks {missing}"


def test_interface_is_defined_once_in_the_package():
    assert set(_os.INTERFACE) <= set(_os.BACKEND_FUNCTIONS)
    assert all(callable(getattr(_os, name)) for name in _os.INTERFACE)
    assert set(_os.INTERFACE) <= set(_os.__all__)


@only_linux
def test_address_space_room_follows_the_rlimit():
    """Under ulimit -v the room is what the limit leaves (positive, below it); the stack is
    RLIMIT_STACK's; without a limit the room is unknown. (The engine refuses --threads whose stacks
    cannot fit before starting any: a thread that dies in CPython's start-up hangs start().)"""
    import subprocess

    code = (
        "import resource; from colibri import _os; "
        "resource.setrlimit(resource.RLIMIT_AS, (3 << 30, resource.getrlimit(resource.RLIMIT_AS)[1])); "
        "print(*_os.address_space_room(), resource.getrlimit(resource.RLIMIT_STACK)[0])"
    )
    room, stack, rlimit_stack = map(
        int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    )
    assert 0 < room < 3 << 30
    assert stack == (rlimit_stack if rlimit_stack > 0 else 8 << 20)
    import resource

    if resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY:
        assert _os.address_space_room()[0] is None


@pytest.mark.skipif(ctypes.sizeof(ctypes.c_void_p) != 8, reason="sizes are those of 64-bit Windows")
def test_windows_structures_have_the_x64_layout():
    w = importlib.import_module("colibri._os._windows")
    assert ctypes.sizeof(w.WIN32_MEMORY_RANGE_ENTRY) == 16
    assert ctypes.sizeof(w.PSAPI_WORKING_SET_EX_INFORMATION) == 16
    assert ctypes.sizeof(w.PROCESS_MEMORY_COUNTERS) == 72
    assert w.PROCESS_MEMORY_COUNTERS.PageFaultCount.offset == 4
    assert w.PROCESS_MEMORY_COUNTERS.PeakWorkingSetSize.offset == 8
    assert w.PSAPI_WORKING_SET_EX_INFORMATION.VirtualAttributes.offset == 8
    assert ctypes.sizeof(w.JOBOBJECT_BASIC_LIMIT_INFORMATION) == 64
    assert w.JOBOBJECT_BASIC_LIMIT_INFORMATION.LimitFlags.offset == 16
    assert ctypes.sizeof(w.JOBOBJECT_EXTENDED_LIMIT_INFORMATION) == 144
    assert w.JOBOBJECT_EXTENDED_LIMIT_INFORMATION.ProcessMemoryLimit.offset == 112
    assert w.JOBOBJECT_EXTENDED_LIMIT_INFORMATION.JobMemoryLimit.offset == 120
    assert ctypes.sizeof(w.MEMORYSTATUSEX) == 64 and w.MEMORYSTATUSEX.ullAvailPhys.offset == 16
    info = w.PSAPI_WORKING_SET_EX_INFORMATION()
    info.VirtualAttributes.Flags = 1 | 5 << 1 | 0x04 << 4  # Valid, ShareCount 5, PAGE_READWRITE
    bits = info.VirtualAttributes
    assert (bits.Valid, bits.ShareCount, bits.Win32Protection, bits.Shared) == (1, 5, 0x04, 0)


def test_windows_backend_prototypes_are_ctypes_types():
    w = importlib.import_module("colibri._os._windows")
    for name, (candidates, restype, argtypes) in w._PROTOTYPES.items():
        assert candidates and all(dll in ("kernel32", "psapi") for dll, _ in candidates), name
        for t in (restype, *argtypes):
            assert isinstance(t, type) and issubclass(t, ctypes._SimpleCData | ctypes._Pointer), (name, t)


def test_ranges_are_page_aligned_sorted_and_merged():
    p = PAGE
    assert _os._aligned([(p + 1, 10)]) == [(p, p)]
    assert _os._aligned([(p - 1, 2)]) == [(0, 2 * p)]
    assert _os._aligned([(5 * p, p), (p, p), (2 * p, 1), (9 * p, 0)]) == [(p, 2 * p), (5 * p, p)]
    assert _os._aligned([]) == []
    with pytest.raises(TypeError, match="wrap a single range"):
        _os._aligned((p, p))
    with pytest.raises(ValueError):
        _os._aligned([(p, -1)])


def test_advice_failure_warns_once_per_function(monkeypatch):
    monkeypatch.setattr(_os, "_WARNED", set())
    unmapped = [(1, PAGE)]  # page 0 is never mapped
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _os.prefetch(unmapped) is False
        assert _os.prefetch(unmapped) is False
    advice = [w for w in caught if issubclass(w.category, _os.AdviceWarning)]
    assert len(advice) == 1, [str(w.message) for w in caught]
    assert "prefetch" in str(advice[0].message)
    assert advice[0].filename == __file__  # points at the caller, not at colibri/_os
    with pytest.warns(_os.AdviceWarning, match="unlock"):
        assert _os.unlock(unmapped) is False  # another function warns for itself


def test_map_file_failure_raises_with_the_filename(tmp_path):
    missing = tmp_path / "missing.bin"
    with pytest.raises(FileNotFoundError) as e:
        _os.map_file(missing)
    assert e.value.filename == str(missing)


def test_empty_file_maps_to_nothing(tmp_path):
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with _os.map_file(empty) as m:
        assert (m.address, m.size) == (0, 0)
        assert m.as_numpy().size == 0
    assert m.closed


def test_alloc_aligned_is_aligned_writable_and_freed():
    for align in (64, 4096, 1 << 20):
        address, buf = _os.alloc_aligned(3 * PAGE + 5, align)
        assert address % align == 0 and address == buf.address and buf.size == 3 * PAGE + 5
        view = buf.as_numpy(np.float32, (3 * PAGE // 4,))
        assert not view.any()  # zero-filled
        view[:] = np.arange(view.size, dtype=np.float32)
        assert ctypes.c_float.from_address(address + 4 * 100).value == 100.0
        del view
        buf.close()
        buf.close()  # idempotent
        with pytest.raises(ValueError, match="closed"):
            buf.as_numpy()
    assert _os.alloc_aligned(0)[0] == 0
    with pytest.raises(ValueError):
        _os.alloc_aligned(PAGE, align=3)


def test_numpy_views_keep_their_owner_alive():
    _, buf = _os.alloc_aligned(PAGE)
    view = buf.as_numpy(np.uint8)
    del buf  # the view still owns it: no unmap under our feet
    view[:] = 7
    assert view.sum() == 7 * PAGE


def test_lock_and_unlock_a_small_range():
    _, buf = _os.alloc_aligned(4 * PAGE)
    with buf, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _os._WARNED.discard("lock")
        locked = _os.lock([(buf.address, buf.size)])
        if locked:
            assert _os.unlock([(buf.address, buf.size)]) is True
            assert not caught
        else:  # e.g. RLIMIT_MEMLOCK is 0 here: advice, so a warning and no exception
            assert any(issubclass(w.category, _os.AdviceWarning) for w in caught)


def _thp_possible() -> bool:
    try:
        return "[never]" not in open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False


def test_small_pages_make_memory_resident_page_by_page():
    """After small_pages, one written byte of an 8 MB anonymous region is one page in memory. On a
    Linux with transparent huge pages the region is first advised MADV_HUGEPAGE, and a twin region
    left so shows the 2 MB that small_pages (MADV_NOHUGEPAGE) saves; elsewhere the advice has
    nothing to do and still succeeds."""
    size, thp = 8 << 20, sys.platform.startswith("linux") and _thp_possible()
    regions = [_os.alloc_aligned(size, 2 << 20) for _ in range(2)]
    try:
        if thp:
            libc = ctypes.CDLL(None, use_errno=True)
            for address, _ in regions:
                assert libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(size), 14) == 0  # MADV_HUGEPAGE
        (small, _), (huge, _) = regions
        assert _os.small_pages([(small, size)]) is True
        for address, _ in regions:
            ctypes.c_char.from_address(address + (3 << 20)).value = b"x"
        assert _os.resident_bytes(small, size) == PAGE
        if thp:
            assert _os.resident_bytes(huge, size) == 2 << 20
    finally:
        for _, buf in regions:
            buf.close()


def test_statistics_are_sane():
    current, peak = _os.rss_bytes()
    assert peak >= current > 0
    if LINUX:  # the counters are this process's, as the kernel keeps them
        import resource

        low = resource.getrusage(resource.RUSAGE_SELF)
        minor, major = _os.page_faults()
        high = resource.getrusage(resource.RUSAGE_SELF)
        assert low.ru_minflt <= minor <= high.ru_minflt and low.ru_majflt <= major <= high.ru_majflt
    minor, major = _os.page_faults()
    with _os.alloc_aligned(64 * PAGE)[1] as buf:
        buf.as_numpy(np.uint8)[::PAGE] = 1  # first write to each fresh page faults
        assert _os.page_faults()[0] > minor
    io = _os.read_io_bytes()
    assert isinstance(io, int) if LINUX else io is None or isinstance(io, int)


# ---- Linux behaviour -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def random_file(tmp_path_factory):
    """(path, bytes) of a 64 MiB file of random bytes, flushed to storage (so it can be evicted)."""
    data = np.random.default_rng(0).integers(0, 256, FILE_BYTES, dtype=np.uint8)
    path = tmp_path_factory.mktemp("os") / "random.bin"
    with open(path, "wb") as f:
        f.write(data.tobytes())
        f.flush()
        os.fsync(f.fileno())
    return path, data


@only_linux
def test_mapping_reads_the_file(random_file):
    path, data = random_file
    with _os.map_file(path) as m:
        assert m.size == FILE_BYTES and m.address % PAGE == 0
        raw = (ctypes.c_char * m.size).from_address(m.address)
        assert np.array_equal(np.frombuffer(raw, np.uint8), data)
        view = m.as_numpy(np.uint32, (FILE_BYTES // 4,))
        assert np.array_equal(view, data.view(np.uint32))
        assert not view.flags.writeable  # PROT_READ: a write would crash, numpy refuses it
        del raw, view


@only_linux
def test_prefetch_chunk_is_whole_pages_and_splits_ranges(random_file):
    chunk = _os.prefetch_chunk(random_file[0])
    assert chunk >= PAGE and chunk % PAGE == 0
    from colibri._os import _linux

    pieces = list(_linux._pieces([(0, 5 * PAGE), (10 * PAGE, PAGE)], 2 * PAGE))
    assert pieces == [(0, 2 * PAGE), (2 * PAGE, 2 * PAGE), (4 * PAGE, PAGE), (10 * PAGE, PAGE)]


@only_linux
def test_evict_then_prefetch_fills_the_page_cache(random_file):
    """The whole file, not only its first `prefetch_chunk` bytes: one madvise(MADV_WILLNEED)
    reads at most the device's readahead limit (8 MiB of these 64 on the machine this was
    written on, 128 KiB-1.25 MiB on typical NVMe), so prefetch must split the range."""
    path, _ = random_file
    with _os.map_file(path) as m:
        assert _os.evict_file_cache(path) is True
        assert _os.resident_bytes(m.address, m.size) <= HARDLY * m.size
        io_before = _os.read_io_bytes()
        assert _os.prefetch([(m.address, m.size)]) is True
        assert _poll(lambda: _os.resident_bytes(m.address, m.size) >= MOSTLY * m.size), (
            f"only {_os.resident_bytes(m.address, m.size)} of {m.size} bytes after prefetch"
        )
        assert _os.read_io_bytes() - io_before >= MOSTLY * m.size  # it came from storage


@only_linux
def test_release_takes_the_pages_out_of_the_process(random_file):
    path, _ = random_file
    with _os.map_file(path) as m:
        whole = [(m.address, m.size)]
        int(m.as_numpy(np.uint8)[::PAGE].sum())  # touch every page: now mapped into us
        touched = _os.rss_bytes()[0]
        # Control: pages mapped into a process survive eviction from the page cache...
        _os.evict_file_cache(path)
        assert _os.resident_bytes(m.address, m.size) >= MOSTLY * m.size
        # ...release unmaps them: RSS falls by about the mapping, and now eviction works.
        assert _os.release(whole) is True
        assert touched - _os.rss_bytes()[0] >= RSS_DROP * m.size
        _os.evict_file_cache(path)
        assert _os.resident_bytes(m.address, m.size) <= HARDLY * m.size


@only_linux
def test_unaligned_ranges_cover_their_pages(random_file):
    path, _ = random_file
    with _os.map_file(path) as m:
        _os.evict_file_cache(path)
        first = m.address + 10 * PAGE
        # 3 pages' length starting 1 byte into page 10: pages 10..13 (no EINVAL on the odd start)
        assert _os.prefetch([(first + 1, 3 * PAGE)]) is True
        assert _poll(lambda: _os.resident_bytes(first, 4 * PAGE) == 4 * PAGE)
        assert _os.resident_bytes(m.address + 100 * PAGE, 10 * PAGE) == 0  # nothing else read
        assert _os.resident_bytes(first + 1, 10) == 10  # clipped to the range, not whole pages
        assert _os.resident_bytes(first + PAGE - 5, 10) == 10  # straddling two pages
    # release of private anonymous memory zero-fills exactly the pages it covered
    with _os.alloc_aligned(4 * PAGE)[1] as buf:
        pages = buf.as_numpy(np.uint8, (4, PAGE))
        pages[:] = 1
        assert _os.release([(buf.address + PAGE + 1, PAGE)]) is True  # pages 1 and 2
        assert pages.sum(axis=1).tolist() == [PAGE, 0, 0, PAGE]
        del pages


@only_linux
def test_resident_bytes_of_an_unmapped_range_raises():
    with pytest.raises(OSError):
        _os.resident_bytes(0, PAGE)


# ---- Windows behaviour ---------------------------------------------------------------------------


@only_windows
def test_windows_mapping_prefetch_release_and_working_set(random_file):
    path, data = random_file
    with _os.map_file(path) as m:
        assert np.array_equal(m.as_numpy(np.uint8), data)  # touches every page
        assert _os.resident_bytes(m.address, m.size) >= MOSTLY * m.size
        touched = _os.rss_bytes()[0]
        assert _os.release([(m.address, m.size)]) is True
        assert _os.resident_bytes(m.address, m.size) <= HARDLY * m.size
        assert touched - _os.rss_bytes()[0] >= RSS_DROP * m.size
        assert _os.prefetch([(m.address + 1, 3 * PAGE)]) is True
    assert _os.evict_file_cache(path) is False
    assert _os.page_faults()[1] == 0


@only_windows
def test_windows_prefetch_fallback_touches_pages(monkeypatch):
    w = importlib.import_module("colibri._os._windows")
    _, restype, argtypes = w._PROTOTYPES["PrefetchVirtualMemory"]  # as on Windows 7: missing
    monkeypatch.setitem(w._PROTOTYPES, "PrefetchVirtualMemory", ((("kernel32", "NoSuchFunction"),), restype, argtypes))
    w._lookup.cache_clear()
    try:
        with _os.alloc_aligned(8 * PAGE)[1] as buf:
            assert _os.prefetch([(buf.address, buf.size)]) is True
        monkeypatch.setattr(_os, "_WARNED", set())
        with pytest.warns(_os.AdviceWarning):
            assert _os.prefetch([(1, PAGE)]) is False  # unmapped: ReadProcessMemory fails cleanly
    finally:
        monkeypatch.undo()
        w._lookup.cache_clear()


def test_compute_cores_respects_the_affinity_mask():
    import subprocess
    import sys

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this OS")
    cpu = sorted(os.sched_getaffinity(0))[0]
    code = f"import os; os.sched_setaffinity(0, {{{cpu}}}); from colibri import _os; print(_os.compute_cores())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "1"
    assert 1 <= _os.compute_cores() <= len(os.sched_getaffinity(0))


def test_a_loaded_model_lives_in_memory_the_os_layer_gave_it(converted):
    """The model's files are _os.Mapping objects (map_file), the KV cache and scratch come from
    alloc_aligned (page-aligned, unlike numpy's own allocations), and mmap=False reads the files
    into alloc_aligned memory."""
    import colibri

    m = colibri.load(converted("mixtral_a", "int8"))
    regions = [region for region, _ in m._maps._maps.values()]
    assert regions and all(isinstance(r, _os.Mapping) for r in regions)
    assert all(address % PAGE == 0 for address, _ in m._engine.kv_cache_ranges())
    r = colibri.load(converted("mixtral_a", "int8"), mmap=False)
    assert all(isinstance(region, _os.AlignedBuffer) for region, _ in r._maps._maps.values())
    np.testing.assert_array_equal(m.forward([1, 2, 3]), r.forward([1, 2, 3]))
    alive = [weakref.ref(region) for region in regions]
    del regions
    m.close()
    gc.collect()
    assert all(ref() is None or ref().closed for ref in alive)  # no view left: unmapped at close


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.sampled_from(["u1", "<i4", "<f4", "<i8"])), min_size=1, max_size=24))
def test_arena_arrays_are_aligned_zero_and_apart(items):
    """_os.arena: every array zero-filled, 64-byte aligned, none overlapping another, and arrays
    of a page-multiple size not all at the same offset within a page."""
    specs = {f"a{i}": ((n,), dtype) for i, (n, dtype) in enumerate(items)}
    arrays = _os.arena(specs)
    spans = []
    for name, (shape, dtype) in specs.items():
        a = arrays[name]
        assert a.shape == shape and a.dtype == np.dtype(dtype) and not a.any()
        if a.size:
            assert a.ctypes.data % 64 == 0
            spans.append((a.ctypes.data, a.ctypes.data + a.nbytes))
            a[...] = 1  # writeable, and its own memory
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    big = _os.arena({f"p{i}": ((PAGE,), "<f4") for i in range(4)})
    assert len({a.ctypes.data % PAGE for a in big.values()}) == 4


@pytest.mark.parametrize(
    "flags, expected",
    [
        (0, (None, "")),
        (0x100, (300 << 20, "job object ProcessMemoryLimit")),
        (0x300, (200 << 20, "job object JobMemoryLimit")),
    ],
)
def test_windows_memory_limit_reads_the_job_object(monkeypatch, flags, expected):
    """memory_limit on Windows: QueryInformationJobObject(NULL, JobObjectExtendedLimitInformation)
    of the job the process is in, the tighter of its process and job limits where their flags
    are set (a recording fake of kernel32 here)."""
    w = importlib.import_module("colibri._os._windows")
    calls = []

    def query(job, klass, address, size, returned):
        calls.append((job, klass, size))
        info = w.JOBOBJECT_EXTENDED_LIMIT_INFORMATION.from_address(address)
        info.BasicLimitInformation.LimitFlags = flags
        info.ProcessMemoryLimit, info.JobMemoryLimit = 300 << 20, 200 << 20
        return 1

    monkeypatch.setattr(w, "_lookup", lambda name: query if name == "QueryInformationJobObject" else None)
    assert w.memory_limit() == expected
    assert calls == [(None, w.JobObjectExtendedLimitInformation, ctypes.sizeof(w.JOBOBJECT_EXTENDED_LIMIT_INFORMATION))]


def test_windows_memory_limit_outside_a_job(monkeypatch):
    w = importlib.import_module("colibri._os._windows")
    monkeypatch.setattr(w, "_lookup", lambda name: (lambda *a: 0) if name == "QueryInformationJobObject" else None)
    assert w.memory_limit() == (None, "")


# ---- AMX's tile state: the Linux request (arch_prctl), the report ------------------------------

# The kernel's numbers, written out here from its headers (not read from the module under test):
# x86-64's syscall number of arch_prctl, uapi/asm/prctl.h's two operations, XTILEDATA's component.
SYS_ARCH_PRCTL_X86_64, ARCH_GET_XCOMP_PERM, ARCH_REQ_XCOMP_PERM, XTILEDATA = 158, 0x1022, 0x1023, 18


class FakeArchPrctl:
    """libc's syscall(2) as _linux.request_tile_data calls it: arch_prctl's ARCH_GET_XCOMP_PERM
    (the permitted XSAVE components) and ARCH_REQ_XCOMP_PERM (grant component 18 or fail with
    `errno`), recorded in `calls`. `lie`: the request succeeds but grants nothing."""

    def __init__(self, mask=0xE7, errno=0, lie=False):
        self.mask, self.errno, self.lie, self.calls, self.restype = mask, errno, lie, [], None

    def __call__(self, number, op, arg):
        assert number.value == SYS_ARCH_PRCTL_X86_64
        self.calls.append(op.value)
        if op.value == ARCH_GET_XCOMP_PERM:
            arg._obj.value = self.mask
            return 0
        assert op.value == ARCH_REQ_XCOMP_PERM and arg.value == XTILEDATA
        if self.errno:
            ctypes.set_errno(self.errno)
            return -1
        if not self.lie:
            self.mask |= 1 << arg.value
        return 0


@pytest.fixture(autouse=True)
def _no_fake_libc_left():
    """_linux._fn caches each libc function it looks up: a fake's must not outlive its test."""
    yield
    importlib.import_module("colibri._os._linux")._fn.cache_clear()


def _fake_libc(monkeypatch, fake):
    from colibri._os import _linux

    _linux._fn.cache_clear()
    monkeypatch.setattr(_linux, "_libc", lambda: type("FakeLibc", (), {"syscall": fake})())
    monkeypatch.setattr(_linux.os, "uname", lambda: os.uname_result(("Linux", "h", "6.8", "#1", "x86_64")))
    monkeypatch.setattr(_linux.sys, "platform", "linux")
    return _linux


@only_linux
def test_the_tile_state_is_requested_once_and_checked(monkeypatch):
    """Not yet permitted: one ARCH_REQ_XCOMP_PERM for component 18 between two reads of the mask,
    the second showing it; already permitted: no request at all."""
    fake = FakeArchPrctl()
    linux = _fake_libc(monkeypatch, fake)
    linux.request_tile_data()
    assert fake.calls == [ARCH_GET_XCOMP_PERM, ARCH_REQ_XCOMP_PERM, ARCH_GET_XCOMP_PERM]
    assert fake.mask >> XTILEDATA & 1
    fake.calls.clear()
    linux.request_tile_data()
    assert fake.calls == [ARCH_GET_XCOMP_PERM]


@only_linux
@pytest.mark.parametrize(
    "err, cause", [(95, "no AMX tile state"), (22, "Linux 5.16"), (28, "sigaltstack"), (1, os.strerror(1))]
)
def test_a_refused_tile_state_names_its_cause(monkeypatch, err, cause):
    """A refusal is an OSError carrying the errno and one line naming the cause: no AMX (EOPNOTSUPP),
    a kernel before 5.16 (EINVAL), a small alternate signal stack (ENOSPC), else strerror; the
    interface turns it into (False, that line), asked once per process."""
    fake = FakeArchPrctl(errno=err)
    _fake_libc(monkeypatch, fake)
    monkeypatch.setattr(_os, "_backend", importlib.import_module("colibri._os._linux"))
    monkeypatch.setattr(_os, "_TILE_DATA", [])
    granted, why = _os.request_tile_data()
    assert not granted and cause in why and "ARCH_REQ_XCOMP_PERM" in why and "\n" not in why
    assert _os.request_tile_data() == (granted, why) and len(fake.calls) == 2  # not asked again


@only_linux
def test_a_request_that_grants_nothing_is_refused(monkeypatch):
    linux = _fake_libc(monkeypatch, FakeArchPrctl(lie=True))
    with pytest.raises(OSError, match="not held"):
        linux.request_tile_data()


@only_linux
def test_the_tile_state_is_an_x86_64_request(monkeypatch):
    fake = FakeArchPrctl()
    linux = _fake_libc(monkeypatch, fake)
    monkeypatch.setattr(linux.os, "uname", lambda: os.uname_result(("Linux", "h", "6.8", "#1", "aarch64")))
    with pytest.raises(OSError, match="x86-64 Linux"):
        linux.request_tile_data()
    assert fake.calls == []


@only_linux
def test_the_real_request_agrees_with_the_cpu():
    """On this machine, the kernel's answer itself: granted where the CPU has AMX and XCR0 enables
    its state (an AMX host), refused with one line otherwise; the report says the same."""
    from colibri import _kernels

    f = _kernels.cpu_features()
    saved = list(_os._TILE_DATA)
    _os._TILE_DATA.clear()
    try:
        granted, why = _os.request_tile_data()
    finally:
        _os._TILE_DATA[:] = saved or _os._TILE_DATA
    if os.uname().machine == "x86_64" and f["amx_tile"] and f["os_amx"]:
        assert granted, why
    else:
        assert not granted and why and "\n" not in why
    status = _kernels.amx_status()
    assert ("granted" in status) == (granted and f["amx_tile"] and f["os_amx"])


@pytest.mark.parametrize(
    "amx_tile, amx_int8, amx_bf16, os_amx, answer, expect",
    [
        (False, False, False, False, None, "no AMX on this CPU"),
        (True, True, True, False, None, "does not enable its tile state (XCR0"),
        (True, True, False, True, (True, ""), "AMX (int8): tile state granted"),
        (
            True,
            True,
            True,
            True,
            (False, "why not"),
            "AMX (int8+bf16) on this CPU, but the OS refused its tile state: why not",
        ),
    ],
)
def test_the_amx_report(monkeypatch, amx_tile, amx_int8, amx_bf16, os_amx, answer, expect):
    """_kernels.amx_status: the CPU's bits, XCR0, then the OS's answer — asked only where the first
    two allow the tiles."""
    from colibri import _kernels

    asked = []
    monkeypatch.setattr(_os, "request_tile_data", lambda: asked.append(1) or answer)
    f = dict(_kernels.cpu_features(), amx_tile=amx_tile, amx_int8=amx_int8, amx_bf16=amx_bf16, os_amx=os_amx)
    status = _kernels.amx_status(f)
    assert expect in status and "\n" not in status
    assert bool(asked) == (answer is not None)


@pytest.mark.skipif(not LINUX or os.uname().machine != "x86_64", reason="/proc/cpuinfo's x86 flags")
def test_the_amx_bits_are_the_kernels_cpu_flags():
    """cpu.h's AMX bits (CPUID 7.0 EDX 22, 24, 25) against the flags Linux (5.16+ knows them) lists
    for this CPU."""
    import re
    from colibri import _kernels

    release = re.match(r"(\d+)\.(\d+)", os.uname().release)
    if not release or tuple(map(int, release.groups())) < (5, 16):
        pytest.skip("this kernel predates AMX's flags")
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    features = _kernels.cpu_features()
    names = ("amx_tile", "amx_int8", "amx_bf16")
    if features["os_amx"]:  # the kernel lists them where it enabled their state
        assert {k: features[k] for k in names} == {k: k in flags for k in names}
    else:  # a CPU bit the kernel does not list is possible; not the reverse
        assert not any(k in flags and not features[k] for k in names)
