/* kernels_amx.h — the AMX step: a prompt's interleaved int8/int4/int6/mxfp4 products on tiles (TDPBSSD),
 * and its bf16 products (TDPBF16PS, "bf16 products on tiles" below).
 *
 * AMX (Intel Sapphire Rapids and later) multiplies tiles — 2-D registers of up to 16 rows x 64
 * bytes — in a unit beside the vector ports: TDPBSSD adds to each int32 C[m][n] the products of
 * row m of A (signed bytes) with column n of B (signed bytes, stored 4 K-bytes a column side by
 * side: the "VNNI" order of the interleaved layout's vectors, quant.h). One instruction here does
 * 16 tokens x 16 outputs x 32 inputs, what 128 vpdpbusd on zmm do.
 *
 * The formats scale each block of 32 inputs (quant.h), so a tile's K is one block (A 16 x 32
 * bytes, B 8 rows x 64 bytes, C 16 x 16 int32) and every block's C is stored and scaled in zmm:
 * acc = fma(float(C), dw * dx, acc), block after block — the exact integer block sums of every
 * other step, scaled and added in the same order, so the same bits as decode. Per block and
 * tile: one TDPBSSD beside 16 x (cvt, mul, fma) on the two 512-bit ports, which take longer than
 * the tile unit's product: the scaling, not the tile unit, sets the pace, and two tile sets (C of
 * the next block computed while this one is scaled) overlap them.
 *
 * Layouts:
 *   A  the activations of 16 tokens, one block: [16 tokens][32 bytes], packed once per call
 *      (cb_amx_act: zero rows past n, their scale 0);
 *   B  two groups' block as signed bytes, [8 rows c][64 bytes] = group g's vector c (8 outputs x 4
 *      inputs) then group g + 1's: int8 copied, the 4-bit and 6-bit codes unpacked and their
 *      offset taken off (int4 - 8, mxfp4's doubled values, int6 - 32), once per chunk of blocks
 *      and shared by every tile of tokens (cb_amx_wblock, with the two groups' 16 scales);
 *   C  [16 tokens][16 outputs] int32, stored to a 1 KB buffer the zmm read one token a row.
 * nl4 (two scales a block), the last n % 16 tokens (decode, a few tokens: the tile unit takes as
 * long for 1 row as for 16) and an odd last group go to the AVX512-VNNI step.
 *
 * The body (amx_body.h) is instantiated here with the instructions (GCC/clang inline asm: the
 * assembler knows them, no compiler flag is needed; MSVC the _tile_* intrinsics), and by the probes
 * with the tile ops emulated in C on a thread's array of 8 tiles (test_steps.h, "amx-emulated": the
 * body's bits tested on any AVX-512 CPU). The real step runs only
 * where the CPU has AMX-INT8, XCR0 enables the tile state, the OS lent it to the process
 * (_os.request_tile_data: Linux arch_prctl; Windows 11 / Server 2022 as an optional feature the
 * process turns on) and the import-time self-test passed (dispatch.h cb_self_test).
 */
#ifndef COLIBRI_KERNELS_AMX_H
#define COLIBRI_KERNELS_AMX_H

#include "kernels_vnni.h"
#include "kernels_avx512.h"      /* the bf16 products tile takes a prompt's last tokens */
#include "amx_types.h"           /* CB_HAVE_AMX, the tiles' shapes and packed blocks */


#if CB_HAVE_AMX


/* Tiles 0, 1 and 2, 3: A and B of even and odd blocks; 4 .. 3 + CB_AMX_CTILES: C. */
static void cb_amx_fill_config(cb_amx_config *c) {
    memset(c, 0, sizeof *c);
    c->palette = 1;
    for (int s = 0; s < 2; s++) {
        c->rows[2 * s] = CB_AMX_TOKENS;      c->colsb[2 * s] = CB_QBLOCK;    /* A: [16 tokens][32 bytes] */
        c->rows[2 * s + 1] = CB_QBLOCK / 4;  c->colsb[2 * s + 1] = 64;       /* B: [8][2 groups x 8 x 4] */
    }
    for (int t = 4; t < 4 + CB_AMX_CTILES; t++) { c->rows[t] = CB_AMX_TOKENS; c->colsb[t] = 64; }   /* C: [16][16] int32 */
}

/* The CB_AMX_TOKENS tokens of acts, blocks 0 .. nb - 1, into tile[nb]. */
static void cb_amx_pack_acts(cb_amx_act *tile, const cb_act_q8 *acts, int nb) {
    for (int j = 0; j < CB_AMX_TOKENS; j++)
        for (int kb = 0; kb < nb; kb++) {
            memcpy(tile[kb].q[j], acts[j].q + (size_t)kb * CB_QBLOCK, CB_QBLOCK);
            tile[kb].d[j] = acts[j].d[kb];
        }
}

/* nblocks blocks of groups gp and gq (each pointer at the first) into wb[nblocks]. */
CB_TARGET_AVX512_VNNI static void cb_amx_pack_weights(cb_amx_wblock *wb, const char *gp, const char *gq,
                                                      int dtype, int nblocks) {
    const size_t gbytes = cb_group_bytes(dtype);
    const __m512i offset = _mm512_set1_epi8((char)cb_code_offset(dtype, 1));
    for (int b = 0; b < nblocks; b++, gp += gbytes, gq += gbytes, wb++) {
        if (dtype == CB_INT8) {
            const cb_igroup_int8 *g = (const cb_igroup_int8 *)gp, *h = (const cb_igroup_int8 *)gq;
            for (int c = 0; c < 8; c++)
                _mm512_storeu_si512(wb->q[c], cb_join_si512(_mm256_loadu_si256((const __m256i *)g->qs[c]),
                                                            _mm256_loadu_si256((const __m256i *)h->qs[c])));
        } else {
            for (int v = 0; v < 4; v++) {
                __m512i lo, hi;
                cb_inibbles2_512(gp, gq, dtype, v, &lo, &hi);
                _mm512_storeu_si512(wb->q[v], _mm512_sub_epi8(lo, offset));
                _mm512_storeu_si512(wb->q[4 + v], _mm512_sub_epi8(hi, offset));
            }
        }
        _mm512_storeu_ps(wb->dw, cb_join_ps512(cb_igroup_scales_avx2(gp, dtype), cb_igroup_scales_avx2(gq, dtype)));
    }
}

/* ---- bf16 products on tiles (TDPBF16PS) --------------------------------------------------------
 * The interleaved bf16 layout with bf16 products (spec: kernels_scalar.h, cb_itile_bf16_lanes):
 * each output sums in two lanes p — p = 0 inputs 4c, 4c + 1, p = 1 inputs 4c + 2, 4c + 3 of every
 * unit c of 4 inputs —, a pair's higher input first, each addition rounded, and is lane 0 + lane 1:
 * vdpbf16ps decode's bits (its 16 lanes are 8 outputs x the two p). On tiles, lane p of a group
 * pair's 16 outputs and 16 tokens is one C tile, and a TDPBF16PS adds 16 units (64 inputs) to it:
 *   A_p  [16 tokens][16 units c][2]: the token's pair (x[4c + 2p + 1], x[4c + 2p]), higher first;
 *   B_p  [16 units c][16 outputs][2]: the weights' same pairs, swapped alike;
 * so TDPBF16PS as the Intrinsics Guide defines it (pair k after pair k - 1, the even element's
 * product added first, each addition rounded; DAZ, FTZ) adds exactly lane p's sequence, and C_0 +
 * C_1 is decode's output. Whether the unit follows that definition is not known here: the SDM's
 * later text keeps even and odd partial sums within an instruction (tools/bench/amx_bf16_probe.c
 * asks a CPU). The import self-test compares this tile with the AVX512_BF16 step bit for bit;
 * where they differ it tries the split orders (kernels_scalar.h, cb_bf16_order: each lane's even
 * and odd sums over each TDPBF16PS's 64 inputs, joined at its end), in which decode and the other
 * tiles then add with widened FMAs (kernels_avx512.h, cb_itile_bf16s_avx512), and where none
 * matches turns only this tile off (dispatch.h, cb_amx_bf16_failed_check). A last chunk
 * of 8 units (cols % 64 == 32) is padded: A with +0, B with -0, so each padded product is -0 and
 * adding it leaves a lane exactly as it was, a lane flushed to -0 included. Unlike the int
 * formats there is no scale a block, so C stays on the tile over a whole range of
 * CB_AMX_BF16_CHUNKS chunks of 64 inputs: the tile unit, not the vector ports, sets the pace. */
CB_STATIC_ASSERT(CB_AMX_BF16_UNITS * 4 == CB_BF16_SPLIT_INPUTS, "a split order's span is one TDPBF16PS's inputs");

/* All 8 tiles 16 rows x 64 bytes: 0, 1 A of two token tiles; 2, 3 B of two group pairs; 4 .. 7 C (amx_body.h). */
static void cb_amx_bf16_fill_config(cb_amx_config *c) {
    memset(c, 0, sizeof *c);
    c->palette = 1;
    for (int t = 0; t < 8; t++) { c->rows[t] = 16; c->colsb[t] = 64; }
}

/* vpermt2w indices of lane p: element 2c + j of a row takes element 4c + 2p + 1 - j (of the 64
 * bf16 of two registers: one token's 64 inputs for A; group g's unit then group g + 1's for B,
 * whose 8 outputs x 4 inputs are the same pattern). */
CB_TARGET_AVX512_BF16 static inline __m512i cb_amx_bf16_lane_index(int p) {
    uint16_t idx[32];
    for (int c = 0; c < 16; c++)
        for (int j = 0; j < 2; j++) idx[2 * c + j] = (uint16_t)(4 * c + 2 * p + 1 - j);
    return _mm512_loadu_si512((const void *)idx);
}

/* The 16 tokens acts[0..15]' activations (acts.xb, cols inputs) as A, chunk after chunk:
 * tile[chunks]. */
CB_TARGET_AVX512_BF16 static void cb_amx_bf16_pack_acts(cb_amx_bf16_a *tile, const cb_act_q8 *acts, int cols) {
    const __m512i i0 = cb_amx_bf16_lane_index(0), i1 = cb_amx_bf16_lane_index(1);
    for (int h = 0; h * 64 < cols; h++, tile++)
        for (int t = 0; t < CB_AMX_TOKENS; t++) {
            const uint16_t *x = acts[t].xb + (size_t)h * 64;
            const __m512i lo = _mm512_loadu_si512((const void *)x);
            const __m512i hi = h * 64 + 32 < cols ? _mm512_loadu_si512((const void *)(x + 32)) : _mm512_setzero_si512();
            _mm512_storeu_si512(tile->q[0][t], _mm512_permutex2var_epi16(lo, i0, hi));
            _mm512_storeu_si512(tile->q[1][t], _mm512_permutex2var_epi16(lo, i1, hi));
        }
}

/* Chunks h0 .. h0 + nchunks - 1 of groups gp and gp + row (their rows: cols x 8 bf16, unit c's
 * 64 bytes at c * 64) as B: wb[nchunks]. */
CB_TARGET_AVX512_BF16 static void cb_amx_bf16_pack_weights(cb_amx_bf16_w *wb, const char *gp, size_t row, int cols,
                                                           int h0, int nchunks) {
    const __m512i i0 = cb_amx_bf16_lane_index(0), i1 = cb_amx_bf16_lane_index(1);
    const int units = cols / 4;
    for (int h = 0; h < nchunks; h++, wb++)
        for (int c = 0; c < CB_AMX_BF16_UNITS; c++) {
            const int u = (h0 + h) * CB_AMX_BF16_UNITS + c;
            if (u >= units) {                   /* the padded half of a last chunk: -0 (above) */
                _mm512_storeu_si512(wb->q[0][c], _mm512_set1_epi16((short)0x8000));
                _mm512_storeu_si512(wb->q[1][c], _mm512_set1_epi16((short)0x8000));
                continue;
            }
            const __m512i g = _mm512_loadu_si512((const void *)(gp + (size_t)u * 64));
            const __m512i h1 = _mm512_loadu_si512((const void *)(gp + row + (size_t)u * 64));
            _mm512_storeu_si512(wb->q[0][c], _mm512_permutex2var_epi16(g, i0, h1));
            _mm512_storeu_si512(wb->q[1][c], _mm512_permutex2var_epi16(g, i1, h1));
        }
}

/* ---- the tile ops ------------------------------------------------------------------------------
 * The instructions, as GCC's own intrinsics write them (both assembler dialects), but with a
 * "memory" clobber on the loads too: the packed A and B are written just before. The intrinsics
 * branch (MSVC, whose intrinsics the compiler takes as touching memory; GCC or clang with
 * CB_AMX_INTRINSICS, given the same clobber by an empty asm before each load) is otherwise alike. */
#if CB_AMX_ASM
#define CB_AMX_HW_LOADCFG(cfg) __asm__ volatile("ldtilecfg %0" ::"m"(*(const cb_amx_config *)(cfg)))
#define CB_AMX_HW_RELEASE() __asm__ volatile("tilerelease" ::)
#define CB_AMX_HW_LOAD(t, base, stride) \
    __asm__ volatile("{tileloadd\t(%0,%1,1), %%tmm" #t "|tileloadd\t%%tmm" #t ", [%0+%1*1]}" \
                     ::"r"((const void *)(base)), "r"((long long)(stride)) : "memory")
#define CB_AMX_HW_STORE(t, base, stride) \
    __asm__ volatile("{tilestored\t%%tmm" #t ", (%0,%1,1)|tilestored\t[%0+%1*1], %%tmm" #t "}" \
                     ::"r"((void *)(base)), "r"((long long)(stride)) : "memory")
#define CB_AMX_HW_ZERO(t) __asm__ volatile("tilezero\t%%tmm" #t ::)
#define CB_AMX_HW_DPBSSD(c, a, b) \
    __asm__ volatile("{tdpbssd\t%%tmm" #b ", %%tmm" #a ", %%tmm" #c "|tdpbssd\t%%tmm" #c ", %%tmm" #a ", %%tmm" #b "}" ::)
#define CB_AMX_HW_DPBF16PS(c, a, b) \
    __asm__ volatile("{tdpbf16ps\t%%tmm" #b ", %%tmm" #a ", %%tmm" #c "|tdpbf16ps\t%%tmm" #c ", %%tmm" #a ", %%tmm" #b "}" ::)
#else                                   /* the intrinsics: C = tile c, A = tile a, B = tile b alike */
#if defined(__GNUC__) || defined(__clang__)
#define CB_AMX_MEMORY_BARRIER() __asm__ volatile("" ::: "memory")
#else
#define CB_AMX_MEMORY_BARRIER() ((void)0)
#endif
#define CB_AMX_HW_LOADCFG(cfg) do { CB_AMX_MEMORY_BARRIER(); _tile_loadconfig((const void *)(cfg)); } while (0)
#define CB_AMX_HW_RELEASE() _tile_release()
#define CB_AMX_HW_LOAD(t, base, stride) \
    do { CB_AMX_MEMORY_BARRIER(); _tile_loadd(t, (const void *)(base), (size_t)(stride)); } while (0)
#define CB_AMX_HW_STORE(t, base, stride) _tile_stored(t, (void *)(base), (size_t)(stride))
#define CB_AMX_HW_ZERO(t) _tile_zero(t)
#define CB_AMX_HW_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)
#define CB_AMX_HW_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
#endif

#define CB_AMX_LOADCFG CB_AMX_HW_LOADCFG
#define CB_AMX_RELEASE CB_AMX_HW_RELEASE
#define CB_AMX_LOAD CB_AMX_HW_LOAD
#define CB_AMX_STORE CB_AMX_HW_STORE
#define CB_AMX_ZERO CB_AMX_HW_ZERO
#define CB_AMX_DPBSSD CB_AMX_HW_DPBSSD
#define CB_AMX_DPBF16PS CB_AMX_HW_DPBF16PS
#define CB_AMX_NAME(base) base##_amx
#include "amx_body.h"                  /* (it #undefs its parameters) */


#endif /* CB_HAVE_AMX */
#endif /* COLIBRI_KERNELS_AMX_H */
