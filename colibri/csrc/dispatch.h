/* dispatch.h — the kernel table, chosen once at import, and the drivers that run it.
 *
 * cb_select_isa() fills cb_kt for one tier (scalar, avx2, avx512; the tiers side by side, each
 * filling every entry): a matrix kernel per storage format x layout (cb_mat_kernels), whose
 * plain-C spec is the scalar tier's entry, and the attention, activation and quantization
 * kernels. The drivers (cb_matmul_jobs over cb_job_rows / _transposed / _interleaved, and
 * cb_attention) only call through cb_kt, so forcing a tier (COLIBRI_ISA) changes every kernel at
 * once and nothing else. The table holds function pointers only; tuning constants are #defines
 * here, test toggles are cb_options.
 */
#ifndef COLIBRI_DISPATCH_H
#define COLIBRI_DISPATCH_H

#include <stdlib.h>

#include "cpu.h"
#ifdef _OPENMP
int omp_get_thread_num(void);    /* OpenMP's own (<omp.h> is not on every toolchain's path: MSVC mode) */
int omp_get_num_threads(void);
#endif
#include "kernels_scalar.h"
#include "kernels_avx2.h"
#include "kernels_avx512.h"
#include "kernels_vnni.h"
#include "kernels_amx.h"

/* Tokens per tile call: every tier's tiles (rows and transposed) take T in 1..4. */
#define CB_TILE_TOKENS 4

/* The scalar tier's tprefill, the plain-C spec of every tier's: the stored-order tile over the
 * tokens CB_TILE_TOKENS at a time (the repacked kernels give its bits; no scratch used). */
static void cb_tprefill_scalar(float *out, int ldo, const char *w, int dtype, const cb_act_q8 *acts, int rows,
                               int cols, int o0, int o1, int n, uint8_t *scratch, int first) {
    (void)scratch; (void)first;
    for (int t = 0; t < n; t += CB_TILE_TOKENS) {
        const int T = n - t < CB_TILE_TOKENS ? n - t : CB_TILE_TOKENS;
        cb_ttile_scalar(out + (size_t)t * ldo, ldo, w, dtype, NULL, 0, acts + t, rows, cols, o0, o1, T);
    }
}

/* The kernels of one storage format in one layout: cb_kt.mat[dtype][layout]. Each layout's driver
 * below (cb_job_rows, cb_job_transposed, cb_job_interleaved) reads its own fields:
 *   CB_ROWS         tile (up to tile_rows rows x CB_TILE_TOKENS tokens) and, where the tile's
 *                   arithmetic for one token is a dot product, `dot`, which decode calls row by row
 *                   (a 4-argument call per row instead of the tile's 11: less call overhead per row);
 *                   xp_order: the tile reads the activation reordered into acts.xp (CB_XP_*: the
 *                   AVX-512 rows tile cb_permute_bf16's lanes, the AVX2 interleaved bf16 prefill
 *                   cb_permute_pairs' pairs; a tier uses at most one order);
 *                   tile_bf16x (bf16 only, where the CPU has AVX512_BF16): the tile of bf16
 *                   products, taken instead of `tile` for a model whose acts carry xb (see
 *                   cb_takes_bf16x; its spec is kernels_scalar.h's cb_tile_bf16x_scalar);
 *   CB_TRANSPOSED   ttile (groups of CB_TGROUP outputs) and, for int8/int4, tprefill: the repacked
 *                   prefill from CB_TPREFILL_MIN_TOKENS tokens (same bits; the scalar tier's is the
 *                   stored-order tile itself, cb_tprefill_scalar);
 *   CB_INTERLEAVED  itile (int8/int4/mxfp4/nl4/int6, and bf16 widened to f32), decode and prefill
 *                   (the amx int step: whole tiles of 16 tokens on AMX, kernels_amx.h);
 *                   itile_bf16x (bf16 only, where the CPU has AVX512_BF16): its bf16 products, taken
 *                   as tile_bf16x is (spec: kernels_scalar.h's cb_itile_bf16x_scalar; the amx step's
 *                   whole tiles of 16 tokens on TDPBF16PS where the CPU has AMX-BF16, kernels_amx.h);
 * The scalar tier's entries (kernels_scalar.h: cb_tile_scalar, cb_ttile_scalar, cb_itile_scalar)
 * are the plain-C spec of every other tier's, which the tests hold them to. */
typedef struct {
    cb_tile_fn tile;
    cb_dot_fn dot;
    int tile_rows;
    int xp_order;               /* CB_XP_NONE, CB_XP_LANES or CB_XP_PAIRS: what acts.xp must hold */
    cb_tile_fn tile_bf16x;      /* bf16 rows only: the tile of bf16 products (acts.xb), or NULL */
    cb_ttile_fn ttile;
    cb_tprefill_fn tprefill;
    cb_itile_fn itile;
    cb_itile_fn itile_bf16x;    /* bf16 interleaved only: the tile of bf16 products (acts.xb), or NULL */
} cb_mat_kernels;

/* The kernel table: function pointers only, filled once for a tier (cb_select_isa), read by the
 * drivers below and by nothing else. */
typedef struct {
    cb_mat_kernels mat[CB_N_DTYPES][CB_N_LAYOUTS];
    void (*quantize)(cb_act_q8 *a, const float *x, int n);       /* activations for int8/int4 */
    void (*glu)(float *gate, const float *up, int n, int act);   /* the FFN activation (cb_glu) */
    cb_attend_fn attend;            /* one query's attention for a KV head's query heads */
    int attend_heads;               /* the most query heads attend takes at once (f32, f16 caches) */
    int attend_heads_q8;            /* ... over a q8 cache */
    cb_attend_block_fn attend_block;    /* a prompt's block of queries, each exactly as attend */
    int attend_block_heads;         /* the most query heads attend_block takes at once */
    cb_kv_store_fn kv_store;        /* a key or value row into the cache, in its element type */
    int (*softmax)(float *x, int n);    /* the softmax attend uses (cb_softmax's contract) */
    void (*round_bf16)(uint16_t *dst, const float *x, int n);   /* acts.xb for tile_bf16x */
} cb_kernel_table;

static cb_kernel_table cb_kt;
static cb_cpu_features cb_cpu;

/* What filled the table: the tier, and the int step of its int8/int4 group kernels (a VNNI step
 * is a feature of the avx2 or avx512 tier, used where the CPU has it). */
typedef struct { int isa; int int_step; } cb_selection;
static cb_selection cb_selected;

/* Test and benchmark toggles, kept out of the table: prefill_repack 0 sends transposed int8/int4
 * prefill through the stored-order ttile instead of tprefill (to compare the two). */
static struct { int prefill_repack; } cb_options = {1};

/* An int step that failed import's self-test on a tier whose kernels passed with a slower step
 * (cb_self_test) is off from then on: the number of the check it failed (0: not turned off). The
 * slowest step of a tier is never off: where it fails too, the tier's own code is at fault. With
 * the AVX512-VNNI step off, the AVX-512 tier's other kernels leave vpdpbusd too (cb_select_kernels). */
static int cb_int_step_failed_check[CB_INT_STEPS];

/* The steps installed from outside this module (int_step.h: the probes' test steps), by code: a
 * step this module lacks (the emulated ones), or one whose own kernels it replaces (a faulty
 * kernel); itile NULL: none. Empty in a production run. */
static cb_int_kernels cb_installed_steps[CB_INT_STEPS];

/* The AMX step (kernels_amx.h: the AVX512-VNNI step with the interleaved prompts on AMX tiles) runs
 * only once the OS has lent this process the tile state (_kernels asks at import, then sets this)
 * and until its self-test fails (cb_int_step_failed_check). */
static int cb_amx_granted;
/* Its bf16 products tile (TDPBF16PS) is checked apart: the unit's order of roundings is not known
 * to be decode's (kernels_amx.h). Import's self-test finds the order it gives decode's bits in
 * (cb_self_test_step_bf16_orders) and keeps it here; where no order does, only that tile stays off. The
 * hardware tile is installed only while the order in use is the unit's (-1: not yet known), so an
 * order set afterwards (_kernels.set_bf16_order) moves bf16 prompts to the AVX-512 tiles instead. */
static int cb_amx_bf16_failed_check;
static int cb_amx_bf16_unit_order = -1;
static void cb_set_amx_granted(int granted) { cb_amx_granted = granted != 0; }

/* The group kernels this module builds for int step `step` on tier `isa` (*k), and whether this
 * tier and CPU can run them: the steps as they are, before any installed one or self-test mark. */
static int cb_int_step_own_kernels(int step, int isa, cb_int_kernels *k) {
    cb_int_kernels s = {NULL, NULL, NULL, NULL};
    int ok = 0;
    if (isa == CB_ISA_SCALAR) {
        s.ttile = cb_ttile_scalar;
        s.tprefill = cb_tprefill_scalar;
        s.itile = cb_itile_scalar;
        ok = step == CB_INT_STEP_SCALAR;
    }
#if CB_X86
    else if (step == CB_INT_STEP_AVX2) {
        cb_int_kernels avx2 = {cb_ttile_avx2_any, cb_tprefill_quant_avx2, cb_itile_avx2, NULL};
        s = avx2;
        ok = 1;
    } else if (step == CB_INT_STEP_AVXVNNI) {
        cb_int_kernels vex = {cb_ttile_avxvnni, cb_tprefill_quant_avxvnni, cb_itile_avxvnni, NULL};
        s = vex;
        ok = cb_cpu.avx_vnni;
    } else if (step == CB_INT_STEP_AVX512VNNI) {
        cb_int_kernels evex = {cb_ttile_avx512vnni, cb_tprefill_quant_avx512vnni, cb_itile_wide_avx512vnni, NULL};
        s = evex;
        ok = isa >= CB_ISA_AVX512 && cb_cpu.avx512_vnni;
    }
#if CB_HAVE_AMX
    else if (step == CB_INT_STEP_AMX) {
        cb_int_kernels amx = {cb_ttile_avx512vnni, cb_tprefill_quant_avx512vnni, cb_itile_amx, NULL};
        if (cb_cpu.avx512_bf16 && cb_cpu.amx_bf16 && !cb_amx_bf16_failed_check &&   /* (its last tokens go to */
            (cb_amx_bf16_unit_order < 0 || cb_amx_bf16_unit_order == cb_bf16_order))   /* the AVX512_BF16 tile) */
            amx.itile_bf16x = cb_itile_bf16x_amx;
        s = amx;
        ok = isa >= CB_ISA_AVX512 && cb_cpu.avx512_vnni && cb_cpu.amx_tile && cb_cpu.amx_int8 && cb_cpu.os_amx &&
             cb_amx_granted;
    }
#endif
#endif
    *k = s;
    return ok;
}

/* Whether tier `isa` on this CPU has what an installed test step needs (int_step.h): the VNNI
 * emulation AVX2, the AMX emulation the AVX512-VNNI step it falls back to. */
static int cb_installed_step_runs(int step, int isa) {
#if CB_X86
    if (step == CB_INT_STEP_VNNI_EMULATED) return isa >= CB_ISA_AVX2;
    if (step == CB_INT_STEP_AMX_EMULATED) return isa >= CB_ISA_AVX512 && cb_cpu.avx512_vnni;
#endif
    (void)step; (void)isa;
    return 0;
}

/* The group kernels of int step `step` on tier `isa`: 0, or -1 (nothing written) if this tier or
 * CPU has no such step, or (unless `any`) the self-test turned it off (cb_int_step_failed_check).
 * An installed step stands for this module's own (or for the step it lacks). The registry the
 * table is filled from (and the tests choose from). */
static int cb_int_step_kernels_of(int step, int isa, cb_int_kernels *k, int any) {
    if (step < 0 || step >= CB_INT_STEPS) return -1;
    cb_int_kernels s;
    int ok = cb_int_step_own_kernels(step, isa, &s);
    const cb_int_kernels *installed = &cb_installed_steps[step];
    if (installed->itile && ok)
        s.itile = installed->itile;             /* (a replaced kernel: the step's others its own) */
    else if (installed->itile && (ok = cb_installed_step_runs(step, isa)) != 0) {
        s = *installed;
        if (!cb_cpu.avx512_bf16) s.itile_bf16x = NULL;
    }
    if (!ok || (!any && cb_int_step_failed_check[step])) return -1;
    *k = s;
    return 0;
}
static int cb_int_step_kernels(int step, int isa, cb_int_kernels *k) { return cb_int_step_kernels_of(step, isa, k, 0); }

/* The fastest int step tier `isa` has on this CPU and has not turned off (the emulated ones are
 * for tests only). */
static int cb_best_int_step(int isa) {
    const int steps[] = {CB_INT_STEP_AMX, CB_INT_STEP_AVX512VNNI, CB_INT_STEP_AVXVNNI, CB_INT_STEP_AVX2,
                         CB_INT_STEP_SCALAR};
    cb_int_kernels k;
    for (int i = 0; i < (int)(sizeof steps / sizeof *steps); i++)
        if (cb_int_step_kernels(steps[i], isa, &k) == 0) return steps[i];
    return CB_INT_STEP_SCALAR;
}

static void cb_set_rows(cb_kernel_table *t, int dtype, cb_tile_fn tile, cb_dot_fn dot, int tile_rows, int xp_order) {
    cb_mat_kernels *e = &t->mat[dtype][CB_ROWS];
    e->tile = tile;
    e->dot = dot;
    e->tile_rows = tile_rows;
    e->xp_order = xp_order;
}

/* The tiers, side by side: each fills every entry of the table. */
static void cb_fill_scalar(cb_kernel_table *t) {
    for (int d = 0; d < CB_N_DTYPES; d++) cb_set_rows(t, d, cb_tile_scalar, cb_dot_scalar(d), 1, 0);
    t->quantize = cb_quantize_act_scalar;
    t->glu = cb_glu_scalar;
    t->attend = cb_attend_heads_scalar;
    t->attend_heads = t->attend_heads_q8 = CB_ATTN_HEADS;
    t->attend_block = cb_attend_block_scalar;
    t->attend_block_heads = CB_ATTN_HEADS;
    t->kv_store = cb_kv_store_scalar;
    t->softmax = cb_softmax;
    t->round_bf16 = cb_round_bf16_scalar;
    t->mat[CB_BF16][CB_INTERLEAVED].itile = cb_itile_scalar;
}

#if CB_X86
/* tiles of one row and up to 4 tokens (the weights are loaded once for 4 prompt tokens); the
 * AVX2 dots are those tiles at T = 1 */
static void cb_fill_avx2(cb_kernel_table *t) {
    cb_set_rows(t, CB_F32, cb_tile_float_avx2_any, cb_dot_f32_avx2, 1, 0);
    cb_set_rows(t, CB_F16, cb_tile_float_avx2_any, cb_dot_f16_avx2, 1, 0);
    cb_set_rows(t, CB_BF16, cb_tile_float_avx2_any, cb_dot_bf16_avx2, 1, 0);
    cb_set_rows(t, CB_INT8, cb_tile_quant_avx2_any, cb_dot_int8_avx2, 1, 0);
    cb_set_rows(t, CB_INT4, cb_tile_quant_avx2_any, cb_dot_int4_avx2, 1, 0);
    cb_set_rows(t, CB_MXFP4, cb_tile_quant_avx2_any, cb_dot_mxfp4_avx2, 1, 0);
    t->quantize = cb_quantize_act_avx2;
    t->glu = cb_glu_avx2;
    t->attend = cb_attend_heads_avx2;
    t->attend_heads = CB_ATTN_HEADS;
    t->attend_heads_q8 = CB_ATTN_HEADS_WIDE;           /* a KV head's 8 heads at once (cb_attend_q8_avx2) */
    t->attend_block = cb_attend_block_avx2;
    t->attend_block_heads = CB_ATTN_HEADS;
    t->kv_store = cb_kv_store_avx2;
    t->softmax = cb_softmax_avx2;
    t->round_bf16 = cb_round_bf16_scalar;
    t->mat[CB_BF16][CB_INTERLEAVED].itile = cb_itile_bf16_avx2;
    t->mat[CB_BF16][CB_INTERLEAVED].xp_order = CB_XP_PAIRS;     /* its prompt tiles' broadcasts */
}

/* 4-row float tiles (bf16 from the permuted input); 2-row int8/int4 tiles where the CPU has
 * AVX512-VNNI, else AVX2's; the rest (mxfp4 too) as AVX2 (memory-bound: wider vectors gain
 * nothing there) */
static void cb_fill_avx512(cb_kernel_table *t, const cb_cpu_features *f) {
    cb_set_rows(t, CB_F32, cb_tile_float_avx512_any, NULL, 4, 0);
    cb_set_rows(t, CB_F16, cb_tile_float_avx512_any, NULL, 4, 0);
    cb_set_rows(t, CB_BF16, cb_tile_float_avx512_any, NULL, 4, CB_XP_LANES);
    if (f->avx512_vnni) {
        cb_set_rows(t, CB_INT8, cb_tile_quant_avx512_any, NULL, 2, 0);
        cb_set_rows(t, CB_INT4, cb_tile_quant_avx512_any, NULL, 2, 0);
    } else {
        cb_set_rows(t, CB_INT8, cb_tile_quant_avx2_any, cb_dot_int8_avx2, 1, 0);
        cb_set_rows(t, CB_INT4, cb_tile_quant_avx2_any, cb_dot_int4_avx2, 1, 0);
    }
    cb_set_rows(t, CB_MXFP4, cb_tile_quant_avx2_any, cb_dot_mxfp4_avx2, 1, 0);   /* AVX2's: memory-bound */
    if (f->avx512_bf16) {
        t->mat[CB_BF16][CB_ROWS].tile_bf16x = cb_tile_bf16x_avx512_any;   /* 4 rows, as the widened tile */
        t->mat[CB_BF16][CB_INTERLEAVED].itile_bf16x =          /* the order in use (kernels_scalar.h) */
            cb_bf16_order == CB_BF16_SEQ ? cb_itile_bf16x_avx512 : cb_itile_bf16s_avx512;
        t->round_bf16 = cb_round_bf16_avx512;
    } else {
        t->round_bf16 = cb_round_bf16_scalar;
    }
    t->quantize = cb_quantize_act_avx2;
    t->glu = cb_glu_avx2;
    t->attend = f->avx512_vnni ? cb_attend_heads_avx512vnni : cb_attend_heads_avx512;   /* q8: vpdpbusd */
    t->attend_heads = t->attend_heads_q8 = CB_ATTN_HEADS_WIDE;
    t->attend_block = f->avx512_vnni ? cb_attend_block_avx512vnni : cb_attend_block_avx512;
    t->attend_block_heads = CB_ATTN_HEADS_WIDE;
    t->kv_store = cb_kv_store_avx2;
    t->softmax = cb_softmax_avx512;
    t->mat[CB_BF16][CB_INTERLEAVED].itile = cb_itile_bf16_avx512;
}
#endif

/* Fill cb_kt for tier `isa` with the group kernels of int step `step`; -1 (cb_kt unchanged) if
 * this CPU/OS cannot run them or (unless `any`: the self-test's references) the self-test turned
 * the step off. */
static int cb_select_kernels_of(int isa, int step, int any) {
    cb_kernel_table t;
    cb_int_kernels k;
    cb_cpu = cb_detect_cpu();
    if (isa > cb_best_isa(&cb_cpu) || cb_int_step_kernels_of(step, isa, &k, any) != 0) return -1;
    memset(&t, 0, sizeof t);
#if CB_X86
    cb_cpu_features trusted = cb_cpu;        /* vpdpbusd's other users follow its step's self-test */
    if (cb_int_step_failed_check[CB_INT_STEP_AVX512VNNI]) trusted.avx512_vnni = 0;
    if (isa >= CB_ISA_AVX512) cb_fill_avx512(&t, &trusted);
    else if (isa == CB_ISA_AVX2) cb_fill_avx2(&t);
    else
#endif
        cb_fill_scalar(&t);
    for (int d = 0; d < CB_N_DTYPES; d++) {
        t.mat[d][CB_TRANSPOSED].ttile = k.ttile;
        if (d == CB_INT8 || d == CB_INT4) {
            t.mat[d][CB_TRANSPOSED].tprefill = k.tprefill;
            t.mat[d][CB_INTERLEAVED].itile = k.itile;
        }
        if (d == CB_MXFP4 || d == CB_NL4 || d == CB_INT6)      /* (no transposed mxfp4/nl4/int6) */
            t.mat[d][CB_INTERLEAVED].itile = k.itile;
    }
    if (k.itile_bf16x && t.mat[CB_BF16][CB_INTERLEAVED].itile_bf16x) t.mat[CB_BF16][CB_INTERLEAVED].itile_bf16x = k.itile_bf16x;
    cb_kt = t;
    cb_selected.isa = isa;
    cb_selected.int_step = step;
    return 0;
}
static int cb_select_kernels(int isa, int step) { return cb_select_kernels_of(isa, step, 0); }

/* Fill cb_kt for `isa` with the fastest int step it has here; -1 if this CPU/OS cannot run it. */
static int cb_select_isa(int isa) {
    cb_cpu = cb_detect_cpu();
    if (isa > cb_best_isa(&cb_cpu)) return -1;
    return cb_select_kernels(isa, cb_best_int_step(isa));
}

/* gate[n] = act(gate[n]) * up[n] (SwiGLU / GeGLU) in place, by the current tier. */
static void cb_glu(float *gate, const float *up, int n, int act) { cb_kt.glu(gate, up, n, act); }

/* Re-fill the table for the selected tier with int step `step` (tests and benchmarks compare the
 * steps; cb_select_isa picks the fastest). -1, changing nothing, if the tier or CPU has no such
 * step or the self-test turned it off. */
static int cb_set_int_step(int step) { return cb_select_kernels(cb_selected.isa, step); }

/* Use order `order` (CB_BF16_*, kernels_scalar.h) for the interleaved bf16 products from now on,
 * the table refilled; -1 (nothing changed) if it is not one. The import self-test sets it where
 * the AMX unit follows a split order; tests set it to run those paths on any AVX512_BF16 CPU. */
static int cb_set_bf16_order(int order) {
    if (order < 0 || order >= CB_BF16_ORDERS) return -1;
    cb_bf16_order = order;
    return cb_select_kernels(cb_selected.isa, cb_selected.int_step);
}

/* Turn the repacked prefill of the transposed int8/int4 matrices off (0: the stored-order tiles,
 * which tests and benchmarks compare it with) or back on (1). Returns whether it is now in use. */
static int cb_set_prefill_repack(int on) {
    cb_options.prefill_repack = on != 0;
    return cb_options.prefill_repack && cb_kt.mat[CB_INT8][CB_TRANSPOSED].tprefill != NULL;
}

/* Install `k` as int step `step` (int_step.h: the probes' test steps), or with k NULL remove what
 * was installed; the table is refilled with the step in use, or, where that step is gone, with the
 * fastest the tier has. -1 (nothing changed) if `step` is no step. */
static int cb_install_int_step(int step, const cb_int_kernels *k) {
    static const cb_int_kernels none = {NULL, NULL, NULL, NULL};
    if (step < 0 || step >= CB_INT_STEPS) return -1;
    cb_installed_steps[step] = k ? *k : none;
    if (cb_select_kernels(cb_selected.isa, cb_selected.int_step) != 0) cb_select_isa(cb_selected.isa);
    return 0;
}

/* Whether a step is installed from outside this module (cb_install_int_step). */
static int cb_int_step_installed(int step) {
    return step >= 0 && step < CB_INT_STEPS && cb_installed_steps[step].itile != NULL;
}

/* What a step built outside this module calls back into it for (int_step.h). */
static const cb_step_parts *cb_step_parts_of_kernels(void) {
#if CB_HAVE_AMX
    static const cb_step_parts parts = {cb_ttile_avx2_any, cb_tprefill_pack_avx2, cb_thread_scratch, &cb_bf16_order,
                                        cb_ttile_avx512vnni, cb_tprefill_quant_avx512vnni, cb_itile_avx512vnni, cb_itile_wide_avx512vnni,
                                        cb_itile_bf16x_ordered_avx512, cb_amx_fill_config, cb_amx_pack_acts,
                                        cb_amx_pack_weights, cb_amx_bf16_fill_config, cb_amx_bf16_pack_acts,
                                        cb_amx_bf16_pack_weights};
#elif CB_X86
    static const cb_step_parts parts = {cb_ttile_avx2_any, cb_tprefill_pack_avx2, cb_thread_scratch, &cb_bf16_order};
#else
    static const cb_step_parts parts = {NULL, NULL, cb_thread_scratch, &cb_bf16_order};
#endif
    return &parts;
}

/* Outputs per chunk of a transposed prefill product: the chunk's weights (about 128 KB) stay in
 * L2 while every 4-token tile of the prompt passes over them. Decode takes up to CB_TDECODE_OUTPUTS
 * outputs of a thread's range per pass: long reads per input row or block, and their sums (16 KB)
 * stay in L1 across the passes (a whole 131072-output head per thread would not fit in L2). */
#define CB_TCHUNK_BYTES (128 * 1024)

/* From this many tokens a transposed int8/int4 product repacks each chunk (its tprefill): the
 * repack costs about what 4 tokens' products save, so it pays only well above 4 tokens. */
#define CB_TPREFILL_MIN_TOKENS 8
#define CB_TDECODE_OUTPUTS 4096

/* This thread's share of a transposed product: whole groups of 8 outputs [u0, u1) * 8. Every
 * output's arithmetic is the same for any n and any split, so prefill equals decode. */
static void cb_job_transposed(const cb_matjob *j, int n, int th, int nt, int *r0, int *r1) {
    const int unit = CB_TGROUP, rows = j->rows, cols = j->cols, ldx = j->ldx;
    const float *x = j->x;
    const cb_act_q8 *acts = j->acts;
    const int units = (rows + unit - 1) / unit;
    const int u0 = (int)((long long)units * th / nt), u1 = (int)((long long)units * (th + 1) / nt);
    const size_t bytes_per_unit = j->dtype == CB_INT8 || j->dtype == CB_INT4
        ? (size_t)(cols / CB_QBLOCK) * cb_group_bytes(j->dtype)
        : cb_row_stride(j->dtype, cols) * unit;
    int chunk_units = (int)(CB_TCHUNK_BYTES / (bytes_per_unit ? bytes_per_unit : 1));
    if (chunk_units < 1) chunk_units = 1;
    /* float formats: a chunk's slice of an input row is contiguous; below 256 outputs (512 B of
     * bf16) the reads are too short and every row a new page */
    if (j->dtype != CB_INT8 && j->dtype != CB_INT4 && chunk_units < 256 / unit) chunk_units = 256 / unit;
    const int step = n == 1 ? CB_TDECODE_OUTPUTS / unit : chunk_units, max_t = CB_TILE_TOKENS;
    const cb_mat_kernels *e = &cb_kt.mat[j->dtype][CB_TRANSPOSED];
    *r0 = u0 * unit < rows ? u0 * unit : rows;
    *r1 = u1 * unit < rows ? u1 * unit : rows;
    /* the repacked prefill's scratch, sized for this thread's largest chunk (no memory: the
     * stored-order tile below) */
    uint8_t *scratch = NULL;
    if (n >= CB_TPREFILL_MIN_TOKENS && cb_options.prefill_repack && e->tprefill && (j->dtype == CB_INT8 || j->dtype == CB_INT4) &&
        cols >= CB_QBLOCK && u1 > u0)
        scratch = cb_thread_scratch(CB_SCRATCH_TPREFILL, cb_tprefill_bytes(step < u1 - u0 ? step : u1 - u0,
                                                      cols / CB_QBLOCK, n));
    for (int c = u0; c < u1; c += step) {
        int o0 = c * unit, o1 = (c + step < u1 ? c + step : u1) * unit;
        if (o1 > rows) o1 = rows;
        if (scratch) {
            e->tprefill(j->out, j->ldo, (const char *)j->w, j->dtype, acts, rows, cols, o0, o1, n, scratch, c == u0);
            continue;
        }
        for (int t = 0; t < n; t += max_t) {
            int T = n - t < max_t ? n - t : max_t;
            e->ttile(j->out + (size_t)t * j->ldo, j->ldo, (const char *)j->w, j->dtype, x + (size_t)t * ldx,
                        ldx, acts + t, rows, cols, o0, o1, T);
        }
    }
}

static inline int cb_takes_bf16x(const cb_matjob *j);

/* This thread's share of an interleaved int8/int4/mxfp4/nl4/int6/bf16 product: whole groups of 8
 * outputs, all tokens in one call (cb_itile_fn); nl4's row scales then multiply the finished outputs. */
static void cb_job_interleaved(const cb_matjob *j, int n, int th, int nt, int *r0, int *r1) {
    const int groups = j->rows / CB_TGROUP;
    const int g0 = (int)((long long)groups * th / nt), g1 = (int)((long long)groups * (th + 1) / nt);
    *r0 = g0 * CB_TGROUP;
    *r1 = g1 * CB_TGROUP;
    const cb_mat_kernels *e = &cb_kt.mat[j->dtype][CB_INTERLEAVED];
    const cb_itile_fn itile = cb_takes_bf16x(j) ? e->itile_bf16x : e->itile;
    if (g1 > g0) itile(j->out, j->ldo, (const char *)j->w, j->dtype, j->acts, j->cols, g0, g1, n);
    if (j->dtype == CB_NL4 && g1 > g0) {     /* each finished output times its row scale (quant.h) */
        const float *rs = cb_nl4_row_scales(j->w, j->rows, j->cols);
        for (int t = 0; t < n; t++) {
            float *o = j->out + (size_t)t * j->ldo;
            for (int r = *r0; r < *r1; r++) o[r] *= rs[r];
        }
    }
}

/* Does job j take bf16 products (bf16 weights, rows or interleaved, the activation rounded to bf16
 * in acts.xb, vdpbf16ps)? Where the model's acts carry xb (load(bf16_products=)) and the tier has
 * the tile; elsewhere the same job runs the widened, exact path. */
static inline int cb_takes_bf16x(const cb_matjob *j) {
    if (j->dtype != CB_BF16 || !j->acts || !j->acts[0].xb) return 0;
    return j->layout == CB_ROWS ? cb_kt.mat[CB_BF16][CB_ROWS].tile_bf16x != NULL
         : j->layout == CB_INTERLEAVED && cb_kt.mat[CB_BF16][CB_INTERLEAVED].itile_bf16x != NULL;
}

/* This thread's share of a rows-layout product: rows go tile_rows at a time and tokens
 * CB_TILE_TOKENS at a time through the tile; decode takes one row per tile, or calls the dot
 * product row by row where it is the tile's arithmetic. Either way an element's arithmetic does
 * not depend on n or on the split, so a prompt processed in one matmul gives exactly the logits
 * of decoding. */
static void cb_job_rows(const cb_matjob *j, int n, int th, int nt, int *r0, int *r1) {
    const int dtype = j->dtype, rows = j->rows, ldo = j->ldo, cols = j->cols, ldx = j->ldx;
    const float *x = j->x;
    const cb_act_q8 *acts = j->acts;
    const size_t stride = cb_row_stride(dtype, cols);
    const char *wb = (const char *)j->w;
    float *out = j->out;
    const cb_mat_kernels *e = &cb_kt.mat[dtype][CB_ROWS];
    const int bf16x = cb_takes_bf16x(j);
    cb_tile_fn tile = bf16x ? e->tile_bf16x : e->tile;
    if (!(n == 1 && e->dot) || bf16x) {
        /* decode: one row per tile, so one weight stream per thread: for the rows layout 2 or 4
         * rows at once read slower, in every format */
        const int TR = n == 1 ? 1 : e->tile_rows;
        const int groups = (rows + TR - 1) / TR;
        const int g0 = (int)((long long)groups * th / nt), g1 = (int)((long long)groups * (th + 1) / nt);
        *r0 = g0 * TR < rows ? g0 * TR : rows;
        *r1 = g1 * TR < rows ? g1 * TR : rows;
        for (int g = g0; g < g1; g++) {
            int r0 = g * TR;
            int R = rows - r0 >= TR ? TR : 1;        /* a full group, or the tail row by row */
            for (int r = r0; r < rows && r < r0 + TR; r += R) {
                for (int t = 0; t < n; t += CB_TILE_TOKENS) {
                    int T = n - t < CB_TILE_TOKENS ? n - t : CB_TILE_TOKENS;
                    tile(out + (size_t)t * ldo + r, ldo, wb + (size_t)r * stride, stride, dtype,
                         x + (size_t)t * ldx, ldx, acts + t, cols, R, T);
                }
            }
        }
        return;
    }
    cb_dot_fn dot = e->dot;
    *r0 = (int)((long long)rows * th / nt);
    *r1 = (int)((long long)rows * (th + 1) / nt);
    for (int r = *r0; r < *r1; r++) {
        const void *row = wb + (size_t)r * stride;
        for (int t = 0; t < n; t++) out[(size_t)t * ldo + r] = dot(row, x + (size_t)t * ldx, &acts[t], cols);
    }
}

/* The calling thread's number in the parallel region it is in (0 outside one, or without OpenMP). */
static inline int cb_thread_num(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* The number of threads of the parallel region the caller is in (1 outside one, or without OpenMP). */
static inline int cb_team_size(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

/* A batch's input, prepared for its kernels before any product reads it: the first job of each
 * distinct acts (jobs with the same input pass the same acts) and what its jobs need of it. */
typedef struct {
    const cb_matjob *j;
    int quantized;      /* some job takes quantized activations (cb_kt.quantize into acts) */
    int bf16x;          /* some job takes bf16 products (the input rounded to bf16 into acts.xb) */
    int xp_order;       /* CB_XP_*: the order a float tile reads acts.xp in (one per tier) */
} cb_input_prep;

/* Inputs of a batch prepared in the parallel region (each thread a share of the rows) from this
 * many elements in all; below it the calling thread prepares them alone. A prompt's MoE wave
 * quantizes every expert's gathered rows: one thread doing it alone would leave the others
 * waiting. */
#define CB_PREP_PARALLEL_MIN (1 << 15)
/* Distinct inputs a batch prepares in parallel at most (a MoE wave: up to 2 x 65 jobs); a larger
 * batch prepares its inputs on the calling thread. */
#define CB_PREP_MAX 160

/* Row t of input p, as every job of that input needs it (the same bytes whichever thread). */
static void cb_prepare_row(const cb_input_prep *p, int t) {
    const cb_matjob *j = p->j;
    const float *x = j->x + (size_t)t * j->ldx;
    if (p->quantized) cb_kt.quantize(&j->acts[t], x, j->cols);
    if (p->bf16x) cb_kt.round_bf16(j->acts[t].xb, x, j->cols);
#if CB_X86
    if (p->xp_order == CB_XP_LANES && j->acts[0].xp)          /* the input of the AVX-512 bf16 tile */
        cb_permute_bf16(j->acts[t].xp, x, j->cols);
    if (p->xp_order == CB_XP_PAIRS && j->n > 1 && j->acts[0].xp)   /* AVX2 interleaved bf16 prompt tiles */
        cb_permute_pairs(j->acts[t].xp, x, j->cols);
#endif
}

/* Thread th of nt's share of the rows of inputs preps[0..np): the rows numbered in input order, split
 * in nt contiguous runs. */
static void cb_prepare_share(const cb_input_prep *preps, int np, long long rows, int th, int nt) {
    const long long r0 = rows * th / nt, r1 = rows * (th + 1) / nt;
    long long at = 0;                                   /* the first row of input p */
    for (int p = 0; p < np && at < r1; at += preps[p].j->n, p++) {
        const long long a = r0 > at ? r0 - at : 0, b = r1 - at < preps[p].j->n ? r1 - at : preps[p].j->n;
        for (long long t = a; t < b; t++) cb_prepare_row(&preps[p], (int)t);
    }
}

/* Several products in one parallel region: q/k/v of attention, gate/up of every chosen expert,
 * their down projections. Integer formats quantize each input once (per distinct acts) first —
 * in the region itself, every thread a share of the rows, where there are many
 * (CB_PREP_PARALLEL_MIN). Each thread then takes its static share of every product in turn with
 * no barrier between them, so the threads meet once per batch instead of once per matrix (and once
 * more after a parallel preparation). Below CB_PARALLEL_MIN_WORK multiply-adds and
 * CB_PARALLEL_MIN_BYTES of weights in all, one thread. */
static void cb_matmul_jobs(const cb_matjob *jobs, int count, int n_threads) {
    long long work = 0, bytes = 0, prep_rows = 0, prep_elems = 0;
    cb_input_prep preps[CB_PREP_MAX];
    int np = 0;
    for (int i = 0; i < count; i++) {
        const cb_matjob *j = &jobs[i];
        const int n = j->n;
        work += (long long)j->rows * j->cols * n;
        bytes += (long long)cb_matrix_bytes(j->dtype, j->rows, j->cols);
        int first = 1;                                  /* the first job of this input? */
        for (int p = 0; p < i; p++) first &= jobs[p].acts != j->acts;
        if (!first) continue;
        if (j->acts)                                    /* what the interleaved bf16 kernels widen against */
            for (int t = 0; t < n; t++) j->acts[t].x = j->x + (size_t)t * j->ldx;
        cb_input_prep prep = {j, 0, 0, CB_XP_NONE};
        for (int p = i; p < count; p++) {
            if (jobs[p].acts != j->acts) continue;
            prep.quantized |= CB_IS_QUANT(jobs[p].dtype);
            if (cb_takes_bf16x(&jobs[p])) prep.bf16x = 1;
            else if (cb_kt.mat[jobs[p].dtype][jobs[p].layout].xp_order != CB_XP_NONE)
                prep.xp_order = cb_kt.mat[jobs[p].dtype][jobs[p].layout].xp_order;   /* one per tier */
        }
        if (!prep.quantized && !prep.bf16x && prep.xp_order == CB_XP_NONE) continue;
        if (np < CB_PREP_MAX) {
            preps[np++] = prep;
            prep_rows += n;
            prep_elems += (long long)n * j->cols;
        } else {
            for (int t = 0; t < n; t++) cb_prepare_row(&prep, t);
        }
    }
    const int nt = n_threads > 1 && (work >= CB_PARALLEL_MIN_WORK || bytes >= CB_PARALLEL_MIN_BYTES) ? n_threads : 1;
    const int prep_in_region = nt > 1 && prep_elems >= CB_PREP_PARALLEL_MIN;
    if (!prep_in_region) cb_prepare_share(preps, np, prep_rows, 0, 1);
    #pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int th = cb_thread_num(), team = cb_team_size();
        if (prep_in_region) {
            cb_prepare_share(preps, np, prep_rows, th, team);
            #pragma omp barrier
        }
        for (int i = 0; i < count; i++) {
            const cb_matjob *j = &jobs[i];
            const int n = j->n;
            int r0, r1;
            if (j->layout == CB_TRANSPOSED) cb_job_transposed(j, n, th, team, &r0, &r1);
            else if (j->layout == CB_INTERLEAVED) cb_job_interleaved(j, n, th, team, &r0, &r1);
            else cb_job_rows(j, n, th, team, &r0, &r1);
            if (j->glu_up)        /* the up rows r0..r1 came from this thread too: same rows, same split */
                for (int t = 0; t < n; t++)
                    cb_glu(j->out + (size_t)t * j->ldo + r0, j->glu_up + (size_t)t * j->ldo + r0, r1 - r0, j->glu_act);
        }
    }
}

/* out[t * ldo + r] = W[r, :] . x[t * ldx + :] for t < n, r < rows: one product (see above). */
static void cb_matmul(float *out, int ldo, const void *w, int dtype, int layout, const float *x, int ldx,
                      cb_act_q8 *acts, int n, int rows, int cols, int n_threads) {
    cb_matjob job = {n, out, ldo, w, dtype, layout, rows, cols, x, ldx, acts, NULL, 0};
    cb_matmul_jobs(&job, 1, n_threads);
}

/* The current tier's rounding of activations to bf16 (for the tests). */
static void cb_round_bf16(uint16_t *dst, const float *x, int n) { cb_kt.round_bf16(dst, x, n); }

/* Does the tier in use have bf16 products (vdpbf16ps)? What load(bf16_products="auto") asks. */
static int cb_has_bf16_products(void) { return cb_kt.mat[CB_BF16][CB_ROWS].tile_bf16x != NULL; }

/* Causal attention over the cache, for each query position (cb_attention below takes n of them).
 *   q        [n_heads, head_dim]           the current query (already roped)
 *   k_cache  [n_kv_heads, ring, head_dim]   keys of positions start..pos (a KV head's rows
 *   v_cache  [n_kv_heads, ring, head_dim]   together: one contiguous read per head)
 *   scores   [n_heads, n_ctx + 1]           scratch (row stride n_ctx + 1: the positions and a sink)
 *   sinks    [n_heads] or NULL               attention sinks: a logit per head in the softmax, no value
 *   out      [n_heads, head_dim]
 * Positions start..pos are attended (start > 0 for sliding-window layers); position p lives in
 * cache row p % ring (ring = the cache's rows: n_ctx, or a sliding layer's window plus a prefill
 * chunk). Query head h reads KV head h / (n_heads / n_kv_heads), as transformers' repeat_kv does.
 * Scores are q.k * scale, by the tier's cb_kt.attend for the query heads of one KV head at a time
 * (prefill and decode both come here, so they still agree bit for bit). Those units are split
 * over threads from CB_ATTN_PARALLEL_MIN multiply-adds (from a few hundred positions a serial
 * attention would be a sizeable share of a decode step). */
#define CB_ATTN_PARALLEL_MIN (1 << 15)

/* The attention's units of work: the query heads of each KV head, up to `per` at a time (decode:
 * the tier's cb_kt.attend_heads or attend_heads_q8; a prompt's blocks: cb_kt.attend_block_heads), so a key or value row read once
 * serves that many heads. Unit u covers heads *h0 .. *h0 + *nh - 1 of KV head *kvh. */
static inline int cb_attn_units(int n_heads, int n_kv_heads, int per) {
    const int group = n_heads / n_kv_heads;
    return n_kv_heads * ((group + per - 1) / per);
}
static inline void cb_attn_unit(int u, int n_heads, int n_kv_heads, int per, int *h0, int *nh, int *kvh) {
    const int group = n_heads / n_kv_heads, per_kv = (group + per - 1) / per;
    const int c = u % per_kv;
    *kvh = u / per_kv;
    *h0 = *kvh * group + c * per;
    *nh = group - c * per < per ? group - c * per : per;
}

/* The rows of n_ctx + 1 floats cb_attention's `scores` must have for n_threads threads: a row per
 * head for one query, a block's rows per thread for several. */
static inline int cb_attention_score_rows(int n_heads, int n_threads) {
    const int block = (n_threads > 1 ? n_threads : 1) * CB_ATTN_QBLOCK * CB_ATTN_BLOCK_HEADS_MAX;
    return n_heads > block ? n_heads : block;
}

/* n queries q [n, ldq] at positions pos0.. (their keys already in the cache), out [n, ldo];
 * `window` > 0 limits each query to its last `window` positions; scores
 * [cb_attention_score_rows(n_heads, n_threads), n_ctx + 1]. One query (decode): one parallel
 * region over the units, each using its heads' scores rows. Several: the (unit, block of
 * CB_ATTN_QBLOCK queries) pairs handed out one at a time, the blocks of the latest (longest)
 * queries first, each thread using its own block of rows. Every head of every query computes
 * alike either way, so a prompt's attention equals decoding's. */
static void cb_attention(float *out, int ldo, const float *q, int ldq, const void *k_cache,
                         const void *v_cache, float *scores, int n_heads, int n_kv_heads, int head_dim,
                         int n_ctx, int n, int pos0, int window, int ring, float scale, const float *sinks,
                         int n_threads, int kv) {
    long long work = 0;
    for (int t = 0; t < n; t++) {
        int pos = pos0 + t;
        work += (long long)n_heads * (pos - cb_window_start(pos, window) + 1) * head_dim;
    }
    int parallel = n_threads > 1 && work >= CB_ATTN_PARALLEL_MIN;
    (void)parallel;
    if (n == 1) {
        cb_attend_fn attend = cb_kt.attend;
        int per = kv == CB_KV_Q8 ? cb_kt.attend_heads_q8 : cb_kt.attend_heads;
        /* fewer wide units than threads, and units of 4 heads would give each thread one at most
         * (4 KV heads of 8 on 8-16 threads): those, so more threads work (each reading its rows) */
        if (parallel && per > CB_ATTN_HEADS && cb_attn_units(n_heads, n_kv_heads, per) < n_threads
            && cb_attn_units(n_heads, n_kv_heads, CB_ATTN_HEADS) <= n_threads)
            per = CB_ATTN_HEADS;
        const int units = cb_attn_units(n_heads, n_kv_heads, per);
        #pragma omp parallel for schedule(static) num_threads(n_threads) if (parallel)
        for (int u = 0; u < units; u++) {
            int h0, nh, kvh;
            cb_attn_unit(u, n_heads, n_kv_heads, per, &h0, &nh, &kvh);
            attend(out, q, k_cache, v_cache, scores, n_ctx + 1, h0, nh, kvh, head_dim, cb_window_start(pos0, window),
                   pos0, ring, scale, sinks, kv);
        }
        return;
    }
    cb_attend_block_fn attend_block = cb_kt.attend_block;
    const int per = cb_kt.attend_block_heads, units = cb_attn_units(n_heads, n_kv_heads, per);
    const int blocks = (n + CB_ATTN_QBLOCK - 1) / CB_ATTN_QBLOCK;
    const size_t per_thread = (size_t)CB_ATTN_QBLOCK * CB_ATTN_BLOCK_HEADS_MAX * (size_t)(n_ctx + 1);
    #pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads) if (parallel)
    for (int item = 0; item < units * blocks; item++) {
        const int b = blocks - 1 - item / units, u = item % units;
        const int j0 = b * CB_ATTN_QBLOCK, nq = n - j0 < CB_ATTN_QBLOCK ? n - j0 : CB_ATTN_QBLOCK;
        int h0, nh, kvh;
        cb_attn_unit(u, n_heads, n_kv_heads, per, &h0, &nh, &kvh);
        attend_block(out + (size_t)j0 * ldo, ldo, q + (size_t)j0 * ldq, ldq, nq, k_cache, v_cache,
                     scores + (size_t)cb_thread_num() * per_thread, n_ctx + 1, h0, nh, kvh, head_dim, pos0 + j0,
                     window, ring, scale, sinks, kv);
    }
}

/* n floats into a cache row of kv (CB_KV_*) elements, by the current tier. */
static void cb_kv_store(void *dst, const float *src, int n, int kv) { cb_kt.kv_store(dst, src, n, kv); }

/* The current tier's attention softmax (for the tests). */
static int cb_attention_softmax(float *x, int n) { return cb_kt.softmax(x, n); }

/* The current tier's activation quantization (for the tests). */
static void cb_quantize_act(cb_act_q8 *a, const float *x, int n) { cb_kt.quantize(a, x, n); }

/* ---- the import-time self-test ---------------------------------------------------------------
 *
 * A known-answer test of a tier against the scalar spec, on the drivers the engine uses: every
 * storage format in every layout it has (rows, but not nl4/int6; transposed for the float formats and
 * int8/int4; interleaved for int8/int4/mxfp4/nl4/int6/bf16) through cb_matmul at one token and at five (decode and the
 * prefill tiles), bf16 products where the tier has them, rows and interleaved (the rounding bit for bit), the
 * attention with and without sinks, and both GLU activations, each computed on the scalar tier
 * and on the tier under test from the same deterministic inputs (weights of
 * random bytes whose scales are set to valid values). Results must agree within float32
 * summation-order error (CB_SELFTEST_RTOL of the largest reference value). About 30 small
 * products, kept small because import runs them; most of the time is the tier switches' CPU
 * detection (cpuid traps to the hypervisor in a VM). Returns 0 with tier `isa` selected, or 1 + the index of the
 * first failing check with the table left on tier `isa` (the caller picks another); -1 if the CPU
 * cannot run `isa` at all. */
#define CB_SELFTEST_RTOL 1e-3f

static uint32_t cb_selftest_rand(uint32_t *state) {
    *state = *state * 1664525u + 1013904223u;
    return *state >> 8;
}

/* Fill a stored [rows, cols] matrix of `dtype` in `layout` with deterministic bytes, its scales
 * made valid: f32 values in [-1, 1); f16 / bf16 of normal magnitude; int8/int4/mxfp4/int6 random
 * weights with f16 scales near 2^-6 or e8m0 scales of 2^-6 +- 1; nl4 random bytes with row
 * scales in [2^-6, 2^-5). */
static void cb_selftest_fill(uint8_t *w, size_t bytes, int dtype, int layout, int rows, int cols, uint32_t *state) {
    if (dtype == CB_F32) {
        float *f = (float *)w;
        for (size_t i = 0; i < bytes / 4; i++) f[i] = (float)(cb_selftest_rand(state) % 2000u) / 1000.0f - 1.0f;
        return;
    }
    if (dtype == CB_F16 || dtype == CB_BF16) {
        uint16_t *h = (uint16_t *)w;
        for (size_t i = 0; i < bytes / 2; i++) {
            uint32_t r = cb_selftest_rand(state);
            h[i] = dtype == CB_F16 ? (uint16_t)((r & 0x8000u) | ((10u + (r >> 16) % 6u) << 10) | (r & 0x3FFu))
                                   : (uint16_t)((r & 0x8000u) | ((118u + (r >> 16) % 8u) << 7) | (r & 0x7Fu));
        }
        return;
    }
    for (size_t i = 0; i < bytes; i++) w[i] = (uint8_t)cb_selftest_rand(state);
    const int nb = cols / CB_QBLOCK, groups = rows / CB_TGROUP;
    if (layout == CB_ROWS) {                            /* each block's scale */
        const size_t bb = cb_row_stride(dtype, CB_QBLOCK);
        for (size_t b = 0; b < (size_t)rows * nb; b++) {
            if (dtype == CB_MXFP4) w[b * bb] = (uint8_t)(120u + cb_selftest_rand(state) % 3u);
            else { uint16_t d = (uint16_t)(0x2000u + cb_selftest_rand(state) % 0x400u); memcpy(w + b * bb, &d, 2); }
        }
        return;
    }
    if (dtype == CB_NL4) {                              /* its six-bit scales take any bits; the row scales */
        float *rs = (float *)(void *)(w + (size_t)groups * nb * sizeof(cb_igroup_nl4));
        for (int r = 0; r < rows; r++) rs[r] = (float)(1000u + cb_selftest_rand(state) % 1000u) * (1.0f / 64000.0f);
        return;
    }
    for (size_t gi = 0; gi < (size_t)groups * nb; gi++) {   /* each group's 8 scales, first in the group */
        uint8_t *g = w + gi * cb_group_bytes(dtype);
        for (int r = 0; r < CB_TGROUP; r++) {
            if (dtype == CB_MXFP4) g[r] = (uint8_t)(120u + cb_selftest_rand(state) % 3u);
            else { uint16_t d = (uint16_t)(0x2000u + cb_selftest_rand(state) % 0x400u); memcpy(g + 2 * r, &d, 2); }
        }
    }
}

static int cb_selftest_close(const float *ref, const float *got, int n) {
    float scale = 0.0f;
    for (int i = 0; i < n; i++) scale = fabsf(ref[i]) > scale ? fabsf(ref[i]) : scale;
    for (int i = 0; i < n; i++)
        if (!(fabsf(ref[i] - got[i]) <= CB_SELFTEST_RTOL * scale + 1e-6f)) return 0;   /* NaN fails too */
    return 1;
}

/* The checks of the last self-test run that multiplied on the AMX step's bf16 products tile (0:
 * none): a failure of one of them turns only that tile off (cb_self_test). */
static int cb_selftest_amx_bf16_checks[2];
static int cb_selftest_is_amx_bf16_check(int code) {
    return code > 0 && (code == cb_selftest_amx_bf16_checks[0] || code == cb_selftest_amx_bf16_checks[1]);
}

/* Is the table's bf16 products tile the AMX step's (hardware or emulated)? */
static int cb_amx_bf16_installed(void) {
#if CB_HAVE_AMX
    const cb_itile_fn f = cb_kt.mat[CB_BF16][CB_INTERLEAVED].itile_bf16x;
    return f != NULL && (f == cb_itile_bf16x_amx || f == cb_installed_steps[CB_INT_STEP_AMX_EMULATED].itile_bf16x);
#else
    return 0;
#endif
}

#if CB_HAVE_AMX
/* The AMX bf16 products tile against the AVX512_BF16 step's, bit for bit, on a shape that takes
 * each of its paths: 3 whole tiles of 16 tokens (a pair and an odd one) and a tail token, 7 groups
 * (a pass of CB_AMX_BF16_PAIRS group pairs, a pass of one, an odd group), and a half chunk of
 * inputs more than one range of CB_AMX_BF16_CHUNKS chunks (544 at 8: the lanes wait in the
 * state between ranges, and the last chunk is padded). 0 if they agree. The selection is left at
 * (isa, step). */
static int cb_selftest_amx_bf16(int isa, int step, uint32_t *state) {
    enum { R = 7 * CB_TGROUP, C = 64 * CB_AMX_BF16_CHUNKS + 32, N = 3 * CB_AMX_TOKENS + 1 };
    static uint16_t w[R * C], xb[N * C];
    static float x[N * C], ref[N * R], got[N * R];
    cb_act_q8 acts[N];
    memset(acts, 0, sizeof acts);
    for (int t = 0; t < N; t++) acts[t].xb = xb + (size_t)t * C;            /* (bf16 needs only xb) */
    for (int i = 0; i < N * C; i++) x[i] = (float)(cb_selftest_rand(state) % 2000u) / 1000.0f - 1.0f;
    cb_selftest_fill((uint8_t *)w, sizeof w, CB_BF16, CB_INTERLEAVED, R, C, state);
    cb_select_kernels_of(isa, CB_INT_STEP_AVX512VNNI, 1);                      /* (even if it is off) */
    cb_matmul(ref, R, w, CB_BF16, CB_INTERLEAVED, x, C, acts, N, R, C, 1);    /* rounds x into xb */
    cb_select_kernels(isa, step);
    cb_matmul(got, R, w, CB_BF16, CB_INTERLEAVED, x, C, acts, N, R, C, 1);
    return memcmp(ref, got, sizeof ref) != 0;
}
#endif

/* The kernels of tier `isa` with int step `step` against the scalar spec: 0 if all agree, -1 if
 * this CPU/OS cannot run them, else the number of the first check that failed. The selection is
 * left at (isa, step). Needs cb_init_tables() first (the scalar spec's f16 table). */
static int cb_self_test_step(int isa, int step) {
    /* R: 5 groups of 8 outputs (decode's 4 streams and one more; the pair tiles' two pairs and an
     * odd group); N: a whole AMX tile of 16 tokens and one more, also a prompt for every other tile */
    enum { R = 40, C = 64, N = 17, HEADS = 4, KV = 2, HD = 16, RING = 9 };
    static uint8_t w[R * C * 4];                        /* the largest: f32 */
    static float x[N * C], ref[N * R], got[N * R], xp[N * C], ad[N * C / CB_QBLOCK];
    static int8_t aq[N * C];
    static int32_t as[N * C / CB_QBLOCK], aoff[2 * N * C / CB_QBLOCK];
    static float kc[KV * RING * HD], vc[KV * RING * HD], q[HEADS * HD], sinks[HEADS], sc[HEADS * (RING + 1)];
    static uint16_t kc16[KV * RING * HD], vc16[KV * RING * HD];
    static char kc8[KV * RING * (HD + CB_KV_Q8_SCALE_BYTES)], vc8[KV * RING * (HD + CB_KV_Q8_SCALE_BYTES)];
    static float gate[3 * C], up[3 * C], gref[3 * C];
    cb_act_q8 acts[N];
    uint32_t state = 12345u;
    int check = 0;
    cb_selftest_amx_bf16_checks[0] = cb_selftest_amx_bf16_checks[1] = 0;
    if (cb_select_kernels(isa, step) != 0) return -1;
    for (int t = 0; t < N; t++) {
        acts[t].q = aq + t * C; acts[t].d = ad + t * (C / CB_QBLOCK); acts[t].s = as + t * (C / CB_QBLOCK);
        acts[t].nl4_off = aoff + t * 2 * (C / CB_QBLOCK); acts[t].n = 0; acts[t].xp = xp + t * C; acts[t].xb = NULL;
    }
    for (int i = 0; i < N * C; i++) x[i] = (float)(cb_selftest_rand(&state) % 2000u) / 1000.0f - 1.0f;
    for (int dtype = 0; dtype < CB_N_DTYPES; dtype++)
        for (int layout = 0; layout < CB_N_LAYOUTS; layout++) {
            const int quant = CB_IS_QUANT(dtype);
            if ((layout == CB_TRANSPOSED && dtype == CB_MXFP4) || (layout == CB_INTERLEAVED && !quant && dtype != CB_BF16))
                continue;
            if ((dtype == CB_NL4 || dtype == CB_INT6) && layout != CB_INTERLEAVED) continue;
            const size_t bytes = cb_matrix_bytes(dtype, R, C);
            cb_selftest_fill(w, bytes, dtype, layout, R, C, &state);
            static const int token_counts[] = {1, 2, 5, N};   /* decode, the few-token tiles, prompts */
            for (int in = 0; in < (int)(sizeof token_counts / sizeof *token_counts); in++) {
                const int n = token_counts[in];
                check++;
                cb_select_kernels(CB_ISA_SCALAR, CB_INT_STEP_SCALAR);
                cb_matmul(ref, R, w, dtype, layout, x, C, acts, n, R, C, 1);
                cb_select_kernels(isa, step);
                cb_matmul(got, R, w, dtype, layout, x, C, acts, n, R, C, 1);
                if (!cb_selftest_close(ref, got, n * R)) return check;
            }
        }
    if (cb_kt.mat[CB_BF16][CB_ROWS].tile_bf16x) {      /* bf16 products: rounding, then the tile */
        static uint16_t xb[N * C], xb_ref[N * C];
        check++;
        cb_round_bf16_scalar(xb_ref, x, N * C - 3);      /* a tail the vector rounding masks */
        cb_kt.round_bf16(xb, x, N * C - 3);
        if (memcmp(xb, xb_ref, sizeof(uint16_t) * (N * C - 3)) != 0) return check;
        cb_selftest_fill(w, (size_t)R * cb_row_stride(CB_BF16, C), CB_BF16, CB_ROWS, R, C, &state);
        for (int t = 0; t < N; t++) acts[t].xb = xb + t * C;
        for (int n = 1; n <= N; n += N - 1) {
            check++;
            cb_matmul(got, R, w, CB_BF16, CB_ROWS, x, C, acts, n, R, C, 1);     /* rounds x into xb */
            cb_tile_bf16x_scalar(ref, R, (const char *)w, cb_row_stride(CB_BF16, C), CB_BF16, x, C, acts, C, R, n);
            if (!cb_selftest_close(ref, got, n * R)) return check;
        }
        for (int n = 1; n <= N && cb_kt.mat[CB_BF16][CB_INTERLEAVED].itile_bf16x; n += N - 1) {   /* interleaved */
            check++;
            if (n == N && cb_amx_bf16_installed()) cb_selftest_amx_bf16_checks[0] = check;   /* its whole tile */
            cb_matmul(got, R, w, CB_BF16, CB_INTERLEAVED, x, C, acts, n, R, C, 1);
            cb_itile_bf16x_scalar(ref, R, (const char *)w, CB_BF16, acts, C, 0, R / CB_TGROUP, n);
            if (!cb_selftest_close(ref, got, n * R)) return check;
        }
        for (int t = 0; t < N; t++) acts[t].xb = NULL;
    }
#if CB_HAVE_AMX
    if (step == CB_INT_STEP_AMX || step == CB_INT_STEP_AMX_EMULATED) {
        /* its tiles run from 16 tokens: a whole tile and one token more (N), each format it takes,
         * the AVX512-VNNI step's bits */
        _Static_assert(N == CB_AMX_TOKENS + 1, "the AMX check multiplies a whole tile and one token more");
        const int dtypes[] = {CB_INT8, CB_INT4, CB_INT6, CB_MXFP4};
        for (int i = 0; i < 4; i++) {
            check++;
            const int dtype = dtypes[i];
            const size_t bytes = (size_t)(R / CB_TGROUP) * (C / CB_QBLOCK) * cb_group_bytes(dtype);
            cb_selftest_fill(w, bytes, dtype, CB_INTERLEAVED, R, C, &state);
            cb_select_kernels_of(isa, CB_INT_STEP_AVX512VNNI, 1);             /* (even if it is off) */
            cb_matmul(ref, R, w, dtype, CB_INTERLEAVED, x, C, acts, N, R, C, 1);
            cb_select_kernels(isa, step);
            cb_matmul(got, R, w, dtype, CB_INTERLEAVED, x, C, acts, N, R, C, 1);
            if (memcmp(ref, got, sizeof(float) * N * R) != 0) return check;
        }
        if (cb_amx_bf16_installed()) {                   /* its bf16 products: decode's bits */
            check++;
            cb_selftest_amx_bf16_checks[1] = check;
            if (cb_selftest_amx_bf16(isa, step, &state) != 0) return check;
        }
    }
#endif
    for (int i = 0; i < KV * RING * HD; i++) {
        kc[i] = (float)(cb_selftest_rand(&state) % 2000u) / 1000.0f - 1.0f;
        vc[i] = (float)(cb_selftest_rand(&state) % 2000u) / 1000.0f - 1.0f;
    }
    for (int i = 0; i < HEADS * HD; i++) q[i] = (float)(cb_selftest_rand(&state) % 2000u) / 1000.0f - 1.0f;
    for (int i = 0; i < HEADS; i++) sinks[i] = (float)(cb_selftest_rand(&state) % 4000u) / 1000.0f - 2.0f;
    for (int i = 0; i < KV * RING * HD; i++) {           /* the same cache in f16 (both tiers store it alike) */
        kc16[i] = cb_f32_to_f16(kc[i]);
        vc16[i] = cb_f32_to_f16(vc[i]);
    }
    for (int r = 0; r < KV * RING; r++) {                 /* and in q8 (every tier stores it with the scalar code) */
        cb_kv_store_q8(kc8 + (size_t)r * (HD + CB_KV_Q8_SCALE_BYTES), kc + r * HD, HD);
        cb_kv_store_q8(vc8 + (size_t)r * (HD + CB_KV_Q8_SCALE_BYTES), vc + r * HD, HD);
    }
    for (int kv = CB_KV_F32; kv <= CB_KV_Q8; kv++)
        for (int with_sinks = 0; with_sinks < 2; with_sinks++) {
            const void *k = kv == CB_KV_F16 ? (const void *)kc16 : kv == CB_KV_Q8 ? (const void *)kc8 : (const void *)kc;
            const void *v = kv == CB_KV_F16 ? (const void *)vc16 : kv == CB_KV_Q8 ? (const void *)vc8 : (const void *)vc;
            check++;
            cb_select_kernels(CB_ISA_SCALAR, CB_INT_STEP_SCALAR);              /* a window of 9: positions 3..11 of a ring of 9, wrapped */
            cb_attention(ref, 0, q, 0, k, v, sc, HEADS, KV, HD, RING, 1, 11, RING, RING, 0.25f, with_sinks ? sinks : NULL, 1, kv);
            cb_select_kernels(isa, step);
            cb_attention(got, 0, q, 0, k, v, sc, HEADS, KV, HD, RING, 1, 11, RING, RING, 0.25f, with_sinks ? sinks : NULL, 1, kv);
            if (!cb_selftest_close(ref, got, HEADS * HD)) return check;
            check++;           /* three queries at once (a prompt's block) = one at a time, bit for bit */
            {
                enum { NQ = 3 };
                static float q3[NQ * HEADS * HD], one[NQ * HEADS * HD], block[NQ * HEADS * HD];
                static float sc3[CB_ATTN_QBLOCK * CB_ATTN_BLOCK_HEADS_MAX * (RING + 1)];
                for (int i = 0; i < NQ * HEADS * HD; i++) q3[i] = q[i % (HEADS * HD)] * (float)(1 + i / (HEADS * HD));
                for (int t = 0; t < NQ; t++)         /* window 7: positions 3..9, 4..10, 5..11 */
                    cb_attention(one + t * HEADS * HD, 0, q3 + t * HEADS * HD, 0, k, v, sc3, HEADS, KV, HD, RING, 1,
                                 9 + t, 7, RING, 0.25f, with_sinks ? sinks : NULL, 1, kv);
                cb_attention(block, HEADS * HD, q3, HEADS * HD, k, v, sc3, HEADS, KV, HD, RING, NQ, 9, 7, RING, 0.25f,
                             with_sinks ? sinks : NULL, 1, kv);
                if (memcmp(one, block, sizeof one) != 0) return check;
            }
        }
    check++;                                              /* the tier's f16 store is the scalar spec's */
    {
        static uint16_t stored[KV * RING * HD];
        cb_kv_store(stored, kc, KV * RING * HD, CB_KV_F16);
        if (memcmp(stored, kc16, sizeof stored) != 0) return check;
    }
    check++;                                              /* and its q8 store (a row of 19: a tail) */
    {
        static char stored[CB_KV_Q8_SCALE_BYTES + 19], want[CB_KV_Q8_SCALE_BYTES + 19];
        cb_kv_store_q8(want, kc, 19);
        cb_kv_store(stored, kc, 19, CB_KV_Q8);
        if (memcmp(stored, want, sizeof stored) != 0) return check;
    }
    for (int act = CB_ACT_SILU; act <= CB_ACT_GELU_TANH; act++) {
        check++;
        for (int i = 0; i < 3 * C; i++) {
            gate[i] = (float)(cb_selftest_rand(&state) % 8000u) / 1000.0f - 4.0f;
            up[i] = (float)(cb_selftest_rand(&state) % 2000u) / 1000.0f - 1.0f;
        }
        memcpy(gref, gate, sizeof gate);
        cb_glu_scalar(gref, up, 3 * C - 5, act);
        cb_glu(gate, up, 3 * C - 5, act);
        if (!cb_selftest_close(gref, gate, 3 * C - 5)) return check;
    }
    return 0;
}

/* cb_self_test_step of tier `isa` with int step `step` in vdpbf16ps's order of bf16 products and,
 * where it fails in the AMX bf16 tile's checks, in each split order in turn (kernels_scalar.h: the
 * unit may sum a TDPBF16PS's even and odd products apart): the first order in which the whole
 * self-test passes is kept (0 returned: decode and every bf16 products tile now add in it). Where
 * none does, the order is back to vdpbf16ps's and the first run's check returned, *bf16_tile
 * telling whether it was the AMX bf16 tile's. The selection is left at (isa, step). */
static int cb_self_test_step_bf16_orders(int isa, int step, int *bf16_tile) {
    cb_bf16_order = CB_BF16_SEQ;
    const int code = cb_self_test_step(isa, step);
    *bf16_tile = cb_selftest_is_amx_bf16_check(code);
    if (!*bf16_tile) return code;
    for (int order = CB_BF16_SPLIT_SUM; order < CB_BF16_ORDERS; order++) {
        cb_bf16_order = order;
        if (cb_self_test_step(isa, step) == 0) return 0;
    }
    cb_bf16_order = CB_BF16_SEQ;
    cb_select_kernels(isa, step);
    return code;
}

/* Import's search for the order of bf16 products (cb_self_test_step_bf16_orders) run on int step
 * `step` of tier `isa` — for the tests, on the amx-emulated step playing a unit that follows a
 * given order (test_steps.h): the order kept (CB_BF16_*), -1 where none passes, -2 where a check
 * outside the bf16 tile fails, -3 where the tier has no such step with a bf16 products tile here.
 * The order and the int step in use are restored. */
static int cb_search_bf16_order(int isa, int step) {
    const int before_step = cb_selected.int_step, before_order = cb_bf16_order;
    cb_int_kernels k;
    if (cb_int_step_kernels(step, isa, &k) != 0 || !k.itile_bf16x) return -3;
    int bf16_tile;
    const int found = cb_self_test_step_bf16_orders(isa, step, &bf16_tile) == 0 ? cb_bf16_order : bf16_tile ? -1 : -2;
    cb_bf16_order = before_order;
    cb_select_kernels(isa, before_step);
    return found;
}

/* The self-test of tier `isa` as import runs it: with the fastest int step the tier has here, in
 * vdpbf16ps's order of bf16 products; where that step fails and a slower one passes, the failure
 * was the step's, which stays off (cb_int_step_failed_check keeps its check: _kernels warns) and
 * the tier runs the slower one; where the tier's slowest step fails too, the tier's own code is at
 * fault: its steps are left on and that step's failure returned (the caller tries another tier).
 * The AMX step's bf16 products tile first gets its own search: where it fails, the step is tested
 * in each split order (cb_bf16_order: the unit may sum a TDPBF16PS's even and odd products apart,
 * as the SDM says) and the first that passes is kept as the unit's (cb_amx_bf16_unit_order) —
 * decode and the other bf16 tiles then add in that order; where none passes, the order stays
 * vdpbf16ps's, that tile stays off (cb_amx_bf16_failed_check) and the step is tested again
 * without it. A tier without the AMX step is tested in the order in use, which it keeps. The
 * tier's steps are tested afresh; what an earlier run found of steps the tier does not have (the
 * AVX512-VNNI and AMX steps and the unit's order, for the AVX2 tier) is kept. */
static int cb_self_test(int isa) {
    cb_cpu = cb_detect_cpu();
    if (isa > cb_best_isa(&cb_cpu)) return -1;
    int kept[CB_INT_STEPS];                         /* the marks of steps this tier does not have */
    cb_int_kernels k;
    memcpy(kept, cb_int_step_failed_check, sizeof kept);
    memset(cb_int_step_failed_check, 0, sizeof cb_int_step_failed_check);
    for (int s = 0; s < CB_INT_STEPS; s++)
        if (cb_int_step_kernels(s, isa, &k) == 0) kept[s] = 0;
    const int amx_here = cb_int_step_kernels(CB_INT_STEP_AMX, isa, &k) == 0;
    if (amx_here) {                                 /* (found again) */
        cb_amx_bf16_failed_check = 0;
        cb_amx_bf16_unit_order = -1;
    }
    int code;
    for (;;) {
        const int step = cb_best_int_step(isa);
        int bf16_tile = 0;
        code = amx_here ? cb_self_test_step_bf16_orders(isa, step, &bf16_tile) : cb_self_test_step(isa, step);
        if (step == CB_INT_STEP_AMX && bf16_tile) {
            cb_amx_bf16_failed_check = code;
            code = cb_self_test_step(isa, step);    /* (its table now without that tile) */
        }
        if (code == 0) {
            if (step == CB_INT_STEP_AMX && cb_amx_bf16_installed()) cb_amx_bf16_unit_order = cb_bf16_order;
            break;
        }
        cb_int_step_failed_check[step] = code;
        if (code < 0 || cb_int_step_kernels(cb_best_int_step(isa), isa, &k) != 0) {   /* no slower step left */
            memset(cb_int_step_failed_check, 0, sizeof cb_int_step_failed_check);   /* the tier's own fault */
            if (amx_here) cb_amx_bf16_failed_check = 0;
            break;
        }
    }
    for (int s = 0; s < CB_INT_STEPS; s++)
        if (kept[s]) cb_int_step_failed_check[s] = kept[s];
    cb_select_kernels(isa, cb_best_int_step(isa));
    return code;
}

#endif /* COLIBRI_DISPATCH_H */
