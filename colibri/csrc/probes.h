/* probes.h — the machine's ceilings, for the benchmarks' rooflines (colibri/_probes.pyx): not
 * used by the engine.
 *
 * cb_read_bytes streams a buffer (the attainable read bandwidth that decode is held to);
 * cb_peak_* run 10 independent chains of one vector instruction per thread (enough to cover its
 * latency) and return the operations done, or -1 where this CPU or compiler cannot run them: the
 * float FMA at 256 and 512 bits, the AVX2 int8 step of the kernels without VNNI (maddubs + madd),
 * AVX512_BF16's vdpbf16ps (what bf16 products are held to) and 512-bit vpdpbusd (the wide int prefill
 * tile's step). The caller checks the CPU first.
 */
#ifndef COLIBRI_PROBES_H
#define COLIBRI_PROBES_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "target.h"

/* Streaming read of n bytes (a multiple of 64) split over threads. Returns a checksum so the loop
 * is not removed. */
static uint64_t cb_read_bytes(const void *p, size_t n, int n_threads) {
    const uint64_t *q = (const uint64_t *)p;
    long long words = (long long)(n / 8);
    uint64_t total = 0;
    #pragma omp parallel for schedule(static) num_threads(n_threads) reduction(+:total)
    for (long long i = 0; i < words; i += 8) {
        total += (q[i] ^ q[i + 1]) + (q[i + 2] ^ q[i + 3]) + (q[i + 4] ^ q[i + 5]) + (q[i + 6] ^ q[i + 7]);
    }
    return total;
}

#if CB_X86
#include <immintrin.h>

/* 8-lane FMAs: 16 float operations each. */
CB_TARGET_AVX2 static double cb_peak_fma_avx2(long long iters, int n_threads) {
    double total = 0.0;
    #pragma omp parallel num_threads(n_threads) reduction(+:total)
    {
        __m256 a[10];
        const __m256 m = _mm256_set1_ps(0.9999999f), c = _mm256_set1_ps(1e-7f);
        for (int k = 0; k < 10; k++) a[k] = _mm256_set1_ps(1.0f + k);
        for (long long i = 0; i < iters; i++)
            for (int k = 0; k < 10; k++) a[k] = _mm256_fmadd_ps(a[k], m, c);
        float lanes[8];
        __m256 s = a[0];
        for (int k = 1; k < 10; k++) s = _mm256_add_ps(s, a[k]);
        _mm256_storeu_ps(lanes, s);
        total += (double)(lanes[0] > 0.0f) * (double)iters * 10.0 * 8.0 * 2.0;
    }
    return total;
}

/* 16-lane FMAs: 32 float operations each (a core that splits 512-bit operations in two runs
 * these at the 256-bit rate). */
CB_TARGET_AVX512 static double cb_peak_fma_avx512(long long iters, int n_threads) {
    double total = 0.0;
    #pragma omp parallel num_threads(n_threads) reduction(+:total)
    {
        __m512 a[10];
        const __m512 m = _mm512_set1_ps(0.9999999f), c = _mm512_set1_ps(1e-7f);
        for (int k = 0; k < 10; k++) a[k] = _mm512_set1_ps(1.0f + k);
        for (long long i = 0; i < iters; i++)
            for (int k = 0; k < 10; k++) a[k] = _mm512_fmadd_ps(a[k], m, c);
        __m512 s = a[0];
        for (int k = 1; k < 10; k++) s = _mm512_add_ps(s, a[k]);
        total += (double)(_mm512_reduce_add_ps(s) > 0.0f) * (double)iters * 10.0 * 16.0 * 2.0;
    }
    return total;
}

/* The AVX2 int8 dot-product ceiling without VNNI: 32 byte products through maddubs, pairs to int32
 * through madd, one add — the multiplies of the kernels' int8 step (which adds a sign), which
 * share two pipes (tools/bench/int_steps.c). Each chain's sum is its next input's bytes, so
 * nothing hoists; 10 chains with 12 vectors live fit the 16 registers and cover the step's
 * latency, which is what the kernels' step itself reaches (fewer chains leave the pipes idle, more
 * spill, and an input of its own per chain would need 23 vectors live). 2 operations per product. */
CB_TARGET_AVX2 static double cb_peak_int8_avx2(long long iters, int n_threads) {
    double total = 0.0;
    #pragma omp parallel num_threads(n_threads) reduction(+:total)
    {
        __m256i acc[10];
        const __m256i w = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
        for (int k = 0; k < 10; k++) acc[k] = _mm256_set1_epi32(k);
        for (long long i = 0; i < iters; i++)
            for (int k = 0; k < 10; k++) acc[k] = _mm256_add_epi32(acc[k], _mm256_madd_epi16(_mm256_maddubs_epi16(w, acc[k]), ones));
        __m256i s = acc[0];
        for (int k = 1; k < 10; k++) s = _mm256_add_epi32(s, acc[k]);
        total += (double)(_mm256_extract_epi32(s, 0) != 12345) * (double)iters * 10.0 * 32.0 * 2.0;
    }
    return total;
}

/* vdpbf16ps: 32 bf16 products and their sums into 16 f32 lanes, 64 float operations each. 24
 * chains: the instruction's latency is longer than an FMA's, so the FMA loop's 10 chains would
 * not cover it and the probe would read below what the interleaved bf16 tile (16 accumulators)
 * reaches. */
CB_TARGET_AVX512_BF16 static double cb_peak_bf16_avx512(long long iters, int n_threads) {
    double total = 0.0;
    #pragma omp parallel num_threads(n_threads) reduction(+:total)
    {
        __m512 a[24];
        __m512bh w, x;
        const __m512i wi = _mm512_set1_epi16(0x3F80), xi = _mm512_set1_epi16(0x3380);   /* 1.0, ~6e-8 */
        memcpy(&w, &wi, sizeof w);
        memcpy(&x, &xi, sizeof x);
        for (int k = 0; k < 24; k++) a[k] = _mm512_set1_ps(1.0f + k);
        for (long long i = 0; i < iters; i++)
            for (int k = 0; k < 24; k++) a[k] = _mm512_dpbf16_ps(a[k], w, x);
        __m512 s = a[0];
        for (int k = 1; k < 24; k++) s = _mm512_add_ps(s, a[k]);
        total += (double)(_mm512_reduce_add_ps(s) > 0.0f) * (double)iters * 24.0 * 32.0 * 2.0;
    }
    return total;
}

/* 512-bit vpdpbusd (AVX512_VNNI): 64 byte products into 16 int32 lanes, 128 operations each — the
 * wide prefill tile's step (kernels_vnni.h, cb_igroup2_avx512vnni). */
CB_TARGET_AVX512_VNNI static double cb_peak_vnni_avx512(long long iters, int n_threads) {
    double total = 0.0;
    #pragma omp parallel num_threads(n_threads) reduction(+:total)
    {
        __m512i a[10];
        const __m512i u = _mm512_set1_epi8(3), x = _mm512_set1_epi8(-2);
        for (int k = 0; k < 10; k++) a[k] = _mm512_set1_epi32(k);
        for (long long i = 0; i < iters; i++)
            for (int k = 0; k < 10; k++) a[k] = _mm512_dpbusd_epi32(a[k], u, x);
        __m512i s = a[0];
        for (int k = 1; k < 10; k++) s = _mm512_add_epi32(s, a[k]);
        total += (double)(_mm512_reduce_add_epi32(s) != 12345) * (double)iters * 10.0 * 64.0 * 2.0;
    }
    return total;
}
#else
static double cb_peak_vnni_avx512(long long iters, int n_threads) { (void)iters; (void)n_threads; return -1.0; }
static double cb_peak_fma_avx2(long long iters, int n_threads) { (void)iters; (void)n_threads; return -1.0; }
static double cb_peak_fma_avx512(long long iters, int n_threads) { (void)iters; (void)n_threads; return -1.0; }
static double cb_peak_int8_avx2(long long iters, int n_threads) { (void)iters; (void)n_threads; return -1.0; }
static double cb_peak_bf16_avx512(long long iters, int n_threads) { (void)iters; (void)n_threads; return -1.0; }
#endif

#endif /* COLIBRI_PROBES_H */
