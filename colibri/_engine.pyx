# cython: language_level=3
"""The layer loop of Colibri: the model over n tokens, written once (decode is n = 1).

Design
------
`Engine` holds raw pointers into the mapped weight files (never copies of them), the KV cache and
one scratch arena, all sized once from the config. `Engine.run()` pushes tokens through
`forward()` without the GIL, a prefill chunk at a time (decode is a chunk of one token);
`forward()` is the whole model in one screen, over n tokens:

    embed -> for each layer: attn_norm, attention, residual, ffn_norm, MoE or dense FFN, residual
          -> final_norm -> lm_head

Every block is written once for n tokens: every weight is read once per chunk, and since no
kernel's arithmetic depends on n, a prompt gives exactly the logits of decoding it token by token.
Architectures differ only by flags in `Hyper` and by which per-layer pointers are NULL (biases,
q/k norms, shared expert, Gemma's extra norms and scales, gpt-oss's sinks and expert biases): one
parameterised block, no per-architecture code paths — except the attention of multi-head latent
attention layers (DeepSeek-V3, `attention_mla`), whose KV cache holds the latent and whose
up-projections are absorbed into the query and the output. Attention geometry is per layer (Gemma 4's global layers have
their own head_dim, key/value heads and RoPE); a sliding-window layer's KV cache is a ring of
window + prefill chunk rows, so it holds only what that layer can still attend to. The MoE block
runs the experts in ascending index, each over the tokens routed to it, in waves that share a
parallel region (decode: the top-k and the shared expert in one). Kernels are the C functions of
csrc/: the table-driven ones through _kernels' entry points (the tier chosen at import), the
router through _routing, the element-wise ones directly (_kernels.pxd says which are which). A
non-zero status (non-finite router logits or logits: a damaged model) is turned into an exception
by the Python layer. Under a memory budget (or a prefetch mode) the MoE block tells the expert
cache (csrc/expert_cache.h) which experts it uses and expects; a prefill under a budget then runs
one expert per wave, the next one's read queued before the current one's product. The structs
(Mat, FFN, Layer, Hyper, Scratch) are declared in _engine.pxd.
"""

from libc.stdint cimport uintptr_t, int32_t, int64_t, uint8_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memset, memcpy
from libc.math cimport expf, sqrtf
cimport cython
from cython.parallel cimport prange

cimport colibri._kernels as kernels
cimport colibri._routing as routing
from colibri._kernels cimport (cb_act_q8, cb_matjob, CB_F32, CB_INT8, CB_INT4, CB_MXFP4, CB_NL4, CB_INT6, CB_BF16,
                               CB_TRANSPOSED, CB_INTERLEAVED, CB_ACT_SWIGLU_CLAMPED, cb_row_stride, cb_kv_row_bytes)

import numpy as np

from colibri.errors import ColibriError

from colibri import names
from colibri._kernels import ACT_ARRAYS, DTYPE_CODES, KV_CODES, LAYOUT_CODES, act_specs
from colibri._os import arena, zeros     # every buffer of the engine comes from the OS layer (alloc_aligned)

# Step status codes, read by model.py.
cpdef enum:
    STATUS_OK = 0
    STATUS_BAD_ROUTER = 1
    STATUS_BAD_LOGITS = 2
    STATUS_BAD_HIDDEN = 3

# expert prefetching through the expert cache's readers (PREFETCH_CODES names them)
cpdef enum:
    PREFETCH_NONE = 0         # experts are read by the loop's page faults
    PREFETCH_ROUTED = 1       # a chosen expert that is not resident is also read by the readers, in one request
    # ... and the next layer's likely experts (its router on this hidden state) one layer early
    PREFETCH_PREDICT = 2

# prediction counters, Engine.prefetch_stats[PF_*]
cpdef enum:
    PF_PREDICTED = 0          # experts predicted for the next layer
    PF_PREDICT_HITS = 1       # of which the next layer really chose
    PF_N = 2

# q/k norm modes (QK_NORM_CODES names them)
cpdef enum:
    QK_NORM_NONE = 0
    QK_NORM_PER_HEAD = 1     # Qwen3-MoE: RMSNorm over each head's head_dim values
    QK_NORM_WHOLE = 2        # OLMoE: RMSNorm over the whole projected q (k) vector

PREFETCH_CODES = dict(zip(names.PREFETCH_MODES, (PREFETCH_NONE, PREFETCH_ROUTED, PREFETCH_PREDICT)))
QK_NORM_CODES = {"none": QK_NORM_NONE, "per_head": QK_NORM_PER_HEAD, "whole": QK_NORM_WHOLE}
# _os.EngineAdvice kinds
ADVICE_CODES = {"none": CB_ADVICE_NONE, "madvise": CB_ADVICE_MADVISE, "win32": CB_ADVICE_WIN32}
EVICTION_CODES = dict(zip(names.EVICTION_POLICIES, (CB_EVICT_LRU, CB_EVICT_LFU)))      # the expert cache's policies
# the expert cache's counters, Engine.cache_stats[CACHE_STATS[name]] (csrc/expert_cache.h)
CACHE_STATS = {"hits": CB_CS_HITS, "misses": CB_CS_MISSES, "prefetches": CB_CS_PREFETCHES,
               "prefetch_hits": CB_CS_PREFETCH_HITS, "evictions": CB_CS_EVICTIONS, "wasted_prefetches": CB_CS_WASTED,
               "over_budget": CB_CS_OVER_BUDGET, "read_calls": CB_CS_READ_CALLS, "read_bytes": CB_CS_READ_BYTES,
               "drops": CB_CS_DROPS, "advice_failures": CB_CS_FAILURES}

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
    cdef int d = h.d_model, k = h.top_k, E = h.n_experts, t, j, e, m, row = 0, count = 0
    cdef Slot slots[MAX_SLOTS]
    cdef Slot *sl
    matmul(s.router, E, &L.router, router_in, d, s.acts, n, h.n_threads)
    for t in range(n):
        if L.router_logit_bias != NULL:
            kernels.add(s.router + <size_t>t * E, L.router_logit_bias, E)
        if route(h, L, s.router + <size_t>t * E, s.tok_chosen + t * k, s.tok_w + t * k) != 0:
            s.bad_layer = layer
            return STATUS_BAD_ROUTER
    memcpy(s.chosen + layer * k, s.tok_chosen + (n - 1) * k, sizeof(int) * k)     # last token, for --verbose
    memcpy(s.chosen_w + layer * k, s.tok_w + (n - 1) * k, sizeof(float) * k)
    s.stream_layer = 0
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
                 float *logits, int want) noexcept nogil:
    """The model, layer by layer, over n <= s.cap tokens at positions pos0.. (decode: n = 1):

        embed -> for each layer: attn_norm, attention, residual, ffn_norm, MoE or dense FFN, residual
              -> final_norm -> lm_head (want: WANT_ALL, WANT_LAST, WANT_NONE or, in a step, WANT_SOME)
    """
    cdef int d = h.d_model, layer, t, status, kept
    cdef Layer *L
    for t in range(n):
        kernels.dequant_row(s.x + <size_t>t * d, embedding.data, embedding.dtype, embedding.layout, tokens[t],
                            embedding.rows, d)
        if h.embed_scale != 1.0:
            kernels.scale(s.x + <size_t>t * d, h.embed_scale, d)
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
    max_cols = max(d, q_dim, max_ff, q_lora, mla_o)
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
        addresses and the run options, all derived there; here they are only checked and laid out."""
        cdef int d = spec.d_model
        cdef int n_layers = spec.n_layers
        cdef int n_experts = spec.n_experts
        cdef int top_k = spec.top_k
        cdef int n_ctx = spec.n_ctx
        cdef int cap = spec.prefill_chunk
        cdef int n_seq = spec.n_seq
        layers = spec.layers
        tensors = spec.tensors
        if not 1 <= top_k <= MAX_TOP_K or n_experts < 1 or not 1 <= cap <= n_ctx or len(layers) != n_layers \
                or not 1 <= n_seq <= cap:
            raise ValueError(f"inconsistent EngineSpec: top_k {top_k}, n_experts {n_experts}, "
                             f"prefill_chunk {cap}, n_ctx {n_ctx}, {len(layers)} layers of {n_layers}, "
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
        kv_type, kv_shapes = _kv_layout(spec)       # (checks the KV cache's type)
        self.h.kv = KV_CODES[spec.kv_cache]

        specs, wave, max_ff = _scratch_layout(spec)
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
        cdef Scratch *s = &self.s
        s.cap = cap
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
        for (pl, pe), (start, length) in spec.expert_pages.items():
            keep["expert_pages"][pl * n_experts + pe] = (start, length)
        if spec.prefetch != PREFETCH_NONE or spec.expert_budget is not None:
            self._start_cache(spec, keep)
        self.cache_stats = keep["cache_stats"]
        self.cache_resident = keep["cache_resident"]
        self.logits = keep["logits"]
        self.chosen = keep["chosen"]
        self.chosen_weights = keep["chosen_w"]
        self.expert_counts = keep["counts"]
        self.prefetch_stats = keep["prefetch_stats"]

        self.embedding = _mat(tensors["embedding"])
        self.lm_head = _mat(tensors["lm_head"] if "lm_head" in tensors else tensors["embedding"])
        self.final_norm = _vec(tensors, "final_norm")

        self.layers = <Layer *>calloc(n_layers, sizeof(Layer))
        self.experts = <FFN *>calloc(n_layers * n_experts, sizeof(FFN))
        if self.layers == NULL or self.experts == NULL:
            raise MemoryError("cannot allocate the layer table")
        cdef Layer *L
        cdef int layer, e
        for layer in range(n_layers):
            L = &self.layers[layer]
            p = f"layers.{layer}."
            f = layers[layer]
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
            L.kv_seq_bytes = keep["k_cache"][layer].nbytes // n_seq
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

    def run(self, const int[::1] tokens, int pos0, float[:, ::1] logits_out, bint all_logits, int seq=0):
        """Push tokens[0..T) of sequence `seq` (0 .. n_seq - 1) through the model at positions
        pos0.., in chunks of at most the prefill chunk (every weight read once per chunk; decode is
        a chunk of one token).

        all_logits: logits_out is [T, vocab] and receives every position's logits;
        otherwise logits_out is [1, vocab] and receives only the last one (the lm_head is skipped
        for the others). logits_out None: no logits at all (an inner chunk of a prompt the caller
        runs piece by piece). Returns (status, token index of a failure, layer of a bad router).
        """
        cdef int t = 0, n, status = STATUS_OK
        cdef int T = tokens.shape[0]
        cdef int want
        cdef bint none = logits_out is None
        cdef float *out = NULL
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
                status = forward(&self.h, self.layers, &self.embedding, self.final_norm, &self.lm_head,
                                 &self.s, &tokens[t], n, pos0 + t, out, want)
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
        self.s.tok_want = NULL if want is None else &want[0]
        with nogil:
            status = forward(&self.h, self.layers, &self.embedding, self.final_norm, &self.lm_head,
                             &self.s, &tokens[0], B, 0, &logits_out[0, 0], WANT_ALL if want is None else WANT_SOME)
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
