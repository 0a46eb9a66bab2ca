/* kernels_avx2.h — the AVX2 + FMA + F16C tier (same signatures as the scalar reference).
 *
 * Compiled with per-function target attributes so the baseline build stays plain x86-64; these
 * functions run only when cpu.h found the features (and the OS support) at import. Integer
 * formats use the sign trick: sum(w * x) = sum(|w| * sign(x, w)), so the unsigned-by-signed
 * byte multiply (vpmaddubsw) applies to signed weights; |w| <= 127 keeps the int16 pair sums
 * exact (2 * 127 * 127 < 32767).
 */
#ifndef COLIBRI_KERNELS_AVX2_H
#define COLIBRI_KERNELS_AVX2_H

#include "target.h"           /* CB_X86, CB_ALWAYS_INLINE, CB_TARGET_* */
#include "kernels_scalar.h"
#include "avx2_int.h"         /* the integer helpers it shares with the VNNI bodies */

#if CB_X86
#include <immintrin.h>

CB_TARGET_AVX2 static inline float cb_hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

CB_TARGET_AVX2 static inline float cb_hmax256(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

CB_TARGET_AVX2 static inline __m256 cb_bf16x8_to_f32(const uint16_t *p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

/* 8 weights from element i of a row stored as f32 / f16 / bf16, as floats. */
CB_TARGET_AVX2 static inline __m256 cb_load_f32x8_avx2(const char *row, int dtype, int i) {
    if (dtype == CB_F32) return _mm256_loadu_ps((const float *)row + i);
    if (dtype == CB_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
    return cb_bf16x8_to_f32((const uint16_t *)row + i);
}

/* Float tile: out[j * ldo] = row . x_j for T in 1..4 tokens (x_j = x + j * ldx) of one weight
 * row. Per token two accumulators (elements i..i+7 and i+8..i+15 of each 16), then the scalar
 * tail: T = 1 is the decode dot product, so prefill and decode agree bit for bit. The weights
 * are converted once for the T tokens. */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_tile_float_avx2(float *out, int ldo, const char *row, int dtype, const float *x, int ldx, int n, const int T) {
    __m256 acc0[4], acc1[4];
    for (int j = 0; j < T; j++) acc0[j] = acc1[j] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 w0 = cb_load_f32x8_avx2(row, dtype, i), w1 = cb_load_f32x8_avx2(row, dtype, i + 8);
        for (int j = 0; j < T; j++) {
            const float *xj = x + (size_t)j * ldx;
            acc0[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xj + i), acc0[j]);
            acc1[j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xj + i + 8), acc1[j]);
        }
    }
    for (int j = 0; j < T; j++) {
        const float *xj = x + (size_t)j * ldx;
        float acc = cb_hsum256(_mm256_add_ps(acc0[j], acc1[j]));
        for (int k = i; k < n; k++) acc += cb_load_f32_scalar(row, dtype, k) * xj[k];
        out[(size_t)j * ldo] = acc;
    }
}

CB_TARGET_AVX2 static float cb_dot_f32_avx2(const void *row, const float *x, const cb_act_q8 *a, int n) {
    float out;
    (void)a;
    cb_tile_float_avx2(&out, 1, (const char *)row, CB_F32, x, 0, n, 1);
    return out;
}

CB_TARGET_AVX2 static float cb_dot_f16_avx2(const void *row, const float *x, const cb_act_q8 *a, int n) {
    float out;
    (void)a;
    cb_tile_float_avx2(&out, 1, (const char *)row, CB_F16, x, 0, n, 1);
    return out;
}

CB_TARGET_AVX2 static float cb_dot_bf16_avx2(const void *row, const float *x, const cb_act_q8 *a, int n) {
    float out;
    (void)a;
    cb_tile_float_avx2(&out, 1, (const char *)row, CB_BF16, x, 0, n, 1);
    return out;
}

/* cb_quantize_act_scalar with 8 lanes: the same float operations (amax, d = amax / 127, x * (1/d))
 * and the same rounding (cvtps_epi32 and lrintf both round to nearest even in the default mode),
 * so the same bytes. Vectorised because every integer product quantizes its input first, and an
 * lrintf call per element would make it a sizeable share of a small expert's matvec. */
CB_TARGET_AVX2 static void cb_quantize_act_avx2(cb_act_q8 *a, const float *x, int n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < n / CB_QBLOCK; b++) {
        const float *xb = x + b * CB_QBLOCK;
        __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float amax = _mm_cvtss_f32(m4);
        float d = amax >= CB_ACT_TINY ? amax / 127.0f : 0.0f;
        float id = d > 0.0f ? 1.0f / d : 0.0f;
        a->d[b] = d;
        __m256 s = _mm256_set1_ps(id);
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, s)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, s));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, s)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, s));
        /* int32 -> int8 with packs (in-lane), then undo the lane interleaving */
        __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
        __m256i p = _mm256_packs_epi16(p01, p23);
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(a->q + b * CB_QBLOCK), p);
        /* the block's sum of q (pairs against 1, then the 8 int32 lanes): every kernel with
         * unsigned weights takes off 8 or 128 times it (cb_act_q8.s) */
        __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), p), _mm256_set1_epi16(1));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        a->s[b] = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
        __m128i h4 = _mm256_castsi256_si128(s32);                 /* lanes 0..3: elements 0..15 */
        h4 = _mm_add_epi32(h4, _mm_shuffle_epi32(h4, 0x4E));
        const int32_t half = _mm_cvtsi128_si32(_mm_add_epi32(h4, _mm_shuffle_epi32(h4, 0xB1)));
        a->nl4_off[2 * b] = -CB_NL4_OFFSET * half;
        a->nl4_off[2 * b + 1] = -CB_NL4_OFFSET * (a->s[b] - half);
    }
    a->n = n;
}

/* int32 [8] partial sums of w[32] * x[32] (signed bytes, |w| <= 127), sign trick + maddubs. */
CB_TARGET_AVX2 static inline __m256i cb_dot_i8x32_avx2(__m256i w, __m256i x) {
    __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

/* int4 block -> 32 signed bytes in [-8, 7], element order 0..31: the 16 bytes go to both halves
 * of a ymm, the upper half shifted right by 4 (elements 16..31 are the high nibbles). */
CB_TARGET_AVX2 static inline __m256i cb_unpack_int4_avx2(const uint8_t *qs) {
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    v = _mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0));
    return _mm256_sub_epi8(_mm256_and_si256(v, _mm256_set1_epi8(0x0F)), _mm256_set1_epi8(8));
}

/* mxfp4 block -> 32 signed bytes, its doubled e2m1 values (cb_mxfp4_int) in element order: the
 * low nibbles (even elements) and high nibbles (odd) through one byte shuffle each, then
 * interleaved back. */
CB_TARGET_AVX2 static inline __m256i cb_unpack_mxfp4_avx2(const uint8_t *qs) {
    const __m128i lut = _mm_loadu_si128((const __m128i *)cb_mxfp4_int), m4 = _mm_set1_epi8(0x0F);
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(raw, m4));
    const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(raw, 4), m4));
    return _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
}

/* One block of int8 / int4 / mxfp4 weights as 32 signed bytes, and its scale. */
CB_TARGET_AVX2 static inline __m256i cb_load_qblock_avx2(const char *row, int dtype, int b, float *d) {
    if (dtype == CB_MXFP4) {
        const cb_block_mxfp4 *blk = (const cb_block_mxfp4 *)row + b;
        *d = cb_e8m0_half(blk->e);
        return cb_unpack_mxfp4_avx2(blk->qs);
    }
    if (dtype == CB_INT8) {
        const cb_block_int8 *blk = (const cb_block_int8 *)row + b;
        *d = _cvtsh_ss(blk->d);
        return _mm256_loadu_si256((const __m256i *)blk->qs);
    }
    const cb_block_int4 *blk = (const cb_block_int4 *)row + b;
    *d = _cvtsh_ss(blk->d);
    return cb_unpack_int4_avx2(blk->qs);
}

/* acc += (w . x of block b) * (dw * dx): the step every integer product below is made of. */
CB_TARGET_AVX2 static inline __m256 cb_qblock_fma_avx2(__m256 acc, __m256i wq, float dw, const cb_act_q8 *a, int b) {
    __m256i xq = _mm256_loadu_si256((const __m256i *)(a->q + b * CB_QBLOCK));
    __m256 p = _mm256_cvtepi32_ps(cb_dot_i8x32_avx2(wq, xq));
    return _mm256_fmadd_ps(p, _mm256_set1_ps(dw * a->d[b]), acc);
}

/* Integer tile: out[j * ldo] = row . token j for T in 1..4 tokens of one weight row, the blocks
 * accumulated in order into one accumulator per token. The weight block is loaded (and for int4
 * unpacked) once for the T tokens: the prefill gain. T = 1 is the decode dot product, so prefill
 * and decode agree bit for bit. One accumulator, not two (even and odd blocks): decode is bound
 * by the weights' reads, not by the accumulator's latency, so a second chain only adds work. */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_tile_quant_avx2(float *out, int ldo, const char *row, int dtype, const cb_act_q8 *acts, int cols, const int T) {
    __m256 acc[4];
    for (int j = 0; j < T; j++) acc[j] = _mm256_setzero_ps();
    const int nb = cols / CB_QBLOCK;
    float d;
    for (int b = 0; b < nb; b++) {
        __m256i wq = cb_load_qblock_avx2(row, dtype, b, &d);
        for (int j = 0; j < T; j++) acc[j] = cb_qblock_fma_avx2(acc[j], wq, d, &acts[j], b);
    }
    for (int j = 0; j < T; j++) out[(size_t)j * ldo] = cb_hsum256(acc[j]);
}

CB_TARGET_AVX2 static float cb_dot_int8_avx2(const void *row, const float *x, const cb_act_q8 *a, int n) {
    float out;
    (void)x;
    cb_tile_quant_avx2(&out, 1, (const char *)row, CB_INT8, a, n, 1);
    return out;
}

CB_TARGET_AVX2 static float cb_dot_int4_avx2(const void *row, const float *x, const cb_act_q8 *a, int n) {
    float out;
    (void)x;
    cb_tile_quant_avx2(&out, 1, (const char *)row, CB_INT4, a, n, 1);
    return out;
}

CB_TARGET_AVX2 static float cb_dot_mxfp4_avx2(const void *row, const float *x, const cb_act_q8 *a, int n) {
    float out;
    (void)x;
    cb_tile_quant_avx2(&out, 1, (const char *)row, CB_MXFP4, a, n, 1);
    return out;
}

CB_TARGET_AVX2 static void cb_tile_quant_avx2_any(float *out, int ldo, const char *w, size_t stride, int dtype,
                                                  const float *x, int ldx, const cb_act_q8 *acts, int cols,
                                                  int R, int T) {
    (void)x; (void)ldx; (void)stride; (void)R;
#define CB_CALL_Q2(dt, t) cb_tile_quant_avx2(out, ldo, w, dt, acts, cols, t)
    if (dtype == CB_INT8) { CB_AVX2_T_CASES(CB_CALL_Q2, CB_INT8) }
    else if (dtype == CB_MXFP4) { CB_AVX2_T_CASES(CB_CALL_Q2, CB_MXFP4) }
    else { CB_AVX2_T_CASES(CB_CALL_Q2, CB_INT4) }
#undef CB_CALL_Q2
}

CB_TARGET_AVX2 static void cb_tile_float_avx2_any(float *out, int ldo, const char *w, size_t stride, int dtype,
                                                  const float *x, int ldx, const cb_act_q8 *acts, int cols,
                                                  int R, int T) {
    (void)acts; (void)stride; (void)R;
#define CB_CALL_F2(dt, t) cb_tile_float_avx2(out, ldo, w, dt, x, ldx, cols, t)
    if (dtype == CB_F32) { CB_AVX2_T_CASES(CB_CALL_F2, CB_F32) }
    else if (dtype == CB_F16) { CB_AVX2_T_CASES(CB_CALL_F2, CB_F16) }
    else { CB_AVX2_T_CASES(CB_CALL_F2, CB_BF16) }
#undef CB_CALL_F2
}

/* ---- the FFN activation --------------------------------------------------------------------
 *
 * exp(x) for x in [-87.3, 88.3] (clamped there: no denormal or infinite results), Cephes' expf:
 * x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so r is exact to float precision), e^r by
 * a degree-6 polynomial, 2^n through the exponent bits. About 1 ulp against expf. SiLU is then
 * x / (1 + e^-x), and the tanh GELU x * sigmoid(2u) = x / (1 + e^-2u), u = sqrt(2/pi)(x + 0.044715 x^3)
 * (0.5 (1 + tanh u) = sigmoid(2u)): 8 lanes at a time instead of one libm call per element (the
 * GLU runs over every expert's intermediate activations). */
#define CB_LN_SMALLEST_NORMAL -87.3365448f   /* ln(FLT_MIN): an exp below it is taken as 0 */

/* The exp's operations on a vector of W (_mm256 or _mm512) lanes, written once: the AVX-512 tier's
 * cb_exp_avx512 is the same arithmetic lane by lane, so the same bits. VT is the float vector type,
 * ROUND(v) rounds to the nearest integer, CASTI reinterprets the exponent bits as floats. */
#define CB_EXP_BODY(W, VT, ROUND, CASTI)                                                             \
    {                                                                                              \
        x = W##_min_ps(W##_max_ps(x, W##_set1_ps(-87.3f)), W##_set1_ps(88.3f));                    \
        const VT n = ROUND(W##_mul_ps(x, W##_set1_ps(1.44269504088896341f)));                      \
        VT r = W##_fnmadd_ps(n, W##_set1_ps(0.693359375f), x);                                     \
        r = W##_fnmadd_ps(n, W##_set1_ps(-2.12194440e-4f), r);                                     \
        VT p = W##_set1_ps(1.9875691500e-4f);                                                      \
        p = W##_fmadd_ps(p, r, W##_set1_ps(1.3981999507e-3f));                                     \
        p = W##_fmadd_ps(p, r, W##_set1_ps(8.3334519073e-3f));                                     \
        p = W##_fmadd_ps(p, r, W##_set1_ps(4.1665795894e-2f));                                     \
        p = W##_fmadd_ps(p, r, W##_set1_ps(1.6666665459e-1f));                                     \
        p = W##_fmadd_ps(p, r, W##_set1_ps(5.0000001201e-1f));                                     \
        p = W##_fmadd_ps(p, W##_mul_ps(r, r), W##_add_ps(r, W##_set1_ps(1.0f)));                   \
        return W##_mul_ps(p, CASTI(W##_slli_epi32(W##_add_epi32(W##_cvtps_epi32(n), W##_set1_epi32(127)), 23))); \
    }
#define CB_ROUND_NEAREST256(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
CB_TARGET_AVX2 static inline __m256 cb_exp_avx2(__m256 x) CB_EXP_BODY(_mm256, __m256, CB_ROUND_NEAREST256, _mm256_castsi256_ps)

/* act(x) * u of 8 lanes. */
CB_TARGET_AVX2 static inline __m256 cb_glu8_avx2(__m256 x, __m256 u, int act) {
    __m256 z = _mm256_sub_ps(_mm256_setzero_ps(), x);                           /* -x */
    if (act == CB_ACT_GELU_TANH) {                                              /* -2u */
        const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
        z = _mm256_mul_ps(_mm256_set1_ps(-2.0f * 0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
    }
    return _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), cb_exp_avx2(z))), u);
}

/* The last n % 8 elements go through the same 8-lane arithmetic (padded), so an element's result
 * does not depend on where a thread's rows start: the fused activation of cb_matmul_jobs gives
 * the same bits for any split, and prefill equals decode. */
CB_TARGET_AVX2 static void cb_glu_avx2(float *gate, const float *up, int n, int act) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(gate + i, cb_glu8_avx2(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i), act));
    if (i < n) {
        float g[8] = {0}, u[8] = {0};
        memcpy(g, gate + i, sizeof(float) * (size_t)(n - i));
        memcpy(u, up + i, sizeof(float) * (size_t)(n - i));
        _mm256_storeu_ps(g, cb_glu8_avx2(_mm256_loadu_ps(g), _mm256_loadu_ps(u), act));
        memcpy(gate + i, g, sizeof(float) * (size_t)(n - i));
    }
}

/* ---- the transposed layout (kernels_scalar.h, quant.h) ---------------------------------------
 *
 * Float formats: an axpy per input row into the outputs [o0, o1) of T tokens, which stay in L1
 * (out); per output lane the products are added in input order, so any T gives the same bits.
 * Integer formats: per input block, one group of 8 outputs at a time: 8 integer block sums reduced
 * into one vector of 8 (hadd tree), their 8 scales converted in one instruction, one FMA into the
 * 8 outputs. int4 multiplies the unsigned nibbles (0..15) and subtracts 8 * sum(x) of the block
 * afterwards (exact in int32): no sign trick, and a 32-byte load covers two outputs. */

/* One pass of the float transposed tile: input rows i .. i+U-1 added, in order, into the outputs
 * [o0, o1) of T tokens; each output vector is loaded and stored once per pass. */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_ttile_float_pass_avx2(float *out, int ldo, const char *w, size_t stride, int dtype, const float *x, int ldx,
                         int i, int o0, int o1, const int U, const int T) {
    const char *wrow = w + (size_t)i * stride;
    const int ov = o0 + (o1 - o0) / 8 * 8;
    for (int o = o0; o < ov; o += 8) {
        __m256 wv[4];
        for (int u = 0; u < U; u++) wv[u] = cb_load_f32x8_avx2(wrow + (size_t)u * stride, dtype, o);
        for (int j = 0; j < T; j++) {
            float *y = out + (size_t)j * ldo + o;
            const float *xj = x + (size_t)j * ldx + i;
            __m256 acc = _mm256_loadu_ps(y);
            for (int u = 0; u < U; u++) acc = _mm256_fmadd_ps(wv[u], _mm256_broadcast_ss(xj + u), acc);
            _mm256_storeu_ps(y, acc);
        }
    }
    for (int o = ov; o < o1; o++)
        for (int j = 0; j < T; j++) {
            float *y = out + (size_t)j * ldo + o;
            for (int u = 0; u < U; u++)
                *y = fmaf(cb_load_f32_scalar(wrow + (size_t)u * stride, dtype, o), x[(size_t)j * ldx + i + u], *y);
        }
}

CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_ttile_float_avx2(float *out, int ldo, const char *w, int dtype, const float *x, int ldx,
                    int rows, int cols, int o0, int o1, const int T) {
    /* 4 input rows per pass over the outputs (a store per row would make the weight loads wait on
     * 4K-aliased stores), the last cols % 4 one at a time */
    const size_t stride = cb_row_stride(dtype, rows);
    for (int j = 0; j < T; j++) memset(out + (size_t)j * ldo + o0, 0, sizeof(float) * (size_t)(o1 - o0));
    int i = 0;
    for (; i + 4 <= cols; i += 4) cb_ttile_float_pass_avx2(out, ldo, w, stride, dtype, x, ldx, i, o0, o1, 4, T);
    for (; i < cols; i++) cb_ttile_float_pass_avx2(out, ldo, w, stride, dtype, x, ldx, i, o0, o1, 1, T);
}

/* The 8 int32 block sums of an int8 group against T tokens' activation blocks xq[j]. */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_group_sums_int8_avx2(__m256i *isum, const cb_group_int8 *g, const __m256i *xq, const int T) {
    __m256i quad[2][4];
    for (int h = 0; h < 2; h++) {                       /* outputs 4h .. 4h+3 */
        __m256i pair[2][4];
        for (int p = 0; p < 2; p++) {
            const int r = 4 * h + 2 * p;
            __m256i wa = _mm256_loadu_si256((const __m256i *)g->qs[r]);
            __m256i wb = _mm256_loadu_si256((const __m256i *)g->qs[r + 1]);
            __m256i aa = _mm256_sign_epi8(wa, wa), ab = _mm256_sign_epi8(wb, wb);
            for (int j = 0; j < T; j++) {
                __m256i sa = _mm256_madd_epi16(_mm256_maddubs_epi16(aa, _mm256_sign_epi8(xq[j], wa)), _mm256_set1_epi16(1));
                __m256i sb = _mm256_madd_epi16(_mm256_maddubs_epi16(ab, _mm256_sign_epi8(xq[j], wb)), _mm256_set1_epi16(1));
                pair[p][j] = _mm256_hadd_epi32(sa, sb);
            }
        }
        /* [r0 r1 r2 r3 (lanes 0-3 of each) | r0 r1 r2 r3 (lanes 4-7)] */
        for (int j = 0; j < T; j++) quad[h][j] = _mm256_hadd_epi32(pair[0][j], pair[1][j]);
    }
    for (int j = 0; j < T; j++)
        isum[j] = _mm256_add_epi32(_mm256_permute2x128_si256(quad[0][j], quad[1][j], 0x20),
                                   _mm256_permute2x128_si256(quad[0][j], quad[1][j], 0x31));
}

/* The 8 int32 block sums of an int4 group: nibbles (0..15) times x, minus 8 * sum(x) (xoff[j]). */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_group_sums_int4_avx2(__m256i *isum, const cb_group_int4 *g, const __m256i *xlo, const __m256i *xhi,
                        const __m256i *xoff, const int T) {
    const __m256i one = _mm256_set1_epi16(1);
    __m256i lo[4], hi[4];
    cb_unpack_group_int4_avx2(lo, hi, g);
    for (int j = 0; j < T; j++) {
        __m256i s[4];
        for (int c = 0; c < 4; c++) {
            __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo[c], xlo[j]), _mm256_maddubs_epi16(hi[c], xhi[j]));
            s[c] = _mm256_madd_epi16(p, one);
        }
        isum[j] = cb_int4_group_reduce_avx2(s, xoff[j]);
    }
}


/* y[j * ldo + 0..7] += group grp (of block b) . token j, for T tokens: the step every transposed
 * integer product is made of (the sums first, then the 8 outputs loaded: fewer live registers). */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_tq_group_avx2(float *y, int ldo, const char *grp, int dtype, const cb_tq_block *b, const int T) {
    __m256i isum[4];
    if (dtype == CB_INT8) cb_group_sums_int8_avx2(isum, (const cb_group_int8 *)grp, b->xq, T);
    else cb_group_sums_int4_avx2(isum, (const cb_group_int4 *)grp, b->xlo, b->xhi, b->xoff, T);
    cb_tq_scale_add_avx2(y, ldo, grp, isum, b, T);
}

CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_ttile_quant_avx2(float *out, int ldo, const char *w, int dtype, const cb_act_q8 *acts,
                    int rows, int cols, int o0, int o1, const int T) {
    CB_TTILE_QUANT_BODY(cb_tq_group_avx2, 0)
}

/* The table's transposed entry: the format and T in 1..4 select a specialised body. */
CB_TARGET_AVX2 static void cb_ttile_avx2_any(float *out, int ldo, const char *w, int dtype, const float *x,
                                             int ldx, const cb_act_q8 *acts, int rows, int cols, int o0,
                                             int o1, int T) {
#define CB_CALL_TQ(dt, t) cb_ttile_quant_avx2(out, ldo, w, dt, acts, rows, cols, o0, o1, t)
#define CB_CALL_TF(dt, t) cb_ttile_float_avx2(out, ldo, w, dt, x, ldx, rows, cols, o0, o1, t)
    switch (dtype) {
    case CB_INT8: CB_AVX2_T_CASES(CB_CALL_TQ, CB_INT8) break;
    case CB_INT4: CB_AVX2_T_CASES(CB_CALL_TQ, CB_INT4) break;
    case CB_F32: CB_AVX2_T_CASES(CB_CALL_TF, CB_F32) break;
    case CB_F16: CB_AVX2_T_CASES(CB_CALL_TF, CB_F16) break;
    default: CB_AVX2_T_CASES(CB_CALL_TF, CB_BF16) break;
    }
#undef CB_CALL_TQ
#undef CB_CALL_TF
}

/* ---- prefill of the integer transposed layout: a repacked chunk --------------------------------
 *
 * A prompt multiplies every weight by many tokens, so the prefill first repacks a chunk of groups
 * into an order in which one 32-byte vector holds 4 consecutive inputs of each of the 8 outputs
 * (vector c of block kb: bytes 4r..4r+3 are output r's inputs 4c..4c+3 — an 8 x 8 transpose of
 * dwords). Four activation bytes broadcast against it give the 8 outputs' partial sums in their
 * own int32 lanes, so no horizontal sums (the stored order needs a 9-instruction hadd tree per
 * group and token), and a group's 8 outputs of T tokens stay in registers across every block.
 * int4 is repacked as unsigned nibble bytes (0..15): no sign trick, and a block's 8 maddubs add
 * up in int16 before one madd (|sum| <= 8 * 2 * 15 * 127 = 30480 < 2^15); 8 * sum(x) is taken
 * off as in the stored-order kernel. The int32 block sums are exact, and every block is scaled
 * and added in the same order as in cb_ttile_quant_avx2: prefill still equals decode bit for bit.
 *
 * Packed block (CB_TPACK_BLOCK_BYTES, quant.h): float scales [8], then int8 / nibble bytes
 * [8 vectors][8 outputs][4]. Scratch of a chunk (cb_tprefill_bytes): the int32 activation sums
 * [n][nb] (8 * sum(x), int4 only here; rounded up to 64 bytes), then packed blocks [groups of the
 * chunk][nb]. kernels_vnni.h has the same kernel with a VNNI step. */

/* A register the compiler must materialise here: GCC otherwise regroups the chain of integer adds
 * of a block (they are associative) into one tree at its end, keeping all 32 products of 4 tokens
 * live and spilling them to the stack. */
/* CB_NO_HOIST(p): the pointer p as the compiler cannot follow it, so loads through it stay where
 * they are written (GCC hoisted a row loop's 16 invariant query vectors into 16 registers and
 * spilled the rest of the loop). Neither is needed for the bits, only for the speed. */
#if defined(__GNUC__)
#define CB_IN_ORDER(v) __asm__("" : "+x"(v))
#define CB_NO_HOIST(p) __asm__("" : "+r"(p))
#else
#define CB_IN_ORDER(v) ((void)0)
#define CB_NO_HOIST(p) ((void)0)
#endif

/* r[c] = dword c of each of r[0..7]: the 8 x 8 transpose of 32-bit elements. */
CB_TARGET_AVX2 static inline void cb_transpose8x8_epi32(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {       /* pairs of rows: dwords 0,1 | 4,5 and 2,3 | 6,7 interleaved */
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {       /* 4 rows per 128-bit lane: u[4i + k] holds dwords k | k + 4 */
        u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int k = 0; k < 4; k++) {       /* rows 0-3 and 4-7 of dword k, then of dword k + 4 */
        r[k] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x20);
        r[k + 4] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x31);
    }
}

/* One stored group (cb_group_int8 / cb_group_int4) as a packed block; int8 as w + 128 (unsigned)
 * when `unsigned_int8` (the VNNI kernels). */
CB_TARGET_AVX2 static inline void cb_tpack_group_avx2(uint8_t *dst, const char *grp, int dtype, int unsigned_int8) {
    __m256i r[8];
    _mm256_storeu_ps((float *)dst, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)grp)));
    if (dtype == CB_INT8) {
        const cb_group_int8 *g = (const cb_group_int8 *)grp;
        const __m256i flip = _mm256_set1_epi8(unsigned_int8 ? (char)0x80 : 0);   /* q ^ 0x80 = q + 128 */
        for (int o = 0; o < 8; o++) r[o] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)g->qs[o]), flip);
    } else {
        const cb_group_int4 *g = (const cb_group_int4 *)grp;
        const __m128i m4 = _mm_set1_epi8(0x0F);
        for (int o = 0; o < 8; o++) {    /* elements 0..15 (low nibbles), then 16..31 (high) */
            __m128i v = _mm_loadu_si128((const __m128i *)g->qs[o]);
            r[o] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(v, m4)),
                                           _mm_and_si128(_mm_srli_epi16(v, 4), m4), 1);
        }
    }
    cb_transpose8x8_epi32(r);
    for (int c = 0; c < 8; c++) _mm256_storeu_si256((__m256i *)(dst + 32 + 32 * c), r[c]);
}

/* out[j * ldo + 0..7] (+)= one group's 8 outputs for T tokens over its blocks kb0..kb1-1, packed
 * at pk (block kb0 first); kb0 == 0 starts from zero, otherwise the sums in out continue.
 * xsum8 [T][nb] (row stride nb): 8 * sum of token j's quantized block kb (int4 only). The
 * activation pointers are copied to locals first: out is stored through a float pointer the
 * compiler must otherwise assume may alias them (int8_t is a character type), and it reloaded
 * them after every store. */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_tpacked_group_avx2(float *out, int ldo, const uint8_t *pk, int dtype, const cb_act_q8 *acts,
                      const int32_t *xsum8, int nb, int kb0, int kb1, const int T) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t *xq[4];
    const float *xd[4];
    __m256 acc[4];
    for (int j = 0; j < T; j++) {
        xq[j] = acts[j].q;
        xd[j] = acts[j].d;
        acc[j] = kb0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out + (size_t)j * ldo);
    }
    for (int kb = kb0; kb < kb1; kb++, pk += CB_TPACK_BLOCK_BYTES) {
        const __m256i *wv = (const __m256i *)(pk + 32);
        __m256i isum[4];
        if (dtype == CB_INT8) {
            for (int j = 0; j < T; j++) isum[j] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i w = _mm256_loadu_si256(wv + c), aw = _mm256_sign_epi8(w, w);
                for (int j = 0; j < T; j++) {
                    __m256i x = cb_bcast4_avx2(xq[j] + kb * CB_QBLOCK + 4 * c);
                    isum[j] = _mm256_add_epi32(isum[j], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)), ones));
                    CB_IN_ORDER(isum[j]);
                }
            }
        } else {
            __m256i p16[4];
            for (int j = 0; j < T; j++) p16[j] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i w = _mm256_loadu_si256(wv + c);
                for (int j = 0; j < T; j++) {
                    p16[j] = _mm256_add_epi16(p16[j], _mm256_maddubs_epi16(w, cb_bcast4_avx2(xq[j] + kb * CB_QBLOCK + 4 * c)));
                    CB_IN_ORDER(p16[j]);
                }
            }
            for (int j = 0; j < T; j++)
                isum[j] = _mm256_sub_epi32(_mm256_madd_epi16(p16[j], ones), _mm256_set1_epi32(xsum8[(size_t)j * nb + kb]));
        }
        const __m256 dw = _mm256_loadu_ps((const float *)pk);
        for (int j = 0; j < T; j++)
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j]), _mm256_mul_ps(dw, _mm256_set1_ps(xd[j][kb])), acc[j]);
    }
    for (int j = 0; j < T; j++) _mm256_storeu_ps(out + (size_t)j * ldo, acc[j]);
}

/* The first step of every repacked prefill kernel: when `first`, the activation sums k * sum(x)
 * [n][nb] (k = 8 for int4; 128 for int8 with unsigned_int8, else none), then the chunk's groups
 * [g0, g1) packed (cb_tpack_group_avx2). Returns the packed blocks [g1 - g0][nb]. */
CB_TARGET_AVX2 static uint8_t *cb_tprefill_pack_avx2(const char *w, int dtype, const cb_act_q8 *acts, int rows,
                                                     int cols, int g0, int g1, int n, uint8_t *scratch, int first,
                                                     int unsigned_int8) {
    const int groups = rows / CB_TGROUP, nb = cols / CB_QBLOCK;
    const size_t gbytes = cb_group_bytes(dtype), unit = (size_t)nb * CB_TPACK_BLOCK_BYTES;
    int32_t *xsum = (int32_t *)scratch;
    uint8_t *packed = scratch + cb_tprefill_sums_bytes(nb, n);
    const int32_t k = dtype == CB_INT4 ? 1 : unsigned_int8 ? 16 : 0;       /* times 8 * sum(x) */
    if (k && first)
        for (int t = 0; t < n; t++)
            for (int kb = 0; kb < nb; kb++) xsum[(size_t)t * nb + kb] = k * 8 * acts[t].s[kb];
    for (int kb = 0; kb < nb; kb++) {          /* the stored chunk is read in order, row of blocks by row */
        const char *src = w + ((size_t)kb * groups + g0) * gbytes;
        for (int g = g0; g < g1; g++, src += gbytes)
            cb_tpack_group_avx2(packed + (size_t)(g - g0) * unit + (size_t)kb * CB_TPACK_BLOCK_BYTES, src, dtype,
                                unsigned_int8);
    }
    return packed;
}

/* The prefill entry (cb_kernel_table.tprefill): out[t * ldo + o] for outputs [o0, o1) (whole
 * groups) and all n tokens of a transposed int8/int4 matrix, through `scratch` of
 * cb_tprefill_bytes((o1 - o0) / 8, cols / 32, n) bytes: the activation sums (computed when
 * `first`, kept for the job's later chunks), then the chunk's packed blocks. */
CB_TARGET_AVX2 static void cb_tprefill_quant_avx2(float *out, int ldo, const char *w, int dtype, const cb_act_q8 *acts,
                                                  int rows, int cols, int o0, int o1, int n, uint8_t *scratch,
                                                  int first) {
    const int nb = cols / CB_QBLOCK, g0 = o0 / CB_TGROUP, g1 = o1 / CB_TGROUP;
    const int32_t *xsum = (const int32_t *)scratch;
    const uint8_t *packed = cb_tprefill_pack_avx2(w, dtype, acts, rows, cols, g0, g1, n, scratch, first, 0);
#define CB_CALL_TP(dt, tt) cb_tpacked_group_avx2(o, ldo, pk, dt, acts + t, xs, nb, kb0, kb1, tt)
    CB_TPREFILL_TILES(if (dtype == CB_INT8) { CB_AVX2_T_CASES(CB_CALL_TP, CB_INT8) }
                      else { CB_AVX2_T_CASES(CB_CALL_TP, CB_INT4) })
#undef CB_CALL_TP
}

/* ---- attention ------------------------------------------------------------------------------
 *
 * cb_attend_fn for up to 4 query heads of one KV head over an f32 or f16 cache (head_dim a multiple
 * of 8; otherwise head by head with the AVX2 dot; q8 caches: cb_attend_q8_avx2, up to 8 heads): each key row is loaded once for the NH heads (key rows two at a time:
 * 2 x NH FMA chains, each row's sums gathered by one hadd tree into NH scores), and each value row
 * once per 16 output columns of the NH heads (2 x NH accumulators; per position one broadcast
 * weight per head), in blocks of rows that stay in L1 across those passes. Loops are unrolled for
 * head_dim 64 and 128. A loop per head would read every key and value row once per head, through a
 * function pointer per dot product: the attention of a long context would then dominate decode. */
/* The softmax's exps from element i on, x[k] = exp(x[k] - mx), and their sum: 8 lanes a step
 * adding onto s8 (the partial sums of elements before i), then the lanes' sum, then a scalar tail.
 * The AVX-512 tier's softmax runs its 16-lane steps first and ends here, for the same bits. */
/* The chains of the softmax's sum (8 lanes each) and their fold: ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)). */
#define CB_SOFTMAX_CHAINS 8
CB_TARGET_AVX2 static CB_ALWAYS_INLINE __m256 cb_softmax_fold8(const __m256 *acc) {
    return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])),
                         _mm256_add_ps(_mm256_add_ps(acc[4], acc[5]), _mm256_add_ps(acc[6], acc[7])));
}

CB_TARGET_AVX2 static CB_ALWAYS_INLINE float cb_softmax_exps_avx2(float *x, int i, int n, float mx, __m256 s8) {
    const __m256 vmx = _mm256_set1_ps(mx), underflow = _mm256_set1_ps(CB_LN_SMALLEST_NORMAL);
    for (; i + 8 <= n; i += 8) {
        const __m256 z = _mm256_sub_ps(_mm256_loadu_ps(x + i), vmx);
        const __m256 e = _mm256_and_ps(cb_exp_avx2(z), _mm256_cmp_ps(z, underflow, _CMP_GE_OQ));
        _mm256_storeu_ps(x + i, e);
        s8 = _mm256_add_ps(s8, e);
    }
    float sum = cb_hsum256(s8);
    for (; i < n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    return sum;
}

/* cb_softmax_unnormalized with 8 lanes and cb_exp_avx2 (within 2 ulp of expf), exp below the
 * smallest normal float taken as 0 (expf gives a subnormal: nothing next to the sum, which is >= 1).
 * The attention's; the scalar tier and routing keep cb_softmax. */
CB_TARGET_AVX2 static int cb_softmax_unnormalized_avx2(float *x, int n, float *inv) {
    int i = 0;
    *inv = 1.0f;
    __m256 m8[4], nan8 = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) m8[k] = _mm256_set1_ps(-INFINITY);
    for (; i + 32 <= n; i += 32)          /* max drops NaNs: they are looked for apart; 4 chains */
        for (int k = 0; k < 4; k++) {
            const __m256 v = _mm256_loadu_ps(x + i + 8 * k);
            m8[k] = _mm256_max_ps(m8[k], v);
            nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        m8[0] = _mm256_max_ps(m8[0], v);
        nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float mx = cb_hmax256(_mm256_max_ps(_mm256_max_ps(m8[0], m8[1]), _mm256_max_ps(m8[2], m8[3])));
    if (_mm256_movemask_ps(nan8)) return -1;
    for (; i < n; i++) {
        if (isnan(x[i])) return -1;
        mx = x[i] > mx ? x[i] : mx;
    }
    if (!isfinite(mx)) return -1;
    /* the sum in CB_SOFTMAX_CHAINS chains of 8 lanes over whole 64-element steps (one chain's adds
     * would wait on each other: the exponentials' pass would run at the add's latency), folded as a tree;
     * then the rest in order (cb_softmax_exps_avx2). The AVX-512 tier adds the same lanes in the
     * same order. */
    const __m256 vmx = _mm256_set1_ps(mx), underflow = _mm256_set1_ps(CB_LN_SMALLEST_NORMAL);
    __m256 acc[CB_SOFTMAX_CHAINS];
    for (int k = 0; k < CB_SOFTMAX_CHAINS; k++) acc[k] = _mm256_setzero_ps();
    for (i = 0; i + 8 * CB_SOFTMAX_CHAINS <= n; i += 8 * CB_SOFTMAX_CHAINS)
        for (int k = 0; k < CB_SOFTMAX_CHAINS; k++) {
            const __m256 z = _mm256_sub_ps(_mm256_loadu_ps(x + i + 8 * k), vmx);
            const __m256 e = _mm256_and_ps(cb_exp_avx2(z), _mm256_cmp_ps(z, underflow, _CMP_GE_OQ));
            _mm256_storeu_ps(x + i + 8 * k, e);
            acc[k] = _mm256_add_ps(acc[k], e);
        }
    *inv = 1.0f / cb_softmax_exps_avx2(x, i, n, mx, cb_softmax_fold8(acc));
    return 0;
}

/* cb_softmax_unnormalized's exponentials, then each times 1 / their sum. */
CB_TARGET_AVX2 static int cb_softmax_avx2(float *x, int n) {
    float inv;
    if (cb_softmax_unnormalized_avx2(x, n, &inv)) return -1;
    int i = 0;
    for (const __m256 vinv = _mm256_set1_ps(inv); i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vinv));
    for (; i < n; i++) x[i] *= inv;
    return 0;
}

#ifndef CB_ATTN_PREFETCH
#define CB_ATTN_PREFETCH 8
#endif
#ifndef CB_ATTN_VBLOCK_BYTES
#define CB_ATTN_VBLOCK_BYTES 2048    /* value bytes per block of the value pass (8 rows at head_dim 64; at least 4 rows) */
#endif
/* 8 cache values at element i of a row of KV (f32 or f16: q8 takes the integer kernels) elements,
 * as floats (f16: F16C). row is the row's start. */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE __m256 cb_kv_load8(const void *row, size_t i, const int KV) {
    if (KV == CB_KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
    return _mm256_loadu_ps((const float *)row + i);
}

/* q8 scores (cb_q8_score's bits) of two key rows ka, kb (kb == ka for a lone last row) for NH <= 4
 * query heads, into sc[i][t] and, where `pair`, sc[i][t + 1]: codes qc [NH][qlen]
 * (cb_q8_query_quantize), qs8 [m[0..3].qs, m[0..3].qs] of their cb_q8_query m (cb_q8_qs8). The integer sums by
 * vpmaddubsw of |k| and q signed by k (products and pair sums stay within int16: codes are within
 * +-127), then vpmaddwd with ones, 32 codes a step; a last head_dim % 32 in C. One hadd tree
 * gathers both rows' sums for the 4 heads into 8 lanes, whose float part is cb_q8_score_from_sum's
 * two multiplies on 8 lanes at once. (Two rows share one tree and its conversions, where a row at a
 * time would end each row in its own tree and 4 scalar conversions; the query codes are loaded each
 * step so GCC does not hoist the 16 query vectors out of the rows' loop and spill the products.) */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void cb_q8_rows2_scores_avx2(float *const *sc, int t, int pair,
                                                                   const int8_t *qc, int qlen, __m256 qs8, const char *ka, const char *kb,
                                                                   int head_dim, const int NH) {
    const int8_t *ca = (const int8_t *)(const void *)(ka + CB_KV_Q8_SCALE_BYTES);
    const int8_t *cb = (const int8_t *)(const void *)(kb + CB_KV_Q8_SCALE_BYTES);
    CB_NO_HOIST(qc);                                   /* the query codes loaded each step (from L1) */
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc_a[4], acc_b[4];
    for (int i = 0; i < 4; i++) acc_a[i] = acc_b[i] = _mm256_setzero_si256();
    int d = 0;
    for (; d + 32 <= head_dim; d += 32) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)(ca + d));
        const __m256i b = _mm256_loadu_si256((const __m256i *)(const void *)(cb + d));
        const __m256i aa = _mm256_abs_epi8(a), ab = _mm256_abs_epi8(b);
        for (int i = 0; i < NH; i++) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(const void *)(qc + (size_t)i * qlen + d));
            acc_a[i] = _mm256_add_epi32(acc_a[i], _mm256_madd_epi16(_mm256_maddubs_epi16(aa, _mm256_sign_epi8(qv, a)), ones));
            acc_b[i] = _mm256_add_epi32(acc_b[i], _mm256_madd_epi16(_mm256_maddubs_epi16(ab, _mm256_sign_epi8(qv, b)), ones));
            CB_IN_ORDER(acc_a[i]);                     /* (GCC summed the unrolled steps' products as a */
            CB_IN_ORDER(acc_b[i]);                     /*  tree, spilling them all) */
        }
    }
    const __m256i ha = _mm256_hadd_epi32(_mm256_hadd_epi32(acc_a[0], acc_a[1]), _mm256_hadd_epi32(acc_a[2], acc_a[3]));
    const __m256i hb = _mm256_hadd_epi32(_mm256_hadd_epi32(acc_b[0], acc_b[1]), _mm256_hadd_epi32(acc_b[2], acc_b[3]));
    __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(ha, hb, 0x20),    /* [row a: heads 0-3, */
                                    _mm256_permute2x128_si256(ha, hb, 0x31));   /*  row b: heads 0-3] */
    if (d < head_dim) {
        int32_t s[8];
        _mm256_storeu_si256((__m256i *)(void *)s, sums);
        for (int i = 0; i < NH; i++)
            for (int e = d; e < head_dim; e++) {
                s[i] += (int32_t)qc[(size_t)i * qlen + e] * ca[e];
                s[4 + i] += (int32_t)qc[(size_t)i * qlen + e] * cb[e];
            }
        sums = _mm256_loadu_si256((const __m256i *)(const void *)s);
    }
    const __m256 dk = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(cb_kv_q8_scale(ka))),
                                           _mm_set1_ps(cb_kv_q8_scale(kb)), 1);
    float r[8];
    _mm256_storeu_ps(r, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums), dk), qs8));
    for (int i = 0; i < NH; i++) sc[i][t] = r[i];
    if (pair)
        for (int i = 0; i < NH; i++) sc[i][t + 1] = r[4 + i];
}

/* The qs8 of cb_q8_rows2_scores_avx2 for heads m[0..NH-1] (the lanes of heads past NH: 0). */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE __m256 cb_q8_qs8(const cb_q8_query *m, int NH) {
    float qs[8] = {0};
    for (int i = 0; i < NH && i < 4; i++) qs[i] = qs[4 + i] = m[i].qs;
    return _mm256_loadu_ps(qs);
}

/* q8 scores of positions t0..t1-1 (t counts from the span's first position; row_t0 is t0's cache
 * row) for NH <= 4 heads, two rows a step; `ahead` > 0: each step prefetches the rows that many
 * positions on into L1 (the first pass over a block of rows; later heads find them there). */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_q8_span_scores_avx2(float *const *sc, const int8_t *qc, int qlen, const cb_q8_query *m, const char *kbase,
                       int t0, int t1, int row_t0, int ring, int head_dim, int ahead, const int NH) {
    const size_t rbytes = cb_kv_row_bytes(head_dim, CB_KV_Q8);
    const __m256 qs8 = cb_q8_qs8(m, NH);
    for (int t = t0, row = row_t0; t < t1; t += 2) {
        const int pair = t + 1 < t1, row_b = row + 1 == ring ? 0 : row + 1;
        if (ahead)
            for (int r = 0; r < 2; r++) {
                int p = row + ahead + r;
                if (p >= ring) p %= ring;
                for (size_t b = 0; b < rbytes; b += 64) _mm_prefetch(kbase + (size_t)p * rbytes + b, _MM_HINT_T0);
            }
        cb_q8_rows2_scores_avx2(sc, t, pair, qc, qlen, qs8, kbase + (size_t)row * rbytes,
                                kbase + (size_t)(pair ? row_b : row) * rbytes, head_dim, NH);
        row = row_b + 1 == ring ? 0 : row_b + 1;
    }
}

/* Prefetch the cache rows of positions b0..b1-1 (rbytes each) into L1: the next value block, while
 * this one's queries add theirs (the rows come from L3 or memory once per block and query block). */
static CB_ALWAYS_INLINE void cb_attn_prefetch_rows(const char *base, int b0, int b1, int ring, size_t rbytes) {
    for (int t = b0, row = b0 % ring; t < b1; t++) {
        for (size_t c = 0; c < rbytes; c += 64) _mm_prefetch(base + (size_t)row * rbytes + c, _MM_HINT_T0);
        row = row + 1 == ring ? 0 : row + 1;
    }
}

#define CB_Q8_VP_INT32 16384            /* a converted block's int32 (64 KB: 32 rows at head_dim 1024) */
#define CB_Q8_KBLOCK_BYTES 16384        /* a q8 prompt block's key codes (128 rows at head_dim 128) */

/* A q8 prompt block's positions: a whole number of value groups (the blocks start at multiples of
 * CB_Q8_VGROUP, so a group never spans two blocks), at least one. */
static inline int cb_q8_block_rows(int head_dim) {
    const int r = CB_Q8_KBLOCK_BYTES / cb_q8_qlen(head_dim) / CB_Q8_VGROUP * CB_Q8_VGROUP;
    return r > CB_Q8_VGROUP ? r : CB_Q8_VGROUP;
}
/* q8 values (cb_attend_head's groups of CB_Q8_VGROUP positions, int16 weights). A group's value
 * rows as int16 pairs: vp [pairs][head_dim] int32, each int32 holding a column's code of the
 * pair's first position in its low half and of its second in the high half (what vpmaddwd
 * multiplies by a weight pair), vd [2 x pairs] the rows' scales; the rows from cache row `row` on,
 * wrapping (head_dim % 8 == 0). A prompt converts a block's rows once for all its queries and
 * heads. Each 16 columns d.. are stored as the in-lane unpacks leave them, columns d + 0-3, 8-11
 * then d + 4-7, 12-15, and cb_q8_vpass_avx2 puts its sums back in order (two lane swaps a head
 * and group there, where putting the pairs in order here would take two per pair for all heads:
 * the conversion's loop is bound by the shuffle ports). A last 8 columns are in order. */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void cb_q8_vpairs_avx2(int32_t *vp, float *vd, const char *vbase, int row,
                                                             int pairs, int ring, int head_dim) {
    const size_t rbytes = cb_kv_row_bytes(head_dim, CB_KV_Q8);
    const __m256i low = _mm256_set1_epi32(0xFFFF);
    for (int m = 0; m < pairs; m++) {
        const int rb = row + 1 == ring ? 0 : row + 1;
        const char *a = vbase + (size_t)row * rbytes, *b = vbase + (size_t)rb * rbytes;
        vd[2 * m] = cb_kv_q8_scale(a);
        vd[2 * m + 1] = cb_kv_q8_scale(b);
        int d = 0;
        for (; d + 16 <= head_dim; d += 16) {      /* 16 columns: the codes as int16, interleaved a, b */
            const __m256i a16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(a + CB_KV_Q8_SCALE_BYTES + d)));
            const __m256i b16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(b + CB_KV_Q8_SCALE_BYTES + d)));
            _mm256_storeu_si256((__m256i *)(void *)(vp + (size_t)m * head_dim + d), _mm256_unpacklo_epi16(a16, b16));
            _mm256_storeu_si256((__m256i *)(void *)(vp + (size_t)m * head_dim + d + 8), _mm256_unpackhi_epi16(a16, b16));
        }
        if (d < head_dim) {                         /* a last 8 */
            const __m256i ca = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(a + CB_KV_Q8_SCALE_BYTES + d)));
            const __m256i cb = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(b + CB_KV_Q8_SCALE_BYTES + d)));
            _mm256_storeu_si256((__m256i *)(void *)(vp + (size_t)m * head_dim + d),
                                _mm256_or_si256(_mm256_and_si256(ca, low), _mm256_slli_epi32(cb, 16)));
        }
        row = rb + 1 == ring ? 0 : rb + 1;
    }
}

/* One head's weights for a group: wp [CB_Q8_VGROUP / 2] int16 code pairs (positions 2m, 2m + 1
 * of the group), returning the group's g (cb_q8_group_scale; the codes round(w x inv) as
 * cb_q8_weight_code: the products are IEEE's, the max exact in any order, cvtps_epi32 rounds to
 * nearest even as lrintf). p: the head's probabilities by t; t_first: the t of the group's first
 * position (< 0 where the span starts inside it); lo..hi-1: the t of the span's positions (the
 * others weigh 0, their p never read); vd: the group's row scales. */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE float cb_q8_weights_avx2(int32_t *wp, const float *p, int t_first, int lo,
                                                               int hi, const float *vd) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 w[CB_Q8_VGROUP / 8], mx = _mm256_setzero_ps();
    int nan = 0;
    for (int v = 0; v < CB_Q8_VGROUP / 8; v++) {
        const __m256i t = _mm256_add_epi32(_mm256_set1_epi32(t_first + 8 * v), lane);
        const __m256i in = _mm256_and_si256(_mm256_cmpgt_epi32(t, _mm256_set1_epi32(lo - 1)),
                                            _mm256_cmpgt_epi32(_mm256_set1_epi32(hi), t));
        const __m256 pv = _mm256_maskload_ps(p + t_first + 8 * v, in);
        w[v] = _mm256_and_ps(_mm256_mul_ps(pv, _mm256_loadu_ps(vd + 8 * v)), _mm256_castsi256_ps(in));
        nan |= _mm256_movemask_ps(_mm256_cmp_ps(w[v], w[v], _CMP_UNORD_Q));
        mx = _mm256_max_ps(mx, w[v]);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_shuffle_ps(m4, m4, 0x4E));
    m4 = _mm_max_ps(m4, _mm_shuffle_ps(m4, m4, 0xB1));
    const cb_q8_wscale s = cb_q8_group_scale(nan ? 0.0f : _mm_cvtss_f32(m4), nan != 0);
    if (!(s.inv > 0.0f)) {
        memset(wp, 0, sizeof(int32_t) * (CB_Q8_VGROUP / 2));
        return s.g;
    }
    const __m256 inv = _mm256_set1_ps(s.inv);
    const __m256i top = _mm256_set1_epi32(32767);
    for (int v = 0; v < CB_Q8_VGROUP / 8; v += 2) {    /* 16 codes (0..32767) packed in order */
        const __m256i a = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(w[v], inv)), top);
        const __m256i b = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(w[v + 1], inv)), top);
        _mm256_storeu_si256((__m256i *)(void *)(wp + 4 * v), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
    }
    return s.g;
}

/* A group's values into o[i] for NH (<= 4) heads, NC 8-column vectors from column d: the integer
 * sums by vpmaddwd over the pairs, then o = fma(sum, g, o) (zero: o from 0, the span's first group).
 * NC == 2 reads 16 columns as cb_q8_vpairs_avx2 stores them (lanes swapped back at the end); NC ==
 * 1 reads 8 in order (its last 8, and the AVX-512 tier's). */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void cb_q8_vpass_avx2(float *const *o, const int32_t *wp, const float *gs,
                                                            const int32_t *vp, int head_dim, int d, int zero,
                                                            const int NH, const int NC) {
    __m256i acc[4][2];
    for (int i = 0; i < NH; i++)
        for (int c = 0; c < NC; c++) acc[i][c] = _mm256_setzero_si256();
    for (int m = 0; m < CB_Q8_VGROUP / 2; m++) {
        __m256i v[2];
        for (int c = 0; c < NC; c++) v[c] = _mm256_loadu_si256((const __m256i *)(const void *)(vp + (size_t)m * head_dim + d + 8 * c));
        for (int i = 0; i < NH; i++) {
            const __m256i w = _mm256_set1_epi32(wp[(CB_Q8_VGROUP / 2) * i + m]);
            for (int c = 0; c < NC; c++) {
                acc[i][c] = _mm256_add_epi32(acc[i][c], _mm256_madd_epi16(v[c], w));
                CB_IN_ORDER(acc[i][c]);                /* in registers: GCC kept two on the stack, and */
            }                                          /* the loop waited on their store-to-load */
        }
    }
    for (int i = 0; i < NH; i++) {
        if (NC == 2) {                                 /* columns 0-3, 8-11 | 4-7, 12-15 back in order */
            const __m256i a = acc[i][0], b = acc[i][1];
            acc[i][0] = _mm256_permute2x128_si256(a, b, 0x20);
            acc[i][1] = _mm256_permute2x128_si256(a, b, 0x31);
        }
        for (int c = 0; c < NC; c++) {
            float *dst = o[i] + d + 8 * c;
            _mm256_storeu_ps(dst, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][c]), _mm256_set1_ps(gs[i]),
                                                  zero ? _mm256_setzero_ps() : _mm256_loadu_ps(dst)));
        }
    }
}

/* A group (positions of t t_first.., pairs vp, scales vd) for NH <= 4 heads: weights, then the
 * columns 16 at a time. */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void cb_q8_vgroup_avx2(float *const *o, const float *const *sc, int t_first,
                                                             int lo, int hi, const int32_t *vp, const float *vd,
                                                             int head_dim, const int NH) {
    int32_t wp[4 * CB_Q8_VGROUP / 2];
    float gs[4];
    for (int i = 0; i < NH; i++) gs[i] = cb_q8_weights_avx2(wp + (CB_Q8_VGROUP / 2) * i, sc[i], t_first, lo, hi, vd);
    const int zero = t_first <= 0;
    int d = 0;
    for (; d + 16 <= head_dim; d += 16) cb_q8_vpass_avx2(o, wp, gs, vp, head_dim, d, zero, NH, 2);
    if (d < head_dim) cb_q8_vpass_avx2(o, wp, gs, vp, head_dim, d, zero, NH, 1);
}

/* cb_kv_store_q8 with 8 lanes, the same bytes: the max is exact in any order, the division is
 * IEEE's in both, and cvtps_epi32 rounds to nearest even as lrintf does; a row with NaN or
 * infinity, or all zeros, takes the scalar code. (Every prompt token stores a row per KV head and
 * layer: the store is vectorised for long prefills.) */
CB_TARGET_AVX2 static void cb_kv_store_q8_avx2(void *dst, const float *src, int n) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 m8 = _mm256_setzero_ps();
    int i = 0, unordered = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 a = _mm256_and_ps(_mm256_loadu_ps(src + i), magnitude);
        unordered |= _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        m8 = _mm256_max_ps(m8, a);
    }
    float lanes[8], amax = 0.0f;
    _mm256_storeu_ps(lanes, m8);
    for (int l = 0; l < 8; l++) amax = lanes[l] > amax ? lanes[l] : amax;
    for (int k = i; k < n; k++) unordered |= isnan(src[k]), amax = fabsf(src[k]) > amax ? fabsf(src[k]) : amax;
    const float d = amax / 127.0f;
    if (unordered || !(d > 0.0f) || !isfinite(d)) {
        cb_kv_store_q8(dst, src, n);
        return;
    }
    memcpy(dst, &d, sizeof d);
    int8_t *c = (int8_t *)dst + CB_KV_Q8_SCALE_BYTES;
    const __m256 vd = _mm256_set1_ps(d);
    const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
    for (i = 0; i + 8 <= n; i += 8) {
        const __m256i r = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(src + i), vd)),
                                                            top), bottom);
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        _mm_storel_epi64((__m128i *)(void *)(c + i), _mm_packs_epi16(w, w));
    }
    for (; i < n; i++) {
        const long r = lrintf(src[i] / d);
        c[i] = (int8_t)(r > 127 ? 127 : r < -127 ? -127 : r);
    }
}

/* cb_q8_query_quantize with the 8-lane store (the same bytes). */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void cb_q8_query_quantize_avx2(int8_t *codes, cb_q8_query *m, const float *qh,
                                                                     int head_dim, float scale) {
    char row[CB_KV_Q8_SCALE_BYTES + CB_KV_Q8_MAX_HEAD_DIM];
    cb_kv_store_q8_avx2(row, qh, head_dim);
    cb_q8_query_from_row(codes, m, row, head_dim, scale);
}

CB_TARGET_AVX2 static void cb_kv_store_avx2(void *dst, const float *src, int n, int kv) {
    if (kv == CB_KV_Q8) {
        cb_kv_store_q8_avx2(dst, src, n);
        return;
    }
    if (kv != CB_KV_F16) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)((uint16_t *)dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) ((uint16_t *)dst)[i] = cb_f32_to_f16(src[i]);
}

/* ---- a prompt's block of queries (cb_attend_block_fn) ----
 *
 * Decode's kernel above, one query at a time, reads the query's whole span of keys and values
 * from memory; a prompt chunk's queries read the same rows again and again (at a 4096-token prompt,
 * 128 queries x 4 MB per KV head). The block kernel turns the loops: a block of key (then value)
 * rows, CB_ATTN_KBLOCK_BYTES, is read once and serves every query of the block from L1/L2. Each
 * score and each output is the same sequence of operations as decode's, so a prompt equals
 * decoding it bit for bit (tests/test_kernels.py checks): a score is its row's NH FMA chains over
 * head_dim / 8 steps in the order of d, gathered by the same hadd tree (hadd pairs, then the two
 * 128-bit halves, times the scale), whatever rows share a step; an output adds its positions in
 * order from zero, its sums waiting in `out` between blocks. Only the tiling differs: R key rows a
 * step (decode: 2) and CV 8-column vectors of values a pass (decode: 2). The AVX-512 tier
 * (kernels_avx512.h) runs the same operations per lane on 512-bit vectors, in this order
 * (CB_ATTEND_QBLOCK_BODY), for the same bits. */

/* Scores of positions t0..t1-1 of one query's span (t counts from the span's first position;
 * row_t0 is t0's cache row): sc[i][t] = qh[i] . k_t * scale for the NH heads. */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_attn_block_scores_avx2(float *const *sc, const float *const *qh, const char *kbase, int t0, int t1, int row_t0,
                          int ring, int head_dim, __m256 vscale, const int NH, const int R, const int KV) {
    const size_t rbytes = cb_kv_row_bytes(head_dim, KV);
    for (int t = t0, row = row_t0; t < t1; t += R) {  /* R rows a step (2 or 4); the last valid one repeats */
        const char *k[4];
        for (int r = 0, rr = row; r < R; r++) {
            k[r] = kbase + (size_t)rr * rbytes;
            if (t + r + 1 < t1) rr = rr + 1 == ring ? 0 : rr + 1;
        }
        __m256 acc[4][4];
        for (int r = 0; r < R; r++)
            for (int i = 0; i < 4; i++) acc[r][i] = _mm256_setzero_ps();
        for (int d = 0; d < head_dim; d += 8) {
            __m256 kv[4];
            for (int r = 0; r < R; r++) kv[r] = cb_kv_load8(k[r], d, KV);
            for (int i = 0; i < NH; i++) {
                const __m256 qv = _mm256_loadu_ps(qh[i] + d);
                for (int r = 0; r < R; r++) acc[r][i] = _mm256_fmadd_ps(kv[r], qv, acc[r][i]);
            }
        }
        for (int r = 0; r < R; r += 2) {
            const __m256 sa = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]), _mm256_hadd_ps(acc[r][2], acc[r][3]));
            const __m256 sb = _mm256_hadd_ps(_mm256_hadd_ps(acc[r + 1][0], acc[r + 1][1]),
                                             _mm256_hadd_ps(acc[r + 1][2], acc[r + 1][3]));
            float s8[8];                                 /* [row a: heads 0-3, row b: heads 0-3] */
            _mm256_storeu_ps(s8, _mm256_mul_ps(_mm256_add_ps(_mm256_permute2f128_ps(sa, sb, 0x20),
                                                             _mm256_permute2f128_ps(sa, sb, 0x31)), vscale));
            for (int h = 0; h < 2; h++)
                if (t + r + h < t1)
                    for (int i = 0; i < NH; i++) sc[i][t + r + h] = s8[4 * h + i];
        }
        for (int r = 0; r < R && t + r < t1; r++) row = row + 1 == ring ? 0 : row + 1;
    }
}

/* Values of positions t0..t1-1 of one query's span into o[i] (from zero at t = 0, else onto what
 * o holds): NV 8-column vectors from column d, every row. (NV is a compile-time constant so the
 * accumulators stay in registers: a variable count keeps them on the stack.) */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_attn_block_vpass_avx2(float *const *o, const float *const *sc, const char *vbase, int t0, int t1, int row_t0,
                         int ring, int head_dim, int d, const int NH, const int NV, const int KV) {
    const size_t rbytes = cb_kv_row_bytes(head_dim, KV);
    __m256 acc[4][4];
    for (int i = 0; i < NH; i++)
        for (int c = 0; c < NV; c++) acc[i][c] = t0 ? _mm256_loadu_ps(o[i] + d + 8 * c) : _mm256_setzero_ps();
    for (int t = t0, row = row_t0; t < t1; t++) {
        const char *v = vbase + (size_t)row * rbytes;
        __m256 vv[4];
        for (int c = 0; c < NV; c++) vv[c] = cb_kv_load8(v, (size_t)d + 8 * c, KV);
        for (int i = 0; i < NH; i++) {
            const __m256 p = _mm256_broadcast_ss(sc[i] + t);
            for (int c = 0; c < NV; c++) acc[i][c] = _mm256_fmadd_ps(p, vv[c], acc[i][c]);
        }
        row = row + 1 == ring ? 0 : row + 1;
    }
    for (int i = 0; i < NH; i++)
        for (int c = 0; c < NV; c++) _mm256_storeu_ps(o[i] + d + 8 * c, acc[i][c]);
}

/* The value pass, CV 8-column vectors at a time (the last pass takes what is left). */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_attn_block_values_avx2(float *const *o, const float *const *sc, const char *vbase, int t0, int t1, int row_t0,
                          int ring, int head_dim, const int NH, const int CV, const int KV) {
    int d = 0;
    for (; d + 8 * CV <= head_dim; d += 8 * CV)
        cb_attn_block_vpass_avx2(o, sc, vbase, t0, t1, row_t0, ring, head_dim, d, NH, CV, KV);
    switch ((head_dim - d) / 8) {
    case 3: cb_attn_block_vpass_avx2(o, sc, vbase, t0, t1, row_t0, ring, head_dim, d, NH, 3, KV); break;
    case 2: cb_attn_block_vpass_avx2(o, sc, vbase, t0, t1, row_t0, ring, head_dim, d, NH, 2, KV); break;
    case 1: cb_attn_block_vpass_avx2(o, sc, vbase, t0, t1, row_t0, ring, head_dim, d, NH, 1, KV); break;
    default: break;
    }
}

/* A sink (one more logit, no value) and the softmax (the tier's: cb_softmax_avx2 or _avx512, the
 * same bits) of each head's n scores, as decode's. */
#define CB_ATTN_SOFTMAX_HEADS(SOFTMAX, sc, n, sinks, h0, NH) \
    for (int i_ = 0; i_ < (NH); i_++) {                      \
        if (sinks) (sc)[i_][n] = (sinks)[(h0) + i_];        \
        SOFTMAX((sc)[i_], (n) + ((sinks) != NULL));           \
    }
/* The same for q8 attention: the tier's cb_softmax_unnormalized, 1 / each head's sum in inv[i]. */
#define CB_ATTN_EXPS_HEADS(EXPS, sc, n, sinks, h0, NH, inv)  \
    for (int i_ = 0; i_ < (NH); i_++) {                      \
        if (sinks) (sc)[i_][n] = (sinks)[(h0) + i_];        \
        EXPS((sc)[i_], (n) + ((sinks) != NULL), &(inv)[i_]);  \
    }
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void cb_attn_block_softmax_avx2(float *const *sc, int n, const float *sinks,
                                                                     int h0, const int NH) {
    CB_ATTN_SOFTMAX_HEADS(cb_softmax_avx2, sc, n, sinks, h0, NH)
}

CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_attend_group_avx2(float *out, const float *q, const void *k_cache, const void *v_cache, float *scores,
                     int sc_stride, int h0, int kvh, int head_dim_, int start, int pos, int ring,
                     float scale, const float *sinks, const int NH, const int HD, const int KV) {
    const int head_dim = HD ? HD : head_dim_;          /* a constant where HD is: the loops unroll */
    const size_t rbytes = cb_kv_row_bytes(head_dim, KV);   /* bytes of one cache row */
    const int n = pos - start + 1, row0 = start % ring;
    const float *qh[8];                                /* NH <= 4 here (the AVX-512 tier's units of 8: its own kernel) */
    float *sc[8];
    for (int i = 0; i < NH; i++) {
        qh[i] = q + (size_t)(h0 + i) * head_dim;
        sc[i] = scores + (size_t)(h0 + i) * sc_stride;
    }
    const char *kbase = (const char *)k_cache + (size_t)kvh * ring * rbytes;
    const char *vbase = (const char *)v_cache + (size_t)kvh * ring * rbytes;
    const __m256 vscale = _mm256_set1_ps(scale);
    /* Scores two key rows at a time: each q load serves both rows and 2 x NH independent FMA chains
     * hide the FMA latency (one row's NH chains alone are too few to cover it).
     * Each row's sums are gathered as before — hadd pairs, then the two 128-bit halves — so a
     * score does not depend on its row's partner (or on being the odd one out at the end). */
    for (int t = 0, row = row0; t < n; t += 2) {
        const int pair = t + 1 < n, row_b = row + 1 == ring ? 0 : row + 1;
        const char *ka = kbase + (size_t)row * rbytes, *kb = kbase + (size_t)(pair ? row_b : row) * rbytes;
        for (int r = 0; r < 2; r++) {
            int ahead = row + CB_ATTN_PREFETCH + r;
            ahead = ahead < ring ? ahead : ahead % ring;
            for (size_t d = 0; d < rbytes; d += 64) _mm_prefetch(kbase + (size_t)ahead * rbytes + d, _MM_HINT_T0);
        }
        __m256 acc_a[8], acc_b[8];
        for (int i = 0; i < 8; i++) acc_a[i] = acc_b[i] = _mm256_setzero_ps();
        for (int d = 0; d < head_dim; d += 8) {
            const __m256 kva = cb_kv_load8(ka, d, KV), kvb = cb_kv_load8(kb, d, KV);
            for (int i = 0; i < NH; i++) {
                const __m256 qv = _mm256_loadu_ps(qh[i] + d);
                acc_a[i] = _mm256_fmadd_ps(kva, qv, acc_a[i]);
                acc_b[i] = _mm256_fmadd_ps(kvb, qv, acc_b[i]);
            }
        }
        for (int g = 0; g < NH; g += 4) {                /* a tree per 4 heads (a head's sum is the same in any) */
            const __m256 sa = _mm256_hadd_ps(_mm256_hadd_ps(acc_a[g], acc_a[g + 1]), _mm256_hadd_ps(acc_a[g + 2], acc_a[g + 3]));
            const __m256 sb = _mm256_hadd_ps(_mm256_hadd_ps(acc_b[g], acc_b[g + 1]), _mm256_hadd_ps(acc_b[g + 2], acc_b[g + 3]));
            float r[8];                                  /* [row a: heads g..g+3, row b: heads g..g+3] */
            _mm256_storeu_ps(r, _mm256_mul_ps(_mm256_add_ps(_mm256_permute2f128_ps(sa, sb, 0x20),
                                                            _mm256_permute2f128_ps(sa, sb, 0x31)), vscale));
            for (int i = g; i < NH && i < g + 4; i++) sc[i][t] = r[i - g];
            if (pair)
                for (int i = g; i < NH && i < g + 4; i++) sc[i][t + 1] = r[4 + i - g];
        }
        row = row_b + 1 == ring ? 0 : row_b + 1;
    }
    CB_ATTN_SOFTMAX_HEADS(cb_softmax_avx2, sc, n, sinks, h0, NH)   /* a sink: one more logit, no value */
    /* The value rows a block at a time (vblock rows, CB_ATTN_VBLOCK_BYTES): each pass over 16 of
     * the block's columns finds its rows in L1 and prefetches its own 64-byte piece of the rows of
     * the next block, so the next block arrives whole over the passes, a block ahead. Column-first
     * over all positions would read each row's pieces in separate sweeps of memory 256 bytes apart
     * and stall on those loads; a small block (it and its prefetched successor stay in L1) keeps
     * the passes at the read bandwidth.
     * Each output still adds its positions in order (the sums wait in out between blocks), so
     * the block size does not change a bit. */
    const int vblock = CB_ATTN_VBLOCK_BYTES / (int)rbytes > 4 ? CB_ATTN_VBLOCK_BYTES / (int)rbytes : 4;
    for (int t0 = 0, row_t0 = row0; t0 < n; t0 += vblock) {
        const int t1 = n - t0 > vblock ? t0 + vblock : n;
        const int next0 = (int)(((int64_t)row_t0 + vblock) % ring);
        for (int d = 0; d < head_dim; d += 16) {
            const int two = d + 16 <= head_dim;            /* 16 columns, or the last 8 */
            const size_t col = (size_t)d * rbytes / (size_t)head_dim;   /* about column d's byte in a row */
            __m256 a0[8], a1[8];
            for (int i = 0; i < NH; i++) {
                const float *o = out + (size_t)(h0 + i) * head_dim + d;
                a0[i] = t0 ? _mm256_loadu_ps(o) : _mm256_setzero_ps();
                a1[i] = t0 && two ? _mm256_loadu_ps(o + 8) : _mm256_setzero_ps();
            }
            for (int t = t0, row = row_t0, next = next0; t < t1; t++) {
                const char *v = vbase + (size_t)row * rbytes;
                _mm_prefetch(vbase + (size_t)next * rbytes + col, _MM_HINT_T0);
                const __m256 v0 = cb_kv_load8(v, d, KV), v1 = two ? cb_kv_load8(v, d + 8, KV) : _mm256_setzero_ps();
                for (int i = 0; i < NH; i++) {
                    const __m256 p = _mm256_broadcast_ss(sc[i] + t);
                    a0[i] = _mm256_fmadd_ps(p, v0, a0[i]);
                    a1[i] = _mm256_fmadd_ps(p, v1, a1[i]);
                }
                row = row + 1 == ring ? 0 : row + 1;
                next = next + 1 == ring ? 0 : next + 1;
            }
            for (int i = 0; i < NH; i++) {
                float *o = out + (size_t)(h0 + i) * head_dim + d;
                _mm256_storeu_ps(o, a0[i]);
                if (two) _mm256_storeu_ps(o + 8, a1[i]);
            }
        }
        row_t0 = (int)(((int64_t)row_t0 + (t1 - t0)) % ring);
    }
}

/* nq queries at positions pos0.., the block's key rows then its value rows CB_ATTN_KBLOCK_BYTES at
 * a time for every query that sees them. scores: rows [nq * CB_ATTN_BLOCK_HEADS_MAX] of sc_stride
 * floats, row j * CB_ATTN_BLOCK_HEADS_MAX + i for query j's head h0 + i. */
#ifndef CB_ATTN_KBLOCK_BYTES
#define CB_ATTN_KBLOCK_BYTES 16384
#endif
/* The block kernel's order, for every tier's: per pass (0: scores, 1: values after the softmaxes)
 * the key or value rows a block (ROWS positions) at a time for each query that sees them.
 * The blocks start at a multiple of ALIGN (q8: of its value groups) at or before the first query's
 * span. PREPARE(pass, b0, b1) runs once per block (positions b0..b1-1) before its queries (the AVX-512
 * tier converts the block's rows there); SOFTMAX_HEADS(j, sc, n) is the tier's softmax of query
 * j's NH score rows sc[i] over n positions (CB_ATTN_SOFTMAX_HEADS: cb_softmax's contract, the same
 * bits in every tier that has one; q8: CB_ATTN_EXPS_HEADS, the exponentials and 1 / their sums);
 * FINISH(j, o) runs on query j's NH finished output heads o[i] (q8: times those 1 / sums); SCORES(j, sc, qh, kbase, t0, t1, row_t0, s0) and
 * VALUES(o, sc, vbase, t0, t1, row_t0, s0) are the tier's passes over one query's rows (j: the
 * query's place in the block; s0: the first row's place in its block); the body runs in a function with cb_attend_qblock_group_avx2's
 * parameters (head_dim and rbytes, a cache row's bytes, defined). */
#define CB_ATTN_KBLOCK_ROWS(rbytes) \
    (CB_ATTN_KBLOCK_BYTES / (int)(rbytes) > 8 ? CB_ATTN_KBLOCK_BYTES / (int)(rbytes) : 8)
/* The body's FINISH where there is nothing to finish (f32, f16); q8's (with inv [nq][8] of
 * CB_ATTN_EXPS_HEADS in scope). */
#define CB_ATTN_NO_FINISH(j, o) (void)(o)
#define CB_ATTN_FINISH_Q8(j, o) cb_q8_scale_outputs(o, inv_sum[j], head_dim, NH)
#define CB_ATTEND_QBLOCK_BODY(SCORES, VALUES, ROWS, ALIGN, PREPARE, SOFTMAX_HEADS, FINISH)                       \
    const char *kbase = (const char *)k_cache + (size_t)kvh * ring * rbytes;                            \
    const char *vbase = (const char *)v_cache + (size_t)kvh * ring * rbytes;                            \
    const int rows = (ROWS);                                                                            \
    const int first = cb_window_start(pos0, window) / (ALIGN) * (ALIGN), last = pos0 + nq - 1;           \
    for (int pass = 0; pass < 2; pass++) {                                                              \
        for (int b0 = first; b0 <= last; b0 += rows) {                                                  \
            const int b1 = last + 1 - b0 > rows ? b0 + rows : last + 1;                                 \
            PREPARE(pass, b0, b1);                                                                      \
            for (int j = 0; j < nq; j++) {                                                              \
                const int pos = pos0 + j, start = cb_window_start(pos, window);                         \
                const int a = b0 > start ? b0 : start, b = b1 < pos + 1 ? b1 : pos + 1;                 \
                if (a >= b) continue;                                                                   \
                const float *qh[8];                                                                     \
                float *sc[8], *o[8];                                                                    \
                for (int i = 0; i < NH; i++) {                                                          \
                    qh[i] = q + (size_t)j * ldq + (size_t)(h0 + i) * head_dim;                          \
                    sc[i] = scores + ((size_t)j * CB_ATTN_BLOCK_HEADS_MAX + i) * sc_stride;                       \
                    o[i] = out + (size_t)j * ldo + (size_t)(h0 + i) * head_dim;                         \
                }                                                                                       \
                if (pass == 0) SCORES(j, sc, qh, kbase, a - start, b - start, a % ring, a - b0);        \
                else VALUES(o, (const float *const *)sc, vbase, a - start, b - start, a % ring, a - b0); \
            }                                                                                           \
        }                                                                                               \
        if (pass == 0)                                                                                  \
            for (int j = 0; j < nq; j++) {                                                              \
                const int pos = pos0 + j;                                                               \
                float *sc[8];                                                                           \
                for (int i = 0; i < NH; i++) sc[i] = scores + ((size_t)j * CB_ATTN_BLOCK_HEADS_MAX + i) * sc_stride; \
                SOFTMAX_HEADS(j, sc, pos - cb_window_start(pos, window) + 1);                            \
            }                                                                                           \
    }                                                                                                   \
    for (int j = 0; j < nq; j++) {                                                                      \
        float *o[8];                                                                                    \
        for (int i = 0; i < NH; i++) o[i] = out + (size_t)j * ldo + (size_t)(h0 + i) * head_dim;       \
        FINISH(j, o);                                                                                   \
    }

CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_attend_qblock_group_avx2(float *out, int ldo, const float *q, int ldq, int nq, const void *k_cache,
                            const void *v_cache, float *scores, int sc_stride, int h0, int kvh, int head_dim_,
                            int pos0, int window, int ring, float scale, const float *sinks, int8_t *qc,
                            cb_q8_query *m, int32_t *vp, float *vd, const int NH, const int HD, const int R,
                            const int KV) {
    const int head_dim = HD ? HD : head_dim_;
    const size_t rbytes = cb_kv_row_bytes(head_dim, KV);
    const __m256 vscale = _mm256_set1_ps(scale);
    const int qlen = cb_q8_qlen(head_dim);
    if (KV == CB_KV_Q8)                      /* q8: the block's query heads quantized once, [nq][4][qlen] */
        for (int j = 0; j < nq; j++)
            for (int i = 0; i < NH; i++)
                cb_q8_query_quantize_avx2(qc + (size_t)(CB_ATTN_HEADS * j + i) * qlen, &m[CB_ATTN_HEADS * j + i],
                                     q + (size_t)j * ldq + (size_t)(h0 + i) * head_dim, head_dim, scale);
#define CB_SCORES_AVX2(j, sc, qh, kb, t0, t1, r0, s0)                                                         \
    do {                                                                                                      \
        if (KV == CB_KV_Q8)                                                                                   \
            cb_q8_span_scores_avx2(sc, qc + (size_t)CB_ATTN_HEADS * (j) * qlen, qlen, m + CB_ATTN_HEADS * (j), kb, \
                                   t0, t1, r0, ring, head_dim, 0, NH);  /* q8: two rows a step, no prefetch */ \
        else                                                                                                  \
            cb_attn_block_scores_avx2(sc, qh, kb, t0, t1, r0, ring, head_dim, vscale, NH, R, KV);             \
    } while (0)
#define CB_VALUES_AVX2(o, sc, vb, t0, t1, r0, s0) cb_attn_block_values_avx2(o, sc, vb, t0, t1, r0, ring, head_dim, NH, R, KV)
    /* q8: the block's groups, each t_first = the t of its first position (block row k_) */
#define CB_VALUES_Q8_AVX2(o, sc, vb, t0, t1, r0, s0)                                                         \
    for (int k_ = (s0) / CB_Q8_VGROUP * CB_Q8_VGROUP; k_ < (s0) + (t1) - (t0); k_ += CB_Q8_VGROUP)           \
        cb_q8_vgroup_avx2(o, sc, (t0) - (s0) + k_, t0, t1, vp + (size_t)(k_ / 2) * head_dim, vd + k_, head_dim, NH)
#define CB_PREPARE_AVX2(pass, b0, b1)                                                                          \
    if (KV == CB_KV_Q8 && pass == 1)                                                                          \
        cb_q8_vpairs_avx2(vp, vd, vbase, (b0) % ring, ((b1) - (b0) + CB_Q8_VGROUP - 1) / CB_Q8_VGROUP * (CB_Q8_VGROUP / 2), \
                          ring, head_dim)
#define CB_SOFTMAX_AVX2(j, sc, n) CB_ATTN_SOFTMAX_HEADS(cb_softmax_avx2, sc, n, sinks, h0, NH)
#define CB_EXPS_AVX2(j, sc, n) CB_ATTN_EXPS_HEADS(cb_softmax_unnormalized_avx2, sc, n, sinks, h0, NH, inv_sum[j])
    if (KV == CB_KV_Q8) {
        float inv_sum[CB_ATTN_QBLOCK][8];         /* [query][head] 1 / its softmax's sum */
        CB_ATTEND_QBLOCK_BODY(CB_SCORES_AVX2, CB_VALUES_Q8_AVX2, cb_q8_block_rows(head_dim), CB_Q8_VGROUP,
                              CB_PREPARE_AVX2, CB_EXPS_AVX2, CB_ATTN_FINISH_Q8)
    } else {
        CB_ATTEND_QBLOCK_BODY(CB_SCORES_AVX2, CB_VALUES_AVX2, CB_ATTN_KBLOCK_ROWS(rbytes), 1, CB_PREPARE_AVX2,
                              CB_SOFTMAX_AVX2, CB_ATTN_NO_FINISH)
    }
#undef CB_SOFTMAX_AVX2
#undef CB_EXPS_AVX2
#undef CB_SCORES_AVX2
#undef CB_VALUES_AVX2
#undef CB_VALUES_Q8_AVX2
#undef CB_PREPARE_AVX2
}

/* The query heads a unit of decode's attention takes over a q8 cache on this tier and over any
 * cache on the AVX-512 tier (cb_kernel_table.attend_heads_q8, .attend_heads): a KV head of
 * Qwen3-MoE or gpt-oss. */
#define CB_ATTN_HEADS_WIDE 8
/* Key rows a block of decode's q8 scores: 8.4 KB at head_dim 128, so the second 4 heads find the
 * block in L1 (up to head_dim ~480). */
#define CB_Q8_DECODE_KROWS 64

/* One query's q8 attention (cb_attend_fn) for NH <= CB_ATTN_HEADS_WIDE query heads of a KV head:
 * integer sums of codes (cb_q8_score), the softmax's exponentials (cb_softmax_unnormalized), the
 * values in groups of CB_Q8_VGROUP aligned positions (cb_q8_vgroup_avx2), each output times 1 /
 * its sum. A block of CB_Q8_DECODE_KROWS key rows is scored 4 heads at a time, the first 4
 * prefetching the rows ahead and the next 4 finding the block in L1, and a group's value rows are
 * turned into int16 pairs once for all the heads (at 4 heads a call, the 8 heads of a KV head of
 * Qwen3-MoE or gpt-oss would convert the value rows twice). Every score and output is the
 * same sequence of operations whatever NH, so the bits are the prompt's and the other tiers'. */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_attend_q8_avx2(float *out, const float *q, const void *k_cache, const void *v_cache, float *scores, int sc_stride,
                  int h0, int kvh, int head_dim_, int start, int pos, int ring, float scale, const float *sinks,
                  const int NH, const int HD) {
    const int head_dim = HD ? HD : head_dim_;          /* a constant where HD is: the loops unroll */
    const size_t rbytes = cb_kv_row_bytes(head_dim, CB_KV_Q8);
    const int n = pos - start + 1, qlen = cb_q8_qlen(head_dim);
    const int NA = NH < 4 ? NH : 4, NB = NH - NA;      /* the heads of the first and second 4 */
    const char *kbase = (const char *)k_cache + (size_t)kvh * ring * rbytes;
    const char *vbase = (const char *)v_cache + (size_t)kvh * ring * rbytes;
    int8_t qc[CB_ATTN_HEADS_WIDE * CB_KV_Q8_MAX_HEAD_DIM];
    cb_q8_query m[CB_ATTN_HEADS_WIDE];
    float *sc[CB_ATTN_HEADS_WIDE], *o[CB_ATTN_HEADS_WIDE], inv[CB_ATTN_HEADS_WIDE];
    for (int i = 0; i < NH; i++) {
        sc[i] = scores + (size_t)(h0 + i) * sc_stride;
        o[i] = out + (size_t)(h0 + i) * head_dim;
        cb_q8_query_quantize_avx2(qc + (size_t)i * qlen, &m[i], q + (size_t)(h0 + i) * head_dim, head_dim, scale);
    }
    for (int t0 = 0, row_t0 = start % ring; t0 < n; t0 += CB_Q8_DECODE_KROWS) {
        const int t1 = n - t0 > CB_Q8_DECODE_KROWS ? t0 + CB_Q8_DECODE_KROWS : n;
        cb_q8_span_scores_avx2(sc, qc, qlen, m, kbase, t0, t1, row_t0, ring, head_dim, CB_ATTN_PREFETCH, NA);
        if (NB)
            cb_q8_span_scores_avx2(sc + 4, qc + (size_t)4 * qlen, qlen, m + 4, kbase, t0, t1, row_t0, ring, head_dim,
                                   0, NB);
        row_t0 = (int)(((int64_t)row_t0 + (t1 - t0)) % ring);
    }
    CB_ATTN_EXPS_HEADS(cb_softmax_unnormalized_avx2, sc, n, sinks, h0, NH, inv)
    int32_t vp[CB_Q8_VGROUP / 2 * CB_KV_Q8_MAX_HEAD_DIM];
    float vd[CB_Q8_VGROUP];
    for (int g0 = start - start % CB_Q8_VGROUP; g0 <= pos; g0 += CB_Q8_VGROUP) {
        cb_attn_prefetch_rows(vbase, g0 + CB_Q8_VGROUP, g0 + 2 * CB_Q8_VGROUP, ring, rbytes);
        cb_q8_vpairs_avx2(vp, vd, vbase, g0 % ring, CB_Q8_VGROUP / 2, ring, head_dim);
        cb_q8_vgroup_avx2(o, (const float *const *)sc, g0 - start, 0, n, vp, vd, head_dim, NA);
        if (NB) cb_q8_vgroup_avx2(o + 4, (const float *const *)sc + 4, g0 - start, 0, n, vp, vd, head_dim, NB);
    }
    cb_q8_scale_outputs(o, inv, head_dim, NH);
}

/* CALL(k, ...) for k = nh query heads, a constant from 1 to 8 (8: more), so each unit size
 * compiles with its own register tiles: the AVX2 tier's q8 decode and every AVX-512 attention
 * entry's dispatch. */
#define CB_SWITCH_HEADS8(nh, CALL, ...)        \
    switch (nh) {                              \
    case 1: CALL(1, __VA_ARGS__); break;       \
    case 2: CALL(2, __VA_ARGS__); break;       \
    case 3: CALL(3, __VA_ARGS__); break;       \
    case 4: CALL(4, __VA_ARGS__); break;       \
    case 5: CALL(5, __VA_ARGS__); break;       \
    case 6: CALL(6, __VA_ARGS__); break;       \
    case 7: CALL(7, __VA_ARGS__); break;       \
    default: CALL(8, __VA_ARGS__); break;      \
    }

CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_attend_heads_kv_avx2(float *out, const float *q, const void *k_cache, const void *v_cache, float *scores,
                        int sc_stride, int h0, int nh, int kvh, int head_dim, int start, int pos, int ring,
                        float scale, const float *sinks, const int KV) {
    if (head_dim % 8) {
        for (int h = h0; h < h0 + nh; h++)
            cb_attend_head(out, q, k_cache, v_cache, scores + (size_t)h * sc_stride, h, kvh, head_dim,
                           start, pos, ring, scale, sinks, KV == CB_KV_F16 ? cb_dot_f16_avx2 : cb_dot_f32_avx2, KV);
        return;
    }
    if (KV == CB_KV_Q8) {                              /* up to CB_ATTN_HEADS_WIDE heads at once */
#define CB_ATTEND_Q8(k, hd) cb_attend_q8_avx2(out, q, k_cache, v_cache, scores, sc_stride, h0, kvh, head_dim, start, \
                                              pos, ring, scale, sinks, k, hd)
        if (head_dim == 64) CB_SWITCH_HEADS8(nh, CB_ATTEND_Q8, 64)
        else if (head_dim == 128) CB_SWITCH_HEADS8(nh, CB_ATTEND_Q8, 128)
        else CB_SWITCH_HEADS8(nh, CB_ATTEND_Q8, 0)
#undef CB_ATTEND_Q8
        return;
    }
    for (int g = 0; g < nh; g += CB_ATTN_HEADS) {      /* f32, f16: 4 heads a call */
        const int hg = h0 + g, ng = nh - g < CB_ATTN_HEADS ? nh - g : CB_ATTN_HEADS;
#define CB_ATTEND_NH(k, hd) cb_attend_group_avx2(out, q, k_cache, v_cache, scores, sc_stride, hg, kvh, \
                                                 head_dim, start, pos, ring, scale, sinks, k, hd, KV)
#define CB_ATTEND_HD(hd)                  \
    switch (ng) {                         \
    case 1: CB_ATTEND_NH(1, hd); break;   \
    case 2: CB_ATTEND_NH(2, hd); break;   \
    case 3: CB_ATTEND_NH(3, hd); break;   \
    default: CB_ATTEND_NH(4, hd); break;  \
    }
        if (head_dim == 64) CB_ATTEND_HD(64)
        else if (head_dim == 128) CB_ATTEND_HD(128)
        else CB_ATTEND_HD(0)
#undef CB_ATTEND_HD
#undef CB_ATTEND_NH
    }
}

CB_TARGET_AVX2 static void cb_attend_heads_avx2(float *out, const float *q, const void *k_cache, const void *v_cache,
                                                float *scores, int sc_stride, int h0, int nh, int kvh,
                                                int head_dim, int start, int pos, int ring, float scale,
                                                const float *sinks, int kv) {
    if (kv == CB_KV_F16)
        cb_attend_heads_kv_avx2(out, q, k_cache, v_cache, scores, sc_stride, h0, nh, kvh, head_dim, start, pos, ring,
                                scale, sinks, CB_KV_F16);
    else if (kv == CB_KV_Q8)
        cb_attend_heads_kv_avx2(out, q, k_cache, v_cache, scores, sc_stride, h0, nh, kvh, head_dim, start, pos, ring,
                                scale, sinks, CB_KV_Q8);
    else
        cb_attend_heads_kv_avx2(out, q, k_cache, v_cache, scores, sc_stride, h0, nh, kvh, head_dim, start, pos, ring,
                                scale, sinks, CB_KV_F32);
}

CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_attend_block_kv_avx2(float *out, int ldo, const float *q, int ldq, int nq, const void *k_cache, const void *v_cache,
                        float *scores, int sc_stride, int h0, int nh, int kvh, int head_dim, int pos0, int window,
                        int ring, float scale, const float *sinks, int8_t *qc, cb_q8_query *m, int32_t *vp,
                        float *vd, const int R, const int KV) {
    if (head_dim % 8) {                                 /* as cb_attend_heads_kv_avx2: head by head */
        for (int j = 0; j < nq; j++)
            for (int h = h0; h < h0 + nh; h++)
                cb_attend_head(out + (size_t)j * ldo, q + (size_t)j * ldq, k_cache, v_cache,
                               scores + ((size_t)j * CB_ATTN_BLOCK_HEADS_MAX + h - h0) * sc_stride, h, kvh, head_dim,
                               cb_window_start(pos0 + j, window), pos0 + j, ring, scale, sinks,
                               KV == CB_KV_F16 ? cb_dot_f16_avx2 : cb_dot_f32_avx2, KV);
        return;
    }
#define CB_ATTEND_NH(k, hd) cb_attend_qblock_group_avx2(out, ldo, q, ldq, nq, k_cache, v_cache, scores, sc_stride, \
                                                        h0, kvh, head_dim, pos0, window, ring, scale, sinks, qc, m, vp, vd, \
                                                        k, hd, R, KV)
#define CB_ATTEND_HD(hd)                  \
    switch (nh) {                         \
    case 1: CB_ATTEND_NH(1, hd); break;   \
    case 2: CB_ATTEND_NH(2, hd); break;   \
    case 3: CB_ATTEND_NH(3, hd); break;   \
    default: CB_ATTEND_NH(4, hd); break;  \
    }
    if (head_dim == 64) CB_ATTEND_HD(64)
    else if (head_dim == 128) CB_ATTEND_HD(128)
    else CB_ATTEND_HD(0)
#undef CB_ATTEND_HD
#undef CB_ATTEND_NH
}

CB_TARGET_AVX2 static void cb_attend_block_avx2(float *out, int ldo, const float *q, int ldq, int nq, const void *k_cache,
                                                const void *v_cache, float *scores, int sc_stride, int h0, int nh,
                                                int kvh, int head_dim, int pos0, int window, int ring, float scale,
                                                const float *sinks, int kv) {
    if (kv == CB_KV_F16)
        cb_attend_block_kv_avx2(out, ldo, q, ldq, nq, k_cache, v_cache, scores, sc_stride, h0, nh, kvh, head_dim, pos0,
                                window, ring, scale, sinks, NULL, NULL, NULL, NULL, 2, CB_KV_F16);
    else if (kv == CB_KV_Q8) {
        int8_t qc[CB_ATTN_QBLOCK * CB_ATTN_HEADS * CB_KV_Q8_MAX_HEAD_DIM];   /* the block's quantized query heads */
        cb_q8_query m[CB_ATTN_QBLOCK * CB_ATTN_HEADS];
        int32_t vp[CB_Q8_VP_INT32];                                          /* a block's value pairs */
        float vd[CB_Q8_KBLOCK_BYTES / CB_Q8_QALIGN + CB_Q8_VGROUP];
        cb_attend_block_kv_avx2(out, ldo, q, ldq, nq, k_cache, v_cache, scores, sc_stride, h0, nh, kvh, head_dim, pos0,
                                window, ring, scale, sinks, qc, m, vp, vd, 2, CB_KV_Q8);
    } else
        cb_attend_block_kv_avx2(out, ldo, q, ldq, nq, k_cache, v_cache, scores, sc_stride, h0, nh, kvh, head_dim, pos0,
                                window, ring, scale, sinks, NULL, NULL, NULL, NULL, 2, CB_KV_F32);
}

/* ---- the interleaved layout (int8/int4, quant.h) ---------------------------------------------
 *
 * A group's vector c holds inputs 4c..4c+3 of its 8 outputs, so 4 activation bytes broadcast to
 * every int32 lane multiply all 8 outputs at once and each output's sum stays in its own lane: per
 * block and token, int8 is 8 x (sign, sign, maddubs, madd, add) and int4 8 maddubs adding up in
 * int16 (as the repacked prefill: |sum| <= 30480) before one madd, minus 8 * sum(x) (acts->s) for
 * the nibbles' offset — no hadd tree, no repacking, and for decode a thread's groups are one
 * contiguous read. The same tile serves decode (T = 1, a group's whole row of blocks in
 * registers) and prefill (4-token tiles over CB_TPREFILL_KBLOCKS blocks of a group, which stay in
 * L1 across the tiles). The int32 block sums are exact and each output adds its blocks in order
 * with the transposed kernels' fmadd, so the three layouts give the same bits on this tier, and
 * prefill equals decode. kernels_vnni.h has the same tile with a VNNI step. mxfp4 is int4's tile
 * with each nibble shuffled to its doubled value + 12 (cb_mxfp4_u12) and 12 * sum(x) taken off;
 * its int16 sums (up to 2 x 2 x 24 x 127 a vector) go to int32 every two vectors. */

/* out[j * ldo + 0..7] = one interleaved group's 8 outputs for T tokens (acts[j]), over its blocks
 * kb0..kb1-1 at gp (block kb0 first); `first`: start from zero, otherwise continue the sums in out. */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_igroup_avx2(float *out, int ldo, const char *gp, int dtype, const cb_act_q8 *acts, int kb0, int kb1, int first,
               const int T) {
    const __m256i ones = _mm256_set1_epi16(1);
    const size_t gbytes = cb_group_bytes(dtype);
    const int8_t *xq[4];
    const float *xd[4];
    const int32_t *xs[4], *xoff[4];
    __m256 acc[4];
    for (int j = 0; j < T; j++) {       /* locals: out's stores could alias int8_t (cb_tpacked_group_avx2) */
        xq[j] = acts[j].q;
        xd[j] = acts[j].d;
        xs[j] = acts[j].s;
        xoff[j] = acts[j].nl4_off;
        acc[j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + (size_t)j * ldo);
    }
    for (int kb = kb0; kb < kb1; kb++, gp += gbytes) {
        __m256i isum[4];
        if (dtype == CB_INT8) {
            const cb_igroup_int8 *g = (const cb_igroup_int8 *)gp;
            for (int j = 0; j < T; j++) isum[j] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)g->qs[c]), aw = _mm256_sign_epi8(w, w);
                for (int j = 0; j < T; j++) {
                    const __m256i x = CB_BCAST4(xq[j] + kb * CB_QBLOCK + 4 * c);
                    isum[j] = _mm256_add_epi32(isum[j], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)), ones));
                    CB_IN_ORDER(isum[j]);
                }
            }
        } else if (dtype == CB_NL4) {      /* two chains, int32 at once: a vector's pair sums reach 30480 */
            __m256i hsum[4];
            for (int j = 0; j < T; j++) {
                isum[j] = _mm256_set1_epi32(xoff[j][2 * kb]);
                hsum[j] = _mm256_set1_epi32(xoff[j][2 * kb + 1]);
            }
            for (int v = 0; v < 4; v++) {
                __m256i lo, hi;
                cb_inibbles_avx2(gp, dtype, v, &lo, &hi);
                for (int j = 0; j < T; j++) {
                    const int8_t *x = xq[j] + kb * CB_QBLOCK + 4 * v;
                    isum[j] = _mm256_add_epi32(isum[j], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, CB_BCAST4(x)), ones));
                    hsum[j] = _mm256_add_epi32(hsum[j], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, CB_BCAST4(x + 16)), ones));
                    CB_IN_ORDER(isum[j]);
                }
            }
            __m256i slo, shi;
            cb_nl4_scales_avx2(gp, &slo, &shi);
            for (int j = 0; j < T; j++)
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_mullo_epi32(isum[j], slo),
                                                                             _mm256_mullo_epi32(hsum[j], shi))),
                                         _mm256_set1_ps(xd[j][kb]), acc[j]);
            continue;
        } else {
            const int32_t offset = cb_code_offset(dtype, 0);
            __m256i p16[4];
            for (int j = 0; j < T; j++) {
                p16[j] = _mm256_setzero_si256();
                isum[j] = _mm256_set1_epi32(-offset * xs[j][kb]);
            }
            for (int v = 0; v < 4; v++) {
                __m256i lo, hi;
                cb_inibbles_avx2(gp, dtype, v, &lo, &hi);
                for (int j = 0; j < T; j++) {
                    const int8_t *x = xq[j] + kb * CB_QBLOCK + 4 * v;
                    p16[j] = _mm256_add_epi16(p16[j], _mm256_add_epi16(_mm256_maddubs_epi16(lo, CB_BCAST4(x)),
                                                                       _mm256_maddubs_epi16(hi, CB_BCAST4(x + 16))));
                    CB_IN_ORDER(p16[j]);
                }
                if ((dtype == CB_MXFP4 && v == 1) || dtype == CB_INT6)   /* mxfp4: two vectors' sums, up to
                                                                   24384 in int16; int6: one's, 32004 */
                    for (int j = 0; j < T; j++) {
                        isum[j] = _mm256_add_epi32(isum[j], _mm256_madd_epi16(p16[j], ones));
                        p16[j] = _mm256_setzero_si256();
                    }
            }
            for (int j = 0; j < T; j++) isum[j] = _mm256_add_epi32(isum[j], _mm256_madd_epi16(p16[j], ones));
        }
        const __m256 dw = cb_igroup_scales_avx2(gp, dtype);
        for (int j = 0; j < T; j++)
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j]), _mm256_mul_ps(dw, _mm256_set1_ps(xd[j][kb])), acc[j]);
    }
    for (int j = 0; j < T; j++) _mm256_storeu_ps(out + (size_t)j * ldo, acc[j]);
}

/* A tile's share of the next groups' weights to prefetch into L2 (the interleaved prompt tiles:
 * this file's pair tile, kernels_vnni.h's quad tile): `lines` 64-byte lines from p, 8 a block
 * (from the tile's first block on) until they are done. The next pair (quad) of groups is one
 * span of bytes (the groups are stored one after another), spread evenly over the current one's
 * tiles and chunks: with the weights coming from memory, the next groups arrive while the current
 * ones are multiplied, and spread thin, into L2, the requests neither come in a burst nor push the
 * current chunk out of L1. The count a block is fixed, not one that follows the share (a loop of
 * variable length in the tile takes registers the tile's sums need). nl4's 512-bit pair tile keeps
 * its burst into L1 instead (kernels_vnni.h), which that tile runs faster with. */
#define CB_PREFETCH_LINES_PER_BLOCK 8
typedef struct {
    const char *p;
    int lines;
} cb_prefetch_run;

static CB_ALWAYS_INLINE void cb_prefetch_lines(cb_prefetch_run *r, const int count) {
    if (r->lines > 0) {
        for (int i = 0; i < count; i++) _mm_prefetch(r->p + 64 * i, _MM_HINT_T1);
        r->p += 64 * count;
        r->lines -= count;
    }
}

/* Share `call` of `calls` of the `bytes` at base; none where base is NULL. */
static inline cb_prefetch_run cb_prefetch_share(const char *base, size_t bytes, int call, int calls) {
    cb_prefetch_run r = {base, 0};
    if (!base) return r;
    const size_t total = (bytes + 63) / 64, l0 = total * call / calls, l1 = total * (call + 1) / calls;
    r.p = base + 64 * l0;
    r.lines = (int)(l1 - l0);
    return r;
}

/* ---- the prompt's interleaved tile on packed activations: two groups a tile ----------------
 *
 * cb_igroup_avx2 above, at 4 tokens, kept its tokens' q/d/s pointers on the stack (reloaded every
 * block), moved each block's offset (-8 x s) from a general register into a vector, and unpacked a
 * group's nibbles for 4 tokens only. For a prompt (n > 1) the activations are packed once per call
 * into cb_act_block4 tiles (one pointer, constant offsets; the offset's int32 ready to broadcast
 * from memory), and the groups go two at a time (cb_igroup2_avx2: each activation broadcast
 * feeds both groups' products). Every output's lane does the same exact integer block sums, scaled
 * and added block by block in the same order as cb_igroup_avx2, so the bits are the same and
 * prefill still equals decode. mxfp4 (its shuffles take the registers a second group needs) and
 * nl4 (two scales a block) keep cb_igroup_avx2, as do decode and a thread's odd last group.
 * Packing costs about one group's products, so a call of fewer than CB_ITILE2_MIN_GROUPS_AVX2
 * groups, which would not earn it back, stays on cb_igroup_avx2. */
#define CB_ITILE_AVX2_TOKENS 4
#define CB_ITILE2_MIN_GROUPS_AVX2 32
typedef struct {
    int32_t q[8][CB_ITILE_AVX2_TOKENS];     /* [unit u][token j]: bytes 4u..4u+3 of token j's block */
    int32_t bias[CB_ITILE_AVX2_TOKENS];     /* [token j] the int32 sum's start: -offset * s (int8: 0) */
    float d[CB_ITILE_AVX2_TOKENS];          /* [token j] the block's activation scale */
} cb_act_block4;

/* Tokens acts[0..T-1], blocks 0..nb-1, into tile[nb] (slots past T are zero). int4, int8, int6. */
static void cb_pack_act_block4(cb_act_block4 *tile, const cb_act_q8 *acts, int T, int nb, int dtype) {
    const int32_t offset = cb_code_offset(dtype, 0);
    memset(tile, 0, (size_t)nb * sizeof(cb_act_block4));
    for (int j = 0; j < T; j++) {
        const cb_act_q8 *a = &acts[j];
        for (int kb = 0; kb < nb; kb++) {
            cb_act_block4 *b = &tile[kb];
            for (int u = 0; u < 8; u++) memcpy(&b->q[u][j], a->q + (size_t)kb * CB_QBLOCK + 4 * u, 4);
            b->bias[j] = -offset * a->s[kb];
            b->d[j] = a->d[kb];
        }
    }
}

/* out[j * ldo + 0..15] (+)= groups g and g + 1 (at gp and gp + gstride, blocks kb0..kb1-1) for T
 * tokens of the packed tile: cb_igroup_avx2's arithmetic on both groups at once. */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_igroup2_avx2(float *out, int ldo, const char *gp, size_t gstride, int dtype, const cb_act_block4 *tile, int kb0,
                int kb1, int first, cb_prefetch_run pf, const int T) {
    const __m256i ones = _mm256_set1_epi16(1);
    const size_t gbytes = cb_group_bytes(dtype);
    __m256 acc[CB_ITILE_AVX2_TOKENS][2];
    for (int j = 0; j < T; j++)
        for (int p = 0; p < 2; p++) acc[j][p] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + (size_t)j * ldo + 8 * p);
    for (int kb = kb0; kb < kb1; kb++, gp += gbytes) {
        const cb_act_block4 *b = &tile[kb];
        cb_prefetch_lines(&pf, CB_PREFETCH_LINES_PER_BLOCK);  /* this tile's share of the next pair */
        __m256i isum[CB_ITILE_AVX2_TOKENS][2];
        for (int j = 0; j < T; j++) isum[j][0] = isum[j][1] = _mm256_set1_epi32(b->bias[j]);
        if (dtype == CB_INT8) {
            for (int c = 0; c < 8; c++) {
                __m256i w[2], aw[2];
                for (int p = 0; p < 2; p++) {
                    w[p] = _mm256_loadu_si256((const __m256i *)((const cb_igroup_int8 *)(gp + p * gstride))->qs[c]);
                    aw[p] = _mm256_sign_epi8(w[p], w[p]);
                }
                for (int j = 0; j < T; j++) {
                    const __m256i x = _mm256_set1_epi32(b->q[c][j]);
                    for (int p = 0; p < 2; p++) {
                        isum[j][p] = _mm256_add_epi32(isum[j][p], _mm256_madd_epi16(_mm256_maddubs_epi16(aw[p], _mm256_sign_epi8(x, w[p])), ones));
                        CB_IN_ORDER(isum[j][p]);
                    }
                }
            }
        } else {
            __m256i p16[CB_ITILE_AVX2_TOKENS][2];
            for (int j = 0; j < T; j++) p16[j][0] = p16[j][1] = _mm256_setzero_si256();
            for (int v = 0; v < 4; v++) {
                __m256i lo[2], hi[2];
                for (int p = 0; p < 2; p++) cb_inibbles_avx2(gp + p * gstride, dtype, v, &lo[p], &hi[p]);
                for (int j = 0; j < T; j++) {
                    const __m256i xl = _mm256_set1_epi32(b->q[v][j]), xh = _mm256_set1_epi32(b->q[4 + v][j]);
                    for (int p = 0; p < 2; p++) {
                        p16[j][p] = _mm256_add_epi16(p16[j][p], _mm256_add_epi16(_mm256_maddubs_epi16(lo[p], xl),
                                                                                 _mm256_maddubs_epi16(hi[p], xh)));
                        CB_IN_ORDER(p16[j][p]);
                    }
                }
                if (dtype == CB_INT6)              /* one vector's sums reach 32004 in int16 (cb_igroup_avx2) */
                    for (int j = 0; j < T; j++)
                        for (int p = 0; p < 2; p++) {
                            isum[j][p] = _mm256_add_epi32(isum[j][p], _mm256_madd_epi16(p16[j][p], ones));
                            p16[j][p] = _mm256_setzero_si256();
                        }
            }
            for (int j = 0; j < T; j++)
                for (int p = 0; p < 2; p++) isum[j][p] = _mm256_add_epi32(isum[j][p], _mm256_madd_epi16(p16[j][p], ones));
        }
        const __m256 dw[2] = {cb_igroup_scales_avx2(gp, dtype), cb_igroup_scales_avx2(gp + gstride, dtype)};
        for (int j = 0; j < T; j++) {
            const __m256 dx = _mm256_set1_ps(b->d[j]);
            for (int p = 0; p < 2; p++)
                acc[j][p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j][p]), _mm256_mul_ps(dw[p], dx), acc[j][p]);
        }
    }
    for (int j = 0; j < T; j++)
        for (int p = 0; p < 2; p++) _mm256_storeu_ps(out + (size_t)j * ldo + 8 * p, acc[j][p]);
}

/* Decode: G groups at once, streams `gstride` bytes apart (outputs `ostride` floats apart), over
 * all nb blocks: G read streams per thread instead of one (the transposed decode's lesson:
 * CB_TDECODE_ROWS), and one activation broadcast serves G groups. Each group's arithmetic is
 * cb_igroup_avx2's for T = 1: the same bits. */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_idecode_avx2(float *out, size_t ostride, const char *gp, size_t gstride, int dtype, const cb_act_q8 *act, int nb,
                const int G) {
    const __m256i ones = _mm256_set1_epi16(1);
    const size_t gbytes = cb_group_bytes(dtype);
    const int8_t *xq = act->q;
    const float *xd = act->d;
    const int32_t *xs = act->s, *xoff = act->nl4_off;
    __m256 acc[4];
    for (int k = 0; k < G; k++) acc[k] = _mm256_setzero_ps();
    for (int kb = 0; kb < nb; kb++, gp += gbytes) {
        __m256i isum[4];
        const int8_t *x = xq + kb * CB_QBLOCK;
        if (dtype == CB_INT8) {
            for (int k = 0; k < G; k++) isum[k] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i xb = CB_BCAST4(x + 4 * c);
                for (int k = 0; k < G; k++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)((const cb_igroup_int8 *)(gp + k * gstride))->qs[c]);
                    isum[k] = _mm256_add_epi32(isum[k], _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w),
                                                                                               _mm256_sign_epi8(xb, w)), ones));
                }
            }
        } else if (dtype == CB_NL4) {      /* as cb_igroup_avx2's nl4 branch */
            __m256i hsum[4];
            for (int k = 0; k < G; k++) {
                isum[k] = _mm256_set1_epi32(xoff[2 * kb]);
                hsum[k] = _mm256_set1_epi32(xoff[2 * kb + 1]);
            }
            for (int v = 0; v < 4; v++) {
                const __m256i xl = CB_BCAST4(x + 4 * v), xhi = CB_BCAST4(x + 16 + 4 * v);
                for (int k = 0; k < G; k++) {
                    __m256i lo, hi;
                    cb_inibbles_avx2(gp + k * gstride, dtype, v, &lo, &hi);
                    isum[k] = _mm256_add_epi32(isum[k], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl), ones));
                    hsum[k] = _mm256_add_epi32(hsum[k], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xhi), ones));
                }
            }
            const __m256 dx = _mm256_set1_ps(xd[kb]);
            for (int k = 0; k < G; k++)
                acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(cb_nl4_scaled_avx2(gp + k * gstride, isum[k], hsum[k])), dx, acc[k]);
            continue;
        } else {
            const int32_t offset = cb_code_offset(dtype, 0);
            /* With 16 ymm registers GCC spilled this loop's sums to the stack (it regroups the
             * associative adds into one tree, as in cb_igroup_avx2): every sum is materialised in
             * order (CB_IN_ORDER), and int4 adds the offset's sum after the loop, not before it (4
             * vectors fewer live across it). Integer sums: the same bits. */
            const int partial = dtype == CB_MXFP4 || dtype == CB_INT6;    /* isum takes partial sums */
            __m256i p16[4];
            for (int k = 0; k < G; k++) {
                p16[k] = _mm256_setzero_si256();
                if (partial) isum[k] = _mm256_set1_epi32(-offset * xs[kb]);
            }
            for (int v = 0; v < 4; v++) {
                const __m256i xl = CB_BCAST4(x + 4 * v), xh = CB_BCAST4(x + 16 + 4 * v);
                for (int k = 0; k < G; k++) {
                    __m256i lo, hi;
                    cb_inibbles_avx2(gp + k * gstride, dtype, v, &lo, &hi);
                    p16[k] = _mm256_add_epi16(p16[k], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
                    CB_IN_ORDER(p16[k]);
                }
                if ((dtype == CB_MXFP4 && v == 1) || dtype == CB_INT6)
                    for (int k = 0; k < G; k++) {
                        isum[k] = _mm256_add_epi32(isum[k], _mm256_madd_epi16(p16[k], ones));
                        CB_IN_ORDER(isum[k]);
                        p16[k] = _mm256_setzero_si256();
                    }
            }
            const __m256i off = _mm256_set1_epi32(-offset * xs[kb]);
            for (int k = 0; k < G; k++)
                isum[k] = _mm256_add_epi32(partial ? isum[k] : off, _mm256_madd_epi16(p16[k], ones));
        }
        const __m256 dx = _mm256_set1_ps(xd[kb]);
        for (int k = 0; k < G; k++) {
            const __m256 dw = cb_igroup_scales_avx2(gp + k * gstride, dtype);
            acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[k]), _mm256_mul_ps(dw, dx), acc[k]);
        }
    }
    for (int k = 0; k < G; k++) _mm256_storeu_ps(out + k * ostride, acc[k]);
}

/* Two int4 tokens (sequences decoded together: most experts of a batched step get one or two
 * tokens): vnni_body.h's cb_ifew for one pass of 2 tokens, on maddubs. Decode's order: G groups
 * read side by side, `gstride` bytes apart (CB_IDECODE_LOOP's streams), each stream's lines
 * CB_IFEW_PREFETCH ahead, both tokens over every block as it passes. out[j * ldo + k * ostride +
 * 0..7], k < G, j < 2. Each token's block sum is cb_idecode_avx2's integer sum and its scaling the
 * same fma in the same order: the same bits as decode and the prompt tiles. At G = 4 the 8 float
 * sums and 8 int16 sums do not fit the 16 ymm registers with the weights and broadcasts: GCC keeps
 * some on the stack, touched once a block, which a tile waiting on memory affords. The prompt's
 * pair tile reads a thread's weights as one stream; at 2 tokens the reads, not the arithmetic, are
 * the limit, and G streams read faster than one (as decode's do). int6 and mxfp4 (their partial
 * sums take 8 more registers: slower here) and int8 (its 2 tokens already read at the decode
 * tile's rate) keep the prompt tiles, as do 3+ tokens, where the arithmetic, not the reads, is the
 * limit. */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_ifew2_int4_avx2(float *out, int ldo, size_t ostride, const char *gp, size_t gstride, const cb_act_q8 *acts, int nb,
                   const int G) {
    const __m256i ones = _mm256_set1_epi16(1);
    const size_t gbytes = cb_group_bytes(CB_INT4);
    const int32_t offset = cb_code_offset(CB_INT4, 0);
    const int8_t *xq[2] = {acts[0].q, acts[1].q};
    const float *xd[2] = {acts[0].d, acts[1].d};
    const int32_t *xs[2] = {acts[0].s, acts[1].s};
    __m256 acc[CB_IDECODE_STREAMS][2];                 /* [stream k][token j] */
    for (int k = 0; k < G; k++) acc[k][0] = acc[k][1] = _mm256_setzero_ps();
    for (int kb = 0; kb < nb; kb++, gp += gbytes) {
        for (int k = 0; k < G; k++)    /* a block's lines (or their neighbours) of each stream, ahead */
            for (size_t off = 0; off < gbytes; off += 64) _mm_prefetch(gp + k * gstride + CB_IFEW_PREFETCH + off, CB_IFEW_HINT);
        __m256i p16[CB_IDECODE_STREAMS][2];
        for (int k = 0; k < G; k++) p16[k][0] = p16[k][1] = _mm256_setzero_si256();
        for (int v = 0; v < 4; v++) {
            __m256i xl[2], xh[2];
            for (int j = 0; j < 2; j++) {
                xl[j] = CB_BCAST4(xq[j] + kb * CB_QBLOCK + 4 * v);
                xh[j] = CB_BCAST4(xq[j] + kb * CB_QBLOCK + 16 + 4 * v);
            }
            for (int k = 0; k < G; k++) {
                __m256i lo, hi;
                cb_inibbles_avx2(gp + k * gstride, CB_INT4, v, &lo, &hi);
                for (int j = 0; j < 2; j++) {
                    p16[k][j] = _mm256_add_epi16(p16[k][j], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl[j]),
                                                                             _mm256_maddubs_epi16(hi, xh[j])));
                    CB_IN_ORDER(p16[k][j]);
                }
            }
        }
        for (int k = 0; k < G; k++) {
            const __m256 dw = cb_igroup_scales_avx2(gp + k * gstride, CB_INT4);
            for (int j = 0; j < 2; j++) {
                const __m256i sum = _mm256_add_epi32(_mm256_set1_epi32(-offset * xs[j][kb]), _mm256_madd_epi16(p16[k][j], ones));
                acc[k][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dw, _mm256_set1_ps(xd[j][kb])), acc[k][j]);
            }
        }
    }
    for (int k = 0; k < G; k++)
        for (int j = 0; j < 2; j++) _mm256_storeu_ps(out + (size_t)j * ldo + k * ostride, acc[k][j]);
}

/* ---- interleaved bf16 (cb_igroup_bf16), widened to f32 -----------------------------------------
 * A group's vector c (64 bytes) is two 256-bit halves, outputs 0-3 and 4-7, each lane 2o + p a pair
 * of bf16 weights (inputs 4c + 2p and + 1): shifted left 16 bits it is the lower input's weight as
 * f32, masked the higher one's, each multiplied by that input broadcast in the same pattern
 * (x[4c], x[4c + 2] and x[4c + 1], x[4c + 3], one in-lane shuffle each). The two FMAs keep the
 * scalar spec's order lane for lane (cb_itile_bf16_lanes), and the hadd that ends a tile adds
 * lane 0 and lane 1 of each output, so this tile gives the scalar tier's bits. A group's weights
 * are contiguous (its blocks in order), read once per tile of up to 4 tokens (16-64 KB: L1 or
 * L2); decode takes 4 groups side by side, as the integer formats do. */
#define CB_IBF16_TOKENS_AVX2 4

/* How far ahead of each of its 4 streams (bytes) the bf16 decode asks for the next line: the
 * hardware prefetchers alone do not keep the bf16 decode at the read bandwidth; a few lines ahead
 * is enough, and further ahead is slower again. The integer decode reads a quarter to half the
 * bytes per multiply and is slowed by the same prefetch: it has none. */
#define CB_IBF16_PREFETCH 512

/* A prompt's bf16 tiles (this tier's one group at a time, AVX-512's two) prefetch the next groups
 * into L2 instead, spread over the current ones' tiles of tokens (cb_prefetch_run), this many
 * lines a step of 4 inputs (64 bytes a group): at most 2 lines a step are the next groups', so a
 * lone tile still gets all of its share. */
#define CB_IBF16_PREFETCH_LINES 2
static const cb_prefetch_run cb_no_prefetch = {NULL, 0};

/* CB_XP_PAIRS: each 4 inputs as x0 x2 x1 x3, so that the prompt tile's two broadcast patterns
 * (x0 x2 x0 x2 ..., x1 x3 x1 x3 ...) are 64-bit broadcasts from memory — load-port work — instead
 * of two in-lane shuffles per token and 4 inputs, which share a pipe with the FMAs. cols % 4 == 0
 * (the interleaved layout's cols are whole blocks). */
static void cb_permute_pairs(float *xp, const float *x, int cols) {
    for (int k = 0; k + 4 <= cols; k += 4) {
        xp[k] = x[k];
        xp[k + 1] = x[k + 2];
        xp[k + 2] = x[k + 1];
        xp[k + 3] = x[k + 3];
    }
}

/* out[j * ldo + og * 8 + 0..7] = groups gp + og * gstride, og < G, times tokens j < T (G * T <= 4).
 * PAIRS (T > 1): the tokens' acts[j].xp in CB_XP_PAIRS order (the driver writes it for n > 1),
 * else acts[j].x shuffled: the same values in the same lanes, so the same bits. */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_ibf16_tile_avx2(float *out, int ldo, size_t ostride, const char *gp, size_t gstride, const cb_act_q8 *acts,
                   int cols, cb_prefetch_run pf, const int G, const int T, const int PAIRS) {
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 lo[4][CB_IBF16_TOKENS_AVX2], hi[4][CB_IBF16_TOKENS_AVX2];     /* outputs 0-3 and 4-7 */
    const float *xj[CB_IBF16_TOKENS_AVX2];   /* locals: the loop's stores could alias acts */
    for (int j = 0; j < T; j++) xj[j] = PAIRS ? acts[j].xp : acts[j].x;
    for (int g = 0; g < G; g++)
        for (int j = 0; j < T; j++) lo[g][j] = hi[g][j] = _mm256_setzero_ps();
    /* registers: 8 accumulators, a group's 4 widened vectors, one token's 2 broadcasts (16 in
     * all; holding every token's broadcasts at once would spill) */
    for (int k = 0; k < cols; k += 4, gp += 64) {
        __m256 xe = _mm256_setzero_ps(), xo = _mm256_setzero_ps();
        if (T == 1) {                                    /* decode: one token, G groups */
            const __m256 xv = _mm256_broadcast_ps((const __m128 *)(xj[0] + k));
            xe = _mm256_permute_ps(xv, 0x88);            /* x[k], x[k + 2], ... */
            xo = _mm256_permute_ps(xv, 0xDD);            /* x[k + 1], x[k + 3], ... */
            for (int g = 0; g < G; g++)                  /* each stream's line CB_IBF16_PREFETCH ahead */
                _mm_prefetch(gp + g * gstride + CB_IBF16_PREFETCH, _MM_HINT_T0);
        } else
            cb_prefetch_lines(&pf, CB_IBF16_PREFETCH_LINES);    /* this tile's share of the next group */
        for (int g = 0; g < G; g++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(gp + g * gstride));
            const __m256i b = _mm256_loadu_si256((const __m256i *)(gp + g * gstride + 32));
            const __m256 ae = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), ao = _mm256_castsi256_ps(_mm256_and_si256(a, high));
            const __m256 be = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), bo = _mm256_castsi256_ps(_mm256_and_si256(b, high));
            for (int j = 0; j < T; j++) {
                if (T > 1 && PAIRS) {
                    xe = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)(const void *)(xj[j] + k)));
                    xo = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)(const void *)(xj[j] + k + 2)));
                } else if (T > 1) {
                    const __m256 xv = _mm256_broadcast_ps((const __m128 *)(xj[j] + k));
                    xe = _mm256_permute_ps(xv, 0x88);
                    xo = _mm256_permute_ps(xv, 0xDD);
                }
                lo[g][j] = _mm256_fmadd_ps(ao, xo, _mm256_fmadd_ps(ae, xe, lo[g][j]));
                hi[g][j] = _mm256_fmadd_ps(bo, xo, _mm256_fmadd_ps(be, xe, hi[g][j]));
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int j = 0; j < T; j++)         /* [o0 o1 o4 o5 | o2 o3 o6 o7] -> in order */
            _mm256_storeu_ps(out + (size_t)j * ldo + g * ostride,
                             _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(lo[g][j], hi[g][j])), 0xD8)));
}

/* The interleaved bf16 entry (cb_itile_fn, dtype CB_BF16): groups [g0, g1), all n tokens; decode
 * takes CB_IDECODE_LOOP's split (cb_group_bytes(CB_BF16) gives a group's bytes per block). */
CB_TARGET_AVX2 static void cb_itile_bf16_avx2(float *out, int ldo, const char *w, int dtype, const cb_act_q8 *acts,
                                              int cols, int g0, int g1, int n) {
    if (n == 1) {
#define CB_CALL_ID(o, os, gp, gs, G) cb_ibf16_tile_avx2(o, 0, os, gp, gs, acts, cols, cb_no_prefetch, G, 1, 0)
        CB_IDECODE_LOOP(CB_CALL_ID)
#undef CB_CALL_ID
        return;
    }
    const size_t row = (size_t)cols * 2 * CB_TGROUP;     /* a group's bytes */
    const int pairs = acts[0].xp != NULL;                /* CB_XP_PAIRS, written by the driver */
    const int tiles = (n + CB_IBF16_TOKENS_AVX2 - 1) / CB_IBF16_TOKENS_AVX2;
    for (int g = g0; g < g1; g++)
        for (int t = 0; t < n; t += CB_IBF16_TOKENS_AVX2) {
            float *o = out + (size_t)t * ldo + (size_t)g * CB_TGROUP;
            const char *gp = w + (size_t)g * row;
            const cb_prefetch_run pf = cb_prefetch_share(g + 1 < g1 ? gp + row : NULL, row, t / CB_IBF16_TOKENS_AVX2, tiles);
#define CB_IBF16_T(T) \
    if (pairs) cb_ibf16_tile_avx2(o, ldo, 0, gp, 0, acts + t, cols, pf, 1, T, 1); \
    else cb_ibf16_tile_avx2(o, ldo, 0, gp, 0, acts + t, cols, pf, 1, T, 0);
            switch (n - t) {
            case 1: cb_ibf16_tile_avx2(o, ldo, 0, gp, 0, acts + t, cols, cb_no_prefetch, 1, 1, 0); break;
            case 2: CB_IBF16_T(2) break;
            case 3: CB_IBF16_T(3) break;
            default: CB_IBF16_T(4) break;
            }
#undef CB_IBF16_T
        }
}

/* A prompt's groups [g0, g1) two at a time on packed activations (cb_igroup2_avx2), in
 * CB_ITILE_LOOP's order (CB_TPREFILL_KBLOCKS blocks of a pair under every tile of tokens), the
 * tokens in tiles of at most 4 of even size (6 tokens: 3 + 3). Returns the first group it left to
 * the caller's tile: g1, g1 - 1 (an odd last group), or g0 where the thread's scratch cannot be had
 * (nothing written). n > 1; int4, int8 and int6. */
CB_TARGET_AVX2 static int cb_itile2_avx2(float *out, int ldo, const char *w, int dtype, const cb_act_q8 *acts,
                                         int cols, int g0, int g1, int n) {
    const int nb = cols / CB_QBLOCK, tiles = (n + CB_ITILE_AVX2_TOKENS - 1) / CB_ITILE_AVX2_TOKENS;
    cb_act_block4 *packed = (cb_act_block4 *)cb_thread_scratch(CB_SCRATCH_ACT_TILES, (size_t)tiles * nb * sizeof(cb_act_block4));
    if (!packed) return g0;
#define CB_TILE_START(i) ((int)((long long)n * (i) / tiles))   /* tile i's first token */
    for (int i = 0; i < tiles; i++)
        cb_pack_act_block4(packed + (size_t)i * nb, acts + CB_TILE_START(i), CB_TILE_START(i + 1) - CB_TILE_START(i),
                           nb, dtype);
    const size_t gbytes = cb_group_bytes(dtype), gstride = (size_t)nb * gbytes;
    const int paired = g0 + (g1 - g0) / 2 * 2;
#define CB_CALL_IG2(dt, T_) cb_igroup2_avx2(o, ldo, gp, gstride, dt, tile, kb0, kb1, kb0 == 0, pf, T_)
    const int chunks = (nb + CB_TPREFILL_KBLOCKS - 1) / CB_TPREFILL_KBLOCKS;
    for (int g = g0; g < paired; g += 2)
        for (int kb0 = 0; kb0 < nb; kb0 += CB_TPREFILL_KBLOCKS) {
            const int kb1 = kb0 + CB_TPREFILL_KBLOCKS < nb ? kb0 + CB_TPREFILL_KBLOCKS : nb;
            const char *gp = w + ((size_t)g * nb + kb0) * gbytes;
            for (int i = 0; i < tiles; i++) {
                const int t = CB_TILE_START(i), T = CB_TILE_START(i + 1) - t;
                float *o = out + (size_t)t * ldo + (size_t)g * CB_TGROUP;
                const cb_act_block4 *tile = packed + (size_t)i * nb;
                /* the next pair, as far as this call's pairs go: a share in each tile of each chunk */
                const cb_prefetch_run pf = cb_prefetch_share(g + 2 < paired ? w + (size_t)(g + 2) * gstride : NULL,
                                                             2 * gstride, kb0 / CB_TPREFILL_KBLOCKS * tiles + i,
                                                             chunks * tiles);
                if (dtype == CB_INT8) { CB_AVX2_T_CASES(CB_CALL_IG2, CB_INT8) }
                else if (dtype == CB_INT6) { CB_AVX2_T_CASES(CB_CALL_IG2, CB_INT6) }
                else { CB_AVX2_T_CASES(CB_CALL_IG2, CB_INT4) }
            }
        }
#undef CB_CALL_IG2
#undef CB_TILE_START
    return paired;
}

/* The table's interleaved entry (cb_kernel_table.itile): groups [g0, g1), all n tokens. */
CB_TARGET_AVX2 static void cb_itile_avx2(float *out, int ldo, const char *w, int dtype, const cb_act_q8 *acts,
                                         int cols, int g0, int g1, int n) {
    if (n == 1) {
#define CB_CALL_ID(o, os, gp, gs, G) \
    if (dtype == CB_INT8) cb_idecode_avx2(o, os, gp, gs, CB_INT8, acts, nb, G); \
    else if (dtype == CB_MXFP4) cb_idecode_avx2(o, os, gp, gs, CB_MXFP4, acts, nb, G); \
    else if (dtype == CB_NL4) cb_idecode_avx2(o, os, gp, gs, CB_NL4, acts, nb, G); \
    else if (dtype == CB_INT6) cb_idecode_avx2(o, os, gp, gs, CB_INT6, acts, nb, G); \
    else cb_idecode_avx2(o, os, gp, gs, CB_INT4, acts, nb, G);
        CB_IDECODE_LOOP(CB_CALL_ID)
#undef CB_CALL_ID
        return;
    }
    if (n == 2 && dtype == CB_INT4) {
#define CB_CALL_IF(o, os, gp, gs, G) cb_ifew2_int4_avx2(o, ldo, os, gp, gs, acts, nb, G);
        CB_IDECODE_LOOP(CB_CALL_IF)
#undef CB_CALL_IF
        return;
    }
    if ((dtype == CB_INT4 || dtype == CB_INT8 || dtype == CB_INT6) && g1 - g0 >= CB_ITILE2_MIN_GROUPS_AVX2)
        g0 = cb_itile2_avx2(out, ldo, w, dtype, acts, cols, g0, g1, n);    /* the tile below does the rest */
#define CB_CALL_IG(dt, tt) cb_igroup_avx2(o, ldo, gp, dt, acts + t, kb0, kb1, kb0 == 0, tt)
    CB_ITILE_LOOP(if (dtype == CB_INT8) { CB_AVX2_T_CASES(CB_CALL_IG, CB_INT8) }
                  else if (dtype == CB_MXFP4) { CB_AVX2_T_CASES(CB_CALL_IG, CB_MXFP4) }
                  else if (dtype == CB_NL4) { CB_AVX2_T_CASES(CB_CALL_IG, CB_NL4) }
                  else if (dtype == CB_INT6) { CB_AVX2_T_CASES(CB_CALL_IG, CB_INT6) }
                  else { CB_AVX2_T_CASES(CB_CALL_IG, CB_INT4) })
#undef CB_CALL_IG
}

#endif /* CB_X86 */
#endif /* COLIBRI_KERNELS_AVX2_H */
