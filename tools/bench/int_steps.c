/* The AVX2 integer steps' ceilings on one core, in inline assembly (no compiler scheduling or
 * register spills between the instructions and the measurement): independent chains of
 *   vpmaddubsw / vpmaddwd / vpaddw / vpsignb / vpunpcklbw / vpmovsxbw / vfmadd231ps alone
 *   (instructions a second),
 *   vpmaddubsw and vpmaddwd interleaved (do they share the multiply pipes?),
 *   vpmaddwd beside vpsignb, vpunpcklbw or vpmovsxbw (which of them take the multiply pipes?),
 *   the int8 step of the interleaved tile: vpsignb, vpmaddubsw, vpmaddwd, vpaddd (32 products),
 *   the int4 step: vpmaddubsw, vpaddw (32 products, int16 sums),
 *   an int16 step: vpmaddwd, vpaddd (16 products of words: int8 widened to int16 without the signs),
 * reported as G instructions or G steps a second and GOP/s (2 x products) for one thread.
 *
 *     gcc -O2 tools/bench/int_steps.c -o /tmp/int_steps && /tmp/int_steps
 *
 * (The run-time probe colibri/csrc/probes.h times the int8 step in C, with more vectors live
 * than the 16 registers: it reads below these figures.) x86-64 with AVX2 and FMA only. */
#include <stdio.h>
#include <time.h>

#define ITERS 100000000L

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define CLOBBERS "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
                 "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "cc"
/* 10 independent one-instruction chains a loop */
#define ONE(NAME, INS)                                                                                   \
    static void NAME(long n) {                                                                           \
        __asm__ volatile("vpxor %%ymm15, %%ymm15, %%ymm15\n1:\n" INS("0") INS("1") INS("2") INS("3")      \
                         INS("4") INS("5") INS("6") INS("7") INS("8") INS("9") "dec %0\njnz 1b\n"         \
                         : "+r"(n)::CLOBBERS);                                                           \
    }
/* 6 independent two-register steps a loop (i: scratch, j: accumulator) */
#define SIX(NAME, INS)                                                                                   \
    static void NAME(long n) {                                                                           \
        __asm__ volatile("vpxor %%ymm15, %%ymm15, %%ymm15\nvpxor %%ymm14, %%ymm14, %%ymm14\n1:\n"         \
                         INS("0", "8") INS("1", "9") INS("2", "10") INS("3", "11") INS("4", "12")          \
                         INS("5", "13") "dec %0\njnz 1b\n"                                                \
                         : "+r"(n)::CLOBBERS);                                                           \
    }
#define MADDUBS(i) "vpmaddubsw %%ymm15, %%ymm" i ", %%ymm" i "\n"
#define MADDWD(i) "vpmaddwd %%ymm15, %%ymm" i ", %%ymm" i "\n"
#define ADDW(i) "vpaddw %%ymm15, %%ymm" i ", %%ymm" i "\n"
#define SIGNB(i) "vpsignb %%ymm15, %%ymm" i ", %%ymm" i "\n"
#define UNPCK(i) "vpunpcklbw %%ymm15, %%ymm" i ", %%ymm" i "\n"
#define MOVSX(i) "vpmovsxbw %%xmm15, %%ymm" i "\n"
#define FMA(i) "vfmadd231ps %%ymm15, %%ymm15, %%ymm" i "\n"
#define MIXED(i, j) "vpmaddubsw %%ymm15, %%ymm" i ", %%ymm" i "\nvpmaddwd %%ymm15, %%ymm" j ", %%ymm" j "\n"
#define INT8_STEP(i, j) "vpsignb %%ymm14, %%ymm15, %%ymm" i "\nvpmaddubsw %%ymm" i ", %%ymm15, %%ymm" i "\n" \
                        "vpmaddwd %%ymm14, %%ymm" i ", %%ymm" i "\nvpaddd %%ymm" i ", %%ymm" j ", %%ymm" j "\n"
#define INT16_STEP(i, j) "vpmaddwd %%ymm14, %%ymm15, %%ymm" i "\nvpaddd %%ymm" i ", %%ymm" j ", %%ymm" j "\n"
#define MADD_SIGN(i, j) "vpmaddwd %%ymm15, %%ymm" i ", %%ymm" i "\nvpsignb %%ymm15, %%ymm" j ", %%ymm" j "\n"
#define MADD_UNPCK(i, j) "vpmaddwd %%ymm15, %%ymm" i ", %%ymm" i "\nvpunpcklbw %%ymm15, %%ymm" j ", %%ymm" j "\n"
#define MADD_MOVSX(i, j) "vpmaddwd %%ymm15, %%ymm" i ", %%ymm" i "\nvpmovsxbw %%xmm15, %%ymm" j "\n"
#define INT4_STEP(i, j) "vpmaddubsw %%ymm14, %%ymm15, %%ymm" i "\nvpaddw %%ymm" i ", %%ymm" j ", %%ymm" j "\n"
ONE(run_maddubs, MADDUBS)
ONE(run_maddwd, MADDWD)
ONE(run_addw, ADDW)
ONE(run_fma, FMA)
ONE(run_signb, SIGNB)
ONE(run_unpck, UNPCK)
ONE(run_movsx, MOVSX)
SIX(run_mixed, MIXED)
SIX(run_int8, INT8_STEP)
SIX(run_int4, INT4_STEP)
SIX(run_int16, INT16_STEP)
SIX(run_madd_sign, MADD_SIGN)
SIX(run_madd_unpck, MADD_UNPCK)
SIX(run_madd_movsx, MADD_MOVSX)

static double timed(void (*f)(long), double per_loop) {
    double best = 1e9;
    for (int r = 0; r < 3; r++) {
        const double t0 = now();
        f(ITERS);
        const double t = now() - t0;
        best = t < best ? t : best;
    }
    return ITERS * per_loop / best / 1e9;
}

int main(void) {
    printf("vpmaddubsw alone            %6.2f G/s\n", timed(run_maddubs, 10));
    printf("vpmaddwd alone              %6.2f G/s\n", timed(run_maddwd, 10));
    printf("vpaddw alone                %6.2f G/s\n", timed(run_addw, 10));
    printf("vpsignb alone               %6.2f G/s\n", timed(run_signb, 10));
    printf("vpunpcklbw alone            %6.2f G/s\n", timed(run_unpck, 10));
    printf("vpmovsxbw ymm, xmm alone    %6.2f G/s\n", timed(run_movsx, 10));
    printf("vfmadd231ps alone           %6.2f G/s\n", timed(run_fma, 10));
    printf("vpmaddubsw + vpmaddwd       %6.2f G multiplies/s\n", timed(run_mixed, 12));
    printf("vpmaddwd + vpsignb          %6.2f G pairs/s\n", timed(run_madd_sign, 6));
    printf("vpmaddwd + vpunpcklbw       %6.2f G pairs/s\n", timed(run_madd_unpck, 6));
    printf("vpmaddwd + vpmovsxbw        %6.2f G pairs/s\n", timed(run_madd_movsx, 6));
    const double s8 = timed(run_int8, 6), s4 = timed(run_int4, 6), s16 = timed(run_int16, 6);
    printf("int8 step (sign, maddubs, madd, add) %6.2f G steps/s = %6.1f GOP/s\n", s8, s8 * 64);
    printf("int4 step (maddubs, add16)           %6.2f G steps/s = %6.1f GOP/s\n", s4, s4 * 64);
    printf("int16 step (madd, add; 16 products)  %6.2f G steps/s = %6.1f GOP/s\n", s16, s16 * 32);
    return 0;
}
