/* api.h — the C the compiled modules share: storage codes, the structs passed between them and
 * the sizes of what they store. Types, constants and a few inline size functions only: every
 * kernel body is compiled once, in colibri._kernels (dispatch.h and the tiers it includes), and
 * the router's in colibri._routing; the other modules include this header (through the .pxd
 * contracts) and call those bodies through the modules' entry points.
 */
#ifndef COLIBRI_API_H
#define COLIBRI_API_H

#include <stddef.h>
#include <stdint.h>

#include "quant.h"

/* Storage dtypes of a weight matrix (colibri._kernels.DTYPE_CODES names them). */
enum { CB_F32 = 0, CB_F16 = 1, CB_BF16 = 2, CB_INT8 = 3, CB_INT4 = 4, CB_MXFP4 = 5, CB_NL4 = 6, CB_INT6 = 7, CB_N_DTYPES = 8 };

/* Layouts of a stored matrix (kernels_scalar.h explains each). */
enum { CB_ROWS = 0, CB_TRANSPOSED = 1, CB_INTERLEAVED = 2, CB_N_LAYOUTS = 3 };   /* colibri._kernels.LAYOUT_CODES */

/* The FFN gate's activation. */
enum { CB_ACT_SILU = 0, CB_ACT_GELU_TANH = 1, CB_ACT_SWIGLU_CLAMPED = 2 };   /* config.HIDDEN_ACTS */

/* Bytes of one row of `cols` weights in `dtype` (int8/int4/mxfp4: cols % 32 == 0; nl4, which has
 * no rows layout: 0, see cb_nl4_bytes; int6, which has none either: its interleaved matrix's bytes
 * over its rows). */
static inline size_t cb_row_stride(int dtype, int cols) {
    switch (dtype) {
    case CB_NL4: return 0;
    case CB_F32: return (size_t)cols * 4;
    case CB_F16: case CB_BF16: return (size_t)cols * 2;
    case CB_INT8: return (size_t)(cols / CB_QBLOCK) * sizeof(cb_block_int8);
    case CB_MXFP4: return (size_t)(cols / CB_QBLOCK) * sizeof(cb_block_mxfp4);
    case CB_INT6: return (size_t)(cols / CB_QBLOCK) * (sizeof(cb_igroup_int6) / CB_TGROUP);
    default: return (size_t)(cols / CB_QBLOCK) * sizeof(cb_block_int4);
    }
}

/* The zero of the unsigned codes the integer steps multiply, which comes off each block's sum
 * times the activations' sum s: int4 8, mxfp4 12 (cb_mxfp4_u12), int6 32, nl4 64 (cb_nl4_u64);
 * int8 128 where the step flips its codes to unsigned (flip_int8: the VNNI steps' vpdpbusd), 0
 * where it multiplies them signed (the AVX2 step's sign trick). */
static inline int32_t cb_code_offset(int dtype, int flip_int8) {
    switch (dtype) {
    case CB_INT8: return flip_int8 ? 128 : 0;
    case CB_MXFP4: return CB_MXFP4_OFFSET;
    case CB_INT6: return CB_INT6_OFFSET;
    case CB_NL4: return CB_NL4_OFFSET;
    default: return 8;
    }
}

/* Bytes of a transposed int8/int4 (or interleaved mxfp4/nl4/int6/bf16) group of 8 outputs. */
static inline size_t cb_group_bytes(int dtype) {
    return dtype == CB_INT8 ? sizeof(cb_group_int8) : dtype == CB_MXFP4 ? sizeof(cb_igroup_mxfp4)
         : dtype == CB_NL4 ? sizeof(cb_igroup_nl4) : dtype == CB_INT6 ? sizeof(cb_igroup_int6)
         : dtype == CB_BF16 ? sizeof(cb_igroup_bf16) : sizeof(cb_group_int4);
}

/* The KV cache's element types (a load option): f32, f16 (half the bytes; values rounded to
 * nearest even as they are stored, cb_kt.kv_store; read back exactly), or q8 (a quarter of f32's
 * bytes and 4 more a row: a row of head_dim values is its f32 scale d = max |x| / 127 followed by
 * head_dim int8 codes round(x / d), and stands for code * d). Attention over a q8 cache works on
 * the codes, as the peers' q8_0 caches do (kernels_scalar.h, cb_q8_score): the query head is quantized the
 * same way, a score is the exact integer dot product of the codes times the two scales, and a
 * value row adds code x (probability x its scale). */
enum { CB_KV_F32 = 0, CB_KV_F16 = 1, CB_KV_Q8 = 2 };
#define CB_KV_Q8_SCALE_BYTES 4          /* a q8 row's f32 scale, before its codes */
#define CB_KV_Q8_MAX_HEAD_DIM 1024      /* head_dim a q8 cache serves (the generic path's row buffer) */

/* Bytes of one cache row (a KV head's head_dim values at one position) of kv elements. */
static inline size_t cb_kv_row_bytes(int head_dim, int kv) {
    return kv == CB_KV_Q8 ? (size_t)head_dim + CB_KV_Q8_SCALE_BYTES : (size_t)head_dim * (kv == CB_KV_F16 ? 2 : 4);
}

/* One product of a batch (cb_matmul_jobs): out[t * ldo + r] = W[r, :] . x_t for t < n tokens,
 * r < rows, x_t = x + t * ldx; W [rows, cols] stored as dtype/layout. acts [n]: the quantization
 * scratch of the integer formats; jobs with the same input pass the same acts (quantized once).
 * Each job has its own n: the experts of one MoE step, each over the tokens routed to it. */
typedef struct {
    int n;
    float *out;
    int ldo;
    const void *w;
    int dtype;
    int layout;       /* CB_ROWS / CB_TRANSPOSED / CB_INTERLEAVED */
    int rows;
    int cols;
    const float *x;
    int ldx;
    cb_act_q8 *acts;
    const float *glu_up;  /* or NULL: then out = act(out) * glu_up (same ldo) over this job's rows, */
    int glu_act;          /* in the same region: the up product must come earlier in the batch */
} cb_matjob;

/* The most experts a token may choose (routing.h). */
#define CB_MAX_TOP_K 64

#endif /* COLIBRI_API_H */
