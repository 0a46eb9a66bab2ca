/* A small decode matvec read from memory — a MoE router: f32 [rows, cols] — through cb_matmul on
 * `threads` threads, as the engine calls it once per layer and token. 128 copies of the matrix are
 * read in turn (128 MB for Qwen3-MoE's [128, 2048] router), so each call finds its weights in
 * memory, not in the caches, as decode does (its other weights pass through them in between).
 *
 *   gcc -O2 -fopenmp -Icolibri/csrc tools/bench/small_matvec.c -o /tmp/small_matvec -lm
 *   gcc -O2 -fopenmp -Icolibri/csrc -DCB_PARALLEL_MIN_BYTES=0x7fffffff tools/bench/small_matvec.c \
 *       -o /tmp/small_matvec_one -lm        # the threads' split by multiply-adds alone (before)
 *   /tmp/small_matvec 128 2048 2; /tmp/small_matvec_one 128 2048 2
 *
 * Prints the best and mean of 5 rounds (each the mean call over the 128 copies), in microseconds,
 * and the best's read rate. x86-64 (the best tier this CPU has). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dispatch.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: small_matvec ROWS COLS THREADS\n");
        return 2;
    }
    const int rows = atoi(argv[1]), cols = atoi(argv[2]), threads = atoi(argv[3]), copies = 128;
    if (rows < 1 || cols < 1 || threads < 1) {
        fprintf(stderr, "small_matvec: ROWS, COLS and THREADS must be positive\n");
        return 2;
    }
    cb_init_tables();
    for (int isa = CB_ISA_AVX512; isa >= CB_ISA_SCALAR && cb_select_isa(isa) < 0; isa--) {}
    const size_t n = (size_t)rows * cols;
    float *w = malloc(n * sizeof(float) * copies), *x = malloc(cols * sizeof(float)), *out = malloc(rows * sizeof(float));
    if (!w || !x || !out) return 1;
    for (size_t i = 0; i < n * copies; i++) w[i] = (float)(i % 97) * 0.01f;
    for (int i = 0; i < cols; i++) x[i] = 0.5f;
    double best = 1e9, total = 0, sink = 0;
    for (int r = 0; r < 5; r++) {
        double t = 0;
        for (int c = 0; c < copies; c++) {
            const double t0 = now();
            cb_matmul(out, rows, w + (size_t)c * n, CB_F32, CB_ROWS, x, cols, NULL, 1, rows, cols, threads);
            t += now() - t0;
            sink += out[0];
        }
        t /= copies;
        total += t;
        best = t < best ? t : best;
    }
    printf("f32 [%d, %d], %d thread(s): best %.1f us, mean %.1f us, %.1f GB/s (%g)\n", rows, cols, threads,
           best * 1e6, total / 5 * 1e6, n * sizeof(float) / best / 1e9, sink > 0 ? 1.0 : 0.0);
    return 0;
}
