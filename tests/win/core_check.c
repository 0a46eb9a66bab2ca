/* core_check.c — the C core built for Windows by MinGW and run under Wine (tests/test_windows_build.py).
 *
 *   cpu    what cb_detect_cpu finds, and the best tier (the test compares it with the Linux build's)
 *   tier   every tier and int step this CPU runs, against the scalar spec (cb_self_test_step:
 *          every format and layout through the drivers, attention with and without sinks, GLU)
 *   map    the OS path colibri._os and the engine take on a real file: CreateFileW,
 *          CreateFileMappingW + MapViewOfFile (read-only), PrefetchVirtualMemory and VirtualUnlock
 *          looked up with GetProcAddress and called through os_hints.h exactly as the engine's
 *          reader threads call them, K32QueryWorkingSetEx, UnmapViewOfFile
 *   alloc  VirtualAlloc (aligned to the allocation granularity, zeroed, writable), VirtualLock,
 *          VirtualUnlock (twice: the second reports ERROR_NOT_LOCKED, the code the working-set trim
 *          of colibri._os relies on), VirtualFree
 *
 * One line per part, "ok" or "FAIL <why>"; exit 0 when every part holds. Where Wine is known to
 * differ from Windows (it keeps no working set of its own), the line says what it saw instead of
 * asserting it.
 */
#include <stdio.h>
#include <windows.h>
#include <psapi.h>                 /* PSAPI_WORKING_SET_EX_INFORMATION (the function: GetProcAddress) */

#include "dispatch.h"
#include "test_steps.h"          /* the vnni-emulated step, installed as the tests do */
#include "os_hints.h"

#define PAGES 64
#define PAGE 4096

static int failures;

/* Wine exports wine_get_version from ntdll; Windows does not. */
static int running_on_wine(void) {
    return GetProcAddress(GetModuleHandleW(L"ntdll.dll"), "wine_get_version") != NULL;
}

static void part(const char *name, int ok, const char *detail) {
    printf("%s %s%s%s\n", name, ok ? "ok" : "FAIL", detail[0] ? " " : "", detail);
    failures += !ok;
}

static void check_tiers(void) {
    static const char *isa_names[] = {"scalar", "avx2", "avx512"};
    static const char *step_names[] = {"scalar", "avx2", "vnni_emulated", "avxvnni", "avx512vnni"};
    cb_cpu_features f = cb_detect_cpu();
    int best = cb_best_isa(&f);
    cb_int_kernels emulated;
    cb_test_steps_bind(cb_step_parts_of_kernels());
    if (cb_test_step_kernels(CB_INT_STEP_VNNI_EMULATED, &emulated) == 0)
        cb_install_int_step(CB_INT_STEP_VNNI_EMULATED, &emulated);
    printf("cpu best=%s avx2=%d fma=%d f16c=%d avx512f=%d avx512bw=%d avx512vl=%d avx512dq=%d "
           "avx512_vnni=%d avx_vnni=%d os_avx=%d os_avx512=%d\n", isa_names[best], f.avx2, f.fma, f.f16c,
           f.avx512f, f.avx512bw, f.avx512vl, f.avx512dq, f.avx512_vnni, f.avx_vnni, f.os_avx, f.os_avx512);
    for (int isa = CB_ISA_SCALAR; isa <= best; isa++) {
        char detail[256] = "";
        int ran = 0, ok = 1;
        for (int step = CB_INT_STEP_SCALAR; step <= CB_INT_STEP_AVX512VNNI; step++) {
            int r = cb_self_test_step(isa, step);
            if (r == -1) continue;                               /* not a step of this tier here */
            ran++;
            ok &= r == 0;
            snprintf(detail + strlen(detail), sizeof detail - strlen(detail), "%s%s%s",
                     ran > 1 ? "," : "", step_names[step], r == 0 ? "" : "(failed)");
        }
        char line[32];
        snprintf(line, sizeof line, "tier %s", isa_names[isa]);
        part(line, ran > 0 && ok, detail);
    }
}

static size_t resident_pages(const uint8_t *view, int pages) {
    typedef BOOL (WINAPI *query_fn)(HANDLE, PVOID, DWORD);
    query_fn query = (query_fn)(void (*)(void))GetProcAddress(GetModuleHandleW(L"kernel32.dll"),
                                                               "K32QueryWorkingSetEx");
    PSAPI_WORKING_SET_EX_INFORMATION info[PAGES];
    if (query == NULL || pages > PAGES) return (size_t)-1;
    for (int i = 0; i < pages; i++) info[i].VirtualAddress = (PVOID)(view + (size_t)i * PAGE);
    if (!query(GetCurrentProcess(), info, (DWORD)sizeof info[0] * pages)) return (size_t)-1;
    size_t n = 0;
    for (int i = 0; i < pages; i++) n += info[i].VirtualAttributes.Valid;
    return n;
}

static uint64_t checksum(const uint8_t *p, size_t n) {
    uint64_t s = 0;
    for (size_t i = 0; i < n; i++) s = s * 31u + p[i];
    return s;
}

static void check_mapping(void) {
    static uint8_t data[PAGES * PAGE];
    wchar_t dir[MAX_PATH], path[MAX_PATH];
    char detail[256];
    DWORD written = 0;
    for (size_t i = 0; i < sizeof data; i++) data[i] = (uint8_t)(i * 131u + (i >> 12));
    if (!GetTempPathW(MAX_PATH, dir) || !GetTempFileNameW(dir, L"cb", 0, path)) {
        part("map", 0, "GetTempFileNameW failed");
        return;
    }
    HANDLE w = CreateFileW(path, GENERIC_WRITE, 0, NULL, CREATE_ALWAYS, FILE_ATTRIBUTE_NORMAL, NULL);
    if (w == INVALID_HANDLE_VALUE || !WriteFile(w, data, sizeof data, &written, NULL) || written != sizeof data) {
        part("map", 0, "writing the test file failed");
        return;
    }
    CloseHandle(w);
    /* as colibri._os._windows.map_file opens it */
    HANDLE f = CreateFileW(path, GENERIC_READ, FILE_SHARE_READ | FILE_SHARE_DELETE, NULL, OPEN_EXISTING,
                           FILE_ATTRIBUTE_NORMAL, NULL);
    LARGE_INTEGER size = {0};
    HANDLE m = f == INVALID_HANDLE_VALUE ? NULL : CreateFileMappingW(f, NULL, PAGE_READONLY, 0, 0, NULL);
    const uint8_t *view = m ? (const uint8_t *)MapViewOfFile(m, FILE_MAP_READ, 0, 0, 0) : NULL;
    int sized = f != INVALID_HANDLE_VALUE && GetFileSizeEx(f, &size) && size.QuadPart == (LONGLONG)sizeof data;
    if (m) CloseHandle(m);                                       /* the view keeps the mapping alive */
    if (f != INVALID_HANDLE_VALUE) CloseHandle(f);
    if (view == NULL || !sized || ((uintptr_t)view & (PAGE - 1))) {
        part("map", 0, "CreateFileW/GetFileSizeEx/CreateFileMappingW/MapViewOfFile failed");
        DeleteFileW(path);
        return;
    }
    HMODULE k32 = GetModuleHandleW(L"kernel32.dll");
    cb_os_advice advice = {CB_ADVICE_WIN32, (uintptr_t)GetProcAddress(k32, "PrefetchVirtualMemory"),
                           (uintptr_t)GetProcAddress(k32, "VirtualUnlock"), 0, 0};
    /* the engine's calls: the whole range, then in chunks of three pages */
    int prefetched = advice.will_need == 0 ? -2 : cb_will_need(&advice, view, sizeof data, 0) == 0 &&
                                                   cb_will_need(&advice, view, sizeof data, 3 * PAGE) == 0;
    int read_ok = checksum(view, sizeof data) == checksum(data, sizeof data);
    size_t before = resident_pages(view, PAGES);
    SetLastError(0);
    int released = advice.release != 0 && cb_release_pages(&advice, view, sizeof data) == 0;
    DWORD release_code = GetLastError();
    size_t after = resident_pages(view, PAGES);
    int reread_ok = checksum(view, sizeof data) == checksum(data, sizeof data);  /* a trimmed page comes back */
    int unmapped = UnmapViewOfFile(view) != 0;
    int deleted = DeleteFileW(path) != 0;
    snprintf(detail, sizeof detail, "prefetch=%s resident_before=%d resident_after_trim=%d trim_error=%lu",
             prefetched == -2 ? "missing" : prefetched ? "ok" : "failed", (int)before, (int)after,
             (unsigned long)release_code);
    part("map", prefetched == 1 && read_ok && released && (release_code == 0 || release_code == ERROR_NOT_LOCKED) &&
                reread_ok && unmapped && deleted && before != (size_t)-1, detail);
}

static void check_alloc(void) {
    SYSTEM_INFO si;
    char detail[160];
    GetSystemInfo(&si);
    const size_t bytes = 1u << 20;
    uint8_t *p = (uint8_t *)VirtualAlloc(NULL, bytes, MEM_COMMIT | MEM_RESERVE, PAGE_READWRITE);
    if (p == NULL) {
        part("alloc", 0, "VirtualAlloc failed");
        return;
    }
    int aligned = ((uintptr_t)p % si.dwAllocationGranularity) == 0 && si.dwPageSize == PAGE;
    int zero = 1;
    for (size_t i = 0; i < bytes; i += 997) zero &= p[i] == 0;
    memset(p, 0x5a, bytes);
    int written = p[0] == 0x5a && p[bytes - 1] == 0x5a;
    int locked = VirtualLock(p, 2 * PAGE) != 0;
    int unlocked = VirtualUnlock(p, 2 * PAGE) != 0;
    SetLastError(0);
    int again = VirtualUnlock(p, 2 * PAGE);                       /* not locked now */
    DWORD again_code = GetLastError();
    int freed = VirtualFree(p, 0, MEM_RELEASE) != 0;
    /* Windows: unlocking pages that are not locked fails with ERROR_NOT_LOCKED (and trims them);
     * Wine's VirtualUnlock succeeds, so there the line only reports it. */
    int not_locked = !again && again_code == ERROR_NOT_LOCKED;
    snprintf(detail, sizeof detail, "granularity=%lu page=%lu second_unlock=%s%s",
             (unsigned long)si.dwAllocationGranularity, (unsigned long)si.dwPageSize,
             not_locked ? "ERROR_NOT_LOCKED" : again ? "succeeded" : "failed",
             running_on_wine() ? " (wine)" : "");
    part("alloc", aligned && zero && written && locked && unlocked && (not_locked || running_on_wine()) && freed,
         detail);
}

int main(void) {
    cb_init_tables();                                            /* as colibri._kernels does at import */
    check_tiers();
    check_mapping();
    check_alloc();
    return failures == 0 ? 0 : 1;
}
