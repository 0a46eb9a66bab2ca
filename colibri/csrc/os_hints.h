/* os_hints.h — the OS calls on the token path: "these expert pages will be read soon" and, under
 * an expert budget during prefill, "these may go".
 *
 * Everything else the OS offers (mapping, release, residency queries, locking, statistics) goes
 * through colibri/_os in Python, outside the token loop. Prefetching the experts a router has just
 * chosen (or predicted) has to happen inside the compiled layer loop, so it is here:
 * madvise(MADV_WILLNEED) on POSIX, PrefetchVirtualMemory (Windows 8+, looked up once; missing:
 * no-op) on Windows. Advice: a failure is counted, never fatal. Ranges are page-aligned by the
 * caller (Engine builds them once at load).
 */
#ifndef COLIBRI_OS_HINTS_H
#define COLIBRI_OS_HINTS_H

#include <stddef.h>
#include <stdint.h>

/* "These pages may leave the process": used by the prefill under an expert budget, right after an
 * expert's matrix product, so a long prompt that routes to every expert never holds them all. */
static int cb_release_pages(const void *start, size_t len);

/* One advice call per `chunk` bytes at most (0: no limit): Linux reads at most
 * max(read_ahead_kb, max_sectors_kb) of a file per madvise(MADV_WILLNEED) and silently skips the
 * rest; colibri._os.prefetch_chunk() says how much. */
static int cb_will_need_one(const void *start, size_t len);

static int cb_will_need(const void *start, size_t len, size_t chunk) {
    int failed = 0;
    if (chunk == 0) chunk = len;
    for (size_t off = 0; off < len; off += chunk) {
        size_t n = len - off < chunk ? len - off : chunk;
        failed |= cb_will_need_one((const char *)start + off, n) != 0;
    }
    return failed ? -1 : 0;
}

#if defined(_WIN32)
#include <windows.h>
typedef struct { void *VirtualAddress; size_t NumberOfBytes; } cb_range_entry;
typedef BOOL (WINAPI *cb_prefetch_fn)(HANDLE, ULONG_PTR, cb_range_entry *, ULONG);
static int cb_will_need_one(const void *start, size_t len) {
    static cb_prefetch_fn fn = NULL;
    static int looked_up = 0;
    if (!looked_up) {
        HMODULE k32 = GetModuleHandleA("kernel32.dll");
        fn = k32 ? (cb_prefetch_fn)GetProcAddress(k32, "PrefetchVirtualMemory") : NULL;
        looked_up = 1;
    }
    if (!fn) return -1;
    cb_range_entry e = {(void *)start, len};
    return fn(GetCurrentProcess(), 1, &e, 0) ? 0 : -1;
}
static int cb_release_pages(const void *start, size_t len) {
    /* on pages that are not locked, VirtualUnlock removes them from the working set (and reports
     * ERROR_NOT_LOCKED): the documented way to trim a range */
    VirtualUnlock((void *)start, len);
    return 0;
}
#else
#include <sys/mman.h>
static int cb_will_need_one(const void *start, size_t len) {
    return madvise((void *)start, len, MADV_WILLNEED);
}
static int cb_release_pages(const void *start, size_t len) {
    return madvise((void *)start, len, MADV_DONTNEED);
}
#endif

#endif /* COLIBRI_OS_HINTS_H */
