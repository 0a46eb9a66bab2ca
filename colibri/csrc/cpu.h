/* cpu.h — which SIMD tier this CPU *and OS* support, decided once at import.
 *
 * CPUID says what the core implements; XGETBV (XCR0) says whether the OS saves the wider
 * registers on context switches. AVX needs XCR0 bits 1-2 (SSE, AVX state), AVX-512 also bits
 * 5-7 (opmask, ZMM_Hi256, Hi16_ZMM). Checking CPUID alone is the bug ggml's FIXME describes.
 * AMX (Intel Sapphire Rapids and later) needs bits 17-18 (XTILECFG, XTILEDATA), and on Linux
 * more: the kernel lends a process the 8 KB tile state only on request (_os.request_tile_data,
 * arch_prctl), which _kernels makes at import where the CPU and XCR0 allow it; the AVX-512 tier's
 * "amx" int step then runs the interleaved prompts on the tiles (kernels_amx.h), and
 * _kernels.amx_status() reports it (colibri info, the test suite's tier line).
 */
#ifndef COLIBRI_CPU_H
#define COLIBRI_CPU_H

#include <stdint.h>

#include "target.h"

enum { CB_ISA_SCALAR = 0, CB_ISA_AVX2 = 1, CB_ISA_AVX512 = 2 };

typedef struct {
    int avx2, fma, f16c;                               /* the AVX2 tier needs all three */
    int avx512f, avx512bw, avx512vl, avx512dq;         /* the AVX-512 tier needs these */
    int avx512_vnni, avx512_bf16, avx_vnni;            /* used where present */
    int amx_tile, amx_int8, amx_bf16;                  /* AMX tiles and their int8 / bf16 products: the
                                                          CPU's bits, usable only with os_amx and the
                                                          OS's loan (_kernels.amx_status) */
    int os_avx, os_avx512, os_amx;                     /* XCR0 says the OS saves the state */
} cb_cpu_features;

#if CB_X86
#if defined(_MSC_VER)
#include <intrin.h>
static void cb_cpuid(int leaf, int sub, int r[4]) { __cpuidex(r, leaf, sub); }
static uint64_t cb_xgetbv(void) { return _xgetbv(0); }
#else
#include <cpuid.h>
static void cb_cpuid(int leaf, int sub, int r[4]) {
    unsigned a, b, c, d;
    __cpuid_count(leaf, sub, a, b, c, d);
    r[0] = (int)a; r[1] = (int)b; r[2] = (int)c; r[3] = (int)d;
}
static uint64_t cb_xgetbv(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}
#endif
#endif

static cb_cpu_features cb_detect_cpu(void) {
    cb_cpu_features f = {0};
#if CB_X86
    int r[4];
    cb_cpuid(0, 0, r);
    int max_leaf = r[0];
    cb_cpuid(1, 0, r);
    int osxsave = (r[2] >> 27) & 1;
    f.fma = (r[2] >> 12) & 1;
    f.f16c = (r[2] >> 29) & 1;
    int avx = (r[2] >> 28) & 1;
    if (osxsave && avx) {
        uint64_t xcr0 = cb_xgetbv();
        f.os_avx = (xcr0 & 0x6) == 0x6;
        f.os_avx512 = f.os_avx && (xcr0 & 0xE0) == 0xE0;
        f.os_amx = (xcr0 & 0x60000) == 0x60000;
    }
    if (max_leaf >= 7) {
        cb_cpuid(7, 0, r);
        f.avx2 = (r[1] >> 5) & 1;
        f.avx512f = (r[1] >> 16) & 1;
        f.avx512dq = (r[1] >> 17) & 1;
        f.avx512bw = (r[1] >> 30) & 1;
        f.avx512vl = (r[1] >> 31) & 1;
        f.avx512_vnni = (r[2] >> 11) & 1;
        f.amx_bf16 = (r[3] >> 22) & 1;
        f.amx_tile = (r[3] >> 24) & 1;
        f.amx_int8 = (r[3] >> 25) & 1;
        cb_cpuid(7, 1, r);
        f.avx512_bf16 = (r[0] >> 5) & 1;
        f.avx_vnni = (r[0] >> 4) & 1;
    }
    if (!f.os_avx) { f.avx2 = f.fma = f.f16c = f.avx_vnni = 0; }
    if (!f.os_avx512) { f.avx512f = f.avx512bw = f.avx512vl = f.avx512dq = f.avx512_vnni = f.avx512_bf16 = 0; }
#endif
    return f;
}

/* The best tier the CPU and OS support. */
static int cb_best_isa(const cb_cpu_features *f) {
    if (f->avx2 && f->fma && f->f16c && f->avx512f && f->avx512bw && f->avx512vl && f->avx512dq)
        return CB_ISA_AVX512;
    if (f->avx2 && f->fma && f->f16c) return CB_ISA_AVX2;
    return CB_ISA_SCALAR;
}

#endif /* COLIBRI_CPU_H */
