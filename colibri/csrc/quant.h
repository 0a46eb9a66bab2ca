/* quant.h — the block formats of quantized weights and activations.
 *
 * Weights (mirrored in colibri/quant.py; tests check both agree):
 *   int8: blocks of 32 weights, one f16 scale:       w = d * q,        q in [-127, 127]   (34 bytes)
 *   int4: blocks of 32 weights, one f16 scale, two weights a byte:
 *         w = d * (q - 8), q in [0, 15]; byte j holds element j (low nibble) and j + 16 (high)
 *                                                                                        (18 bytes)
 *   mxfp4 (OCP microscaling FP4: gpt-oss's experts): blocks of 32 weights, one e8m0 scale byte e
 *         and 16 bytes of e2m1 codes: w = 2^(e - 127) * FP4[q], FP4 = 0, 0.5, 1, 1.5, 2, 3, 4, 6
 *         and their negatives (q + 8); byte j holds element 2j (low nibble) and 2j + 1 (high):
 *         the checkpoint's *_scales byte and *_blocks bytes as they are, side by side (17 bytes).
 *         The kernels take the codes doubled, as integers (cb_mxfp4_int), and the scale halved
 *         (cb_e8m0_half): w = 2^(e - 128) * cb_mxfp4_int[q], the same number.
 *   nl4: a 16-value non-linear codebook (cb_nl4_int: IQ4_NL's values halved) under a signed 6-bit
 *         scale per 16 weights and an f32 scale per row: w = row_scale * sub * cb_nl4_int[q],
 *         sub in [-32, 31]; the interleaved layout only (below): 4.375 bits a weight + 32 bits a row.
 *   int6: blocks of 32 weights, one f16 scale: w = d * (u - 32), u in [0, 63] split into its low 4
 *         bits (int4's nibbles) and its high 2 (a byte holds four); the interleaved layout only
 *         (cb_igroup_int6): 6.5 bits a weight, for the matrices whose error costs most per byte
 *         (the output head, attention) beside 4-bit experts.
 * A row of an int8/int4/mxfp4 matrix is cols/32 consecutive blocks; cols must be a multiple of 32.
 * mxfp4 is stored in the rows layout (the checkpoint's order) or the interleaved one (below).
 *
 * The `transposed` layout ([in, out] at block granularity) stores the same blocks input-major:
 * for each block of 32 inputs kb, the blocks of all outputs in order, 8 outputs at a time as one
 * group whose 8 scales come first (cb_group_int8 / cb_group_int4; rows must be a multiple of 8):
 *     group (kb, g) at byte ((size_t)kb * (rows / 8) + g) * sizeof(group), g = output / 8.
 * A kernel then loads an activation block once for 8 outputs, converts their 8 scales in one
 * instruction and keeps 8 output sums in one vector (no horizontal sum per row).
 *
 * The `interleaved` layout (int8/int4 only) keeps 8 outputs together too, but output-major: group
 * (g, kb) — block kb of outputs 8g .. 8g+7 — at byte ((size_t)g * (cols / 32) + kb) * sizeof(group),
 * so one group's blocks follow each other (a thread's share of a product is one contiguous read),
 * and inside a group the weights go 4 inputs at a time (cb_igroup_int8 / cb_igroup_int4): one
 * 32-byte vector holds 4 inputs of each of the 8 outputs, so 4 activation bytes broadcast to every
 * int32 lane give the 8 outputs' partial sums in their own lanes — no horizontal sums (the
 * transposed order needs an hadd tree per group and token), one vpdpbusd per vector with VNNI.
 * Same blocks, same numbers: a matrix converts between the three layouts without loss. An mxfp4
 * interleaved group (cb_igroup_mxfp4) is int4's with the 8 e8m0 scales first and each code where
 * int4 keeps its nibble (element 4v + i of output r low in qs[v][r][i], 16 + 4v + i high): the
 * kernels turn a nibble into its doubled value + 12 (cb_mxfp4_u12, unsigned, one byte shuffle) and
 * take 12 * sum(x) off, where int4 takes 8 * sum(x).
 * An nl4 interleaved group (cb_igroup_nl4) is int4's codes under 16 six-bit scales: output r's
 * inputs 0..15 (the low nibbles) have scale sc_lo[r], inputs 16..31 (the high ones) sc_hi[r], so
 * the two chains the kernels already keep for the low and high nibbles each take their own
 * scale. The kernels shuffle a code to cb_nl4_u64 (its value + 64, unsigned) and take 64 times
 * each half's activation sum off (cb_act_q8.nl4_off). After the matrix's groups come its `rows`
 * f32 row scales, which multiply each output once, when its sum is complete (dispatch.h).
 * An int6 interleaved group (cb_igroup_int6) is int4's group (the 8 f16 scales, the low 4 bits
 * of each code where int4 keeps its nibble) followed by the codes' high 2 bits, 32 bytes for each
 * two of int4's code vectors: qh[p][r][i] holds, from its low bits up, the high bits of the low
 * and high nibble of qs[2p][r][i], then those of qs[2p + 1][r][i]. A kernel ORs them in above
 * the nibbles (a shift and a mask per vector) and multiplies u = code + 32 as int4 multiplies its
 * nibbles, taking 32 * sum(x) off.
 *
 * Activations multiplied against integer weights are quantized per block of 32 to int8 with a
 * float scale (cb_act_q8), as the fast engines do: the dot product of two blocks is then an
 * integer dot product times two scales.
 */
#ifndef COLIBRI_QUANT_H
#define COLIBRI_QUANT_H

#include <stdint.h>
#include <math.h>
#include <string.h>

#define CB_QBLOCK 32

typedef struct {
    uint16_t d;                 /* f16 scale */
    int8_t qs[CB_QBLOCK];       /* [32] quantized weights */
} cb_block_int8;

typedef struct {
    uint16_t d;                 /* f16 scale */
    uint8_t qs[CB_QBLOCK / 2];  /* [16] element j in the low nibble of qs[j], element j+16 in the high */
} cb_block_int4;

typedef struct {
    uint8_t e;                  /* e8m0 scale: 2^(e - 127) (255, NaN in the standard, is refused at convert) */
    uint8_t qs[CB_QBLOCK / 2];  /* [16] e2m1 codes: element 2j in the low nibble of qs[j], 2j + 1 in the high */
} cb_block_mxfp4;

/* The e2m1 values times 2, by code: an exact int8 (what the integer kernels multiply). */
static const int8_t cb_mxfp4_int[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* 2^(e - 128): half the block's scale, which goes with the doubled codes (exact for every e:
 * e < 2 are subnormal floats). */
static inline float cb_e8m0_half(uint8_t e) {
    uint32_t bits = e >= 2 ? (uint32_t)(e - 1) << 23 : 0x00200000u << e;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#define CB_TGROUP 8             /* outputs per group of the transposed integer layout */

typedef struct {
    uint16_t d[CB_TGROUP];              /* [8] f16 scales of outputs 8g .. 8g+7 */
    int8_t qs[CB_TGROUP][CB_QBLOCK];    /* [8][32] their quantized weights, as in cb_block_int8 */
} cb_group_int8;

typedef struct {
    uint16_t d[CB_TGROUP];              /* [8] f16 scales */
    uint8_t qs[CB_TGROUP][CB_QBLOCK / 2];   /* [8][16] nibbles, as in cb_block_int4 */
} cb_group_int4;

/* A group of the interleaved layout: the 8 f16 scales, then the weights 4 inputs at a time. */
typedef struct {
    uint16_t d[CB_TGROUP];              /* [8] f16 scales of outputs 8g .. 8g+7 */
    int8_t qs[8][CB_TGROUP][4];         /* [vector c][output r][i]: input 4c + i of output r */
} cb_igroup_int8;

typedef struct {
    uint16_t d[CB_TGROUP];              /* [8] f16 scales */
    uint8_t qs[4][CB_TGROUP][4];        /* [vector v][output r][i]: input 4v + i of output r in the low
                                           nibble, input 16 + 4v + i in the high (nibbles as in
                                           cb_block_int4: w = d * (q - 8)) */
} cb_igroup_int4;

typedef struct {
    uint8_t e[CB_TGROUP];               /* [8] e8m0 scales of outputs 8g .. 8g+7 */
    uint8_t qs[4][CB_TGROUP][4];        /* [vector v][output r][i]: the codes of inputs 4v + i (low
                                           nibble) and 16 + 4v + i (high) of output r */
} cb_igroup_mxfp4;

/* An interleaved bf16 group: 8 outputs x 32 inputs, 512 bytes, no scale. A vector of it (64
 * bytes) holds 4 inputs of each of the 8 outputs, so a 512-bit register is 8 outputs x 2 pairs of
 * inputs in its 16 lanes: vdpbf16ps multiplies it by the 4 activations broadcast, the widened path
 * by the even and odd inputs (kernels_scalar.h, cb_itile_bf16_scalar: the order of the sums). */
typedef struct {
    uint16_t w[8][CB_TGROUP][4];        /* [vector c][output r][i]: input 4c + i of output r (bf16 bits) */
} cb_igroup_bf16;

/* An interleaved int6 group: 8 outputs x 32 inputs, 208 bytes (quant.h's header). */
typedef struct {
    uint16_t d[CB_TGROUP];              /* [8] f16 scales */
    uint8_t qs[4][CB_TGROUP][4];        /* [vector v][output r][i]: the low 4 bits of u = code + 32 of
                                           inputs 4v + i (low nibble) and 16 + 4v + i (high), as int4 */
    uint8_t qh[2][CB_TGROUP][4];        /* [pair p][output r][i]: bits 2k, 2k + 1 hold the high 2 bits
                                           of vector 2p + k / 2's low (k even) or high (k odd) nibble */
} cb_igroup_int6;
#define CB_INT6_OFFSET 32               /* u = code + 32: what the integer steps multiply */

/* Bits 4..5 of each byte: the high 2 bits of vector v's low (half 0) or high (half 1) nibbles,
 * from the byte qh that holds them (cb_igroup_int6), as a shift of that byte. */
#define CB_INT6_HSHIFT(v, half) (4 - 2 * (2 * ((v) & 1) + (half)))

/* The doubled e2m1 values + 12 by code, unsigned (0 .. 24): what the interleaved kernels multiply
 * (then 12 * sum(x) comes off). */
static const uint8_t cb_mxfp4_u12[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
#define CB_MXFP4_OFFSET 12

/* An interleaved nl4 group: 8 outputs x 32 inputs, 140 bytes. sc packs the 16 six-bit scales,
 * each stored + 32 (0 .. 63): byte r (r < 8) holds sc_lo[r] in its low 6 bits and the low 2 bits
 * of sc_hi[r] above them; byte 8 + r / 2 holds the high 4 bits of sc_hi[r] in its low (r even) or
 * high (r odd) nibble (cb_nl4_scales). */
typedef struct {
    uint8_t sc[12];                     /* [12] the packed scales */
    uint8_t qs[4][CB_TGROUP][4];        /* [vector v][output r][i]: the codes of inputs 4v + i (low
                                           nibble) and 16 + 4v + i (high) of output r, as int4's */
} cb_igroup_nl4;

/* The codebook, by code: IQ4_NL's 16 values (llama.cpp's kvalues_iq4nl, fitted to the weights of
 * trained models) halved and rounded half to even, so that value + 64 (0 .. 120) times an int8
 * activation cannot saturate vpmaddubsw's pair sums (2 * 120 * 127 < 32767). */
static const int8_t cb_nl4_int[16] = {-64, -52, -42, -32, -24, -18, -11, -5, 0, 6, 12, 19, 26, 34, 44, 56};
static const uint8_t cb_nl4_u64[16] = {0, 12, 22, 32, 40, 46, 53, 59, 64, 70, 76, 83, 90, 98, 108, 120};
#define CB_NL4_OFFSET 64
#define CB_NL4_SCALE_BIAS 32

/* The two six-bit scales of output r (r < 8) of an nl4 group, signed. */
static inline void cb_nl4_scales(const uint8_t sc[12], int r, int *lo, int *hi) {
    *lo = (sc[r] & 63) - CB_NL4_SCALE_BIAS;
    *hi = ((sc[r] >> 6) | (((sc[8 + r / 2] >> (4 * (r & 1))) & 15) << 2)) - CB_NL4_SCALE_BIAS;
}

/* The prefill's packed form of one group and block (kernels_avx2.h, cb_tprefill_quant_avx2): 8
 * float scales, then 8 vectors of 32 bytes, vector c holding inputs 4c..4c+3 of the 8 outputs
 * (int4 as one nibble value per byte; int8 as w + 128 in the VNNI kernels). Scratch only, never
 * stored. */
#define CB_TPACK_BLOCK_BYTES (8 * 4 + 8 * 32)

/* Scratch bytes of the prefill's activation sums (k * sum(x) of n tokens' nb blocks, int32: the
 * offset of unsigned weights, int4 always, int8 in the VNNI kernels), rounded up to 64, and of the
 * whole scratch of a chunk of `units` groups (sums, then packed blocks). */
static inline size_t cb_tprefill_sums_bytes(int nb, int n) {
    return ((size_t)n * nb * sizeof(int32_t) + 63) / 64 * 64;
}

static inline size_t cb_tprefill_bytes(int units, int nb, int n) {
    return cb_tprefill_sums_bytes(nb, n) + (size_t)units * nb * CB_TPACK_BLOCK_BYTES;
}

#if defined(__cplusplus)
#define CB_STATIC_ASSERT static_assert
#else
#define CB_STATIC_ASSERT _Static_assert
#endif
CB_STATIC_ASSERT(sizeof(cb_block_int8) == 34, "int8 block must be 34 bytes");
CB_STATIC_ASSERT(sizeof(cb_block_int4) == 18, "int4 block must be 18 bytes");
CB_STATIC_ASSERT(sizeof(cb_block_mxfp4) == 17, "mxfp4 block must be 17 bytes");
CB_STATIC_ASSERT(sizeof(cb_group_int8) == 8 * 34, "int8 group must be 8 blocks");
CB_STATIC_ASSERT(sizeof(cb_group_int4) == 8 * 18, "int4 group must be 8 blocks");
CB_STATIC_ASSERT(sizeof(cb_igroup_int8) == sizeof(cb_group_int8), "interleaved int8 group must be 8 blocks");
CB_STATIC_ASSERT(sizeof(cb_igroup_int4) == sizeof(cb_group_int4), "interleaved int4 group must be 8 blocks");
CB_STATIC_ASSERT(sizeof(cb_igroup_mxfp4) == 8 * 17, "interleaved mxfp4 group must be 8 blocks");
CB_STATIC_ASSERT(sizeof(cb_igroup_nl4) == 140, "interleaved nl4 group must be 140 bytes");
CB_STATIC_ASSERT(sizeof(cb_igroup_int6) == 208, "interleaved int6 group must be 208 bytes");
CB_STATIC_ASSERT(sizeof(cb_igroup_bf16) == 512, "interleaved bf16 group must be 512 bytes");

/* Activations quantized per block of 32: x[i] ~= d[i / 32] * q[i]. */
typedef struct {
    int8_t *q;      /* [n] */
    float *d;       /* [n / 32] */
    int32_t *s;     /* [n / 32] the sum of each block's q: what unsigned weights (int4's nibbles,
                       w + 8; VNNI's int8, w + 128) take off, times 8 or 128 */
    int32_t *nl4_off; /* [2 * n / 32] per block -64 x the sum of its first 16 q, then -64 x the sum
                       of its last 16: what nl4's codes + 64 take off in each half, ready to
                       broadcast (the prefill's 4-token tiles would recompute them per group) */
    int n;
    float *xp;      /* [n] or NULL: the float activation reordered for a bf16 tile (CB_XP_*) */
    uint16_t *xb;   /* [n] or NULL: the activation rounded to bf16 for bf16 products (vdpbf16ps),
                       set where a model takes them (load(bf16_products=)); see dispatch.h */
    const float *x; /* [n] the float activation itself, which the interleaved bf16 kernels widen
                       against: set by cb_matmul_jobs for each batch (not owned) */
} cb_act_q8;

/* The orders cb_act_q8.xp can hold (cb_mat_kernels.xp_order says which a kernel reads):
 * CB_XP_LANES  the AVX-512 rows bf16 tile's (kernels_avx512.h, cb_permute_bf16);
 * CB_XP_PAIRS  each 4 inputs as x0 x2 x1 x3: the AVX2 interleaved bf16 prompt tile broadcasts a
 *              64-bit pair (kernels_avx2.h, cb_permute_pairs); written only for n > 1 tokens. */
enum { CB_XP_NONE = 0, CB_XP_LANES = 1, CB_XP_PAIRS = 2 };

#define CB_ACT_TINY 1e-30f

/* A bf16 value as the float it stands for (exact). */
static inline float cb_bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#endif /* COLIBRI_QUANT_H */
