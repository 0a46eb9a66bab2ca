/* tprefill_vnni_body.h — the body of the VNNI repacked prefill (kernels_vnni.h), included once per
 * instruction set, with:
 *   CB_VNNI_TARGET          the functions' target attribute
 *   CB_VNNI_DPBUSD(a, u, s) a + in each int32 lane the 4 products of unsigned bytes u, signed bytes s
 *   CB_VNNI_NAME(base)      base with the instruction set's suffix
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
