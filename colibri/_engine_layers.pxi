# The layer loop: the model over n tokens (decode: n = 1), included by _engine.pyx (whose
# docstring is its design). Every function here runs without the GIL over the structs of
# _engine.pxd (Hyper, Layer, FFN, Scratch); forward() at the end is the whole model in one screen.

# ---- the blocks of the layer loop, each over n tokens (decode: n = 1) ------------------------

cdef enum:
    # Tokens from which a block's per-token work between the products (norms, rotary embedding,
    # cache stores, the experts' weighted sums) is split over the threads, as the products are:
    # done by one thread it would leave the others waiting at every block of a long prefill.
    # Each token's arithmetic is the same either way.
    PARALLEL_TOKENS_MIN = 16

cdef inline void job(cb_matjob *j, float *out, int ldo, const Mat *m, const float *x, int ldx,
                     cb_act_q8 *acts, int n) noexcept nogil:
    """j = the product out[t * ldo + r] = m[r, :] . x[t * ldx + :] for t < n (cb_matmul_jobs)."""
    j.n = n
    j.out = out
    j.ldo = ldo
    j.w = m.data
    j.dtype = m.dtype
    j.layout = m.layout
    j.rows = m.rows
    j.cols = m.cols
    j.x = x
    j.ldx = ldx
    j.acts = acts
    j.glu_up = NULL
    j.glu_act = 0
    if m.input_stats != NULL:
        add_input_stats(m, x, ldx, n)


cdef void add_input_stats(const Mat *m, const float *x, int ldx, int n) noexcept nogil:
    """m.input_stats[c] += x[t, c]^2 over the n tokens of a product, and the token count after the
    columns: the activation statistics `calibrate` collects (an expert sees only its tokens)."""
    cdef int t, c
    cdef double v
    cdef float *scratch
    for t in range(n):
        for c in range(m.cols):
            v = x[<size_t>t * ldx + c]
            m.input_stats[c] += v * v
    m.input_stats[m.cols] += n
    if m.input_gram != NULL and n > 0:        # the upper triangle of sum_t x_t x_t^T (csrc/gram.h)
        scratch = <float *>malloc(<size_t>n * m.cols * sizeof(float))
        if scratch != NULL:
            cb_gram_add(m.input_gram, x, ldx, n, m.cols, scratch)
            free(scratch)
        else:                                 # no room for the transposed tokens: one at a time
            for t in range(n):
                cb_gram_add(m.input_gram, x + <size_t>t * ldx, ldx, 1, m.cols, NULL)


cdef inline void matmul(float *out, int ldo, const Mat *m, const float *x, int ldx, cb_act_q8 *acts, int n,
                        int n_threads) noexcept nogil:
    """out[t * ldo + r] = m[r, :] . x[t * ldx + :] for t < n: one product in one parallel region."""
    cdef cb_matjob j
    job(&j, out, ldo, m, x, ldx, acts, n)
    kernels.matmul_jobs(&j, 1, n_threads)


cdef inline int gate_up_jobs(cb_matjob *jobs, const FFN *f, float *gate_out, float *up_out, int ldo,
                             const float *x, int ldx, cb_act_q8 *acts, int n, int act) noexcept nogil:
    """jobs[0:2] = up, then gate with the activation fused in (gate_out = act(gate x) * up x, each
    thread over the rows it computed) when both matrices split alike (same format, layout and
    shape, as converted models have) and nothing comes between product and activation (biases;
    the clamped SwiGLU). Returns 1 if fused, 0 if the caller must apply the activation (ffn_wave)."""
    job(&jobs[0], up_out, ldo, &f.up, x, ldx, acts, n)
    job(&jobs[1], gate_out, ldo, &f.gate, x, ldx, acts, n)
    if f.gate.dtype == f.up.dtype and f.gate.layout == f.up.layout and f.gate.rows == f.up.rows \
            and f.gate_b == NULL and f.up_b == NULL and act != CB_ACT_SWIGLU_CLAMPED:
        jobs[1].glu_up = up_out
        jobs[1].glu_act = act
        return 1
    return 0


cdef enum:
    MAX_SLOTS = 65            # FFNs of one wave: at least top-k and the shared one

MAX_TOP_K = min(routing.CB_MAX_TOP_K, MAX_SLOTS - 1)    # experts per token: what the router and a wave hold


cdef struct Slot:             # one FFN of a wave over some of the tokens
    const FFN *f
    const float *x            # [m, ldx] its input rows
    int ldx
    cb_act_q8 *acts           # [m] their quantization scratch
    int row0                  # its rows of the wave buffers: row0 .. row0 + m - 1
    int m
    float *out                # [m, d_model] where its outputs go (s.y + row0 * d_model in a MoE wave)


cdef inline void activate(const Hyper *h, const FFN *f, float *gate, float *up) noexcept nogil:
    """One token's hidden row: gate [d_ff] = act(gate + gate_b) * (up + up_b), biases where the FFN
    has them, the activation of the model (the clamped SwiGLU with its parameters)."""
    cdef int ff = f.gate.rows
    if f.gate_b != NULL:
        kernels.add(gate, f.gate_b, ff)
    if f.up_b != NULL:
        kernels.add(up, f.up_b, ff)
    if h.act == CB_ACT_SWIGLU_CLAMPED:
        kernels.glu_clamped(gate, up, ff, h.swiglu_alpha, h.swiglu_limit)
    else:
        kernels.glu(gate, up, ff, h.act)


cdef void ffn_wave(const Hyper *h, Scratch *s, const Slot *slots, int count) noexcept nogil:
    """For each slot i: out[t] = down(act(gate x_t) * up x_t), t < m, of its FFN (hidden rows row0..
    of the wave buffers; with its biases where it has them): every gate and up of the wave in one
    parallel region, every down in another."""
    cdef cb_matjob jobs[2 * MAX_SLOTS]
    cdef int fused[MAX_SLOTS]
    cdef int i, t, ff = s.max_ff
    cdef size_t r
    if count < 1:
        return
    for i in range(count):
        r = <size_t>slots[i].row0
        fused[i] = gate_up_jobs(&jobs[2 * i], slots[i].f, s.hb + r * ff, s.hb2 + r * ff, ff, slots[i].x,
                                slots[i].ldx, slots[i].acts, slots[i].m, h.act)
    kernels.matmul_jobs(jobs, 2 * count, h.n_threads)
    for i in range(count):
        r = <size_t>slots[i].row0
        if not fused[i]:
            for t in range(slots[i].m):
                activate(h, slots[i].f, s.hb + (r + t) * ff, s.hb2 + (r + t) * ff)
        job(&jobs[i], slots[i].out, h.d_model, &slots[i].f.down, s.hb + r * ff, ff, s.wave_acts + r, slots[i].m)
    kernels.matmul_jobs(jobs, count, h.n_threads)
    for i in range(count):
        if slots[i].f.down_b != NULL:
            for t in range(slots[i].m):
                kernels.add(slots[i].out + <size_t>t * h.d_model, slots[i].f.down_b, h.d_model)


cdef void ffn(const Hyper *h, const FFN *f, const float *x, float *out, Scratch *s, int n) noexcept nogil:
    """out[n, d] = down(act(gate x) * up x) for the rows of x [n, d] (n <= cap <= wave_rows): a
    wave of one slot."""
    cdef Slot slot
    slot.f = f
    slot.x = x
    slot.ldx = h.d_model
    slot.acts = s.acts
    slot.row0 = 0
    slot.m = n
    slot.out = out
    ffn_wave(h, s, &slot, 1)


cdef void qkv_finish(const Hyper *h, const Layer *L, float *q, float *k, float *v, int pos) noexcept nogil:
    """After the q/k/v projections of one position: biases, q/k/v norms, clipping, rotary embedding.
    q [n_heads * head_dim], k and v [n_kv_heads * head_dim] (head_dim, n_kv_heads: the layer's).
    Without a v projection (attention_k_eq_v) v is filled here from the raw k projection."""
    cdef int hd = L.head_dim
    cdef int q_dim = h.n_heads * hd
    cdef int kv_dim = L.n_kv_heads * hd
    cdef int i
    if L.bq != NULL:
        kernels.add(q, L.bq, q_dim)
    if L.bk != NULL:
        kernels.add(k, L.bk, kv_dim)
    if L.wv.data == NULL:
        memcpy(v, k, sizeof(float) * kv_dim)
    elif L.bv != NULL:
        kernels.add(v, L.bv, kv_dim)
    if h.qk_norm == QK_NORM_PER_HEAD:
        for i in range(h.n_heads):
            kernels.rmsnorm(q + i * hd, q + i * hd, L.q_norm, hd, h.rms_eps)
        for i in range(L.n_kv_heads):
            kernels.rmsnorm(k + i * hd, k + i * hd, L.k_norm, hd, h.rms_eps)
    elif h.qk_norm == QK_NORM_WHOLE:
        kernels.rmsnorm(q, q, L.q_norm, q_dim, h.rms_eps)
        kernels.rmsnorm(k, k, L.k_norm, kv_dim, h.rms_eps)
    if h.v_norm:
        for i in range(L.n_kv_heads):
            kernels.rmsnorm(v + i * hd, v + i * hd, NULL, hd, h.rms_eps)
    if h.clip_qkv > 0:                                              # OLMoE's clip_qkv
        kernels.clip(q, h.clip_qkv, q_dim)
        kernels.clip(k, h.clip_qkv, kv_dim)
        kernels.clip(v, h.clip_qkv, kv_dim)
    cdef const float *cos_t = L.rope_cos + <size_t>pos * (L.rope_dim // 2)
    cdef const float *sin_t = L.rope_sin + <size_t>pos * (L.rope_dim // 2)
    kernels.rope(q, h.n_heads, hd, L.rope_dim, cos_t, sin_t)
    kernels.rope(k, L.n_kv_heads, hd, L.rope_dim, cos_t, sin_t)


cdef inline int token_pos(const Scratch *s, int t, int pos0) noexcept nogil:
    """The position of token t of a call: pos0 + t in a chunk, its own in a step."""
    return s.tok_pos[t] if s.tok_seq != NULL else pos0 + t


cdef inline int token_seq(const Scratch *s, int t) noexcept nogil:
    """The sequence whose cache token t of a call uses: the chunk's, or its own in a step."""
    return s.tok_seq[t] if s.tok_seq != NULL else s.seq


cdef inline int step_run_end(const Scratch *s, int t, int n) noexcept nogil:
    """In a step: the end of the run of tokens from t that continue one sequence position by
    position (a prompt's piece; a decoding sequence's run is its one token)."""
    cdef int r = t + 1
    while r < n and s.tok_seq[r] == s.tok_seq[t] and s.tok_pos[r] == s.tok_pos[r - 1] + 1:
        r += 1
    return r


cdef inline void *seq_cache(void *cache, const Layer *L, int seq) noexcept nogil:
    """Sequence seq's part [n_kv_heads, kv_ring, row] of a layer's key or value cache."""
    return <char *>cache + <size_t>seq * L.kv_seq_bytes


cdef inline void kv_store(const Hyper *h, Layer *L, const float *k, const float *v, int pos, int seq) noexcept nogil:
    """Position pos's keys and values [n_kv_heads * head_dim] into row pos % kv_ring of each KV
    head of sequence seq, as the cache's elements (h.kv: f32 copied, f16 rounded to nearest even,
    q8 quantized per row)."""
    cdef int j, hd = L.head_dim
    cdef size_t row
    cdef char *kc = <char *>seq_cache(L.k_cache, L, seq)
    cdef char *vc = <char *>seq_cache(L.v_cache, L, seq)
    for j in range(L.n_kv_heads):
        row = (<size_t>j * L.kv_ring + pos % L.kv_ring) * cb_kv_row_bytes(hd, h.kv)
        kernels.kv_store(kc + row, k + <size_t>j * hd, hd, h.kv)
        kernels.kv_store(vc + row, v + <size_t>j * hd, hd, h.kv)


cdef inline void qkv_token(const Hyper *h, Layer *L, Scratch *s, int t, int pos0) noexcept nogil:
    """Token t of a call (a chunk from position pos0, or a step): its q/k/v rows finished
    (qkv_finish) and its keys and values stored in its sequence's cache (kv_store)."""
    cdef int q_dim = h.n_heads * L.head_dim, kv_dim = L.n_kv_heads * L.head_dim
    cdef int pos = token_pos(s, t, pos0)
    qkv_finish(h, L, s.q + <size_t>t * q_dim, s.k + <size_t>t * kv_dim, s.v + <size_t>t * kv_dim, pos)
    kv_store(h, L, s.k + <size_t>t * kv_dim, s.v + <size_t>t * kv_dim, pos, token_seq(s, t))


cdef void attention(const Hyper *h, Layer *L, Scratch *s, int n, int pos0) noexcept nogil:
    """s.xb2 = self-attention of s.xb [n, d] at positions pos0..pos0+n-1 (causal, in order), or,
    in a step, each token at its own position over its own sequence's cache (the decode of each).
    The tokens' keys and values go to cache rows position % kv_ring before any query reads them:
    a ring of window + chunk rows keeps every key a query of the chunk (or a step's run) can see."""
    cdef int d = h.d_model, q_dim = h.n_heads * L.head_dim, kv_dim = L.n_kv_heads * L.head_dim, t, r
    cdef cb_matjob jobs[3]
    job(&jobs[0], s.q, q_dim, &L.wq, s.xb, d, s.acts, n)
    job(&jobs[1], s.k, kv_dim, &L.wk, s.xb, d, s.acts, n)
    job(&jobs[2], s.v, kv_dim, &L.wv, s.xb, d, s.acts, n)
    kernels.matmul_jobs(jobs, 3 if L.wv.data != NULL else 2, h.n_threads)
    if n >= PARALLEL_TOKENS_MIN and h.n_threads > 1:
        for t in prange(n, num_threads=h.n_threads, schedule='static'):
            qkv_token(h, L, s, t, pos0)
    else:
        for t in range(n):
            qkv_token(h, L, s, t, pos0)
    if s.tok_seq == NULL:
        kernels.attention(s.att, q_dim, s.q, q_dim, seq_cache(L.k_cache, L, s.seq), seq_cache(L.v_cache, L, s.seq),
                          s.scores, h.n_heads, L.n_kv_heads, L.head_dim, h.n_ctx, n, pos0, L.sliding_window,
                          L.kv_ring, L.attn_scale, L.sinks, h.n_threads, h.kv)
    else:
        t = 0
        while t < n:                            # each run of one sequence's consecutive positions at once
            r = step_run_end(s, t, n)
            kernels.attention(s.att + <size_t>t * q_dim, q_dim, s.q + <size_t>t * q_dim, q_dim,
                              seq_cache(L.k_cache, L, s.tok_seq[t]), seq_cache(L.v_cache, L, s.tok_seq[t]),
                              s.scores, h.n_heads, L.n_kv_heads, L.head_dim, h.n_ctx, r - t, s.tok_pos[t],
                              L.sliding_window, L.kv_ring, L.attn_scale, L.sinks, h.n_threads, h.kv)
            t = r
    matmul(s.xb2, d, &L.wo, s.att, q_dim, s.acts, n, h.n_threads)
    if L.bo != NULL:
        for t in range(n):
            kernels.add(s.xb2 + <size_t>t * d, L.bo, d)


cdef void attention_mla(const Hyper *h, Layer *L, Scratch *s, int n, int pos0) noexcept nogil:
    """s.xb2 = multi-head latent attention of s.xb [n, d] (DeepSeek-V3), absorbed: the cache holds
    per position only [RoPE key, latent] (rope_dim + kv_rank numbers), every query head attends
    it as one KV head, with its query [rope part, wkb_h . nope part] and its value wvb_h . (the
    attention's latent). The same arithmetic for any n, so a prompt equals decoding it."""
    cdef int d = h.d_model, H = h.n_heads, D = L.head_dim, R = L.kv_rank, rope = L.rope_dim
    cdef int qk = L.qk_head, v = L.v_head, nope = L.qk_head - L.rope_dim, t, i, pos, r
    cdef int ql = L.wq_a.rows
    cdef cb_matjob jobs[2]
    cdef cb_matjob *heads = s.head_jobs
    cdef Mat wh
    cdef const float *cos_t
    cdef const float *sin_t
    cdef float *row
    if L.wq_a.data != NULL:                     # the low-rank query and the latent, in one batch
        job(&jobs[0], s.mla_qa, ql, &L.wq_a, s.xb, d, s.acts, n)
        job(&jobs[1], s.k, D, &L.wkv_a, s.xb, d, s.acts, n)
        kernels.matmul_jobs(jobs, 2, h.n_threads)
        for t in range(n):
            kernels.rmsnorm(s.mla_qa + <size_t>t * ql, s.mla_qa + <size_t>t * ql, L.q_a_norm, ql, h.rms_eps)
        matmul(s.mla_q, H * qk, &L.wq_b, s.mla_qa, ql, s.acts, n, h.n_threads)
    else:
        job(&jobs[0], s.mla_q, H * qk, &L.wq, s.xb, d, s.acts, n)
        job(&jobs[1], s.k, D, &L.wkv_a, s.xb, d, s.acts, n)
        kernels.matmul_jobs(jobs, 2, h.n_threads)
    for t in range(n):                          # the latent normed, the RoPE parts rotated, cached
        row = s.k + <size_t>t * D
        pos = token_pos(s, t, pos0)
        kernels.rmsnorm(row + rope, row + rope, L.kv_a_norm, R, h.rms_eps)
        cos_t = L.rope_cos + <size_t>pos * (rope // 2)
        sin_t = L.rope_sin + <size_t>pos * (rope // 2)
        kernels.rope(row, 1, D, rope, cos_t, sin_t)
        kernels.rope(s.mla_q + <size_t>t * H * qk, H, qk, rope, cos_t, sin_t)
        kernels.kv_store(<char *>seq_cache(L.k_cache, L, token_seq(s, t)) + <size_t>(pos % L.kv_ring)
                         * cb_kv_row_bytes(D, h.kv), row, D, h.kv)
        for i in range(H):                      # each head's query: [its RoPE part, (absorbed below)]
            memcpy(s.q + (<size_t>t * H + i) * D, s.mla_q + (<size_t>t * H + i) * qk, sizeof(float) * rope)
    for i in range(H):                          # latent queries: wkb_h . nope_h
        wh = L.wkb
        wh.data = <const char *>L.wkb.data + <size_t>i * R * cb_row_stride(L.wkb.dtype, nope)
        wh.rows = R
        job(&heads[i], s.q + <size_t>i * D + rope, H * D, &wh, s.mla_q + <size_t>i * qk + rope, H * qk, s.acts, n)
    kernels.matmul_jobs(heads, H, h.n_threads)
    if s.tok_seq == NULL:
        kernels.attention(s.att, H * D, s.q, H * D, seq_cache(L.k_cache, L, s.seq), seq_cache(L.v_cache, L, s.seq),
                          s.scores, H, 1, D, h.n_ctx, n, pos0, 0, L.kv_ring, L.attn_scale, NULL, h.n_threads, h.kv)
    else:
        t = 0
        while t < n:
            r = step_run_end(s, t, n)
            kernels.attention(s.att + <size_t>t * H * D, H * D, s.q + <size_t>t * H * D, H * D,
                              seq_cache(L.k_cache, L, s.tok_seq[t]), seq_cache(L.v_cache, L, s.tok_seq[t]),
                              s.scores, H, 1, D, h.n_ctx, r - t, s.tok_pos[t], 0, L.kv_ring, L.attn_scale, NULL,
                              h.n_threads, h.kv)
            t = r
    for i in range(H):                          # values: wvb_h . (head h's attention over the latents)
        wh = L.wvb
        wh.data = <const char *>L.wvb.data + <size_t>i * v * cb_row_stride(L.wvb.dtype, R)
        wh.rows = v
        job(&heads[i], s.mla_o + <size_t>i * v, H * v, &wh, s.att + <size_t>i * D + rope, H * D, s.acts, n)
    kernels.matmul_jobs(heads, H, h.n_threads)
    matmul(s.xb2, d, &L.wo, s.mla_o, H * v, s.acts, n, h.n_threads)


cdef void predict_next(const Hyper *h, Layer *L, Scratch *s, const int *chosen, int layer,
                       const float *router_in) noexcept nogil:
    """PREFETCH_PREDICT, one token: score the prediction made for this layer, and predict the next
    MoE layer's experts from this router input (queued for the cache's reader now)."""
    cdef int j, i, hits = 0
    cdef Layer *N
    if s.predicted[layer * h.top_k] >= 0:                       # how good was the prediction?
        for j in range(h.top_k):
            for i in range(h.top_k):
                if s.predicted[layer * h.top_k + i] == chosen[j]:
                    hits += 1
        s.prefetch_stats[PF_PREDICTED] += h.top_k
        s.prefetch_stats[PF_PREDICT_HITS] += hits
    if layer + 1 < h.n_layers and L[1].is_moe:                     # predict the next layer
        N = &L[1]
        matmul(s.router2, h.n_experts, &N.router, router_in, h.d_model, s.acts, 1, 1)
        if route(h, N, s.router2, s.predicted + (layer + 1) * h.top_k, s.pred_w) == 0:
            for j in range(h.top_k):
                cb_cache_prefetch(s.cache, N.expert0 + s.predicted[(layer + 1) * h.top_k + j])


cdef inline int route(const Hyper *h, const Layer *L, float *logits, int *chosen, float *weights) noexcept nogil:
    """Router logits [n_experts] -> top-k experts and their weights (times the per-expert scales)."""
    cdef int j
    if h.sigmoid_router:
        return routing.route_sigmoid(logits, L.router_bias, h.n_experts, h.top_k, h.n_group, h.topk_group,
                                     h.norm_topk_prob, h.routed_scaling, chosen, weights)
    if routing.route(logits, h.n_experts, h.top_k, h.norm_topk_prob, h.use_lut, chosen, weights) != 0:
        return -1
    if L.expert_scale != NULL:
        for j in range(h.top_k):
            weights[j] *= L.expert_scale[chosen[j]]
    return 0


cdef inline float shared_gate(const Layer *L, const float *x, int d) noexcept nogil:
    """sigmoid(shared_gate . x): the weight of the shared expert (Qwen2-MoE); 1 without a gate."""
    cdef float g = 0
    cdef int j
    if L.shared_gate == NULL:
        return 1.0
    for j in range(d):
        g += L.shared_gate[j] * x[j]
    return 1.0 / (1.0 + expf(-g))


@cython.cdivision(True)
cdef inline int share_start(int n, int th, int nt) noexcept nogil:
    """The first of thread th's items when n are split in nt contiguous shares (th = nt: n)."""
    return <int>(<int64_t>n * th / nt)


cdef void add_wave_rows(const Hyper *h, const Scratch *s, const Slot *slots, int count, float *out, int t0,
                        int t1) noexcept nogil:
    """out[t] += weight * the row's output for the wave's rows of tokens t0 <= t < t1, slot by slot
    (each token's sum in the wave's order, whichever thread adds it)."""
    cdef int i, r, t, d = h.d_model
    for i in range(count):
        for r in range(slots[i].row0, slots[i].row0 + slots[i].m):
            t = s.rows[r]
            if t0 <= t < t1:
                kernels.axpy(out + <size_t>t * d, s.row_w[r], s.y + <size_t>r * d, d)


cdef void wave_finish(const Hyper *h, Layer *L, Scratch *s, const Slot *slots, int count, int n,
                      float *out) noexcept nogil:
    """Run a wave and add each row's output, times its weight, into out [n, d] (the wave's slots
    in ascending expert index, the shared expert last: each token's summation order)."""
    cdef int i, th, nt = h.n_threads
    ffn_wave(h, s, slots, count)
    if n >= PARALLEL_TOKENS_MIN and nt > 1:
        for th in prange(nt, num_threads=nt, schedule='static'):
            add_wave_rows(h, s, slots, count, out, share_start(n, th, nt), share_start(n, th + 1, nt))
    else:
        add_wave_rows(h, s, slots, count, out, 0, n)
    for i in range(count):
        if s.stream_layer and slots[i].f != &L.shared:
            cb_cache_done(s.cache, L.expert0 + <int>(slots[i].f - L.experts))


cdef void expert_cache_step(const Hyper *h, Layer *L, Scratch *s, int n, int layer,
                            const float *router_in) noexcept nogil:
    """Tell the expert cache what this layer will use: decode, the top-k (read by the reader too
    with a prefetch mode) and, with PREDICT, the next layer's predicted experts; a call of several
    tokens, every expert some token chose — all at once, as decode uses its top-k, or, under a
    budget, streamed (s.stream_layer: one expert a wave, the next read meanwhile, each marked done
    after its product) when the call is a prompt's (more tokens than the Model's sequences: at
    most one per sequence is sequences decoded together) or its experts would take more than half
    the budget (the plan's working set is two layers' top-k: the cache never evicts the current
    layer's experts, so a larger set at once would go over it)."""
    cdef int k = h.top_k, E = h.n_experts, t, j, e
    cdef int64_t layer_bytes = 0
    cb_cache_layer(s.cache)
    if n == 1:
        for j in range(k):
            if s.tok_chosen[j] >= 0:                              # (-1: skipped, skip_missed)
                cb_cache_use(s.cache, L.expert0 + s.tok_chosen[j], h.prefetch != PREFETCH_NONE)
        if h.prefetch == PREFETCH_PREDICT:
            predict_next(h, L, s, s.tok_chosen, layer, router_in)
        return
    memset(s.expert_m, 0, sizeof(int) * E)
    for t in range(n * k):
        s.expert_m[s.tok_chosen[t]] += 1
    if h.stream_prefill:
        s.stream_layer = n > h.n_seq
        if not s.stream_layer:                                # decode tokens: do their experts fit?
            for e in range(E):
                if s.expert_m[e]:
                    layer_bytes += cb_cache_expert_bytes(s.cache, L.expert0 + e)
            s.stream_layer = 2 * layer_bytes > s.cache.budget
    if s.stream_layer:                                        # the first expert's read starts now
        for e in range(E):
            if s.expert_m[e]:
                cb_cache_prefetch(s.cache, L.expert0 + e)
                break
        return
    for e in range(E):
        if s.expert_m[e]:
            cb_cache_use(s.cache, L.expert0 + e, h.prefetch != PREFETCH_NONE)


cdef int cache_conditional_route(const Hyper *h, Layer *L, Scratch *s, const float *logits) noexcept nogil:
    """One decoded token's experts chosen with the ones the cache holds favoured (h.cache_routing):
    its router logits [n_experts], those of resident experts raised by cache_routing times their
    range, choose the top-k (s.tok_chosen); each chosen one's weight is the router's own from the
    unchanged logits: softmax over all experts (over the chosen with norm_topk_prob) times the
    per-expert scale, or for the sigmoid router sigmoid (over their sum with norm_topk_prob)
    times routed_scaling. Counts the choices the router alone would not have made. Returns
    route()'s status."""
    cdef int E = h.n_experts, k = h.top_k, e, j, i, same
    cdef int plain[MAX_SLOTS]
    cdef float plain_w[MAX_SLOTS]
    cdef float lo = logits[0], hi = logits[0], total = 0
    if route(h, L, logits, plain, plain_w) != 0:                  # the router's own choice
        return -1
    for e in range(E):
        lo = logits[e] if logits[e] < lo else lo
        hi = logits[e] if logits[e] > hi else hi
    for e in range(E):
        s.router2[e] = logits[e] + (h.cache_routing * (hi - lo) if s.cache.resident[L.expert0 + e] else 0)
    if route(h, L, s.router2, s.tok_chosen, s.tok_w) != 0:
        return -1
    for j in range(k):                                             # the chosen ones' own weights
        e = s.tok_chosen[j]
        s.tok_w[j] = 1.0 / (1.0 + expf(-logits[e])) if h.sigmoid_router else expf(logits[e] - hi)
        total += s.tok_w[j]
    if not h.sigmoid_router and not h.norm_topk_prob:
        total = 0
        for e in range(E):
            total += expf(logits[e] - hi)
    for j in range(k):
        if h.norm_topk_prob or not h.sigmoid_router:
            s.tok_w[j] /= total
        if h.sigmoid_router:
            s.tok_w[j] *= h.routed_scaling
        elif L.expert_scale != NULL:
            s.tok_w[j] *= L.expert_scale[s.tok_chosen[j]]
        same = 0
        for i in range(k):
            same = same or plain[i] == s.tok_chosen[j]
        if not same:
            s.prefetch_stats[PF_REROUTED] += 1
    return 0


cdef void skip_missed(const Hyper *h, Layer *L, Scratch *s) noexcept nogil:
    """One decoded token's chosen experts (s.tok_chosen, s.tok_w [top_k]): each that the cache
    does not hold, is not the heaviest and weighs less than h.skip_missed / top_k of their sum is
    marked -1 (no expert matches it) with weight 0; the kept weights are scaled back to the sum."""
    cdef int k = h.top_k, j, top = 0, e
    cdef float total = 0, kept = 0, w
    for j in range(k):
        total += s.tok_w[j]
        if s.tok_w[j] > s.tok_w[top]:
            top = j
    if not total > 0:
        return
    for j in range(k):
        e = s.tok_chosen[j]
        w = s.tok_w[j]
        if j != top and w < h.skip_missed / k * total and not s.cache.resident[L.expert0 + e]:
            s.tok_chosen[j] = -1
            s.tok_w[j] = 0
            s.prefetch_stats[PF_SKIPPED] += 1
        else:
            kept += w
    if kept != total:
        for j in range(k):
            s.tok_w[j] *= total / kept


cdef inline void stream_next(Scratch *s, Layer *L, int e, int E) noexcept nogil:
    """A prefill under a budget is about to compute expert e: count its use, and queue the read
    of the next expert the chunk routes to, so that it overlaps e's product."""
    cdef int f
    cb_cache_use(s.cache, L.expert0 + e, 1)
    for f in range(e + 1, E):
        if s.expert_m[f]:
            cb_cache_prefetch(s.cache, L.expert0 + f)
            break


cdef int moe(const Hyper *h, Layer *L, Scratch *s, int n, int layer, const float *router_in,
             const float *expert_in, float *out) noexcept nogil:
    """out [n, d] = for each token, the sum over its chosen experts of weight * expert(expert_in)
    (+ the gated shared expert); the router reads router_in (the same rows except in the parallel
    block). The experts run in ascending index, each over the tokens routed to it, in waves of up
    to MAX_SLOTS experts and wave_rows rows (decode: one wave of the top-k and the shared one); an
    expert every token chose reads expert_in itself (quantized once for all of them)."""
    cdef int d = h.d_model, k = h.top_k, E = h.n_experts, t, j, e, m, row = 0, count = 0, status
    cdef Slot slots[MAX_SLOTS]
    cdef Slot *sl
    matmul(s.router, E, &L.router, router_in, d, s.acts, n, h.n_threads)
    for t in range(n):
        if L.router_logit_bias != NULL:
            kernels.add(s.router + <size_t>t * E, L.router_logit_bias, E)
        if n == 1 and h.cache_routing > 0 and s.cache != NULL:    # decode: lossy, opt-in (load(cache_routing=))
            status = cache_conditional_route(h, L, s, s.router)
        else:
            status = route(h, L, s.router + <size_t>t * E, s.tok_chosen + t * k, s.tok_w + t * k)
        if status != 0:
            s.bad_layer = layer
            return STATUS_BAD_ROUTER
    memcpy(s.chosen + layer * k, s.tok_chosen + (n - 1) * k, sizeof(int) * k)     # last token, for --verbose
    memcpy(s.chosen_w + layer * k, s.tok_w + (n - 1) * k, sizeof(float) * k)
    s.stream_layer = 0
    if s.cache != NULL and h.skip_missed > 0 and n == 1:     # decode: lossy, opt-in (load(skip_missed=))
        skip_missed(h, L, s)
    if s.cache != NULL:
        expert_cache_step(h, L, s, n, layer, router_in)
    memset(out, 0, sizeof(float) * n * d)
    for e in range(E + 1 if L.has_shared else E):         # e == E: the shared expert, every token
        m = 0
        for t in range(n):
            for j in range(k):
                if e == E or s.tok_chosen[t * k + j] == e:
                    m += 1
                    break
        if m == 0:
            continue
        if count == MAX_SLOTS or row + m > s.wave_rows or (count and s.stream_layer):
            wave_finish(h, L, s, slots, count, n, out)       # the wave is full (streaming: one expert)
            count = row = 0
        if e < E and s.stream_layer:
            stream_next(s, L, e, E)
        if e < E:
            s.counts[layer * E + e] += m
        sl = &slots[count]
        sl.f = &L.shared if e == E else &L.experts[e]
        sl.row0 = row
        sl.m = m
        m = 0
        for t in range(n):
            for j in range(k):
                if e == E or s.tok_chosen[t * k + j] == e:
                    s.rows[row + m] = t
                    s.row_w[row + m] = shared_gate(L, expert_in + <size_t>t * d, d) if e == E else s.tok_w[t * k + j]
                    if sl.m < n:                            # gather the tokens routed to e
                        memcpy(s.g + <size_t>(row + m) * d, expert_in + <size_t>t * d, sizeof(float) * d)
                    m += 1
                    break
        if sl.m == n:                                       # every token: its input as it is
            sl.x = expert_in
            sl.acts = s.acts
        else:
            sl.x = s.g + <size_t>row * d
            sl.acts = s.wave_acts + row
        sl.ldx = d
        sl.out = s.y + <size_t>row * d
        row += sl.m
        count += 1
    if count:
        wave_finish(h, L, s, slots, count, n, out)
    return STATUS_OK


cdef int feed_forward(const Hyper *h, Layer *L, Scratch *s, int n, int layer) noexcept nogil:
    """s.xb2 [n, d] = the feed-forward block of the residuals s.x (s.xb: their ffn_norm)."""
    cdef int d = h.d_model, t, status
    cdef size_t o
    if not L.is_moe:
        ffn(h, &L.dense, s.xb, s.xb2, s, n)
        return STATUS_OK
    if not L.parallel:
        return moe(h, L, s, n, layer, s.xb, s.xb, s.xb2)
    # Gemma 4: dense MLP and experts side by side, each with its own norms, summed
    ffn(h, &L.dense, s.xb, s.xb2, s, n)
    for t in range(n):
        o = <size_t>t * d
        kernels.rmsnorm(s.xb2 + o, s.xb2 + o, L.post_mlp_norm, d, h.rms_eps)
        kernels.rmsnorm(s.rx + o, s.x + o, L.router_scale, d, h.rms_eps)
        kernels.scale(s.rx + o, h.router_root, d)
        kernels.rmsnorm(s.xe + o, s.x + o, L.pre_moe_norm, d, h.rms_eps)
    status = moe(h, L, s, n, layer, s.rx, s.xe, s.xm)
    if status != STATUS_OK:
        return status
    for t in range(n):
        o = <size_t>t * d
        kernels.rmsnorm(s.xm + o, s.xm + o, L.post_moe_norm, d, h.rms_eps)
        kernels.add(s.xb2 + o, s.xm + o, d)
    return STATUS_OK


cdef inline void rmsnorm_rows(float *out, const float *x, const float *weight, int n, const Hyper *h) noexcept nogil:
    """out[t] = rmsnorm(x[t]) * weight for the n rows [n, d_model]."""
    cdef int t
    if n >= PARALLEL_TOKENS_MIN and h.n_threads > 1:
        for t in prange(n, num_threads=h.n_threads, schedule='static'):
            kernels.rmsnorm(out + <size_t>t * h.d_model, x + <size_t>t * h.d_model, weight, h.d_model, h.rms_eps)
    else:
        for t in range(n):
            kernels.rmsnorm(out + <size_t>t * h.d_model, x + <size_t>t * h.d_model, weight, h.d_model, h.rms_eps)


cdef inline int logits_status(const Hyper *h, float *logits, int n) noexcept nogil:
    """Soft-cap the logits [n] where configured; STATUS_BAD_LOGITS if any is not finite."""
    if h.softcap > 0:
        kernels.softcap(logits, h.softcap, n)
    return STATUS_OK if kernels.all_finite(logits, n) else STATUS_BAD_LOGITS


cdef enum:
    WANT_NONE = 0             # no logits (an inner chunk of a long prompt)
    WANT_LAST = 1             # the last token's logits [vocab]
    WANT_ALL = 2              # every token's logits [n, vocab]
    WANT_SOME = 3             # the logits of the tokens s.tok_want marks, in their order [marked, vocab]


cdef int forward(const Hyper *h, Layer *layers, const Mat *embedding, const float *final_norm,
                 const Mat *lm_head, Scratch *s, const int *tokens, int n, int pos0,
                 float *logits, int want, Nextn *nextn, const float *hidden_in, float *hidden_out) noexcept nogil:
    """The model, layer by layer, over n <= s.cap tokens at positions pos0.. (decode: n = 1):

        embed -> for each layer: attn_norm, attention, residual, ffn_norm, MoE or dense FFN, residual
              -> final_norm -> lm_head (want: WANT_ALL, WANT_LAST, WANT_NONE or, in a step, WANT_SOME)

    A multi-token-prediction block (nextn.eh_proj set) takes eh_proj([enorm(embed); hnorm(hidden_in)])
    as its stream. hidden_out [n, d] (or NULL): every row's hidden state after the final norm.
    """
    cdef int d = h.d_model, layer, t, status, kept
    cdef Layer *L
    for t in range(n):
        kernels.dequant_row(s.x + <size_t>t * d, embedding.data, embedding.dtype, embedding.layout, tokens[t],
                            embedding.rows, d)
        if h.embed_scale != 1.0:
            kernels.scale(s.x + <size_t>t * d, h.embed_scale, d)
    if nextn.eh_proj.data != NULL:                                  # a nextn block's input
        for t in range(n):
            kernels.rmsnorm(nextn.joined + <size_t>t * 2 * d, s.x + <size_t>t * d, nextn.enorm, d, h.rms_eps)
            kernels.rmsnorm(nextn.joined + <size_t>t * 2 * d + d, hidden_in + <size_t>t * d, nextn.hnorm, d,
                            h.rms_eps)
        matmul(s.x, d, &nextn.eh_proj, nextn.joined, 2 * d, s.acts, n, h.n_threads)
    for layer in range(h.n_layers):
        L = &layers[layer]
        rmsnorm_rows(s.xb, s.x, L.attn_norm, n, h)                 # attention block
        if L.mla:
            attention_mla(h, L, s, n, pos0)
        else:
            attention(h, L, s, n, pos0)
        if L.post_attn_norm != NULL:
            rmsnorm_rows(s.xb2, s.xb2, L.post_attn_norm, n, h)
        kernels.add(s.x, s.xb2, n * d)
        rmsnorm_rows(s.xb, s.x, L.ffn_norm, n, h)                  # feed-forward block
        status = feed_forward(h, L, s, n, layer)
        if status != STATUS_OK:
            return status
        if L.post_ffn_norm != NULL:
            rmsnorm_rows(s.xb2, s.xb2, L.post_ffn_norm, n, h)
        kernels.add(s.x, s.xb2, n * d)
        if L.layer_scalar != 1.0:
            kernels.scale(s.x, L.layer_scalar, n * d)
    if hidden_out != NULL:                                          # every row normed, as the head reads it
        rmsnorm_rows(s.x, s.x, final_norm, n, h)
        memcpy(hidden_out, s.x, sizeof(float) * n * d)
        if want == WANT_NONE:
            return STATUS_OK if kernels.all_finite(s.x, n * d) else STATUS_BAD_HIDDEN
        if want == WANT_ALL:
            matmul(logits, h.vocab, lm_head, s.x, d, s.acts, n, h.n_threads)
            return logits_status(h, logits, n * h.vocab)
        matmul(logits, h.vocab, lm_head, s.x + <size_t>(n - 1) * d, d, s.acts, 1, h.n_threads)
        return logits_status(h, logits, h.vocab)
    if want == WANT_SOME:                                           # the marked rows to the front
        kept = 0
        for t in range(n):
            if s.tok_want[t]:
                if kept != t:
                    memcpy(s.x + <size_t>kept * d, s.x + <size_t>t * d, sizeof(float) * d)
                kept += 1
        if kept == 0:
            want = WANT_NONE
        else:
            n = kept
            want = WANT_ALL
    if want == WANT_NONE:
        return STATUS_OK if kernels.all_finite(s.x, n * d) else STATUS_BAD_HIDDEN
    if want == WANT_ALL:                                            # head
        rmsnorm_rows(s.x, s.x, final_norm, n, h)
        matmul(logits, h.vocab, lm_head, s.x, d, s.acts, n, h.n_threads)
        return logits_status(h, logits, n * h.vocab)
    rmsnorm_rows(s.x + <size_t>(n - 1) * d, s.x + <size_t>(n - 1) * d, final_norm, 1, h)
    matmul(logits, h.vocab, lm_head, s.x + <size_t>(n - 1) * d, d, s.acts, 1, h.n_threads)
    return logits_status(h, logits, h.vocab)
