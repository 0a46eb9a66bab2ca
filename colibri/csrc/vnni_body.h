/* vnni_body.h — the VNNI kernels of the transposed and interleaved int8/int4 layouts
 * (kernels_vnni.h): decode / stored-order tiles, the repacked prefill, the interleaved tile. Included once per instruction set, with:
 *   CB_VNNI_TARGET          the functions' target attribute
 *   CB_VNNI_DPBUSD(a, u, s) a + in each int32 lane the 4 products of unsigned bytes u, signed bytes s
 *   CB_VNNI_NAME(base)      base with the instruction set's suffix
 *   CB_VNNI_FEW_TS          tokens a pass of the few-token tile (cb_ifew: 2), or 0 for none
 * No include guard: including it is instantiating it. */

/* out[j * ldo + 0..7] (+)= one group's 8 outputs for T tokens over its blocks kb0..kb1-1, packed
 * with unsigned weights at pk (block kb0 first); kb0 == 0 starts from zero, otherwise the sums in
 * out continue. xsum [T][nb] (row stride nb): the weights' offset times the sum of token j's
 * quantized block kb, where each block's integer sum starts. Vectors c = 0, 2, 4, 6 and 1, 3, 5, 7
 * of a block go to two chains per token (integer adds: the same sum in any order). */
CB_VNNI_TARGET static CB_ALWAYS_INLINE void
CB_VNNI_NAME(cb_tpacked_group)(float *out, int ldo, const uint8_t *pk, const cb_act_q8 *acts,
                               const int32_t *xsum, int nb, int kb0, int kb1, const int T) {
    const int8_t *xq[4];
    const float *xd[4];
    __m256 acc[4];
    for (int j = 0; j < T; j++) {       /* locals: out's stores could alias int8_t (cb_tpacked_group_avx2) */
        xq[j] = acts[j].q;
        xd[j] = acts[j].d;
        acc[j] = kb0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out + (size_t)j * ldo);
    }
    for (int kb = kb0; kb < kb1; kb++, pk += CB_TPACK_BLOCK_BYTES) {
        const __m256i *wv = (const __m256i *)(pk + 32);
        __m256i even[4], odd[4];
        for (int j = 0; j < T; j++) {
            even[j] = _mm256_set1_epi32(-xsum[(size_t)j * nb + kb]);
            odd[j] = _mm256_setzero_si256();
        }
        for (int c = 0; c < 8; c += 2) {
            const __m256i w0 = _mm256_loadu_si256(wv + c), w1 = _mm256_loadu_si256(wv + c + 1);
            for (int j = 0; j < T; j++) {
                const int8_t *x = xq[j] + kb * CB_QBLOCK + 4 * c;
                even[j] = CB_VNNI_DPBUSD(even[j], w0, cb_bcast4_avx2(x));
                odd[j] = CB_VNNI_DPBUSD(odd[j], w1, cb_bcast4_avx2(x + 4));
            }
        }
        const __m256 dw = _mm256_loadu_ps((const float *)pk);
        for (int j = 0; j < T; j++)
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(even[j], odd[j])),
                                     _mm256_mul_ps(dw, _mm256_set1_ps(xd[j][kb])), acc[j]);
    }
    for (int j = 0; j < T; j++) _mm256_storeu_ps(out + (size_t)j * ldo, acc[j]);
}

/* The prefill entry (cb_kernel_table.tprefill), as cb_tprefill_quant_avx2 with the chunk packed
 * as unsigned bytes (both formats take the same body). */
CB_VNNI_TARGET static void
CB_VNNI_NAME(cb_tprefill_quant)(float *out, int ldo, const char *w, int dtype, const cb_act_q8 *acts, int rows,
                                int cols, int o0, int o1, int n, uint8_t *scratch, int first) {
    const int nb = cols / CB_QBLOCK, g0 = o0 / CB_TGROUP, g1 = o1 / CB_TGROUP;
    const int32_t *xsum = (const int32_t *)scratch;
    const uint8_t *packed = cb_tprefill_pack_avx2(w, dtype, acts, rows, cols, g0, g1, n, scratch, first, 1);
#define CB_CALL_TPV(dt, tt) CB_VNNI_NAME(cb_tpacked_group)(o, ldo, pk, acts + t, xs, nb, kb0, kb1, tt)
    CB_TPREFILL_TILES(CB_AVX2_T_CASES(CB_CALL_TPV, 0))
#undef CB_CALL_TPV
}

/* The 8 int32 block sums of a stored group against T tokens (as cb_group_sums_int8/int4_avx2):
 * int8 weights + 128 (q ^ 0x80) against x, int4 nibbles against x's halves, each output's 8 lane
 * sums then gathered by the same hadd tree; the offset times sum(x) (b->xoff) taken off. */
CB_VNNI_TARGET static CB_ALWAYS_INLINE void
CB_VNNI_NAME(cb_group_sums)(__m256i *isum, const char *grp, int dtype, const cb_tq_block *b, const int T) {
    const __m256i zero = _mm256_setzero_si256();
    __m256i s[4];                       /* outputs 2c, 2c+1 of one token */
    if (dtype == CB_INT8) {
        const cb_group_int8 *g = (const cb_group_int8 *)grp;
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        for (int j = 0; j < T; j++) {
            for (int c = 0; c < 4; c++) {   /* 8 lane sums of each of outputs 2c, 2c+1, paired by hadd */
                const __m256i u0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)g->qs[2 * c]), flip);
                const __m256i u1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)g->qs[2 * c + 1]), flip);
                s[c] = _mm256_hadd_epi32(CB_VNNI_DPBUSD(zero, u0, b->xq[j]), CB_VNNI_DPBUSD(zero, u1, b->xq[j]));
            }
            /* s[c] = [2c 2c 2c+1 2c+1 | 2c 2c 2c+1 2c+1]: two more hadds give [0 1 2 3 | 0 1 2 3] of
             * outputs 0-3 and of 4-7, whose 128-bit halves add up */
            __m256i q0 = _mm256_hadd_epi32(s[0], s[1]), q1 = _mm256_hadd_epi32(s[2], s[3]);
            isum[j] = _mm256_sub_epi32(_mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20),
                                                        _mm256_permute2x128_si256(q0, q1, 0x31)), b->xoff[j]);
        }
    } else {
        __m256i lo[4], hi[4];
        cb_unpack_group_int4_avx2(lo, hi, (const cb_group_int4 *)grp);
        for (int j = 0; j < T; j++) {
            for (int c = 0; c < 4; c++)
                s[c] = CB_VNNI_DPBUSD(CB_VNNI_DPBUSD(zero, lo[c], b->xlo[j]), hi[c], b->xhi[j]);
            isum[j] = cb_int4_group_reduce_avx2(s, b->xoff[j]);
        }
    }
}

CB_VNNI_TARGET static CB_ALWAYS_INLINE void
CB_VNNI_NAME(cb_tq_group)(float *y, int ldo, const char *grp, int dtype, const cb_tq_block *b, const int T) {
    __m256i isum[4];
    CB_VNNI_NAME(cb_group_sums)(isum, grp, dtype, b, T);
    cb_tq_scale_add_avx2(y, ldo, grp, isum, b, T);
}

CB_VNNI_TARGET static CB_ALWAYS_INLINE void
CB_VNNI_NAME(cb_ttile_quant)(float *out, int ldo, const char *w, int dtype, const cb_act_q8 *acts,
                             int rows, int cols, int o0, int o1, const int T) {
    CB_TTILE_QUANT_BODY(CB_VNNI_NAME(cb_tq_group), 1)
}

/* The table's transposed entry (cb_ttile_fn): int8/int4 with this step, the float formats as AVX2. */
CB_VNNI_TARGET static void
CB_VNNI_NAME(cb_ttile)(float *out, int ldo, const char *w, int dtype, const float *x, int ldx, const cb_act_q8 *acts,
                       int rows, int cols, int o0, int o1, int T) {
    if (dtype != CB_INT8 && dtype != CB_INT4) {
        cb_ttile_avx2_any(out, ldo, w, dtype, x, ldx, acts, rows, cols, o0, o1, T);
        return;
    }
#define CB_CALL_TQV(dt, t) CB_VNNI_NAME(cb_ttile_quant)(out, ldo, w, dt, acts, rows, cols, o0, o1, t)
    if (dtype == CB_INT8) { CB_AVX2_T_CASES(CB_CALL_TQV, CB_INT8) } else { CB_AVX2_T_CASES(CB_CALL_TQV, CB_INT4) }
#undef CB_CALL_TQV
}

/* One interleaved group (as cb_igroup_avx2) with this step: int8 flipped to unsigned (q ^ 0x80 =
 * q + 128) in a register, int4's low and high nibbles as they are; each block's sum starts from
 * -128 * sum(x), -8 * sum(x), (mxfp4, its codes shuffled to cb_mxfp4_u12) -12 * sum(x) or (int6,
 * u = code + 32 with its high bits ORed in) -32 * sum(x) (acts->s). Per block and token: 8 (xor +) vpdpbusd in two chains. */
CB_VNNI_TARGET static CB_ALWAYS_INLINE void
CB_VNNI_NAME(cb_igroup)(float *out, int ldo, const char *gp, int dtype, const cb_act_q8 *acts, int kb0, int kb1,
                        int first, const int T) {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    const size_t gbytes = cb_group_bytes(dtype);
    const int32_t offset = cb_code_offset(dtype, 1);
    const int8_t *xq[4];
    const float *xd[4];
    const int32_t *xs[4], *xoff[4];
    __m256 acc[4];
    for (int j = 0; j < T; j++) {
        xq[j] = acts[j].q;
        xd[j] = acts[j].d;
        xs[j] = acts[j].s;
        xoff[j] = acts[j].nl4_off;
        acc[j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + (size_t)j * ldo);
    }
    for (int kb = kb0; kb < kb1; kb++, gp += gbytes) {
        __m256i even[4], odd[4];
        for (int j = 0; j < T; j++) {
            if (dtype == CB_NL4) {          /* the low and high halves, each with its own offset sum */
                even[j] = _mm256_set1_epi32(xoff[j][2 * kb]);
                odd[j] = _mm256_set1_epi32(xoff[j][2 * kb + 1]);
            } else {
                even[j] = _mm256_set1_epi32(-offset * xs[j][kb]);
                odd[j] = _mm256_setzero_si256();
            }
        }
        if (dtype == CB_INT8) {
            const cb_igroup_int8 *g = (const cb_igroup_int8 *)gp;
            for (int c = 0; c < 8; c += 2) {
                const __m256i u0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)g->qs[c]), flip);
                const __m256i u1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)g->qs[c + 1]), flip);
                for (int j = 0; j < T; j++) {
                    const int8_t *x = xq[j] + kb * CB_QBLOCK + 4 * c;
                    even[j] = CB_VNNI_DPBUSD(even[j], u0, CB_BCAST4(x));
                    odd[j] = CB_VNNI_DPBUSD(odd[j], u1, CB_BCAST4(x + 4));
                }
            }
        } else {
            for (int v = 0; v < 4; v++) {
                __m256i lo, hi;
                cb_inibbles_avx2(gp, dtype, v, &lo, &hi);
                for (int j = 0; j < T; j++) {
                    const int8_t *x = xq[j] + kb * CB_QBLOCK + 4 * v;
                    even[j] = CB_VNNI_DPBUSD(even[j], lo, CB_BCAST4(x));
                    odd[j] = CB_VNNI_DPBUSD(odd[j], hi, CB_BCAST4(x + 16));
                }
            }
        }
        if (dtype == CB_NL4) {
            __m256i slo, shi;
            cb_nl4_scales_avx2(gp, &slo, &shi);
            for (int j = 0; j < T; j++)
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_mullo_epi32(even[j], slo),
                                                                             _mm256_mullo_epi32(odd[j], shi))),
                                         _mm256_set1_ps(xd[j][kb]), acc[j]);
            continue;
        }
        const __m256 dw = cb_igroup_scales_avx2(gp, dtype);
        for (int j = 0; j < T; j++)
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(even[j], odd[j])),
                                     _mm256_mul_ps(dw, _mm256_set1_ps(xd[j][kb])), acc[j]);
    }
    for (int j = 0; j < T; j++) _mm256_storeu_ps(out + (size_t)j * ldo, acc[j]);
}

/* Decode: G interleaved groups side by side (as cb_idecode_avx2) with this step. */
CB_VNNI_TARGET static CB_ALWAYS_INLINE void
CB_VNNI_NAME(cb_idecode)(float *out, size_t ostride, const char *gp, size_t gstride, int dtype, const cb_act_q8 *act,
                         int nb, const int G) {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    const size_t gbytes = cb_group_bytes(dtype);
    const int32_t offset = cb_code_offset(dtype, 1);
    __m256 acc[4];
    for (int k = 0; k < G; k++) acc[k] = _mm256_setzero_ps();
    for (int kb = 0; kb < nb; kb++, gp += gbytes) {
        const int8_t *x = act->q + kb * CB_QBLOCK;
        __m256i even[4], odd[4];
        for (int k = 0; k < G; k++) {
            if (dtype == CB_NL4) {
                even[k] = _mm256_set1_epi32(act->nl4_off[2 * kb]);
                odd[k] = _mm256_set1_epi32(act->nl4_off[2 * kb + 1]);
            } else {
                even[k] = _mm256_set1_epi32(-offset * act->s[kb]);
                odd[k] = _mm256_setzero_si256();
            }
        }
        if (dtype == CB_INT8) {
            for (int c = 0; c < 8; c += 2) {
                const __m256i x0 = CB_BCAST4(x + 4 * c), x1 = CB_BCAST4(x + 4 * c + 4);
                for (int k = 0; k < G; k++) {
                    const cb_igroup_int8 *g = (const cb_igroup_int8 *)(gp + k * gstride);
                    even[k] = CB_VNNI_DPBUSD(even[k], _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)g->qs[c]), flip), x0);
                    odd[k] = CB_VNNI_DPBUSD(odd[k], _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)g->qs[c + 1]), flip), x1);
                }
            }
        } else {
            for (int v = 0; v < 4; v++) {
                const __m256i xl = CB_BCAST4(x + 4 * v), xh = CB_BCAST4(x + 16 + 4 * v);
                for (int k = 0; k < G; k++) {
                    __m256i lo, hi;
                    cb_inibbles_avx2(gp + k * gstride, dtype, v, &lo, &hi);
                    even[k] = CB_VNNI_DPBUSD(even[k], lo, xl);
                    odd[k] = CB_VNNI_DPBUSD(odd[k], hi, xh);
                }
            }
        }
        const __m256 dx = _mm256_set1_ps(act->d[kb]);
        if (dtype == CB_NL4) {
            for (int k = 0; k < G; k++)
                acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(cb_nl4_scaled_avx2(gp + k * gstride, even[k], odd[k])), dx, acc[k]);
            continue;
        }
        for (int k = 0; k < G; k++) {
            const __m256 dw = cb_igroup_scales_avx2(gp + k * gstride, dtype);
            acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(even[k], odd[k])), _mm256_mul_ps(dw, dx), acc[k]);
        }
    }
    for (int k = 0; k < G; k++) _mm256_storeu_ps(out + k * ostride, acc[k]);
}

#if CB_VNNI_FEW_TS
/* A few tokens (2 .. CB_IFEW_TOKENS(dtype): sequences decoded together, an expert's share of a
 * short step), the formats whose block sum is one integer (int8, int4, mxfp4, int6): decode's order —
 * G groups read side by side, `gstride` bytes apart (CB_IDECODE_LOOP's streams, which the
 * hardware prefetchers follow) — for TS tokens at once. out[j * ldo + k * ostride + 0..7], k < G,
 * j < TS, over blocks kb0..kb1-1 (gp at kb0); `first`: start from zero, else continue out's sums.
 * Each token's block sum is cb_igroup's in one chain (integer adds: the same sum) and its scaling
 * the same fma, so the same bits as the prompt tiles and decode. Every pass sends each stream's
 * lines CB_IFEW_PREFETCH ahead to L2 (every pass, not only a chunk's first). */
CB_VNNI_TARGET static CB_ALWAYS_INLINE void
CB_VNNI_NAME(cb_ifew)(float *out, int ldo, size_t ostride, const char *gp, size_t gstride, int dtype,
                      const cb_act_q8 *acts, int kb0, int kb1, int first, const int G, const int TS) {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    const size_t gbytes = cb_group_bytes(dtype);
    const int32_t offset = cb_code_offset(dtype, 1);
    const int8_t *xq[CB_VNNI_FEW_TS];
    const float *xd[CB_VNNI_FEW_TS];
    const int32_t *xs[CB_VNNI_FEW_TS];
    __m256 acc[CB_IDECODE_STREAMS][CB_VNNI_FEW_TS];
    for (int j = 0; j < TS; j++) {      /* locals: out's stores could alias the activations */
        xq[j] = acts[j].q;
        xd[j] = acts[j].d;
        xs[j] = acts[j].s;
    }
    for (int k = 0; k < G; k++)
        for (int j = 0; j < TS; j++)
            acc[k][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + (size_t)j * ldo + k * ostride);
    for (int kb = kb0; kb < kb1; kb++, gp += gbytes) {
        __m256i sum[CB_IDECODE_STREAMS][CB_VNNI_FEW_TS];
        for (int k = 0; k < G; k++)     /* a block's lines (or their neighbours) of each stream, ahead */
            for (size_t off = 0; off < gbytes; off += 64) _mm_prefetch(gp + k * gstride + CB_IFEW_PREFETCH + off, CB_IFEW_HINT);
        for (int j = 0; j < TS; j++) {
            const __m256i start = _mm256_set1_epi32(-offset * xs[j][kb]);
            for (int k = 0; k < G; k++) sum[k][j] = start;
        }
        if (dtype == CB_INT8) {
            for (int c = 0; c < 8; c++) {
                __m256i xb[CB_VNNI_FEW_TS];
                for (int j = 0; j < TS; j++) xb[j] = CB_BCAST4(xq[j] + kb * CB_QBLOCK + 4 * c);
                for (int k = 0; k < G; k++) {
                    const cb_igroup_int8 *g = (const cb_igroup_int8 *)(gp + k * gstride);
                    const __m256i u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)g->qs[c]), flip);
                    for (int j = 0; j < TS; j++) sum[k][j] = CB_VNNI_DPBUSD(sum[k][j], u, xb[j]);
                }
            }
        } else {
            for (int v = 0; v < 4; v++) {
                __m256i xl[CB_VNNI_FEW_TS], xh[CB_VNNI_FEW_TS];
                for (int j = 0; j < TS; j++) {
                    xl[j] = CB_BCAST4(xq[j] + kb * CB_QBLOCK + 4 * v);
                    xh[j] = CB_BCAST4(xq[j] + kb * CB_QBLOCK + 16 + 4 * v);
                }
                for (int k = 0; k < G; k++) {
                    __m256i lo, hi;
                    cb_inibbles_avx2(gp + k * gstride, dtype, v, &lo, &hi);
                    for (int j = 0; j < TS; j++)
                        sum[k][j] = CB_VNNI_DPBUSD(CB_VNNI_DPBUSD(sum[k][j], lo, xl[j]), hi, xh[j]);
                }
            }
        }
        for (int k = 0; k < G; k++) {
            const __m256 dw = cb_igroup_scales_avx2(gp + k * gstride, dtype);
            for (int j = 0; j < TS; j++)
                acc[k][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[k][j]), _mm256_mul_ps(dw, _mm256_set1_ps(xd[j][kb])),
                                            acc[k][j]);
        }
    }
    for (int k = 0; k < G; k++)
        for (int j = 0; j < TS; j++) _mm256_storeu_ps(out + (size_t)j * ldo + k * ostride, acc[k][j]);
}

/* G groups' few-token products: the whole rows in one pass when the tokens fit one pass, else
 * CB_IFEW_KBLOCKS blocks of each row at a time (in L1) under every pass of CB_VNNI_FEW_TS tokens. */
CB_VNNI_TARGET static CB_ALWAYS_INLINE void
CB_VNNI_NAME(cb_ifew_groups)(float *out, int ldo, size_t ostride, const char *gp, size_t gstride, int dtype,
                             const cb_act_q8 *acts, int nb, int n, const int G) {
    const size_t gbytes = cb_group_bytes(dtype);
    const int kblocks = n <= CB_VNNI_FEW_TS ? nb : CB_IFEW_KBLOCKS;
    for (int kb0 = 0; kb0 < nb; kb0 += kblocks) {
        const int kb1 = kb0 + kblocks < nb ? kb0 + kblocks : nb;
        for (int t = 0; t < n; t += CB_VNNI_FEW_TS) {
            const int T = n - t < CB_VNNI_FEW_TS ? n - t : CB_VNNI_FEW_TS;
#define CB_CALL_FEW(TS_) CB_VNNI_NAME(cb_ifew)(out + (size_t)t * ldo, ldo, ostride, gp + kb0 * gbytes, gstride, \
                                               dtype, acts + t, kb0, kb1, kb0 == 0, G, TS_)
#if CB_VNNI_FEW_TS != 2
#error "cb_ifew_groups dispatches passes of 1 or 2 tokens: a pass of CB_VNNI_FEW_TS tokens needs its cases here"
#endif
            if (T == 1) CB_CALL_FEW(1);
            else CB_CALL_FEW(2);
#undef CB_CALL_FEW
        }
    }
}
#endif

/* The table's interleaved entry (cb_itile_fn) with this step. */
CB_VNNI_TARGET static void
CB_VNNI_NAME(cb_itile)(float *out, int ldo, const char *w, int dtype, const cb_act_q8 *acts, int cols, int g0,
                       int g1, int n) {
#if CB_VNNI_FEW_TS
    if (n > 1 && n <= CB_IFEW_TOKENS(dtype)) {
#define CB_CALL_FEWG(o, os, gp, gs, G) \
    if (dtype == CB_INT8) CB_VNNI_NAME(cb_ifew_groups)(o, ldo, os, gp, gs, CB_INT8, acts, nb, n, G); \
    else if (dtype == CB_MXFP4) CB_VNNI_NAME(cb_ifew_groups)(o, ldo, os, gp, gs, CB_MXFP4, acts, nb, n, G); \
    else if (dtype == CB_INT6) CB_VNNI_NAME(cb_ifew_groups)(o, ldo, os, gp, gs, CB_INT6, acts, nb, n, G); \
    else CB_VNNI_NAME(cb_ifew_groups)(o, ldo, os, gp, gs, CB_INT4, acts, nb, n, G);
        CB_IDECODE_LOOP(CB_CALL_FEWG)
#undef CB_CALL_FEWG
        return;
    }
#endif
    if (n == 1) {
#define CB_CALL_IDV(o, os, gp, gs, G) \
    if (dtype == CB_INT8) CB_VNNI_NAME(cb_idecode)(o, os, gp, gs, CB_INT8, acts, nb, G); \
    else if (dtype == CB_MXFP4) CB_VNNI_NAME(cb_idecode)(o, os, gp, gs, CB_MXFP4, acts, nb, G); \
    else if (dtype == CB_NL4) CB_VNNI_NAME(cb_idecode)(o, os, gp, gs, CB_NL4, acts, nb, G); \
    else if (dtype == CB_INT6) CB_VNNI_NAME(cb_idecode)(o, os, gp, gs, CB_INT6, acts, nb, G); \
    else CB_VNNI_NAME(cb_idecode)(o, os, gp, gs, CB_INT4, acts, nb, G);
        CB_IDECODE_LOOP(CB_CALL_IDV)
#undef CB_CALL_IDV
        return;
    }
#define CB_CALL_IGV(dt, tt) CB_VNNI_NAME(cb_igroup)(o, ldo, gp, dt, acts + t, kb0, kb1, kb0 == 0, tt)
    CB_ITILE_LOOP(if (dtype == CB_INT8) { CB_AVX2_T_CASES(CB_CALL_IGV, CB_INT8) }
                  else if (dtype == CB_MXFP4) { CB_AVX2_T_CASES(CB_CALL_IGV, CB_MXFP4) }
                  else if (dtype == CB_NL4) { CB_AVX2_T_CASES(CB_CALL_IGV, CB_NL4) }
                  else if (dtype == CB_INT6) { CB_AVX2_T_CASES(CB_CALL_IGV, CB_INT6) }
                  else { CB_AVX2_T_CASES(CB_CALL_IGV, CB_INT4) })
#undef CB_CALL_IGV
}
