/* kernels_avx512.h — the AVX-512 (F/BW/VL/DQ) tier's rows-layout tiles, with VNNI where present
 * (the transposed layout's integer kernels with VNNI are in kernels_vnni.h; its float ones are
 * kernels_avx2.h's).
 *
 * Every format is multiplied by tiles (R rows x T tokens, below), which serve decode and prefill
 * alike. Float formats use 16-lane FMAs with masked loads for the tail (no scalar remainder). bf16
 * weights are widened to f32 by a shift and multiplied in f32 (exact products), or, where the CPU
 * has AVX512_BF16 and the model takes bf16 products, multiplied by vdpbf16ps with the activation
 * rounded to bf16 (below). Integer formats use vpdpbusd (AVX512_VNNI) on the sign trick of kernels_avx2.h:
 * sum(w * x) = sum(|w| * sign(x, w)), one instruction per 32 byte products; they only exist as
 * tiles (below), which serve decode (1 row x 1 token) and prefill (2 rows x 4 tokens) alike.
 */
#ifndef COLIBRI_KERNELS_AVX512_H
#define COLIBRI_KERNELS_AVX512_H

#include "kernels_avx2.h"

#if CB_X86

CB_TARGET_AVX512 static inline __m512 cb_bf16x16_to_f32(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* ---- tiles: R weight rows x T tokens at once (decode: T = 1; prefill: T up to 4) -------------
 * Each (row, token) pair keeps ONE accumulator, filled in the same order whatever the tile shape,
 * so decode (matvec) and prefill (matmul) compute bitwise identical results on this tier; rows
 * share the activation loads and tokens share the weight loads and conversions. */

#define CB_TILE_MAX 4

CB_TARGET_AVX512 static inline __m512 cb_load_f32x16(const void *w, int dtype, int i, __mmask16 m) {
    if (dtype == CB_F32) return _mm512_maskz_loadu_ps(m, (const float *)w + i);
    if (dtype == CB_F16) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)w + i));
    return cb_bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)w + i));
}

/* bf16 widened by interleaving with zero words: within each 128-bit lane, unpacklo takes words
 * 0-3 and unpackhi words 4-7, so 32 weights become two f32 vectors holding elements
 * {0-3, 8-11, 16-19, 24-27} and {4-7, 12-15, 20-23, 28-31}: one instruction per 16 weights
 * instead of two. The activation is put in the same order once per product (cb_permute_bf16). */
static void cb_permute_bf16(float *xp, const float *x, int cols) {
    int full = cols / 32 * 32;
    for (int k = 0; k < full; k += 32)
        for (int lane = 0; lane < 4; lane++)
            for (int e = 0; e < 4; e++) {
                xp[k + lane * 4 + e] = x[k + lane * 8 + e];
                xp[k + 16 + lane * 4 + e] = x[k + lane * 8 + 4 + e];
            }
    for (int k = full; k < cols; k++) xp[k] = x[k];
}

CB_TARGET_AVX512 static CB_ALWAYS_INLINE void
cb_tile_float_avx512(float *out, int ldo, const char *w, size_t stride, int dtype, const float *x, int ldx,
                     const cb_act_q8 *acts, int cols, const int R, const int T) {
    __m512 acc[CB_TILE_MAX][CB_TILE_MAX];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < T; j++) acc[i][j] = _mm512_setzero_ps();
    int k0 = 0;
    if (dtype == CB_BF16 && acts[0].xp) {
        const __m512i zero = _mm512_setzero_si512();
        for (; k0 + 32 <= cols; k0 += 32) {
            __m512 lo[CB_TILE_MAX], hi[CB_TILE_MAX];
            for (int i = 0; i < R; i++) {
                __m512i raw = _mm512_loadu_si512((const void *)((const uint16_t *)(w + (size_t)i * stride) + k0));
                lo[i] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, raw));
                hi[i] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, raw));
            }
            for (int j = 0; j < T; j++) {
                __m512 xl = _mm512_loadu_ps(acts[j].xp + k0), xh = _mm512_loadu_ps(acts[j].xp + k0 + 16);
                for (int i = 0; i < R; i++) acc[i][j] = _mm512_fmadd_ps(hi[i], xh, _mm512_fmadd_ps(lo[i], xl, acc[i][j]));
            }
        }
    }
    for (int k = k0; k < cols; k += 16) {
        __mmask16 m = cols - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (cols - k)) - 1);
        __m512 wv[CB_TILE_MAX];
        for (int i = 0; i < R; i++) wv[i] = cb_load_f32x16(w + (size_t)i * stride, dtype, k, m);
        for (int j = 0; j < T; j++) {
            __m512 xv = _mm512_maskz_loadu_ps(m, x + (size_t)j * ldx + k);
            for (int i = 0; i < R; i++) acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < T; j++) out[(size_t)j * ldo + i] = _mm512_reduce_add_ps(acc[i][j]);
}

/* Integer formats: per pair, even blocks go to one accumulator and odd blocks to another (two
 * dependency chains), summed at the end: the order of cb_dot_int8/int4_avx512 for one row, so
 * tiles of any shape agree with them bit for bit. */
CB_TARGET_AVX512_VNNI static CB_ALWAYS_INLINE void
cb_tile_quant_block(__m256 acc[CB_TILE_MAX][CB_TILE_MAX], const char *w, size_t stride, int dtype,
                    const cb_act_q8 *acts, int b, const int R, const int T) {
    __m256i wq[CB_TILE_MAX], wa[CB_TILE_MAX];
    float dw[CB_TILE_MAX];
    for (int i = 0; i < R; i++) {
        const char *row = w + (size_t)i * stride;
        if (dtype == CB_INT8) {
            const cb_block_int8 *blk = (const cb_block_int8 *)row + b;
            wq[i] = _mm256_loadu_si256((const __m256i *)blk->qs);
            dw[i] = _cvtsh_ss(blk->d);
        } else {
            const cb_block_int4 *blk = (const cb_block_int4 *)row + b;
            wq[i] = cb_unpack_int4_avx2(blk->qs);
            dw[i] = _cvtsh_ss(blk->d);
        }
        wa[i] = _mm256_sign_epi8(wq[i], wq[i]);                           /* |w| */
    }
    for (int j = 0; j < T; j++) {
        __m256i xq = _mm256_loadu_si256((const __m256i *)(acts[j].q + b * CB_QBLOCK));
        float dx = acts[j].d[b];
        for (int i = 0; i < R; i++) {
            __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wa[i], _mm256_sign_epi8(xq, wq[i]));
            acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw[i] * dx), acc[i][j]);
        }
    }
}

CB_TARGET_AVX512_VNNI static CB_ALWAYS_INLINE void
cb_tile_quant_avx512(float *out, int ldo, const char *w, size_t stride, int dtype, const cb_act_q8 *acts,
                     int cols, const int R, const int T) {
    __m256 even[CB_TILE_MAX][CB_TILE_MAX], odd[CB_TILE_MAX][CB_TILE_MAX];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < T; j++) even[i][j] = odd[i][j] = _mm256_setzero_ps();
    const int nb = cols / CB_QBLOCK;
    int b = 0;
    for (; b + 2 <= nb; b += 2) {
        cb_tile_quant_block(even, w, stride, dtype, acts, b, R, T);
        cb_tile_quant_block(odd, w, stride, dtype, acts, b + 1, R, T);
    }
    if (b < nb) cb_tile_quant_block(even, w, stride, dtype, acts, b, R, T);
    for (int i = 0; i < R; i++)
        for (int j = 0; j < T; j++) out[(size_t)j * ldo + i] = cb_hsum256(_mm256_add_ps(even[i][j], odd[i][j]));
}

/* ---- bf16 products (AVX512_BF16) ------------------------------------------------------------
 * vdpbf16ps multiplies 32 bf16 weights by 32 bf16 activations and adds each pair's two products
 * into one of 16 f32 lanes: one instruction per 32 weights and token, where the widened path above
 * takes two unpacks and two FMAs. The activation is rounded to bf16 once per product (round_bf16,
 * into acts.xb): that rounding is the whole accuracy cost, the
 * products of two bf16 values being exact in f32. One accumulator per (row, token), filled in the
 * same order for any tile shape, so decode and prefill agree bit for bit. */
CB_TARGET_AVX512_BF16 static inline __m512bh cb_as_bf16x32(__m512i v) {
    __m512bh r;
    memcpy(&r, &v, sizeof r);
    return r;
}

CB_TARGET_AVX512_BF16 static void cb_round_bf16_avx512(uint16_t *dst, const float *x, int n) {
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + i));
        __m256i v;
        memcpy(&v, &h, sizeof v);
        _mm256_storeu_si256((__m256i *)(dst + i), v);
    }
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + i));
        __m256i v;
        memcpy(&v, &h, sizeof v);
        _mm256_mask_storeu_epi16(dst + i, m, v);
    }
}

CB_TARGET_AVX512_BF16 static CB_ALWAYS_INLINE void
cb_tile_bf16x_avx512(float *out, int ldo, const char *w, size_t stride, const cb_act_q8 *acts, int cols,
                     const int R, const int T) {
    __m512 acc[CB_TILE_MAX][CB_TILE_MAX];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < T; j++) acc[i][j] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 32 <= cols; k += 32) {
        __m512i wv[CB_TILE_MAX];
        for (int i = 0; i < R; i++) wv[i] = _mm512_loadu_si512((const void *)((const uint16_t *)(w + (size_t)i * stride) + k));
        for (int j = 0; j < T; j++) {
            const __m512bh xv = cb_as_bf16x32(_mm512_loadu_si512((const void *)(acts[j].xb + k)));
            for (int i = 0; i < R; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], cb_as_bf16x32(wv[i]), xv);
        }
    }
    if (k < cols) {                         /* the tail: zero pairs beyond the row add nothing */
        const __mmask32 m = (__mmask32)((1ull << (cols - k)) - 1u);
        __m512i wv[CB_TILE_MAX];
        for (int i = 0; i < R; i++) wv[i] = _mm512_maskz_loadu_epi16(m, (const uint16_t *)(w + (size_t)i * stride) + k);
        for (int j = 0; j < T; j++) {
            const __m512bh xv = cb_as_bf16x32(_mm512_maskz_loadu_epi16(m, acts[j].xb + k));
            for (int i = 0; i < R; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], cb_as_bf16x32(wv[i]), xv);
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < T; j++) out[(size_t)j * ldo + i] = _mm512_reduce_add_ps(acc[i][j]);
}

/* One entry point per format family; R in {1, 4}, T in 1..4 select a specialised body. */
#define CB_TILE_CASES(CALL) \
    switch (R * 8 + T) { \
    case 4 * 8 + 1: CALL(4, 1); break; case 4 * 8 + 2: CALL(4, 2); break; \
    case 4 * 8 + 3: CALL(4, 3); break; case 4 * 8 + 4: CALL(4, 4); break; \
    case 1 * 8 + 1: CALL(1, 1); break; case 1 * 8 + 2: CALL(1, 2); break; \
    case 1 * 8 + 3: CALL(1, 3); break; default: CALL(1, 4); break; }

CB_TARGET_AVX512 static void cb_tile_float_avx512_any(float *out, int ldo, const char *w, size_t stride,
        int dtype, const float *x, int ldx, const cb_act_q8 *acts, int cols, int R, int T) {
#define CB_CALL_F(r, t) cb_tile_float_avx512(out, ldo, w, stride, dtype, x, ldx, acts, cols, r, t)
    CB_TILE_CASES(CB_CALL_F)
#undef CB_CALL_F
}

CB_TARGET_AVX512_BF16 static void cb_tile_bf16x_avx512_any(float *out, int ldo, const char *w, size_t stride,
        int dtype, const float *x, int ldx, const cb_act_q8 *acts, int cols, int R, int T) {
    (void)dtype; (void)x; (void)ldx;
#define CB_CALL_B(r, t) cb_tile_bf16x_avx512(out, ldo, w, stride, acts, cols, r, t)
    CB_TILE_CASES(CB_CALL_B)
#undef CB_CALL_B
}

CB_TARGET_AVX512_VNNI static void cb_tile_quant_avx512_any(float *out, int ldo, const char *w, size_t stride,
        int dtype, const float *x, int ldx, const cb_act_q8 *acts, int cols, int R, int T) {
    (void)x; (void)ldx;
#define CB_CALL_Q(r, t) cb_tile_quant_avx512(out, ldo, w, stride, dtype, acts, cols, r, t)
    switch (R * 8 + T) {     /* two accumulators per pair: at most 2 x 4 pairs fit the registers */
    case 2 * 8 + 1: CB_CALL_Q(2, 1); break; case 2 * 8 + 2: CB_CALL_Q(2, 2); break;
    case 2 * 8 + 3: CB_CALL_Q(2, 3); break; case 2 * 8 + 4: CB_CALL_Q(2, 4); break;
    case 1 * 8 + 1: CB_CALL_Q(1, 1); break; case 1 * 8 + 2: CB_CALL_Q(1, 2); break;
    case 1 * 8 + 3: CB_CALL_Q(1, 3); break; default: CB_CALL_Q(1, 4); break; }
#undef CB_CALL_Q
}

/* ---- interleaved bf16 (cb_igroup_bf16) on 512-bit vectors ----------------------------------------
 * A group's vector (64 bytes) is one register: lane 2o + p holds output o's pair of weights for
 * inputs 4c + 2p and + 1, so no horizontal sum until a tile ends (one shuffle and add per 8
 * outputs and token), and one load of weights serves every token of the tile. Widened (exact):
 * the lower words shifted up and the upper words masked are the two inputs' weights in f32,
 * times x[4c], x[4c + 2] / x[4c + 1], x[4c + 3] broadcast from a 128-bit load, two FMAs in the
 * scalar spec's order (kernels_scalar.h, cb_itile_bf16_lanes): the AVX2 and scalar tiers' bits.
 * bf16 products: one vdpbf16ps per vector and token, the 4 rounded activations broadcast as one
 * 64-bit value. A prompt's tile is 2 groups x up to 8 tokens (16 accumulators), a group pair's
 * weights (2 x 16-64 KB) read from L1/L2 once per 8 tokens; decode takes 4 groups side by side. */
#define CB_IBF16_TOKENS 8

/* lanes 2o and 2o + 1 added, outputs in order: of one group (low 8 lanes), or of two (g, h). */
CB_TARGET_AVX512 static CB_ALWAYS_INLINE __m512 cb_ibf16_pairs_avx512(__m512 acc) {
    return _mm512_add_ps(acc, _mm512_permute_ps(acc, 0xB1));
}

CB_TARGET_AVX512 static CB_ALWAYS_INLINE void
cb_ibf16_store_avx512(float *out, int ldo, size_t ostride, __m512 acc[4][CB_IBF16_TOKENS], const int G, const int T) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    for (int j = 0; j < T; j++) {
        if (G == 2 && ostride == CB_TGROUP) {
            _mm512_storeu_ps(out + (size_t)j * ldo, _mm512_permutex2var_ps(cb_ibf16_pairs_avx512(acc[0][j]), even,
                                                                           cb_ibf16_pairs_avx512(acc[1][j])));
            continue;
        }
        for (int g = 0; g < G; g++)
            _mm256_storeu_ps(out + (size_t)j * ldo + g * ostride,
                             _mm512_castps512_ps256(_mm512_permutexvar_ps(even, cb_ibf16_pairs_avx512(acc[g][j]))));
    }
}

/* One step (4 inputs) of groups gp + g * gstride (g < G) widened: lo[g] the lower input's weight of
 * each lane pair, hi[g] the higher's, as f32; with the step's prefetch (decode: as the AVX2 tier's,
 * CB_IBF16_PREFETCH ahead; a prompt: this tile's share of the next pair). */
CB_TARGET_AVX512 static CB_ALWAYS_INLINE void cb_ibf16_widen_step(const char *gp, size_t gstride, cb_prefetch_run *pf,
                                                                 const int G, const int T, __m512 lo[4], __m512 hi[4]) {
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    if (T == 1)
        for (int g = 0; g < G; g++) _mm_prefetch(gp + g * gstride + CB_IBF16_PREFETCH, _MM_HINT_T0);
    else
        cb_prefetch_lines(pf, CB_IBF16_PREFETCH_LINES);
    for (int g = 0; g < G; g++) {
        const __m512i a = _mm512_loadu_si512((const void *)(gp + g * gstride));
        lo[g] = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
        hi[g] = _mm512_castsi512_ps(_mm512_and_si512(a, high));
    }
}

/* out[j * ldo + g * ostride + 0..7] = group gp + g * gstride (g < G) times tokens j < T, widened. */
CB_TARGET_AVX512 static CB_ALWAYS_INLINE void
cb_ibf16_tile_avx512(float *out, int ldo, size_t ostride, const char *gp, size_t gstride, const cb_act_q8 *acts,
                     int cols, cb_prefetch_run pf, const int G, const int T) {
    __m512 acc[4][CB_IBF16_TOKENS];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < T; j++) acc[g][j] = _mm512_setzero_ps();
    for (int k = 0; k < cols; k += 4, gp += 64) {
        __m512 we[4], wo[4];
        cb_ibf16_widen_step(gp, gstride, &pf, G, T, we, wo);
        for (int j = 0; j < T; j++) {
            const __m512 xv = _mm512_broadcast_f32x4(_mm_loadu_ps(acts[j].x + k));
            const __m512 xe = _mm512_permute_ps(xv, 0x88), xo = _mm512_permute_ps(xv, 0xDD);
            for (int g = 0; g < G; g++) acc[g][j] = _mm512_fmadd_ps(wo[g], xo, _mm512_fmadd_ps(we[g], xe, acc[g][j]));
        }
    }
    cb_ibf16_store_avx512(out, ldo, ostride, acc, G, T);
}

/* The same tile of bf16 products (acts.xb, vdpbf16ps). */
CB_TARGET_AVX512_BF16 static CB_ALWAYS_INLINE void
cb_ibf16x_tile_avx512(float *out, int ldo, size_t ostride, const char *gp, size_t gstride, const cb_act_q8 *acts,
                      int cols, cb_prefetch_run pf, const int G, const int T) {
    __m512 acc[4][CB_IBF16_TOKENS];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < T; j++) acc[g][j] = _mm512_setzero_ps();
    for (int k = 0; k < cols; k += 4, gp += 64) {
        __m512i wv[4];
        if (T == 1)
            for (int g = 0; g < G; g++) _mm_prefetch(gp + g * gstride + CB_IBF16_PREFETCH, _MM_HINT_T0);
        else                                             /* a prompt: this tile's share of the next pair */
            cb_prefetch_lines(&pf, CB_IBF16_PREFETCH_LINES);
        for (int g = 0; g < G; g++) wv[g] = _mm512_loadu_si512((const void *)(gp + g * gstride));
        for (int j = 0; j < T; j++) {
            int64_t x4;
            memcpy(&x4, acts[j].xb + k, sizeof x4);
            const __m512bh xv = cb_as_bf16x32(_mm512_set1_epi64(x4));
            for (int g = 0; g < G; g++) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], cb_as_bf16x32(wv[g]), xv);
        }
    }
    cb_ibf16_store_avx512(out, ldo, ostride, acc, G, T);
}

/* The order of the entries below: decode (n = 1) 4 groups side by side (CB_IDECODE_LOOP's split),
 * a prompt 2 groups x TOKENS tokens a tile (T_CASES: one case a token count), an odd last group
 * alone. In a function with cb_itile_fn's parameters and CB_IBF16_DECODE(o, ostride, gp, gstride,
 * G) and CB_IBF16_PAIR(G, T) (G groups of a tile, T tokens, both constant) defined. */
#define CB_IBF16_ENTRY(TOKENS, T_CASES)                                                                 \
    if (n == 1) {                                                                                       \
        CB_IDECODE_LOOP(CB_IBF16_DECODE)                                                                \
        return;                                                                                         \
    }                                                                                                   \
    const size_t row = (size_t)cols * 2 * CB_TGROUP;                                                    \
    const int tiles = (n + (TOKENS) - 1) / (TOKENS);                                                    \
    for (int g = g0; g < g1; g += 2)                                                                    \
        for (int t = 0; t < n; t += (TOKENS)) {                                                         \
            float *o = out + (size_t)t * ldo + (size_t)g * CB_TGROUP;                                   \
            const char *gp = w + (size_t)g * row;                                                       \
            const int T = n - t, ahead = g1 - g - 2 < 2 ? g1 - g - 2 : 2;                               \
            const cb_prefetch_run pf = cb_prefetch_share(ahead > 0 ? gp + 2 * row : NULL, ahead * row,     \
                                                         t / (TOKENS), tiles);                          \
            if (g + 1 < g1) { T_CASES(CB_IBF16_PAIR, 2) }                                               \
            else { T_CASES(CB_IBF16_PAIR, 1) }                                                          \
        }

CB_TARGET_AVX512 static void cb_itile_bf16_avx512(float *out, int ldo, const char *w, int dtype, const cb_act_q8 *acts,
                                                  int cols, int g0, int g1, int n) {
#define CB_IBF16_DECODE(o, os, gp, gs, G) cb_ibf16_tile_avx512(o, 0, os, gp, gs, acts, cols, cb_no_prefetch, G, 1)
#define CB_IBF16_PAIR(G, T) cb_ibf16_tile_avx512(o, ldo, (G) > 1 ? CB_TGROUP : 0, gp, (G) > 1 ? row : 0, acts + t, cols, pf, G, T)
    CB_IBF16_ENTRY(CB_IBF16_TOKENS, CB_T8_CASES)
#undef CB_IBF16_PAIR
#undef CB_IBF16_DECODE
}

CB_TARGET_AVX512_BF16 static void cb_itile_bf16x_avx512(float *out, int ldo, const char *w, int dtype,
                                                        const cb_act_q8 *acts, int cols, int g0, int g1, int n) {
#define CB_IBF16_DECODE(o, os, gp, gs, G) cb_ibf16x_tile_avx512(o, 0, os, gp, gs, acts, cols, cb_no_prefetch, G, 1)
#define CB_IBF16_PAIR(G, T) cb_ibf16x_tile_avx512(o, ldo, (G) > 1 ? CB_TGROUP : 0, gp, (G) > 1 ? row : 0, acts + t, cols, pf, G, T)
    CB_IBF16_ENTRY(CB_IBF16_TOKENS, CB_T8_CASES)
#undef CB_IBF16_PAIR
#undef CB_IBF16_DECODE
}

/* ---- bf16 products in a split order (cb_bf16_order, kernels_scalar.h) ---------------------------
 * Where the AMX unit sums TDPBF16PS's even and odd elements apart, decode and every prompt tile
 * follow it, widened: the weights' pair of a lane split by a shift and a mask as in the widened
 * tile, the rounded activations (acts.xb, 4 broadcast as one 64-bit value) likewise, one FMA into
 * the lane's even sum (inputs 4c + 2p + 1) and one into its odd sum (4c + 2p), and every 64 inputs
 * the two joined to the lane in the order's way — the scalar spec's operations lane for lane. Two
 * FMAs and two shifts or masks where vdpbf16ps takes one instruction: decode stays bound by the
 * weights' bytes; a prompt's tokens take these only past the AMX tiles (the last n % 16, an odd
 * group). Three sums a lane, so a prompt's tile is 2 groups x up to 4 tokens (24 accumulators). */
#define CB_IBF16S_TOKENS 4

CB_TARGET_AVX512 static CB_ALWAYS_INLINE __m512 cb_bf16_join_avx512(__m512 lane, __m512 even, __m512 odd, int order) {
    switch (order) {
    case CB_BF16_SPLIT_SUM: return _mm512_add_ps(lane, _mm512_add_ps(even, odd));
    case CB_BF16_SPLIT_EVEN: return _mm512_add_ps(_mm512_add_ps(lane, even), odd);
    default: return _mm512_add_ps(_mm512_add_ps(lane, odd), even);
    }
}

/* out[j * ldo + g * ostride + 0..7] = group gp + g * gstride (g < G) times tokens j < T, bf16
 * products in split order `order`; subnormals flushed as the bf16 instructions flush them (DAZ: a
 * subnormal input taken as zero, FTZ: a subnormal result) through MXCSR's bits while the lanes
 * sum, so the widened FMAs give TDPBF16PS's bits on every input; the lanes' last addition, as the
 * AMX tile's (amx_body.h), under the caller's MXCSR. */
#define CB_MXCSR_DAZ_FTZ 0x8040u
CB_TARGET_AVX512 static CB_ALWAYS_INLINE void
cb_ibf16s_tile_avx512(float *out, int ldo, size_t ostride, const char *gp, size_t gstride, const cb_act_q8 *acts,
                      int cols, cb_prefetch_run pf, const int G, const int T, const int order) {
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    __m512 acc[4][CB_IBF16_TOKENS], even[4][CB_IBF16S_TOKENS], odd[4][CB_IBF16S_TOKENS];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < T; j++) acc[g][j] = even[g][j] = odd[g][j] = _mm512_setzero_ps();
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | CB_MXCSR_DAZ_FTZ);
    for (int k = 0; k < cols; k += 4, gp += 64) {
        __m512 wlo[4], whi[4];
        cb_ibf16_widen_step(gp, gstride, &pf, G, T, wlo, whi);
        for (int j = 0; j < T; j++) {
            int64_t x4;
            memcpy(&x4, acts[j].xb + k, sizeof x4);
            const __m512i xv = _mm512_set1_epi64(x4);
            const __m512 xlo = _mm512_castsi512_ps(_mm512_slli_epi32(xv, 16));
            const __m512 xhi = _mm512_castsi512_ps(_mm512_and_si512(xv, high));
            for (int g = 0; g < G; g++) {
                even[g][j] = _mm512_fmadd_ps(whi[g], xhi, even[g][j]);
                odd[g][j] = _mm512_fmadd_ps(wlo[g], xlo, odd[g][j]);
            }
        }
        if ((k + 4) % CB_BF16_SPLIT_INPUTS == 0 || k + 4 >= cols)
            for (int g = 0; g < G; g++)
                for (int j = 0; j < T; j++) {
                    acc[g][j] = cb_bf16_join_avx512(acc[g][j], even[g][j], odd[g][j], order);
                    even[g][j] = odd[g][j] = _mm512_setzero_ps();
                }
    }
    _mm_setcsr(csr);
    cb_ibf16_store_avx512(out, ldo, ostride, acc, G, T);
}

/* The interleaved bf16 products entry in the split order cb_bf16_order: decode 4 groups side by
 * side (CB_IDECODE_LOOP's split), a prompt 2 groups x 4 tokens a tile, an odd last group alone. */
CB_TARGET_AVX512 static void cb_itile_bf16s_avx512(float *out, int ldo, const char *w, int dtype,
                                                   const cb_act_q8 *acts, int cols, int g0, int g1, int n) {
    const int order = cb_bf16_order;
#define CB_IBF16_DECODE(o, os, gp, gs, G) cb_ibf16s_tile_avx512(o, 0, os, gp, gs, acts, cols, cb_no_prefetch, G, 1, order)
#define CB_IBF16_PAIR(G, T) cb_ibf16s_tile_avx512(o, ldo, (G) > 1 ? CB_TGROUP : 0, gp, (G) > 1 ? row : 0, acts + t, cols, pf, G, T, order)
    CB_IBF16_ENTRY(CB_IBF16S_TOKENS, CB_AVX2_T_CASES)
#undef CB_IBF16_PAIR
#undef CB_IBF16_DECODE
}
#undef CB_IBF16_ENTRY

/* The interleaved bf16 products entry of the order in use: vdpbf16ps's sequence, or a split one. */
CB_TARGET_AVX512_BF16 static void cb_itile_bf16x_ordered_avx512(float *out, int ldo, const char *w, int dtype,
                                                               const cb_act_q8 *acts, int cols, int g0, int g1, int n) {
    if (cb_bf16_order == CB_BF16_SEQ) cb_itile_bf16x_avx512(out, ldo, w, dtype, acts, cols, g0, g1, n);
    else cb_itile_bf16s_avx512(out, ldo, w, dtype, acts, cols, g0, g1, n);
}

/* ---- a prompt's block of queries (cb_attend_block_fn) on 512-bit vectors -------------------------
 *
 * The AVX2 tier's block kernel (kernels_avx2.h: its order, CB_ATTEND_QBLOCK_BODY) with each FMA
 * on 16 lanes, so each score and output is still the same sequence of operations as decoding its
 * query (cb_attend_heads_avx512) and as the AVX2 tier: a score's 8 lanes of partial sums are those
 * of key row r in lanes 0..7 and of row r + 1 in lanes 8..15 of one vector. A key block (16 KB of
 * f32) is converted once into such row pairs for all the block's queries; a step takes 8 rows for
 * 3-4 heads or 16 for 1-2 (16 accumulators), and its scores are gathered by transposing adds in the
 * hadd tree's order and stored a head's 8 or 16 rows at once (splitting each pair back into
 * 256-bit halves, one hadd tree and 8 scalar stores per pair, would take more operations than the
 * scores' FMAs). A value pass takes 16 columns a vector (4 vectors x 4 heads), each lane adding its
 * positions in order (the block's f16 values are not converted once as the keys are: vcvtph2ps
 * from memory is cheap there, and the copy is not). A unit is up to 8 query heads of a KV head
 * (cb_kernel_table.attend_block_heads), taken 4 at a time by the score and value passes, so
 * Qwen3-MoE's group of 8 converts and reads a key or value block from L3 once, not twice. Where
 * the 512-bit FMA runs at the 256-bit instruction rate (cores with two full-width 512-bit FMA
 * units) half the instructions do the same work. */

/* cb_exp_avx2 on 16 lanes: the same operations lane by lane (CB_EXP_BODY), so the same bits. */
#define CB_ROUND_NEAREST512(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
CB_TARGET_AVX512 static CB_ALWAYS_INLINE __m512 cb_exp_avx512(__m512 x)
    CB_EXP_BODY(_mm512, __m512, CB_ROUND_NEAREST512, _mm512_castsi512_ps)

/* cb_softmax_unnormalized_avx2's result bit for bit with 16 lanes at a time: the max is exact in
 * any order, each exp is the same lane arithmetic, and the sum runs in the same 8-lane chains (a zmm
 * holds two), folded alike; after the whole 64-element steps, a 16-element step adds its low then
 * its high 8 (the AVX2 loop's two steps), with the AVX2 loop's last 8 and scalar tail. */
CB_TARGET_AVX512 static int cb_softmax_unnormalized_avx512(float *x, int n, float *inv) {
    int i = 0;
    *inv = 1.0f;
    __m512 m16[4];
    for (int k = 0; k < 4; k++) m16[k] = _mm512_set1_ps(-INFINITY);
    __mmask16 nan16 = 0;
    for (; i + 64 <= n; i += 64)            /* max drops NaNs: they are looked for apart; 4 chains */
        for (int k = 0; k < 4; k++) {
            const __m512 v = _mm512_loadu_ps(x + i + 16 * k);
            m16[k] = _mm512_max_ps(m16[k], v);
            nan16 |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        }
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        m16[0] = _mm512_max_ps(m16[0], v);
        nan16 |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    if (nan16) return -1;
    float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m16[0], m16[1]), _mm512_max_ps(m16[2], m16[3])));
    for (; i < n; i++) {
        if (isnan(x[i])) return -1;
        mx = x[i] > mx ? x[i] : mx;
    }
    if (!isfinite(mx)) return -1;
    const __m512 vmx = _mm512_set1_ps(mx), underflow = _mm512_set1_ps(CB_LN_SMALLEST_NORMAL);
    __m512 acc[CB_SOFTMAX_CHAINS / 2];        /* [k]: the AVX2 loop's chains 2k (lanes 0..7) and 2k + 1 */
    for (int k = 0; k < CB_SOFTMAX_CHAINS / 2; k++) acc[k] = _mm512_setzero_ps();
    for (i = 0; i + 8 * CB_SOFTMAX_CHAINS <= n; i += 8 * CB_SOFTMAX_CHAINS)
        for (int k = 0; k < CB_SOFTMAX_CHAINS / 2; k++) {
            const __m512 z = _mm512_sub_ps(_mm512_loadu_ps(x + i + 16 * k), vmx);
            const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(z, underflow, _CMP_GE_OQ), cb_exp_avx512(z));
            _mm512_storeu_ps(x + i + 16 * k, e);
            acc[k] = _mm512_add_ps(acc[k], e);
        }
    __m256 chains[CB_SOFTMAX_CHAINS];
    for (int k = 0; k < CB_SOFTMAX_CHAINS / 2; k++) {
        chains[2 * k] = _mm512_castps512_ps256(acc[k]);
        chains[2 * k + 1] = _mm512_extractf32x8_ps(acc[k], 1);
    }
    __m256 s8 = cb_softmax_fold8(chains);
    for (; i + 16 <= n; i += 16) {
        const __m512 z = _mm512_sub_ps(_mm512_loadu_ps(x + i), vmx);
        const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(z, underflow, _CMP_GE_OQ), cb_exp_avx512(z));
        _mm512_storeu_ps(x + i, e);
        s8 = _mm256_add_ps(_mm256_add_ps(s8, _mm512_castps512_ps256(e)), _mm512_extractf32x8_ps(e, 1));
    }
    *inv = 1.0f / cb_softmax_exps_avx2(x, i, n, mx, s8);
    return 0;
}

CB_TARGET_AVX512 static int cb_softmax_avx512(float *x, int n) {
    float inv;
    if (cb_softmax_unnormalized_avx512(x, n, &inv)) return -1;
    int i = 0;
    for (const __m512 vinv = _mm512_set1_ps(inv); i + 16 <= n; i += 16)
        _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), vinv));
    for (; i < n; i++) x[i] *= inv;
    return 0;
}

/* Elements d..d+7 of cache rows a and b (f32 or f16: q8 scores take the integer kernels) as floats:
 * a's in lanes 0..7, b's in 8..15. */
CB_TARGET_AVX512 static CB_ALWAYS_INLINE __m512 cb_kv_load8x2(const char *a, const char *b, size_t d, const int KV) {
    if (KV == CB_KV_F16)
        return _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)(a + 2 * d))),
            _mm_loadu_si128((const __m128i *)(const void *)(b + 2 * d)), 1));
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps((const float *)(const void *)a + d)),
                              _mm256_loadu_ps((const float *)(const void *)b + d), 1);
}

/* 16 cache values at element i of a row (row: its start; f32 or f16), as floats. */
CB_TARGET_AVX512 static CB_ALWAYS_INLINE __m512 cb_kv_load16(const char *row, size_t i, const int KV) {
    if (KV == CB_KV_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(row + 2 * i)));
    return _mm512_loadu_ps((const float *)(const void *)row + i);
}

/* The key block, converted once for all the block's queries: cache rows of positions b0..b1-1 to
 * f32 in pairs, kf [pairs][head_dim / 8][16]: pair p's vector c holds elements 8c..8c+7 of position
 * b0 + 2p in lanes 0..7 and of b0 + 2p + 1 in lanes 8..15 (an odd block's last row repeats), so a
 * score step loads a row pair with one plain load, however many queries and heads read it (not
 * each converting f16 and joining two halves itself, once per query and step). The 16 rows after a
 * partial block are zeroed: a step of 16 rows may read that far and its extra lanes are never
 * stored (zeros, not stale bits: no denormal stalls). */
#define CB_ATTN_KF_FLOATS 4096          /* a key block's f32 pairs: 16 KB, L1-resident with its queries */
#define CB_ATTN_KF_MAX_HD 512           /* head_dim the scratch serves (8 rows at 512); beyond: the AVX2 kernel */
#define CB_ATTN_KF_PAD 16               /* rows after a block a score step may read */
static inline int cb_attn_kf_rows(int head_dim) { return (CB_ATTN_KF_FLOATS / head_dim) & ~7; }

CB_TARGET_AVX512 static CB_ALWAYS_INLINE void
cb_attn_kblock_pairs_avx512(float *kf, const char *kbase, int b0, int b1, int rows, int ring, int head_dim,
                            const int KV) {
    const size_t rbytes = cb_kv_row_bytes(head_dim, KV);
    const int n = b1 - b0, pairs = (n + 1) / 2;
    int row = b0 % ring;
    for (int p = 0; p < pairs; p++) {
        const int rb = 2 * p + 1 < n ? (row + 1 == ring ? 0 : row + 1) : row;
        const char *a = kbase + (size_t)row * rbytes, *b = kbase + (size_t)rb * rbytes;
        const char *na = kbase + (size_t)((row + rows) % ring) * rbytes;   /* the next block's rows */
        for (size_t c = 0; c < 2 * rbytes; c += 64) _mm_prefetch(na + c, _MM_HINT_T0);
        float *dst = kf + (size_t)p * 2 * head_dim;
        for (int d = 0; d < head_dim; d += 8) _mm512_storeu_ps(dst + 2 * d, cb_kv_load8x2(a, b, (size_t)d, KV));
        row = rb + 1 == ring ? 0 : rb + 1;
    }
    if (2 * pairs < rows) memset(kf + (size_t)2 * pairs * head_dim, 0, sizeof(float) * CB_ATTN_KF_PAD * head_dim);
}

/* hadd on 512 bits: per 128-bit lane [x0 + x1, x2 + x3, y0 + y1, y2 + y3], _mm256_hadd_ps's pairs. */
CB_TARGET_AVX512 static CB_ALWAYS_INLINE __m512 cb_hadd512(__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
}

/* 8 rows' half sums from 4 row pairs' accumulators of one head (a[p]: row 2p's 8 partial sums in
 * lanes 0..7, row 2p + 1's in 8..15). 128-bit lanes: [rows 0 2 4 6: partials 0-3 summed as
 * (0 + 1) + (2 + 3)], [the same rows: (4 + 5) + (6 + 7)], then rows 1 3 5 7 alike. */
CB_TARGET_AVX512 static CB_ALWAYS_INLINE __m512 cb_rows8_halves(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    return cb_hadd512(cb_hadd512(a0, a1), cb_hadd512(a2, a3));
}

/* Two such sets of 8 rows joined: the halves added ((0123) + (4567), the AVX2 tree's last add) and
 * put in row order, times the scale: lanes 0..7 rows 0..7 of x, lanes 8..15 those of y. */
CB_TARGET_AVX512 static CB_ALWAYS_INLINE __m512 cb_rows8x2_scores(__m512 x, __m512 y, __m512 vscale) {
    const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    const __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
    return _mm512_mul_ps(_mm512_permutexvar_ps(order, s), vscale);
}

/* Scores of one query's rows s0..s1-1 of the key block kf (row s is position b0 + s):
 * sc[i][t_at_0 + s] = qh[i] . k * scale for the NH (<= 4) heads, 2P rows a step (P = 4 row pairs
 * for 3-4 heads, 8 for 1-2: 16 accumulators). Each score is the AVX2 kernel's: 8 lanes of FMA
 * chains over d in order, gathered (0 + 1) + (2 + 3), + ((4 + 5) + (6 + 7)), times the scale — by
 * transposing adds over whole vectors (about 1.5 operations a score) instead of a hadd tree and
 * scalar stores per row pair (about 4). Rows outside s0..s1-1 in a step are computed, not stored. */
CB_TARGET_AVX512 static CB_ALWAYS_INLINE void
cb_attn_block_scores_kf_avx512(float *const *sc, const float *const *qh, const float *kf, int s0, int s1,
                               int t_at_0, int head_dim, __m512 vscale, const int NH, const int P) {
    for (int s = s0 & ~1; s < s1; s += 2 * P) {
        const float *kp = kf + (size_t)s * head_dim;   /* pair s / 2 */
        __m512 acc[8][4];                               /* [row pair][head] */
        for (int p = 0; p < P; p++)
            for (int i = 0; i < NH; i++) acc[p][i] = _mm512_setzero_ps();
        for (int d = 0; d < head_dim; d += 8) {
            __m512 kv[8];
            for (int p = 0; p < P; p++) kv[p] = _mm512_loadu_ps(kp + (size_t)p * 2 * head_dim + 2 * d);
            for (int i = 0; i < NH; i++) {
                const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(qh[i] + d));
                for (int p = 0; p < P; p++) acc[p][i] = _mm512_fmadd_ps(kv[p], qv, acc[p][i]);
            }
        }
        const int lo = s0 > s ? s0 - s : 0, hi = s1 - s < 2 * P ? s1 - s : 2 * P;
        const unsigned keep = ((1u << hi) - 1) & ~((1u << lo) - 1);
        if (P == 8) {
            for (int i = 0; i < NH; i++)
                _mm512_mask_storeu_ps(sc[i] + t_at_0 + s, (__mmask16)keep,
                                      cb_rows8x2_scores(cb_rows8_halves(acc[0][i], acc[1][i], acc[2][i], acc[3][i]),
                                                        cb_rows8_halves(acc[4][i], acc[5][i], acc[6][i], acc[7][i]),
                                                        vscale));
        } else {
            for (int i = 0; i < NH; i += 2) {
                const __m512 x = cb_rows8_halves(acc[0][i], acc[1][i], acc[2][i], acc[3][i]);
                const __m512 y = i + 1 < NH ? cb_rows8_halves(acc[0][i + 1], acc[1][i + 1], acc[2][i + 1], acc[3][i + 1])
                                            : _mm512_setzero_ps();
                const __m512 sv = cb_rows8x2_scores(x, y, vscale);
                _mm256_mask_storeu_ps(sc[i] + t_at_0 + s, (__mmask8)keep, _mm512_castps512_ps256(sv));
                if (i + 1 < NH) _mm256_mask_storeu_ps(sc[i + 1] + t_at_0 + s, (__mmask8)keep, _mm512_extractf32x8_ps(sv, 1));
            }
        }
    }
}

/* As cb_attn_block_vpass_avx2 with NV 16-column vectors from column d, for NH <= 8 heads (NH x NV
 * <= 16 accumulators); `ahead` > 0: each row also prefetches its piece of the row `ahead` rows on
 * (decode's next block), which changes no bit. */
CB_TARGET_AVX512 static CB_ALWAYS_INLINE void
cb_attn_block_vpass_avx512(float *const *o, const float *const *sc, const char *vbase, int t0, int t1, int row_t0,
                           int ring, int head_dim, int d, int ahead, const int NH, const int NV, const int KV) {
    const size_t rbytes = cb_kv_row_bytes(head_dim, KV);
    const size_t col = (size_t)d * rbytes / (size_t)head_dim, span = (size_t)16 * NV * rbytes / (size_t)head_dim;
    __m512 acc[8][4];
    for (int i = 0; i < NH; i++)
        for (int c = 0; c < NV; c++) acc[i][c] = t0 ? _mm512_loadu_ps(o[i] + d + 16 * c) : _mm512_setzero_ps();
    for (int t = t0, row = row_t0; t < t1; t++) {
        const char *v = vbase + (size_t)row * rbytes;
        if (ahead) {                                     /* about the bytes of columns d..d+16NV-1 */
            const int next = (int)(((int64_t)row + ahead) % ring);
            for (size_t b = 0; b < span; b += 64) _mm_prefetch(vbase + (size_t)next * rbytes + col + b, _MM_HINT_T0);
        }
        __m512 vv[4];
        for (int c = 0; c < NV; c++) vv[c] = cb_kv_load16(v, (size_t)(d + 16 * c), KV);
        for (int i = 0; i < NH; i++) {
            const __m512 p = _mm512_set1_ps(sc[i][t]);
            for (int c = 0; c < NV; c++) acc[i][c] = _mm512_fmadd_ps(p, vv[c], acc[i][c]);
        }
        row = row + 1 == ring ? 0 : row + 1;
    }
    for (int i = 0; i < NH; i++)
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(o[i] + d + 16 * c, acc[i][c]);
}

/* The value pass, NV vectors of 16 columns at a time; a last 8 columns by the AVX2 pass (4 heads a
 * call). */
CB_TARGET_AVX512 static CB_ALWAYS_INLINE void
cb_attn_block_values_avx512(float *const *o, const float *const *sc, const char *vbase, int t0, int t1, int row_t0,
                            int ring, int head_dim, int ahead, const int NH, const int NV, const int KV) {
    int d = 0;
    for (; d + 16 * NV <= head_dim; d += 16 * NV)
        cb_attn_block_vpass_avx512(o, sc, vbase, t0, t1, row_t0, ring, head_dim, d, ahead, NH, NV, KV);
    switch ((head_dim - d) / 16) {
    case 3: cb_attn_block_vpass_avx512(o, sc, vbase, t0, t1, row_t0, ring, head_dim, d, ahead, NH, 3, KV); break;
    case 2: cb_attn_block_vpass_avx512(o, sc, vbase, t0, t1, row_t0, ring, head_dim, d, ahead, NH, 2, KV); break;
    case 1: cb_attn_block_vpass_avx512(o, sc, vbase, t0, t1, row_t0, ring, head_dim, d, ahead, NH, 1, KV); break;
    default: break;
    }
    if (head_dim % 16)
        for (int g = 0; g < NH; g += 4)
            cb_attn_block_vpass_avx2(o + g, sc + g, vbase, t0, t1, row_t0, ring, head_dim, head_dim - 8,
                                     NH - g < 4 ? NH - g : 4, 1, KV);
}

CB_TARGET_AVX512 static CB_ALWAYS_INLINE void
cb_attend_qblock_group_avx512(float *out, int ldo, const float *q, int ldq, int nq, const void *k_cache,
                              const void *v_cache, float *scores, int sc_stride, int h0, int kvh, int head_dim_,
                              int pos0, int window, int ring, float scale, const float *sinks, float *kf,
                              const int NH, const int HD, const int KV) {
    const int head_dim = HD ? HD : head_dim_;
    const size_t rbytes = cb_kv_row_bytes(head_dim, KV);
    const __m512 vscale = _mm512_set1_ps(scale);
    const int krows = cb_attn_kf_rows(head_dim);
    memset(kf + (size_t)krows * head_dim, 0, sizeof(float) * CB_ATTN_KF_PAD * head_dim);
#define CB_PREPARE_AVX512(pass, b0, b1) \
    if (pass == 0) cb_attn_kblock_pairs_avx512(kf, kbase, b0, b1, krows, ring, head_dim, KV); \
    else cb_attn_prefetch_rows(vbase, b1, (b1) + krows < last + 1 ? (b1) + krows : last + 1, ring, rbytes)
    const int NH_A = NH < 4 ? NH : 4, NH_B = NH > 4 ? NH - 4 : 1;   /* up to 8 heads: two calls of 4 */
#define CB_SCORES_AVX512(j, sc, qh, kb, t0, t1, r0, s0)                                                        \
    do {                                                                                                      \
        cb_attn_block_scores_kf_avx512(sc, qh, kf, s0, (s0) + (t1) - (t0), (t0) - (s0), head_dim, vscale, NH_A, \
                                       NH_A <= 2 ? 8 : 4);                                                    \
        if (NH > 4)                                                                                           \
            cb_attn_block_scores_kf_avx512(sc + 4, qh + 4, kf, s0, (s0) + (t1) - (t0), (t0) - (s0), head_dim,  \
                                           vscale, NH_B, NH_B <= 2 ? 8 : 4);                                  \
    } while (0)
#define CB_VALUES_AVX512(o, sc, vb, t0, t1, r0, s0)                                                           \
    do {                                                                                                      \
        cb_attn_block_values_avx512(o, sc, vb, t0, t1, r0, ring, head_dim, 0, NH_A, 4, KV);                   \
        if (NH > 4) cb_attn_block_values_avx512(o + 4, sc + 4, vb, t0, t1, r0, ring, head_dim, 0, NH_B, 4, KV); \
    } while (0)
#define CB_SOFTMAX_AVX512(j, sc, n) CB_ATTN_SOFTMAX_HEADS(cb_softmax_avx512, sc, n, sinks, h0, NH)
    CB_ATTEND_QBLOCK_BODY(CB_SCORES_AVX512, CB_VALUES_AVX512, krows, 1, CB_PREPARE_AVX512, CB_SOFTMAX_AVX512,
                          CB_ATTN_NO_FINISH)
#undef CB_SOFTMAX_AVX512
#undef CB_PREPARE_AVX512
#undef CB_SCORES_AVX512
#undef CB_VALUES_AVX512
}

CB_TARGET_AVX512 static CB_ALWAYS_INLINE void
cb_attend_block_kv_avx512(float *out, int ldo, const float *q, int ldq, int nq, const void *k_cache, const void *v_cache,
                          float *scores, int sc_stride, int h0, int nh, int kvh, int head_dim, int pos0, int window,
                          int ring, float scale, const float *sinks, float *kf, const int KV) {
    if (head_dim % 8 || head_dim > CB_ATTN_KF_MAX_HD) {  /* head by head / without the scratch: the AVX2 tier's, */
        for (int g = 0; g < nh; g += CB_ATTN_HEADS)      /* 4 heads a call */
            cb_attend_block_kv_avx2(out, ldo, q, ldq, nq, k_cache, v_cache, scores, sc_stride, h0 + g,
                                    nh - g < CB_ATTN_HEADS ? nh - g : CB_ATTN_HEADS, kvh, head_dim, pos0, window, ring,
                                    scale, sinks, NULL, NULL, NULL, NULL, 4, KV);
        return;
    }
#define CB_ATTEND_NH(k, hd) cb_attend_qblock_group_avx512(out, ldo, q, ldq, nq, k_cache, v_cache, scores, sc_stride, \
                                                          h0, kvh, head_dim, pos0, window, ring, scale, sinks, kf, k, hd, KV)
#define CB_ATTEND_HD(hd) CB_SWITCH_HEADS8(nh, CB_ATTEND_NH, hd)
    if (head_dim == 64) CB_ATTEND_HD(64)
    else if (head_dim == 128) CB_ATTEND_HD(128)
    else CB_ATTEND_HD(0)
#undef CB_ATTEND_HD
#undef CB_ATTEND_NH
}

CB_TARGET_AVX512 static void cb_attend_block_avx512(float *out, int ldo, const float *q, int ldq, int nq,
                                                    const void *k_cache, const void *v_cache, float *scores,
                                                    int sc_stride, int h0, int nh, int kvh, int head_dim, int pos0,
                                                    int window, int ring, float scale, const float *sinks, int kv) {
    float kf[CB_ATTN_KF_FLOATS + CB_ATTN_KF_PAD * CB_ATTN_KF_MAX_HD];   /* a key block's pairs and the pad: 48 KB */
    if (kv == CB_KV_Q8)                    /* without AVX512-VNNI: the AVX2 tier's integer sums, 4 heads a call */
        for (int g = 0; g < nh; g += CB_ATTN_HEADS)
            cb_attend_block_avx2(out, ldo, q, ldq, nq, k_cache, v_cache, scores, sc_stride, h0 + g,
                                 nh - g < CB_ATTN_HEADS ? nh - g : CB_ATTN_HEADS, kvh, head_dim, pos0, window, ring,
                                 scale, sinks, kv);
    else if (kv == CB_KV_F16)
        cb_attend_block_kv_avx512(out, ldo, q, ldq, nq, k_cache, v_cache, scores, sc_stride, h0, nh, kvh, head_dim, pos0,
                                  window, ring, scale, sinks, kf, CB_KV_F16);
    else
        cb_attend_block_kv_avx512(out, ldo, q, ldq, nq, k_cache, v_cache, scores, sc_stride, h0, nh, kvh, head_dim, pos0,
                                  window, ring, scale, sinks, kf, CB_KV_F32);
}

/* One query (cb_attend_fn, decode) for up to CB_ATTN_HEADS_WIDE = 8 query heads of a KV head: with
 * 32 registers a key or value row read once serves 8 heads (Qwen3-MoE's and gpt-oss's groups of 8
 * each read their KV head once, not twice). On 512-bit vectors as the prompt's block kernel above:
 * key rows in pairs per vector, 4 rows a step (2 x NH chains), each score's lanes split back into
 * the AVX2 kernel's hadd tree; values 16 columns a vector, 32 a pass for 8 heads (64 for up to 4),
 * in the AVX2 kernel's blocks of rows, each prefetching its piece of the next block. Every score
 * and output is the AVX2 tier's sequence of operations (cb_attend_group_avx2), so the bits are
 * that tier's and the prompt's. */
CB_TARGET_AVX512 static CB_ALWAYS_INLINE void
cb_attend_group_avx512(float *out, const float *q, const void *k_cache, const void *v_cache, float *scores,
                       int sc_stride, int h0, int kvh, int head_dim_, int start, int pos, int ring,
                       float scale, const float *sinks, const int NH, const int HD, const int KV) {
    const int head_dim = HD ? HD : head_dim_;
    const size_t rbytes = cb_kv_row_bytes(head_dim, KV);
    const int n = pos - start + 1, row0 = start % ring;
    const float *qh[8];
    float *sc[8], *o[8];
    for (int i = 0; i < NH; i++) {
        qh[i] = q + (size_t)(h0 + i) * head_dim;
        sc[i] = scores + (size_t)(h0 + i) * sc_stride;
        o[i] = out + (size_t)(h0 + i) * head_dim;
    }
    const char *kbase = (const char *)k_cache + (size_t)kvh * ring * rbytes;
    const char *vbase = (const char *)v_cache + (size_t)kvh * ring * rbytes;
    const __m512 vscale512 = _mm512_set1_ps(scale);
    for (int t = 0, row = row0; t < n; t += 4) {         /* the last valid row repeats */
        const char *k[4];
        for (int r = 0, rr = row; r < 4; r++) {
            k[r] = kbase + (size_t)rr * rbytes;
            if (t + r + 1 < n) rr = rr + 1 == ring ? 0 : rr + 1;
        }
        for (int r = 0; r < 4; r++) {
            int ahead = row + CB_ATTN_PREFETCH + r;
            ahead = ahead < ring ? ahead : ahead % ring;
            for (size_t b = 0; b < rbytes; b += 64) _mm_prefetch(kbase + (size_t)ahead * rbytes + b, _MM_HINT_T0);
        }
        __m512 acc[2][8];                               /* [row pair][head] */
        for (int p = 0; p < 2; p++)
            for (int i = 0; i < 8; i++) acc[p][i] = _mm512_setzero_ps();
        for (int d = 0; d < head_dim; d += 8) {
            const __m512 kv0 = cb_kv_load8x2(k[0], k[1], (size_t)d, KV), kv1 = cb_kv_load8x2(k[2], k[3], (size_t)d, KV);
            for (int i = 0; i < NH; i++) {
                const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(qh[i] + d));
                acc[0][i] = _mm512_fmadd_ps(kv0, qv, acc[0][i]);
                acc[1][i] = _mm512_fmadd_ps(kv1, qv, acc[1][i]);
            }
        }
        /* 4 heads' 4 rows a vector, gathered by the prompt kernel's transposing adds (the hadd
         * tree's order: the AVX2 bits): heads g, g + 1 as "8 rows" of cb_rows8_halves, g + 2, g + 3
         * the other 8, so lanes 4i..4i+3 are head g + i's rows t..t+3, stored 4 at a time (half
         * the operations of 256-bit hadd trees and 8 scalar stores per row pair) */
        const __mmask8 keep = (__mmask8)((1u << (n - t < 4 ? n - t : 4)) - 1u);
        const __m512 z = _mm512_setzero_ps();
        for (int g = 0; g < NH; g += 4) {
            const __m512 x = cb_rows8_halves(acc[0][g], acc[1][g], g + 1 < NH ? acc[0][g + 1] : z, g + 1 < NH ? acc[1][g + 1] : z);
            const __m512 y = g + 2 < NH ? cb_rows8_halves(acc[0][g + 2], acc[1][g + 2], g + 3 < NH ? acc[0][g + 3] : z,
                                                          g + 3 < NH ? acc[1][g + 3] : z)
                                        : z;
            const __m512 sv = cb_rows8x2_scores(x, y, vscale512);
            _mm_mask_storeu_ps(sc[g] + t, keep, _mm512_castps512_ps128(sv));
            if (g + 1 < NH) _mm_mask_storeu_ps(sc[g + 1] + t, keep, _mm512_extractf32x4_ps(sv, 1));
            if (g + 2 < NH) _mm_mask_storeu_ps(sc[g + 2] + t, keep, _mm512_extractf32x4_ps(sv, 2));
            if (g + 3 < NH) _mm_mask_storeu_ps(sc[g + 3] + t, keep, _mm512_extractf32x4_ps(sv, 3));
        }
        for (int r = 0; r < 4 && t + r < n; r++) row = row + 1 == ring ? 0 : row + 1;
    }
    CB_ATTN_SOFTMAX_HEADS(cb_softmax_avx512, sc, n, sinks, h0, NH)
    const int vblock = CB_ATTN_VBLOCK_BYTES / (int)rbytes > 4 ? CB_ATTN_VBLOCK_BYTES / (int)rbytes : 4;
    for (int t0 = 0, row_t0 = row0; t0 < n; t0 += vblock) {
        const int t1 = n - t0 > vblock ? t0 + vblock : n;
        cb_attn_block_values_avx512(o, (const float *const *)sc, vbase, t0, t1, row_t0, ring, head_dim, vblock, NH,
                                    NH > 4 ? 2 : 4, KV);
        row_t0 = (int)(((int64_t)row_t0 + (t1 - t0)) % ring);
    }
}

CB_TARGET_AVX512 static void cb_attend_heads_avx512(float *out, const float *q, const void *k_cache, const void *v_cache,
                                                    float *scores, int sc_stride, int h0, int nh, int kvh, int head_dim,
                                                    int start, int pos, int ring, float scale, const float *sinks,
                                                    int kv) {
    if (head_dim % 8 || kv == CB_KV_Q8) {       /* q8 without AVX512-VNNI: the AVX2 tier's integer sums */
        cb_attend_heads_avx2(out, q, k_cache, v_cache, scores, sc_stride, h0, nh, kvh, head_dim, start, pos, ring,
                             scale, sinks, kv);
        return;
    }
#define CB_ATTEND_NH(k, hd, kvt) cb_attend_group_avx512(out, q, k_cache, v_cache, scores, sc_stride, h0, kvh, head_dim, \
                                                        start, pos, ring, scale, sinks, k, hd, kvt)
#define CB_ATTEND_HD(hd, kvt) CB_SWITCH_HEADS8(nh, CB_ATTEND_NH, hd, kvt)
    if (kv == CB_KV_F16) {
        if (head_dim == 64) CB_ATTEND_HD(64, CB_KV_F16)
        else if (head_dim == 128) CB_ATTEND_HD(128, CB_KV_F16)
        else CB_ATTEND_HD(0, CB_KV_F16)
    } else {
        if (head_dim == 64) CB_ATTEND_HD(64, CB_KV_F32)
        else if (head_dim == 128) CB_ATTEND_HD(128, CB_KV_F32)
        else CB_ATTEND_HD(0, CB_KV_F32)
    }
#undef CB_ATTEND_HD
#undef CB_ATTEND_NH
}

/* ---- q8 attention with AVX512-VNNI (cb_attend_head's q8 bits) ----
 *
 * Scores: key rows are transposed 16 at a time so that one vpdpbusd adds 4 codes of 16 rows at
 * once: kt [groups][16] int32, group g of row r the row's codes 4g..4g+3 XOR 0x80 (vpdpbusd takes
 * them as unsigned, code + 128; the query's bias, -128 x its codes' sum, starts the sum), and the
 * query head's 4 codes of group g broadcast. A score's sum is then complete in its lane: no
 * reduction (decode's f32 scores spend about a third of their operations gathering lanes). The
 * transpose (64 shuffles per 16 x 64 bytes) is paid once per row and serves every query head
 * reading it: 8 in decode's units, a prompt block's 8 queries x 8 heads.
 * Values: a group's rows as int16 pairs (as cb_q8_vpairs_avx2's, columns in order), one vpdpwssd adding two
 * positions x 16 columns for a head — against a widening, a conversion and an FMA per position
 * and 16 columns in float; a prompt converts each block once for all its queries and heads.
 * The integer sums are exact and the float steps are the AVX2 tier's (cb_q8_score_from_sum,
 * cb_q8_weights_avx2, o = fma(sum, g, o)), so the bits are that tier's and a prompt's equal decoding it. */

/* acc += vpdpbusd / vpdpwssd (acc, a, b) in place. GCC's intrinsics copy each accumulator to
 * another register and back around every instruction of these loops (a move per product, a large
 * share of the q8 value pass's instructions); inline assembly ties it to one register. */
#if defined(__GNUC__) && !defined(__clang__)
#define CB_DPBUSD512(acc, a, b) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b))
#define CB_DPWSSD512(acc, a, b) __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b))
#else
#define CB_DPBUSD512(acc, a, b) ((acc) = _mm512_dpbusd_epi32((acc), (a), (b)))
#define CB_DPWSSD512(acc, a, b) ((acc) = _mm512_dpwssd_epi32((acc), (a), (b)))
#endif

/* Rows rows[0..valid-1] (q8 cache rows) into kt [cb_q8_qlen(head_dim) / 4][16] and kd [16]:
 * bytes past head_dim and rows past valid are code 0 (they meet the query's zero padding or are
 * never stored). */
CB_TARGET_AVX512_VNNI static CB_ALWAYS_INLINE void
cb_q8_transpose16_avx512vnni(int32_t *kt, float *kd, const char *const *rows, int valid, int head_dim) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int c = 0; c < head_dim; c += 64) {
        const __mmask64 m = head_dim - c >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (head_dim - c)) - 1);
        __m512i r[16], a[16], b[16];
        for (int i = 0; i < 16; i++)
            r[i] = i < valid ? _mm512_maskz_loadu_epi8(m, rows[i] + CB_KV_Q8_SCALE_BYTES + c) : _mm512_setzero_si512();
        for (int k = 0; k < 8; k++) {                 /* 32-bit interleave of row pairs */
            a[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
            a[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
        }
        for (int k = 0; k < 4; k++) {                 /* b[4k + j], 128-bit lane L: group 4L + j of rows 4k..4k+3 */
            b[4 * k] = _mm512_unpacklo_epi64(a[4 * k], a[4 * k + 2]);
            b[4 * k + 1] = _mm512_unpackhi_epi64(a[4 * k], a[4 * k + 2]);
            b[4 * k + 2] = _mm512_unpacklo_epi64(a[4 * k + 1], a[4 * k + 3]);
            b[4 * k + 3] = _mm512_unpackhi_epi64(a[4 * k + 1], a[4 * k + 3]);
        }
        int32_t *dst = kt + (size_t)(c / 4) * 16;
        for (int j = 0; j < 4; j++) {                 /* group 4L + j: lane L of b[j], b[4 + j], b[8 + j], b[12 + j] */
            const __m512i c0 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x44), c1 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xEE);
            const __m512i d0 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x44), d1 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xEE);
            _mm512_storeu_si512(dst + (size_t)(0 + j) * 16, _mm512_xor_si512(_mm512_shuffle_i32x4(c0, d0, 0x88), flip));
            _mm512_storeu_si512(dst + (size_t)(4 + j) * 16, _mm512_xor_si512(_mm512_shuffle_i32x4(c0, d0, 0xDD), flip));
            _mm512_storeu_si512(dst + (size_t)(8 + j) * 16, _mm512_xor_si512(_mm512_shuffle_i32x4(c1, d1, 0x88), flip));
            _mm512_storeu_si512(dst + (size_t)(12 + j) * 16, _mm512_xor_si512(_mm512_shuffle_i32x4(c1, d1, 0xDD), flip));
        }
    }
    for (int i = 0; i < 16; i++) kd[i] = i < valid ? cb_kv_q8_scale(rows[i]) : 0.0f;
}

/* NH query heads (q: head i at q + i x head_dim) quantized (cb_q8_query_quantize's codes, the
 * 8-lane store) into qt [cb_q8_qlen / 4][8] int32 — group g's 4 codes of head i at qt[8g + i], so a
 * step's broadcasts come from one address — and m [NH]. */
CB_TARGET_AVX512 static CB_ALWAYS_INLINE void cb_q8_queries_avx512(int32_t *qt, cb_q8_query *m, const float *q,
                                                                  int head_dim, float scale, const int NH) {
    const int groups = cb_q8_qlen(head_dim) / 4;
    int32_t codes[CB_KV_Q8_MAX_HEAD_DIM / 4];
    for (int i = 0; i < NH; i++) {
        cb_q8_query_quantize_avx2((int8_t *)codes, &m[i], q + (size_t)i * head_dim, head_dim, scale);
        for (int g = 0; g < groups; g++) qt[8 * g + i] = codes[g];
    }
}

/* Scores of V x 16 transposed rows (kt, kd: V consecutive sets of 16) for NH query heads (qt, m as
 * cb_q8_queries_avx512 makes them): sc[i][t_at + r] for the rows r of the set whose bit is in keep[v]. */
CB_TARGET_AVX512_VNNI static CB_ALWAYS_INLINE void
cb_q8_scores16_avx512vnni(float *const *sc, int t_at, const __mmask16 *keep, const int32_t *kt, const float *kd,
                          const int32_t *qt, int groups, const cb_q8_query *m, const int NH, const int V) {
    __m512i acc[2][8];
    for (int v = 0; v < V; v++)
        for (int i = 0; i < NH; i++) acc[v][i] = _mm512_set1_epi32(m[i].bias);
    for (int g = 0; g < groups; g++) {
        __m512i k[2];
        for (int v = 0; v < V; v++) k[v] = _mm512_loadu_si512(kt + ((size_t)v * groups + g) * 16);
        for (int i = 0; i < NH; i++) {
            const __m512i qv = _mm512_set1_epi32(qt[8 * g + i]);
            for (int v = 0; v < V; v++) CB_DPBUSD512(acc[v][i], k[v], qv);
        }
    }
    for (int v = 0; v < V; v++) {
        const __m512 dk = _mm512_loadu_ps(kd + 16 * v);
        for (int i = 0; i < NH; i++)
            _mm512_mask_storeu_ps(sc[i] + t_at + 16 * v, keep[v],
                                  _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[v][i]), dk), _mm512_set1_ps(m[i].qs)));
    }
}

/* cb_q8_vpairs_avx2's pairs on 512-bit vectors, 16 columns a step, in order (a last 8 as there). */
CB_TARGET_AVX512_VNNI static CB_ALWAYS_INLINE void cb_q8_vpairs_avx512vnni(int32_t *vp, float *vd, const char *vbase,
                                                                          int row, int pairs, int ring, int head_dim) {
    const size_t rbytes = cb_kv_row_bytes(head_dim, CB_KV_Q8);
    const __m512i low = _mm512_set1_epi32(0xFFFF);
    for (int m = 0; m < pairs; m++) {
        const int rb = row + 1 == ring ? 0 : row + 1;
        const char *a = vbase + (size_t)row * rbytes + CB_KV_Q8_SCALE_BYTES, *b = vbase + (size_t)rb * rbytes + CB_KV_Q8_SCALE_BYTES;
        vd[2 * m] = cb_kv_q8_scale(a - CB_KV_Q8_SCALE_BYTES);
        vd[2 * m + 1] = cb_kv_q8_scale(b - CB_KV_Q8_SCALE_BYTES);
        int32_t *dst = vp + (size_t)m * head_dim;
        int d = 0;
        for (; d + 16 <= head_dim; d += 16) {
            const __m512i ca = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(a + d)));
            const __m512i cb = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(b + d)));
            _mm512_storeu_si512(dst + d, _mm512_or_si512(_mm512_and_si512(ca, low), _mm512_slli_epi32(cb, 16)));
        }
        if (d < head_dim) {
            const __m256i ca = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(a + d)));
            const __m256i cb = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(b + d)));
            _mm256_storeu_si256((__m256i *)(void *)(dst + d), _mm256_or_si256(_mm256_and_si256(ca, _mm512_castsi512_si256(low)),
                                                                         _mm256_slli_epi32(cb, 16)));
        }
        row = rb + 1 == ring ? 0 : rb + 1;
    }
}

/* cb_q8_weights_avx2 on 16 lanes, the same bits. */
CB_TARGET_AVX512 static CB_ALWAYS_INLINE float cb_q8_weights_avx512(int32_t *wp, const float *p, int t_first, int lo,
                                                                   int hi, const float *vd) {
    __m512 w[2];
    __mmask16 nan = 0;
    for (int v = 0; v < 2; v++) {
        const int t = t_first + 16 * v, a = lo - t, b = hi - t;   /* lanes a..b-1 are in the span */
        const unsigned up = b >= 16 ? 0xFFFFu : b > 0 ? (1u << b) - 1u : 0u;
        const __mmask16 in = (__mmask16)(a > 0 ? up & ~((1u << (a < 16 ? a : 16)) - 1u) : up);
        w[v] = _mm512_maskz_mul_ps(in, _mm512_maskz_loadu_ps(in, p + t), _mm512_loadu_ps(vd + 16 * v));
        nan |= _mm512_cmp_ps_mask(w[v], w[v], _CMP_UNORD_Q);
    }
    const cb_q8_wscale s = cb_q8_group_scale(nan ? 0.0f : _mm512_reduce_max_ps(_mm512_max_ps(w[0], w[1])), nan != 0);
    if (!(s.inv > 0.0f)) {
        memset(wp, 0, sizeof(int32_t) * (CB_Q8_VGROUP / 2));
        return s.g;
    }
    const __m512 inv = _mm512_set1_ps(s.inv);
    const __m512i top = _mm512_set1_epi32(32767);
    for (int v = 0; v < 2; v++)
        _mm256_storeu_si256((__m256i *)(void *)(wp + 8 * v),
                            _mm512_cvtepi32_epi16(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(w[v], inv)), top)));
    return s.g;
}

/* cb_q8_vpass_avx2 with vpdpwssd: NC 16-column vectors from column d for NH <= 4 heads. */
CB_TARGET_AVX512_VNNI static CB_ALWAYS_INLINE void cb_q8_vpass_avx512vnni(float *const *o, const int32_t *wp,
                                                                         const float *gs, const int32_t *vp,
                                                                         int head_dim, int d, int zero, const int NH,
                                                                         const int NC) {
    __m512i acc[4][4];
    for (int i = 0; i < NH; i++)
        for (int c = 0; c < NC; c++) acc[i][c] = _mm512_setzero_si512();
    for (int m = 0; m < CB_Q8_VGROUP / 2; m++) {
        __m512i v[4];
        for (int c = 0; c < NC; c++) v[c] = _mm512_loadu_si512(vp + (size_t)m * head_dim + d + 16 * c);
        for (int i = 0; i < NH; i++) {
            const __m512i w = _mm512_set1_epi32(wp[(CB_Q8_VGROUP / 2) * i + m]);
            for (int c = 0; c < NC; c++) CB_DPWSSD512(acc[i][c], v[c], w);
        }
    }
    for (int i = 0; i < NH; i++)
        for (int c = 0; c < NC; c++) {
            float *dst = o[i] + d + 16 * c;
            _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][c]), _mm512_set1_ps(gs[i]),
                                                  zero ? _mm512_setzero_ps() : _mm512_loadu_ps(dst)));
        }
}

/* A group for NH <= 8 heads (cb_q8_vgroup_avx2's arguments): weights, then 4 heads at a time the
 * columns 64 a pass, then 16, then a last 8 by the AVX2 pass. */
CB_TARGET_AVX512_VNNI static CB_ALWAYS_INLINE void cb_q8_vgroup_avx512vnni(float *const *o, const float *const *sc,
                                                                          int t_first, int lo, int hi, const int32_t *vp,
                                                                          const float *vd, int head_dim, const int NH) {
    int32_t wp[8 * CB_Q8_VGROUP / 2];
    float gs[8];
    for (int i = 0; i < NH; i++) gs[i] = cb_q8_weights_avx512(wp + (CB_Q8_VGROUP / 2) * i, sc[i], t_first, lo, hi, vd);
    const int zero = t_first <= 0;
    for (int g = 0; g < NH; g += 4) {
        const int nh = NH - g < 4 ? NH - g : 4;
        float *const *og = o + g;
        const int32_t *wg = wp + (CB_Q8_VGROUP / 2) * g;
        int d = 0;
#define CB_Q8_VPASS(k, nc) cb_q8_vpass_avx512vnni(og, wg, gs + g, vp, head_dim, d, zero, k, nc)
#define CB_Q8_VPASS_NH(nc)                                        \
        switch (nh) {                                             \
        case 1: CB_Q8_VPASS(1, nc); break;                        \
        case 2: CB_Q8_VPASS(2, nc); break;                        \
        case 3: CB_Q8_VPASS(3, nc); break;                        \
        default: CB_Q8_VPASS(4, nc); break;                       \
        }
        for (; d + 64 <= head_dim; d += 64) CB_Q8_VPASS_NH(4)
        for (; d + 16 <= head_dim; d += 16) CB_Q8_VPASS_NH(1)
#undef CB_Q8_VPASS
#undef CB_Q8_VPASS_NH
        if (d < head_dim) {
            switch (nh) {
            case 1: cb_q8_vpass_avx2(og, wg, gs + g, vp, head_dim, d, zero, 1, 1); break;
            case 2: cb_q8_vpass_avx2(og, wg, gs + g, vp, head_dim, d, zero, 2, 1); break;
            case 3: cb_q8_vpass_avx2(og, wg, gs + g, vp, head_dim, d, zero, 3, 1); break;
            default: cb_q8_vpass_avx2(og, wg, gs + g, vp, head_dim, d, zero, 4, 1); break;
            }
        }
    }
}

/* Decode (cb_attend_fn) over a q8 cache for NH <= 8 query heads: the key rows 16 at a time,
 * transposed and prefetched a set ahead; the softmax; the value groups (CB_Q8_VGROUP positions
 * from a multiple of it), each converted once for the NH heads, the next prefetched. */
CB_TARGET_AVX512_VNNI static CB_ALWAYS_INLINE void
cb_attend_group_q8_avx512vnni(float *out, const float *q, const void *k_cache, const void *v_cache, float *scores,
                              int sc_stride, int h0, int kvh, int head_dim, int start, int pos, int ring, float scale,
                              const float *sinks, int32_t *scratch, const int NH) {
    const size_t rbytes = cb_kv_row_bytes(head_dim, CB_KV_Q8);
    const int n = pos - start + 1, row0 = start % ring, groups = cb_q8_qlen(head_dim) / 4;
    int32_t qt[CB_KV_Q8_MAX_HEAD_DIM / 4 * 8];
    cb_q8_query m[CB_ATTN_HEADS_WIDE];
    float kd[CB_Q8_VGROUP], *sc[8], *o[8];
    cb_q8_queries_avx512(qt, m, q + (size_t)h0 * head_dim, head_dim, scale, NH);
    for (int i = 0; i < NH; i++) {
        sc[i] = scores + (size_t)(h0 + i) * sc_stride;
        o[i] = out + (size_t)(h0 + i) * head_dim;
    }
    const char *kbase = (const char *)k_cache + (size_t)kvh * ring * rbytes;
    const char *vbase = (const char *)v_cache + (size_t)kvh * ring * rbytes;
    for (int t = 0, row = row0; t < n; t += 16) {
        const int valid = n - t < 16 ? n - t : 16;
        const char *rows[16];
        for (int r = 0; r < valid; r++) {
            rows[r] = kbase + (size_t)row * rbytes;
            int ahead = row + 16;                      /* the next set's row */
            ahead = ahead < ring ? ahead : ahead % ring;
            for (size_t b = 0; b < rbytes; b += 64) _mm_prefetch(kbase + (size_t)ahead * rbytes + b, _MM_HINT_T0);
            row = row + 1 == ring ? 0 : row + 1;
        }
        cb_q8_transpose16_avx512vnni(scratch, kd, rows, valid, head_dim);
        const __mmask16 keep = (__mmask16)((1u << valid) - 1u);
        cb_q8_scores16_avx512vnni(sc, t, &keep, scratch, kd, qt, groups, m, NH, 1);
    }
    float inv[8];                                      /* 1 / each head's softmax sum */
    CB_ATTN_EXPS_HEADS(cb_softmax_unnormalized_avx512, sc, n, sinks, h0, NH, inv)
    for (int g0 = start - start % CB_Q8_VGROUP; g0 <= pos; g0 += CB_Q8_VGROUP) {
        cb_attn_prefetch_rows(vbase, g0 + CB_Q8_VGROUP, g0 + 2 * CB_Q8_VGROUP, ring, rbytes);
        cb_q8_vpairs_avx512vnni(scratch, kd, vbase, g0 % ring, CB_Q8_VGROUP / 2, ring, head_dim);
        cb_q8_vgroup_avx512vnni(o, (const float *const *)sc, g0 - start, 0, n, scratch, kd, head_dim, NH);
    }
    cb_q8_scale_outputs(o, inv, head_dim, NH);
}

/* A prompt's block (cb_attend_block_fn) over a q8 cache for NH <= 8 heads: the block's query heads
 * quantized once; blocks of cb_q8_block_rows positions from a multiple of CB_Q8_VGROUP, each key
 * block transposed once for all the queries (32 rows a step: 2 x NH accumulators), each value
 * block converted to pairs once. Scratch: kv [CB_Q8_VP_INT32] (the transposed keys, then the
 * value pairs), kd [cb_q8_block_rows + 16], qt [CB_ATTN_QBLOCK][qlen / 4][8], m [CB_ATTN_QBLOCK][8]. */
CB_TARGET_AVX512_VNNI static CB_ALWAYS_INLINE void
cb_attend_qblock_q8_avx512vnni(float *out, int ldo, const float *q, int ldq, int nq, const void *k_cache,
                               const void *v_cache, float *scores, int sc_stride, int h0, int kvh, int head_dim,
                               int pos0, int window, int ring, float scale, const float *sinks, int32_t *kv, float *kd,
                               int32_t *qt, cb_q8_query *m, const int NH) {
    const size_t rbytes = cb_kv_row_bytes(head_dim, CB_KV_Q8);
    const int groups = cb_q8_qlen(head_dim) / 4, krows = cb_q8_block_rows(head_dim);
    for (int j = 0; j < nq; j++)
        cb_q8_queries_avx512(qt + (size_t)j * groups * 8, m + 8 * j, q + (size_t)j * ldq + (size_t)h0 * head_dim,
                             head_dim, scale, NH);
#define CB_PREPARE_Q8(pass, b0, b1)                                                                   \
    if (pass == 0) {                                                                                  \
        for (int s_ = 0, row_ = (b0) % ring; s_ < (b1) - (b0); s_ += 16) {                            \
            const int valid_ = (b1) - (b0) - s_ < 16 ? (b1) - (b0) - s_ : 16;                         \
            const char *rows_[16];                                                                    \
            for (int r_ = 0; r_ < valid_; r_++) {                                                     \
                rows_[r_] = kbase + (size_t)row_ * rbytes;                                            \
                row_ = row_ + 1 == ring ? 0 : row_ + 1;                                               \
            }                                                                                         \
            cb_q8_transpose16_avx512vnni(kv + (size_t)(s_ / 16) * groups * 16, kd + s_, rows_, valid_, head_dim); \
        }                                                                                             \
        cb_attn_prefetch_rows(kbase, b1, (b1) + krows < last + 1 ? (b1) + krows : last + 1, ring, rbytes); \
    } else {                                                                                          \
        cb_q8_vpairs_avx512vnni(kv, kd, vbase, (b0) % ring,                                           \
                                ((b1) - (b0) + CB_Q8_VGROUP - 1) / CB_Q8_VGROUP * (CB_Q8_VGROUP / 2), ring, head_dim); \
        cb_attn_prefetch_rows(vbase, b1, (b1) + krows < last + 1 ? (b1) + krows : last + 1, ring, rbytes); \
    }
#define CB_SCORES_Q8(j, sc, qh, kb, t0, t1, r0, s0)                                                   \
    do {                                                                                              \
        const int s1_ = (s0) + (t1) - (t0), t_at_ = (t0) - (s0);                                      \
        const int32_t *qj_ = qt + (size_t)(j) * groups * 8;                                           \
        (void)qh;                                                                                     \
        for (int s_ = (s0) & ~15; s_ < s1_; s_ += 32) {                                               \
            __mmask16 keep_[2];                                                                       \
            for (int v_ = 0; v_ < 2; v_++) {                                                          \
                const int lo_ = (s0) - s_ - 16 * v_, hi_ = s1_ - s_ - 16 * v_;                        \
                const unsigned up_ = hi_ >= 16 ? 0xFFFFu : hi_ > 0 ? (1u << hi_) - 1u : 0u;           \
                keep_[v_] = (__mmask16)(lo_ > 0 ? up_ & ~((1u << (lo_ < 16 ? lo_ : 16)) - 1u) : up_); \
            }                                                                                         \
            if (s1_ - s_ > 16)                                                                        \
                cb_q8_scores16_avx512vnni(sc, t_at_ + s_, keep_, kv + (size_t)(s_ / 16) * groups * 16, kd + s_, \
                                          qj_, groups, m + 8 * (j), NH, 2);                           \
            else                                                                                      \
                cb_q8_scores16_avx512vnni(sc, t_at_ + s_, keep_, kv + (size_t)(s_ / 16) * groups * 16, kd + s_, \
                                          qj_, groups, m + 8 * (j), NH, 1);                           \
        }                                                                                             \
    } while (0)
#define CB_VALUES_Q8(o, sc, vb, t0, t1, r0, s0)                                                       \
    for (int k_ = (s0) / CB_Q8_VGROUP * CB_Q8_VGROUP; k_ < (s0) + (t1) - (t0); k_ += CB_Q8_VGROUP)    \
        cb_q8_vgroup_avx512vnni(o, sc, (t0) - (s0) + k_, t0, t1, kv + (size_t)(k_ / 2) * head_dim, kd + k_, head_dim, NH)
    float inv_sum[CB_ATTN_QBLOCK][8];             /* [query][head] 1 / its softmax's sum */
#define CB_EXPS_Q8(j, sc, n) CB_ATTN_EXPS_HEADS(cb_softmax_unnormalized_avx512, sc, n, sinks, h0, NH, inv_sum[j])
    CB_ATTEND_QBLOCK_BODY(CB_SCORES_Q8, CB_VALUES_Q8, krows, CB_Q8_VGROUP, CB_PREPARE_Q8, CB_EXPS_Q8, CB_ATTN_FINISH_Q8)
#undef CB_EXPS_Q8
#undef CB_PREPARE_Q8
#undef CB_SCORES_Q8
#undef CB_VALUES_Q8
}

/* The tier's attention where the CPU has AVX512-VNNI: q8 caches (head_dim a multiple of 8) by the
 * kernels above, the rest as cb_attend_heads_avx512 / cb_attend_block_avx512. */
CB_TARGET_AVX512_VNNI static void cb_attend_heads_avx512vnni(float *out, const float *q, const void *k_cache,
                                                             const void *v_cache, float *scores, int sc_stride, int h0,
                                                             int nh, int kvh, int head_dim, int start, int pos, int ring,
                                                             float scale, const float *sinks, int kv) {
    if (kv != CB_KV_Q8 || head_dim % 8) {
        cb_attend_heads_avx512(out, q, k_cache, v_cache, scores, sc_stride, h0, nh, kvh, head_dim, start, pos, ring,
                               scale, sinks, kv);
        return;
    }
    int32_t scratch[CB_Q8_VP_INT32];     /* 16 key rows transposed, then a value group's pairs: 64 KB at most */
#define CB_Q8_NH(k, unused) cb_attend_group_q8_avx512vnni(out, q, k_cache, v_cache, scores, sc_stride, h0, kvh, head_dim, \
                                                  start, pos, ring, scale, sinks, scratch, k)
    CB_SWITCH_HEADS8(nh, CB_Q8_NH, 0)
#undef CB_Q8_NH
}

CB_TARGET_AVX512_VNNI static void cb_attend_block_avx512vnni(float *out, int ldo, const float *q, int ldq, int nq,
                                                             const void *k_cache, const void *v_cache, float *scores,
                                                             int sc_stride, int h0, int nh, int kvh, int head_dim,
                                                             int pos0, int window, int ring, float scale,
                                                             const float *sinks, int kv) {
    if (kv != CB_KV_Q8 || head_dim % 8) {
        cb_attend_block_avx512(out, ldo, q, ldq, nq, k_cache, v_cache, scores, sc_stride, h0, nh, kvh, head_dim, pos0,
                               window, ring, scale, sinks, kv);
        return;
    }
    int32_t kv_block[CB_Q8_VP_INT32];    /* a block's transposed keys, then its value pairs: 64 KB at most */
    float kd[CB_Q8_KBLOCK_BYTES / CB_Q8_QALIGN + CB_Q8_VGROUP];
    int32_t qt[CB_ATTN_QBLOCK * 8 * CB_KV_Q8_MAX_HEAD_DIM / 4];           /* the queries' codes: 64 KB at most */
    cb_q8_query m[CB_ATTN_QBLOCK * 8];
#define CB_Q8_NH(k, unused) cb_attend_qblock_q8_avx512vnni(out, ldo, q, ldq, nq, k_cache, v_cache, scores, sc_stride, h0, kvh, \
                                                   head_dim, pos0, window, ring, scale, sinks, kv_block, kd, qt, m, k)
    CB_SWITCH_HEADS8(nh, CB_Q8_NH, 0)
#undef CB_Q8_NH
}

#endif /* CB_X86 */
#endif /* COLIBRI_KERNELS_AVX512_H */
