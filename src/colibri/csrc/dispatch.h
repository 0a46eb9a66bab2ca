/* dispatch.h — the kernel table, chosen once at import, and the matvec built on it.
 *
 * cb_select_isa() fills cb_kt with the dot products of one tier (scalar, avx2, avx512). The
 * rest of the engine only calls through cb_kt, so forcing a tier (COLIBRI_ISA) changes every
 * kernel at once and nothing else.
 */
#ifndef COLIBRI_DISPATCH_H
#define COLIBRI_DISPATCH_H

#include "cpu.h"
#include "kernels_scalar.h"
#include "kernels_avx2.h"
#include "kernels_avx512.h"

/* out[j * ldo + i] = row i . token j for an R x T tile (R <= tile_rows, T in 1..4), rows `stride`
 * bytes apart; x/ldx for the float formats, acts for the integer ones. */
typedef void (*cb_tile_fn)(float *out, int ldo, const char *w, size_t stride, int dtype, const float *x,
                           int ldx, const cb_act_q8 *acts, int cols, int R, int T);

typedef struct {
    int isa;                        /* CB_ISA_* */
    void (*quantize)(cb_act_q8 *a, const float *x, int n);   /* activations for int8/int4 */
    cb_dot_fn dot[CB_N_DTYPES];     /* indexed by CB_F32 .. CB_INT4 */
    cb_tile_fn tile[CB_N_DTYPES];   /* NULL: this tier multiplies row by row with dot */
    int tile_rows[CB_N_DTYPES];     /* rows per tile (the tail goes one row at a time) */
    int decode_dot[CB_N_DTYPES];    /* 1: dot is the tile's arithmetic for one token, and decode
                                       calls it row by row (a 4-argument call per row instead of
                                       the tile's 11: AVX2 int4 decode 10 % faster) */
} cb_kernel_table;

static cb_kernel_table cb_kt;
static cb_cpu_features cb_cpu;

/* Fill cb_kt for `isa`; returns -1 if this CPU/OS cannot run it (cb_kt unchanged). */
static int cb_select_isa(int isa) {
    cb_kernel_table t;
    cb_cpu = cb_detect_cpu();
    if (isa > cb_best_isa(&cb_cpu)) return -1;
    t.isa = isa;
    t.quantize = cb_quantize_act_scalar;
    t.dot[CB_F32] = cb_dot_f32_scalar;
    t.dot[CB_F16] = cb_dot_f16_scalar;
    t.dot[CB_BF16] = cb_dot_bf16_scalar;
    t.dot[CB_INT8] = cb_dot_int8_scalar;
    t.dot[CB_INT4] = cb_dot_int4_scalar;
    for (int d = 0; d < CB_N_DTYPES; d++) { t.tile[d] = NULL; t.tile_rows[d] = 1; t.decode_dot[d] = 0; }
#if CB_X86
    if (isa >= CB_ISA_AVX2) {
        t.dot[CB_F32] = cb_dot_f32_avx2;
        t.dot[CB_F16] = cb_dot_f16_avx2;
        t.dot[CB_BF16] = cb_dot_bf16_avx2;
        t.dot[CB_INT8] = cb_dot_int8_avx2;
        t.dot[CB_INT4] = cb_dot_int4_avx2;
        t.quantize = cb_quantize_act_avx2;
        /* tiles of one row and up to 4 tokens: the weights are loaded once for 4 prompt tokens */
        t.tile[CB_F32] = t.tile[CB_F16] = t.tile[CB_BF16] = cb_tile_float_avx2_any;
        t.tile[CB_INT8] = t.tile[CB_INT4] = cb_tile_quant_avx2_any;
        for (int d = 0; d < CB_N_DTYPES; d++) t.decode_dot[d] = 1;     /* the AVX2 dots are tiles of T = 1 */
    }
    if (isa >= CB_ISA_AVX512) {
        t.tile[CB_F32] = t.tile[CB_F16] = t.tile[CB_BF16] = cb_tile_float_avx512_any;
        t.decode_dot[CB_F32] = t.decode_dot[CB_F16] = t.decode_dot[CB_BF16] = 0;
        t.tile_rows[CB_F32] = t.tile_rows[CB_F16] = t.tile_rows[CB_BF16] = 4;
        if (cb_cpu.avx512_vnni) {
            t.tile[CB_INT8] = t.tile[CB_INT4] = cb_tile_quant_avx512_any;
            t.decode_dot[CB_INT8] = t.decode_dot[CB_INT4] = 0;
            t.tile_rows[CB_INT8] = t.tile_rows[CB_INT4] = 2;
        }
    }
#endif
    cb_kt = t;
    return 0;
}

/* The shared body of matvec and matmul: out[t * ldo + r] = W[r, :] . x[t * ldx + :] for t < n,
 * r < rows, W stored as `dtype` with rows cb_row_stride bytes apart. Integer formats quantize
 * each token's activation per block into acts[t] first. Rows are split over threads. With a tile
 * kernel, rows go tile_rows at a time and tokens 4 at a time (decode: one row, or the dot
 * product where it is the tile's arithmetic); otherwise one dot product per element. Either way
 * an element's arithmetic does not depend on n, so a prompt processed in one matmul gives exactly
 * the logits of token-by-token decoding. */
static void cb_matmul(float *out, int ldo, const void *w, int dtype, const float *x, int ldx,
                      cb_act_q8 *acts, int n, int rows, int cols, int n_threads) {
    size_t stride = cb_row_stride(dtype, cols);
    cb_dot_fn dot = cb_kt.dot[dtype];
    cb_tile_fn tile = cb_kt.tile[dtype];
    const char *wb = (const char *)w;
    if (dtype == CB_INT8 || dtype == CB_INT4)
        for (int t = 0; t < n; t++) cb_kt.quantize(&acts[t], x + (size_t)t * ldx, cols);
#if CB_X86
    if (dtype == CB_BF16 && cb_kt.isa >= CB_ISA_AVX512 && tile && acts[0].xp)   /* the AVX-512 bf16 tile */
        for (int t = 0; t < n; t++) cb_permute_bf16(acts[t].xp, x + (size_t)t * ldx, cols);
#endif
    int parallel = n_threads > 1 && (long long)rows * cols * n >= CB_PARALLEL_MIN_WORK;
    (void)parallel;
    if (tile && !(n == 1 && cb_kt.decode_dot[dtype])) {
        int TR = cb_kt.tile_rows[dtype];
        /* decode: one row per tile (one weight stream per thread) measured fastest for every
         * format: 2 or 4 rows at once cut int8 from 26 to 10-24 GB/s, bf16 from 23 to 16-19 */
        if (n == 1) TR = 1;
        int groups = (rows + TR - 1) / TR;
        #pragma omp parallel for schedule(static) num_threads(n_threads) if (parallel)
        for (int g = 0; g < groups; g++) {
            int r0 = g * TR;
            int R = rows - r0 >= TR ? TR : 1;        /* a full group, or the tail row by row */
            for (int r = r0; r < rows && r < r0 + TR; r += R) {
                for (int t = 0; t < n; t += 4) {
                    int T = n - t < 4 ? n - t : 4;
                    tile(out + (size_t)t * ldo + r, ldo, wb + (size_t)r * stride, stride, dtype,
                         x + (size_t)t * ldx, ldx, acts + t, cols, R, T);
                }
            }
        }
        return;
    }
    #pragma omp parallel for schedule(static) num_threads(n_threads) if (parallel)
    for (int r = 0; r < rows; r++) {
        const void *row = wb + (size_t)r * stride;
        for (int t = 0; t < n; t++) out[(size_t)t * ldo + r] = dot(row, x + (size_t)t * ldx, &acts[t], cols);
    }
}

/* The current tier's activation quantization (for the tests). */
static void cb_quantize_act(cb_act_q8 *a, const float *x, int n) { cb_kt.quantize(a, x, n); }

/* out[rows] = W[rows, cols] @ x[cols] (decode); `a` is the activation quantization scratch. */
static void cb_matvec(float *out, const void *w, int dtype, const float *x, cb_act_q8 *a,
                      int rows, int cols, int n_threads) {
    cb_matmul(out, rows, w, dtype, x, cols, a, 1, rows, cols, n_threads);
}

#endif /* COLIBRI_DISPATCH_H */
