/* kernels_vnni.h — the transposed int8/int4 kernels with a VNNI step (vpdpbusd).
 *
 * vpdpbusd adds to each int32 lane the 4 products of its unsigned bytes in one operand and signed
 * bytes in the other: one instruction for the maddubs + madd (+ add) of the AVX2 kernels, with no
 * int16 intermediate to bound and no sign trick. So the weights go in unsigned — int4 its nibbles
 * (w + 8), int8 w + 128 (q ^ 0x80, q in [-127, 127]) — and each block's sum takes off 8 * sum(x)
 * or 128 * sum(x) (per token and block, computed once). The integer block sums are exact, so they
 * are the AVX2 kernels' and the scalar tier's; scaled and added in the same order, the outputs are
 * the same bits, and prefill still equals decode.
 *   decode and short prompts (stored-order tiles): a stored int8 row is flipped to unsigned in a
 *     register (xor + vpdpbusd per output instead of sign, sign, maddubs, madd); int4's two
 *     nibble halves chain two vpdpbusd;
 *   the repacked prefill: the chunk is packed unsigned for both formats, one vpdpbusd per 4
 *     inputs x 8 outputs x token.
 *
 * The body (vnni_body.h) is compiled once per way of doing the step:
 *   ..._avx512vnni     EVEX vpdpbusd on 256-bit vectors (AVX512_VNNI + AVX512VL)
 *   ..._avxvnni        VEX vpdpbusd (AVX-VNNI: Alder Lake and later, Sierra Forest, Zen 5)
 *   ..._vnni_emulated  the step in exact AVX2 arithmetic (cb_dpbusd_emulated_avx2): tests the body
 *                      bit for bit on CPUs without VNNI (_kernels.set_int_step("vnni-emulated"));
 *                      never chosen by default.
 */
#ifndef COLIBRI_KERNELS_VNNI_H
#define COLIBRI_KERNELS_VNNI_H

#include "kernels_avx2.h"        /* the shared 256-bit helpers; a sibling of kernels_avx512.h */

#if CB_X86

/* vpdpbusd in AVX2: even and odd bytes widened to int16 (u zero-, s sign-extended), multiplied and
 * paired by madd (|u * s| <= 255 * 128: exact), so lane k gets bytes 4k..4k+3 — the instruction's
 * result, which does not saturate either. */
CB_TARGET_AVX2 static inline __m256i cb_dpbusd_emulated_avx2(__m256i acc, __m256i u, __m256i s) {
    const __m256i low_bytes = _mm256_set1_epi16(0x00FF);
    const __m256i u_even = _mm256_and_si256(u, low_bytes), u_odd = _mm256_srli_epi16(u, 8);
    const __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), s_odd = _mm256_srai_epi16(s, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(u_even, s_even), _mm256_madd_epi16(u_odd, s_odd)));
}

/* The emulated step on one vector in memory (its test against the instruction's definition). */
CB_TARGET_AVX2 static void cb_dpbusd_emulated_mem(int32_t out[8], const int32_t acc[8], const uint8_t u[32],
                                                  const int8_t s[32]) {
    _mm256_storeu_si256((__m256i *)out, cb_dpbusd_emulated_avx2(_mm256_loadu_si256((const __m256i *)acc),
                                                                _mm256_loadu_si256((const __m256i *)u),
                                                                _mm256_loadu_si256((const __m256i *)s)));
}

#define CB_VNNI_TARGET CB_TARGET_AVX512_VNNI
#define CB_VNNI_DPBUSD(a, u, s) _mm256_dpbusd_epi32(a, u, s)
#define CB_VNNI_NAME(base) base##_avx512vnni
#include "vnni_body.h"
#undef CB_VNNI_TARGET
#undef CB_VNNI_DPBUSD
#undef CB_VNNI_NAME

#define CB_VNNI_TARGET CB_TARGET_AVXVNNI
#define CB_VNNI_DPBUSD(a, u, s) _mm256_dpbusd_avx_epi32(a, u, s)
#define CB_VNNI_NAME(base) base##_avxvnni
#include "vnni_body.h"
#undef CB_VNNI_TARGET
#undef CB_VNNI_DPBUSD
#undef CB_VNNI_NAME

#define CB_VNNI_TARGET CB_TARGET_AVX2
#define CB_VNNI_DPBUSD(a, u, s) cb_dpbusd_emulated_avx2(a, u, s)
#define CB_VNNI_NAME(base) base##_vnni_emulated
#include "vnni_body.h"
#undef CB_VNNI_TARGET
#undef CB_VNNI_DPBUSD
#undef CB_VNNI_NAME

/* ---- the AVX512-VNNI step's prefill on 512-bit vectors ----------------------------------------
 *
 * The interleaved prefill tile above works on 256-bit vectors: one group's 8 outputs. Where
 * vpdpbusd runs on 512 bits at the 256-bit instruction rate (Zen 5: 6.8-7.8 G a second per core on
 * zmm as on ymm, BENCHMARKS.md; Intel's two 512-bit ports) a zmm holding two neighbouring groups — their
 * 16 outputs, group g in lanes 0..7, g + 1 in lanes 8..15 — does twice the work per instruction.
 * Each vector of a group's codes is unpacked by the 256-bit helpers and the two groups' halves
 * joined (amortised over up to 8 tokens: 32 registers hold 16 sum chains and 8 accumulators); 4
 * activation bytes are broadcast to all 16 lanes. Every output's lane does what the 256-bit tile
 * does — the same exact integer block sums, scaled and added block by block in the same order —
 * so the bits are the same, and prefill still equals decode. A thread's odd last group, and
 * decode, take the 256-bit tile. */
#define CB_ITILE2_TOKENS 8

CB_TARGET_AVX512_VNNI static CB_ALWAYS_INLINE __m512i cb_join_si512(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

CB_TARGET_AVX512_VNNI static CB_ALWAYS_INLINE __m512 cb_join_ps512(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

CB_TARGET_AVX512_VNNI static CB_ALWAYS_INLINE __m512i cb_bcast4_512(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* out[j * ldo + 0..15] (+)= groups g and g + 1 (at gp and gp + gstride, blocks kb0..kb1-1) for T
 * tokens: cb_igroup_avx512vnni's arithmetic on both groups at once. */
CB_TARGET_AVX512_VNNI static CB_ALWAYS_INLINE void
cb_igroup2_avx512vnni(float *out, int ldo, const char *gp, size_t gstride, int dtype, const cb_act_q8 *acts,
                      int kb0, int kb1, int first, int prefetch, const int T) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const size_t gbytes = cb_group_bytes(dtype);
    const int32_t offset = dtype == CB_INT8 ? 128 : dtype == CB_MXFP4 ? CB_MXFP4_OFFSET : dtype == CB_NL4 ? CB_NL4_OFFSET
                         : dtype == CB_INT6 ? CB_INT6_OFFSET : 8;
    const int8_t *xq[CB_ITILE2_TOKENS];
    const float *xd[CB_ITILE2_TOKENS];
    const int32_t *xs[CB_ITILE2_TOKENS], *xoff[CB_ITILE2_TOKENS];
    __m512 acc[CB_ITILE2_TOKENS];
    for (int j = 0; j < T; j++) {
        xq[j] = acts[j].q;
        xd[j] = acts[j].d;
        xs[j] = acts[j].s;
        xoff[j] = acts[j].nl4_off;
        acc[j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + (size_t)j * ldo);
    }
    for (int kb = kb0; kb < kb1; kb++, gp += gbytes) {
        const char *gq = gp + gstride;                       /* group g + 1's block kb */
        if (prefetch)                                        /* the next pair's block kb, from memory */
            for (size_t b = 0; b < gbytes; b += 64) {
                _mm_prefetch(gp + 2 * gstride + b, _MM_HINT_T0);
                _mm_prefetch(gp + 3 * gstride + b, _MM_HINT_T0);
            }
        __m512i even[CB_ITILE2_TOKENS], odd[CB_ITILE2_TOKENS];
        for (int j = 0; j < T; j++) {
            if (dtype == CB_NL4) {
                even[j] = _mm512_set1_epi32(xoff[j][2 * kb]);
                odd[j] = _mm512_set1_epi32(xoff[j][2 * kb + 1]);
            } else {
                even[j] = _mm512_set1_epi32(-offset * xs[j][kb]);
                odd[j] = _mm512_setzero_si512();
            }
        }
        if (dtype == CB_INT8) {
            const cb_igroup_int8 *g = (const cb_igroup_int8 *)gp, *h = (const cb_igroup_int8 *)gq;
            for (int c = 0; c < 8; c += 2) {
                const __m512i u0 = _mm512_xor_si512(cb_join_si512(_mm256_loadu_si256((const __m256i *)g->qs[c]),
                                                                  _mm256_loadu_si256((const __m256i *)h->qs[c])), flip);
                const __m512i u1 = _mm512_xor_si512(cb_join_si512(_mm256_loadu_si256((const __m256i *)g->qs[c + 1]),
                                                                  _mm256_loadu_si256((const __m256i *)h->qs[c + 1])), flip);
                for (int j = 0; j < T; j++) {
                    const int8_t *x = xq[j] + kb * CB_QBLOCK + 4 * c;
                    even[j] = _mm512_dpbusd_epi32(even[j], u0, cb_bcast4_512(x));
                    odd[j] = _mm512_dpbusd_epi32(odd[j], u1, cb_bcast4_512(x + 4));
                }
            }
        } else {
            for (int v = 0; v < 4; v++) {
                __m256i lo_g, hi_g, lo_h, hi_h;
                cb_inibbles_avx2(gp, dtype, v, &lo_g, &hi_g);
                cb_inibbles_avx2(gq, dtype, v, &lo_h, &hi_h);
                const __m512i lo = cb_join_si512(lo_g, lo_h), hi = cb_join_si512(hi_g, hi_h);
                for (int j = 0; j < T; j++) {
                    const int8_t *x = xq[j] + kb * CB_QBLOCK + 4 * v;
                    even[j] = _mm512_dpbusd_epi32(even[j], lo, cb_bcast4_512(x));
                    odd[j] = _mm512_dpbusd_epi32(odd[j], hi, cb_bcast4_512(x + 16));
                }
            }
        }
        if (dtype == CB_NL4) {
            __m256i slo_g, shi_g, slo_h, shi_h;
            cb_nl4_scales_avx2(gp, &slo_g, &shi_g);
            cb_nl4_scales_avx2(gq, &slo_h, &shi_h);
            const __m512i slo = cb_join_si512(slo_g, slo_h), shi = cb_join_si512(shi_g, shi_h);
            for (int j = 0; j < T; j++)
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_mullo_epi32(even[j], slo),
                                                                             _mm512_mullo_epi32(odd[j], shi))),
                                         _mm512_set1_ps(xd[j][kb]), acc[j]);
            continue;
        }
        const __m512 dw = cb_join_ps512(cb_igroup_scales_avx2(gp, dtype), cb_igroup_scales_avx2(gq, dtype));
        for (int j = 0; j < T; j++)
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(even[j], odd[j])),
                                     _mm512_mul_ps(dw, _mm512_set1_ps(xd[j][kb])), acc[j]);
    }
    for (int j = 0; j < T; j++) _mm512_storeu_ps(out + (size_t)j * ldo, acc[j]);
}

/* The AVX512-VNNI step's interleaved entry (cb_itile_fn): a prompt's groups two at a time on
 * 512-bit vectors, in the order of CB_ITILE_LOOP with 8-token tiles; decode, and an odd last
 * group, by the 256-bit tile (cb_itile_avx512vnni). */
CB_TARGET_AVX512_VNNI static void
cb_itile_wide_avx512vnni(float *out, int ldo, const char *w, int dtype, const cb_act_q8 *acts, int cols, int g0,
                         int g1, int n) {
    const int paired = g0 + (g1 - g0) / 2 * 2;
    if (n == 1 || paired == g0) {
        cb_itile_avx512vnni(out, ldo, w, dtype, acts, cols, g0, g1, n);
        return;
    }
    const int nb = cols / CB_QBLOCK;
    const size_t gbytes = cb_group_bytes(dtype), gstride = (size_t)nb * gbytes;
#define CB_CALL_IG2(dt, tt) cb_igroup2_avx512vnni(o, ldo, gp, gstride, dt, acts + t, kb0, kb1, kb0 == 0, t == 0, tt)
    for (int g = g0; g < paired; g += 2)
        for (int kb0 = 0; kb0 < nb; kb0 += CB_TPREFILL_KBLOCKS) {
            const int kb1 = kb0 + CB_TPREFILL_KBLOCKS < nb ? kb0 + CB_TPREFILL_KBLOCKS : nb;
            const char *gp = w + ((size_t)g * nb + kb0) * gbytes;
            for (int t = 0; t < n; t += CB_ITILE2_TOKENS) {
                float *o = out + (size_t)t * ldo + (size_t)g * CB_TGROUP;
                const int T = n - t;
                if (dtype == CB_INT8) { CB_T8_CASES(CB_CALL_IG2, CB_INT8) }
                else if (dtype == CB_MXFP4) { CB_T8_CASES(CB_CALL_IG2, CB_MXFP4) }
                else if (dtype == CB_NL4) { CB_T8_CASES(CB_CALL_IG2, CB_NL4) }
                else if (dtype == CB_INT6) { CB_T8_CASES(CB_CALL_IG2, CB_INT6) }
                else { CB_T8_CASES(CB_CALL_IG2, CB_INT4) }
            }
        }
#undef CB_CALL_IG2
    if (paired < g1) cb_itile_avx512vnni(out, ldo, w, dtype, acts, cols, paired, g1, n);
}

#endif /* CB_X86 */
#endif /* COLIBRI_KERNELS_VNNI_H */
