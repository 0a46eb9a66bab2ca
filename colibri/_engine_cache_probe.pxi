# The expert cache alone, for the tests (included by _engine.pyx, which compiles the cache).

cdef class CacheProbe:
    """The expert cache of csrc/expert_cache.h alone, over `lengths` bytes of experts carved from
    one anonymous region (so the readers' real advice calls act on real pages), for the tests:
    drive it with layer / use / prefetch / done and read its state back."""
    cdef cb_expert_cache *c
    cdef object keep              # the numpy arrays the cache points into, and the region
    cdef public object resident   # uint8 [n]
    cdef public object fresh      # uint8 [n]
    cdef public object stats      # int64 [CB_CS_N]

    def __init__(self, lengths, long long budget, str policy="lru", advice=None):
        from colibri import _os
        n = len(lengths)
        page = _os.page_size()
        lengths = [(int(x) + page - 1) // page * page for x in lengths]
        region = _os.zeros(max(sum(lengths), page), np.uint8, align=page)
        pages = np.zeros((n, 2), np.uint64)
        offset = 0
        for i, length in enumerate(lengths):
            pages[i] = (region.ctypes.data + offset, length)
            offset += length
        self.resident = np.zeros(n, np.uint8)
        self.fresh = np.zeros(n, np.uint8)
        self.stats = np.zeros(len(CACHE_STATS), np.int64)
        last_use = np.zeros(n, np.int64)
        freq = np.zeros(n, np.float32)
        fds = np.full(n, -1, np.int32)
        self.keep = [region, pages, last_use, freq, fds]
        self.c = cache_new(pages, fds, self.resident, self.fresh, last_use, freq, self.stats, budget, policy,
                           _os.engine_advice() if advice is None else advice, _os.cache_advice(), 0)

    def layer(self):
        cb_cache_layer(self.c)

    def use(self, int i, bint read=True):
        cb_cache_use(self.c, i, read)

    def prefetch(self, int i):
        cb_cache_prefetch(self.c, i)

    def done(self, int i):
        cb_cache_done(self.c, i)

    def hold(self, int i):
        return cb_cache_hold(self.c, i)

    def drain(self):
        with nogil:
            cb_cache_drain(self.c)

    @property
    def bytes(self):
        return self.c.bytes, self.c.peak

    def close(self):
        cdef cb_expert_cache *c = self.c
        self.c = NULL
        if c != NULL:
            with nogil:
                cb_cache_stop(c)
            free(c)

    def __dealloc__(self):
        self.close()
