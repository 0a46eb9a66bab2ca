/* cache_check.c — the expert cache (csrc/expert_cache.h) built for Windows and run under Wine by
 * tests/test_windows_build.py: its reader threads (CreateThread, SRW locks, condition variables)
 * start, run, drain and stop, and the policy evicts what it should. Built for Linux too (the same
 * source, POSIX threads) so that the two can be compared. Prints one line; exit 0 when right. */
#include <stdio.h>
#include <stdlib.h>

#include "expert_cache.h"

#define N 4
#define PAGE 4096

int main(void) {
    static char pages[N][PAGE];
    cb_range_entry spans[N];
    int32_t fds[N] = {-1, -1, -1, -1};
    uint8_t resident[N] = {0}, fresh[N] = {0};
    int64_t last_use[N] = {0}, stats[CB_CS_N] = {0};
    float freq[N] = {0};
    for (int i = 0; i < N; i++) {
        spans[i].VirtualAddress = pages[i];
        spans[i].NumberOfBytes = PAGE;
    }
    cb_expert_cache *c = calloc(1, sizeof *c);
    if (c == NULL) return 2;
    c->n = N;
    c->pages = spans;
    c->fds = fds;
    c->resident = resident;
    c->fresh = fresh;
    c->last_use = last_use;
    c->freq = freq;
    c->stats = stats;
    c->budget = 2 * PAGE;                     /* room for two of the four */
    if (cb_cache_start(c) != 0) return 3;
    for (int round = 0; round < 50; round++)  /* the readers see work come and go */
        for (int i = 0; i < N; i++) {
            cb_cache_layer(c);
            cb_cache_use(c, i, 1);
            cb_cache_prefetch(c, (i + 1) % N);
        }
    cb_cache_drain(c);
    cb_cache_stop(c);
    printf("resident %d%d%d%d evictions %lld reads %lld\n", resident[0], resident[1], resident[2], resident[3],
           (long long)stats[CB_CS_EVICTIONS], (long long)stats[CB_CS_READ_CALLS]);
    free(c);
    return resident[0] + resident[1] + resident[2] + resident[3] == 2 && stats[CB_CS_EVICTIONS] > 0 ? 0 : 1;
}
