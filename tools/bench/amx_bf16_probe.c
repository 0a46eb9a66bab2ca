/* amx_bf16_probe.c — which order of roundings AMX's TDPBF16PS (and AVX512_BF16's VDPBF16PS) follow
 * on this CPU, found by comparing the instructions' outputs with candidate definitions.
 *
 *   gcc -O2 -ffp-contract=off tools/bench/amx_bf16_probe.c -o /tmp/amx_bf16_probe
 *   /tmp/amx_bf16_probe [trials]
 *
 * Why: an AMX bf16 prompt tile can give the same bits as decode only if decode adds its products in
 * the tile unit's order, and Intel documents two different orders. The Intrinsics Guide's
 * pseudo-code for TDPBF16PS adds each pair's two products to the accumulator one after the other
 * (the even element first), as VDPBF16PS's does (there the odd one first) — which this Zen 4's
 * vdpbf16ps follows bit for bit. The SDM's later text keeps two partial sums per output, even and
 * odd products, each started from zero for every instruction, and adds them to the accumulator at
 * the instruction's end ("Count is in bfloat16 prior to horizontal"), in an order it does not spell
 * out here. Every bf16 x bf16 product is exact in float32 (8-bit significands), so the candidates
 * differ only in where the additions round; on inputs with cancellations a wrong candidate
 * disagrees in a large share of the outputs.
 *
 * Each candidate is a C function of (the accumulator, the instruction's pairs) evaluated in float32
 * with the products exact (the file must be built with -ffp-contract=off: a contracted fma would
 * change the candidates). Inputs: bf16 of random sign and exponent within 2^-4 .. 2^4 (the "fused"
 * candidates sum in double, exactly at these magnitudes), no subnormals; then one check each of
 * DAZ (a subnormal input taken as zero) and FTZ (a subnormal result flushed). Output: per
 * instruction, K (pairs an instruction) and candidate, how many outputs differ; "matches" names the
 * candidates that never differ, and for TDPBF16PS at K = 16 the engine's order of bf16 products that
 * follows (what its import self-test will choose). Needs x86-64 Linux; the tile part AMX-BF16 and
 * Linux 5.16+ (the tile state is asked for with arch_prctl, as colibri._os does), the vector part
 * AVX512_BF16.
 */
#define _GNU_SOURCE
#include <cpuid.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#if !defined(__x86_64__) || !defined(__GNUC__)
#error "amx_bf16_probe: x86-64 with GCC or clang"
#endif

enum { M = 16, N = 16, KMAX = 16 };     /* a full tile: 16 rows x 16 float32, 16 pairs an instruction */

/* ---- inputs ------------------------------------------------------------------------------------ */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}

static float bf16_value(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* random sign, exponent 2^-4 .. 2^4, random 7-bit mantissa */
static uint16_t random_bf16(void) {
    return (uint16_t)(((rnd() & 1u) << 15) | ((123u + rnd() % 9u) << 7) | (rnd() & 0x7Fu));
}

/* A [M][2K] (row m: pairs k of token m), B [K][2N] (row k: pairs of outputs n), C [M][N] */
static uint16_t A[M][2 * KMAX], B[KMAX][2 * N];
static float C0[M][N];

static void fill(int K) {
    for (int m = 0; m < M; m++)
        for (int i = 0; i < 2 * K; i++) A[m][i] = random_bf16();
    for (int k = 0; k < K; k++)
        for (int i = 0; i < 2 * N; i++) B[k][i] = random_bf16();
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) C0[m][n] = bf16_value(random_bf16()) * 16.0f;
}

/* ---- the candidates: C[m][n] after one instruction over pairs k0 .. k1-1 ------------------------- */

typedef float (*candidate_fn)(float c, int m, int n, int k0, int k1);

#define P(j) (bf16_value(A[m][2 * k + (j)]) * bf16_value(B[k][2 * n + (j)]))    /* exact in float32 */

/* the Intrinsics Guide's TDPBF16PS: pair by pair, the even product first, each addition rounded */
static float seq_even_first(float c, int m, int n, int k0, int k1) {
    for (int k = k0; k < k1; k++) { c = c + P(0); c = c + P(1); }
    return c;
}
/* VDPBF16PS's documented order: the odd product first */
static float seq_odd_first(float c, int m, int n, int k0, int k1) {
    for (int k = k0; k < k1; k++) { c = c + P(1); c = c + P(0); }
    return c;
}
/* the SDM's later TDPBF16PS: even and odd partial sums from zero, then combined ... */
static void split_sums(int m, int n, int k0, int k1, float *even, float *odd) {
    float e = 0.0f, o = 0.0f;
    for (int k = k0; k < k1; k++) { e = e + P(0); o = o + P(1); }
    *even = e;
    *odd = o;
}
static float split_sum_then_c(float c, int m, int n, int k0, int k1) {      /* ... c + (even + odd) */
    float e, o;
    split_sums(m, n, k0, k1, &e, &o);
    return c + (e + o);
}
static float split_c_even_odd(float c, int m, int n, int k0, int k1) {      /* ... (c + even) + odd */
    float e, o;
    split_sums(m, n, k0, k1, &e, &o);
    return (c + e) + o;
}
static float split_c_odd_even(float c, int m, int n, int k0, int k1) {      /* ... (c + odd) + even */
    float e, o;
    split_sums(m, n, k0, k1, &e, &o);
    return (c + o) + e;
}
/* a pair's two products added with one rounding, then to c with another */
static float pair_rounded(float c, int m, int n, int k0, int k1) {
    for (int k = k0; k < k1; k++) c = c + (P(0) + P(1));
    return c;
}
/* c and a pair's two products added with one rounding (exact in double at these magnitudes) */
static float pair_fused(float c, int m, int n, int k0, int k1) {
    for (int k = k0; k < k1; k++) c = (float)((double)c + (double)P(0) + (double)P(1));
    return c;
}
/* the whole instruction with one rounding */
static float all_fused(float c, int m, int n, int k0, int k1) {
    double s = c;
    for (int k = k0; k < k1; k++) s += (double)P(0) + (double)P(1);
    return (float)s;
}
#undef P

/* colibri: the engine's order of bf16 products (kernels_scalar.h, cb_bf16_order) in which its AMX
 * tile gives decode's bits where TDPBF16PS follows the candidate (the tile swaps each pair, so the
 * instruction's even element is the pair's higher input), or NULL: the tile stays off there. */
static const struct { const char *name; candidate_fn fn; const char *colibri; } candidates[] = {
    {"seq-even-first", seq_even_first, "seq"}, {"seq-odd-first", seq_odd_first, NULL},
    {"split:c+(e+o)", split_sum_then_c, "split-sum"}, {"split:(c+e)+o", split_c_even_odd, "split-even"},
    {"split:(c+o)+e", split_c_odd_even, "split-odd"},
    {"pair-rounded", pair_rounded, NULL}, {"pair-fused", pair_fused, NULL}, {"all-fused", all_fused, NULL},
};
enum { NCAND = sizeof candidates / sizeof *candidates };

/* ---- the instructions ------------------------------------------------------------------------------ */

typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* XCR0: the state the OS saves (0 where the OS has no XSAVE: nothing beyond SSE) */
static unsigned long long xcr0(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return 0;      /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}
static int have_amx_bf16(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    return ((d >> 22) & 1) && (xcr0() & 0x60000) == 0x60000;     /* AMX-BF16, the tile state enabled */
}
static int have_avx512_bf16(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return 0;
    return ((a >> 5) & 1) && (xcr0() & 0xE6) == 0xE6;            /* AVX512_BF16, the zmm state enabled */
}

/* out = C0 after one TDPBF16PS over pairs 0 .. K-1 (tiles: 0 = C, 1 = A, 2 = B) */
static void tile_product(float out[M][N], int K) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = M; cfg.colsb[0] = 4 * N;
    cfg.rows[1] = M; cfg.colsb[1] = (uint16_t)(4 * K);
    cfg.rows[2] = (uint8_t)K; cfg.colsb[2] = 4 * N;
    memcpy(out, C0, sizeof C0);
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm0" ::"r"((void *)out), "r"((long long)(4 * N)) : "memory");
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm1" ::"r"((void *)A), "r"((long long)sizeof A[0]) : "memory");
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm2" ::"r"((void *)B), "r"((long long)sizeof B[0]) : "memory");
    __asm__ volatile("tdpbf16ps %%tmm2, %%tmm1, %%tmm0" ::);
    __asm__ volatile("tilestored %%tmm0, (%0,%1,1)" ::"r"((void *)out), "r"((long long)(4 * N)) : "memory");
    __asm__ volatile("tilerelease" ::);
}

/* out[0][n] = C0[0][n] after K VDPBF16PS, one pair each (lane n: A row 0's pair k, B[k]'s pair n) */
__attribute__((target("avx512f,avx512bf16"))) static void vector_product(float out[M][N], int K) {
    __m512 acc = _mm512_loadu_ps(C0[0]);
    for (int k = 0; k < K; k++) {
        uint32_t a;
        memcpy(&a, &A[0][2 * k], 4);
        const __m512i av = _mm512_set1_epi32((int)a), bv = _mm512_loadu_si512((const void *)B[k]);
        __m512bh ab, bb;
        memcpy(&ab, &av, sizeof ab);
        memcpy(&bb, &bv, sizeof bb);
        acc = _mm512_dpbf16_ps(acc, ab, bb);
    }
    memcpy(out, C0, sizeof C0);
    _mm512_storeu_ps(out[0], acc);
}

/* Compare `trials` random fills of the instruction (tile: one TDPBF16PS of K pairs; vector: K
 * VDPBF16PS, each a candidate of one pair) with every candidate; print the differences. */
static void compare(const char *what, int tile, int K, int trials) {
    long differ[NCAND] = {0}, total = 0;
    static float got[M][N];
    for (int t = 0; t < trials; t++) {
        fill(K);
        if (tile) tile_product(got, K);
        else vector_product(got, K);
        const int rows = tile ? M : 1;
        for (int m = 0; m < rows; m++)
            for (int n = 0; n < N; n++) {
                total++;
                for (int c = 0; c < NCAND; c++) {
                    float want = C0[m][n];
                    if (tile) want = candidates[c].fn(want, m, n, 0, K);
                    else                                   /* one instruction a pair */
                        for (int k = 0; k < K; k++) want = candidates[c].fn(want, m, n, k, k + 1);
                    if (memcmp(&want, &got[m][n], sizeof want) != 0) differ[c]++;
                }
            }
    }
    printf("%s K=%d: %ld outputs;", what, K, total);
    for (int c = 0; c < NCAND; c++) printf(" %s %ld", candidates[c].name, differ[c]);
    printf("\n%s K=%d matches:", what, K);
    int any = 0;
    for (int c = 0; c < NCAND; c++)
        if (differ[c] == 0) { printf(" %s", candidates[c].name); any = 1; }
    printf("%s\n", any ? "" : " none of the candidates");
    if (!tile || K != KMAX) return;
    const char *order = NULL;          /* the engine's tile: one TDPBF16PS of KMAX pairs a lane */
    for (int c = 0; c < NCAND && !order; c++)
        if (differ[c] == 0) order = candidates[c].colibri;
    printf("%s K=%d: colibri's bf16 order %s\n", what, K,
           order ? order : "none (its AMX bf16 tile stays off: bf16 prompts take vdpbf16ps)");
}

/* DAZ: a subnormal input times 2^100 (0 if taken as zero); FTZ: 2^-70 x 2^-70 (0 if flushed). */
static void denormals(const char *what, int tile) {
    static float got[M][N];
    const uint16_t sub = 0x0001, big = (uint16_t)((127 + 100) << 7), tiny = (uint16_t)((127 - 70) << 7);
    const uint16_t in[2][2] = {{sub, big}, {tiny, tiny}};
    for (int i = 0; i < 2; i++) {
        memset(A, 0, sizeof A); memset(B, 0, sizeof B); memset(C0, 0, sizeof C0);
        A[0][0] = in[i][0];
        B[0][0] = in[i][1];
        if (tile) tile_product(got, 1);
        else vector_product(got, 1);
        printf("%s %s: %g (%s)\n", what, i == 0 ? "subnormal input x 2^100" : "2^-70 x 2^-70",
               (double)got[0][0], got[0][0] == 0.0f ? (i == 0 ? "DAZ" : "FTZ") : "kept");
    }
}

int main(int argc, char **argv) {
    const int trials = argc > 1 ? atoi(argv[1]) : 64;
    if (have_avx512_bf16()) {
        for (int K = 1; K <= KMAX; K *= 4) compare("vdpbf16ps", 0, K, trials);
        denormals("vdpbf16ps", 0);
    } else {
        printf("vdpbf16ps: this CPU has no AVX512_BF16\n");      /* (or the OS does not enable AVX-512) */
    }
    unsigned long mask = 0;
    if (!have_amx_bf16()) {
        printf("tdpbf16ps: this CPU has no AMX-BF16\n");        /* (or the OS does not enable its tiles) */
        return 0;
    }
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0 ||
        syscall(SYS_arch_prctl, 0x1022 /* ARCH_GET_XCOMP_PERM */, &mask) != 0 || !(mask & (1ul << 18))) {
        printf("tdpbf16ps: the OS did not lend the tile state (arch_prctl XTILEDATA)\n");
        return 1;
    }
    for (int K = 1; K <= KMAX; K *= 2) compare("tdpbf16ps", 1, K, trials);
    denormals("tdpbf16ps", 1);
    return 0;
}
