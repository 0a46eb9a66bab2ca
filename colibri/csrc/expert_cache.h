/* expert_cache.h — which experts hold memory, under a byte budget, and the reader that fetches them.
 *
 * Design
 * ------
 * Every expert is its own mapped file (colibri.modeldir). Under a memory cap the page cache of
 * those files is what the cap counts, so an expert that is not in use must leave it, and an
 * expert about to be used should be read before the layer loop reaches it:
 *
 *   - The layer loop (the engine thread, _engine.pyx) tells the cache what it does: `cb_cache_layer`
 *     when a layer's routing begins (the experts used before may go), `cb_cache_use` for each
 *     expert it is about to compute, `cb_cache_prefetch` for one it expects soon (the next layer's
 *     predicted experts, the next expert of a prefill) and `cb_cache_done` when a prefill product
 *     is over (that expert may go first). These only update the bookkeeping under a mutex and
 *     queue work: the loop never waits for the OS.
 *   - Admitting an expert that does not fit evicts others: first a prefetched one its layer did
 *     not use (a wrong guess), then the coldest by the policy (LRU, or LFU with aging: a use adds
 *     1, and every `n` uses all counts halve); never one of the current layer's or one prefetched
 *     since it began. The victims' drops are queued ahead of everything, the new expert's read
 *     after them: the pages leave before new ones come (the plan's margin holds one expert for
 *     the loop's own page faults, which may run ahead of the readers).
 *   - CB_CACHE_READERS reader threads (POSIX threads or Win32) run the read queue in order. A
 *     read is split in pieces of CB_CACHE_PIECE bytes that the readers take in parallel (storage
 *     serves several requests at once faster than one), one advice call each on the expert's
 *     span: madvise MADV_POPULATE_READ where the kernel has it, else MADV_WILLNEED;
 *     PrefetchVirtualMemory on Windows. A read of an expert evicted since it was queued is
 *     skipped. A drop is MADV_DONTNEED on the span, then POSIX_FADV_DONTNEED on its file, so the
 *     page cache lets it go too; an expert being read is dropped by the reader that finishes it.
 *
 * Nothing here is needed for correctness: a dropped page that the loop touches again is read
 * back by a page fault. The OS functions come from colibri._os (ctypes) as addresses, like
 * os_hints.h's. All counters are int64 in `stats` [CB_CS_N] (numpy memory owned by the engine).
 */
#ifndef COLIBRI_EXPERT_CACHE_H
#define COLIBRI_EXPERT_CACHE_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "os_hints.h"

#ifdef _WIN32
#include <windows.h>
typedef SRWLOCK cb_mutex;
typedef CONDITION_VARIABLE cb_cond;
typedef HANDLE cb_thread;
#define cb_mutex_init(m) InitializeSRWLock(m)
#define cb_mutex_lock(m) AcquireSRWLockExclusive(m)
#define cb_mutex_unlock(m) ReleaseSRWLockExclusive(m)
#define cb_mutex_destroy(m) ((void)0)
#define cb_cond_init(c) InitializeConditionVariable(c)
#define cb_cond_wait(c, m) SleepConditionVariableSRW(c, m, INFINITE, 0)
#define cb_cond_broadcast(c) WakeAllConditionVariable(c)
#define cb_cond_destroy(c) ((void)0)
#else
#include <pthread.h>
typedef pthread_mutex_t cb_mutex;
typedef pthread_cond_t cb_cond;
typedef pthread_t cb_thread;
#define cb_mutex_init(m) pthread_mutex_init(m, NULL)
#define cb_mutex_lock(m) pthread_mutex_lock(m)
#define cb_mutex_unlock(m) pthread_mutex_unlock(m)
#define cb_mutex_destroy(m) pthread_mutex_destroy(m)
#define cb_cond_init(c) pthread_cond_init(c, NULL)
#define cb_cond_wait(c, m) pthread_cond_wait(c, m)
#define cb_cond_broadcast(c) pthread_cond_broadcast(c)
#define cb_cond_destroy(c) pthread_cond_destroy(c)
#endif

enum { CB_EVICT_LRU = 0, CB_EVICT_LFU = 1 };                 /* colibri._engine.EVICTION_CODES */

enum {                       /* counters, stats[CB_CS_*] (colibri._engine.CS_*) */
    CB_CS_HITS = 0,          /* uses of an expert that was admitted (resident or being read) */
    CB_CS_MISSES,            /* uses of one that was not: the loop reads it by page faults */
    CB_CS_PREFETCHES,        /* experts admitted by a prefetch */
    CB_CS_PREFETCH_HITS,     /* uses of an expert a prefetch admitted, its first since */
    CB_CS_EVICTIONS,         /* experts evicted to stay under the budget */
    CB_CS_WASTED,            /* of which a prefetch admitted and nothing used */
    CB_CS_OVER_BUDGET,       /* admissions that found nothing to evict (every expert in use) */
    CB_CS_READ_CALLS,        /* OS read advice calls */
    CB_CS_READ_BYTES,        /* bytes they covered */
    CB_CS_DROPS,             /* experts dropped from the page cache */
    CB_CS_FAILURES,          /* advice calls the OS refused (never fatal) */
    CB_CS_N
};

#define CB_CACHE_QUEUE 16384 /* jobs waiting for the readers at most (a full queue drops reads) */
#define CB_CACHE_READERS 4   /* reader threads: storage serves several requests at once faster */
#define CB_CACHE_PIECE (2u << 20)   /* bytes of an expert one read job covers */

typedef struct {
    uintptr_t fadvise;       /* posix_fadvise (0: the page cache is not told) */
    int dontneed;            /* POSIX_FADV_DONTNEED */
    int read_arg;            /* the madvise code of a read: MADV_POPULATE_READ or MADV_WILLNEED */
} cb_cache_os;

typedef int (*cb_fadvise_fn)(int fd, int64_t offset, int64_t len, int advice);

typedef struct {
    int n;                   /* experts: index = layer * n_experts + e */
    const cb_range_entry *pages;  /* [n] each expert's mapped span (length 0: not an expert) */
    const int32_t *fds;      /* [n] a descriptor of its file, or -1 */
    uint8_t *resident;       /* [n] admitted (counted in `bytes`) */
    uint8_t *fresh;          /* [n] admitted by a prefetch and not used since */
    int64_t *last_use;       /* [n] the clock at its last use or admission */
    float *freq;             /* [n] uses, aged */
    int64_t budget;          /* bytes of experts admitted at most */
    int64_t bytes;           /* bytes admitted now */
    int64_t peak;            /* the most bytes admitted at once */
    int64_t clock;           /* +1 per use, admission and layer */
    int64_t layer_start;     /* the clock when the current layer began: what is newer is in use */
    int64_t uses;            /* since the last aging */
    int policy;
    int64_t *stats;          /* [CB_CS_N] */
    cb_os_advice advice;     /* will_need (with os.read_arg) and release */
    cb_cache_os os;
    size_t chunk;            /* bytes per read advice call (0: no limit) */
    int64_t queue[CB_CACHE_QUEUE];  /* job = expert << 32 | piece << 1 | (1: drop, 0: read) */
    int head, count, busy, stop, started;
    int32_t *inflight;       /* [n] read pieces of each expert running now */
    uint8_t *pending_drop;   /* [n] a drop that waits for them */
    cb_mutex lock;
    cb_cond wake;            /* the readers: work arrived, or stop */
    cb_cond idle;            /* cb_cache_drain: the queue is empty and every reader waits */
    cb_thread thread[CB_CACHE_READERS];
} cb_expert_cache;

static void cb_cache_push_front(cb_expert_cache *c, int64_t job) {   /* with the lock held */
    if (c->count == CB_CACHE_QUEUE) {                          /* full: a drop replaces the last read */
        if (job & 1) c->queue[(c->head + c->count - 1) % CB_CACHE_QUEUE] = job;
        return;
    }
    c->head = (c->head + CB_CACHE_QUEUE - 1) % CB_CACHE_QUEUE;
    c->queue[c->head] = job;
    c->count++;
    cb_cond_broadcast(&c->wake);
}

static void cb_cache_push(cb_expert_cache *c, int64_t job) {  /* with the lock held */
    if (c->count == CB_CACHE_QUEUE) return;                    /* full: the loop's faults read it */
    c->queue[(c->head + c->count) % CB_CACHE_QUEUE] = job;
    c->count++;
    cb_cond_broadcast(&c->wake);
}

/* One job per piece; urgent (the loop needs it now): ahead of everything queued, in order. */
static void cb_cache_push_read(cb_expert_cache *c, int i, int urgent) {
    size_t len = c->pages[i].NumberOfBytes;
    int64_t pieces = (int64_t)((len + CB_CACHE_PIECE - 1) / CB_CACHE_PIECE);
    for (int64_t k = 0; k < pieces; k++) {
        int64_t p = urgent ? pieces - 1 - k : k;
        int64_t job = ((int64_t)i << 32) | (p << 1);
        if (urgent && c->count < CB_CACHE_QUEUE) cb_cache_push_front(c, job);
        else cb_cache_push(c, job);
    }
}

static int cb_cache_drop_now(cb_expert_cache *c, int i) {      /* without the lock; 1 if it failed */
    const cb_range_entry *r = &c->pages[i];
    int failed = cb_release_pages(&c->advice, r->VirtualAddress, r->NumberOfBytes) != 0;
    if (c->os.fadvise && c->fds[i] >= 0)
        failed |= ((cb_fadvise_fn)c->os.fadvise)(c->fds[i], 0, 0, c->os.dontneed) != 0;
    return failed;
}

/* Run one read job; called and returning with the lock held (released around the OS call). A
 * drop of an expert some piece of which is being read waits for that read (the reader that
 * finishes it drops it), so that no page read after the drop stays in the page cache uncounted. */
static void cb_cache_run_job(cb_expert_cache *c, int64_t job) {
    int i = (int)(job >> 32);
    const cb_range_entry *r = &c->pages[i];
    if (r->NumberOfBytes == 0) return;
    if (job & 1) {                                              /* a drop */
        if (c->resident[i]) return;                            /* admitted again since */
        if (c->inflight[i]) { c->pending_drop[i] = 1; return; }
        cb_mutex_unlock(&c->lock);
        int failed = cb_cache_drop_now(c, i);
        cb_mutex_lock(&c->lock);
        c->stats[CB_CS_DROPS]++;
        c->stats[CB_CS_FAILURES] += failed;
        return;
    }
    if (!c->resident[i]) return;                                /* evicted since */
    size_t off = (size_t)((job >> 1) & 0x7fffffff) * CB_CACHE_PIECE;
    size_t len = r->NumberOfBytes - off < CB_CACHE_PIECE ? r->NumberOfBytes - off : CB_CACHE_PIECE;
    c->inflight[i]++;
    cb_mutex_unlock(&c->lock);
    cb_os_advice a = c->advice;
    a.will_need_arg = c->os.read_arg;
    int failed = cb_will_need(&a, (const char *)r->VirtualAddress + off, len, c->chunk) != 0;
    cb_mutex_lock(&c->lock);
    c->stats[CB_CS_READ_CALLS]++;
    c->stats[CB_CS_READ_BYTES] += (int64_t)len;
    c->stats[CB_CS_FAILURES] += failed;
    if (--c->inflight[i] == 0 && c->pending_drop[i]) {
        c->pending_drop[i] = 0;
        if (!c->resident[i]) {
            cb_mutex_unlock(&c->lock);
            failed = cb_cache_drop_now(c, i);
            cb_mutex_lock(&c->lock);
            c->stats[CB_CS_DROPS]++;
            c->stats[CB_CS_FAILURES] += failed;
        }
    }
}

#ifdef _WIN32
static DWORD WINAPI cb_cache_reader(void *arg)
#else
static void *cb_cache_reader(void *arg)
#endif
{
    cb_expert_cache *c = (cb_expert_cache *)arg;
    cb_mutex_lock(&c->lock);
    for (;;) {
        while (c->count == 0 && !c->stop) {
            if (c->busy == 0) cb_cond_broadcast(&c->idle);
            cb_cond_wait(&c->wake, &c->lock);
        }
        if (c->count == 0) break;                              /* stop, and nothing left to do */
        int64_t job = c->queue[c->head];
        c->head = (c->head + 1) % CB_CACHE_QUEUE;
        c->count--;
        c->busy++;                                             /* readers running a job */
        cb_cache_run_job(c, job);
        c->busy--;
    }
    if (c->busy == 0) cb_cond_broadcast(&c->idle);
    cb_mutex_unlock(&c->lock);
#ifdef _WIN32
    return 0;
#else
    return NULL;
#endif
}

static void cb_cache_stop(cb_expert_cache *c);

/* Start the readers. 0, or -1 if the memory or a thread could not be had (nothing runs then). */
static int cb_cache_start(cb_expert_cache *c) {
    c->inflight = (int32_t *)calloc((size_t)c->n, sizeof(int32_t));
    c->pending_drop = (uint8_t *)calloc((size_t)c->n, 1);
    if (!c->inflight || !c->pending_drop) {
        free(c->inflight);
        free(c->pending_drop);
        return -1;
    }
    cb_mutex_init(&c->lock);
    cb_cond_init(&c->wake);
    cb_cond_init(&c->idle);
    for (int t = 0; t < CB_CACHE_READERS; t++) {
#ifdef _WIN32
        c->thread[t] = CreateThread(NULL, 0, cb_cache_reader, c, 0, NULL);
        if (c->thread[t] == NULL) break;
#else
        if (pthread_create(&c->thread[t], NULL, cb_cache_reader, c) != 0) break;
#endif
        c->started++;
    }
    if (c->started == 0) {
        free(c->inflight);
        free(c->pending_drop);
        return -1;
    }
    return 0;
}

/* Wait until every queued job has run (tests, statistics, before the mappings go). */
static void cb_cache_drain(cb_expert_cache *c) {
    if (!c->started) return;
    cb_mutex_lock(&c->lock);
    while (c->count || c->busy) cb_cond_wait(&c->idle, &c->lock);
    cb_mutex_unlock(&c->lock);
}

/* Run what is queued, then stop and join the readers. */
static void cb_cache_stop(cb_expert_cache *c) {
    if (!c->started) return;
    cb_mutex_lock(&c->lock);
    c->stop = 1;
    cb_cond_broadcast(&c->wake);
    cb_mutex_unlock(&c->lock);
    for (int t = 0; t < c->started; t++) {
#ifdef _WIN32
        WaitForSingleObject(c->thread[t], INFINITE);
        CloseHandle(c->thread[t]);
#else
        pthread_join(c->thread[t], NULL);
#endif
    }
    c->started = 0;
    free(c->inflight);
    free(c->pending_drop);
    cb_mutex_destroy(&c->lock);
    cb_cond_destroy(&c->wake);
    cb_cond_destroy(&c->idle);
}

/* The coldest expert that is not in use, or -1. A prefetched expert that the layer it was read
 * for did not use (a wrong prediction: `fresh` and older than this layer) goes first, whatever
 * the policy: it is not popular, it was only guessed. */
static int cb_cache_victim(const cb_expert_cache *c) {        /* with the lock held */
    int best = -1;
    for (int i = 0; i < c->n; i++) {
        if (!c->resident[i] || c->last_use[i] >= c->layer_start) continue;
        if (best < 0) { best = i; continue; }
        if (c->fresh[i] != c->fresh[best]) {
            if (c->fresh[i]) best = i;
            continue;
        }
        if (c->policy == CB_EVICT_LFU
                ? (c->freq[i] < c->freq[best] || (c->freq[i] == c->freq[best] && c->last_use[i] < c->last_use[best]))
                : c->last_use[i] < c->last_use[best])
            best = i;
    }
    return best;
}

#define CB_CACHE_MAX_VICTIMS 64   /* evictions one admission makes at most (then it runs over budget) */

/* Admit expert i, evicting until it fits; the victims go to victims [CB_CACHE_MAX_VICTIMS] for the
 * caller to drop. Returns how many. With the lock held. */
static int cb_cache_admit(cb_expert_cache *c, int i, int *victims) {
    int64_t need = (int64_t)c->pages[i].NumberOfBytes;
    int nv = 0;
    while (c->bytes + need > c->budget) {
        int v = nv < CB_CACHE_MAX_VICTIMS ? cb_cache_victim(c) : -1;
        if (v < 0) { c->stats[CB_CS_OVER_BUDGET]++; break; }
        c->resident[v] = 0;
        c->bytes -= (int64_t)c->pages[v].NumberOfBytes;
        c->stats[CB_CS_EVICTIONS]++;
        c->stats[CB_CS_WASTED] += c->fresh[v];
        c->fresh[v] = 0;
        victims[nv++] = v;
    }
    c->resident[i] = 1;
    c->bytes += need;
    if (c->bytes > c->peak) c->peak = c->bytes;
    return nv;
}

/* Queue the victims' drops ahead of everything, so that they run before the read of the expert
 * that evicted them (queued first, by the caller): the pages leave before new ones come. The
 * loop's thread never makes the calls itself — fadvise's page-cache drop waits on every CPU
 * (lru_add_drain_all), which the compute threads hold. With the lock held. */
static void cb_cache_queue_drops(cb_expert_cache *c, const int *victims, int nv) {
    for (int j = 0; j < nv; j++) cb_cache_push_front(c, ((int64_t)victims[j] << 32) | 1);
}

/* A layer's routing begins: the experts used before it may be evicted from now on. */
static void cb_cache_layer(cb_expert_cache *c) {
    cb_mutex_lock(&c->lock);
    c->layer_start = ++c->clock;
    cb_mutex_unlock(&c->lock);
}

/* The loop is about to compute expert i. read: also queue a read of it (the reader's one large
 * request runs beside the loop's page faults). */
static void cb_cache_use(cb_expert_cache *c, int i, int read) {
    int victims[CB_CACHE_MAX_VICTIMS], nv = 0, missed;
    cb_mutex_lock(&c->lock);
    missed = !c->resident[i];
    if (!missed) {
        c->stats[CB_CS_HITS]++;
        c->stats[CB_CS_PREFETCH_HITS] += c->fresh[i];
    } else {
        c->stats[CB_CS_MISSES]++;
        nv = cb_cache_admit(c, i, victims);
    }
    c->fresh[i] = 0;
    c->last_use[i] = ++c->clock;
    c->freq[i] += 1.0f;
    if (++c->uses >= c->n) {                                     /* aging: old popularity fades */
        for (int j = 0; j < c->n; j++) c->freq[j] *= 0.5f;
        c->uses = 0;
    }
    if (missed) {
        if (read) cb_cache_push_read(c, i, 1);                   /* at the front ... */
        cb_cache_queue_drops(c, victims, nv);                    /* ... and the drops before it */
    }
    cb_mutex_unlock(&c->lock);
}

/* Expert i is expected soon: admit it and queue its read (nothing if it is admitted already). */
static void cb_cache_prefetch(cb_expert_cache *c, int i) {
    int victims[CB_CACHE_MAX_VICTIMS], nv = 0, admitted = 0;
    cb_mutex_lock(&c->lock);
    if (!c->resident[i]) {
        nv = cb_cache_admit(c, i, victims);
        c->fresh[i] = 1;
        c->last_use[i] = ++c->clock;
        c->stats[CB_CS_PREFETCHES]++;
        admitted = 1;
    }
    if (admitted) {
        cb_cache_queue_drops(c, victims, nv);                    /* the drops first, the read last */
        cb_cache_push_read(c, i, 0);
    }
    cb_mutex_unlock(&c->lock);
}

/* The bytes of expert i's span (what admitting it counts against the budget). */
static int64_t cb_cache_expert_bytes(const cb_expert_cache *c, int i) { return (int64_t)c->pages[i].NumberOfBytes; }

/* A prefill product of expert i is over: it is the first to go if room is needed (a prompt
 * streams each expert once). */
static void cb_cache_done(cb_expert_cache *c, int i) {
    cb_mutex_lock(&c->lock);
    c->last_use[i] = c->layer_start - 1 - (c->n - i);          /* older than this layer, in index order */
    cb_mutex_unlock(&c->lock);
}

/* At load: expert i is in memory already (a warm page cache). Admit it if it fits without an
 * eviction; 1 if it was admitted. */
static int cb_cache_hold(cb_expert_cache *c, int i) {
    cb_mutex_lock(&c->lock);
    int64_t need = (int64_t)c->pages[i].NumberOfBytes;
    int fits = !c->resident[i] && c->bytes + need <= c->budget;
    if (fits) {
        c->resident[i] = 1;
        c->bytes += need;
        if (c->bytes > c->peak) c->peak = c->bytes;
        c->last_use[i] = ++c->clock;
    }
    cb_mutex_unlock(&c->lock);
    return fits;
}

#endif /* COLIBRI_EXPERT_CACHE_H */
