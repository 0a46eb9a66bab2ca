/* The host's own interruptions, without any engine: one process pinned to each CPU repeats a
 * fixed piece of arithmetic (about `ms` milliseconds, no memory traffic) and times every
 * repetition. A decoded token waits for its slowest thread at every barrier, so an interruption
 * of any one CPU is a slow token: what this finds bounds the P99 / P50 of `colibri bench`'s
 * per-token decode times from below on the same host.
 *
 *   gcc -O2 host_noise.c -o host_noise && ./host_noise [ms=4] [seconds=4] [cpus=all online]
 *
 * Prints one line per CPU: P50, P99, P99/P50 and the largest repetition in ms, how many took over
 * 1.15 x P50, and the median time between those (the period of a periodic interruption). */
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* One repetition: a dependent chain of multiply-adds, `steps` long. */
static double spin(long steps) {
    volatile double x = 1.0;
    for (long k = 0; k < steps; k++) x = x * 1.0000001 + 1e-9;
    return x;
}

static void probe(int cpu, double ms, double seconds) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set)) {
        fprintf(stderr, "host_noise: cannot pin to CPU %d\n", cpu);
        exit(1);
    }
    long steps = 100000;                       /* calibrate: steps for about `ms` */
    for (double t = 0; t < ms * 1e-3 / 2;) {
        const double t0 = now();
        spin(steps);
        t = now() - t0;
        if (t < ms * 1e-3 / 2) steps *= 2;
    }
    const double t0 = now();
    spin(steps);
    steps = (long)((double)steps * ms * 1e-3 / (now() - t0));
    const int n = (int)(seconds * 1e3 / ms) > 10 ? (int)(seconds * 1e3 / ms) : 10;
    double *at = malloc(sizeof(double) * n), *took = malloc(sizeof(double) * n), *sorted = malloc(sizeof(double) * n);
    double *gaps = malloc(sizeof(double) * n);
    if (!at || !took || !sorted || !gaps) exit(1);
    for (int i = 0; i < n; i++) {
        at[i] = now();
        spin(steps);
        took[i] = now() - at[i];
        sorted[i] = took[i];
    }
    qsort(sorted, n, sizeof(double), cmp);
    const double p50 = sorted[n / 2], p99 = sorted[(int)(0.99 * (n - 1))];
    int slow = 0, ngaps = 0;
    double last = -1.0;
    for (int i = 0; i < n; i++)
        if (took[i] > 1.15 * p50) {
            slow++;
            if (last >= 0) gaps[ngaps++] = at[i] - last;
            last = at[i];
        }
    qsort(gaps, ngaps, sizeof(double), cmp);
    char period[64] = "";
    if (ngaps) snprintf(period, sizeof period, ", a median %.0f ms apart", 1e3 * gaps[ngaps / 2]);
    printf("cpu %d: %d x %.2f ms: P50 %.3f P99 %.3f P99/P50 %.3f max %.3f ms; %d over 1.15 x P50%s\n", cpu, n, ms,
           1e3 * p50, 1e3 * p99, p99 / p50, 1e3 * sorted[n - 1], slow, period);
}

int main(int argc, char **argv) {
    const double ms = argc > 1 ? atof(argv[1]) : 4.0, seconds = argc > 2 ? atof(argv[2]) : 4.0;
    const int cpus = argc > 3 ? atoi(argv[3]) : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (!(ms > 0) || !(seconds > 0) || cpus < 1) {
        fprintf(stderr, "usage: host_noise [ms > 0] [seconds > 0] [cpus >= 1]\n");
        return 2;
    }
    for (int c = 0; c < cpus; c++)
        if (fork() == 0) {
            probe(c, ms, seconds);
            fflush(stdout);
            _exit(0);
        }
    int status, failed = 0;
    while (wait(&status) > 0) failed |= !WIFEXITED(status) || WEXITSTATUS(status);
    return failed;
}
