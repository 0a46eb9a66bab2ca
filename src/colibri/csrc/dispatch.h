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

typedef struct {
    int isa;                        /* CB_ISA_* */
    cb_dot_fn dot[CB_N_DTYPES];     /* indexed by CB_F32 .. CB_INT4 */
} cb_kernel_table;

static cb_kernel_table cb_kt;
static cb_cpu_features cb_cpu;

/* Fill cb_kt for `isa`; returns -1 if this CPU/OS cannot run it (cb_kt unchanged). */
static int cb_select_isa(int isa) {
    cb_kernel_table t;
    cb_cpu = cb_detect_cpu();
    if (isa > cb_best_isa(&cb_cpu)) return -1;
    t.isa = isa;
    t.dot[CB_F32] = cb_dot_f32_scalar;
    t.dot[CB_F16] = cb_dot_f16_scalar;
    t.dot[CB_BF16] = cb_dot_bf16_scalar;
    t.dot[CB_INT8] = cb_dot_int8_scalar;
    t.dot[CB_INT4] = cb_dot_int4_scalar;
#if CB_X86
    if (isa >= CB_ISA_AVX2) {
        t.dot[CB_F32] = cb_dot_f32_avx2;
        t.dot[CB_F16] = cb_dot_f16_avx2;
        t.dot[CB_BF16] = cb_dot_bf16_avx2;
        t.dot[CB_INT8] = cb_dot_int8_avx2;
        t.dot[CB_INT4] = cb_dot_int4_avx2;
    }
    if (isa >= CB_ISA_AVX512) {
        t.dot[CB_F32] = cb_dot_f32_avx512;
        t.dot[CB_F16] = cb_dot_f16_avx512;
        t.dot[CB_BF16] = cb_dot_bf16_avx512;
        if (cb_cpu.avx512_vnni) {
            t.dot[CB_INT8] = cb_dot_int8_avx512;
            t.dot[CB_INT4] = cb_dot_int4_avx512;
        }
    }
#endif
    cb_kt = t;
    return 0;
}

/* out[rows] = W[rows, cols] @ x[cols]; W stored as `dtype`, rows `cb_row_stride` bytes apart.
 * For the integer formats x is first quantized per block into `a` (scratch, >= cols). */
static void cb_matvec(float *out, const void *w, int dtype, const float *x, cb_act_q8 *a,
                      int rows, int cols, int n_threads) {
    size_t stride = cb_row_stride(dtype, cols);
    cb_dot_fn dot = cb_kt.dot[dtype];
    if (dtype == CB_INT8 || dtype == CB_INT4) cb_quantize_act_scalar(a, x, cols);
    int parallel = n_threads > 1 && (long long)rows * cols >= CB_PARALLEL_MIN_WORK;
    (void)parallel;
    #pragma omp parallel for schedule(static) num_threads(n_threads) if (parallel)
    for (int r = 0; r < rows; r++) out[r] = dot((const char *)w + (size_t)r * stride, x, a, cols);
}

/* out[t * ldo + r] = W[r, :] . x[t * ldx + :] for t < n tokens, r < rows: a matrix product that
 * reads each weight row once for all n tokens (prefill). acts[n]: per-token quantization scratch
 * for the integer formats. Each element is computed by the same dot product as cb_matvec, so a
 * batched prefill gives exactly the results of token-by-token decoding. */
static void cb_matmul(float *out, int ldo, const void *w, int dtype, const float *x, int ldx,
                      cb_act_q8 *acts, int n, int rows, int cols, int n_threads) {
    size_t stride = cb_row_stride(dtype, cols);
    cb_dot_fn dot = cb_kt.dot[dtype];
    if (dtype == CB_INT8 || dtype == CB_INT4)
        for (int t = 0; t < n; t++) cb_quantize_act_scalar(&acts[t], x + (size_t)t * ldx, cols);
    int parallel = n_threads > 1 && (long long)rows * cols * n >= CB_PARALLEL_MIN_WORK;
    (void)parallel;
    #pragma omp parallel for schedule(static) num_threads(n_threads) if (parallel)
    for (int r = 0; r < rows; r++) {
        const void *row = (const char *)w + (size_t)r * stride;
        for (int t = 0; t < n; t++) out[(size_t)t * ldo + r] = dot(row, x + (size_t)t * ldx, &acts[t], cols);
    }
}

#endif /* COLIBRI_DISPATCH_H */
