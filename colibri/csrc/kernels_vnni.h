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

#endif /* CB_X86 */
#endif /* COLIBRI_KERNELS_VNNI_H */
