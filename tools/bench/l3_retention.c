/* l3_retention.c — can a hot buffer (an MoE's attention weights and head, read every token) stay in
 * the last-level cache while a larger stream (the token's experts) goes past it? Each repetition
 * reads the hot buffer, then the stream, with T OpenMP threads; the hot buffer's read rate says
 * whether it came from the cache (tens of GB/s above the stream's) or from memory (the same).
 *
 *   gcc -O2 -mavx512f -mclflushopt -fopenmp tools/bench/l3_retention.c -o /tmp/l3r
 *   /tmp/l3r HOT_MB STREAM_MB MODE DIST REPS       e.g. /tmp/l3r 20 200 1 2048 12
 *
 * MODE: 0 plain loads; 1 prefetchnta DIST bytes ahead of the stream's loads; 2 prefetcht0 DIST
 * ahead; 4 plain loads and clflushopt of the stream's lines DIST bytes behind (evicted before they
 * can be victims in L3). STREAM_MB 1: the hot buffer alone (the cache's own rate). The first
 * repetition is discarded. */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* The sum of buf's 64-bit words (bytes: a multiple of 256), with the stream's hints of `mode`. */
static long long read_all(const char *buf, size_t bytes, int mode, size_t dist) {
    long long sum = 0;
#pragma omp parallel for reduction(+ : sum) schedule(static)
    for (size_t i = 0; i < bytes; i += 256) {
        for (int l = 0; l < 4 && mode == 1; l++) _mm_prefetch(buf + i + dist + 64 * l, _MM_HINT_NTA);
        for (int l = 0; l < 4 && mode == 2; l++) _mm_prefetch(buf + i + dist + 64 * l, _MM_HINT_T0);
        __m512i v = _mm512_load_si512(buf + i);
        for (int l = 1; l < 4; l++) v = _mm512_add_epi64(v, _mm512_load_si512(buf + i + 64 * l));
        sum += _mm512_reduce_add_epi64(v);
        if (mode == 4 && i >= dist)
            for (int l = 0; l < 4; l++) _mm_clflushopt((void *)(buf + i - dist + 64 * l));
    }
    return sum;
}

int main(int argc, char **argv) {
    if (argc != 6 || atoi(argv[5]) < 2) {
        fprintf(stderr, "usage: %s HOT_MB STREAM_MB MODE DIST REPS (REPS >= 2: the first is discarded)\n", argv[0]);
        return 2;
    }
    const size_t hot_bytes = (size_t)atoi(argv[1]) << 20, stream_bytes = (size_t)atoi(argv[2]) << 20;
    const int mode = atoi(argv[3]), reps = atoi(argv[5]);
    const size_t dist = (size_t)atoi(argv[4]);
    char *hot = aligned_alloc(4096, hot_bytes), *stream = aligned_alloc(4096, (stream_bytes + dist + 4096) / 4096 * 4096);
    if (!hot || !stream) {
        fprintf(stderr, "%s: cannot allocate %zu + %zu bytes\n", argv[0], hot_bytes, stream_bytes + dist);
        return 1;
    }
    memset(hot, 1, hot_bytes);
    memset(stream, 2, stream_bytes + dist + 256);
    double t_hot = 0, t_stream = 0;
    long long sink = 0;
    for (int r = 0; r < reps; r++) {
        const double t0 = now();
        sink += read_all(hot, hot_bytes, 0, 0);
        const double t1 = now();
        sink += read_all(stream, stream_bytes, mode, dist);
        const double t2 = now();
        if (r > 0) {
            t_hot += t1 - t0;
            t_stream += t2 - t1;
        }
    }
    printf("mode %d dist %zu: hot %.1f GB/s, stream %.1f GB/s, %.2f ms a repetition (%lld)\n", mode, dist,
           hot_bytes * (reps - 1) / t_hot / 1e9, stream_bytes * (reps - 1) / t_stream / 1e9,
           (t_hot + t_stream) / (reps - 1) * 1e3, sink & 1);
    return 0;
}
