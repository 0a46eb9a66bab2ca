/* test_steps.h — the int steps that exist only for the tests, built in the probes
 * (colibri/_probes.pyx), never in the kernel module (int_step.h says why):
 *   the VNNI step emulated in AVX2 ("vnni-emulated"): vnni_body.h instantiated with vpdpbusd
 *     written in exact AVX2 arithmetic, so the VNNI bodies' bits are tested on CPUs without VNNI;
 *   the AMX tiles emulated in C ("amx-emulated"): amx_body.h instantiated with the tile ops written
 *     after the instructions' definitions, so the AMX step's bits are tested on any AVX512-VNNI CPU;
 *   faulty steps: a step's interleaved kernel wrapped to miscompute, so the import self-test's
 *     fallback to a slower step is tested on a CPU whose steps all agree.
 * The probes install them into the kernel module's registry (cb_install_int_step) when a test asks;
 * a production run never does. The bodies fall back to and pack with the kernel module's entries
 * (the AVX2 and AVX512-VNNI steps', the AMX packers): they reach them through its cb_step_parts
 * (cb_test_steps_bind), so no kernel body is compiled here a second time. A program that includes
 * the kernel module's headers too (tools/bench/amx_check.c) calls them directly.
 */
#ifndef COLIBRI_TEST_STEPS_H
#define COLIBRI_TEST_STEPS_H

#include <float.h>
#include <math.h>
#include <string.h>

#include "int_step.h"
#include "avx2_int.h"
#include "amx_types.h"

static const cb_step_parts *cb_test_parts;   /* the kernel module's (cb_test_steps_bind) */

static void cb_test_steps_bind(const cb_step_parts *parts) { cb_test_parts = parts; }

/* The order the emulated unit's TDPBF16PS adds in: -1 follows the order in use; the tests fix one
 * to play a unit that follows it, for the self-test's search (_probes.search_bf16_order_emulated). */
static int cb_amx_emu_unit_order = -1;

#if CB_X86

/* The kernel module's entries a VNNI body calls, by their own names (kernels_avx2.h): through the
 * parts here; a program that includes the kernel module's headers too (a benchmark) has them. */
#ifndef COLIBRI_KERNELS_AVX2_H
static void cb_ttile_avx2_any(float *out, int ldo, const char *w, int dtype, const float *x, int ldx,
                              const cb_act_q8 *acts, int rows, int cols, int o0, int o1, int T) {
    cb_test_parts->ttile_avx2_any(out, ldo, w, dtype, x, ldx, acts, rows, cols, o0, o1, T);
}
static uint8_t *cb_tprefill_pack_avx2(const char *w, int dtype, const cb_act_q8 *acts, int rows, int cols, int g0,
                                      int g1, int n, uint8_t *scratch, int first, int unsigned_int8) {
    return cb_test_parts->tprefill_pack_avx2(w, dtype, acts, rows, cols, g0, g1, n, scratch, first, unsigned_int8);
}
#endif

/* vpdpbusd in AVX2: even and odd bytes widened to int16 (u zero-, s sign-extended), multiplied and
 * paired by madd (|u * s| <= 255 * 128: exact), so lane k gets bytes 4k..4k+3 — the instruction's
 * result, which does not saturate either. */
CB_TARGET_AVX2 static inline __m256i cb_dpbusd_emulated_avx2(__m256i acc, __m256i u, __m256i s) {
    const __m256i low_bytes = _mm256_set1_epi16(0x00FF);
    const __m256i u_even = _mm256_and_si256(u, low_bytes), u_odd = _mm256_srli_epi16(u, 8);
    const __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), s_odd = _mm256_srai_epi16(s, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(u_even, s_even), _mm256_madd_epi16(u_odd, s_odd)));
}

/* The emulated step on one vector in memory (its test against the instruction's definition). */
CB_TARGET_AVX2 static void cb_dpbusd_emulated_mem(int32_t out[8], const int32_t acc[8], const uint8_t u[32],
                                                  const int8_t s[32]) {
    _mm256_storeu_si256((__m256i *)out, cb_dpbusd_emulated_avx2(_mm256_loadu_si256((const __m256i *)acc),
                                                                _mm256_loadu_si256((const __m256i *)u),
                                                                _mm256_loadu_si256((const __m256i *)s)));
}

/* The emulated step takes the few-token tile as the EVEX step does: its bits are tested everywhere. */
#define CB_VNNI_TARGET CB_TARGET_AVX2
#define CB_VNNI_DPBUSD(a, u, s) cb_dpbusd_emulated_avx2(a, u, s)
#define CB_VNNI_NAME(base) base##_vnni_emulated
#define CB_VNNI_FEW_TS 2
#include "vnni_body.h"
#undef CB_VNNI_TARGET
#undef CB_VNNI_DPBUSD
#undef CB_VNNI_NAME
#undef CB_VNNI_FEW_TS

#endif /* CB_X86 */

/* out[8] = acc[8] + the emulated VNNI step of u[32] (unsigned) and s[32] (signed), for its test
 * against the instruction's definition; -1 where this build has no AVX2 (the caller checks the CPU). */
static int cb_dpbusd_emulated(int32_t *out, const int32_t *acc, const uint8_t *u, const int8_t *s) {
#if CB_X86
    cb_dpbusd_emulated_mem(out, acc, u, s);
    return 0;
#else
    (void)out; (void)acc; (void)u; (void)s;
    return -1;
#endif
}

/* ---- the AMX tiles emulated in C ("amx-emulated") ----------------------------------------------
 * amx_body.h instantiated with its tile ops written in C after the instructions' definitions: the
 * AMX step's bits tested on any AVX512-VNNI CPU (its last tokens and odd groups go to that step). */
#if CB_HAVE_AMX

/* The kernel module's entries the AMX body calls, by their own names (through the parts). */
#ifndef COLIBRI_KERNELS_AMX_H
static uint8_t *cb_thread_scratch(int slot, size_t bytes) { return cb_test_parts->thread_scratch(slot, bytes); }
static void cb_itile_avx512vnni(float *out, int ldo, const char *w, int dtype, const cb_act_q8 *acts, int cols,
                                int g0, int g1, int n) {
    cb_test_parts->itile_avx512vnni(out, ldo, w, dtype, acts, cols, g0, g1, n);
}
static void cb_itile_wide_avx512vnni(float *out, int ldo, const char *w, int dtype, const cb_act_q8 *acts, int cols,
                                     int g0, int g1, int n) {
    cb_test_parts->itile_wide_avx512vnni(out, ldo, w, dtype, acts, cols, g0, g1, n);
}
static void cb_itile_bf16x_ordered_avx512(float *out, int ldo, const char *w, int dtype, const cb_act_q8 *acts,
                                          int cols, int g0, int g1, int n) {
    cb_test_parts->itile_bf16x_ordered_avx512(out, ldo, w, dtype, acts, cols, g0, g1, n);
}
static void cb_amx_fill_config(cb_amx_config *c) { cb_test_parts->amx_fill_config(c); }
static void cb_amx_pack_acts(cb_amx_act *tile, const cb_act_q8 *acts, int nb) {
    cb_test_parts->amx_pack_acts(tile, acts, nb);
}
static void cb_amx_pack_weights(cb_amx_wblock *wb, const char *gp, const char *gq, int dtype, int nblocks) {
    cb_test_parts->amx_pack_weights(wb, gp, gq, dtype, nblocks);
}
static void cb_amx_bf16_fill_config(cb_amx_config *c) { cb_test_parts->amx_bf16_fill_config(c); }
static void cb_amx_bf16_pack_acts(cb_amx_bf16_a *tile, const cb_act_q8 *acts, int cols) {
    cb_test_parts->amx_bf16_pack_acts(tile, acts, cols);
}
static void cb_amx_bf16_pack_weights(cb_amx_bf16_w *wb, const char *gp, size_t row, int cols, int h0, int nchunks) {
    cb_test_parts->amx_bf16_pack_weights(wb, gp, row, cols, h0, nchunks);
}
#define CB_TEST_BF16_ORDER (*cb_test_parts->bf16_order)
#else
#define CB_TEST_BF16_ORDER cb_bf16_order
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
            const int order = cb_amx_emu_unit_order >= 0 ? cb_amx_emu_unit_order : CB_TEST_BF16_ORDER;
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

#define CB_AMX_LOADCFG(cfg) cb_amx_emu_loadcfg(cfg)
#define CB_AMX_RELEASE() ((void)0)
#define CB_AMX_LOAD(t, base, stride) cb_amx_emu_load(t, base, stride)
#define CB_AMX_STORE(t, base, stride) cb_amx_emu_store(t, base, stride)
#define CB_AMX_ZERO(t) cb_amx_emu_zero(t)
#define CB_AMX_DPBSSD(c, a, b) cb_amx_emu_dpbssd(c, a, b)
#define CB_AMX_DPBF16PS(c, a, b) cb_amx_emu_dpbf16ps(c, a, b)
#define CB_AMX_NAME(base) base##_amx_emulated
#include "amx_body.h"                  /* (it #undefs its parameters) */
#undef CB_TEST_BF16_ORDER

#endif /* CB_HAVE_AMX */

/* The kernels of test step `step` built here (*k): 0, or -1 where this build has none of it. */
static int cb_test_step_kernels(int step, cb_int_kernels *k) {
    memset(k, 0, sizeof *k);
#if CB_X86
    if (step == CB_INT_STEP_VNNI_EMULATED && cb_test_parts) {
        k->ttile = cb_ttile_vnni_emulated;
        k->tprefill = cb_tprefill_quant_vnni_emulated;
        k->itile = cb_itile_vnni_emulated;
        return 0;
    }
#endif
#if CB_HAVE_AMX
    if (step == CB_INT_STEP_AMX_EMULATED && cb_test_parts) {    /* (its decode and tiles: the AVX512-VNNI step's) */
        k->ttile = cb_test_parts->ttile_avx512vnni;
        k->tprefill = cb_test_parts->tprefill_avx512vnni;
        k->itile = cb_itile_amx_emulated;
        k->itile_bf16x = cb_itile_bf16x_amx_emulated;
        return 0;
    }
#endif
    (void)step;
    return -1;
}

/* ---- faulty steps ------------------------------------------------------------------------------
 * A faulty step's interleaved kernel: the step's own kernel (cb_faulty_of[step]) with the first
 * output of each call changed (one token, one group: what a wrong instruction on some inputs would
 * do). One wrapper per step, so that several steps can be faulty at once. */
static cb_itile_fn cb_faulty_of[CB_INT_STEPS];

#define CB_FAULTY_ITILE(step)                                                                             \
    static void cb_itile_faulty_##step(float *out, int ldo, const char *w, int dtype, const cb_act_q8 *acts, \
                                       int cols, int g0, int g1, int n) {                                 \
        cb_faulty_of[step](out, ldo, w, dtype, acts, cols, g0, g1, n);                                    \
        if (g0 < g1 && n > 0) out[(size_t)g0 * CB_TGROUP] = nanf("");                                     \
    }
CB_FAULTY_ITILE(0)
CB_FAULTY_ITILE(1)
CB_FAULTY_ITILE(2)
CB_FAULTY_ITILE(3)
CB_FAULTY_ITILE(4)
CB_FAULTY_ITILE(5)
CB_FAULTY_ITILE(6)
#undef CB_FAULTY_ITILE

static const cb_itile_fn cb_itile_faulty[] = {cb_itile_faulty_0, cb_itile_faulty_1, cb_itile_faulty_2,
                                              cb_itile_faulty_3, cb_itile_faulty_4, cb_itile_faulty_5,
                                              cb_itile_faulty_6};
CB_STATIC_ASSERT(sizeof cb_itile_faulty / sizeof *cb_itile_faulty == CB_INT_STEPS, "a faulty wrapper a step");

/* *k made faulty: its interleaved kernel wrapped as step `step`'s (k as the registry gave it). */
static void cb_make_faulty(int step, cb_int_kernels *k) {
    cb_faulty_of[step] = k->itile;
    k->itile = cb_itile_faulty[step];
}

#endif /* COLIBRI_TEST_STEPS_H */
