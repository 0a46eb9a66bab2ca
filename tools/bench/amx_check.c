/* amx_check.c — the AMX step's interleaved tiles against the AVX512-VNNI step's (int formats) and the
 * AVX512_BF16 step's (bf16 products), on one machine: the same bits, then GOP/s side by side, and the
 * tile unit's, vpdpbusd's and vdpbf16ps's peaks.
 *
 *   gcc -O3 -fopenmp -Icolibri/csrc tools/bench/amx_check.c -o /tmp/amx_check -lm
 *   /tmp/amx_check [--emulated | --hardware-only] [--threads 1,16] [--tokens 8,16,64,256] [--shape 2048x4096]
 *                  [--dtypes int8,int4,bf16] [--reps 5]
 *
 * --hardware-only: on an AMX CPU, skip the emulated tile ops' bits (checked on any AVX512-VNNI CPU).
 *
 * --emulated: the bits of the emulated tile ops only (any AVX512-VNNI CPU; no timing); with
 * --emulated-unit ORDER the emulated TDPBF16PS adds in that order of roundings (seq, split-sum,
 * split-even, split-odd: kernels_scalar.h), to play a unit that is not vdpbf16ps's. Without it
 * the CPU needs AMX-INT8 and Linux 5.16+ (the tile state is asked for with arch_prctl, as
 * colibri._os does). Outputs: "bits" lines (the AMX tile's outputs equal the VNNI tile's bit for
 * bit over formats, shapes, token counts, group ranges and threads), "peak" lines (the tile unit's
 * TDPBSSD and zmm vpdpbusd on one core, GOP/s), and one "prefill" line per format, token count and
 * thread count: the median of --reps products of each tile, interleaved, and their ratio. Where the
 * bf16 tile misses vdpbf16ps's bits, each split order is tried ("bf16 order" lines: the one whose
 * bits the unit gives is kept for the dispatch check, as import's self-test does). Build
 * with -DCB_AMX_STORE_DELAY=D -DCB_AMX_LOOKAHEAD=L (the int tile's pipeline), -DCB_AMX_KBLOCKS=K,
 * -DCB_AMX_BF16_PAIRS=P or -DCB_AMX_BF16_CHUNKS=C (the bf16 tile's blocking; kernels_amx.h) for
 * another variant: tools/bench/amx_engine.py --variants builds and times several.
 */
#define _GNU_SOURCE
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "dispatch.h"
#include "kernels_amx.h"
#include "test_steps.h"          /* the amx-emulated step (the probes' test steps) */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}

static const char *dtype_name(int d) {
    return d == CB_INT8 ? "int8" : d == CB_INT4 ? "int4" : d == CB_INT6 ? "int6" : d == CB_MXFP4 ? "mxfp4"
         : d == CB_BF16 ? "bf16" : "?";
}

/* The tiles compared for a format: bf16 multiplies bf16 products (acts.xb) against AVX512_BF16's
 * in the order in use (cb_bf16_order; timed against vdpbf16ps's, the AVX-512 prompt tile). */
static cb_itile_fn reference_tile(int dtype) {
    return dtype == CB_BF16 ? cb_itile_bf16x_ordered_avx512 : cb_itile_wide_avx512vnni;
}
static cb_itile_fn timed_reference_tile(int dtype) {
    return dtype == CB_BF16 ? cb_itile_bf16x_avx512 : cb_itile_wide_avx512vnni;
}
static cb_itile_fn amx_tile(int dtype, int emulated) {
    if (dtype == CB_BF16) return emulated ? cb_itile_bf16x_amx_emulated : cb_itile_bf16x_amx;
    return emulated ? cb_itile_amx_emulated : cb_itile_amx;
}

/* A random interleaved matrix [rows, cols]: random codes, scales in a sane range. */
static char *make_weights(int dtype, int rows, int cols, size_t *bytes) {
    const int nb = cols / CB_QBLOCK, groups = rows / CB_TGROUP;
    if (dtype == CB_BF16) {           /* random bf16 of random sign, 2^-4 .. 2^3 */
        *bytes = (size_t)rows * cols * 2;
        uint16_t *h = aligned_alloc(64, (*bytes + 63) / 64 * 64);
        for (size_t i = 0; i < *bytes / 2; i++) h[i] = (uint16_t)(((rnd() & 1u) << 15) | ((123u + rnd() % 8u) << 7) | (rnd() & 0x7Fu));
        return (char *)h;
    }
    const size_t gbytes = cb_group_bytes(dtype);
    *bytes = (size_t)groups * nb * gbytes;
    char *w = aligned_alloc(64, (*bytes + 63) / 64 * 64);
    for (size_t i = 0; i < *bytes; i++) w[i] = (char)rnd();
    for (size_t g = 0; g < (size_t)groups * nb; g++) {
        char *grp = w + g * gbytes;
        for (int r = 0; r < CB_TGROUP; r++) {
            if (dtype == CB_MXFP4) {
                ((uint8_t *)grp)[r] = (uint8_t)(118 + rnd() % 12);
            } else {
                ((uint16_t *)grp)[r] = (uint16_t)(((7 + rnd() % 5) << 10) | (rnd() & 0x3FF));
            }
        }
        if (dtype == CB_INT8)
            for (int k = 0; k < 256; k++)
                if (((cb_igroup_int8 *)grp)->qs[k / 32][(k / 4) % 8][k % 4] == -128) ((cb_igroup_int8 *)grp)->qs[k / 32][(k / 4) % 8][k % 4] = -127;
    }
    return w;
}

static cb_act_q8 *make_acts(int n, int cols) {
    cb_act_q8 *a = calloc((size_t)n, sizeof *a);
    float *x = malloc(sizeof(float) * cols);
    for (int t = 0; t < n; t++) {
        for (int i = 0; i < cols; i++) x[i] = ((int)(rnd() % 20001) - 10000) * (i % 97 == 0 ? 1e-3f : 1e-4f);
        a[t].q = aligned_alloc(64, (size_t)cols);
        a[t].d = malloc(sizeof(float) * cols / 32);
        a[t].s = malloc(sizeof(int32_t) * cols / 32);
        a[t].nl4_off = malloc(sizeof(int32_t) * cols / 16);
        a[t].xb = malloc(sizeof(uint16_t) * cols);         /* bf16 products' activations */
        cb_quantize_act_scalar(&a[t], x, cols);
        cb_round_bf16_scalar(a[t].xb, x, cols);
    }
    free(x);
    return a;
}

static void free_acts(cb_act_q8 *a, int n) {
    for (int t = 0; t < n; t++) { free(a[t].q); free(a[t].d); free(a[t].s); free(a[t].nl4_off); free(a[t].xb); }
    free(a);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

/* One product over `threads` threads, each its share of the groups (as dispatch.h's jobs). */
static void product(cb_itile_fn f, float *out, int ldo, const char *w, int dtype, const cb_act_q8 *acts, int rows,
                    int cols, int n, int threads) {
    const int groups = rows / CB_TGROUP;
#pragma omp parallel num_threads(threads)
    {
        const int th = omp_get_thread_num(), nt = omp_get_num_threads();
        const int g0 = (int)((long long)groups * th / nt), g1 = (int)((long long)groups * (th + 1) / nt);
        if (g1 > g0) f(out, ldo, w, dtype, acts, cols, g0, g1, n);
    }
}

/* The bits of the AMX tiles against the AVX-512 steps' — the int formats' (only = -1) or bf16's
 * (only = CB_BF16) —: the cases that differ. */
static int check_bits(int emulated, const char *label, int only) {
    const int dtypes[] = {CB_INT8, CB_INT4, CB_INT6, CB_MXFP4, CB_BF16};
    const int shapes[][3] = {{64, 128, 8}, {64, 128, 16}, {72, 256, 17}, {128, 1056, 33}, {136, 4096, 100},
                             {64, 2048, 64}, {48, 512, 7}, {256, 1024, 250}};
    int fails = 0, cases = 0;
    for (size_t d = 0; d < sizeof dtypes / sizeof *dtypes; d++)
        for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
            if (dtypes[d] == CB_BF16 && !(cb_cpu.avx512_bf16 && (emulated || cb_cpu.amx_bf16))) continue;
            if ((only == CB_BF16) != (dtypes[d] == CB_BF16)) continue;
            const cb_itile_fn ref_tile = reference_tile(dtypes[d]), amx = amx_tile(dtypes[d], emulated);
            const int rows = shapes[s][0], cols = shapes[s][1], n = shapes[s][2], ldo = rows + 8;
            size_t bytes;
            char *w = make_weights(dtypes[d], rows, cols, &bytes);
            cb_act_q8 *acts = make_acts(n, cols);
            float *ref = malloc(sizeof(float) * (size_t)n * ldo), *got = malloc(sizeof(float) * (size_t)n * ldo);
            for (int variant = 0; variant < 3; variant++) {
                const int groups = rows / CB_TGROUP;
                const int g0 = variant == 1 ? 1 : 0, threads = variant == 2 ? 3 : 1;
                for (size_t i = 0; i < (size_t)n * ldo; i++) ref[i] = got[i] = -12345.0f;
                if (threads == 1) {
                    ref_tile(ref, ldo, w, dtypes[d], acts, cols, g0, groups, n);
                    amx(got, ldo, w, dtypes[d], acts, cols, g0, groups, n);
                } else {
                    product(ref_tile, ref, ldo, w, dtypes[d], acts, rows, cols, n, threads);
                    product(amx, got, ldo, w, dtypes[d], acts, rows, cols, n, threads);
                }
                cases++;
                if (memcmp(ref, got, sizeof(float) * (size_t)n * ldo) != 0) {
                    fails++;
                    size_t i = 0;      /* the first output whose bits differ (+0 and -0 compare equal) */
                    while (memcmp(&ref[i], &got[i], sizeof(float)) == 0) i++;
                    printf("bits %s MISMATCH %s rows %d cols %d n %d g0 %d threads %d: first at token %zu output %zu: "
                           "%.9g vs %.9g\n", label, dtype_name(dtypes[d]), rows, cols, n, g0, threads, i / ldo, i % ldo,
                           ref[i], got[i]);
                }
            }
            free(ref); free(got); free(w);
            free_acts(acts, n);
        }
    printf("bits %s: %d of %d cases the same bits as the AVX512-VNNI (bf16: AVX512_BF16, order %s) tile\n", label,
           cases - fails, cases, cb_bf16_order_names[cb_bf16_order]);
    return fails;
}

/* Where the bf16 tile misses vdpbf16ps's bits: the split orders in turn, the first whose bits it
 * gives kept in cb_bf16_order (as import's self-test does); the order's name, or NULL (back to seq). */
static const char *find_bf16_order(int emulated, const char *label) {
    if (check_bits(emulated, label, CB_BF16) == 0) return cb_bf16_order_names[CB_BF16_SEQ];
    for (int order = CB_BF16_SPLIT_SUM; order < CB_BF16_ORDERS; order++) {
        cb_bf16_order = order;
        if (check_bits(emulated, label, CB_BF16) == 0) {
            printf("bf16 order %s: %s (the unit sums TDPBF16PS's even and odd products apart)\n", label, cb_bf16_order_names[order]);
            return cb_bf16_order_names[order];
        }
    }
    cb_bf16_order = CB_BF16_SEQ;
    printf("bf16 order %s: none of the orders (the bf16 tile stays off)\n", label);
    return NULL;
}

/* The step through the kernel table: dispatch.h's self-test with the AMX step (hardware or
 * emulated), then cb_matmul (its threads, the interleaved job split) with the AMX step against the
 * AVX512-VNNI step, bit for bit. */
static int check_dispatch(int step, const char *label) {
    cb_set_amx_granted(1);
    int fails = 0;
    const int code = cb_self_test_step(CB_ISA_AVX512, step);   /* (leaves the table at the step) */
    printf("dispatch %s: self-test %s (code %d%s)\n", label, code == 0 ? "passed" : "FAILED", code,
           cb_selftest_is_amx_bf16_check(code) ? ": a check of the bf16 products tile" : "");
    fails += code != 0;
    const int dtypes[] = {CB_INT8, CB_INT4, CB_INT6, CB_MXFP4, CB_BF16};
    const int shapes[][3] = {{1024, 2048, 40}, {768, 2048, 16}, {2056, 512, 77}};
    const int threads[] = {1, 4, 16};
    int cases = 0, same = 0;
    for (size_t d = 0; d < 5; d++)
        for (size_t s = 0; s < 3; s++) {
            if (dtypes[d] == CB_BF16 && !cb_amx_bf16_installed()) {      /* (the step's table) */
                if (s == 0) printf("dispatch %s: no AMX bf16 products tile in the table\n", label);
                continue;
            }
            const int rows = shapes[s][0], cols = shapes[s][1], n = shapes[s][2];
            size_t bytes;
            char *w = make_weights(dtypes[d], rows, cols, &bytes);
            cb_act_q8 *acts = make_acts(n, cols);
            float *x = malloc(sizeof(float) * (size_t)n * cols);
            for (size_t i = 0; i < (size_t)n * cols; i++) x[i] = ((int)(rnd() % 20001) - 10000) * 1e-4f;
            float *ref = malloc(sizeof(float) * (size_t)n * rows), *got = malloc(sizeof(float) * (size_t)n * rows);
            for (size_t h = 0; h < 3; h++) {
                cb_select_kernels(CB_ISA_AVX512, CB_INT_STEP_AVX512VNNI);
                cb_matmul(ref, rows, w, dtypes[d], CB_INTERLEAVED, x, cols, acts, n, rows, cols, threads[h]);
                if (cb_select_kernels(CB_ISA_AVX512, step) != 0) { printf("dispatch %s: step refused\n", label); return 1; }
                cb_matmul(got, rows, w, dtypes[d], CB_INTERLEAVED, x, cols, acts, n, rows, cols, threads[h]);
                cases++;
                same += memcmp(ref, got, sizeof(float) * (size_t)n * rows) == 0;
            }
            free(x); free(ref); free(got); free(w);
            free_acts(acts, n);
        }
    printf("dispatch %s: %d of %d products through cb_matmul the AVX512-VNNI step's bits\n", label, same, cases);
    return fails + (cases - same);
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* With cfg loaded and tiles 0-3 from buf (A, tile 0, at a_stride bytes a row), C tiles 4-7 zeroed:
 * `iters` rounds of BODY (4 tile products of 16 x 16 x K), their rate printed as `label`. */
#define AMX_PEAK(label, unit, K, a_stride, BODY)                                                          \
    do {                                                                                                  \
        CB_AMX_HW_LOADCFG(&cfg);                                                                          \
        CB_AMX_HW_LOAD(0, buf, a_stride); CB_AMX_HW_LOAD(1, buf, 64);                                     \
        CB_AMX_HW_LOAD(2, buf, 64); CB_AMX_HW_LOAD(3, buf, 64);                                           \
        CB_AMX_HW_ZERO(4); CB_AMX_HW_ZERO(5); CB_AMX_HW_ZERO(6); CB_AMX_HW_ZERO(7);                       \
        const double t0 = now();                                                                          \
        for (long i = 0; i < iters; i++) { BODY; }                                                        \
        const double dt = now() - t0;                                                                     \
        CB_AMX_HW_RELEASE();                                                                              \
        printf("peak %s: %.1f %s one core (%.2f ns an instruction)\n", label,                            \
               4.0 * iters * 16 * 16 * (K) * 2 / dt * 1e-9, unit, dt / (4.0 * iters) * 1e9);              \
    } while (0)

/* The tile unit's peaks, 4 independent products a round: TDPBSSD 16x16x64 and at the int step's
 * shape (K = 32: one block), TDPBF16PS 16x16x32 (16 pairs: the bf16 tile's shape). */
static void peaks(void) {
    cb_amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    static int8_t buf[1024] __attribute__((aligned(64)));
    for (int i = 0; i < 1024; i++) buf[i] = (int8_t)(rnd() % 7);
    const long iters = 2000000;
    AMX_PEAK("tdpbssd 16x16x64", "GOP/s", 64, 64,
             CB_AMX_HW_DPBSSD(4, 0, 1); CB_AMX_HW_DPBSSD(5, 0, 2); CB_AMX_HW_DPBSSD(6, 1, 3); CB_AMX_HW_DPBSSD(7, 2, 3));
    for (int t = 1; t < 4; t++) { cfg.rows[t] = 8; cfg.colsb[t] = 64; }      /* A 16 x 32 bytes, B 8 x 64 */
    cfg.rows[0] = 16; cfg.colsb[0] = 32;
    AMX_PEAK("tdpbssd 16x16x32 (the step's shape)", "GOP/s", 32, 32,
             CB_AMX_HW_DPBSSD(4, 0, 1); CB_AMX_HW_DPBSSD(5, 0, 2); CB_AMX_HW_DPBSSD(6, 0, 3); CB_AMX_HW_DPBSSD(7, 0, 1));
    if (!cb_cpu.amx_bf16) return;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    for (int i = 0; i < 512; i++) ((uint16_t *)buf)[i] = 0x3C00;   /* 2^-7: small sums */
    AMX_PEAK("tdpbf16ps 16x16x32", "GFLOP/s", 32, 64,
             CB_AMX_HW_DPBF16PS(4, 0, 2); CB_AMX_HW_DPBF16PS(5, 1, 3); CB_AMX_HW_DPBF16PS(6, 0, 2); CB_AMX_HW_DPBF16PS(7, 1, 3));
}
#undef AMX_PEAK

CB_TARGET_AVX512_BF16 static void peak_bf16(void) {
    if (!cb_cpu.avx512_bf16) return;
    __m512 acc[12];
    for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_ps((float)i);
    const __m512bh a = cb_as_bf16x32(_mm512_set1_epi16(0x3C00)), b = cb_as_bf16x32(_mm512_set1_epi16(0x3C00));
    const long iters = 20000000;
    double t0 = now();
    for (long k = 0; k < iters; k++) {
        for (int i = 0; i < 12; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
        __asm__ volatile("" : "+v"(acc[0]), "+v"(acc[1]), "+v"(acc[2]), "+v"(acc[3]), "+v"(acc[4]), "+v"(acc[5]));
    }
    double dt = now() - t0;
    float sink = 0;
    for (int i = 0; i < 12; i++) sink += _mm512_reduce_add_ps(acc[i]);
    printf("peak vdpbf16ps zmm: %.1f GFLOP/s one core (sink %g)\n", 12.0 * iters * 32 * 2 / dt * 1e-9, (double)sink);
}

CB_TARGET_AVX512_VNNI static void peak_vnni(void) {
    __m512i acc[12];
    for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_epi32(i);
    const __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(-2);
    const long iters = 20000000;
    double t0 = now();
    for (long k = 0; k < iters; k++) {
        for (int i = 0; i < 12; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], u, s);
        __asm__ volatile("" : "+v"(acc[0]), "+v"(acc[1]), "+v"(acc[2]), "+v"(acc[3]), "+v"(acc[4]), "+v"(acc[5]));
    }
    double dt = now() - t0;
    int32_t sink = 0;
    for (int i = 0; i < 12; i++) sink += _mm512_reduce_add_epi32(acc[i]);
    printf("peak vpdpbusd zmm: %.1f GOP/s one core (sink %d)\n", 12.0 * iters * 64 * 2 / dt * 1e-9, sink);
}

static int parse_list(const char *s, int *out, int max) {
    int k = 0;
    while (*s && k < max) {
        out[k++] = atoi(s);
        s = strchr(s, ',');
        if (!s) break;
        s++;
    }
    return k;
}

int main(int argc, char **argv) {
    int emulated = 0, hardware_only = 0, reps = 5, rows = 2048, cols = 4096, unit = -1;
    int threads[8] = {1}, nthreads = 1, tokens[16] = {8, 16, 32, 64, 128, 512}, ntokens = 6;
    int dtypes[5] = {CB_INT8, CB_INT4}, ndtypes = 2;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--emulated")) emulated = 1;
        else if (!strcmp(argv[i], "--hardware-only")) hardware_only = 1;
        else if (!strcmp(argv[i], "--emulated-unit") && i + 1 < argc) {
            const char *name = argv[++i];
            for (int o = 0; o < CB_BF16_ORDERS; o++)
                if (!strcmp(name, cb_bf16_order_names[o])) unit = o;
            if (unit < 0) { fprintf(stderr, "amx_check: unknown order %s\n", name); return 2; }
        }
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) nthreads = parse_list(argv[++i], threads, 8);
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) ntokens = parse_list(argv[++i], tokens, 16);
        else if (!strcmp(argv[i], "--shape") && i + 1 < argc) sscanf(argv[++i], "%dx%d", &rows, &cols);
        else if (!strcmp(argv[i], "--dtypes") && i + 1 < argc) {
            const char *s = argv[++i];
            ndtypes = 0;
            if (strstr(s, "int8")) dtypes[ndtypes++] = CB_INT8;
            if (strstr(s, "int4")) dtypes[ndtypes++] = CB_INT4;
            if (strstr(s, "int6")) dtypes[ndtypes++] = CB_INT6;
            if (strstr(s, "mxfp4")) dtypes[ndtypes++] = CB_MXFP4;
            if (strstr(s, "bf16")) dtypes[ndtypes++] = CB_BF16;
        } else {
            fprintf(stderr, "amx_check: unknown argument %s\n", argv[i]);
            return 2;
        }
    }
    if (emulated && hardware_only) {
        fprintf(stderr, "amx_check: --hardware-only is for a run on AMX hardware, not with --emulated\n");
        return 2;
    }
    cb_init_tables();
    printf("pipeline: store delay %d, lookahead %d, %d blocks a chunk; bf16: %d group pair%s a pass, %d chunks\n",
           CB_AMX_STORE_DELAY, CB_AMX_LOOKAHEAD, CB_AMX_KBLOCKS, CB_AMX_BF16_PAIRS, CB_AMX_BF16_PAIRS > 1 ? "s" : "",
           CB_AMX_BF16_CHUNKS);
    cb_cpu = cb_detect_cpu();
    cb_test_steps_bind(cb_step_parts_of_kernels());
    cb_int_kernels emulated_step;
    if (cb_test_step_kernels(CB_INT_STEP_AMX_EMULATED, &emulated_step) == 0)
        cb_install_int_step(CB_INT_STEP_AMX_EMULATED, &emulated_step);
    if (emulated) {
        cb_amx_emu_unit_order = unit;
        const int fails = check_bits(1, "amx-emulated", -1) + !find_bf16_order(1, "amx-emulated");
        return fails + check_dispatch(CB_INT_STEP_AMX_EMULATED, "amx-emulated") ? 1 : 0;
    }
    unsigned long mask = 0;
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0 || syscall(SYS_arch_prctl, 0x1022, &mask) != 0 || !(mask & (1ul << 18))) {
        fprintf(stderr, "amx_check: the OS did not lend the tile state (arch_prctl XTILEDATA)\n");
        return 1;
    }
    int fails = hardware_only ? 0 : check_bits(1, "amx-emulated", -1) + !find_bf16_order(1, "amx-emulated");
    cb_bf16_order = CB_BF16_SEQ;
    fails += check_bits(0, "amx", -1) + !find_bf16_order(0, "amx");     /* (the unit's order kept) */
    fails += check_dispatch(CB_INT_STEP_AMX, "amx");
    peaks();
    peak_vnni();
    peak_bf16();
    fflush(stdout);
    for (int d = 0; d < ndtypes; d++) {
        if (dtypes[d] == CB_BF16 && !(cb_cpu.avx512_bf16 && cb_cpu.amx_bf16)) {
            printf("prefill bf16: this CPU has no AMX-BF16 or AVX512_BF16\n");
            continue;
        }
        const cb_itile_fn ref_tile = timed_reference_tile(dtypes[d]), amx = amx_tile(dtypes[d], 0);
        size_t bytes;
        char *w = make_weights(dtypes[d], rows, cols, &bytes);
        for (int ti = 0; ti < ntokens; ti++) {
            const int n = tokens[ti];
            cb_act_q8 *acts = make_acts(n, cols);
            float *out = aligned_alloc(64, sizeof(float) * (size_t)n * rows);
            for (int h = 0; h < nthreads; h++) {
                double tv[64], ta[64];
                const int r = reps < 64 ? reps : 64;
                product(ref_tile, out, rows, w, dtypes[d], acts, rows, cols, n, threads[h]);
                product(amx, out, rows, w, dtypes[d], acts, rows, cols, n, threads[h]);
                for (int k = 0; k < r; k++) {
                    double t0 = now();
                    product(ref_tile, out, rows, w, dtypes[d], acts, rows, cols, n, threads[h]);
                    double t1 = now();
                    product(amx, out, rows, w, dtypes[d], acts, rows, cols, n, threads[h]);
                    double t2 = now();
                    tv[k] = t1 - t0;
                    ta[k] = t2 - t1;
                }
                qsort(tv, r, sizeof(double), cmp_double);
                qsort(ta, r, sizeof(double), cmp_double);
                const double ops = 2.0 * rows * (double)cols * n;
                printf("prefill %s %dx%d tokens %d threads %d: avx512 %.1f GOP/s, amx %.1f GOP/s, amx/avx512 %.2f\n",
                       dtype_name(dtypes[d]), rows, cols, n, threads[h], ops / tv[r / 2] * 1e-9, ops / ta[r / 2] * 1e-9,
                       tv[r / 2] / ta[r / 2]);
                fflush(stdout);
            }
            free(out);
            free_acts(acts, n);
        }
        free(w);
    }
    return fails ? 1 : 0;
}
