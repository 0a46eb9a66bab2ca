/* kernels_scalar.h — the portable reference kernels of Colibri: the scalar tier.
 *
 * Every kernel the layer loop calls exists here as plain C, with the signature of its table entry
 * (dispatch.h): these are the specification, and the SIMD tiers (kernels_avx2.h, kernels_avx512.h,
 * kernels_vnni.h) are tested against them. Conventions:
 *   - weights are row-major [rows, cols] ("rows" layout) in one of the storage dtypes below;
 *   - activations are float32, accumulation is float32 except where a comment says otherwise;
 *   - `n_threads` splits the output rows with OpenMP; small problems stay on one thread.
 */
#ifndef COLIBRI_KERNELS_SCALAR_H
#define COLIBRI_KERNELS_SCALAR_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stddef.h>
#include <stdlib.h>

#include "api.h"
#include "int_step.h"         /* the tile entries' types */

/* The formats whose products take quantized activations (cb_act_q8). */
#define CB_IS_QUANT(dtype) ((dtype) == CB_INT8 || (dtype) == CB_INT4 || (dtype) == CB_MXFP4 || (dtype) == CB_NL4 || \
                            (dtype) == CB_INT6)

/* One dot product of a weight row (storage format) with the activation, given both as floats
 * x[cols] and, for the integer formats, quantized per block (a). Every tier implements this
 * signature for every dtype; dispatch.h picks one per dtype at import. */
typedef float (*cb_dot_fn)(const void *row, const float *x, const cb_act_q8 *a, int cols);

/* Below this many multiply-adds a matvec/matmul runs on one thread: waking the other threads and
 * waiting for them at the barrier costs more (much more when a core is shared with other work)... */
#define CB_PARALLEL_MIN_WORK (1 << 19)
/* ...unless its weights are this many bytes or more: a decode matvec is a read, and a small one in
 * f32 or bf16 has few multiply-adds for its bytes. A MoE router (Qwen3-MoE's [128, 2048] f32: 1 MB,
 * 262,144 multiply-adds; OLMoE's [64, 2048]), read from memory once per layer and token, is read
 * faster by two threads than by one, as one core alone does not reach the memory's bandwidth; a
 * many-core server, each of whose cores reads a small part of its bandwidth, gains more.
 * (#ifndef: tools/bench/small_matvec.c builds without it.) */
#ifndef CB_PARALLEL_MIN_BYTES
#define CB_PARALLEL_MIN_BYTES (1 << 18)
#endif

/* This thread's scratch of at least `bytes` (64-byte aligned) in one of CB_SCRATCH_SLOTS slots,
 * grown on demand and kept for the thread's life: OpenMP's pool threads keep a few hundred KB each;
 * so does every other thread that ran a prefill (a Python thread's is not freed when it exits).
 * NULL if the allocation fails. A slot's buffer moves when it grows: a caller asks again for each
 * product and never holds it across another call for the same slot. */
/* (The slots' codes, CB_SCRATCH_*: int_step.h.) */
static CB_THREAD_LOCAL void *cb_scratch_raw[CB_SCRATCH_SLOTS];       /* what malloc returned */
static CB_THREAD_LOCAL uint8_t *cb_scratch_ptr[CB_SCRATCH_SLOTS];    /* aligned into it */
static CB_THREAD_LOCAL size_t cb_scratch_cap[CB_SCRATCH_SLOTS];

static uint8_t *cb_thread_scratch(int slot, size_t bytes) {
    if (cb_scratch_ptr[slot] && bytes <= cb_scratch_cap[slot]) return cb_scratch_ptr[slot];
    size_t cap = (bytes + bytes / 2 + 63) / 64 * 64;
    free(cb_scratch_raw[slot]);
    cb_scratch_raw[slot] = malloc(cap + 64);
    cb_scratch_ptr[slot] = cb_scratch_raw[slot] ? (uint8_t *)(((uintptr_t)cb_scratch_raw[slot] + 63) & ~(uintptr_t)63) : NULL;
    cb_scratch_cap[slot] = cb_scratch_raw[slot] ? cap : 0;
    return cb_scratch_ptr[slot];
}

/* Portable quantization of activations (the reference for the SIMD versions). n % 32 == 0. */
static void cb_quantize_act_scalar(cb_act_q8 *a, const float *x, int n) {
    for (int b = 0; b < n / CB_QBLOCK; b++) {
        const float *xb = x + b * CB_QBLOCK;
        float amax = 0.0f;
        for (int j = 0; j < CB_QBLOCK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        /* blocks below CB_ACT_TINY quantize to zero: 1/d would overflow for subnormal scales */
        float d = amax >= CB_ACT_TINY ? amax / 127.0f : 0.0f;
        float id = d > 0.0f ? 1.0f / d : 0.0f;
        a->d[b] = d;
        int32_t sum = 0, half = 0;
        for (int j = 0; j < CB_QBLOCK; j++) {
            a->q[b * CB_QBLOCK + j] = (int8_t)lrintf(xb[j] * id);
            sum += a->q[b * CB_QBLOCK + j];
            if (j == CB_QBLOCK / 2 - 1) half = sum;
        }
        a->s[b] = sum;
        a->nl4_off[2 * b] = -CB_NL4_OFFSET * half;
        a->nl4_off[2 * b + 1] = -CB_NL4_OFFSET * (sum - half);
    }
    a->n = n;
}

/* ---- half-precision conversion ------------------------------------------------------------ */

/* f16 -> f32 lookup table [65536], filled once by cb_init_tables() at import, never changed. */
static float cb_f16_table[65536];

static float cb_f16_to_f32_exact(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t man = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;                                   /* +-0 */
        } else {                                           /* subnormal: normalise */
            int e = -1;
            do { e++; man <<= 1; } while ((man & 0x400u) == 0);
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3FFu) << 13);
        }
    } else if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);           /* inf / nan */
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);  /* normal: rebias 15 -> 127 */
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void cb_init_tables(void) {
    for (uint32_t i = 0; i < 65536u; i++) cb_f16_table[i] = cb_f16_to_f32_exact((uint16_t)i);
}

/* f32 -> bf16 as vcvtneps2bf16 does it: round to nearest even, a denormal input to a signed
 * zero (the instruction treats denormal inputs as zero), a NaN stays a NaN (quieted). */
static inline uint16_t cb_f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7F800000u) == 0) return (uint16_t)((bits >> 16) & 0x8000u);         /* zero, denormal */
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x0040u);  /* NaN */
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* Round n activations to bf16 (cb_kernel_table.round_bf16's spec). */
static void cb_round_bf16_scalar(uint16_t *dst, const float *x, int n) {
    for (int i = 0; i < n; i++) dst[i] = cb_f32_to_bf16(x[i]);
}

/* ---- dot products and matrix-vector products ---------------------------------------------- */

static float cb_dot_f32_scalar(const void *row, const float *x, const cb_act_q8 *a, int n) {
    const float *w = (const float *)row;
    (void)a;
    float acc = 0.0f;
    for (int i = 0; i < n; i++) acc += w[i] * x[i];
    return acc;
}

static float cb_dot_f16_scalar(const void *row, const float *x, const cb_act_q8 *a, int n) {
    const uint16_t *w = (const uint16_t *)row;
    (void)a;
    float acc = 0.0f;
    for (int i = 0; i < n; i++) acc += cb_f16_table[w[i]] * x[i];
    return acc;
}

static float cb_dot_bf16_scalar(const void *row, const float *x, const cb_act_q8 *a, int n) {
    const uint16_t *w = (const uint16_t *)row;
    (void)a;
    float acc = 0.0f;
    for (int i = 0; i < n; i++) acc += cb_bf16_to_f32(w[i]) * x[i];
    return acc;
}

/* The exact integer dot product of one block's 32 weights (int8: qs[32]; int4: the nibbles of
 * qs[16], element j low in qs[j], j + 16 high) with 32 quantized activations. */
static inline int32_t cb_block_dot_int8(const int8_t *qs, const int8_t *xq) {
    int32_t s = 0;
    for (int j = 0; j < CB_QBLOCK; j++) s += (int32_t)qs[j] * (int32_t)xq[j];
    return s;
}

static inline int32_t cb_block_dot_int4(const uint8_t *qs, const int8_t *xq) {
    int32_t s = 0;
    for (int j = 0; j < CB_QBLOCK / 2; j++) {
        s += ((int32_t)(qs[j] & 0x0F) - 8) * (int32_t)xq[j];
        s += ((int32_t)(qs[j] >> 4) - 8) * (int32_t)xq[j + CB_QBLOCK / 2];
    }
    return s;
}

/* mxfp4: the doubled codes (cb_mxfp4_int) of element 2j (low nibble of qs[j]) and 2j + 1 (high). */
static inline int32_t cb_block_dot_mxfp4(const uint8_t *qs, const int8_t *xq) {
    int32_t s = 0;
    for (int j = 0; j < CB_QBLOCK / 2; j++) {
        s += (int32_t)cb_mxfp4_int[qs[j] & 0x0F] * (int32_t)xq[2 * j];
        s += (int32_t)cb_mxfp4_int[qs[j] >> 4] * (int32_t)xq[2 * j + 1];
    }
    return s;
}

static float cb_dot_mxfp4_scalar(const void *row, const float *x, const cb_act_q8 *a, int n) {
    const cb_block_mxfp4 *w = (const cb_block_mxfp4 *)row;
    (void)x;
    float acc = 0.0f;
    for (int b = 0; b < n / CB_QBLOCK; b++)
        acc += cb_e8m0_half(w[b].e) * a->d[b] * (float)cb_block_dot_mxfp4(w[b].qs, a->q + b * CB_QBLOCK);
    return acc;
}

static float cb_dot_int8_scalar(const void *row, const float *x, const cb_act_q8 *a, int n) {
    const cb_block_int8 *w = (const cb_block_int8 *)row;
    (void)x;
    float acc = 0.0f;
    for (int b = 0; b < n / CB_QBLOCK; b++)
        acc += cb_f16_table[w[b].d] * a->d[b] * (float)cb_block_dot_int8(w[b].qs, a->q + b * CB_QBLOCK);
    return acc;
}

static float cb_dot_int4_scalar(const void *row, const float *x, const cb_act_q8 *a, int n) {
    const cb_block_int4 *w = (const cb_block_int4 *)row;
    (void)x;
    float acc = 0.0f;
    for (int b = 0; b < n / CB_QBLOCK; b++)
        acc += cb_f16_table[w[b].d] * a->d[b] * (float)cb_block_dot_int4(w[b].qs, a->q + b * CB_QBLOCK);
    return acc;
}

/* ---- the transposed layout ------------------------------------------------------------------
 *
 * A matrix W [rows = outputs, cols = inputs] stored `transposed` is [cols, rows] row-major for the
 * float formats (a matvec is an axpy per input row), and for int8/int4 the same blocks as `rows`
 * stored input-major in groups of 8 outputs (quant.h). The same quantization, so both layouts hold
 * the same numbers. The scalar kernel below accumulates every output in exactly the order of the
 * scalar dot products above, so at the scalar tier both layouts give the same bits.
 */

/* An interleaved nl4 matrix [rows, cols]: its groups, then its f32 row scales [rows] (quant.h). */
static inline size_t cb_nl4_bytes(int rows, int cols) {
    return (size_t)(rows / CB_TGROUP) * (cols / CB_QBLOCK) * sizeof(cb_igroup_nl4) + (size_t)rows * sizeof(float);
}

/* Bytes of a [rows, cols] matrix in dtype's storage (nl4's whole interleaved matrix, else rows x
 * cb_row_stride). */
static inline size_t cb_matrix_bytes(int dtype, int rows, int cols) {
    return dtype == CB_NL4 ? cb_nl4_bytes(rows, cols) : (size_t)rows * cb_row_stride(dtype, cols);
}

static inline const float *cb_nl4_row_scales(const void *w, int rows, int cols) {
    return (const float *)((const char *)w + (size_t)(rows / CB_TGROUP) * (cols / CB_QBLOCK) * sizeof(cb_igroup_nl4));
}

/* An interleaved group's 8 weight scales as floats (int8/int4: f16; mxfp4: 2^(e - 128), the
 * half scale of its doubled codes; nl4 has two per output, cb_nl4_scales). */
static inline float cb_igroup_scale(const char *grp, int dtype, int r) {
    return dtype == CB_MXFP4 ? cb_e8m0_half(((const cb_igroup_mxfp4 *)grp)->e[r])
                             : cb_f16_table[((const uint16_t *)grp)[r]];
}

/* One weight of a float-format row, as float. */
static inline float cb_load_f32_scalar(const char *row, int dtype, int i) {
    if (dtype == CB_F32) return ((const float *)row)[i];
    if (dtype == CB_F16) return cb_f16_table[((const uint16_t *)row)[i]];
    return cb_bf16_to_f32(((const uint16_t *)row)[i]);
}

/* The 32 weights q[32] of output r in an interleaved group (quant.h) as signed integers (int4:
 * nibble - 8; mxfp4: the doubled e2m1 value; nl4: its codebook value; int6: u - 32), input order. */
static inline void cb_igroup_weights(int8_t q[CB_QBLOCK], const char *grp, int dtype, int r) {
    for (int v = 0; v < 8; v++)
        for (int i = 0; i < 4; i++) {
            if (dtype == CB_INT8) {
                q[4 * v + i] = ((const cb_igroup_int8 *)grp)->qs[v][r][i];
            } else if (dtype == CB_MXFP4 && v < 4) {
                uint8_t b = ((const cb_igroup_mxfp4 *)grp)->qs[v][r][i];
                q[4 * v + i] = cb_mxfp4_int[b & 0x0F];
                q[16 + 4 * v + i] = cb_mxfp4_int[b >> 4];
            } else if (dtype == CB_NL4 && v < 4) {
                uint8_t b = ((const cb_igroup_nl4 *)grp)->qs[v][r][i];
                q[4 * v + i] = cb_nl4_int[b & 0x0F];
                q[16 + 4 * v + i] = cb_nl4_int[b >> 4];
            } else if (dtype == CB_INT6 && v < 4) {
                const cb_igroup_int6 *g6 = (const cb_igroup_int6 *)grp;
                const uint8_t b = g6->qs[v][r][i], h = g6->qh[v / 2][r][i];
                const int k = 2 * (v & 1);                 /* bits 2k, 2k + 1: the low nibble's */
                q[4 * v + i] = (int8_t)(((b & 0x0F) | (((h >> (2 * k)) & 3) << 4)) - CB_INT6_OFFSET);
                q[16 + 4 * v + i] = (int8_t)(((b >> 4) | (((h >> (2 * k + 2)) & 3) << 4)) - CB_INT6_OFFSET);
            } else if (v < 4) {
                uint8_t b = ((const cb_igroup_int4 *)grp)->qs[v][r][i];
                q[4 * v + i] = (int8_t)((b & 0x0F) - 8);
                q[16 + 4 * v + i] = (int8_t)((b >> 4) - 8);
            }
        }
}

/* out[cols] = row `row` of W [rows, cols] stored as `dtype` in `layout`, converted to float32
 * (the embedding lookup; a tied embedding that is also the output head may be transposed: then
 * the row is gathered, one block per group of its column). */
static void cb_dequant_row(float *out, const void *w, int dtype, int layout, int row, int rows, int cols) {
    const char *wb = (const char *)w;
    if (dtype == CB_MXFP4 && layout != CB_INTERLEAVED) {      /* rows */
        const cb_block_mxfp4 *blk = (const cb_block_mxfp4 *)(wb + (size_t)row * cb_row_stride(dtype, cols));
        for (int b = 0; b < cols / CB_QBLOCK; b++) {
            float d = cb_e8m0_half(blk[b].e);
            for (int j = 0; j < CB_QBLOCK / 2; j++) {
                out[b * CB_QBLOCK + 2 * j] = d * (float)cb_mxfp4_int[blk[b].qs[j] & 0x0F];
                out[b * CB_QBLOCK + 2 * j + 1] = d * (float)cb_mxfp4_int[blk[b].qs[j] >> 4];
            }
        }
        return;
    }
    if (dtype == CB_BF16 && layout == CB_INTERLEAVED) {    /* input 4c + i at w[c][row % 8][i] of its group */
        const uint16_t *grp = (const uint16_t *)(wb + (size_t)(row / CB_TGROUP) * cols * 2 * CB_TGROUP);
        for (int i = 0; i < cols; i++) out[i] = cb_bf16_to_f32(grp[(size_t)(i / 4) * 4 * CB_TGROUP + (row % CB_TGROUP) * 4 + i % 4]);
        return;
    }
    if (!CB_IS_QUANT(dtype)) {
        if (layout == CB_TRANSPOSED) {                  /* element i of the row: input row i, column `row` */
            size_t stride = cb_row_stride(dtype, rows);
            for (int i = 0; i < cols; i++) out[i] = cb_load_f32_scalar(wb + (size_t)i * stride, dtype, row);
        } else {
            const char *base = wb + (size_t)row * cb_row_stride(dtype, cols);
            for (int i = 0; i < cols; i++) out[i] = cb_load_f32_scalar(base, dtype, i);
        }
        return;
    }
    const size_t bbytes = dtype == CB_INT8 ? sizeof(cb_block_int8) : sizeof(cb_block_int4);
    if (dtype == CB_NL4) {                              /* interleaved only */
        const int nb = cols / CB_QBLOCK;
        const float rs = cb_nl4_row_scales(w, rows, cols)[row];
        for (int b = 0; b < nb; b++) {
            const char *grp = wb + ((size_t)(row / CB_TGROUP) * nb + b) * sizeof(cb_igroup_nl4);
            int8_t q[CB_QBLOCK];
            int lo, hi;
            cb_igroup_weights(q, grp, dtype, row % CB_TGROUP);
            cb_nl4_scales(((const cb_igroup_nl4 *)grp)->sc, row % CB_TGROUP, &lo, &hi);
            for (int j = 0; j < CB_QBLOCK; j++)        /* sub * code is an exact integer: one rounding */
                out[b * CB_QBLOCK + j] = rs * (float)((j < 16 ? lo : hi) * q[j]);
        }
        return;
    }
    if (layout == CB_INTERLEAVED) {
        const int nb = cols / CB_QBLOCK;
        for (int b = 0; b < nb; b++) {
            const char *grp = wb + ((size_t)(row / CB_TGROUP) * nb + b) * cb_group_bytes(dtype);
            int8_t q[CB_QBLOCK];
            cb_igroup_weights(q, grp, dtype, row % CB_TGROUP);
            float df = cb_igroup_scale(grp, dtype, row % CB_TGROUP);
            for (int j = 0; j < CB_QBLOCK; j++) out[b * CB_QBLOCK + j] = df * (float)q[j];
        }
        return;
    }
    for (int b = 0; b < cols / CB_QBLOCK; b++) {
        uint16_t d;               /* block b of the row: its scale and its 32 (int8) / 16 (int4) bytes */
        const void *qs;
        if (layout == CB_TRANSPOSED) {
            const char *grp = wb + ((size_t)b * (rows / CB_TGROUP) + row / CB_TGROUP) * cb_group_bytes(dtype);
            int r = row % CB_TGROUP;
            d = ((const uint16_t *)grp)[r];
            qs = dtype == CB_INT8 ? (const void *)((const cb_group_int8 *)grp)->qs[r]
                                  : (const void *)((const cb_group_int4 *)grp)->qs[r];
        } else {
            const char *blk = wb + (size_t)row * cb_row_stride(dtype, cols) + (size_t)b * bbytes;
            d = *(const uint16_t *)blk;
            qs = blk + sizeof(uint16_t);
        }
        float df = cb_f16_table[d];
        float *o = out + b * CB_QBLOCK;
        if (dtype == CB_INT8) {
            for (int j = 0; j < CB_QBLOCK; j++) o[j] = df * (float)((const int8_t *)qs)[j];
        } else {
            const uint8_t *q4 = (const uint8_t *)qs;
            for (int j = 0; j < CB_QBLOCK / 2; j++) {
                o[j] = df * (float)((q4[j] & 0x0F) - 8);
                o[j + CB_QBLOCK / 2] = df * (float)((q4[j] >> 4) - 8);
            }
        }
    }
}

/* The tile of the rows layout (cb_tile_fn): out[t * ldo + r] = row r . token t for R rows `stride`
 * bytes apart and T tokens (x/ldx for the float formats, acts for the integer ones). This is the
 * plain-C spec of every tier's tile: each element the scalar dot product of its row and token. */
typedef void (*cb_tile_fn)(float *out, int ldo, const char *w, size_t stride, int dtype, const float *x,
                           int ldx, const cb_act_q8 *acts, int cols, int R, int T);

/* bf16 products (the rows tile of bf16 weights with the activation rounded to bf16, acts.xb):
 * the plain-C spec of the AVX512_BF16 tile. A product of two bf16 values is exact in f32, so only
 * the order of the f32 sums differs between the spec and a tier. */
static void cb_tile_bf16x_scalar(float *out, int ldo, const char *w, size_t stride, int dtype, const float *x,
                                 int ldx, const cb_act_q8 *acts, int cols, int R, int T) {
    (void)dtype; (void)x; (void)ldx;
    for (int r = 0; r < R; r++) {
        const uint16_t *row = (const uint16_t *)(w + (size_t)r * stride);
        for (int t = 0; t < T; t++) {
            float acc = 0.0f;
            for (int i = 0; i < cols; i++) acc += cb_bf16_to_f32(row[i]) * cb_bf16_to_f32(acts[t].xb[i]);
            out[(size_t)t * ldo + r] = acc;
        }
    }
}

static cb_dot_fn cb_dot_scalar(int dtype) {
    switch (dtype) {
    case CB_F32: return cb_dot_f32_scalar;
    case CB_F16: return cb_dot_f16_scalar;
    case CB_BF16: return cb_dot_bf16_scalar;
    case CB_INT8: return cb_dot_int8_scalar;
    case CB_MXFP4: return cb_dot_mxfp4_scalar;
    case CB_NL4: case CB_INT6: return NULL;     /* no rows layout */
    default: return cb_dot_int4_scalar;
    }
}

static void cb_tile_scalar(float *out, int ldo, const char *w, size_t stride, int dtype, const float *x,
                           int ldx, const cb_act_q8 *acts, int cols, int R, int T) {
    cb_dot_fn dot = cb_dot_scalar(dtype);
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++)
            out[(size_t)t * ldo + r] = dot(w + (size_t)r * stride, x + (size_t)t * ldx, &acts[t], cols);
}

static void cb_ttile_scalar(float *out, int ldo, const char *w, int dtype, const float *x, int ldx,
                            const cb_act_q8 *acts, int rows, int cols, int o0, int o1, int T) {
    for (int j = 0; j < T; j++) memset(out + (size_t)j * ldo + o0, 0, sizeof(float) * (size_t)(o1 - o0));
    if (dtype != CB_INT8 && dtype != CB_INT4) {
        size_t stride = cb_row_stride(dtype, rows);
        for (int i = 0; i < cols; i++) {
            const char *wrow = w + (size_t)i * stride;
            for (int j = 0; j < T; j++) {
                float xi = x[(size_t)j * ldx + i];
                float *y = out + (size_t)j * ldo;
                for (int o = o0; o < o1; o++) y[o] += cb_load_f32_scalar(wrow, dtype, o) * xi;
            }
        }
        return;
    }
    const int groups = rows / CB_TGROUP;
    const size_t gbytes = cb_group_bytes(dtype);
    for (int kb = 0; kb < cols / CB_QBLOCK; kb++) {
        for (int o = o0; o < o1; o++) {
            const char *grp = w + ((size_t)kb * groups + o / CB_TGROUP) * gbytes;
            int r = o % CB_TGROUP;
            float dw = cb_f16_table[((const uint16_t *)grp)[r]];
            for (int j = 0; j < T; j++) {
                const int8_t *xq = acts[j].q + kb * CB_QBLOCK;
                int32_t s = dtype == CB_INT8 ? cb_block_dot_int8(((const cb_group_int8 *)grp)->qs[r], xq)
                                             : cb_block_dot_int4(((const cb_group_int4 *)grp)->qs[r], xq);
                out[(size_t)j * ldo + o] += dw * acts[j].d[kb] * (float)s;
            }
        }
    }
}

/* ---- the interleaved bf16 layout (cb_igroup_bf16) ---------------------------------------------
 * Output r of a group sums its inputs in two lanes, p = 0 taking inputs 4c, 4c + 1 and p = 1
 * inputs 4c + 2, 4c + 3 of every vector c, in order; the output is lane 0 + lane 1. The widened
 * (exact) path adds each product with one rounding, the lower input of a pair first:
 * lane = fma(w[4c + 2p], x[4c + 2p], lane), then fma(w[4c + 2p + 1], x[4c + 2p + 1], lane), which the
 * AVX2 and AVX-512 kernels do lane for lane, so every tier gives these bits. bf16 products take
 * the activation rounded to bf16 (acts.xb) and vdpbf16ps's order, the higher input of a pair
 * first (Intel's definition; exact products, so fma is that sum): the spec of the AVX512_BF16
 * kernel, which the tests hold to a tolerance only (flushing of subnormals is the CPU's).
 *
 * The order of bf16 products' roundings (cb_bf16_order). vdpbf16ps's, above, is CB_BF16_SEQ, the
 * order everywhere unless an AMX unit's TDPBF16PS follows another: Intel documents TDPBF16PS both
 * as that sequence (the Intrinsics Guide) and as two partial sums kept apart within an instruction
 * (the SDM: even and odd elements of its pairs, each from zero, joined to the accumulator at the
 * instruction's end). The AMX bf16 tile (kernels_amx.h) feeds a TDPBF16PS 16 vectors c (64
 * inputs) of lane p with each pair swapped, so its even element is input 4c + 2p + 1 and its odd
 * 4c + 2p. In a split order each lane p therefore sums, over each 64 inputs of the row from input
 * 0 (a last 32 alone), even = sum of the w x products of inputs 4c + 2p + 1 and odd = of inputs
 * 4c + 2p, each from zero, each addition rounded, and the lane takes them as the order says
 * (cb_bf16_join). Decode and every prompt tile then follow it (the AVX-512 widened split kernels,
 * kernels_avx512.h), so a prompt keeps decode's bits on such a unit. The import self-test chooses
 * the order (dispatch.h, cb_self_test); tests set it (_kernels.set_bf16_order). */
/* (The orders' codes, CB_BF16_*: int_step.h.) */
/* Their names (COLIBRI_BF16_ORDER, _kernels.BF16_ORDERS, the tools' reports). */
static const char *const cb_bf16_order_names[CB_BF16_ORDERS] = {"seq", "split-sum", "split-even", "split-odd"};
static int cb_bf16_order = CB_BF16_SEQ;

/* A split order's join of a 64-input span's even and odd partial sums into lane. */
static inline float cb_bf16_join(float lane, float even, float odd, int order) {
    switch (order) {
    case CB_BF16_SPLIT_SUM: return lane + (even + odd);
    case CB_BF16_SPLIT_EVEN: return (lane + even) + odd;
    default: return (lane + odd) + even;
    }
}

/* products: 0 widened (acts.x, exact), else bf16 products (acts.xb) in order cb_bf16_order. */
static void cb_itile_bf16_lanes(float *out, int ldo, const char *w, const cb_act_q8 *acts, int cols, int g0,
                                int g1, int n, int products) {
    const int units = cols / 4;                          /* vectors of 4 inputs, over all blocks */
    const size_t row = (size_t)(cols / CB_QBLOCK) * sizeof(cb_igroup_bf16);
    for (int g = g0; g < g1; g++) {
        const uint16_t (*vec)[CB_TGROUP][4] = (const uint16_t (*)[CB_TGROUP][4])(w + (size_t)g * row);
        for (int r = 0; r < CB_TGROUP; r++)
            for (int t = 0; t < n; t++) {
                float lane[2] = {0.0f, 0.0f};
                if (products && cb_bf16_order != CB_BF16_SEQ) {
                    for (int c0 = 0; c0 < units; c0 += CB_BF16_SPLIT_INPUTS / 4)
                        for (int p = 0; p < 2; p++) {
                            float even = 0.0f, odd = 0.0f;
                            for (int c = c0; c < units && c < c0 + CB_BF16_SPLIT_INPUTS / 4; c++) {
                                const int i = 4 * c + 2 * p;
                                even = fmaf(cb_bf16_to_f32(vec[c][r][2 * p + 1]), cb_bf16_to_f32(acts[t].xb[i + 1]), even);
                                odd = fmaf(cb_bf16_to_f32(vec[c][r][2 * p]), cb_bf16_to_f32(acts[t].xb[i]), odd);
                            }
                            lane[p] = cb_bf16_join(lane[p], even, odd, cb_bf16_order);
                        }
                    out[(size_t)t * ldo + g * CB_TGROUP + r] = lane[0] + lane[1];
                    continue;
                }
                for (int c = 0; c < units; c++)
                    for (int p = 0; p < 2; p++) {
                        const int i = 4 * c + 2 * p;
                        const float w0 = cb_bf16_to_f32(vec[c][r][2 * p]), w1 = cb_bf16_to_f32(vec[c][r][2 * p + 1]);
                        if (products) {
                            lane[p] = fmaf(w1, cb_bf16_to_f32(acts[t].xb[i + 1]), lane[p]);
                            lane[p] = fmaf(w0, cb_bf16_to_f32(acts[t].xb[i]), lane[p]);
                        } else {
                            lane[p] = fmaf(w0, acts[t].x[i], lane[p]);
                            lane[p] = fmaf(w1, acts[t].x[i + 1], lane[p]);
                        }
                    }
                out[(size_t)t * ldo + g * CB_TGROUP + r] = lane[0] + lane[1];
            }
    }
}

/* The interleaved bf16 tile of bf16 products (acts.xb): the spec of the AVX512_BF16 kernel. */
static void cb_itile_bf16x_scalar(float *out, int ldo, const char *w, int dtype, const cb_act_q8 *acts, int cols,
                                  int g0, int g1, int n) {
    (void)dtype;
    cb_itile_bf16_lanes(out, ldo, w, acts, cols, g0, g1, n, 1);
}

static void cb_itile_scalar(float *out, int ldo, const char *w, int dtype, const cb_act_q8 *acts, int cols,
                            int g0, int g1, int n) {
    if (dtype == CB_BF16) {
        cb_itile_bf16_lanes(out, ldo, w, acts, cols, g0, g1, n, 0);
        return;
    }
    const int nb = cols / CB_QBLOCK;
    const size_t gbytes = cb_group_bytes(dtype);
    for (int g = g0; g < g1; g++)
        for (int r = 0; r < CB_TGROUP; r++)
            for (int t = 0; t < n; t++) {
                const int8_t *xq = acts[t].q;
                float acc = 0.0f;
                for (int kb = 0; kb < nb; kb++) {
                    const char *grp = w + ((size_t)g * nb + kb) * gbytes;
                    int8_t q[CB_QBLOCK];
                    cb_igroup_weights(q, grp, dtype, r);
                    int32_t s_lo = 0, s_hi = 0;       /* inputs 0..15 and 16..31 */
                    for (int i = 0; i < 16; i++) s_lo += (int32_t)q[i] * (int32_t)xq[kb * CB_QBLOCK + i];
                    for (int i = 16; i < CB_QBLOCK; i++) s_hi += (int32_t)q[i] * (int32_t)xq[kb * CB_QBLOCK + i];
                    if (dtype == CB_NL4) {            /* each half its own integer scale, exactly (below 2^24:
                                                         quant.h); the row scale after (dispatch.h) */
                        int lo, hi;
                        cb_nl4_scales(((const cb_igroup_nl4 *)grp)->sc, r, &lo, &hi);
                        acc += (float)(s_lo * lo + s_hi * hi) * acts[t].d[kb];
                    } else {
                        acc += cb_igroup_scale(grp, dtype, r) * acts[t].d[kb] * (float)(s_lo + s_hi);
                    }
                }
                out[(size_t)t * ldo + g * CB_TGROUP + r] = acc;
            }
}

/* ---- elementwise ---------------------------------------------------------------------------- */

/* out[n] = x[n] / rms(x) * weight[n]; weight may be NULL (no scale). The mean of squares is
 * accumulated in double so the result does not depend on summation order. */
static void cb_rmsnorm(float *out, const float *x, const float *weight, int n, float eps) {
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * (double)x[i];
    float inv = 1.0f / sqrtf((float)(ss / n) + eps);
    if (weight) {
        for (int i = 0; i < n; i++) out[i] = weight[i] * (x[i] * inv);
    } else {
        for (int i = 0; i < n; i++) out[i] = x[i] * inv;
    }
}

static inline void cb_add(float *acc, const float *x, int n) {
    for (int i = 0; i < n; i++) acc[i] += x[i];
}

static inline void cb_axpy(float *acc, float a, const float *x, int n) {
    for (int i = 0; i < n; i++) acc[i] += a * x[i];
}

static inline void cb_clip(float *x, float limit, int n) {
    for (int i = 0; i < n; i++) x[i] = x[i] > limit ? limit : (x[i] < -limit ? -limit : x[i]);
}

static inline float cb_silu(float x) { return x / (1.0f + expf(-x)); }

/* GELU, tanh approximation (torch's gelu(approximate="tanh"), "gelu_pytorch_tanh"). */
static inline float cb_gelu_tanh(float x) {
    const float k = 0.7978845608028654f;          /* sqrt(2 / pi) */
    return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}


/* gpt-oss's clamped SwiGLU, in place: gate = min(gate, limit), up = clamp(up, -limit, limit),
 * gate = (up + 1) * gate * sigmoid(alpha * gate). Its experts have biases, so it is never fused
 * into a product (cb_matjob.glu_up): the engine calls it after adding them, on every tier. */
static inline void cb_glu_clamped(float *gate, const float *up, int n, float alpha, float limit) {
    for (int i = 0; i < n; i++) {
        float g = gate[i] < limit ? gate[i] : limit;
        float u = up[i] > limit ? limit : (up[i] < -limit ? -limit : up[i]);
        gate[i] = (u + 1.0f) * (g / (1.0f + expf(-alpha * g)));
    }
}

/* gate[n] = act(gate[n]) * up[n] (SwiGLU / GeGLU), in place: the scalar tier's; cb_glu in
 * dispatch.h calls the current tier's. */
static inline void cb_glu_scalar(float *gate, const float *up, int n, int act) {
    if (act == CB_ACT_GELU_TANH) {
        for (int i = 0; i < n; i++) gate[i] = cb_gelu_tanh(gate[i]) * up[i];
    } else {
        for (int i = 0; i < n; i++) gate[i] = cb_silu(gate[i]) * up[i];
    }
}

static inline void cb_scale(float *x, float a, int n) {
    for (int i = 0; i < n; i++) x[i] *= a;
}

/* x = cap * tanh(x / cap): Gemma's final logit soft-capping. */
static inline void cb_softcap(float *x, float cap, int n) {
    for (int i = 0; i < n; i++) x[i] = tanhf(x[i] / cap) * cap;
}

/* A softmax's exponentials in place, x[i] = exp(x[i] - max x), and *inv = 1 / their sum; returns
 * 0, or -1 when x holds NaN/inf (x untouched, *inv = 1). q8 attention weighs its values by these
 * and multiplies each output by *inv once at the end (cb_attend_head): one pass over the scores
 * fewer than normalising them. */
static int cb_softmax_unnormalized(float *x, int n, float *inv) {
    float mx = x[0];
    *inv = 1.0f;
    for (int i = 0; i < n; i++) {
        if (isnan(x[i])) return -1;               /* a NaN never wins the comparison below */
        mx = x[i] > mx ? x[i] : mx;
    }
    if (!isfinite(mx)) return -1;
    float sum = 0.0f;
    for (int i = 0; i < n; i++) { x[i] = expf(x[i] - mx); sum += x[i]; }
    *inv = 1.0f / sum;
    return 0;
}

/* In-place softmax over x[n]; returns 0, or -1 when x holds NaN/inf (nothing is normalised). */
static int cb_softmax(float *x, int n) {
    float inv;
    if (cb_softmax_unnormalized(x, n, &inv)) return -1;
    for (int i = 0; i < n; i++) x[i] *= inv;
    return 0;
}

/* q8 attention's last step: each of NH output heads o[i] [head_dim] times inv[i] (1 / its softmax's
 * sum). One multiply an element: every tier's bits. */
static inline void cb_q8_scale_outputs(float *const *o, const float *inv, int head_dim, int NH) {
    for (int i = 0; i < NH; i++)
        for (int d = 0; d < head_dim; d++) o[i][d] *= inv[i];
}

/* q8 attention. A query head is quantized as cb_kv_store_q8 stores a cache row (scale d_q =
 * max |q| / 127, codes round(q / d_q)); the score of a key row with scale d_k and codes k is
 *     s = ((float)(sum_d q_d k_d) x d_k) x (d_q x scale)
 * — the integer sum exact (|sum| <= 127 x 127 x CB_KV_Q8_MAX_HEAD_DIM < 2^24, so its float too),
 * then two roundings, in this order on every tier — so a score has the same bits however a tier
 * sums the products (vpmaddubsw, vpdpbusd, in rows or transposed), and a prompt equals decoding it.
 * The values go in groups of CB_Q8_VGROUP positions aligned to multiples of it (the group of
 * position P starts at P - P % 32, whatever the query's span): position t of the group weighs
 * w_t = e_t x d_v (its softmax exponential exp(s_t - max s), not yet divided by their sum, times
 * its row's scale, one rounding; 0 outside the query's span), the group's weights become int16
 * codes wq_t = round(w_t x 32767 / max w), and each output column adds
 * (float)(sum_t wq_t x code_t) x (max w / 32767) (cb_q8_group_scale), the groups in order, and is
 * multiplied by 1 / (the exponentials' sum) at the end (cb_softmax_unnormalized) — the integer sum
 * exact (32 x 32767 x 127 < 2^31), so vpmaddwd or vpdpwssd over position pairs give its bits in any
 * order. (A weight's error is at most g / 2: 1 / 65534 of the group's largest.) A NaN or infinite
 * query, row or weight gives NaN scores or outputs, as with f32. The quantized query head: its
 * codes zero-padded to cb_q8_qlen bytes (a whole number of 64-byte vectors; the padding
 * multiplies whatever the key rows hold there by 0) and: */
typedef struct {
    int32_t bias;       /* -128 x the sum of the codes: vpdpbusd multiplies key bytes as unsigned
                           (code + 128), so a sum starts here to be the codes' own */
    float qs;           /* d_q x the attention's scale */
} cb_q8_query;
#define CB_Q8_QALIGN 64
static inline int cb_q8_qlen(int head_dim) { return (head_dim + CB_Q8_QALIGN - 1) / CB_Q8_QALIGN * CB_Q8_QALIGN; }

static void cb_kv_store_q8(void *dst, const float *src, int n);

/* A query head stored as a q8 row (by the tier's store: the same bytes) into codes
 * [cb_q8_qlen(head_dim)] and m. */
static inline void cb_q8_query_from_row(int8_t *codes, cb_q8_query *m, const char *row, int head_dim, float scale) {
    float d;
    int32_t sum = 0;
    memcpy(&d, row, sizeof d);
    memcpy(codes, row + CB_KV_Q8_SCALE_BYTES, (size_t)head_dim);
    memset(codes + head_dim, 0, (size_t)(cb_q8_qlen(head_dim) - head_dim));
    for (int i = 0; i < head_dim; i++) sum += codes[i];
    m->bias = -128 * sum;
    m->qs = d * scale;
}

/* Quantize query head qh [head_dim] into codes [cb_q8_qlen(head_dim)] and m. */
static inline void cb_q8_query_quantize(int8_t *codes, cb_q8_query *m, const float *qh, int head_dim, float scale) {
    char row[CB_KV_Q8_SCALE_BYTES + CB_KV_Q8_MAX_HEAD_DIM];
    cb_kv_store_q8(row, qh, head_dim);
    cb_q8_query_from_row(codes, m, row, head_dim, scale);
}

/* A q8 row's scale (its first 4 bytes). */
static inline float cb_kv_q8_scale(const char *row) {
    float d;
    memcpy(&d, row, sizeof d);
    return d;
}

/* A value group's positions (and so a q8 prompt block's alignment), its weights' int16 top, and
 * the largest weight below which a group adds nothing (a weight is a probability times a row's
 * scale: a whole group under 2^-100 is positions the query does not attend, or values that small). */
#define CB_Q8_VGROUP 32
#define CB_Q8_WMAX 32767.0f
#define CB_Q8_WTINY 0x1p-100f

/* A value group's scales from its largest weight and whether a weight was NaN: its outputs add
 * sum x g, its weights are coded round(w x inv). g NaN and inv 0 (outputs NaN) where a weight is
 * NaN or infinite; g = inv = 0 where the largest is below CB_Q8_WTINY; else g = wmax / 32767,
 * inv = 32767 / wmax (finite: wmax >= 2^-100). */
typedef struct {
    float g, inv;
} cb_q8_wscale;
static inline cb_q8_wscale cb_q8_group_scale(float wmax, int nan) {
    cb_q8_wscale s = {0.0f, 0.0f};
    if (nan || !isfinite(wmax)) s.g = NAN;
    else if (wmax >= CB_Q8_WTINY) {
        s.g = wmax / CB_Q8_WMAX;
        s.inv = CB_Q8_WMAX / wmax;
    }
    return s;
}

/* A weight's int16 code: round(w x inv) to nearest even, at most 32767 (0 where inv is 0). */
static inline int32_t cb_q8_weight_code(float w, float inv) {
    if (!(inv > 0.0f)) return 0;
    const long r = lrintf(w * inv);
    return (int32_t)(r > 32767 ? 32767 : r);
}

/* The score's float part from the exact integer sum: every tier's. */
static inline float cb_q8_score_from_sum(int32_t sum, float d_k, float qs) { return ((float)sum * d_k) * qs; }

/* The spec of one score: query codes qc against key row krow. */
static inline float cb_q8_score(const int8_t *qc, float qs, const char *krow, int head_dim) {
    const int8_t *kc = (const int8_t *)(const void *)(krow + CB_KV_Q8_SCALE_BYTES);
    int32_t sum = 0;
    for (int d = 0; d < head_dim; d++) sum += (int32_t)qc[d] * kc[d];
    return cb_q8_score_from_sum(sum, cb_kv_q8_scale(krow), qs);
}

/* Head h of the query at `pos`, attending positions start..pos: out [head_dim], sc [>= pos-start+2].
 * sinks [n_heads] or NULL: head h's sink logit joins the softmax (in sc[n]) and takes no value.
 * The caches hold kv (CB_KV_*) elements; dot multiplies a key row of that type (f32, f16) by the
 * query; q8 takes cb_q8_score. */
static inline void cb_attend_head(float *out, const float *q, const void *k_cache, const void *v_cache,
                                  float *sc, int h, int kvh, int head_dim, int start,
                                  int pos, int ring, float scale, const float *sinks, cb_dot_fn dot, int kv) {
    const float *qh = q + (size_t)h * head_dim;
    const size_t rbytes = cb_kv_row_bytes(head_dim, kv);
    int8_t qc[CB_KV_Q8_MAX_HEAD_DIM];           /* the query head's codes (q8) */
    cb_q8_query qm = {0, 0.0f};
    if (kv == CB_KV_Q8) cb_q8_query_quantize(qc, &qm, qh, head_dim, scale);
    int n = pos - start + 1;
    int row0 = start % ring;                     /* the cache row of position start; rows wrap */
    for (int t = 0, row = row0; t < n; t++, row = row + 1 == ring ? 0 : row + 1) {
        const char *kt = (const char *)k_cache + ((size_t)kvh * ring + row) * rbytes;
        sc[t] = kv == CB_KV_Q8 ? cb_q8_score(qc, qm.qs, kt, head_dim) : dot(kt, qh, NULL, head_dim) * scale;
    }
    if (sinks) sc[n] = sinks[h];
    float inv = 1.0f;                            /* q8: 1 / the exponentials' sum, applied at the end */
    if (kv == CB_KV_Q8) cb_softmax_unnormalized(sc, n + (sinks != NULL), &inv);
    else cb_softmax(sc, n + (sinks != NULL));
    float *oh = out + (size_t)h * head_dim;
    memset(oh, 0, sizeof(float) * (size_t)head_dim);
    if (kv == CB_KV_Q8) {                        /* groups of CB_Q8_VGROUP positions, int16 weights */
        int32_t isum[CB_KV_Q8_MAX_HEAD_DIM];
        for (int g0 = start - start % CB_Q8_VGROUP; g0 <= pos; g0 += CB_Q8_VGROUP) {
            float w[CB_Q8_VGROUP], wmax = 0.0f;
            int nan = 0;
            for (int k = 0; k < CB_Q8_VGROUP; k++) {
                const int p = g0 + k;
                w[k] = p < start || p > pos ? 0.0f
                     : sc[p - start] * cb_kv_q8_scale((const char *)v_cache + ((size_t)kvh * ring + p % ring) * rbytes);
                nan |= isnan(w[k]);
                wmax = w[k] > wmax ? w[k] : wmax;
            }
            const cb_q8_wscale ws = cb_q8_group_scale(wmax, nan);
            memset(isum, 0, sizeof(int32_t) * (size_t)head_dim);
            for (int k = 0; k < CB_Q8_VGROUP; k++) {
                const int32_t wq = g0 + k < start || g0 + k > pos ? 0 : cb_q8_weight_code(w[k], ws.inv);
                if (!wq) continue;
                const int8_t *c = (const int8_t *)(const void *)((const char *)v_cache + ((size_t)kvh * ring + (g0 + k) % ring) * rbytes + CB_KV_Q8_SCALE_BYTES);
                for (int d = 0; d < head_dim; d++) isum[d] += wq * c[d];
            }
            for (int d = 0; d < head_dim; d++) oh[d] += (float)isum[d] * ws.g;
        }
        cb_q8_scale_outputs(&oh, &inv, head_dim, 1);
        return;
    }
    for (int t = 0, row = row0; t < n; t++, row = row + 1 == ring ? 0 : row + 1) {
        const char *vt = (const char *)v_cache + ((size_t)kvh * ring + row) * rbytes;
        if (kv == CB_KV_F16)
            for (int d = 0; d < head_dim; d++) oh[d] += sc[t] * cb_f16_table[((const uint16_t *)vt)[d]];
        else
            cb_axpy(oh, sc[t], (const float *)vt, head_dim);
    }
}

/* f32 -> f16, round to nearest even (as F16C's vcvtps2ph with _MM_FROUND_TO_NEAREST_INT and
 * numpy's astype(float16)): overflow to infinity, NaN stays NaN, subnormals kept. */
static inline uint16_t cb_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, abs = x & 0x7FFFFFFFu;
    if (abs > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((abs >> 13) & 0x3FFu));   /* NaN */
    if (abs >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);        /* rounds past 65504: inf */
    if (abs < 0x38800000u) {                                          /* an f16 subnormal (or 0) */
        if (abs < 0x33000000u) return (uint16_t)sign;                 /* below half the smallest */
        const uint32_t m = (abs & 0x7FFFFFu) | 0x800000u, shift = 126u - (abs >> 23);
        uint32_t r = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        r += rem > half || (rem == half && (r & 1u));
        return (uint16_t)(sign | r);
    }
    uint32_t r = (abs - 0x38000000u) >> 13;                           /* rebias 127 -> 15 */
    const uint32_t rem = abs & 0x1FFFu;
    r += rem > 0x1000u || (rem == 0x1000u && (r & 1u));
    return (uint16_t)(sign | r);
}

/* A q8 cache row (CB_KV_Q8) of n floats: d = max |x| / 127, codes lrintf(x / d) (round to nearest
 * even; all 0 where d is 0). A row holding NaN or infinity stores d = NaN or infinity and codes 0,
 * so it reads back as NaN and the engine's finiteness check sees it, as with an f32 cache. (A row
 * below 127 x FLT_MIN has a subnormal scale and reads back within 127 x FLT_MIN.) The AVX2 and
 * AVX-512 tiers store the same bytes with 8 lanes (cb_kv_store_q8_avx2). */
static void cb_kv_store_q8(void *dst, const float *src, int n) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) {
        const float a = fabsf(src[i]);
        if (!(a <= amax)) amax = a;              /* NaN wins, and stays */
        if (isnan(amax)) break;
    }
    const float d = amax / 127.0f;
    int8_t *c = (int8_t *)dst + CB_KV_Q8_SCALE_BYTES;
    memcpy(dst, &d, sizeof d);
    for (int i = 0; i < n; i++) {
        const long r = d > 0.0f && isfinite(d) ? lrintf(src[i] / d) : 0;
        c[i] = (int8_t)(r > 127 ? 127 : r < -127 ? -127 : r);
    }
}

/* Store n floats into a cache row of kv (CB_KV_*) elements. */
static void cb_kv_store_scalar(void *dst, const float *src, int n, int kv) {
    if (kv == CB_KV_Q8)
        cb_kv_store_q8(dst, src, n);
    else if (kv == CB_KV_F16)
        for (int i = 0; i < n; i++) ((uint16_t *)dst)[i] = cb_f32_to_f16(src[i]);
    else
        memcpy(dst, src, sizeof(float) * (size_t)n);
}

/* Attention of one query at `pos` for query heads h0 .. h0 + nh - 1 (nh <= the table's attend_heads), which all read
 * KV head kvh (grouped-query attention), over positions start..pos whose keys and values live in
 * row p % ring of the caches [n_kv_heads, ring, head_dim]; q [n_heads, head_dim] roped, out [n_heads,
 * head_dim], scores: a row of >= pos - start + 2 floats per head, sc_stride apart; sinks [n_heads]
 * or NULL: attention sinks (gpt-oss), one logit per head in the softmax's denominator, no value.
 * Every tier implements this; prefill and decode both come through it, so they agree bit for bit. */
typedef void (*cb_attend_fn)(float *out, const float *q, const void *k_cache, const void *v_cache, float *scores,
                             int sc_stride, int h0, int nh, int kvh, int head_dim, int start, int pos,
                             int ring, float scale, const float *sinks, int kv);
typedef void (*cb_kv_store_fn)(void *dst, const float *src, int n, int kv);

/* The attention's query heads per unit of work where a tier has no wider kernel: decode's
 * (cb_attend_fn's nh, cb_kernel_table.attend_heads / attend_heads_q8) and a prompt block's
 * (cb_attend_block_fn's nh, cb_kernel_table.attend_block_heads). The wider kernels take 8
 * (CB_ATTN_HEADS_WIDE, a KV head of Qwen3-MoE or gpt-oss at once: the AVX-512 tier's, and the AVX2
 * tier's decode over a q8 cache). A prompt block's scores have CB_ATTN_BLOCK_HEADS_MAX rows a
 * query whatever the tier takes. */
#define CB_ATTN_HEADS 4
#define CB_ATTN_BLOCK_HEADS_MAX 8

/* A prompt's queries go to cb_kt.attend_block CB_ATTN_QBLOCK at a time (its nq never exceeds it):
 * the block's cache rows are read from memory once for all of them (one query at a time read a
 * query's whole span each). */
#define CB_ATTN_QBLOCK 8

/* The first position a query at `pos` attends: pos - window + 1 in a sliding-window layer
 * (window > 0), else 0. */
static inline int cb_window_start(int pos, int window) {
    return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

/* A prompt's block of nq queries at positions pos0.. for the query heads h0 .. h0 + nh - 1 of KV
 * head kvh, each query's span as cb_window_start gives it (window 0: from position 0): q [nq, ldq]
 * and out [nq, ldo] rows as cb_attend_fn's q and out; scores: rows [nq * CB_ATTN_BLOCK_HEADS_MAX] of
 * sc_stride floats, query j's head h0 + i in row j * CB_ATTN_BLOCK_HEADS_MAX + i. Each query's result is exactly the
 * tier's cb_attend_fn's for it (the tiers turn the loops so that cache rows serve the whole block). */
typedef void (*cb_attend_block_fn)(float *out, int ldo, const float *q, int ldq, int nq, const void *k_cache,
                                   const void *v_cache, float *scores, int sc_stride, int h0, int nh, int kvh,
                                   int head_dim, int pos0, int window, int ring, float scale, const float *sinks,
                                   int kv);

static void cb_attend_heads_scalar(float *out, const float *q, const void *k_cache, const void *v_cache,
                                   float *scores, int sc_stride, int h0, int nh, int kvh,
                                   int head_dim, int start, int pos, int ring, float scale, const float *sinks,
                                   int kv) {
    for (int h = h0; h < h0 + nh; h++)
        cb_attend_head(out, q, k_cache, v_cache, scores + (size_t)h * sc_stride, h, kvh, head_dim, start,
                       pos, ring, scale, sinks, kv == CB_KV_F16 ? cb_dot_f16_scalar : cb_dot_f32_scalar, kv);
}

/* cb_attend_block_fn's spec: the queries one after another, as decoding them. */
static void cb_attend_block_scalar(float *out, int ldo, const float *q, int ldq, int nq, const void *k_cache,
                                   const void *v_cache, float *scores, int sc_stride, int h0, int nh, int kvh,
                                   int head_dim, int pos0, int window, int ring, float scale, const float *sinks,
                                   int kv) {
    for (int j = 0; j < nq; j++)
        for (int h = h0; h < h0 + nh; h++)
            cb_attend_head(out + (size_t)j * ldo, q + (size_t)j * ldq, k_cache, v_cache,
                           scores + ((size_t)j * CB_ATTN_BLOCK_HEADS_MAX + h - h0) * sc_stride, h, kvh, head_dim,
                           cb_window_start(pos0 + j, window), pos0 + j, ring, scale, sinks,
                           kv == CB_KV_F16 ? cb_dot_f16_scalar : cb_dot_f32_scalar, kv);
}

/* Rotary embedding, "rotate half" convention (Hugging Face) over the first rot_dim values of each
 * head (rot_dim = head_dim: all of them; less: transformers' partial_rotary_factor): element i
 * pairs with i + rot_dim/2. cos/sin hold [rot_dim/2] values for the current position. */
static void cb_rope(float *v, int n_heads, int head_dim, int rot_dim, const float *cos_t, const float *sin_t) {
    int half = rot_dim / 2;                     /* pairs (i, i + rot_dim / 2); values past rot_dim pass */
    for (int h = 0; h < n_heads; h++) {
        float *p = v + (size_t)h * head_dim;
        for (int i = 0; i < half; i++) {
            float a = p[i], b = p[i + half];
            p[i] = a * cos_t[i] - b * sin_t[i];
            p[i + half] = b * cos_t[i] + a * sin_t[i];
        }
    }
}

/* 1 when every x[i] is finite, else 0. */
static int cb_all_finite(const float *x, int n) {
    for (int i = 0; i < n; i++) if (!isfinite(x[i])) return 0;
    return 1;
}

#endif /* COLIBRI_KERNELS_SCALAR_H */
