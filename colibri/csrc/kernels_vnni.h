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
 * and a third time by the probes, with the step in exact AVX2 arithmetic (test_steps.h,
 * "vnni-emulated"): the body's bits tested on CPUs without VNNI.
 */
#ifndef COLIBRI_KERNELS_VNNI_H
#define COLIBRI_KERNELS_VNNI_H

#include "kernels_avx2.h"        /* the AVX2 entries it falls back to; the shared helpers (avx2_int.h) */

#if CB_X86

#define CB_VNNI_TARGET CB_TARGET_AVX512_VNNI
#define CB_VNNI_DPBUSD(a, u, s) _mm256_dpbusd_epi32(a, u, s)
#define CB_VNNI_NAME(base) base##_avx512vnni
#define CB_VNNI_FEW_TS 2
#include "vnni_body.h"
#undef CB_VNNI_TARGET
#undef CB_VNNI_DPBUSD
#undef CB_VNNI_NAME
#undef CB_VNNI_FEW_TS

/* AVX-VNNI (VEX: 16 registers) has no few-token tile: its 4 streams x 2 tokens of sums and
 * accumulators are sized for the EVEX step's 32 registers; a few tokens take the prompt tiles. */
#define CB_VNNI_TARGET CB_TARGET_AVXVNNI
#define CB_VNNI_DPBUSD(a, u, s) _mm256_dpbusd_avx_epi32(a, u, s)
#define CB_VNNI_NAME(base) base##_avxvnni
#define CB_VNNI_FEW_TS 0
#include "vnni_body.h"
#undef CB_VNNI_TARGET
#undef CB_VNNI_DPBUSD
#undef CB_VNNI_NAME
#undef CB_VNNI_FEW_TS

/* ---- the AVX512-VNNI step's prefill on 512-bit vectors ----------------------------------------
 *
 * The interleaved prefill tile above works on 256-bit vectors: one group's 8 outputs. Where
 * vpdpbusd runs on 512 bits at the 256-bit instruction rate (cores with full-width 512-bit units)
 * a zmm holding two neighbouring groups — their
 * 16 outputs, group g in lanes 0..7, g + 1 in lanes 8..15 — does twice the work per instruction.
 * Each vector of a group's codes is unpacked by the 256-bit helpers and the two groups' halves
 * joined (amortised over up to 8 tokens: 32 registers hold 16 sum chains and 8 accumulators); 4
 * activation bytes are broadcast to all 16 lanes. Every output's lane does what the 256-bit tile
 * does — the same exact integer block sums, scaled and added block by block in the same order —
 * so the bits are the same, and prefill still equals decode. A thread's odd last group, and
 * decode, take the 256-bit tile.
 *
 * Two things set the pace of this tile beside the products: the broadcasts (one load for each
 * vpdpbusd: two loads a cycle feed at most two) and the activations' per-token pointers. So the
 * activations are packed once per call into cb_act_block8 tiles (one pointer, constant offsets),
 * and all formats but nl4 go four groups at a time (cb_igroup4_avx512vnni: two zmm of outputs,
 * each broadcast feeding both), which halves the broadcasts per product. */
#define CB_ITILE2_TOKENS 8

CB_TARGET_AVX512_VNNI static CB_ALWAYS_INLINE __m512i cb_join_si512(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

CB_TARGET_AVX512_VNNI static CB_ALWAYS_INLINE __m512 cb_join_ps512(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

/* cb_int6_high_avx2 on 512 bits. */
CB_TARGET_AVX512_VNNI static CB_ALWAYS_INLINE __m512i cb_int6_high_512(__m512i h, int shift) {
    __m512i placed;
    switch (shift) {
    case 4: placed = _mm512_slli_epi16(h, 4); break;
    case 2: placed = _mm512_slli_epi16(h, 2); break;
    case 0: placed = h; break;
    default: placed = _mm512_srli_epi16(h, 2); break;
    }
    return _mm512_and_si512(placed, _mm512_set1_epi8(0x30));
}

/* Vector v of two interleaved groups' codes (at gp and gq) as the unsigned bytes vpdpbusd multiplies,
 * group gp's in lanes 0..7 and gq's in 8..15: cb_inibbles_avx2 on the joined 64 bytes (one join, and
 * the nibble split, int6's high bits and the shuffles once on 512 bits instead of on each half). */
CB_TARGET_AVX512_VNNI static CB_ALWAYS_INLINE void cb_inibbles2_512(const char *gp, const char *gq, int dtype, int v,
                                                                   __m512i *lo, __m512i *hi) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const size_t codes = dtype == CB_MXFP4 ? offsetof(cb_igroup_mxfp4, qs)
                       : dtype == CB_NL4 ? offsetof(cb_igroup_nl4, qs)
                       : dtype == CB_INT6 ? offsetof(cb_igroup_int6, qs) : offsetof(cb_igroup_int4, qs);
    const __m512i a = cb_join_si512(_mm256_loadu_si256((const __m256i *)(gp + codes + 32 * v)),
                                    _mm256_loadu_si256((const __m256i *)(gq + codes + 32 * v)));
    *lo = _mm512_and_si512(a, m4);
    *hi = _mm512_and_si512(_mm512_srli_epi16(a, 4), m4);
    if (dtype == CB_INT6) {
        const size_t qh = offsetof(cb_igroup_int6, qh) + 32 * (v / 2);
        const __m512i h = cb_join_si512(_mm256_loadu_si256((const __m256i *)(gp + qh)),
                                        _mm256_loadu_si256((const __m256i *)(gq + qh)));
        *lo = _mm512_or_si512(*lo, cb_int6_high_512(h, CB_INT6_HSHIFT(v, 0)));
        *hi = _mm512_or_si512(*hi, cb_int6_high_512(h, CB_INT6_HSHIFT(v, 1)));
    }
    if (dtype == CB_MXFP4 || dtype == CB_NL4) {
        const __m512i lut = _mm512_broadcast_i32x4(
            _mm_loadu_si128((const __m128i *)(dtype == CB_MXFP4 ? cb_mxfp4_u12 : cb_nl4_u64)));
        *lo = _mm512_shuffle_epi8(lut, *lo);
        *hi = _mm512_shuffle_epi8(lut, *hi);
    }
}

/* The activations of one tile of up to 8 tokens, packed once per call for the 512-bit tile: per
 * block, the 4-byte units of every token side by side, so that one pointer and constant offsets
 * reach every broadcast (a vpdpbusd's {1to16} memory operand) — 8 tokens' q/d/s pointers do not
 * fit in the general registers beside the tile's and would be reloaded from the stack every block. */
typedef struct {
    int32_t q[8][CB_ITILE2_TOKENS];     /* [unit u][token j]: bytes 4u..4u+3 of token j's block */
    int32_t bias[2][CB_ITILE2_TOKENS];  /* [half][token j]: the sums' starting values (the codes'
                                           offset taken off: -offset * s, or nl4's two halves) */
    float d[CB_ITILE2_TOKENS];          /* [token j] the block's activation scale */
} cb_act_block8;

/* Tokens t0..t0+T-1 of acts, blocks 0..nb-1, into tile[nb] (slots past T are zero). */
static void cb_pack_act_block8(cb_act_block8 *tile, const cb_act_q8 *acts, int T, int nb, int dtype) {
    const int32_t offset = cb_code_offset(dtype, 1);
    memset(tile, 0, (size_t)nb * sizeof(cb_act_block8));
    for (int j = 0; j < T; j++) {
        const cb_act_q8 *a = &acts[j];
        for (int kb = 0; kb < nb; kb++) {
            cb_act_block8 *b = &tile[kb];
            for (int u = 0; u < 8; u++) memcpy(&b->q[u][j], a->q + (size_t)kb * CB_QBLOCK + 4 * u, 4);
            if (dtype == CB_NL4) {
                b->bias[0][j] = a->nl4_off[2 * kb];
                b->bias[1][j] = a->nl4_off[2 * kb + 1];
            } else
                b->bias[0][j] = -offset * a->s[kb];
            b->d[j] = a->d[kb];
        }
    }
}

/* out[j * ldo + 0..15] (+)= groups g and g + 1 (at gp and gp + gstride, blocks kb0..kb1-1) for T
 * tokens of the packed tile: cb_igroup_avx512vnni's arithmetic on both groups at once. */
CB_TARGET_AVX512_VNNI static CB_ALWAYS_INLINE void
cb_igroup2_avx512vnni(float *out, int ldo, const char *gp, size_t gstride, int dtype, const cb_act_block8 *tile,
                      int kb0, int kb1, int first, int prefetch, const int T) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const size_t gbytes = cb_group_bytes(dtype);
    __m512 acc[CB_ITILE2_TOKENS];
    for (int j = 0; j < T; j++) acc[j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + (size_t)j * ldo);
    for (int kb = kb0; kb < kb1; kb++, gp += gbytes) {
        const cb_act_block8 *b = &tile[kb];
        const char *gq = gp + gstride;                       /* group g + 1's block kb */
        if (prefetch)                                        /* the next pair's block kb, from memory */
            for (size_t o = 0; o < gbytes; o += 64) {
                _mm_prefetch(gp + 2 * gstride + o, _MM_HINT_T0);
                _mm_prefetch(gp + 3 * gstride + o, _MM_HINT_T0);
            }
        __m512i even[CB_ITILE2_TOKENS], odd[CB_ITILE2_TOKENS];
        for (int j = 0; j < T; j++) {
            even[j] = _mm512_set1_epi32(b->bias[0][j]);
            odd[j] = dtype == CB_NL4 ? _mm512_set1_epi32(b->bias[1][j]) : _mm512_setzero_si512();
        }
        if (dtype == CB_INT8) {
            const cb_igroup_int8 *g = (const cb_igroup_int8 *)gp, *h = (const cb_igroup_int8 *)gq;
            for (int c = 0; c < 8; c += 2) {
                const __m512i u0 = _mm512_xor_si512(cb_join_si512(_mm256_loadu_si256((const __m256i *)g->qs[c]),
                                                                  _mm256_loadu_si256((const __m256i *)h->qs[c])), flip);
                const __m512i u1 = _mm512_xor_si512(cb_join_si512(_mm256_loadu_si256((const __m256i *)g->qs[c + 1]),
                                                                  _mm256_loadu_si256((const __m256i *)h->qs[c + 1])), flip);
                for (int j = 0; j < T; j++) {
                    even[j] = _mm512_dpbusd_epi32(even[j], u0, _mm512_set1_epi32(b->q[c][j]));
                    odd[j] = _mm512_dpbusd_epi32(odd[j], u1, _mm512_set1_epi32(b->q[c + 1][j]));
                }
            }
        } else {
            for (int v = 0; v < 4; v++) {
                __m512i lo, hi;
                cb_inibbles2_512(gp, gq, dtype, v, &lo, &hi);
                for (int j = 0; j < T; j++) {
                    even[j] = _mm512_dpbusd_epi32(even[j], lo, _mm512_set1_epi32(b->q[v][j]));
                    odd[j] = _mm512_dpbusd_epi32(odd[j], hi, _mm512_set1_epi32(b->q[4 + v][j]));
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
                                         _mm512_set1_ps(b->d[j]), acc[j]);
            continue;
        }
        const __m512 dw = cb_join_ps512(cb_igroup_scales_avx2(gp, dtype), cb_igroup_scales_avx2(gq, dtype));
        for (int j = 0; j < T; j++)
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(even[j], odd[j])),
                                     _mm512_mul_ps(dw, _mm512_set1_ps(b->d[j])), acc[j]);
    }
    for (int j = 0; j < T; j++) _mm512_storeu_ps(out + (size_t)j * ldo, acc[j]);
}

/* out[j * ldo + 0..31] (+)= groups g .. g + 3 (at gp + k * gstride, blocks kb0..kb1-1) for T <=
 * CB_ITILE4_TOKENS tokens of the packed tile: two zmm of outputs, so each activation broadcast feeds
 * two vpdpbusd (the pair tile's broadcasts are one a vpdpbusd: the load ports, not the products,
 * set its pace), and one chain per token and zmm (the nibble halves add into the same int32 sum:
 * integer sums, so the same bits as the pair tile's two chains). Not nl4, whose halves have their
 * own scales. */
#define CB_ITILE4_TOKENS 6
/* The blocks of a quad that go over every tile before the next: 18 KB of weights (int4 32 blocks,
 * int8 16), which stay in L1 across the tiles beside the tile's activations, on a 32 KB L1 too;
 * the next quad's blocks are prefetched into L2, not beside them (cb_prefetch_run). Twice as many
 * (int8 at 32 blocks: 35 KB) would not stay. */
#define CB_ITILE4_CHUNK_BYTES 18432
CB_TARGET_AVX512_VNNI static CB_ALWAYS_INLINE void
cb_igroup4_avx512vnni(float *out, int ldo, const char *gp, size_t gstride, int dtype, const cb_act_block8 *tile,
                      int kb0, int kb1, int first, cb_prefetch_run pf, const int T) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const size_t gbytes = cb_group_bytes(dtype);
    __m512 acc[CB_ITILE4_TOKENS][2];
    for (int j = 0; j < T; j++)
        for (int p = 0; p < 2; p++)
            acc[j][p] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + (size_t)j * ldo + 16 * p);
    for (int kb = kb0; kb < kb1; kb++, gp += gbytes) {
        const cb_act_block8 *b = &tile[kb];
        cb_prefetch_lines(&pf, CB_PREFETCH_LINES_PER_BLOCK);  /* this tile's share of the next quad */
        __m512i sum[CB_ITILE4_TOKENS][2];
        for (int j = 0; j < T; j++) sum[j][0] = sum[j][1] = _mm512_set1_epi32(b->bias[0][j]);
        if (dtype == CB_INT8) {
            for (int c = 0; c < 8; c++) {
                __m512i u[2];
                for (int p = 0; p < 2; p++) {
                    const cb_igroup_int8 *g = (const cb_igroup_int8 *)(gp + 2 * p * gstride);
                    const cb_igroup_int8 *h = (const cb_igroup_int8 *)(gp + (2 * p + 1) * gstride);
                    u[p] = _mm512_xor_si512(cb_join_si512(_mm256_loadu_si256((const __m256i *)g->qs[c]),
                                                          _mm256_loadu_si256((const __m256i *)h->qs[c])), flip);
                }
                for (int j = 0; j < T; j++) {
                    const __m512i x = _mm512_set1_epi32(b->q[c][j]);
                    sum[j][0] = _mm512_dpbusd_epi32(sum[j][0], u[0], x);
                    sum[j][1] = _mm512_dpbusd_epi32(sum[j][1], u[1], x);
                }
            }
        } else {
            for (int v = 0; v < 4; v++) {
                __m512i lo[2], hi[2];
                for (int p = 0; p < 2; p++)
                    cb_inibbles2_512(gp + 2 * p * gstride, gp + (2 * p + 1) * gstride, dtype, v, &lo[p], &hi[p]);
                for (int j = 0; j < T; j++) {
                    const __m512i xl = _mm512_set1_epi32(b->q[v][j]), xh = _mm512_set1_epi32(b->q[4 + v][j]);
                    sum[j][0] = _mm512_dpbusd_epi32(sum[j][0], lo[0], xl);
                    sum[j][1] = _mm512_dpbusd_epi32(sum[j][1], lo[1], xl);
                    sum[j][0] = _mm512_dpbusd_epi32(sum[j][0], hi[0], xh);
                    sum[j][1] = _mm512_dpbusd_epi32(sum[j][1], hi[1], xh);
                }
            }
        }
        __m512 dw[2];
        for (int p = 0; p < 2; p++)
            dw[p] = cb_join_ps512(cb_igroup_scales_avx2(gp + 2 * p * gstride, dtype),
                                  cb_igroup_scales_avx2(gp + (2 * p + 1) * gstride, dtype));
        for (int j = 0; j < T; j++) {
            const __m512 dx = _mm512_set1_ps(b->d[j]);
            for (int p = 0; p < 2; p++)
                acc[j][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[j][p]), _mm512_mul_ps(dw[p], dx), acc[j][p]);
        }
    }
    for (int j = 0; j < T; j++)
        for (int p = 0; p < 2; p++) _mm512_storeu_ps(out + (size_t)j * ldo + 16 * p, acc[j][p]);
}

/* The AVX512-VNNI step's interleaved entry (cb_itile_fn): a prompt's groups four at a time
 * (nl4: two at a time) on 512-bit vectors, in the order of CB_ITILE_LOOP, a tile of tokens at a
 * time; a pair left over by the pair tile; decode and a few tokens (n <= CB_IFEW_TOKENS(dtype):
 * its few-token tile), and an odd last group, by the 256-bit tile (cb_itile_avx512vnni). The tokens go in tiles of even size (8 tokens: 4 + 4, not 6 + 2). The
 * activations are packed first, every tile at once, into this thread's
 * scratch (cb_act_block8: 352 bytes a block and tile); where that cannot be had, the 256-bit tile
 * runs instead. */
CB_TARGET_AVX512_VNNI static void
cb_itile_wide_avx512vnni(float *out, int ldo, const char *w, int dtype, const cb_act_q8 *acts, int cols, int g0,
                         int g1, int n) {
    const int quads = dtype == CB_NL4 ? g0 : g0 + (g1 - g0) / 4 * 4;
    const int paired = quads + (g1 - quads) / 2 * 2;
    const int tt = dtype == CB_NL4 ? CB_ITILE2_TOKENS : CB_ITILE4_TOKENS;    /* tokens a tile */
    const int nb = cols / CB_QBLOCK, tiles = (n + tt - 1) / tt;
#define CB_TILE_START(i) ((int)((long long)n * (i) / tiles))   /* tile i's first token: tiles of even size */
    cb_act_block8 *packed = n <= CB_IFEW_TOKENS(dtype) || paired == g0 ? NULL
                          : (cb_act_block8 *)cb_thread_scratch(CB_SCRATCH_ACT_TILES, (size_t)tiles * nb * sizeof(cb_act_block8));
    if (!packed) {
        cb_itile_avx512vnni(out, ldo, w, dtype, acts, cols, g0, g1, n);
        return;
    }
    for (int i = 0; i < tiles; i++)
        cb_pack_act_block8(packed + (size_t)i * nb, acts + CB_TILE_START(i), CB_TILE_START(i + 1) - CB_TILE_START(i),
                           nb, dtype);
    const size_t gbytes = cb_group_bytes(dtype), gstride = (size_t)nb * gbytes;
    const int kblocks = dtype == CB_NL4 ? CB_TPREFILL_KBLOCKS : (int)(CB_ITILE4_CHUNK_BYTES / (4 * gbytes));
    const int chunks = (nb + kblocks - 1) / kblocks;
#define CB_CALL_IG4(dt, T_) cb_igroup4_avx512vnni(o, ldo, gp, gstride, dt, tile, kb0, kb1, kb0 == 0, pf, T_)
#define CB_CALL_IG2(dt, T_) cb_igroup2_avx512vnni(o, ldo, gp, gstride, dt, tile, kb0, kb1, kb0 == 0, t == 0, T_)
#define CB_T6_CASES(CALL, DT) \
    switch (T) { case 1: CALL(DT, 1); break; case 2: CALL(DT, 2); break; case 3: CALL(DT, 3); break; \
                 case 4: CALL(DT, 4); break; case 5: CALL(DT, 5); break; default: CALL(DT, 6); break; }
    for (int g = g0; g < paired; g += g < quads ? 4 : 2)
        for (int kb0 = 0; kb0 < nb; kb0 += kblocks) {
            const int kb1 = kb0 + kblocks < nb ? kb0 + kblocks : nb;
            const char *gp = w + ((size_t)g * nb + kb0) * gbytes;
            for (int i = 0; i < tiles; i++) {
                const int t = CB_TILE_START(i), T = CB_TILE_START(i + 1) - t;
                float *o = out + (size_t)t * ldo + (size_t)g * CB_TGROUP;
                const cb_act_block8 *tile = packed + (size_t)i * nb;
                if (g < quads) {
                    /* the next groups, up to a quad's worth: a share in each tile of each chunk */
                    const int ahead = g1 - g - 4 < 4 ? g1 - g - 4 : 4;
                    const cb_prefetch_run pf = cb_prefetch_share(ahead > 0 ? w + (size_t)(g + 4) * gstride : NULL,
                                                                 (size_t)ahead * gstride, kb0 / kblocks * tiles + i,
                                                                 chunks * tiles);
                    if (dtype == CB_INT8) { CB_T6_CASES(CB_CALL_IG4, CB_INT8) }
                    else if (dtype == CB_MXFP4) { CB_T6_CASES(CB_CALL_IG4, CB_MXFP4) }
                    else if (dtype == CB_INT6) { CB_T6_CASES(CB_CALL_IG4, CB_INT6) }
                    else { CB_T6_CASES(CB_CALL_IG4, CB_INT4) }
                } else if (dtype == CB_NL4) { CB_T8_CASES(CB_CALL_IG2, CB_NL4) }
                else if (dtype == CB_INT8) { CB_T6_CASES(CB_CALL_IG2, CB_INT8) }
                else if (dtype == CB_MXFP4) { CB_T6_CASES(CB_CALL_IG2, CB_MXFP4) }
                else if (dtype == CB_INT6) { CB_T6_CASES(CB_CALL_IG2, CB_INT6) }
                else { CB_T6_CASES(CB_CALL_IG2, CB_INT4) }
            }
        }
#undef CB_T6_CASES
#undef CB_CALL_IG2
#undef CB_CALL_IG4
#undef CB_TILE_START
    if (paired < g1) cb_itile_avx512vnni(out, ldo, w, dtype, acts, cols, paired, g1, n);
}

#endif /* CB_X86 */
#endif /* COLIBRI_KERNELS_VNNI_H */
