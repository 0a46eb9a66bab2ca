# The Engine's set-up, included by _engine.pyx: the scratch arena's and the KV cache's layouts
# (sized from the EngineSpec alone: planned_bytes, the memory plan's input), the Engine that
# allocates them once and fills the per-layer tables of pointers into the mapped weights, and the
# expert cache's start and stop. Nothing here runs per token.

cdef cb_expert_cache *cache_new(pages, fds, resident, fresh, last_use, freq, stats, long long budget, str policy,
                                advice, cache_os, size_t chunk) except NULL:
    """A started expert cache (csrc/expert_cache.h) over numpy arrays the caller keeps alive:
    pages uint64 [n, 2] (start, length), fds int32 [n], resident / fresh uint8 [n], last_use int64
    [n], freq float32 [n], stats int64 [CB_CS_N]; advice an _os.EngineAdvice, cache_os an
    _os.CacheAdvice. Free with cb_cache_stop + free."""
    cdef cb_expert_cache *c = <cb_expert_cache *>calloc(1, sizeof(cb_expert_cache))
    if c == NULL:
        raise MemoryError("cannot allocate the expert cache")
    c.n = len(fds)
    c.pages = <const cb_range_entry *><uintptr_t>pages.ctypes.data
    c.fds = <const int32_t *><uintptr_t>fds.ctypes.data
    c.resident = <uint8_t *><uintptr_t>resident.ctypes.data
    c.fresh = <uint8_t *><uintptr_t>fresh.ctypes.data
    c.last_use = <int64_t *><uintptr_t>last_use.ctypes.data
    c.freq = <float *><uintptr_t>freq.ctypes.data
    c.stats = <int64_t *><uintptr_t>stats.ctypes.data
    c.budget = budget
    c.policy = EVICTION_CODES[policy]
    kind, c.advice.will_need, c.advice.release, c.advice.will_need_arg, c.advice.release_arg = advice
    c.advice.kind = ADVICE_CODES[kind]
    c.os.fadvise, c.os.dontneed, c.os.read_arg = cache_os
    c.chunk = chunk
    if cb_cache_start(c) != 0:
        free(c)
        raise MemoryError("cannot start the expert cache's reader threads")
    return c


def _scratch_layout(spec):
    """The engine's scratch arena for `spec` (colibri.spec.EngineSpec): ({name: (shape, dtype)},
    the MoE wave's rows, the widest expert): rows [prefill_chunk] for the block inputs, [wave] for
    the MoE wave, plus the per-layer tables. Engine.__init__ allocates it; planned_bytes sizes it."""
    layers = spec.layers
    cdef int d = spec.d_model
    cdef int cap = spec.prefill_chunk
    cdef int n_heads = spec.n_heads
    cdef int n_layers = spec.n_layers
    cdef int n_experts = spec.n_experts
    cdef int top_k = spec.top_k
    cdef int n_ctx = spec.n_ctx
    cdef int q_dim = n_heads * max(f.head_dim for f in layers)
    cdef int kv_dim = max(f.n_kv_heads * f.head_dim for f in layers)
    max_ff = max([1] + [f.d_ff for f in layers])
    # MLA: the low-rank query, the heads' queries and values (1 where no layer has them)
    q_lora = max([1] + [f.q_lora for f in layers])
    mla_q = max([1] + [n_heads * f.qk_head for f in layers])
    mla_o = max([1] + [n_heads * f.v_head for f in layers])
    max_cols = max(d, q_dim, max_ff, q_lora, mla_o, 2 * d if spec.nextn else 1)
    wave = max(cap, MAX_SLOTS)
    f32 = np.float32
    specs = {
        "x": ((cap, d), f32), "xb": ((cap, d), f32), "xb2": ((cap, d), f32),
        "q": ((cap, q_dim), f32), "att": ((cap, q_dim), f32),
        "k": ((cap, kv_dim), f32), "v": ((cap, kv_dim), f32),
        # the attention's scores: a row per head (decode), or per thread a block of queries'
        "scores": ((kernels.attention_score_rows(n_heads, max(spec.n_threads, 1)) if cap > 1
                    else n_heads, n_ctx + 1), f32),
        "rx": ((cap, d), f32), "xe": ((cap, d), f32), "xm": ((cap, d), f32),
        "mla_qa": ((cap, q_lora), f32), "mla_q": ((cap, mla_q), f32), "mla_o": ((cap, mla_o), f32),
        "router": ((cap, n_experts), f32),
        "tok_chosen": ((cap, top_k), np.int32), "tok_w": ((cap, top_k), f32),
        "g": ((wave, d), f32), "y": ((wave, d), f32),
        "hb": ((wave, max_ff), f32), "hb2": ((wave, max_ff), f32),
        "rows": (wave, np.int32), "row_w": (wave, f32),
        "logits": (spec.vocab, f32),
        "chosen": ((n_layers, top_k), np.int32), "chosen_w": ((n_layers, top_k), f32),
        "counts": ((n_layers, n_experts), np.int64), "predicted": ((n_layers, top_k), np.int32),
        "prefetch_stats": (PF_N, np.int64),
        "router2": (n_experts, f32), "pred_w": (top_k, f32), "expert_m": (n_experts, np.int32),
        # the expert cache, index layer * n_experts + e
        "expert_pages": ((n_layers * n_experts, 2), np.uint64),     # (start, length) of its mapped file
        "cache_resident": (n_layers * n_experts, np.uint8), "cache_fresh": (n_layers * n_experts, np.uint8),
        "cache_last_use": (n_layers * n_experts, np.int64), "cache_freq": (n_layers * n_experts, f32),
        "cache_stats": (CB_CS_N, np.int64),
        "nextn_joined": ((cap, 2 * d if spec.nextn else 1), f32),
    }
    # activation quantization of the block inputs [cap] and of the wave rows [wave]
    for prefix, rows in (("acts", cap), ("wave_acts", wave)):
        specs.update({f"{prefix}.{k}": v for k, v in act_specs(rows, max_cols, spec.bf16_products).items()})
    return specs, wave, max_ff


def _kv_layout(spec):
    """(element dtype, [shape per layer]) of the KV cache for `spec`: per layer [n_seq,
    n_kv_heads, kv_ring, row] keys, and values of the same shape (an MLA layer's one latent array
    serves both). A row is a KV head's head_dim elements at one position; a q8 row is bytes: its
    f32 scale and head_dim codes (cb_kv_row_bytes)."""
    if spec.kv_cache not in KV_CODES:
        raise ValueError(f"kv_cache {spec.kv_cache!r}: one of {', '.join(KV_CODES)}")
    kv_code = KV_CODES[spec.kv_cache]
    shapes = []
    for f in spec.layers:
        if spec.kv_cache == "q8" and f.head_dim > kernels.CB_KV_Q8_MAX_HEAD_DIM:
            raise ColibriError(f"kv_cache q8 serves head_dim up to {kernels.CB_KV_Q8_MAX_HEAD_DIM}, "
                               f"this model's is {f.head_dim}: use f16")
        row = f.head_dim if spec.kv_cache != "q8" else cb_kv_row_bytes(f.head_dim, kv_code)
        shapes.append((spec.n_seq, f.n_kv_heads, f.kv_ring, row))
    return {"f32": np.float32, "f16": np.float16, "q8": np.uint8}[spec.kv_cache], shapes


def planned_bytes(spec) -> tuple:
    """(KV cache bytes, scratch bytes) that an Engine built from `spec` allocates, computed
    without building it (the memory plan's inputs): the same layouts Engine.__init__ allocates."""
    def nbytes(shape, dtype):
        return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    specs = _scratch_layout(spec)[0]
    kv_type, shapes = _kv_layout(spec)
    kv = sum(nbytes(shape, kv_type) * (1 if f.kv_rank else 2) for f, shape in zip(spec.layers, shapes))
    return kv, sum(nbytes(shape, dtype) for shape, dtype in specs.values())


cdef class Engine:
    """Owns the per-layer pointer table, the KV cache and the scratch arena of one model.

    Built from an EngineSpec (colibri.spec), whose TensorRefs point into mappings that must stay
    open for the Engine's lifetime: the caller (model.Model) owns them and closes them after it.
    """
    cdef Hyper h
    cdef Layer *layers          # [n_layers]
    cdef FFN *experts           # [n_layers * n_experts]
    cdef Mat embedding          # [vocab, d_model]
    cdef Mat lm_head            # [vocab, d_model] (the embedding when tied)
    cdef const float *final_norm  # [d_model]
    cdef Nextn nextn            # a multi-token-prediction block's input (spec.nextn; eh_proj.data NULL otherwise)
    cdef Scratch s
    cdef object _keep           # numpy views (memory from colibri._os) behind the scratch arena, KV cache, tables
    cdef public object logits   # np.ndarray float32 [vocab], a view of the scratch logits
    cdef public object chosen   # np.ndarray int32 [n_layers, top_k]
    cdef public object chosen_weights  # np.ndarray float32 [n_layers, top_k]
    cdef public object expert_counts   # np.ndarray int64 [n_layers, n_experts]
    cdef public object prefetch_stats  # np.ndarray int64 [PF_N]
    cdef public object spec            # the EngineSpec it was built from
    cdef public object scratch_bytes   # bytes of the scratch arena (its pages are touched as used)
    cdef public object cache_stats     # np.ndarray int64 [len(CACHE_STATS)], zeros without a cache
    cdef public object cache_resident  # np.ndarray uint8 [n_layers * n_experts]: admitted by the cache

    def __cinit__(self):
        self.layers = NULL
        self.experts = NULL
        self.s.acts = NULL
        self.s.wave_acts = NULL
        self.s.head_jobs = NULL
        self.s.cache = NULL

    def __init__(self, spec):
        """spec: colibri.spec.EngineSpec — the hyperparameters, each layer's geometry, the tensors'
        addresses and the run options, all derived there; here they are only checked and laid out:
        the hyperparameters, then the arena and the KV cache (allocated once), the scratch's
        pointers into them, the expert cache, and the tables of pointers into the weights."""
        self._set_hyper(spec)
        specs, wave, max_ff = _scratch_layout(spec)
        keep = self._allocate(spec, specs)
        self._bind_scratch(keep, wave, max_ff)
        for (pl, pe), (start, length) in spec.expert_pages.items():
            keep["expert_pages"][pl * spec.n_experts + pe] = (start, length)
        if spec.prefetch != PREFETCH_NONE or spec.expert_budget is not None:
            self._start_cache(spec, keep)
        self.cache_stats = keep["cache_stats"]
        self.cache_resident = keep["cache_resident"]
        self.logits = keep["logits"]
        self.chosen = keep["chosen"]
        self.chosen_weights = keep["chosen_w"]
        self.expert_counts = keep["counts"]
        self.prefetch_stats = keep["prefetch_stats"]
        self._bind_weights(spec, keep)

    cdef _set_hyper(self, spec):
        """Check the spec's shape and copy its hyperparameters into Hyper."""
        cdef int d = spec.d_model
        cdef int n_layers = spec.n_layers
        cdef int n_experts = spec.n_experts
        cdef int top_k = spec.top_k
        cdef int n_ctx = spec.n_ctx
        cdef int cap = spec.prefill_chunk
        cdef int n_seq = spec.n_seq
        if not 1 <= top_k <= MAX_TOP_K or n_experts < 1 or not 1 <= cap <= n_ctx or len(spec.layers) != n_layers \
                or not 1 <= n_seq <= cap:
            raise ValueError(f"inconsistent EngineSpec: top_k {top_k}, n_experts {n_experts}, "
                             f"prefill_chunk {cap}, n_ctx {n_ctx}, {len(spec.layers)} layers of {n_layers}, "
                             f"n_seq {n_seq} (1 .. prefill_chunk)")
        self.h.d_model = d
        self.h.n_layers = n_layers
        self.h.n_heads = spec.n_heads
        self.h.vocab = spec.vocab
        self.h.n_experts = n_experts
        self.h.top_k = top_k
        self.h.norm_topk_prob = spec.norm_topk_prob
        self.h.use_lut = spec.use_lut
        self.h.sigmoid_router = spec.sigmoid_router
        self.h.n_group = spec.n_group
        self.h.topk_group = spec.topk_group
        self.h.routed_scaling = spec.routed_scaling
        self.h.prefetch = spec.prefetch
        self.h.stream_prefill = spec.expert_budget is not None
        self.h.skip_missed = spec.skip_missed
        self.h.cache_routing = spec.cache_routing
        self.h.qk_norm = spec.qk_norm
        self.h.clip_qkv = spec.clip_qkv
        self.h.v_norm = spec.v_norm
        self.h.act = spec.act
        self.h.swiglu_alpha = spec.swiglu_alpha
        self.h.swiglu_limit = spec.swiglu_limit
        self.h.embed_scale = spec.embed_scale
        self.h.softcap = spec.softcap
        self.h.router_root = (<float>d) ** -0.5
        self.h.rms_eps = spec.rms_eps
        self.h.n_ctx = n_ctx
        self.h.n_seq = n_seq
        self.h.n_threads = max(spec.n_threads, 1)

    cdef dict _allocate(self, spec, dict specs):
        """The scratch arena (specs: _scratch_layout), the RoPE tables and the KV cache, checked
        against the spec's geometry; kept alive by self._keep. Returns the arrays by name."""
        cdef int n_ctx = spec.n_ctx
        cdef int cap = spec.prefill_chunk
        layers = spec.layers
        kv_type, kv_shapes = _kv_layout(spec)       # (checks the KV cache's type)
        self.h.kv = KV_CODES[spec.kv_cache]
        keep = arena(specs)
        self.spec = spec
        self.scratch_bytes = sum(a.nbytes for a in keep.values())
        for prefix in ("acts", "wave_acts"):
            keep[prefix] = [keep.get(f"{prefix}.{name}") for name in ACT_ARRAYS]
        keep["rope"] = [(np.ascontiguousarray(f.rope_cos, np.float32), np.ascontiguousarray(f.rope_sin, np.float32))
                        for f in layers]
        # KV cache (_kv_layout): a KV head's positions together, what the attention reads; each
        # sequence its own part; each layer its own pages: zero pages are only touched (made
        # resident) as positions are filled. A sliding layer's ring must hold its window plus one
        # prefill chunk.
        keep["k_cache"] = [zeros(shape, kv_type) for shape in kv_shapes]
        # an MLA layer's one array holds the latent rows its attention reads as keys and as values
        keep["v_cache"] = [k if f.kv_rank else zeros(shape, kv_type)
                           for f, k, shape in zip(layers, keep["k_cache"], kv_shapes)]
        keep["predicted"][...] = -1
        for f in layers:
            if not (f.kv_ring == n_ctx or (f.sliding_window > 0 and f.kv_ring >= f.sliding_window + cap)):
                raise ValueError(f"kv_ring {f.kv_ring} cannot hold window {f.sliding_window} + chunk {cap}")
        for (c, sn), f in zip(keep["rope"], layers):
            if not (c.shape == sn.shape == (n_ctx, f.rope_dim // 2) and 2 <= f.rope_dim <= f.head_dim
                    and f.rope_dim % 2 == 0):
                raise ValueError(f"RoPE tables {c.shape} are not [n_ctx, rope_dim / 2] = [{n_ctx}, {f.rope_dim // 2}]"
                                 f" (rope_dim {f.rope_dim}, head_dim {f.head_dim})")
        self._keep = keep
        return keep

    cdef _bind_scratch(self, dict keep, int wave, int max_ff):
        """Point the Scratch at its arrays in the arena."""
        cdef Scratch *s = &self.s
        s.cap = self.spec.prefill_chunk
        s.seq = 0
        s.tok_seq = NULL
        s.tok_pos = NULL
        s.tok_want = NULL
        s.x = _f32(keep["x"])
        s.xb = _f32(keep["xb"])
        s.xb2 = _f32(keep["xb2"])
        s.q = _f32(keep["q"])
        s.att = _f32(keep["att"])
        s.k = _f32(keep["k"])
        s.v = _f32(keep["v"])
        s.scores = _f32(keep["scores"])
        s.rx = _f32(keep["rx"])
        s.xe = _f32(keep["xe"])
        s.xm = _f32(keep["xm"])
        s.mla_qa = _f32(keep["mla_qa"])
        s.mla_q = _f32(keep["mla_q"])
        s.mla_o = _f32(keep["mla_o"])
        s.head_jobs = <cb_matjob *>calloc(max(self.h.n_heads, 1), sizeof(cb_matjob))
        if s.head_jobs == NULL:
            raise MemoryError("cannot allocate the attention's product table")
        s.router = _f32(keep["router"])
        s.tok_chosen = <int *><uintptr_t>keep["tok_chosen"].ctypes.data
        s.tok_w = _f32(keep["tok_w"])
        s.wave_rows = wave
        s.max_ff = max_ff
        s.g = _f32(keep["g"])
        s.y = _f32(keep["y"])
        s.hb = _f32(keep["hb"])
        s.hb2 = _f32(keep["hb2"])
        s.rows = <int *><uintptr_t>keep["rows"].ctypes.data
        s.row_w = _f32(keep["row_w"])
        s.acts = kernels.bind_acts(keep["acts"])
        s.wave_acts = kernels.bind_acts(keep["wave_acts"])
        s.logits = _f32(keep["logits"])
        s.chosen = <int *><uintptr_t>keep["chosen"].ctypes.data
        s.chosen_w = _f32(keep["chosen_w"])
        s.counts = <int64_t *><uintptr_t>keep["counts"].ctypes.data
        s.predicted = <int *><uintptr_t>keep["predicted"].ctypes.data
        s.prefetch_stats = <int64_t *><uintptr_t>keep["prefetch_stats"].ctypes.data
        s.router2 = _f32(keep["router2"])
        s.pred_w = _f32(keep["pred_w"])
        s.expert_m = <int *><uintptr_t>keep["expert_m"].ctypes.data

    cdef _bind_weights(self, spec, dict keep):
        """The tables of pointers into the mapped weights: the embedding, the head, the final norm
        and each layer's (_bind_layer)."""
        tensors = spec.tensors
        self.embedding = _mat(tensors["embedding"])
        self.lm_head = _mat(tensors["lm_head"] if "lm_head" in tensors else tensors["embedding"])
        self.final_norm = _vec(tensors, "final_norm")
        if spec.nextn:
            self.nextn.eh_proj = _mat(tensors["nextn.eh_proj"])
            self.nextn.enorm = _vec(tensors, "nextn.enorm")
            self.nextn.hnorm = _vec(tensors, "nextn.hnorm")
            self.nextn.joined = _f32(keep["nextn_joined"])
        self.layers = <Layer *>calloc(spec.n_layers, sizeof(Layer))
        self.experts = <FFN *>calloc(spec.n_layers * spec.n_experts, sizeof(FFN))
        if self.layers == NULL or self.experts == NULL:
            raise MemoryError("cannot allocate the layer table")
        cdef int layer
        for layer in range(spec.n_layers):
            self._bind_layer(&self.layers[layer], layer, spec, keep)

    cdef _bind_layer(self, Layer *L, int layer, spec, dict keep):
        """Layer `layer`'s geometry, its KV cache and its pointers into the mapped weights."""
        tensors = spec.tensors
        f = spec.layers[layer]
        p = f"layers.{layer}."
        cdef int e, n_experts = spec.n_experts
        L.head_dim = f.head_dim
        L.n_kv_heads = f.n_kv_heads
        L.attn_scale = f.attn_scale or 1.0 / sqrtf(<float>L.head_dim)
        L.rope_dim = f.rope_dim
        L.rope_cos = _f32(keep["rope"][layer][0])
        L.rope_sin = _f32(keep["rope"][layer][1])
        L.attn_norm = _vec(tensors, p + "attn_norm")
        L.ffn_norm = _vec(tensors, p + "ffn_norm")
        L.post_attn_norm = _vec(tensors, p + "post_attn_norm")
        L.post_ffn_norm = _vec(tensors, p + "post_ffn_norm")
        L.layer_scalar = _vec(tensors, p + "layer_scalar")[0] if (p + "layer_scalar") in tensors else 1.0
        L.wo = _mat(tensors[p + "wo"])
        L.mla = 1 if f.kv_rank else 0
        if L.mla:
            _mla_layer(L, f, tensors, p, self.h.n_heads)
        else:
            L.wq = _mat(tensors[p + "wq"])
            L.wk = _mat(tensors[p + "wk"])
        if (p + "wv") in tensors:
            L.wv = _mat(tensors[p + "wv"])          # else data stays NULL: v is the k projection
        L.bq = _vec(tensors, p + "bq")
        L.bk = _vec(tensors, p + "bk")
        L.bv = _vec(tensors, p + "bv")
        L.bo = _vec(tensors, p + "bo")
        L.sinks = _vec(tensors, p + "sinks")
        L.q_norm = _vec(tensors, p + "q_norm")
        L.k_norm = _vec(tensors, p + "k_norm")
        L.sliding_window = f.sliding_window
        L.is_moe = f.moe
        L.kv_ring = f.kv_ring
        L.k_cache = <void *><uintptr_t>keep["k_cache"][layer].ctypes.data
        L.v_cache = <void *><uintptr_t>keep["v_cache"][layer].ctypes.data
        L.kv_seq_bytes = keep["k_cache"][layer].nbytes // spec.n_seq
        if (p + "mlp.gate") in tensors:
            L.dense = _ffn(tensors, p + "mlp.")
        if L.is_moe:
            L.router = _mat(tensors[p + "router"])
            L.router_bias = _vec(tensors, p + "router_bias")
            L.router_logit_bias = _vec(tensors, p + "router_logit_bias")
            if L.router.dtype != CB_F32:
                raise ValueError(f"tensor {p}router must be f32")
            L.experts = self.experts + layer * n_experts
            L.expert0 = layer * n_experts
            for e in range(n_experts):
                L.experts[e] = _ffn(tensors, f"{p}experts.{e}.")
            L.has_shared = 1 if (p + "shared.gate") in tensors else 0
            if L.has_shared:
                L.shared = _ffn(tensors, p + "shared.")
                L.shared_gate = _vec(tensors, p + "shared_gate")     # NULL: an ungated shared expert
            L.expert_scale = _vec(tensors, p + "expert_scale")
            L.parallel = 1 if (p + "router_scale") in tensors else 0
            if L.parallel:
                L.router_scale = _vec(tensors, p + "router_scale")
                L.post_mlp_norm = _vec(tensors, p + "post_mlp_norm")
                L.pre_moe_norm = _vec(tensors, p + "pre_moe_norm")
                L.post_moe_norm = _vec(tensors, p + "post_moe_norm")
                if L.dense.gate.data == NULL or L.post_mlp_norm == NULL or L.pre_moe_norm == NULL \
                        or L.post_moe_norm == NULL:
                    raise ValueError(f"layer {layer}: the parallel MoE block needs mlp.*, post_mlp_norm, "
                                     f"pre_moe_norm and post_moe_norm")
        elif L.dense.gate.data == NULL:
            raise ValueError(f"layer {layer}: dense layer without mlp.gate")

    cdef _start_cache(self, spec, dict keep):
        """The expert cache over every expert's span, and its reader threads (csrc/expert_cache.h)."""
        fds = np.full(spec.n_layers * spec.n_experts, -1, np.int32)
        for (pl, pe), fd in spec.expert_fds.items():
            fds[pl * spec.n_experts + pe] = fd
        keep["cache_fds"] = fds
        self.s.cache = cache_new(keep["expert_pages"], fds, keep["cache_resident"], keep["cache_fresh"],
                                 keep["cache_last_use"], keep["cache_freq"], keep["cache_stats"],
                                 (1 << 62) if spec.expert_budget is None else spec.expert_budget, spec.eviction,
                                 spec.advice, spec.cache_os, spec.prefetch_chunk_bytes)

    def cache_hold(self, indices):
        """At load: these experts (layer * n_experts + e) are in memory already; admit those
        that fit the budget. Returns how many were admitted."""
        if self.s.cache == NULL:
            return 0
        return sum(cb_cache_hold(self.s.cache, int(i)) for i in indices)

    def cache_drain(self):
        """Wait until the cache's reader has run every queued read and drop."""
        if self.s.cache != NULL:
            with nogil:
                cb_cache_drain(self.s.cache)

    @property
    def cache_bytes(self):
        """(bytes of experts admitted now, the most at once), or None without a cache."""
        if self.s.cache == NULL:
            return None
        return self.s.cache.bytes, self.s.cache.peak

    def close(self):
        """Stop the cache's readers (after the jobs they have queued): before the mappings go."""
        self._stop_cache()

    cdef void _stop_cache(self):
        cdef cb_expert_cache *c = self.s.cache
        self.s.cache = NULL
        if c != NULL:
            with nogil:
                cb_cache_stop(c)
            free(c)

    def __dealloc__(self):
        self._stop_cache()
        free(self.layers)
        free(self.experts)
        free(self.s.acts)
        free(self.s.wave_acts)
        free(self.s.head_jobs)

    def reset(self):
        """Forget the context (the KV cache is overwritten position by position, so nothing to clear)."""
        self.expert_counts[...] = 0
        self._keep["predicted"][...] = -1

    def run(self, const int[::1] tokens, int pos0, float[:, ::1] logits_out, bint all_logits, int seq=0,
            const float[:, ::1] hidden_in=None, float[:, ::1] hidden_out=None):
        """Push tokens[0..T) of sequence `seq` (0 .. n_seq - 1) through the model at positions
        pos0.., in chunks of at most the prefill chunk (every weight read once per chunk; decode is
        a chunk of one token).

        all_logits: logits_out is [T, vocab] and receives every position's logits;
        otherwise logits_out is [1, vocab] and receives only the last one (the lm_head is skipped
        for the others). logits_out None: no logits at all (an inner chunk of a prompt the caller
        runs piece by piece). Returns (status, token index of a failure, layer of a bad router).

        hidden_out [T, d_model] or None: each position's last hidden state after the final norm
        (what the head reads: a multi-token-prediction block's input). hidden_in [T, d_model]: a
        nextn block's (spec.nextn) second input, the main model's hidden state at each position.
        """
        cdef int t = 0, n, status = STATUS_OK
        cdef int T = tokens.shape[0]
        cdef int want
        cdef bint none = logits_out is None
        cdef float *out = NULL
        cdef const float *h_in = NULL
        cdef float *h_out = NULL
        cdef size_t d = self.h.d_model
        if (hidden_in is None) == (self.nextn.eh_proj.data != NULL) or (
                hidden_in is not None and (hidden_in.shape[0] < T or hidden_in.shape[1] != <int>d)):
            raise ValueError(f"hidden_in: [{T}, {d}] for a nextn block, None otherwise")
        if hidden_out is not None and (hidden_out.shape[0] < T or hidden_out.shape[1] != <int>d):
            raise ValueError(f"hidden_out must be [{T}, {d}]")
        if pos0 < 0 or pos0 + T > self.h.n_ctx:
            raise ValueError(f"positions {pos0}..{pos0 + T - 1} exceed the context of {self.h.n_ctx}")
        if not 0 <= seq < self.h.n_seq:
            raise ValueError(f"sequence {seq} is outside 0..{self.h.n_seq - 1}")
        if not none and (logits_out.shape[1] != self.h.vocab or logits_out.shape[0] < (T if all_logits else 1)):
            raise ValueError("logits_out has the wrong shape")
        for t in range(T):
            if tokens[t] < 0 or tokens[t] >= self.h.vocab:
                raise ValueError(f"token id {tokens[t]} is outside the vocabulary [0, {self.h.vocab})")
        t = 0
        self.s.seq = seq
        self.s.tok_seq = NULL
        with nogil:
            while t < T:
                n = T - t if T - t < self.s.cap else self.s.cap
                if none:
                    want = WANT_NONE
                else:
                    want = WANT_ALL if all_logits else (WANT_LAST if t + n == T else WANT_NONE)
                    out = &logits_out[t if all_logits else 0, 0]
                h_in = &hidden_in[t, 0] if hidden_in is not None else NULL
                h_out = &hidden_out[t, 0] if hidden_out is not None else NULL
                status = forward(&self.h, self.layers, &self.embedding, self.final_norm, &self.lm_head,
                                 &self.s, &tokens[t], n, pos0 + t, out, want, &self.nextn, h_in, h_out)
                if status != STATUS_OK:
                    break
                t += n
        if status == STATUS_OK and T and not none:
            memcpy(self.s.logits, &logits_out[T - 1 if all_logits else 0, 0], sizeof(float) * self.h.vocab)
        return status, min(t, T - 1), self.s.bad_layer

    def step(self, const int[::1] tokens, const int[::1] seqs, const int[::1] positions, float[:, ::1] logits_out,
             const unsigned char[::1] want=None):
        """B <= prefill_chunk tokens of several sequences in one pass: token b of sequence seqs[b]
        at position positions[b], a sequence's tokens side by side at consecutive positions (a
        decoding sequence's one token, a piece of a prompt), its earlier positions in that
        sequence's cache. Logits into logits_out [B, vocab], or with `want` (uint8 [B]) those of
        the marked tokens only, in their order ([marked, vocab]; the head skipped for the rest).
        Every weight is read once for all B; each token's arithmetic is that of run() on its
        sequence alone (no kernel's depends on the tokens beside it), so the logits are the same
        bits. Returns run()'s triple."""
        cdef int B = tokens.shape[0], b, status, rows
        if not 1 <= B <= self.s.cap or seqs.shape[0] != B or positions.shape[0] != B \
                or (want is not None and want.shape[0] != B):
            raise ValueError(f"a step takes 1..{self.s.cap} tokens with a sequence and a position each, "
                             f"got {B}, {seqs.shape[0]}, {positions.shape[0]}")
        rows = B if want is None else sum(1 for b in range(B) if want[b])
        if logits_out.shape[0] < max(rows, 1) or logits_out.shape[1] != self.h.vocab:
            raise ValueError("logits_out has the wrong shape")
        seen = set()
        for b in range(B):
            if tokens[b] < 0 or tokens[b] >= self.h.vocab:
                raise ValueError(f"token id {tokens[b]} is outside the vocabulary [0, {self.h.vocab})")
            if not 0 <= seqs[b] < self.h.n_seq:
                raise ValueError(f"sequence {seqs[b]} is outside 0..{self.h.n_seq - 1}")
            if seqs[b] in seen and not (seqs[b - 1] == seqs[b] and positions[b] == positions[b - 1] + 1):
                raise ValueError(f"sequence {seqs[b]}'s tokens in a step must be side by side at consecutive positions")
            seen.add(seqs[b])
            if not 0 <= positions[b] < self.h.n_ctx:
                raise ValueError(f"position {positions[b]} exceeds the context of {self.h.n_ctx}")
        self.s.tok_seq = &seqs[0]
        self.s.tok_pos = &positions[0]
        self.s.tok_want = NULL
        if want is not None:
            self.s.tok_want = &want[0]
        with nogil:
            status = forward(&self.h, self.layers, &self.embedding, self.final_norm, &self.lm_head,
                             &self.s, &tokens[0], B, 0, &logits_out[0, 0], WANT_ALL if want is None else WANT_SOME,
                             &self.nextn, NULL, NULL)
        self.s.tok_seq = NULL
        self.s.tok_pos = NULL
        self.s.tok_want = NULL
        if status == STATUS_OK and rows:
            memcpy(self.s.logits, &logits_out[rows - 1, 0], sizeof(float) * self.h.vocab)
        return status, 0, self.s.bad_layer

    @property
    def n_ctx(self):
        return self.h.n_ctx

    @property
    def n_seq(self):
        return self.h.n_seq

    def _kv_arrays(self):
        """Every layer's key and value cache arrays, each once (an MLA layer has one for both)."""
        seen = {}
        for a in self._keep["k_cache"] + self._keep["v_cache"]:
            seen[a.ctypes.data] = a
        return list(seen.values())

    def kv_layer_arrays(self):
        """Per layer, its KV cache arrays ([n_seq, n_kv_heads, kv_ring, row] each; position p of a
        sequence in row p % kv_ring): (keys, values), or an MLA layer's (latent,)."""
        return [(k,) if k is v else (k, v) for k, v in zip(self._keep["k_cache"], self._keep["v_cache"])]

    def kv_cache_ranges(self):
        """[(address, nbytes)] of every layer's key and value cache."""
        return [(a.ctypes.data, a.nbytes) for a in self._kv_arrays()]

    @property
    def kv_cache_bytes(self):
        """Bytes of the KV cache arrays as allocated (keys and values of every layer)."""
        return sum(a.nbytes for a in self._kv_arrays())

    def kv_bytes_read(self, int pos):
        """Bytes of the KV cache that one sequence's token at position `pos` reads: every layer's
        key and value rows (an MLA layer's one latent array) at the positions its attention sees,
        pos + 1 of them or a sliding layer's window."""
        cdef int layer, seen
        total = 0
        for layer in range(self.h.n_layers):
            k, v = self._keep["k_cache"][layer], self._keep["v_cache"][layer]
            per_position = k.nbytes // (k.shape[0] * k.shape[2])     # [n_seq, kv heads, ring, row]
            if v is not k:
                per_position += v.nbytes // (v.shape[0] * v.shape[2])
            seen = pos + 1
            if self.layers[layer].sliding_window > 0 and self.layers[layer].sliding_window < seen:
                seen = self.layers[layer].sliding_window
            total += per_position * seen
        return total


cdef inline float *_f32(a):
    return <float *><uintptr_t>a.ctypes.data


cdef Mat _mat(t):
    """A TensorRef (colibri.modeldir) -> Mat; its shape is the logical [rows, cols]."""
    cdef Mat m
    dtype, shape = t.dtype, t.shape
    m.data = <const void *><uintptr_t>t.address
    m.dtype = DTYPE_CODES[dtype]
    m.layout = LAYOUT_CODES[t.layout]
    if m.layout == CB_TRANSPOSED and (m.dtype == CB_INT8 or m.dtype == CB_INT4) and shape[0] % 8:
        raise ValueError(f"a transposed {dtype} matrix needs a multiple of 8 rows, got {shape}")   # whole groups
    if m.layout == CB_INTERLEAVED and (not (m.dtype == CB_INT8 or m.dtype == CB_INT4 or m.dtype == CB_MXFP4
                                            or m.dtype == CB_NL4 or m.dtype == CB_INT6 or m.dtype == CB_BF16)
                                       or shape[0] % 8 or shape[1] % 32):
        raise ValueError(f"the interleaved layout needs int8/int4/mxfp4/nl4/int6/bf16, a multiple of 8 rows and of "
                         f"32 columns, got {dtype} {shape}")
    if (m.dtype == CB_NL4 or m.dtype == CB_INT6) and m.layout != CB_INTERLEAVED:
        raise ValueError(f"{dtype} has only the interleaved layout")
    if m.dtype == CB_MXFP4 and m.layout == CB_TRANSPOSED:
        raise ValueError("mxfp4 has no transposed layout")
    m.rows = shape[0]
    m.cols = shape[1]
    m.input_stats = NULL
    if t.input_stats is not None:
        if (t.input_stats.dtype != np.float64 or t.input_stats.shape != (shape[1] + 1,)
                or not t.input_stats.flags.c_contiguous):
            raise ValueError(f"input_stats of a [{shape[0]}, {shape[1]}] matrix must be float64 [{shape[1] + 1}]")
        m.input_stats = <double *><uintptr_t>t.input_stats.ctypes.data
    m.input_gram = NULL
    if t.input_gram is not None:
        if (m.input_stats == NULL or t.input_gram.dtype != np.float64 or t.input_gram.shape != (shape[1], shape[1])
                or not t.input_gram.flags.c_contiguous):
            raise ValueError(f"input_gram of a [{shape[0]}, {shape[1]}] matrix must be float64 "
                             f"[{shape[1]}, {shape[1]}], beside input_stats")
        m.input_gram = <double *><uintptr_t>t.input_gram.ctypes.data
    return m


cdef _mla_layer(Layer *L, f, dict tensors, str p, int n_heads):
    """A multi-head latent attention layer's tables (_engine.pxd, Layer), its shapes checked."""
    L.kv_rank = f.kv_rank
    L.qk_head = f.qk_head
    L.v_head = f.v_head
    if (p + "wq_a") in tensors:
        L.wq_a = _mat(tensors[p + "wq_a"])
        L.q_a_norm = _vec(tensors, p + "q_a_norm")
        L.wq_b = _mat(tensors[p + "wq_b"])
    else:
        L.wq = _mat(tensors[p + "wq"])
    L.wkv_a = _mat(tensors[p + "wkv_a"])
    L.kv_a_norm = _vec(tensors, p + "kv_a_norm")
    L.wkb = _mat(tensors[p + "wkb"])
    L.wvb = _mat(tensors[p + "wvb"])
    nope = f.qk_head - f.rope_dim
    if (f.head_dim != f.rope_dim + f.kv_rank or f.n_kv_heads != 1 or nope < 1
            or L.wkv_a.rows != f.head_dim or (L.wkb.rows, L.wkb.cols) != (n_heads * f.kv_rank, nope)
            or (L.wvb.rows, L.wvb.cols) != (n_heads * f.v_head, f.kv_rank) or L.wo.cols != n_heads * f.v_head
            or L.kv_a_norm == NULL or (L.wq_a.data != NULL and L.q_a_norm == NULL)):
        raise ValueError(f"{p}: inconsistent multi-head latent attention tensors")
    for name in ("wkb", "wvb"):                    # multiplied without quantized activations
        if tensors[p + name].dtype not in ("f32", "f16") or tensors[p + name].layout != "rows":
            raise ValueError(f"tensor {p}{name} must be f32 or f16 in the rows layout")


cdef const float *_vec(dict tensors, str name):
    """A float32 vector by name, or NULL when the model has no such tensor."""
    t = tensors.get(name)
    if t is None:
        return NULL
    if t.dtype != "f32":
        raise ValueError(f"tensor {name} must be f32, got {t.dtype}")
    return <const float *><uintptr_t>t.address


cdef FFN _ffn(dict tensors, str prefix):
    cdef FFN f
    f.gate = _mat(tensors[prefix + "gate"])
    f.up = _mat(tensors[prefix + "up"])
    f.down = _mat(tensors[prefix + "down"])
    f.gate_b = _vec(tensors, prefix + "gate_bias")
    f.up_b = _vec(tensors, prefix + "up_bias")
    f.down_b = _vec(tensors, prefix + "down_bias")
    return f
