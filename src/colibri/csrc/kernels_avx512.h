/* kernels_avx512.h — the AVX-512 (F/BW/VL/DQ) tier, with VNNI where present.
 *
 * Float formats use 16-lane FMAs with masked loads for the tail (no scalar remainder). bf16
 * weights are widened to f32 by a shift and multiplied in f32: vdpbf16ps would need the
 * activations rounded to bf16 too, which costs accuracy and buys nothing in a memory-bound
 * matvec. Integer formats use vpdpbusd (AVX512_VNNI) on the sign trick of kernels_avx2.h:
 * sum(w * x) = sum(|w| * sign(x, w)), one instruction per 32 byte products.
 */
#ifndef COLIBRI_KERNELS_AVX512_H
#define COLIBRI_KERNELS_AVX512_H

#include "kernels_avx2.h"

#if CB_X86

#if defined(__GNUC__) || defined(__clang__)
#define CB_TARGET_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")))
#define CB_TARGET_AVX512_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#else
#define CB_TARGET_AVX512
#define CB_TARGET_AVX512_VNNI
#endif

CB_TARGET_AVX512 static float cb_dot_f32_avx512(const void *row, const float *x, const cb_act_q8 *a, int n) {
    const float *w = (const float *)row;
    (void)a;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16), _mm512_loadu_ps(x + i + 16), acc1);
    }
    for (; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        acc0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w + i), _mm512_maskz_loadu_ps(m, x + i), acc0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

CB_TARGET_AVX512 static float cb_dot_f16_avx512(const void *row, const float *x, const cb_act_q8 *a, int n) {
    const uint16_t *w = (const uint16_t *)row;
    (void)a;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + i))), _mm512_loadu_ps(x + i), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + i + 16))), _mm512_loadu_ps(x + i + 16), acc1);
    }
    for (; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        __m512 wv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, w + i));
        acc0 = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x + i), acc0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

CB_TARGET_AVX512 static inline __m512 cb_bf16x16_to_f32(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

CB_TARGET_AVX512 static float cb_dot_bf16_avx512(const void *row, const float *x, const cb_act_q8 *a, int n) {
    const uint16_t *w = (const uint16_t *)row;
    (void)a;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm512_fmadd_ps(cb_bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(w + i))), _mm512_loadu_ps(x + i), acc0);
        acc1 = _mm512_fmadd_ps(cb_bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(w + i + 16))), _mm512_loadu_ps(x + i + 16), acc1);
    }
    for (; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        __m512 wv = cb_bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, w + i));
        acc0 = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x + i), acc0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

/* int32 [8] partial sums of w[32] * x[32] with vpdpbusd (|w| as unsigned, sign moved onto x). */
CB_TARGET_AVX512_VNNI static inline __m256i cb_dot_i8x32_vnni(__m256i w, __m256i x) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

CB_TARGET_AVX512_VNNI static float cb_dot_int8_avx512(const void *row, const float *x, const cb_act_q8 *a, int n) {
    const cb_block_int8 *w = (const cb_block_int8 *)row;
    (void)x;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int nb = n / CB_QBLOCK, b = 0;
    for (; b + 2 <= nb; b += 2) {
        __m256i p0 = cb_dot_i8x32_vnni(_mm256_loadu_si256((const __m256i *)w[b].qs),
                                       _mm256_loadu_si256((const __m256i *)(a->q + b * CB_QBLOCK)));
        __m256i p1 = cb_dot_i8x32_vnni(_mm256_loadu_si256((const __m256i *)w[b + 1].qs),
                                       _mm256_loadu_si256((const __m256i *)(a->q + (b + 1) * CB_QBLOCK)));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(_cvtsh_ss(w[b].d) * a->d[b]), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(_cvtsh_ss(w[b + 1].d) * a->d[b + 1]), acc1);
    }
    for (; b < nb; b++) {
        __m256i p = cb_dot_i8x32_vnni(_mm256_loadu_si256((const __m256i *)w[b].qs),
                                      _mm256_loadu_si256((const __m256i *)(a->q + b * CB_QBLOCK)));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(_cvtsh_ss(w[b].d) * a->d[b]), acc0);
    }
    return cb_hsum256(_mm256_add_ps(acc0, acc1));
}

CB_TARGET_AVX512_VNNI static float cb_dot_int4_avx512(const void *row, const float *x, const cb_act_q8 *a, int n) {
    const cb_block_int4 *w = (const cb_block_int4 *)row;
    (void)x;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int nb = n / CB_QBLOCK, b = 0;
    for (; b + 2 <= nb; b += 2) {
        __m256i p0 = cb_dot_i8x32_vnni(cb_unpack_int4_avx2(w[b].qs),
                                       _mm256_loadu_si256((const __m256i *)(a->q + b * CB_QBLOCK)));
        __m256i p1 = cb_dot_i8x32_vnni(cb_unpack_int4_avx2(w[b + 1].qs),
                                       _mm256_loadu_si256((const __m256i *)(a->q + (b + 1) * CB_QBLOCK)));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(_cvtsh_ss(w[b].d) * a->d[b]), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(_cvtsh_ss(w[b + 1].d) * a->d[b + 1]), acc1);
    }
    for (; b < nb; b++) {
        __m256i p = cb_dot_i8x32_vnni(cb_unpack_int4_avx2(w[b].qs),
                                      _mm256_loadu_si256((const __m256i *)(a->q + b * CB_QBLOCK)));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(_cvtsh_ss(w[b].d) * a->d[b]), acc0);
    }
    return cb_hsum256(_mm256_add_ps(acc0, acc1));
}

#endif /* CB_X86 */
#endif /* COLIBRI_KERNELS_AVX512_H */
