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
 * The tile ops are instantiated twice (amx_body.h): with the instructions (GCC/clang inline asm:
 * the assembler knows them, no compiler flag is needed; MSVC the _tile_* intrinsics), and emulated
 * in C on a thread's array of
 * 8 tiles ("amx-emulated": the body's bits tested on any AVX-512 CPU). The real step runs only
 * where the CPU has AMX-INT8, XCR0 enables the tile state, the OS lent it to the process
 * (_os.request_tile_data: Linux arch_prctl; Windows 11 / Server 2022 as an optional feature the
 * process turns on) and the import-time self-test passed (dispatch.h cb_self_test).
 */
#ifndef COLIBRI_KERNELS_AMX_H
#define COLIBRI_KERNELS_AMX_H

#include <float.h>

#include "kernels_vnni.h"
#include "kernels_avx512.h"      /* the bf16 products tile takes a prompt's last tokens */

/* tiles: 64-bit mode only. GCC and clang write the tile instructions as inline asm (CB_NO_AMX_ASM:
 * setup.py found an assembler without them); MSVC, which has no inline asm on x86-64, takes the
 * _tile_* intrinsics of immintrin.h (its tile numbers constants, as here; CB_NO_AMX_INTRINSICS:
 * setup.py found a Visual Studio without them), as does a GCC or clang
 * build with CB_AMX_INTRINSICS and -mamx-tile -mamx-int8 -mamx-bf16 (the tests compile that). */
#if CB_X86 && defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(CB_NO_AMX_ASM)
#define CB_HAVE_AMX 1
#ifndef CB_AMX_INTRINSICS
#define CB_AMX_ASM 1
#endif
#elif CB_X86 && defined(_MSC_VER) && defined(_M_X64) && !defined(CB_NO_AMX_INTRINSICS)
#define CB_HAVE_AMX 1
#endif

#if CB_HAVE_AMX

#define CB_AMX_TOKENS 16            /* A's and C's rows: tokens a tile */

#ifndef CB_AMX_KBLOCKS
#define CB_AMX_KBLOCKS 32           /* blocks of a group pair unpacked at a time: 18 KB of B beside
                                       a token tile's 18 KB of A, in L1 */
#endif
#if CB_AMX_KBLOCKS < 1
#error "CB_AMX_KBLOCKS: at least 1"
#endif
/* The pair tile's software pipeline (amx_body.h): a block's C is stored CB_AMX_STORE_DELAY steps
 * after its product is issued and scaled CB_AMX_LOOKAHEAD steps after (STORE_DELAY <= LOOKAHEAD).
 * C goes round STORE_DELAY + 2 tiles beside A and B's four, so the next block's product never
 * waits for this one's store (one C tile for all blocks would make each product wait for the last
 * store); cbuf has LOOKAHEAD - STORE_DELAY + 1 slots. The default (0, 1) stores a block's C right
 * after its product and scales it a step later. The emulated tiles hold this body to its bits on
 * any AVX-512 CPU, and the import-time self-test holds the hardware tiles to them. */
#ifndef CB_AMX_STORE_DELAY
#define CB_AMX_STORE_DELAY 0
#endif
#ifndef CB_AMX_LOOKAHEAD
#define CB_AMX_LOOKAHEAD 1
#endif
#define CB_AMX_CTILES (CB_AMX_STORE_DELAY + 2)
#define CB_AMX_CBUFS (CB_AMX_LOOKAHEAD - CB_AMX_STORE_DELAY + 1)
#if CB_AMX_STORE_DELAY > 2 || CB_AMX_STORE_DELAY > CB_AMX_LOOKAHEAD
#error "CB_AMX_STORE_DELAY: 0 .. 2, at most CB_AMX_LOOKAHEAD"
#endif

/* ldtilecfg's 64 bytes (palette 1). */
typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} cb_amx_config;

/* One block of a group pair, as B (signed bytes) and its 16 output scales. */
typedef struct {
    int8_t q[8][64];                /* [row c][group p * 32 + output r * 4 + i]: input 4c + i */
    float dw[16];                   /* [p * 8 + r] the weight scales */
} cb_amx_wblock;

/* One block of a tile of tokens, as A and the tokens' activation scales. */
typedef struct {
    int8_t q[CB_AMX_TOKENS][CB_QBLOCK];     /* [token][input] */
    float d[CB_AMX_TOKENS];                 /* [token] */
} cb_amx_act;

/* The scratch (amx_body.h) lays these out back to back: each keeps the next 64-byte aligned. */
CB_STATIC_ASSERT(sizeof(cb_amx_wblock) % 64 == 0 && sizeof(cb_amx_act) % 64 == 0, "AMX blocks: 64-byte multiples");

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
#define CB_AMX_BF16_UNITS 16            /* units c (4 inputs) a TDPBF16PS */
CB_STATIC_ASSERT(CB_AMX_BF16_UNITS * 4 == CB_BF16_SPLIT_INPUTS, "a split order's span is one TDPBF16PS's inputs");
#ifndef CB_AMX_BF16_CHUNKS
#define CB_AMX_BF16_CHUNKS 8            /* 64-input chunks of B unpacked at a time: 16 KB a group pair, so
                                           two pairs' B stay in Sapphire Rapids' 48 KB L1 beside A */
#endif
/* Group pairs a pass: with two, each lane's products go 2 token tiles x 2 pairs (4 tile loads for 4
 * TDPBF16PS, the blocking Intel's optimization manual gives for AMX); with one, 2 token tiles x 1
 * pair (6 loads for 4). Between ranges of chunks each C tile goes to memory and back (2 more tile
 * moves for 8 chunks' 8 products). tools/bench/amx_engine.py's variants (one pair, 16 chunks:
 * bf16-pairs1; two pairs of 16 chunks, 64 KB of B: bf16-chunks16) are the alternatives to time
 * this one against. */
#ifndef CB_AMX_BF16_PAIRS
#define CB_AMX_BF16_PAIRS 2
#endif
#if CB_AMX_BF16_PAIRS < 1 || CB_AMX_BF16_PAIRS > 2 || CB_AMX_BF16_CHUNKS < 1
#error "CB_AMX_BF16_PAIRS: 1 or 2; CB_AMX_BF16_CHUNKS: at least 1"
#endif

/* One chunk of 64 inputs of a group pair as B, both lanes (2 KB). */
typedef struct {
    uint16_t q[2][CB_AMX_BF16_UNITS][32];       /* [lane p][unit c][output n * 2 + j] */
} cb_amx_bf16_w;

/* One chunk of 64 inputs of a tile of tokens as A, both lanes (2 KB). */
typedef struct {
    uint16_t q[2][CB_AMX_TOKENS][32];           /* [lane p][token][unit c * 2 + j] */
} cb_amx_bf16_a;

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

/* The same ops in C on a thread's 8 emulated tiles (the instruction's definition: rows and colsb
 * from the config, C[m][n] += sum over k, i of A[m][4k + i] * B[k][4n + i] in int32). */
typedef struct { uint8_t b[16][64]; } cb_amx_emu_tile;
static CB_THREAD_LOCAL cb_amx_emu_tile cb_amx_emu_tiles[8];
static CB_THREAD_LOCAL cb_amx_config cb_amx_emu_cfg;

static void cb_amx_emu_loadcfg(const cb_amx_config *c) {
    cb_amx_emu_cfg = *c;
    memset(cb_amx_emu_tiles, 0, sizeof cb_amx_emu_tiles);
}
static void cb_amx_emu_load(int t, const void *base, long stride) {
    memset(&cb_amx_emu_tiles[t], 0, sizeof(cb_amx_emu_tile));
    for (int r = 0; r < cb_amx_emu_cfg.rows[t]; r++)
        memcpy(cb_amx_emu_tiles[t].b[r], (const char *)base + r * stride, cb_amx_emu_cfg.colsb[t]);
}
static void cb_amx_emu_store(int t, void *base, long stride) {
    for (int r = 0; r < cb_amx_emu_cfg.rows[t]; r++)
        memcpy((char *)base + r * stride, cb_amx_emu_tiles[t].b[r], cb_amx_emu_cfg.colsb[t]);
}
static void cb_amx_emu_zero(int t) { memset(&cb_amx_emu_tiles[t], 0, sizeof(cb_amx_emu_tile)); }
static void cb_amx_emu_dpbssd(int c, int a, int b) {
    const int M = cb_amx_emu_cfg.rows[a], K4 = cb_amx_emu_cfg.rows[b], N = cb_amx_emu_cfg.colsb[b] / 4;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            int32_t acc;
            memcpy(&acc, &cb_amx_emu_tiles[c].b[m][4 * n], 4);
            for (int k = 0; k < K4; k++)
                for (int i = 0; i < 4; i++)
                    acc += (int32_t)(int8_t)cb_amx_emu_tiles[a].b[m][4 * k + i] *
                           (int32_t)(int8_t)cb_amx_emu_tiles[b].b[k][4 * n + i];
            memcpy(&cb_amx_emu_tiles[c].b[m][4 * n], &acc, 4);
        }
}

/* TDPBF16PS as the Intrinsics Guide defines it: C[m][n] += A[m][2k] * B[k][2n], then += A[m][2k + 1]
 * * B[k][2n + 1], k after k, each product exact and each addition rounded to nearest even; inputs
 * that are subnormal taken as zero (DAZ), subnormal results flushed to zero (FTZ). Where the order
 * in use is a split one (cb_bf16_order, kernels_scalar.h), as the SDM defines it: the even and
 * odd products summed apart from zero over the instruction's k, then joined to C[m][n] as the
 * order says — so the tests can run the split paths as an AMX unit that follows it would (and
 * play a unit that follows another: cb_amx_emu_unit_order). */
static float cb_amx_emu_bf16(uint16_t h) {
    return (h & 0x7F80u) == 0 ? 0.0f * cb_bf16_to_f32(h) : cb_bf16_to_f32(h);     /* DAZ, the sign kept */
}
static float cb_amx_emu_ftz(float v) { return fabsf(v) < FLT_MIN ? copysignf(0.0f, v) : v; }
static void cb_amx_emu_dpbf16ps(int c, int a, int b) {
    const int M = cb_amx_emu_cfg.rows[a], K2 = cb_amx_emu_cfg.rows[b], N = cb_amx_emu_cfg.colsb[b] / 4;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            const int order = cb_amx_emu_unit_order >= 0 ? cb_amx_emu_unit_order : cb_bf16_order;
            float acc, sums[2] = {0.0f, 0.0f};         /* a split order's even and odd sums */
            memcpy(&acc, &cb_amx_emu_tiles[c].b[m][4 * n], 4);
            for (int k = 0; k < K2; k++)
                for (int i = 0; i < 2; i++) {
                    uint16_t x, y;
                    memcpy(&x, &cb_amx_emu_tiles[a].b[m][4 * k + 2 * i], 2);
                    memcpy(&y, &cb_amx_emu_tiles[b].b[k][4 * n + 2 * i], 2);
                    float *to = order == CB_BF16_SEQ ? &acc : &sums[i];
                    *to = cb_amx_emu_ftz(fmaf(cb_amx_emu_bf16(x), cb_amx_emu_bf16(y), *to));   /* the product exact */
                }
            switch (order) {
            case CB_BF16_SEQ: break;
            case CB_BF16_SPLIT_SUM: acc = cb_amx_emu_ftz(acc + cb_amx_emu_ftz(sums[0] + sums[1])); break;
            case CB_BF16_SPLIT_EVEN: acc = cb_amx_emu_ftz(cb_amx_emu_ftz(acc + sums[0]) + sums[1]); break;
            default: acc = cb_amx_emu_ftz(cb_amx_emu_ftz(acc + sums[1]) + sums[0]); break;
            }
            memcpy(&cb_amx_emu_tiles[c].b[m][4 * n], &acc, 4);
        }
}

#define CB_AMX_LOADCFG CB_AMX_HW_LOADCFG
#define CB_AMX_RELEASE CB_AMX_HW_RELEASE
#define CB_AMX_LOAD CB_AMX_HW_LOAD
#define CB_AMX_STORE CB_AMX_HW_STORE
#define CB_AMX_ZERO CB_AMX_HW_ZERO
#define CB_AMX_DPBSSD CB_AMX_HW_DPBSSD
#define CB_AMX_DPBF16PS CB_AMX_HW_DPBF16PS
#define CB_AMX_NAME(base) base##_amx
#include "amx_body.h"                  /* (it #undefs its parameters) */

#define CB_AMX_LOADCFG(cfg) cb_amx_emu_loadcfg(cfg)
#define CB_AMX_RELEASE() ((void)0)
#define CB_AMX_LOAD(t, base, stride) cb_amx_emu_load(t, base, stride)
#define CB_AMX_STORE(t, base, stride) cb_amx_emu_store(t, base, stride)
#define CB_AMX_ZERO(t) cb_amx_emu_zero(t)
#define CB_AMX_DPBSSD(c, a, b) cb_amx_emu_dpbssd(c, a, b)
#define CB_AMX_DPBF16PS(c, a, b) cb_amx_emu_dpbf16ps(c, a, b)
#define CB_AMX_NAME(base) base##_amx_emulated
#include "amx_body.h"                  /* (it #undefs its parameters) */

#else
#define CB_HAVE_AMX 0
#endif /* CB_HAVE_AMX */
#endif /* COLIBRI_KERNELS_AMX_H */
