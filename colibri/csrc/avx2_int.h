/* avx2_int.h — the 256-bit integer helpers every int step's group kernels share: the AVX2 tier's
 * (kernels_avx2.h) and the VNNI bodies' (vnni_body.h), wherever those are instantiated — the kernel
 * module's steps, and the probes' step emulated in AVX2 (test_steps.h). Inline functions, types and
 * macros only: a module that includes it compiles only what it calls, so no kernel body is compiled
 * twice (tests/test_compiled_once.py).
 */
#ifndef COLIBRI_AVX2_INT_H
#define COLIBRI_AVX2_INT_H

#include "api.h"
#include "target.h"

#if CB_X86
#include <immintrin.h>

/* The table's tile entries (rows R = 1): the format and T in 1..4 select a body specialised at
 * compile time (no format test per block in the inner loop). Callers never pass T > 4
 * (cb_job_rows and cb_job_transposed tile by CB_TILE_TOKENS = 4): T > 4 would run as 4. */
#define CB_AVX2_T_CASES(CALL, DT) \
    switch (T) { case 1: CALL(DT, 1); break; case 2: CALL(DT, 2); break; \
                 case 3: CALL(DT, 3); break; default: CALL(DT, 4); break; }
/* T = 1..8 (the 512-bit tiles' tokens: kernels_vnni.h, kernels_avx512.h), each a separate instantiation. */
#define CB_T8_CASES(CALL, DT) \
    switch (T) { case 1: CALL(DT, 1); break; case 2: CALL(DT, 2); break; case 3: CALL(DT, 3); break; \
                 case 4: CALL(DT, 4); break; case 5: CALL(DT, 5); break; case 6: CALL(DT, 6); break; \
                 case 7: CALL(DT, 7); break; default: CALL(DT, 8); break; }

/* An int4 group's nibbles as bytes 0..15: lo[c] / hi[c] = elements 0..15 / 16..31 of outputs 2c
 * (low 128 bits) and 2c + 1. */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void cb_unpack_group_int4_avx2(__m256i lo[4], __m256i hi[4], const cb_group_int4 *g) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; c++) {                       /* outputs 2c, 2c+1: 32 bytes */
        __m256i v = _mm256_loadu_si256((const __m256i *)g->qs[2 * c]);
        lo[c] = _mm256_and_si256(v, m4);
        hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
}

/* The 8 outputs' sums from s[c] = [2c: 4 partial sums | 2c+1: 4 partial sums], minus xoff: an hadd
 * tree gives [r0 r2 r4 r6 | r1 r3 r5 r7], a permute puts them in output order. */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE __m256i cb_int4_group_reduce_avx2(const __m256i s[4], __m256i xoff) {
    __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
    h = _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    return _mm256_sub_epi32(h, xoff);
}

/* Token j's activation block kb as the group sums want it (T tokens): xoff is the weights' offset
 * times sum(x) — 8 * sum(x) for int4's nibbles, 128 * sum(x) for int8 stored + 128 (the VNNI
 * kernels, `offset_int8`), otherwise unused. */
typedef struct {
    __m256i xq[4], xlo[4], xhi[4], xoff[4];
    __m256 dx[4];
} cb_tq_block;

CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_tq_prepare_avx2(cb_tq_block *b, const cb_act_q8 *acts, int kb, int dtype, const int T, const int offset_int8) {
    for (int j = 0; j < T; j++) {
        const int8_t *q = acts[j].q + kb * CB_QBLOCK;
        b->xq[j] = _mm256_loadu_si256((const __m256i *)q);
        b->dx[j] = _mm256_set1_ps(acts[j].d[kb]);
        if (dtype == CB_INT4) {
            b->xlo[j] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q));
            b->xhi[j] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(q + 16)));
            b->xoff[j] = _mm256_set1_epi32(8 * acts[j].s[kb]);
        } else if (offset_int8) {
            b->xoff[j] = _mm256_set1_epi32(128 * acts[j].s[kb]);
        }
    }
}

/* y[j * ldo + 0..7] += the 8 int32 block sums isum[j] of group grp, scaled (the 8 weight scales
 * times token j's): the end of every transposed integer step, whatever computed the sums. */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void
cb_tq_scale_add_avx2(float *y, int ldo, const char *grp, const __m256i *isum, const cb_tq_block *b, const int T) {
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)grp));   /* the 8 scales */
    for (int j = 0; j < T; j++) {
        float *yj = y + (size_t)j * ldo;
        _mm256_storeu_ps(yj, _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j]), _mm256_mul_ps(dw, b->dx[j]), _mm256_loadu_ps(yj)));
    }
}

/* Decode (T = 1) takes CB_TDECODE_ROWS block rows per pass over the outputs: that many read
 * streams per thread instead of one, so more of the weights' reads are in flight at once (decode
 * is bound by them); every output still adds block kb before kb + 1, so the bits do not change. */
#ifndef CB_TDECODE_ROWS
#define CB_TDECODE_ROWS 4
#endif
/* The body of a transposed integer tile (every kernel's order): out[j * ldo + o0..o1) = the
 * product for T tokens, blocks in order. GROUP(y, ldo, grp, dtype, block, T) is the step, OFFSET_INT8
 * whether it wants int8's 128 * sum(x) (cb_tq_prepare_avx2). In a function with out, ldo, w,
 * dtype, acts, rows, cols, o0, o1, T. */
#define CB_TTILE_QUANT_BODY(GROUP, OFFSET_INT8)                                                         \
    const int groups = rows / CB_TGROUP, nb = cols / CB_QBLOCK;                                       \
    const size_t gbytes = cb_group_bytes(dtype), row_bytes = (size_t)groups * gbytes;                  \
    for (int j = 0; j < T; j++) memset(out + (size_t)j * ldo + o0, 0, sizeof(float) * (size_t)(o1 - o0)); \
    int kb = 0;                                                                                        \
    if (T == 1)                                                                                        \
        for (; kb + CB_TDECODE_ROWS <= nb; kb += CB_TDECODE_ROWS) {                                    \
            cb_tq_block b[CB_TDECODE_ROWS];                                                            \
            for (int r = 0; r < CB_TDECODE_ROWS; r++) cb_tq_prepare_avx2(&b[r], acts, kb + r, dtype, 1, OFFSET_INT8); \
            const char *grp = w + ((size_t)kb * groups + o0 / CB_TGROUP) * gbytes;                    \
            for (int o = o0; o < o1; o += CB_TGROUP, grp += gbytes)                                    \
                for (int r = 0; r < CB_TDECODE_ROWS; r++) GROUP(out + o, ldo, grp + r * row_bytes, dtype, &b[r], 1); \
        }                                                                                              \
    for (; kb < nb; kb++) {                                                                            \
        cb_tq_block b;                                                                                 \
        cb_tq_prepare_avx2(&b, acts, kb, dtype, T, OFFSET_INT8);                                       \
        const char *grp = w + ((size_t)kb * groups + o0 / CB_TGROUP) * gbytes;                        \
        for (int o = o0; o < o1; o += CB_TGROUP, grp += gbytes) GROUP(out + o, ldo, grp, dtype, &b, T); \
    }

/* Four activation bytes (inputs 4c..4c+3 of a block) in every int32 lane. */
CB_TARGET_AVX2 static inline __m256i cb_bcast4_avx2(const int8_t *q) {
    int32_t v;
    memcpy(&v, q, sizeof v);
    return _mm256_set1_epi32(v);
}

#define CB_TPREFILL_KBLOCKS 32

/* The order of a repacked prefill's products (every kernel's): a group's blocks
 * CB_TPREFILL_KBLOCKS at a time (9 KB of packed weights) pass over every 4-token tile, so they and
 * a tile's activations stay in L1. STEP runs with o (the tile's 8 outputs of its first token), pk
 * (block kb0 of group g), xs (the tile's first activation sums), kb0, kb1, t and T (tokens left). */
#define CB_TPREFILL_TILES(STEP)                                                                         \
    for (int g = g0; g < g1; g++)                                                                       \
        for (int kb0 = 0; kb0 < nb; kb0 += CB_TPREFILL_KBLOCKS) {                                       \
            const int kb1 = kb0 + CB_TPREFILL_KBLOCKS < nb ? kb0 + CB_TPREFILL_KBLOCKS : nb;            \
            const uint8_t *pk = packed + (size_t)(g - g0) * nb * CB_TPACK_BLOCK_BYTES                   \
                                + (size_t)kb0 * CB_TPACK_BLOCK_BYTES;                                   \
            for (int t = 0; t < n; t += 4) {                                                            \
                float *o = out + (size_t)t * ldo + (size_t)g * CB_TGROUP;                               \
                const int32_t *xs = xsum + (size_t)t * nb;                                              \
                const int T = n - t;                                                                    \
                STEP                                                                                    \
            }                                                                                           \
        }

/* The 8 outputs' weight scales of an interleaved group at gp: f16 (int8/int4) or e8m0 halved
 * (mxfp4, cb_e8m0_half in 8 lanes: (e - 1) << 23 from e = 2, the two subnormals below). */
CB_TARGET_AVX2 static inline __m256 cb_igroup_scales_avx2(const char *gp, int dtype) {
    if (dtype != CB_MXFP4) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)gp));
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)gp));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(small, normal, _mm256_cmpgt_epi32(e, _mm256_set1_epi32(1))));
}

/* Each byte of h shifted left by `shift` (4, 2, 0 or -2: right by 2), bits 4..5 kept: an int6
 * code's high 2 bits in place above its nibble (CB_INT6_HSHIFT). The shifts are immediates in
 * every branch (MSVC and clang at -O0 want constants). */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE __m256i cb_int6_high_avx2(__m256i h, int shift) {
    __m256i placed;
    switch (shift) {
    case 4: placed = _mm256_slli_epi16(h, 4); break;
    case 2: placed = _mm256_slli_epi16(h, 2); break;
    case 0: placed = h; break;
    default: placed = _mm256_srli_epi16(h, 2); break;
    }
    return _mm256_and_si256(placed, _mm256_set1_epi8(0x30));
}

/* An int4 / mxfp4 / nl4 / int6 group's vector v of codes (32 bytes), its low and high nibbles as
 * the bytes the integer step multiplies: int4's as they are, mxfp4's through cb_mxfp4_u12, nl4's
 * through cb_nl4_u64, int6's with their high 2 bits ORed in (u = code + 32, 0 .. 63). */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void cb_inibbles_avx2(const char *gp, int dtype, int v, __m256i *lo, __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const size_t codes = dtype == CB_MXFP4 ? offsetof(cb_igroup_mxfp4, qs)
                       : dtype == CB_NL4 ? offsetof(cb_igroup_nl4, qs)
                       : dtype == CB_INT6 ? offsetof(cb_igroup_int6, qs) : offsetof(cb_igroup_int4, qs);
    const __m256i a = _mm256_loadu_si256((const __m256i *)(gp + codes + 32 * v));
    *lo = _mm256_and_si256(a, m4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(a, 4), m4);
    if (dtype == CB_INT6) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(gp + offsetof(cb_igroup_int6, qh) + 32 * (v / 2)));
        *lo = _mm256_or_si256(*lo, cb_int6_high_avx2(h, CB_INT6_HSHIFT(v, 0)));
        *hi = _mm256_or_si256(*hi, cb_int6_high_avx2(h, CB_INT6_HSHIFT(v, 1)));
    }
    if (dtype == CB_MXFP4 || dtype == CB_NL4) {
        const __m256i lut = _mm256_broadcastsi128_si256(
            _mm_loadu_si128((const __m128i *)(dtype == CB_MXFP4 ? cb_mxfp4_u12 : cb_nl4_u64)));
        *lo = _mm256_shuffle_epi8(lut, *lo);
        *hi = _mm256_shuffle_epi8(lut, *hi);
    }
}

/* An nl4 group's 16 six-bit scales (quant.h, cb_nl4_scales), signed int32: the low halves' of
 * the 8 outputs in *lo, the high halves' in *hi. */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE void cb_nl4_scales_avx2(const char *gp, __m256i *lo, __m256i *hi) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)gp));
    uint32_t packed;
    memcpy(&packed, gp + 8, 4);
    const __m256i nib = _mm256_srlv_epi32(_mm256_set1_epi32((int)packed), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    const __m256i bias = _mm256_set1_epi32(CB_NL4_SCALE_BIAS);
    *lo = _mm256_sub_epi32(_mm256_and_si256(b, _mm256_set1_epi32(63)), bias);
    *hi = _mm256_sub_epi32(_mm256_or_si256(_mm256_srli_epi32(b, 6), _mm256_and_si256(_mm256_slli_epi32(nib, 2),
                                                                                     _mm256_set1_epi32(60))), bias);
}

/* An nl4 block's two half sums (int32, exact) under their scales, as one int32 vector: each
 * half's sum is at most 16 x 64 x 127 in magnitude, so the total stays below 2^24 and converts to
 * float exactly. */
CB_TARGET_AVX2 static CB_ALWAYS_INLINE __m256i cb_nl4_scaled_avx2(const char *gp, __m256i lo_sum, __m256i hi_sum) {
    __m256i lo, hi;
    cb_nl4_scales_avx2(gp, &lo, &hi);
    return _mm256_add_epi32(_mm256_mullo_epi32(lo_sum, lo), _mm256_mullo_epi32(hi_sum, hi));
}

/* 4 activation bytes in every int32 lane, from memory: vbroadcastss is a load, no shuffle (a set1
 * of the 4 bytes takes shuffle-port work the decode tile's products need). */
#define CB_BCAST4(p) _mm256_castps_si256(_mm256_broadcast_ss((const float *)(const void *)(p)))

#ifndef CB_IDECODE_STREAMS
#define CB_IDECODE_STREAMS 4
#endif

/* The few-token tiles' prefetch (kernels_avx2.h's cb_ifew2_int4_avx2, vnni_body.h's cb_ifew): each read
 * stream's lines this many bytes ahead, into L2: nearer does not cover the memory's latency at a
 * few tokens' arithmetic a block, much further gains nothing, and into L1 the gain depends on the
 * shape and can turn into a loss. */
#define CB_IFEW_PREFETCH 2048
#define CB_IFEW_HINT _MM_HINT_T1

/* The order of every interleaved prefill tile: group by group, CB_TPREFILL_KBLOCKS blocks (9 KB)
 * at a time under every 4-token tile, so they stay in L1 across the tiles. STEP runs with o (the
 * tile's first output), gp (block kb0 of group g), kb0, kb1, t and T (tokens left). In a function
 * with out, ldo, w, dtype, acts, cols, g0, g1, n. */
#define CB_ITILE_LOOP(STEP)                                                                             \
    const int nb = cols / CB_QBLOCK;                                                                    \
    const size_t gbytes = cb_group_bytes(dtype);                                                        \
    for (int g = g0; g < g1; g++)                                                                       \
        for (int kb0 = 0; kb0 < nb; kb0 += CB_TPREFILL_KBLOCKS) {                                       \
            const int kb1 = kb0 + CB_TPREFILL_KBLOCKS < nb ? kb0 + CB_TPREFILL_KBLOCKS : nb;            \
            const char *gp = w + ((size_t)g * nb + kb0) * gbytes;                                       \
            for (int t = 0; t < n; t += 4) {                                                            \
                float *o = out + (size_t)t * ldo + (size_t)g * CB_TGROUP;                               \
                const int T = n - t;                                                                    \
                STEP                                                                                    \
            }                                                                                           \
        }

/* The decode order (decode, and the few-token tiles: cb_ifew2_int4_avx2, vnni_body.h's cb_ifew):
 * the groups [g0, g1) in CB_IDECODE_STREAMS equal parts read side by side, the rest one by one.
 * DECODE(o, ostride, gp, gstride, G) multiplies G groups. */
#define CB_IDECODE_LOOP(DECODE)                                                                         \
    const int nb = cols / CB_QBLOCK;                                                                    \
    const size_t gbytes = cb_group_bytes(dtype), row = (size_t)nb * gbytes;                             \
    const int per = (g1 - g0) / CB_IDECODE_STREAMS;                                                     \
    for (int g = g0; g < g0 + per; g++)                                                                 \
        DECODE(out + (size_t)g * CB_TGROUP, (size_t)per * CB_TGROUP, w + (size_t)g * row, per * row,    \
               CB_IDECODE_STREAMS);                                                                     \
    for (int g = g0 + per * CB_IDECODE_STREAMS; g < g1; g++)                                            \
        DECODE(out + (size_t)g * CB_TGROUP, 0, w + (size_t)g * row, 0, 1);

/* The few-token tile (vnni_body.h, cb_ifew): a product of 2 .. CB_IFEW_TOKENS(dtype) tokens takes
 * it, CB_VNNI_FEW_TS tokens a pass (set per step where the body is instantiated: the EVEX step's 32 registers hold 4 streams
 * x 2 tokens' sums and accumulators; 0 leaves the step without it), CB_IFEW_KBLOCKS blocks of each
 * stream's row at a time under the passes when there are more. Each stream's line CB_IFEW_PREFETCH
 * bytes ahead goes to L2. At a few tokens the weights' reads, not the products, are the limit, and
 * decode's side-by-side streams read faster than the prompt tiles' one: int8 takes this tile up to
 * 6 tokens; int4, int6 and mxfp4 only at 2, since their unpacking of the codes is shared by 2
 * tokens here but by up to 6 in the quad tile; nl4 keeps the prompt tiles. */
#define CB_IFEW_TOKENS(dtype) ((dtype) == CB_INT8 ? 6 : (dtype) == CB_NL4 ? 1 : 2)
#define CB_IFEW_KBLOCKS 8

#endif /* CB_X86 */
#endif /* COLIBRI_AVX2_INT_H */
