/* Memory read bandwidth: sum a buffer much larger than the last-level cache with T OpenMP
 * threads, each reading its own contiguous slice (as the engines' matvec threads do).
 *
 *   gcc -O3 -march=native -fopenmp readbw.c -o readbw && ./readbw [MiB=1024] [passes=10] [threads]
 *
 * Prints one JSON object: the best and median pass in GB/s (1e9 bytes/s) and every pass. The
 * buffer is written once first (so its pages exist, touched by the thread that reads them). */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? (size_t)atol(argv[1]) : 1024;
    int passes = argc > 2 ? atoi(argv[2]) : 10;
    if (argc > 3) omp_set_num_threads(atoi(argv[3]));
    size_t n = mib * 1024 * 1024 / sizeof(uint64_t);
    uint64_t *a = aligned_alloc(4096, n * sizeof(uint64_t));
    if (!a || passes < 1) return 1;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) a[i] = i;
    double *gbs = malloc(passes * sizeof(double)), *sorted = malloc(passes * sizeof(double));
    uint64_t sink = 0;
    int threads = 1;
    for (int p = 0; p < passes; p++) {
        uint64_t s = 0;
        double t0 = omp_get_wtime();
#pragma omp parallel for schedule(static) reduction(+ : s)
        for (size_t i = 0; i < n; i++) s += a[i];
        double dt = omp_get_wtime() - t0;
        threads = omp_get_max_threads();
        gbs[p] = sorted[p] = (double)(n * sizeof(uint64_t)) / dt / 1e9;
        sink += s;
    }
    qsort(sorted, passes, sizeof(double), cmp);
    printf("{\"threads\": %d, \"bytes\": %zu, \"best_gbs\": %.3f, \"median_gbs\": %.3f, \"passes_gbs\": [",
           threads, n * sizeof(uint64_t), sorted[passes - 1], sorted[passes / 2]);
    for (int p = 0; p < passes; p++) printf("%s%.3f", p ? ", " : "", gbs[p]);
    printf("], \"checksum\": %llu}\n", (unsigned long long)sink);
    return 0;
}
