/* amx_body.h — the AMX interleaved tile (kernels_amx.h), compiled once per way of doing the tile
 * ops, with:
 *   CB_AMX_LOADCFG(cfg), CB_AMX_RELEASE(), CB_AMX_LOAD(t, base, stride), CB_AMX_STORE(t, base,
 *   stride), CB_AMX_ZERO(t), CB_AMX_DPBSSD(c, a, b),
 *   CB_AMX_DPBF16PS(c, a, b)                           the tile ops (t, c, a, b: literal tile numbers)
 *   CB_AMX_NAME(base)                                  base with the way's suffix
 * No include guard: including it is instantiating it; it #undefs those parameters at its end. */

/* acc[t] += float(C[t]) * (dw * dx[t]) for the 16 tokens of one block's C (c: [16 tokens][16
 * outputs] int32): decode's scaling of a block sum, one token a zmm. */
CB_TARGET_AVX512_VNNI static CB_ALWAYS_INLINE void
CB_AMX_NAME(cb_amx_scale)(__m512 acc[CB_AMX_TOKENS], const int32_t *c, const cb_amx_wblock *wb, const cb_amx_act *a) {
    const __m512 dw = _mm512_loadu_ps(wb->dw);
    for (int t = 0; t < CB_AMX_TOKENS; t++)
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)(c + 16 * t))),
                                 _mm512_mul_ps(dw, _mm512_set1_ps(a->d[t])), acc[t]);
}

/* Block k's tile ops: A and B alternate between tiles 0, 1 and 2, 3 (the next block's loads need
 * not wait for this one's product), C goes round tiles 4 .. 3 + CB_AMX_CTILES. The tile numbers
 * are literals in every branch (they are part of the instruction). */
#define CB_AMX_SET(a_, b_, c_) do { CB_AMX_LOAD(a_, at[k].q, CB_QBLOCK); CB_AMX_LOAD(b_, wb[k].q, 64); \
                                    CB_AMX_ZERO(c_); CB_AMX_DPBSSD(c_, a_, b_); } while (0)
CB_TARGET_AVX512_VNNI static CB_ALWAYS_INLINE void
CB_AMX_NAME(cb_amx_issue)(int k, const cb_amx_wblock *wb, const cb_amx_act *at) {
    switch ((k % CB_AMX_CTILES) * 2 + (k & 1)) {
    case 0: CB_AMX_SET(0, 1, 4); break;
    case 1: CB_AMX_SET(2, 3, 4); break;
    case 2: CB_AMX_SET(0, 1, 5); break;
    case 3: CB_AMX_SET(2, 3, 5); break;
#if CB_AMX_CTILES > 2
    case 4: CB_AMX_SET(0, 1, 6); break;
    case 5: CB_AMX_SET(2, 3, 6); break;
#endif
#if CB_AMX_CTILES > 3
    case 6: CB_AMX_SET(0, 1, 7); break;
    case 7: CB_AMX_SET(2, 3, 7); break;
#endif
    }
}
#undef CB_AMX_SET

/* Block k's C (tile 4 + k % CB_AMX_CTILES) to cbuf's slot k % CB_AMX_CBUFS. */
CB_TARGET_AVX512_VNNI static CB_ALWAYS_INLINE void CB_AMX_NAME(cb_amx_store)(int k, int32_t *cbuf) {
    int32_t *slot = cbuf + 256 * (k % CB_AMX_CBUFS);
    switch (k % CB_AMX_CTILES) {
    case 0: CB_AMX_STORE(4, slot, 64); break;
    case 1: CB_AMX_STORE(5, slot, 64); break;
#if CB_AMX_CTILES > 2
    case 2: CB_AMX_STORE(6, slot, 64); break;
#endif
#if CB_AMX_CTILES > 3
    case 3: CB_AMX_STORE(7, slot, 64); break;
#endif
    }
}

/* out[t * ldo + 0..15] (+)= a group pair's blocks (wb[nblk], unpacked) for a tile of 16 tokens
 * (at[nblk]); first: start from zero, else continue the sums in out. cbuf:
 * [CB_AMX_CBUFS][16][16] int32, 64-byte aligned, where the tile unit's C goes for the zmm. A
 * software pipeline: at step s block s's product is issued, block s - CB_AMX_STORE_DELAY's C
 * stored and block s - CB_AMX_LOOKAHEAD's scaled, so the tile unit, the store and the scaling of
 * different blocks overlap. */
CB_TARGET_AVX512_VNNI static void
CB_AMX_NAME(cb_amx_pair_tile)(float *out, int ldo, const cb_amx_wblock *wb, const cb_amx_act *at, int nblk,
                              int first, int32_t *cbuf) {
    __m512 acc[CB_AMX_TOKENS];
    for (int t = 0; t < CB_AMX_TOKENS; t++)
        acc[t] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + (size_t)t * ldo);
    for (int s = 0; s < nblk + CB_AMX_LOOKAHEAD; s++) {
        const int st = s - CB_AMX_STORE_DELAY, sc = s - CB_AMX_LOOKAHEAD;
        if (s < nblk) CB_AMX_NAME(cb_amx_issue)(s, wb, at);
        /* the scaling first where its C was stored at an earlier step: the store then waits for
         * its product behind it */
        if (CB_AMX_STORE_DELAY < CB_AMX_LOOKAHEAD && sc >= 0)
            CB_AMX_NAME(cb_amx_scale)(acc, cbuf + 256 * (sc % CB_AMX_CBUFS), &wb[sc], &at[sc]);
        if (st >= 0 && st < nblk) CB_AMX_NAME(cb_amx_store)(st, cbuf);
        if (CB_AMX_STORE_DELAY == CB_AMX_LOOKAHEAD && sc >= 0)
            CB_AMX_NAME(cb_amx_scale)(acc, cbuf + 256 * (sc % CB_AMX_CBUFS), &wb[sc], &at[sc]);
    }
    for (int t = 0; t < CB_AMX_TOKENS; t++) _mm512_storeu_ps(out + (size_t)t * ldo, acc[t]);
}

/* The AMX step's interleaved entry (cb_itile_fn): group pairs, a chunk of CB_AMX_KBLOCKS blocks
 * unpacked at a time and run over every whole tile of 16 tokens; the activations packed once per
 * call into this thread's scratch (cb_amx_act: 576 bytes a block and tile). The AVX512-VNNI step
 * takes the rest: the last n % 16 tokens, an odd last group (its 256-bit tile), nl4 (two scales a
 * block), and everything where no scratch is had. The tail goes to VNNI rather than to a tile
 * padded with zero rows because a tile costs the tile unit as much for 1 row as for 16, while the
 * VNNI step's cost follows its tokens: a padded tile does a whole tile's work for the tail's few
 * tokens, and only a full tile gains on VNNI (and not by enough to pay for a padded one). */
CB_TARGET_AVX512_VNNI static void
CB_AMX_NAME(cb_itile)(float *out, int ldo, const char *w, int dtype, const cb_act_q8 *acts, int cols, int g0,
                      int g1, int n) {
    const int paired = g0 + (g1 - g0) / 2 * 2;
    const int nb = cols / CB_QBLOCK, tiles = n / CB_AMX_TOKENS, n_tiles = tiles * CB_AMX_TOKENS;
    const int kblocks = nb < CB_AMX_KBLOCKS ? nb : CB_AMX_KBLOCKS;
    const size_t act_bytes = (size_t)tiles * nb * sizeof(cb_amx_act), w_bytes = (size_t)kblocks * sizeof(cb_amx_wblock);
    const size_t cbuf_bytes = (size_t)CB_AMX_CBUFS * CB_AMX_TOKENS * 16 * sizeof(int32_t);
    uint8_t *scratch = tiles == 0 || dtype == CB_NL4 || paired == g0 ? NULL
                     : cb_thread_scratch(CB_SCRATCH_ACT_TILES, act_bytes + w_bytes + cbuf_bytes + sizeof(cb_amx_config));
    if (!scratch) {
        cb_itile_wide_avx512vnni(out, ldo, w, dtype, acts, cols, g0, g1, n);
        return;
    }
    cb_amx_act *packed = (cb_amx_act *)scratch;
    cb_amx_wblock *wb = (cb_amx_wblock *)(scratch + act_bytes);
    int32_t *cbuf = (int32_t *)(scratch + act_bytes + w_bytes);            /* [CB_AMX_CBUFS][16][16] */
    cb_amx_config *cfg = (cb_amx_config *)(scratch + act_bytes + w_bytes + cbuf_bytes);
    for (int i = 0; i < tiles; i++)
        cb_amx_pack_acts(packed + (size_t)i * nb, acts + (size_t)i * CB_AMX_TOKENS, nb);
    cb_amx_fill_config(cfg);
    CB_AMX_LOADCFG(cfg);
    const size_t gbytes = cb_group_bytes(dtype), gstride = (size_t)nb * gbytes;
    for (int g = g0; g < paired; g += 2)
        for (int kb0 = 0; kb0 < nb; kb0 += kblocks) {
            const int nblk = kb0 + kblocks < nb ? kblocks : nb - kb0;
            const char *gp = w + ((size_t)g * nb + kb0) * gbytes;
            cb_amx_pack_weights(wb, gp, gp + gstride, dtype, nblk);
            for (int i = 0; i < tiles; i++)
                CB_AMX_NAME(cb_amx_pair_tile)(out + (size_t)i * CB_AMX_TOKENS * ldo + (size_t)g * CB_TGROUP, ldo,
                                              wb, packed + (size_t)i * nb + kb0, nblk, kb0 == 0, cbuf);
        }
    CB_AMX_RELEASE();
    if (n_tiles < n)
        cb_itile_wide_avx512vnni(out + (size_t)n_tiles * ldo, ldo, w, dtype, acts + n_tiles, cols, g0, paired, n - n_tiles);
    if (paired < g1) cb_itile_avx512vnni(out, ldo, w, dtype, acts, cols, paired, g1, n);
}

/* ---- bf16 products (kernels_amx.h: the layouts, the order) --------------------------------------- */

/* Lane p of chunk h for one or two token tiles (a0, a1: their A, chunk h; a1 NULL for one) and one
 * or two group pairs (w0, w1: their B, chunk h; w1 NULL for one): C tiles 4 (a0 x w0), 5 (a0 x w1),
 * 6 (a1 x w0), 7 (a1 x w1). Two of each: 4 tile loads for 4 products (the 2 x 2 blocking). */
CB_TARGET_AVX512_BF16 static CB_ALWAYS_INLINE void
CB_AMX_NAME(cb_amx_bf16_lane_chunk)(int p, const cb_amx_bf16_w *w0, const cb_amx_bf16_w *w1, const cb_amx_bf16_a *a0,
                                    const cb_amx_bf16_a *a1) {
    CB_AMX_LOAD(2, w0->q[p], 64);
    CB_AMX_LOAD(0, a0->q[p], 64);
    CB_AMX_DPBF16PS(4, 0, 2);
    if (w1) {
        CB_AMX_LOAD(3, w1->q[p], 64);
        CB_AMX_DPBF16PS(5, 0, 3);
    }
    if (a1) {
        CB_AMX_LOAD(1, a1->q[p], 64);
        CB_AMX_DPBF16PS(6, 1, 2);
        if (w1) CB_AMX_DPBF16PS(7, 1, 3);
    }
}

/* Lane p's C tiles of a pass (tile 4 + 2 * token tile + pair, those present: two token tiles, two
 * pairs) from their sums in c[4] ([16 tokens][16 outputs] f32 each; NULL where absent), or
 * zeroed (first), and back to it. */
CB_TARGET_AVX512_BF16 static CB_ALWAYS_INLINE void CB_AMX_NAME(cb_amx_bf16_resume)(float *const c[4], int first) {
    if (first) {
        CB_AMX_ZERO(4);
        if (c[1]) CB_AMX_ZERO(5);
        if (c[2]) CB_AMX_ZERO(6);
        if (c[3]) CB_AMX_ZERO(7);
        return;
    }
    CB_AMX_LOAD(4, c[0], 64);
    if (c[1]) CB_AMX_LOAD(5, c[1], 64);
    if (c[2]) CB_AMX_LOAD(6, c[2], 64);
    if (c[3]) CB_AMX_LOAD(7, c[3], 64);
}
CB_TARGET_AVX512_BF16 static CB_ALWAYS_INLINE void CB_AMX_NAME(cb_amx_bf16_suspend)(float *const c[4]) {
    CB_AMX_STORE(4, c[0], 64);
    if (c[1]) CB_AMX_STORE(5, c[1], 64);
    if (c[2]) CB_AMX_STORE(6, c[2], 64);
    if (c[3]) CB_AMX_STORE(7, c[3], 64);
}

/* The AMX step's interleaved bf16 products entry (cb_itile_fn, acts.xb): CB_AMX_BF16_PAIRS group
 * pairs at a time (their B a chunk of CB_AMX_BF16_CHUNKS x 64 inputs unpacked at a time) over every
 * whole tile of 16 tokens, two token tiles at a time, one lane and then the other: with two pairs
 * and two token tiles each A and each B load feeds two products. Between chunks a C tile's sums wait in this call's state ([token
 * tile][pair][lane]: 1 KB each), and after the last, out = lane 0 + lane 1. The activations are
 * packed once per call into this thread's scratch (2 KB a chunk and token tile). The AVX512_BF16
 * step takes the rest: the last n % 16 tokens, an odd last group, and everything where no scratch
 * is had. */
CB_TARGET_AVX512_BF16 static void
CB_AMX_NAME(cb_itile_bf16x)(float *out, int ldo, const char *w, int dtype, const cb_act_q8 *acts, int cols, int g0,
                            int g1, int n) {
    const int paired = g0 + (g1 - g0) / 2 * 2;
    const int tiles = n / CB_AMX_TOKENS, n_tiles = tiles * CB_AMX_TOKENS, chunks = (cols + 63) / 64;
    const int kchunks = chunks < CB_AMX_BF16_CHUNKS ? chunks : CB_AMX_BF16_CHUNKS;
    const size_t act_bytes = (size_t)tiles * chunks * sizeof(cb_amx_bf16_a);
    const size_t w_bytes = (size_t)CB_AMX_BF16_PAIRS * kchunks * sizeof(cb_amx_bf16_w);
    const size_t state_bytes = (size_t)tiles * CB_AMX_BF16_PAIRS * 2 * 256 * sizeof(float);
    uint8_t *scratch = tiles == 0 || paired == g0 ? NULL
                     : cb_thread_scratch(CB_SCRATCH_ACT_TILES, act_bytes + w_bytes + state_bytes + sizeof(cb_amx_config));
    if (!scratch) {
        cb_itile_bf16x_ordered_avx512(out, ldo, w, dtype, acts, cols, g0, g1, n);
        return;
    }
    cb_amx_bf16_a *packed = (cb_amx_bf16_a *)scratch;                   /* [tiles][chunks] */
    cb_amx_bf16_w *wb = (cb_amx_bf16_w *)(scratch + act_bytes);         /* [CB_AMX_BF16_PAIRS][kchunks] */
    float (*state)[CB_AMX_BF16_PAIRS][2][256] =                         /* [tiles][pair][lane] */
        (float (*)[CB_AMX_BF16_PAIRS][2][256])(void *)(scratch + act_bytes + w_bytes);
    cb_amx_config *cfg = (cb_amx_config *)(scratch + act_bytes + w_bytes + state_bytes);
    for (int i = 0; i < tiles; i++)
        cb_amx_bf16_pack_acts(packed + (size_t)i * chunks, acts + (size_t)i * CB_AMX_TOKENS, cols);
    cb_amx_bf16_fill_config(cfg);
    CB_AMX_LOADCFG(cfg);
    const size_t row = (size_t)cols * 2 * CB_TGROUP;                    /* a group's bytes */
    for (int g = g0; g < paired; g += 2 * CB_AMX_BF16_PAIRS) {
        const int pairs = (paired - g) / 2 < CB_AMX_BF16_PAIRS ? (paired - g) / 2 : CB_AMX_BF16_PAIRS;
        for (int h0 = 0; h0 < chunks; h0 += kchunks) {
            const int nch = h0 + kchunks < chunks ? kchunks : chunks - h0, last = h0 + nch == chunks;
            for (int j = 0; j < pairs; j++)
                cb_amx_bf16_pack_weights(wb + (size_t)j * kchunks, w + (size_t)(g + 2 * j) * row, row, cols, h0, nch);
            const cb_amx_bf16_w *w0 = wb, *w1 = pairs > 1 ? wb + kchunks : NULL;
            for (int i = 0; i < tiles; i += 2) {
                const int two = i + 1 < tiles;
                const cb_amx_bf16_a *a0 = packed + (size_t)i * chunks + h0, *a1 = two ? a0 + chunks : NULL;
                for (int p = 0; p < 2; p++) {
                    enum { second = CB_AMX_BF16_PAIRS - 1 };    /* the second pair's index, used where w1 is */
                    float *const c[4] = {state[i][0][p], w1 ? state[i][second][p] : NULL,
                                         two ? state[i + 1][0][p] : NULL, two && w1 ? state[i + 1][second][p] : NULL};
                    CB_AMX_NAME(cb_amx_bf16_resume)(c, h0 == 0);
                    for (int h = 0; h < nch; h++)
                        CB_AMX_NAME(cb_amx_bf16_lane_chunk)(p, w0 + h, w1 ? w1 + h : NULL, a0 + h, a1 ? a1 + h : NULL);
                    CB_AMX_NAME(cb_amx_bf16_suspend)(c);
                }
                if (!last) continue;
                for (int k = i; k < i + 1 + two; k++)                  /* out = lane 0 + lane 1 */
                    for (int j = 0; j < pairs; j++)
                        for (int t = 0; t < CB_AMX_TOKENS; t++)
                            _mm512_storeu_ps(out + (size_t)(k * CB_AMX_TOKENS + t) * ldo + (size_t)(g + 2 * j) * CB_TGROUP,
                                             _mm512_add_ps(_mm512_loadu_ps(state[k][j][0] + 16 * t),
                                                           _mm512_loadu_ps(state[k][j][1] + 16 * t)));
            }
        }
    }
    CB_AMX_RELEASE();
    if (n_tiles < n)
        cb_itile_bf16x_ordered_avx512(out + (size_t)n_tiles * ldo, ldo, w, dtype, acts + n_tiles, cols, g0, paired, n - n_tiles);
    if (paired < g1) cb_itile_bf16x_ordered_avx512(out, ldo, w, dtype, acts, cols, paired, g1, n);
}

#undef CB_AMX_LOADCFG
#undef CB_AMX_RELEASE
#undef CB_AMX_LOAD
#undef CB_AMX_STORE
#undef CB_AMX_ZERO
#undef CB_AMX_DPBSSD
#undef CB_AMX_DPBF16PS
#undef CB_AMX_NAME
