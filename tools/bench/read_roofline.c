/* The machine's read roofline: how fast T threads can stream a buffer far past the last-level
 * cache, by the ways a decode kernel could read it, over the kinds of memory a model's weights
 * can live in. Decode reads every active weight once a token, so the best of these is the
 * ceiling decode is held to (issue "decode at the memory's speed"); the plain loop is what
 * `python -m colibri bench --read-bandwidth` times.
 *
 *   gcc -O3 -march=native -fopenmp tools/bench/read_roofline.c -o /tmp/read_roofline
 *   /tmp/read_roofline [MiB=1024] [passes=7] [file=/tmp/read_roofline.bin]
 *
 * Ways of reading (each thread its own contiguous slice, as the engines' matvec threads split rows):
 *   plain      64-bit loads the compiler vectorizes, one stream per thread
 *   vec        512-bit (or 256-bit) loads, four accumulators, one stream
 *   streamsK   the slice cut in K parts read side by side (K streams per thread, as a matvec over
 *              K rows at once reads them)
 *   pfD        vec plus a software prefetch D bytes ahead (prefetcht0)
 *   ntaD       the same with prefetchnta (no cache pollution)
 * Memory: anonymous 4 KB pages (MADV_NOHUGEPAGE), anonymous 2 MB pages (MADV_HUGEPAGE), a file
 * mapped read-only from the page cache (how Colibri maps weights; 4 KB pages there).
 * The memory kinds and ways take turns pass by pass (the host's bandwidth drifts with its
 * neighbours: one timed apart from the others would carry the drift); the three buffers are held
 * at once (3 x MiB). Prints one JSON object: per memory kind, threads
 * and way, the median and best GB/s (1e9 bytes/s) over the passes.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifdef __AVX512F__
typedef __m512i vec_t;
#define VLOAD(p) _mm512_load_si512((const void *)(p))
#define VXOR(a, b) _mm512_xor_si512(a, b)
#define VZERO() _mm512_setzero_si512()
#define VFOLD(v) ((uint64_t)_mm512_reduce_add_epi64(v))
#else
typedef __m256i vec_t;
#define VLOAD(p) _mm256_load_si256((const __m256i *)(p))
#define VXOR(a, b) _mm256_xor_si256(a, b)
#define VZERO() _mm256_setzero_si256()
static uint64_t VFOLD(__m256i v) {
    uint64_t l[4];
    _mm256_storeu_si256((__m256i *)l, v);
    return l[0] + l[1] + l[2] + l[3];
}
#endif
#define VB ((long)sizeof(vec_t))

static uint64_t read_plain(const uint8_t *p, long n) {
    const uint64_t *q = (const uint64_t *)p;
    uint64_t s = 0;
    for (long i = 0; i < n / 8; i++) s += q[i];
    return s;
}

static uint64_t read_vec(const uint8_t *p, long n, long pf, int nta) {
    vec_t a = VZERO(), b = VZERO(), c = VZERO(), d = VZERO();
    for (long i = 0; i < n; i += 4 * VB) {
        if (pf)                       /* every 64-byte line of this step's loads, pf bytes ahead */
            for (long line = 0; line < 4 * VB; line += 64) {
                if (nta) _mm_prefetch((const char *)p + i + pf + line, _MM_HINT_NTA);
                else _mm_prefetch((const char *)p + i + pf + line, _MM_HINT_T0);
            }
        a = VXOR(a, VLOAD(p + i));
        b = VXOR(b, VLOAD(p + i + VB));
        c = VXOR(c, VLOAD(p + i + 2 * VB));
        d = VXOR(d, VLOAD(p + i + 3 * VB));
    }
    return VFOLD(VXOR(VXOR(a, b), VXOR(c, d)));
}

static uint64_t read_streams(const uint8_t *p, long n, int k) {
    long part = n / k / (2 * VB) * (2 * VB);
    vec_t acc[16];
    for (int s = 0; s < k; s++) acc[s] = VZERO();
    for (long i = 0; i < part; i += 2 * VB)
        for (int s = 0; s < k; s++) {
            const uint8_t *q = p + (long)s * part + i;
            acc[s] = VXOR(acc[s], VXOR(VLOAD(q), VLOAD(q + VB)));
        }
    vec_t t = VZERO();
    for (int s = 0; s < k; s++) t = VXOR(t, acc[s]);
    return VFOLD(t);
}

typedef struct { const char *name; int kind; long arg; } way_t;   /* kind 0 plain, 1 vec, 2 streams, 3 pf, 4 nta */

static uint64_t run_way(const way_t *w, const uint8_t *p, long n, int threads) {
    uint64_t total = 0;
    #pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long slice = n / nt / (16 * VB) * (16 * VB);
        const uint8_t *q = p + (long)t * slice;
        switch (w->kind) {
        case 0: total += read_plain(q, slice); break;
        case 1: total += read_vec(q, slice, 0, 0); break;
        case 2: total += read_streams(q, slice, (int)w->arg); break;
        case 3: total += read_vec(q, slice, w->arg, 0); break;
        default: total += read_vec(q, slice, w->arg, 1); break;
        }
    }
    return total;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static uint8_t *memory(int kind, long n, const char *file) {
    if (kind == 2) {                  /* a file in the page cache, mapped read-only */
        int fd = open(file, O_RDWR | O_CREAT | O_TRUNC, 0600);
        if (fd < 0) return NULL;
        uint8_t *chunk = malloc(1 << 20);
        for (long i = 0; i < (1 << 20); i++) chunk[i] = (uint8_t)(i * 131);
        for (long off = 0; off < n; off += 1 << 20)
            if (write(fd, chunk, 1 << 20) != 1 << 20) return NULL;
        free(chunk);
        void *p = mmap(NULL, n, PROT_READ, MAP_SHARED, fd, 0);
        close(fd);
        return p == MAP_FAILED ? NULL : p;
    }
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    madvise(p, n, kind == 1 ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    #pragma omp parallel for schedule(static)
    for (long i = 0; i < n; i += 4096) ((uint8_t *)p)[i] = (uint8_t)i;   /* each page by a reader */
    return p;
}

int main(int argc, char **argv) {
    long n = (argc > 1 ? atol(argv[1]) : 1024) << 20;
    int passes = argc > 2 ? atoi(argv[2]) : 7;
    const char *file = argc > 3 ? argv[3] : "/tmp/read_roofline.bin";
    const way_t ways[] = {{"plain", 0, 0}, {"vec", 1, 0}, {"streams2", 2, 2}, {"streams4", 2, 4},
                          {"streams8", 2, 8}, {"pf256", 3, 256}, {"pf1024", 3, 1024}, {"pf4096", 3, 4096},
                          {"nta1024", 4, 1024}};
    const char *kinds[] = {"anon-4k", "anon-2m", "file-4k"};
    int max_threads = omp_get_max_threads();
    uint64_t sink = 0;
    printf("{\"bytes\": %ld, \"passes\": %d, \"vector_bits\": %d, \"results\": [", n, passes, (int)(8 * VB));
    int first = 1;
    enum { NK = 3, NW = sizeof ways / sizeof *ways };
    uint8_t *mem[NK];
    for (int kind = 0; kind < NK; kind++)
        if (!(mem[kind] = memory(kind, n, file))) {
            fprintf(stderr, "no memory of kind %s\n", kinds[kind]);
            return 1;
        }
    double *gbs = malloc((size_t)NK * NW * passes * sizeof(double));      /* [kind][way][pass] */
    for (int threads = 1; threads <= max_threads; threads *= 2) {
        for (int kind = 0; kind < NK; kind++)                                /* warm passes */
            for (size_t w = 0; w < NW; w++) sink += run_way(&ways[w], mem[kind], n, threads);
        /* memory kinds and ways take turns, pass by pass: a host whose bandwidth drifts with its
         * neighbours moves them all alike */
        for (int r = 0; r < passes; r++)
            for (int kind = 0; kind < NK; kind++)
                for (size_t w = 0; w < NW; w++) {
                    double t0 = omp_get_wtime();
                    sink += run_way(&ways[w], mem[kind], n, threads);
                    gbs[((size_t)kind * NW + w) * passes + r] = (double)n / (omp_get_wtime() - t0) / 1e9;
                }
        for (int kind = 0; kind < NK; kind++)
            for (size_t w = 0; w < NW; w++) {
                double *g = gbs + ((size_t)kind * NW + w) * passes;
                qsort(g, passes, sizeof(double), cmp);
                printf("%s\n {\"memory\": \"%s\", \"threads\": %d, \"way\": \"%s\", \"median_gbs\": %.2f, "
                       "\"best_gbs\": %.2f}", first ? "" : ",", kinds[kind], threads, ways[w].name,
                       g[passes / 2], g[passes - 1]);
                first = 0;
            }
        fflush(stdout);
    }
    for (int kind = 0; kind < NK; kind++) munmap(mem[kind], n);
    unlink(file);
    printf("\n], \"checksum\": %llu}\n", (unsigned long long)sink);
    return 0;
}
