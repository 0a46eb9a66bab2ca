/* int_step.h — what an int step is, for the modules that build or install one: the entry types of
 * the integer group kernels, the steps' codes, and the kernels a step gives the table. Types and
 * constants only. The kernel module (dispatch.h) builds the production steps; the probes
 * (test_steps.h) build the test steps — the VNNI step emulated in AVX2, the AMX tiles emulated in
 * C, a step's kernel made to miscompute — and install them through the kernel module's entry point
 * (cb_install_int_step), so the table production runs use carries none of them.
 */
#ifndef COLIBRI_INT_STEP_H
#define COLIBRI_INT_STEP_H

#include "api.h"
#include "amx_types.h"           /* the AMX body's packed blocks */

/* Transposed tile: out[j * ldo + o] = W[o, :] . token j for outputs o in [o0, o1) and tokens
 * j < T (x + j * ldx for the float formats, acts[j] for the integer ones); W has `rows` outputs and
 * `cols` inputs, stored transposed. Integer formats: o0 and o1 multiples of 8 (whole groups),
 * except o1 == rows. Every tier implements this signature (SIMD tiers for T <= 4). */
typedef void (*cb_ttile_fn)(float *out, int ldo, const char *w, int dtype, const float *x, int ldx,
                            const cb_act_q8 *acts, int rows, int cols, int o0, int o1, int T);

/* out[t * ldo + o] for outputs [o0, o1) (whole groups) and n tokens of a transposed int8/int4
 * matrix, through `scratch` (cb_tprefill_bytes; `first`: the job's first chunk, which also fills
 * the scratch's activation sums): the same bits as the ttile. */
typedef void (*cb_tprefill_fn)(float *out, int ldo, const char *w, int dtype, const cb_act_q8 *acts, int rows,
                               int cols, int o0, int o1, int n, uint8_t *scratch, int first);

/* Interleaved tile (int8/int4/mxfp4/nl4/int6/bf16, quant.h): out[t * ldo + o] = W[o, :] . token t (acts[t];
 * bf16: acts[t].x, or .xb for bf16 products) for the outputs of groups [g0, g1) and every token
 * t < n; W has `cols` inputs. Every tier implements
 * this signature; each output's blocks are scaled and added in order, as in the scalar dot
 * products above, so at the scalar tier all three layouts give the same bits. */
typedef void (*cb_itile_fn)(float *out, int ldo, const char *w, int dtype, const cb_act_q8 *acts, int cols,
                            int g0, int g1, int n);

/* How the transposed and interleaved int8/int4 kernels (decode tiles, the repacked prefill, the
 * interleaved tiles) multiply bytes, slowest first: the scalar tier's C, AVX2's maddubs + madd,
 * the VNNI step emulated in AVX2, AVX-VNNI, AVX512-VNNI, then AVX512-VNNI with the interleaved
 * prompts on AMX tiles, and those tiles' ops emulated in C. All give the same bits. The two emulated
 * steps exist to test the VNNI and AMX bodies' bits on CPUs without the instructions: they are built
 * in the probes (test_steps.h), not in the kernel module, and exist only once the probes install
 * them (cb_install_int_step); no run selects them by itself. */
enum { CB_INT_STEP_SCALAR, CB_INT_STEP_AVX2, CB_INT_STEP_VNNI_EMULATED, CB_INT_STEP_AVXVNNI,
       CB_INT_STEP_AVX512VNNI, CB_INT_STEP_AMX_EMULATED, CB_INT_STEP_AMX, CB_INT_STEPS };

/* The group kernels of an int step: what the kernel table takes from the step it runs. */
typedef struct {
    cb_ttile_fn ttile;          /* the transposed entry (every format: the float ones as the tier's) */
    cb_tprefill_fn tprefill;    /* the transposed repacked prefill (the scalar tier: its spec) */
    cb_itile_fn itile;          /* the interleaved entry */
    cb_itile_fn itile_bf16x;    /* NULL, or the interleaved bf16 products' entry it replaces (AMX) */
} cb_int_kernels;

/* The orders of the interleaved bf16 products' roundings (kernels_scalar.h explains them; the
 * kernel module's cb_bf16_order is the one in use). */
enum { CB_BF16_SEQ, CB_BF16_SPLIT_SUM, CB_BF16_SPLIT_EVEN, CB_BF16_SPLIT_ODD, CB_BF16_ORDERS };
#define CB_BF16_SPLIT_INPUTS 64         /* the inputs of one TDPBF16PS of a lane: 16 vectors of 4 */

/* The slots of a thread's scratch (kernels_scalar.h, cb_thread_scratch). */
enum {
    CB_SCRATCH_TPREFILL = 0,    /* the repacked prefill's chunk (dispatch.h, cb_job_transposed) */
    CB_SCRATCH_ACT_TILES = 1,   /* the interleaved prompt tiles' packed activations (kernels_avx2.h, kernels_vnni.h;
                                   amx_body.h: also its unpacked weights, C buffers or bf16 lane sums, and tile config) */
    CB_SCRATCH_SLOTS = 2
};

/* What a step built outside the kernel module calls back into it for: the entries a VNNI or AMX
 * body falls back to or packs with (kernels_avx2.h, kernels_vnni.h, kernels_avx512.h,
 * kernels_amx.h), the threads' scratch and the order of bf16 products in use. Filled by the kernel
 * module (cb_step_parts_of_kernels), read by the probes' test steps (test_steps.h). */
typedef struct {
    cb_ttile_fn ttile_avx2_any;                 /* the AVX2 tier's transposed entry */
    uint8_t *(*tprefill_pack_avx2)(const char *w, int dtype, const cb_act_q8 *acts, int rows, int cols, int g0,
                                   int g1, int n, uint8_t *scratch, int first, int unsigned_int8);
    uint8_t *(*thread_scratch)(int slot, size_t bytes);
    const int *bf16_order;                      /* CB_BF16_*: the kernel module's cb_bf16_order */
#if CB_HAVE_AMX
    cb_ttile_fn ttile_avx512vnni;               /* the AVX512-VNNI step's entries */
    cb_tprefill_fn tprefill_avx512vnni;
    cb_itile_fn itile_avx512vnni, itile_wide_avx512vnni, itile_bf16x_ordered_avx512;
    void (*amx_fill_config)(cb_amx_config *c);
    void (*amx_pack_acts)(cb_amx_act *tile, const cb_act_q8 *acts, int nb);
    void (*amx_pack_weights)(cb_amx_wblock *wb, const char *gp, const char *gq, int dtype, int nblocks);
    void (*amx_bf16_fill_config)(cb_amx_config *c);
    void (*amx_bf16_pack_acts)(cb_amx_bf16_a *tile, const cb_act_q8 *acts, int cols);
    void (*amx_bf16_pack_weights)(cb_amx_bf16_w *wb, const char *gp, size_t row, int cols, int h0, int nchunks);
#endif
} cb_step_parts;

#endif /* COLIBRI_INT_STEP_H */
