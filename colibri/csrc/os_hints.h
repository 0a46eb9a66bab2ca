/* os_hints.h — the OS advice on an expert's pages, through the functions colibri._os resolved.
 *
 * Reading an expert before the layer loop reaches it, and dropping an evicted one, happen in the
 * expert cache's reader threads (expert_cache.h). The OS calls themselves are not looked up here:
 * colibri._os (ctypes) resolves them — libc's madvise on POSIX; kernel32's PrefetchVirtualMemory
 * (Windows 8+; absent: no prefetch) and VirtualUnlock on Windows — and hands their addresses to
 * the engine in a cb_os_advice, so one interface decides what runs (and a test can hand in a
 * recording function instead). Advice: a failure is counted, never fatal. Ranges are page-aligned
 * by the caller (the expert spans).
 */
#ifndef COLIBRI_OS_HINTS_H
#define COLIBRI_OS_HINTS_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32) && !defined(_WIN64)
#define CB_WINAPI __stdcall
#else
#define CB_WINAPI
#endif

enum { CB_ADVICE_NONE = 0, CB_ADVICE_MADVISE = 1, CB_ADVICE_WIN32 = 2 };   /* colibri._engine.ADVICE_CODES */

typedef struct {
    int kind;              /* CB_ADVICE_* */
    uintptr_t will_need;   /* madvise / PrefetchVirtualMemory; 0: no prefetch */
    uintptr_t release;     /* madvise / VirtualUnlock; 0: no release */
    int will_need_arg;     /* MADV_WILLNEED (madvise) */
    int release_arg;       /* MADV_DONTNEED (madvise) */
} cb_os_advice;

typedef int (*cb_madvise_fn)(void *addr, size_t len, int advice);
typedef struct { void *VirtualAddress; size_t NumberOfBytes; } cb_range_entry;   /* WIN32_MEMORY_RANGE_ENTRY */
typedef int (CB_WINAPI *cb_prefetch_vm_fn)(void *process, uintptr_t count, cb_range_entry *entries, uint32_t flags);
typedef int (CB_WINAPI *cb_virtual_unlock_fn)(void *addr, size_t len);
#define CB_CURRENT_PROCESS ((void *)(intptr_t)-1)   /* GetCurrentProcess()'s pseudo-handle */

static int cb_will_need_one(const cb_os_advice *a, const void *start, size_t len) {
    if (a->kind == CB_ADVICE_MADVISE && a->will_need)
        return ((cb_madvise_fn)a->will_need)((void *)start, len, a->will_need_arg);
    if (a->kind == CB_ADVICE_WIN32 && a->will_need) {
        cb_range_entry e = {(void *)start, len};
        return ((cb_prefetch_vm_fn)a->will_need)(CB_CURRENT_PROCESS, 1, &e, 0) ? 0 : -1;
    }
    return -1;
}

/* "These pages will be read soon", one call per `chunk` bytes at most (0: no limit): Linux reads
 * at most max(read_ahead_kb, max_sectors_kb) of a file per madvise(MADV_WILLNEED) and silently
 * skips the rest; colibri._os.prefetch_chunk() says how much. 0, or -1 if a call failed. */
static int cb_will_need(const cb_os_advice *a, const void *start, size_t len, size_t chunk) {
    int failed = 0;
    if (chunk == 0) chunk = len;
    for (size_t off = 0; off < len; off += chunk) {
        size_t n = len - off < chunk ? len - off : chunk;
        failed |= cb_will_need_one(a, (const char *)start + off, n) != 0;
    }
    return failed ? -1 : 0;
}

/* "These pages may leave the process": an expert the cache evicted. On Windows
 * VirtualUnlock of pages that are not locked removes them from the working set (it reports
 * ERROR_NOT_LOCKED): the documented way to trim a range. */
static int cb_release_pages(const cb_os_advice *a, const void *start, size_t len) {
    if (a->kind == CB_ADVICE_MADVISE && a->release)
        return ((cb_madvise_fn)a->release)((void *)start, len, a->release_arg);
    if (a->kind == CB_ADVICE_WIN32 && a->release) {
        ((cb_virtual_unlock_fn)a->release)((void *)start, len);
        return 0;
    }
    return -1;
}

#endif /* COLIBRI_OS_HINTS_H */
