# cython: language_level=3
"""The compiled layer loop of Colibri.

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
q/k norms, shared expert, Gemma's extra norms and scales): one parameterised block, no
per-architecture code paths. Attention geometry is per layer (Gemma 4's global layers have
their own head_dim, key/value heads and RoPE); a sliding-window layer's KV cache is a ring of
window + prefill chunk rows, so it holds only what that layer can still attend to. The MoE block
runs the experts in ascending index, each over the tokens routed to it, in waves that share a
parallel region (decode: the top-k and the shared expert in one). Kernels are the C functions of
csrc/, through the kernel table of the tier chosen at import. A non-zero status (non-finite router
logits or logits: a damaged model) is turned into an exception by the Python layer.
"""

from libc.stdint cimport uintptr_t, uint8_t, int8_t, uint16_t, int32_t, int64_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memset, memcpy
from libc.math cimport expf, sqrtf

import numpy as np

cdef extern from "kernels_scalar.h" nogil:
    int CB_F32, CB_F16, CB_BF16, CB_INT8, CB_INT4
    int CB_ROWS, CB_TRANSPOSED, CB_INTERLEAVED
    ctypedef struct cb_act_q8:
        signed char *q     # [n]
        float *d           # [n / 32]
        int32_t *s         # [n / 32] the sum of each block's q
        int n
        float *xp          # [n] or NULL: the activation reordered for the bf16 tile
    void cb_init_tables()

    float cb_f16_to_f32_exact(uint16_t h)
    float cb_bf16_to_f32(uint16_t h)
    size_t cb_row_stride(int dtype, int cols)
    void cb_dequant_row(float *out, const void *w, int dtype, int layout, int row, int rows, int cols)
    void cb_rmsnorm(float *out, const float *x, const float *weight, int n, float eps)
    void cb_add(float *acc, const float *x, int n)
    void cb_axpy(float *acc, float a, const float *x, int n)
    void cb_clip(float *x, float limit, int n)
    void cb_scale(float *x, float a, int n)
    void cb_softcap(float *x, float cap, int n)
    int cb_softmax(float *x, int n)
    void cb_rope(float *v, int n_heads, int head_dim, const float *cos_t, const float *sin_t)
    int cb_all_finite(const float *x, int n)

cdef extern from "dispatch.h" nogil:
    int CB_ISA_SCALAR, CB_ISA_AVX2, CB_ISA_AVX512
    ctypedef struct cb_cpu_features:
        int avx2, fma, f16c, avx512f, avx512bw, avx512vl, avx512dq
        int avx512_vnni, avx512_bf16, avx_vnni, os_avx, os_avx512
    ctypedef struct cb_kernel_table:
        int isa
        int int_step
    int CB_INT_STEP_SCALAR, CB_INT_STEP_AVX2, CB_INT_STEP_VNNI_EMULATED, CB_INT_STEP_AVXVNNI
    int CB_INT_STEP_AVX512VNNI
    cb_kernel_table cb_kt
    cb_cpu_features cb_cpu
    cb_cpu_features cb_detect_cpu()
    int cb_best_isa(const cb_cpu_features *f)
    int cb_select_isa(int isa)
    int cb_set_int_step(int step)
    int cb_set_prefill_repack(int on)
    int cb_dpbusd_emulated(int32_t *out, const int32_t *acc, const uint8_t *u, const int8_t *s)
    void cb_glu(float *gate, const float *up, int n, int act)
    int cb_window_start(int pos, int window)
    void cb_matmul(float *out, int ldo, const void *w, int dtype, int layout, const float *x, int ldx,
                   cb_act_q8 *acts, int n, int rows, int cols, int n_threads)
    int cb_attention_softmax(float *x, int n)
    void cb_quantize_act(cb_act_q8 *a, const float *x, int n)
    void cb_attention(float *out, int ldo, const float *q, int ldq, const float *k_cache,
                      const float *v_cache, float *scores, int n_heads, int n_kv_heads, int head_dim,
                      int n_ctx, int n, int pos0, int window, int ring, float scale, int n_threads)
    ctypedef struct cb_matjob:
        int n
        float *out
        int ldo
        const void *w
        int dtype
        int layout
        int rows
        int cols
        const float *x
        int ldx
        cb_act_q8 *acts
        const float *glu_up
        int glu_act
    void cb_matmul_jobs(const cb_matjob *jobs, int count, int n_threads)

cdef extern from "os_hints.h" nogil:
    int cb_will_need(const void *start, size_t length, size_t chunk)
    int cb_release_pages(const void *start, size_t length)

cdef extern from "routing.h" nogil:
    int CB_MAX_TOP_K
    float CB_LUT_DELTA
    void cb_init_softmax_lut()
    int cb_route(const float *logits, int n_experts, int k, int norm_topk_prob, int use_lut,
                 int *chosen, float *weights)

cb_init_tables()
cb_init_softmax_lut()
LUT_DELTA = CB_LUT_DELTA        # worst-case error of one table exponential (softmax_lut.h)
MAX_TOP_K = CB_MAX_TOP_K

# ---- the SIMD tier, chosen once at import (COLIBRI_ISA forces one) ---------------------------

ISA_NAMES = {"scalar": CB_ISA_SCALAR, "avx2": CB_ISA_AVX2, "avx512": CB_ISA_AVX512}


def cpu_features():
    """What this CPU and OS support: {feature name: bool}."""
    cdef cb_cpu_features f = cb_detect_cpu()
    return {"avx2": bool(f.avx2), "fma": bool(f.fma), "f16c": bool(f.f16c), "avx512f": bool(f.avx512f),
            "avx512bw": bool(f.avx512bw), "avx512vl": bool(f.avx512vl), "avx512dq": bool(f.avx512dq),
            "avx512_vnni": bool(f.avx512_vnni), "avx512_bf16": bool(f.avx512_bf16),
            "avx_vnni": bool(f.avx_vnni), "os_avx": bool(f.os_avx), "os_avx512": bool(f.os_avx512)}


def available_isas():
    """The tiers this machine can run, slowest first."""
    cdef cb_cpu_features f = cb_detect_cpu()
    best = cb_best_isa(&f)
    return [name for name, code in ISA_NAMES.items() if code <= best]


def select_isa(str name):
    """Switch every kernel to tier `name` (scalar, avx2, avx512). ValueError if unavailable."""
    if name not in ISA_NAMES:
        raise ValueError(f"COLIBRI_ISA={name!r} is not a tier; choose one of {', '.join(ISA_NAMES)}")
    if cb_select_isa(ISA_NAMES[name]) != 0:
        raise ValueError(f"COLIBRI_ISA={name}: this CPU (or OS) does not support it; "
                         f"available: {', '.join(available_isas())}")


# How the transposed int8/int4 kernels (decode tiles, repacked prefill) multiply bytes (dispatch.h,
# CB_INT_STEP_*): the scalar tier's C, AVX2 maddubs + madd, the VNNI step emulated in AVX2 (tests),
# AVX-VNNI, AVX512-VNNI. All give the same bits.
INT_STEPS = {"scalar": CB_INT_STEP_SCALAR, "avx2": CB_INT_STEP_AVX2, "vnni-emulated": CB_INT_STEP_VNNI_EMULATED,
             "avx-vnni": CB_INT_STEP_AVXVNNI, "avx512-vnni": CB_INT_STEP_AVX512VNNI}


def int_step():
    """The step of the transposed int8/int4 kernels in use (an INT_STEPS name)."""
    return {v: k for k, v in INT_STEPS.items()}[cb_kt.int_step]


def available_int_steps():
    """The INT_STEPS the current tier can run on this CPU, slowest first."""
    before = cb_kt.int_step
    names = [name for name, step in INT_STEPS.items() if cb_set_int_step(step) == 0]
    cb_set_int_step(before)
    return names


def set_int_step(str name):
    """Use step `name` for the transposed int8/int4 kernels from now on (tests and benchmarks
    compare them; selecting a tier picks the fastest). ValueError if unknown or if this tier and
    CPU cannot run it."""
    if name not in INT_STEPS:
        raise ValueError(f"{name!r} is not an int step; choose one of {', '.join(INT_STEPS)}")
    if cb_set_int_step(INT_STEPS[name]) != 0:
        raise ValueError(f"int step {name} cannot run on tier {isa()} of this CPU; "
                         f"available: {', '.join(available_int_steps())}")


def set_prefill_repack(bint on):
    """Turn the repacked prefill of transposed int8/int4 matrices off or back on (tests and
    benchmarks compare it with the stored-order tile; the engine always uses it where the tier has
    one). Returns whether it is now on."""
    return bool(cb_set_prefill_repack(on))


class int_kernels:
    """`with int_kernels(step, repack):` the transposed int8/int4 kernels with int step `step` (None:
    the one in use) and the repacked prefill on or off, both restored after (tests, benchmarks)."""

    def __init__(self, step=None, repack=True):
        self.step, self.repack = step, repack

    def __enter__(self):
        self.saved = int_step()
        set_int_step(self.step or self.saved)
        set_prefill_repack(self.repack)
        return self

    def __exit__(self, *exc):
        set_int_step(self.saved)
        set_prefill_repack(True)
        return False


def isa():
    """The tier in use."""
    return {v: k for k, v in ISA_NAMES.items()}[cb_kt.isa]


def _select_at_import():
    import os
    forced = os.environ.get("COLIBRI_ISA", "").strip().lower()
    if forced:
        select_isa(forced)        # ValueError names the problem; colibri.model turns it into a clear error
    else:
        select_isa(max(available_isas(), key=ISA_NAMES.get))


try:
    _select_at_import()
    ISA_ERROR = None
except ValueError as e:           # keep importable; loading a model reports the error
    select_isa(max(available_isas(), key=ISA_NAMES.get))
    ISA_ERROR = str(e)

# Step status codes, read by model.py.
cpdef enum:
    STATUS_OK = 0
    STATUS_BAD_ROUTER = 1
    STATUS_BAD_LOGITS = 2
    STATUS_BAD_HIDDEN = 3

# expert prefetching (residency.PREFETCH_MODES maps the names to these codes)
cpdef enum:
    PREFETCH_NONE = 0
    PREFETCH_ROUTED = 1       # advise the OS of a layer's chosen experts as soon as they are chosen
    PREFETCH_PREDICT = 2      # ... and of the next layer's likely experts (its router on this hidden state)

# prefetch counters, Engine.prefetch_stats[PF_*]
cpdef enum:
    PF_CALLS = 0
    PF_BYTES = 1
    PF_FAILURES = 2
    PF_PREDICTED = 3          # experts predicted for the next layer
    PF_PREDICT_HITS = 4       # of which the next layer really chose
    PF_N = 5

# q/k norm modes (config.QK_NORM_MODES maps the names to these codes).
cpdef enum:
    QK_NORM_NONE = 0
    QK_NORM_PER_HEAD = 1     # Qwen3-MoE: RMSNorm over each head's head_dim values
    QK_NORM_WHOLE = 2        # OLMoE: RMSNorm over the whole projected q (k) vector


cdef struct Mat:
    const void *data      # [rows, cols] row-major (layout rows) or transposed (kernels_scalar.h), `dtype` elements
    int dtype
    int layout            # CB_ROWS / CB_TRANSPOSED (kernels_scalar.h)
    int rows
    int cols

cdef struct FFN:          # SwiGLU: down(silu(gate x) * up x)
    Mat gate              # [d_ff, d_model]
    Mat up                # [d_ff, d_model]
    Mat down              # [d_model, d_ff]

cdef struct Range:        # a page-aligned span of mapped memory
    const void *start
    size_t length

cdef struct Layer:
    int head_dim              # this layer's attention geometry (Gemma 4: global layers differ)
    int n_kv_heads
    float attn_scale          # the factor on q.k
    const float *rope_cos     # [n_ctx, head_dim / 2]
    const float *rope_sin     # [n_ctx, head_dim / 2]
    const float *attn_norm    # [d_model]
    Mat wq                    # [n_heads * head_dim, d_model]
    Mat wk                    # [n_kv_heads * head_dim, d_model]
    Mat wv                    # [n_kv_heads * head_dim, d_model]; data NULL: v is the k projection
    Mat wo                    # [d_model, n_heads * head_dim]
    const float *bq           # [n_heads * head_dim] or NULL
    const float *bk           # [n_kv_heads * head_dim] or NULL
    const float *bv           # [n_kv_heads * head_dim] or NULL
    const float *bo           # [d_model] or NULL
    const float *q_norm       # [head_dim] (per head) or [n_heads * head_dim] (whole) or NULL
    const float *k_norm       # [head_dim] or [n_kv_heads * head_dim] or NULL
    const float *ffn_norm     # [d_model]
    const float *post_attn_norm   # [d_model] or NULL (Gemma's sandwich norms)
    const float *post_ffn_norm    # [d_model] or NULL
    float layer_scalar        # the residual stream is multiplied by it after the layer (1: no-op)
    int sliding_window        # 0: attend to every earlier position
    int is_moe
    Mat router                # [n_experts, d_model] f32 (MoE layers)
    FFN *experts              # [n_experts] (MoE layers)
    Range *expert_pages       # [n_experts] the mapped file of each expert, for prefetching
    int has_shared
    FFN shared                # the shared expert (Qwen2-MoE)
    const float *shared_gate  # [d_model]: sigmoid(shared_gate . x) scales the shared expert
    FFN dense                 # the dense MLP (non-MoE layers, and beside the MoE when parallel)
    int parallel              # Gemma 4: dense MLP and MoE side by side, each with its own norms
    const float *post_mlp_norm    # [d_model] (parallel) after the dense MLP
    const float *pre_moe_norm     # [d_model] (parallel) the experts' input norm
    const float *post_moe_norm    # [d_model] (parallel) after the experts
    const float *router_scale     # [d_model] (parallel) the router reads rmsnorm(x) * router_scale * d**-0.5
    const float *expert_scale     # [n_experts] or NULL: multiplies each chosen expert's weight
    int kv_ring               # rows of the cache: n_ctx, or window + prefill chunk (sliding layers)
    float *k_cache            # [n_kv_heads, kv_ring, head_dim], position p in row p % kv_ring of each head
    float *v_cache            # [n_kv_heads, kv_ring, head_dim]

cdef struct Hyper:
    int d_model
    int n_layers
    int n_heads
    int vocab
    int n_experts
    int top_k
    int norm_topk_prob
    int use_lut               # routing exponentials from the softmax table instead of expf
    int prefetch              # PREFETCH_NONE / _ROUTED / _PREDICT
    int release_in_prefill    # under an expert budget: release each expert after its prefill product
    int qk_norm
    float clip_qkv            # 0: no clipping
    int v_norm                # RMSNorm without weight over each value head (Gemma 4)
    int act                   # CB_ACT_SILU / CB_ACT_GELU_TANH of the FFN gate
    float embed_scale         # the embedding row is multiplied by it (1: no-op)
    float softcap             # final logit soft-capping (0: none)
    float router_root         # d_model ** -0.5 (the parallel MoE's router input)
    float rms_eps
    int n_ctx
    int n_threads

cdef struct Scratch:
    # Every buffer of one engine call: up to `cap` tokens (a prefill chunk; decode is one), rows
    # [cap, ...] with token t in row t. Sized once from the config (Engine.__init__).
    int cap
    float *x          # [cap, d_model] the residual streams
    float *xb         # [cap, d_model] normed inputs of a block
    float *xb2        # [cap, d_model] outputs of a block
    float *q          # [cap, n_heads * max head_dim]
    float *att        # [cap, n_heads * max head_dim] attention outputs before wo
    float *k          # [cap, max kv_dim] keys of the tokens, before they go to the cache rows
    float *v          # [cap, max kv_dim] their values
    float *scores     # [n_heads, n_ctx]
    float *rx         # [cap, d_model] router inputs (parallel MoE)
    float *xe         # [cap, d_model] expert inputs (parallel MoE)
    float *xm         # [cap, d_model] expert outputs (parallel MoE)
    cb_act_q8 *acts   # [cap] activation quantization of the block inputs (q: [max_cols], d: [max_cols / 32])
    float *router     # [cap, n_experts] router logits, then probabilities
    int *tok_chosen   # [cap, top_k] each token's experts in this layer
    float *tok_w      # [cap, top_k] their weights
    # the MoE wave (moe): the experts of a layer in ascending index, as many together as fit
    int wave_rows     # rows of the wave buffers: >= cap and >= MAX_SLOTS
    int max_ff
    float *g          # [wave_rows, d_model] inputs gathered for the experts of a wave
    float *hb         # [wave_rows, max_ff] FFN hidden (gate, then activation)
    float *hb2        # [wave_rows, max_ff] FFN hidden (up)
    float *y          # [wave_rows, d_model] expert outputs
    int *rows         # [wave_rows] the token of each gathered row
    float *row_w      # [wave_rows] its expert's weight
    cb_act_q8 *wave_acts  # [wave_rows] quantization of gathered inputs, then of the hidden rows
    float *logits     # [vocab] the last token's logits of the last call
    int *chosen       # [n_layers, top_k] experts chosen for the last token (for --verbose)
    float *chosen_w   # [n_layers, top_k] their weights
    int64_t *counts   # [n_layers, n_experts] how often each expert was chosen
    int bad_layer     # the layer of a bad router status
    int *predicted    # [n_layers, top_k] experts predicted for a layer by the previous one's hidden state
    int64_t *prefetch_stats   # [PF_N] counters, see PF_*
    float *router2    # [n_experts] router logits of the next layer (prediction)
    float *pred_w     # [top_k] scratch weights of a prediction
    size_t prefetch_chunk     # bytes per advice call (0: no limit), from colibri._os.prefetch_chunk


# ---- the blocks of the layer loop, each over n tokens (decode: n = 1) ------------------------

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


cdef inline void matmul(float *out, int ldo, const Mat *m, const float *x, int ldx, cb_act_q8 *acts, int n,
                        int n_threads) noexcept nogil:
    """out[t * ldo + r] = m[r, :] . x[t * ldx + :] for t < n: one product in one parallel region."""
    cdef cb_matjob j
    job(&j, out, ldo, m, x, ldx, acts, n)
    cb_matmul_jobs(&j, 1, n_threads)


cdef inline int gate_up_jobs(cb_matjob *jobs, const FFN *f, float *gate_out, float *up_out, int ldo,
                             const float *x, int ldx, cb_act_q8 *acts, int n, int act) noexcept nogil:
    """jobs[0:2] = up, then gate with the activation fused in (gate_out = act(gate x) * up x, each
    thread over the rows it computed) when both matrices split alike (same format, layout and
    shape, as converted models have). Returns 1 if fused, 0 if the caller must apply cb_glu."""
    job(&jobs[0], up_out, ldo, &f.up, x, ldx, acts, n)
    job(&jobs[1], gate_out, ldo, &f.gate, x, ldx, acts, n)
    if f.gate.dtype == f.up.dtype and f.gate.layout == f.up.layout and f.gate.rows == f.up.rows:
        jobs[1].glu_up = up_out
        jobs[1].glu_act = act
        return 1
    return 0


cdef enum:
    MAX_SLOTS = 65            # FFNs of one wave: at least top-k (<= CB_MAX_TOP_K) and the shared one


cdef struct Slot:             # one FFN of a wave over some of the tokens
    const FFN *f
    const float *x            # [m, ldx] its input rows
    int ldx
    cb_act_q8 *acts           # [m] their quantization scratch
    int row0                  # its rows of the wave buffers: row0 .. row0 + m - 1
    int m
    float *out                # [m, d_model] where its outputs go (s.y + row0 * d_model in a MoE wave)


cdef void ffn_wave(const Hyper *h, Scratch *s, const Slot *slots, int count) noexcept nogil:
    """For each slot i: out[t] = down(act(gate x_t) * up x_t), t < m, of its FFN (hidden rows row0..
    of the wave buffers): every gate and up of the wave in one parallel region, every down in another."""
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
    cb_matmul_jobs(jobs, 2 * count, h.n_threads)
    for i in range(count):
        r = <size_t>slots[i].row0
        if not fused[i]:
            for t in range(slots[i].m):
                cb_glu(s.hb + (r + t) * ff, s.hb2 + (r + t) * ff, slots[i].f.gate.rows, h.act)
        job(&jobs[i], slots[i].out, h.d_model, &slots[i].f.down, s.hb + r * ff, ff, s.wave_acts + r, slots[i].m)
    cb_matmul_jobs(jobs, count, h.n_threads)


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
        cb_add(q, L.bq, q_dim)
    if L.bk != NULL:
        cb_add(k, L.bk, kv_dim)
    if L.wv.data == NULL:
        memcpy(v, k, sizeof(float) * kv_dim)
    elif L.bv != NULL:
        cb_add(v, L.bv, kv_dim)
    if h.qk_norm == QK_NORM_PER_HEAD:
        for i in range(h.n_heads):
            cb_rmsnorm(q + i * hd, q + i * hd, L.q_norm, hd, h.rms_eps)
        for i in range(L.n_kv_heads):
            cb_rmsnorm(k + i * hd, k + i * hd, L.k_norm, hd, h.rms_eps)
    elif h.qk_norm == QK_NORM_WHOLE:
        cb_rmsnorm(q, q, L.q_norm, q_dim, h.rms_eps)
        cb_rmsnorm(k, k, L.k_norm, kv_dim, h.rms_eps)
    if h.v_norm:
        for i in range(L.n_kv_heads):
            cb_rmsnorm(v + i * hd, v + i * hd, NULL, hd, h.rms_eps)
    if h.clip_qkv > 0:                                              # OLMoE's clip_qkv
        cb_clip(q, h.clip_qkv, q_dim)
        cb_clip(k, h.clip_qkv, kv_dim)
        cb_clip(v, h.clip_qkv, kv_dim)
    cdef const float *cos_t = L.rope_cos + <size_t>pos * (hd // 2)
    cdef const float *sin_t = L.rope_sin + <size_t>pos * (hd // 2)
    cb_rope(q, h.n_heads, hd, cos_t, sin_t)
    cb_rope(k, L.n_kv_heads, hd, cos_t, sin_t)


cdef inline void kv_store(Layer *L, const float *k, const float *v, int pos) noexcept nogil:
    """Position pos's keys and values [n_kv_heads * head_dim] into row pos % kv_ring of each KV head."""
    cdef int j, hd = L.head_dim
    cdef size_t row
    for j in range(L.n_kv_heads):
        row = (<size_t>j * L.kv_ring + pos % L.kv_ring) * hd
        memcpy(L.k_cache + row, k + <size_t>j * hd, sizeof(float) * hd)
        memcpy(L.v_cache + row, v + <size_t>j * hd, sizeof(float) * hd)


cdef void attention(const Hyper *h, Layer *L, Scratch *s, int n, int pos0) noexcept nogil:
    """s.xb2 = self-attention of s.xb [n, d] at positions pos0..pos0+n-1 (causal, in order).
    The tokens' keys and values go to cache rows (pos0 + t) % kv_ring before any query reads them:
    a ring of window + chunk rows keeps every key a query of the chunk can see."""
    cdef int d = h.d_model, q_dim = h.n_heads * L.head_dim, kv_dim = L.n_kv_heads * L.head_dim, t
    cdef cb_matjob jobs[3]
    job(&jobs[0], s.q, q_dim, &L.wq, s.xb, d, s.acts, n)
    job(&jobs[1], s.k, kv_dim, &L.wk, s.xb, d, s.acts, n)
    job(&jobs[2], s.v, kv_dim, &L.wv, s.xb, d, s.acts, n)
    cb_matmul_jobs(jobs, 3 if L.wv.data != NULL else 2, h.n_threads)
    for t in range(n):
        qkv_finish(h, L, s.q + <size_t>t * q_dim, s.k + <size_t>t * kv_dim, s.v + <size_t>t * kv_dim, pos0 + t)
        kv_store(L, s.k + <size_t>t * kv_dim, s.v + <size_t>t * kv_dim, pos0 + t)
    cb_attention(s.att, q_dim, s.q, q_dim, L.k_cache, L.v_cache, s.scores, h.n_heads, L.n_kv_heads,
                 L.head_dim, h.n_ctx, n, pos0, L.sliding_window, L.kv_ring, L.attn_scale, h.n_threads)
    matmul(s.xb2, d, &L.wo, s.att, q_dim, s.acts, n, h.n_threads)
    if L.bo != NULL:
        for t in range(n):
            cb_add(s.xb2 + <size_t>t * d, L.bo, d)


cdef inline void will_need(const Range *r, Scratch *s) noexcept nogil:
    s.prefetch_stats[PF_CALLS] += 1
    s.prefetch_stats[PF_BYTES] += <int64_t>r.length
    if cb_will_need(r.start, r.length, s.prefetch_chunk) != 0:
        s.prefetch_stats[PF_FAILURES] += 1


cdef void predict_next(const Hyper *h, Layer *L, Scratch *s, const int *chosen, int layer,
                       const float *router_in) noexcept nogil:
    """PREFETCH_PREDICT, one token: score the prediction made for this layer, and predict the next
    MoE layer's experts from this router input (their pages advised now)."""
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
        if cb_route(s.router2, h.n_experts, h.top_k, h.norm_topk_prob, h.use_lut,
                    s.predicted + (layer + 1) * h.top_k, s.pred_w) == 0:
            for j in range(h.top_k):
                will_need(&N.expert_pages[s.predicted[(layer + 1) * h.top_k + j]], s)


cdef inline int route(const Hyper *h, const Layer *L, float *logits, int *chosen, float *weights) noexcept nogil:
    """Router logits [n_experts] -> top-k experts and their weights (times the per-expert scales)."""
    cdef int j
    if cb_route(logits, h.n_experts, h.top_k, h.norm_topk_prob, h.use_lut, chosen, weights) != 0:
        return -1
    if L.expert_scale != NULL:
        for j in range(h.top_k):
            weights[j] *= L.expert_scale[chosen[j]]
    return 0


cdef inline float shared_gate(const Layer *L, const float *x, int d) noexcept nogil:
    """sigmoid(shared_gate . x): the weight of the shared expert (Qwen2-MoE)."""
    cdef float g = 0
    cdef int j
    for j in range(d):
        g += L.shared_gate[j] * x[j]
    return 1.0 / (1.0 + expf(-g))


cdef void wave_finish(const Hyper *h, Layer *L, Scratch *s, const Slot *slots, int count, int n,
                      float *out) noexcept nogil:
    """Run a wave and add each row's output, times its weight, into out [n, d] (the wave's slots
    in ascending expert index, the shared expert last: each token's summation order)."""
    cdef int i, r, d = h.d_model
    ffn_wave(h, s, slots, count)
    for i in range(count):
        for r in range(slots[i].row0, slots[i].row0 + slots[i].m):
            cb_axpy(out + <size_t>s.rows[r] * d, s.row_w[r], s.y + <size_t>r * d, d)
        if h.release_in_prefill and n > 1 and slots[i].f != &L.shared:
            cb_release_pages(L.expert_pages[slots[i].f - L.experts].start,
                             L.expert_pages[slots[i].f - L.experts].length)


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
        if route(h, L, s.router + <size_t>t * E, s.tok_chosen + t * k, s.tok_w + t * k) != 0:
            s.bad_layer = layer
            return STATUS_BAD_ROUTER
    memcpy(s.chosen + layer * k, s.tok_chosen + (n - 1) * k, sizeof(int) * k)     # last token, for --verbose
    memcpy(s.chosen_w + layer * k, s.tok_w + (n - 1) * k, sizeof(float) * k)
    if h.prefetch != PREFETCH_NONE and n == 1:                # advise the OS of the chosen experts
        for j in range(k):
            will_need(&L.expert_pages[s.tok_chosen[j]], s)
        if h.prefetch == PREFETCH_PREDICT:
            predict_next(h, L, s, s.tok_chosen, layer, router_in)
    elif h.prefetch != PREFETCH_NONE:                         # ... of every expert some token chose
        for e in range(E):
            for t in range(n * k):
                if s.tok_chosen[t] == e:
                    will_need(&L.expert_pages[e], s)
                    break
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
        if count == MAX_SLOTS or row + m > s.wave_rows:   # the wave is full: run it
            wave_finish(h, L, s, slots, count, n, out)
            count = row = 0
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
        cb_rmsnorm(s.xb2 + o, s.xb2 + o, L.post_mlp_norm, d, h.rms_eps)
        cb_rmsnorm(s.rx + o, s.x + o, L.router_scale, d, h.rms_eps)
        cb_scale(s.rx + o, h.router_root, d)
        cb_rmsnorm(s.xe + o, s.x + o, L.pre_moe_norm, d, h.rms_eps)
    status = moe(h, L, s, n, layer, s.rx, s.xe, s.xm)
    if status != STATUS_OK:
        return status
    for t in range(n):
        o = <size_t>t * d
        cb_rmsnorm(s.xm + o, s.xm + o, L.post_moe_norm, d, h.rms_eps)
        cb_add(s.xb2 + o, s.xm + o, d)
    return STATUS_OK


cdef inline void rmsnorm_rows(float *out, const float *x, const float *weight, int n, const Hyper *h) noexcept nogil:
    """out[t] = rmsnorm(x[t]) * weight for the n rows [n, d_model]."""
    cdef int t
    cdef size_t o
    for t in range(n):
        o = <size_t>t * h.d_model
        cb_rmsnorm(out + o, x + o, weight, h.d_model, h.rms_eps)


cdef inline int logits_status(const Hyper *h, float *logits, int n) noexcept nogil:
    """Soft-cap the logits [n] where configured; STATUS_BAD_LOGITS if any is not finite."""
    if h.softcap > 0:
        cb_softcap(logits, h.softcap, n)
    return STATUS_OK if cb_all_finite(logits, n) else STATUS_BAD_LOGITS


cdef enum:
    WANT_NONE = 0             # no logits (an inner chunk of a long prompt)
    WANT_LAST = 1             # the last token's logits [vocab]
    WANT_ALL = 2              # every token's logits [n, vocab]

PREFILL_CHUNK = 128        # prompt tokens per chunk: bounds the scratch (about 40 KB per
                           # token for a 1024-wide model with 3584-wide experts)


cdef int forward(const Hyper *h, Layer *layers, const Mat *embedding, const float *final_norm,
                 const Mat *lm_head, Scratch *s, const int *tokens, int n, int pos0,
                 float *logits, int want) noexcept nogil:
    """The model, layer by layer, over n <= s.cap tokens at positions pos0.. (decode: n = 1):

        embed -> for each layer: attn_norm, attention, residual, ffn_norm, MoE or dense FFN, residual
              -> final_norm -> lm_head (want: WANT_ALL, WANT_LAST or WANT_NONE)
    """
    cdef int d = h.d_model, l, t, status
    cdef Layer *L
    for t in range(n):
        cb_dequant_row(s.x + <size_t>t * d, embedding.data, embedding.dtype, embedding.layout, tokens[t],
                       embedding.rows, d)
        if h.embed_scale != 1.0:
            cb_scale(s.x + <size_t>t * d, h.embed_scale, d)
    for l in range(h.n_layers):
        L = &layers[l]
        rmsnorm_rows(s.xb, s.x, L.attn_norm, n, h)                 # attention block
        attention(h, L, s, n, pos0)
        if L.post_attn_norm != NULL:
            rmsnorm_rows(s.xb2, s.xb2, L.post_attn_norm, n, h)
        cb_add(s.x, s.xb2, n * d)
        rmsnorm_rows(s.xb, s.x, L.ffn_norm, n, h)                  # feed-forward block
        status = feed_forward(h, L, s, n, l)
        if status != STATUS_OK:
            return status
        if L.post_ffn_norm != NULL:
            rmsnorm_rows(s.xb2, s.xb2, L.post_ffn_norm, n, h)
        cb_add(s.x, s.xb2, n * d)
        if L.layer_scalar != 1.0:
            cb_scale(s.x, L.layer_scalar, n * d)
    if want == WANT_NONE:
        return STATUS_OK if cb_all_finite(s.x, n * d) else STATUS_BAD_HIDDEN
    if want == WANT_ALL:                                            # head
        rmsnorm_rows(s.x, s.x, final_norm, n, h)
        matmul(logits, h.vocab, lm_head, s.x, d, s.acts, n, h.n_threads)
        return logits_status(h, logits, n * h.vocab)
    rmsnorm_rows(s.x + <size_t>(n - 1) * d, s.x + <size_t>(n - 1) * d, final_norm, 1, h)
    matmul(logits, h.vocab, lm_head, s.x + <size_t>(n - 1) * d, d, s.acts, 1, h.n_threads)
    return logits_status(h, logits, h.vocab)


# ---- the Python-facing engine ---------------------------------------------------------------

DTYPE_CODES = {"f32": CB_F32, "f16": CB_F16, "bf16": CB_BF16, "int8": CB_INT8, "int4": CB_INT4}
LAYOUT_CODES = {"rows": CB_ROWS, "transposed": CB_TRANSPOSED, "interleaved": CB_INTERLEAVED}


cdef class Engine:
    """Owns the per-layer pointer table, the KV cache and the scratch arena of one model.

    `tensors` maps tensor names of the model directory (see modeldir.py) to
    (address, dtype name, shape) of weights that stay mapped for the Engine's lifetime: the
    caller (model.Model) owns the mappings and keeps them alive.
    """
    cdef Hyper h
    cdef Layer *layers          # [n_layers]
    cdef FFN *experts           # [n_layers * n_experts]
    cdef Mat embedding          # [vocab, d_model]
    cdef Mat lm_head            # [vocab, d_model] (the embedding when tied)
    cdef const float *final_norm  # [d_model]
    cdef Scratch s
    cdef object _keep           # numpy arrays backing the scratch arena, KV cache and tables
    cdef public object logits   # np.ndarray float32 [vocab], a view of the scratch logits
    cdef public object chosen   # np.ndarray int32 [n_layers, top_k]
    cdef public object chosen_weights  # np.ndarray float32 [n_layers, top_k]
    cdef public object expert_counts   # np.ndarray int64 [n_layers, n_experts]
    cdef public object prefetch_stats  # np.ndarray int64 [PF_N]

    def __cinit__(self):
        self.layers = NULL
        self.experts = NULL
        self.s.acts = NULL
        self.s.wave_acts = NULL

    def __init__(self, dict hp, dict tensors, list layer_flags, int n_threads):
        """hp: the config fields plus run options (model.Model builds it). layer_flags[l]: "moe",
        "sliding_window", "d_ff", "head_dim", "n_kv_heads", "kv_ring", "attn_scale" (0: 1/sqrt(head_dim))
        and "rope" = (cos, sin) float32 [n_ctx, head_dim / 2]."""
        cdef int d = hp["hidden_size"]
        cdef int n_layers = hp["num_hidden_layers"]
        cdef int n_experts = max(hp["num_experts"], 1)
        cdef int top_k = max(hp["num_experts_per_tok"], 1)
        cdef int n_ctx = hp["n_ctx"]
        self.h.d_model = d
        self.h.n_layers = n_layers
        self.h.n_heads = hp["num_attention_heads"]
        self.h.vocab = hp["vocab_size"]
        self.h.n_experts = n_experts
        self.h.top_k = top_k
        self.h.norm_topk_prob = 1 if hp["norm_topk_prob"] else 0
        self.h.use_lut = 0 if hp["exact_softmax"] else 1
        self.h.prefetch = hp.get("prefetch_mode", PREFETCH_NONE)
        self.h.release_in_prefill = 1 if hp.get("release_in_prefill") else 0
        self.h.qk_norm = hp["qk_norm_mode"]
        self.h.clip_qkv = hp["clip_qkv"] or 0.0
        self.h.v_norm = 1 if hp.get("v_norm") else 0
        self.h.act = hp.get("act_code", 0)
        self.h.embed_scale = hp.get("embedding_scale", 1.0)
        self.h.softcap = hp.get("final_logit_softcapping") or 0.0
        self.h.router_root = (<float>d) ** -0.5
        self.h.rms_eps = hp["rms_norm_eps"]
        self.h.n_ctx = n_ctx
        self.h.n_threads = max(n_threads, 1)

        cdef int q_dim = self.h.n_heads * max(f["head_dim"] for f in layer_flags)
        cdef int kv_dim = max(f["n_kv_heads"] * f["head_dim"] for f in layer_flags)
        max_ff = max([1] + [f["d_ff"] for f in layer_flags])
        max_cols = max(d, q_dim, max_ff)
        if top_k + 1 > MAX_SLOTS:                      # a decode wave: the chosen experts and the shared one
            raise ValueError(f"top-k {top_k} is more than {MAX_SLOTS - 1} experts per token")
        cap = max(1, min(hp.get("prefill_chunk") or PREFILL_CHUNK, n_ctx))
        wave = max(cap, MAX_SLOTS)
        f32 = np.float32
        blocks = max_cols // 32 + 1
        keep = {
            "x": np.zeros((cap, d), f32), "xb": np.zeros((cap, d), f32), "xb2": np.zeros((cap, d), f32),
            "q": np.zeros((cap, q_dim), f32), "att": np.zeros((cap, q_dim), f32),
            "k": np.zeros((cap, kv_dim), f32), "v": np.zeros((cap, kv_dim), f32),
            "scores": np.zeros((self.h.n_heads, n_ctx), f32),
            "rx": np.zeros((cap, d), f32), "xe": np.zeros((cap, d), f32), "xm": np.zeros((cap, d), f32),
            "router": np.zeros((cap, n_experts), f32),
            "tok_chosen": np.zeros((cap, top_k), np.int32), "tok_w": np.zeros((cap, top_k), f32),
            "g": np.zeros((wave, d), f32), "y": np.zeros((wave, d), f32),
            "hb": np.zeros((wave, max_ff), f32), "hb2": np.zeros((wave, max_ff), f32),
            "rows": np.zeros(wave, np.int32), "row_w": np.zeros(wave, f32),
            # activation quantization of the block inputs [cap] and of the wave rows [wave]
            "acts": _act_arrays(cap, max_cols), "wave_acts": _act_arrays(wave, max_cols),
            "logits": np.zeros(self.h.vocab, f32),
            "rope": [tuple(np.ascontiguousarray(a, f32) for a in f["rope"]) for f in layer_flags],
            "chosen": np.zeros((n_layers, top_k), np.int32),
            "chosen_w": np.zeros((n_layers, top_k), f32),
            "counts": np.zeros((n_layers, n_experts), np.int64),
            "predicted": np.full((n_layers, top_k), -1, np.int32),
            "prefetch_stats": np.zeros(PF_N, np.int64),
            "router2": np.zeros(n_experts, f32), "pred_w": np.zeros(top_k, f32),
            "expert_pages": np.zeros((n_layers, n_experts, 2), np.uint64),     # (start, length) per expert
            # KV cache, per layer [n_kv_heads, kv_ring, head_dim] (a KV head's positions together,
            # what the attention reads): zero pages are only touched (made resident) as positions
            # are filled. A sliding layer's ring must hold its window plus one prefill chunk.
            "k_cache": [np.zeros((f["n_kv_heads"], f["kv_ring"], f["head_dim"]), f32) for f in layer_flags],
            "v_cache": [np.zeros((f["n_kv_heads"], f["kv_ring"], f["head_dim"]), f32) for f in layer_flags],
        }
        for f in layer_flags:
            if not (f["kv_ring"] == n_ctx or (f["sliding_window"] > 0 and f["kv_ring"] >= f["sliding_window"] + cap)):
                raise ValueError(f"kv_ring {f['kv_ring']} cannot hold window {f['sliding_window']} + chunk {cap}")
        for (c, sn), f in zip(keep["rope"], layer_flags):
            assert c.shape == sn.shape == (n_ctx, f["head_dim"] // 2)
        self._keep = keep
        cdef Scratch *s = &self.s
        s.cap = cap
        s.x = _f32(keep["x"]); s.xb = _f32(keep["xb"]); s.xb2 = _f32(keep["xb2"])
        s.q = _f32(keep["q"]); s.att = _f32(keep["att"])
        s.k = _f32(keep["k"]); s.v = _f32(keep["v"])
        s.scores = _f32(keep["scores"])
        s.rx = _f32(keep["rx"]); s.xe = _f32(keep["xe"]); s.xm = _f32(keep["xm"])
        s.router = _f32(keep["router"])
        s.tok_chosen = <int *><uintptr_t>keep["tok_chosen"].ctypes.data
        s.tok_w = _f32(keep["tok_w"])
        s.wave_rows = wave
        s.max_ff = max_ff
        s.g = _f32(keep["g"]); s.y = _f32(keep["y"])
        s.hb = _f32(keep["hb"]); s.hb2 = _f32(keep["hb2"])
        s.rows = <int *><uintptr_t>keep["rows"].ctypes.data
        s.row_w = _f32(keep["row_w"])
        s.acts = _bind_acts(keep["acts"])
        s.wave_acts = _bind_acts(keep["wave_acts"])
        s.logits = _f32(keep["logits"])
        s.chosen = <int *><uintptr_t>keep["chosen"].ctypes.data
        s.chosen_w = _f32(keep["chosen_w"])
        s.counts = <int64_t *><uintptr_t>keep["counts"].ctypes.data
        s.predicted = <int *><uintptr_t>keep["predicted"].ctypes.data
        s.prefetch_stats = <int64_t *><uintptr_t>keep["prefetch_stats"].ctypes.data
        s.router2 = _f32(keep["router2"]); s.pred_w = _f32(keep["pred_w"])
        s.prefetch_chunk = hp.get("prefetch_chunk_bytes") or 0
        assert sizeof(Range) == 2 * sizeof(uint64_t)
        pages = hp.get("expert_pages") or {}
        for (pl, pe), (start, length) in pages.items():
            keep["expert_pages"][pl, pe] = (start, length)
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
        cdef int l, e
        for l in range(n_layers):
            L = &self.layers[l]
            p = f"layers.{l}."
            flags = layer_flags[l]
            L.head_dim = flags["head_dim"]
            L.n_kv_heads = flags["n_kv_heads"]
            L.attn_scale = flags["attn_scale"] or 1.0 / sqrtf(<float>L.head_dim)
            L.rope_cos = _f32(keep["rope"][l][0]); L.rope_sin = _f32(keep["rope"][l][1])
            L.attn_norm = _vec(tensors, p + "attn_norm")
            L.ffn_norm = _vec(tensors, p + "ffn_norm")
            L.post_attn_norm = _vec(tensors, p + "post_attn_norm")
            L.post_ffn_norm = _vec(tensors, p + "post_ffn_norm")
            L.layer_scalar = _vec(tensors, p + "layer_scalar")[0] if (p + "layer_scalar") in tensors else 1.0
            L.wq = _mat(tensors[p + "wq"]); L.wk = _mat(tensors[p + "wk"])
            L.wo = _mat(tensors[p + "wo"])
            if (p + "wv") in tensors:
                L.wv = _mat(tensors[p + "wv"])          # else data stays NULL: v is the k projection
            L.bq = _vec(tensors, p + "bq"); L.bk = _vec(tensors, p + "bk")
            L.bv = _vec(tensors, p + "bv"); L.bo = _vec(tensors, p + "bo")
            L.q_norm = _vec(tensors, p + "q_norm"); L.k_norm = _vec(tensors, p + "k_norm")
            L.sliding_window = flags["sliding_window"]
            L.is_moe = 1 if flags["moe"] else 0
            L.kv_ring = flags["kv_ring"]
            L.k_cache = _f32(keep["k_cache"][l])
            L.v_cache = _f32(keep["v_cache"][l])
            if (p + "mlp.gate") in tensors:
                L.dense = _ffn(tensors, p + "mlp.")
            if L.is_moe:
                L.router = _mat(tensors[p + "router"])
                if L.router.dtype != CB_F32:
                    raise ValueError(f"tensor {p}router must be f32")
                L.experts = self.experts + l * n_experts
                L.expert_pages = <Range *><uintptr_t>(keep["expert_pages"][l].ctypes.data)
                for e in range(hp["num_experts"]):
                    L.experts[e] = _ffn(tensors, f"{p}experts.{e}.")
                L.has_shared = 1 if (p + "shared.gate") in tensors else 0
                if L.has_shared:
                    L.shared = _ffn(tensors, p + "shared.")
                    L.shared_gate = _vec(tensors, p + "shared_gate")
                L.expert_scale = _vec(tensors, p + "expert_scale")
                L.parallel = 1 if (p + "router_scale") in tensors else 0
                if L.parallel:
                    L.router_scale = _vec(tensors, p + "router_scale")
                    L.post_mlp_norm = _vec(tensors, p + "post_mlp_norm")
                    L.pre_moe_norm = _vec(tensors, p + "pre_moe_norm")
                    L.post_moe_norm = _vec(tensors, p + "post_moe_norm")
                    if L.dense.gate.data == NULL or L.post_mlp_norm == NULL or L.pre_moe_norm == NULL \
                            or L.post_moe_norm == NULL:
                        raise ValueError(f"layer {l}: the parallel MoE block needs mlp.*, post_mlp_norm, "
                                         f"pre_moe_norm and post_moe_norm")
            elif L.dense.gate.data == NULL:
                raise ValueError(f"layer {l}: dense layer without mlp.gate")

    def __dealloc__(self):
        free(self.layers)
        free(self.experts)
        free(self.s.acts)
        free(self.s.wave_acts)

    def reset(self):
        """Forget the context (the KV cache is overwritten position by position, so nothing to clear)."""
        self.expert_counts[...] = 0
        self._keep["predicted"][...] = -1

    def run(self, const int[::1] tokens, int pos0, float[:, ::1] logits_out, bint all_logits):
        """Push tokens[0..T) through the model at positions pos0.., in chunks of at most the
        prefill chunk (every weight read once per chunk; decode is a chunk of one token).

        all_logits: logits_out is [T, vocab] and receives every position's logits;
        otherwise logits_out is [1, vocab] and receives only the last one (the lm_head is skipped
        for the others). Returns (status, token index of a failure, layer of a bad router).
        """
        cdef int t = 0, n, status = STATUS_OK
        cdef int T = tokens.shape[0]
        cdef int want
        if pos0 < 0 or pos0 + T > self.h.n_ctx:
            raise ValueError(f"positions {pos0}..{pos0 + T - 1} exceed the context of {self.h.n_ctx}")
        if logits_out.shape[1] != self.h.vocab or logits_out.shape[0] < (T if all_logits else 1):
            raise ValueError("logits_out has the wrong shape")
        for t in range(T):
            if tokens[t] < 0 or tokens[t] >= self.h.vocab:
                raise ValueError(f"token id {tokens[t]} is outside the vocabulary [0, {self.h.vocab})")
        t = 0
        with nogil:
            while t < T:
                n = T - t if T - t < self.s.cap else self.s.cap
                want = WANT_ALL if all_logits else (WANT_LAST if t + n == T else WANT_NONE)
                status = forward(&self.h, self.layers, &self.embedding, self.final_norm, &self.lm_head,
                                 &self.s, &tokens[t], n, pos0 + t, &logits_out[t if all_logits else 0, 0], want)
                if status != STATUS_OK:
                    break
                t += n
        if status == STATUS_OK and T:
            memcpy(self.s.logits, &logits_out[T - 1 if all_logits else 0, 0], sizeof(float) * self.h.vocab)
        return status, min(t, T - 1), self.s.bad_layer

    @property
    def n_ctx(self):
        return self.h.n_ctx

    def kv_cache_ranges(self):
        """[(address, nbytes)] of every layer's key and value cache."""
        return [(a.ctypes.data, a.nbytes) for a in self._keep["k_cache"] + self._keep["v_cache"]]

    @property
    def kv_cache_bytes(self):
        """Bytes of the KV cache arrays as allocated (keys and values of every layer)."""
        return sum(a.nbytes for a in self._keep["k_cache"] + self._keep["v_cache"])


cdef inline float *_f32(a):
    return <float *><uintptr_t>a.ctypes.data


def _act_arrays(int rows, int cols):
    """The numpy arrays behind `rows` activation quantization scratches (cb_act_q8) of up to `cols`
    values: q int8 [rows, cols], d float32 and s int32 [rows, cols / 32 + 1], xp float32 [rows, cols]
    (the AVX-512 bf16 tile's permuted input)."""
    blocks = cols // 32 + 1
    return [np.zeros((rows, cols), np.int8), np.zeros((rows, blocks), np.float32),
            np.zeros((rows, blocks), np.int32), np.zeros((rows, cols), np.float32)]


cdef cb_act_q8 *_bind_acts(list arrays) except NULL:
    """A calloc'd cb_act_q8 [rows] (free() it) pointing into the arrays of _act_arrays, which must
    outlive it."""
    q, d, s, xp = arrays
    cdef int t, rows = q.shape[0]
    cdef cb_act_q8 *acts = <cb_act_q8 *>calloc(max(rows, 1), sizeof(cb_act_q8))
    if acts == NULL:
        raise MemoryError("cannot allocate the activation scratch")
    for t in range(rows):
        acts[t].q = <signed char *><uintptr_t>q[t].ctypes.data
        acts[t].d = <float *><uintptr_t>d[t].ctypes.data
        acts[t].s = <int32_t *><uintptr_t>s[t].ctypes.data
        acts[t].n = 0
        acts[t].xp = <float *><uintptr_t>xp[t].ctypes.data
    return acts


cdef Mat _mat(tuple t):
    """(address, dtype name, shape[, layout name]) -> Mat; shape is the logical [rows, cols]."""
    cdef Mat m
    addr, dtype, shape = t[:3]
    m.data = <const void *><uintptr_t>addr
    m.dtype = DTYPE_CODES[dtype]
    m.layout = LAYOUT_CODES[t[3] if len(t) > 3 else "rows"]
    if m.layout == CB_TRANSPOSED and (m.dtype == CB_INT8 or m.dtype == CB_INT4) and shape[0] % 8:
        raise ValueError(f"a transposed {dtype} matrix needs a multiple of 8 rows, got {shape}")   # whole groups
    if m.layout == CB_INTERLEAVED and (not (m.dtype == CB_INT8 or m.dtype == CB_INT4) or shape[0] % 8):
        raise ValueError(f"the interleaved layout needs int8/int4 and a multiple of 8 rows, got {dtype} {shape}")
    m.rows = shape[0]
    m.cols = shape[1]
    return m


cdef const float *_vec(dict tensors, str name):
    """A float32 vector by name, or NULL when the model has no such tensor."""
    t = tensors.get(name)
    if t is None:
        return NULL
    if t[1] != "f32":
        raise ValueError(f"tensor {name} must be f32, got {t[1]}")
    return <const float *><uintptr_t>t[0]


cdef FFN _ffn(dict tensors, str prefix):
    cdef FFN f
    f.gate = _mat(tensors[prefix + "gate"])
    f.up = _mat(tensors[prefix + "up"])
    f.down = _mat(tensors[prefix + "down"])
    return f


# ---- thin wrappers over the kernels, for the tests ------------------------------------------

def kernel_f16_to_f32(uint16_t h):
    return cb_f16_to_f32_exact(h)


def _stored_rows(w, int cols, str dtype, str layout):
    """The number of outputs of a stored matrix w (see kernel_matvec); ValueError if w cannot hold
    a matrix of `cols` inputs in that format and layout."""
    if dtype not in DTYPE_CODES:
        raise ValueError(f"unknown dtype {dtype!r}")
    if layout not in LAYOUT_CODES:
        raise ValueError(f"unknown layout {layout!r}")
    cdef int code = DTYPE_CODES[dtype]
    block = code == CB_INT8 or code == CB_INT4
    if block and cols % 32:
        raise ValueError(f"{dtype} needs a multiple of 32 columns, got {cols}")
    if layout == "rows":
        rows = w.shape[0]
    elif layout == "interleaved":    # [rows / 8, cols / 32 * group bytes]
        if not block:
            raise ValueError(f"the interleaved layout is for int8/int4, not {dtype}")
        rows = w.shape[0] * 8 if w.ndim == 2 else 0
        if w.ndim != 2 or w.shape[1] != cols // 32 * 8 * cb_row_stride(code, 32):
            raise ValueError(f"interleaved {dtype} needs [rows / 8, cols / 32 * group bytes], got {w.shape}")
    elif block:                      # [cols / 32, rows / 8 * group bytes]
        rows = w.shape[1] // (8 * cb_row_stride(code, 32)) * 8 if w.ndim == 2 else 0
        if w.ndim != 2 or w.shape[0] != cols // 32 or w.shape[1] != rows // 8 * 8 * cb_row_stride(code, 32):
            raise ValueError(f"transposed {dtype} needs [cols / 32, rows / 8 * group bytes], got {w.shape}")
    else:                            # [cols, rows]
        rows = w.shape[1] if w.ndim == 2 else 0
    if w.nbytes != rows * cb_row_stride(code, cols):
        raise ValueError(f"matrix of {w.nbytes} bytes does not hold {rows} rows of {cols} {dtype} values")
    return rows


cdef cb_act_q8 *_test_acts(int n, int cols, list keep) except NULL:
    """Activation quantization scratch for n tokens of `cols` values (free() it); the numpy
    arrays behind it go into `keep`, which must outlive its use."""
    arrays = _act_arrays(n, cols)
    keep.extend(arrays)
    return _bind_acts(arrays)


def kernel_matvec(w, const float[::1] x, str dtype, int n_threads=1, str layout="rows"):
    """W @ x through the kernel table of the current tier.

    w: the stored matrix, C-contiguous. rows layout: [rows, cols] float32 (f32), uint16
    (f16/bf16), or [rows, cols // 32 * block bytes] uint8 for int8/int4; transposed layout: the
    float formats [cols, rows], int8/int4 [cols // 32, rows // 8 * group bytes] uint8 (see
    colibri.quant.transpose)."""
    return kernel_matmul(w, np.asarray(x).reshape(1, -1), dtype, n_threads, layout)[0]   # cb_matvec is n = 1


def bench_matmul(w, const float[:, ::1] x, str dtype, int n_threads, int reps, str layout="rows"):
    """Seconds for `reps` products out[n, rows] = x[n, cols] @ W[rows, cols]^T through the engine's
    cb_matmul (n = 1: the decode matvec; n > 1: a prefill tile pass), with no Python between
    repetitions: what tools/bench_kernels.py times. W is stored as in kernel_matvec."""
    import time
    w = np.ascontiguousarray(w)
    cdef int n = x.shape[0], cols = x.shape[1], r, t
    cdef int rows = _stored_rows(w, cols, dtype, layout)
    cdef int code = DTYPE_CODES[dtype]
    cdef int lay = LAYOUT_CODES[layout]
    if n < 1 or reps < 1:
        raise ValueError("bench_matmul: needs n >= 1 tokens and reps >= 1")
    out = np.zeros((n, rows), np.float32)
    keep = []
    cdef cb_act_q8 *acts = _test_acts(n, cols, keep)
    cdef float[:, ::1] o = out
    cdef const void *wp = <const void *><uintptr_t>w.ctypes.data
    t0 = time.perf_counter()
    with nogil:
        for r in range(reps):
            cb_matmul(&o[0, 0], rows, wp, code, lay, &x[0, 0], cols, acts, n, rows, cols, n_threads)
    seconds = time.perf_counter() - t0
    free(acts)
    return seconds


def bench_attention(const float[:, ::1] q, k_layers, v_layers, int pos, int n_threads, int reps):
    """Seconds for `reps` decode steps' attention: one query q [n_heads, head_dim] against every
    layer's cache in k_layers / v_layers float32 [n_layers, n_kv_heads, ring, head_dim] (the
    engine's order), positions 0..pos, through cb_attention with no Python between layers or
    repetitions: what tools/bench_kernels.py --attention times."""
    import time
    ka = np.ascontiguousarray(k_layers, np.float32)
    va = np.ascontiguousarray(v_layers, np.float32)
    if ka.ndim != 4 or va.shape != ka.shape or ka.shape[3] != q.shape[1] or ka.shape[1] < 1 \
            or q.shape[0] % ka.shape[1] or not 0 <= pos < ka.shape[2] or reps < 1:
        raise ValueError("bench_attention: q [n_heads, head_dim], caches [n_layers, n_kv_heads, ring, head_dim], "
                         "0 <= pos < ring, reps >= 1")
    cdef int n_layers = ka.shape[0], n_kv = ka.shape[1], ring = ka.shape[2], head_dim = ka.shape[3]
    cdef int n_heads = q.shape[0], r, layer
    out = np.zeros((n_heads, head_dim), np.float32)
    scores = np.zeros((n_heads, pos + 1), np.float32)
    cdef float[:, ::1] o = out, sc = scores
    cdef const float[:, :, :, ::1] kv = ka, vv = va
    cdef float scale = 1.0 / sqrtf(head_dim)
    t0 = time.perf_counter()
    with nogil:
        for r in range(reps):
            for layer in range(n_layers):
                cb_attention(&o[0, 0], 0, &q[0, 0], 0, &kv[layer, 0, 0, 0], &vv[layer, 0, 0, 0], &sc[0, 0], n_heads,
                             n_kv, head_dim, pos + 1, 1, pos, 0, ring, scale, n_threads)
    return time.perf_counter() - t0


def kernel_matmul(w, const float[:, ::1] x, str dtype, int n_threads=1, str layout="rows"):
    """out [n, rows] = x [n, cols] @ W^T through cb_matmul (the prefill product), W stored as in
    kernel_matvec."""
    w = np.ascontiguousarray(w)
    cdef int n = x.shape[0], cols = x.shape[1], t
    cdef int rows = _stored_rows(w, cols, dtype, layout)
    cdef int code = DTYPE_CODES[dtype]
    cdef int lay = LAYOUT_CODES[layout]
    out = np.zeros((n, rows), np.float32)
    if n == 0 or rows == 0 or cols == 0:
        return out
    keep = []
    cdef cb_act_q8 *acts = _test_acts(n, cols, keep)
    cdef float[:, ::1] o = out
    cdef const void *wp = <const void *><uintptr_t>w.ctypes.data
    with nogil:
        cb_matmul(&o[0, 0], rows, wp, code, lay, &x[0, 0], cols, acts, n, rows, cols, n_threads)
    free(acts)
    return out


GLU_ACT_CODES = {"silu": 0, "gelu_pytorch_tanh": 1}    # cb_glu's act (CB_ACT_SILU, CB_ACT_GELU_TANH)


def kernel_glu(const float[::1] gate, const float[::1] up, str act):
    """act(gate) * up through the current tier's cb_glu (act: "silu" or "gelu_pytorch_tanh")."""
    if gate.shape[0] != up.shape[0]:
        raise ValueError("kernel_glu: gate and up must have the same length")
    if act not in GLU_ACT_CODES:
        raise ValueError(f"kernel_glu: act must be one of {', '.join(GLU_ACT_CODES)}, not {act!r}")
    out = np.array(gate, np.float32)
    cdef float[::1] o = out
    cdef int n = gate.shape[0], code = GLU_ACT_CODES[act]
    if n:
        cb_glu(&o[0], &up[0], n, code)
    return out


def kernel_dpbusd_emulated(const int32_t[::1] acc, const uint8_t[::1] u, const int8_t[::1] s):
    """acc [8] + the VNNI step (vpdpbusd) of u [32] and s [32] as emulated in AVX2 for the
    "vnni-emulated" int step. ValueError on a tier without AVX2."""
    if acc.shape[0] != 8 or u.shape[0] != 32 or s.shape[0] != 32:
        raise ValueError("kernel_dpbusd_emulated: acc [8] int32, u [32] uint8, s [32] int8")
    out = np.empty(8, np.int32)
    cdef int32_t[::1] o = out
    if cb_dpbusd_emulated(&o[0], &acc[0], &u[0], &s[0]) != 0:
        raise ValueError(f"kernel_dpbusd_emulated: tier {isa()} has no AVX2")
    return out


def kernel_glu_product(gate, up, const float[:, ::1] x, str dtype, str layout, str act, int n_threads,
                       bint adjacent=True):
    """act(x @ gate^T) * (x @ up^T) [n, rows] through one cb_matmul_jobs batch (each thread applies
    the activation to the gate rows it computed), gate and up stored as in kernel_matvec.
    adjacent: the batch is [up, gate]; otherwise [up, another product, gate]."""
    gate = np.ascontiguousarray(gate)
    up = np.ascontiguousarray(up)
    if act not in GLU_ACT_CODES:
        raise ValueError(f"kernel_glu_product: act must be one of {', '.join(GLU_ACT_CODES)}, not {act!r}")
    cdef int n = x.shape[0], cols = x.shape[1]
    cdef int rows = _stored_rows(gate, cols, dtype, layout)
    if _stored_rows(up, cols, dtype, layout) != rows or gate.shape != up.shape:
        raise ValueError("kernel_glu_product: gate and up must have the same shape")
    out = np.zeros((n, rows), np.float32)
    up_out = np.zeros((n, rows), np.float32)
    other = np.zeros((n, rows), np.float32)
    if n == 0 or rows == 0:
        return out
    keep = []
    cdef cb_act_q8 *acts = _test_acts(n, cols, keep)
    cdef cb_matjob jobs[3]
    cdef float[:, ::1] o = out, u = up_out, ot = other
    cdef int k, count = 2 if adjacent else 3
    cdef const void *ptrs[3]
    cdef float *outs[3]
    ptrs[0] = <const void *><uintptr_t>up.ctypes.data
    ptrs[1] = ptrs[0] if not adjacent else <const void *><uintptr_t>gate.ctypes.data
    ptrs[2] = <const void *><uintptr_t>gate.ctypes.data
    outs[0] = &u[0, 0]
    outs[1] = &ot[0, 0] if not adjacent else &o[0, 0]
    outs[2] = &o[0, 0]
    for k in range(count):
        jobs[k].n = n
        jobs[k].out = outs[k]
        jobs[k].ldo = rows
        jobs[k].w = ptrs[k]
        jobs[k].dtype = DTYPE_CODES[dtype]
        jobs[k].layout = LAYOUT_CODES[layout]
        jobs[k].rows = rows
        jobs[k].cols = cols
        jobs[k].x = &x[0, 0]
        jobs[k].ldx = cols
        jobs[k].acts = acts
        jobs[k].glu_up = NULL
        jobs[k].glu_act = 0
    jobs[count - 1].glu_up = &u[0, 0]
    jobs[count - 1].glu_act = GLU_ACT_CODES[act]
    with nogil:
        cb_matmul_jobs(jobs, count, n_threads)
    free(acts)
    return out


def kernel_attention(q, k_cache, v_cache, int n_kv_heads, int start, int pos, int n_threads=1):
    """One query's causal attention through the tier's kernel (cb_attention): q float32 [n_heads,
    head_dim] (roped), k_cache / v_cache float32 [ring, n_kv_heads * head_dim] holding position p
    in row p % ring — or already in the engine's order [n_kv_heads, ring, head_dim] (C-contiguous
    float32, used as they are: tools/bench_kernels.py); attends positions start..pos with scale
    1/sqrt(head_dim). -> [n_heads, head_dim]."""
    qa = np.ascontiguousarray(q, np.float32)
    cdef int n_heads = qa.shape[0], head_dim = qa.shape[1], ring
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError("kernel_attention: n_heads must be a multiple of n_kv_heads")
    if np.ndim(k_cache) == 3:
        ring = np.shape(k_cache)[1]
        if np.shape(k_cache) != (n_kv_heads, ring, head_dim) or np.shape(v_cache) != np.shape(k_cache):
            raise ValueError("kernel_attention: engine-order caches are [n_kv_heads, ring, head_dim]")
        ka = np.ascontiguousarray(k_cache, np.float32)
        va = np.ascontiguousarray(v_cache, np.float32)
    else:
        ring = np.shape(k_cache)[0]
        if np.shape(k_cache) != (ring, n_kv_heads * head_dim) or np.shape(v_cache) != np.shape(k_cache):
            raise ValueError("kernel_attention: q [n_heads, head_dim], caches [ring, n_kv_heads * head_dim]")
        # the engine's cache order: [n_kv_heads, ring, head_dim]
        ka = np.ascontiguousarray(np.asarray(k_cache, np.float32).reshape(ring, n_kv_heads, head_dim).transpose(1, 0, 2))
        va = np.ascontiguousarray(np.asarray(v_cache, np.float32).reshape(ring, n_kv_heads, head_dim).transpose(1, 0, 2))
    if not 0 <= start <= pos or pos - start + 1 > ring:
        raise ValueError("kernel_attention: positions start..pos must fit the ring")
    n_ctx = pos - start + 1
    out = np.zeros((n_heads, head_dim), np.float32)
    scores = np.zeros((n_heads, n_ctx), np.float32)
    cdef float[:, ::1] o = out, sc = scores
    cdef const float[:, ::1] qv = qa
    cdef const float[:, :, ::1] kv = ka, vv = va
    with nogil:
        cb_attention(&o[0, 0], 0, &qv[0, 0], 0, &kv[0, 0, 0], &vv[0, 0, 0], &sc[0, 0], n_heads, n_kv_heads, head_dim,
                     n_ctx, 1, pos, pos - start + 1 if start > 0 else 0, ring, 1.0 / sqrtf(head_dim), n_threads)
    return out


def kernel_attention_softmax(x):
    """The current tier's attention softmax of float32 x [n] (a copy); None when x holds NaN/inf
    (cb_softmax's contract: nothing normalised)."""
    out = np.array(x, np.float32).reshape(-1)
    cdef float[::1] o = out
    if out.shape[0] == 0:
        return out
    return out if cb_attention_softmax(&o[0], out.shape[0]) == 0 else None


def kernel_quantize_act(const float[::1] x):
    """(q int8 [n], d float32 [n / 32], s int32 [n / 32]): the current tier's per-block activation
    quantization (s: each block's sum of q)."""
    cdef int n = x.shape[0]
    if n % 32:
        raise ValueError(f"activations are quantized in blocks of 32, got {n} values")
    q = np.zeros(max(n, 32), np.int8)
    d = np.zeros(max(n // 32, 1), np.float32)
    s = np.zeros(max(n // 32, 1), np.int32)
    cdef cb_act_q8 act
    act.q = <signed char *><uintptr_t>q.ctypes.data
    act.d = <float *><uintptr_t>d.ctypes.data
    act.s = <int32_t *><uintptr_t>s.ctypes.data
    act.xp = NULL
    if n:
        cb_quantize_act(&act, &x[0], n)
    return q[:n], d[:n // 32], s[:n // 32]


def kernel_dequant_row(w, int row, int cols, str dtype, str layout="rows"):
    """Row `row` of a stored matrix (as in kernel_matvec) as float32 [cols] (the embedding lookup)."""
    w = np.ascontiguousarray(w)
    cdef int rows = _stored_rows(w, cols, dtype, layout)
    if not 0 <= row < rows:
        raise ValueError(f"row {row} is outside 0..{rows - 1}")
    out = np.zeros(cols, np.float32)
    cdef float[::1] o = out
    cb_dequant_row(&o[0], <const void *><uintptr_t>w.ctypes.data, DTYPE_CODES[dtype], LAYOUT_CODES[layout], row,
                   rows, cols)
    return out


def kernel_route(const float[::1] logits, int k, bint norm_topk_prob, bint use_lut=False):
    """(chosen expert indices int32 [k], weights float32 [k]) or ValueError for non-finite logits."""
    buf = np.array(logits, np.float32)
    chosen = np.zeros(k, np.int32)
    weights = np.zeros(k, np.float32)
    cdef float[::1] b = buf
    cdef int[::1] c = chosen
    cdef float[::1] w = weights
    if k < 1 or k > b.shape[0] or k > CB_MAX_TOP_K:
        raise ValueError(f"k={k} must be in 1..{min(b.shape[0], CB_MAX_TOP_K)}")
    if cb_route(&b[0], b.shape[0], k, norm_topk_prob, use_lut, &c[0], &w[0]) != 0:
        raise ValueError("router logits are not finite")
    return chosen, weights


def bench_route(const float[:, ::1] logits, int k, bint norm_topk_prob, bint use_lut):
    """Route every row of logits [n, n_experts] (the routing micro-benchmark); returns seconds."""
    import time
    cdef int n = logits.shape[0], e = logits.shape[1], i
    chosen = np.zeros(k, np.int32)
    weights = np.zeros(k, np.float32)
    cdef int[::1] c = chosen
    cdef float[::1] w = weights
    t0 = time.perf_counter()
    with nogil:
        for i in range(n):
            cb_route(&logits[i, 0], e, k, norm_topk_prob, use_lut, &c[0], &w[0])
    return time.perf_counter() - t0


def kernel_rmsnorm(const float[::1] x, weight, float eps):
    out = np.zeros(x.shape[0], np.float32)
    cdef float[::1] o = out
    cdef const float[::1] wv
    if weight is None:
        cb_rmsnorm(&o[0], &x[0], NULL, x.shape[0], eps)
    else:
        wv = np.ascontiguousarray(weight, np.float32)
        cb_rmsnorm(&o[0], &x[0], &wv[0], x.shape[0], eps)
    return out


cdef extern from "quant.h":
    ctypedef struct cb_block_int8:
        pass
    ctypedef struct cb_block_int4:
        pass
    ctypedef struct cb_group_int8:
        pass
    ctypedef struct cb_group_int4:
        pass


def block_sizes():
    """sizeof of the C block structs, for the test that they agree with colibri.quant."""
    return {"int8": sizeof(cb_block_int8), "int4": sizeof(cb_block_int4)}


def group_sizes():
    """sizeof of the C group structs of the transposed layout (8 blocks each)."""
    return {"int8": sizeof(cb_group_int8), "int4": sizeof(cb_group_int4)}


cdef extern from *:
    """
    /* Streaming read of n bytes (a multiple of 64) split over threads: the machine's read
     * bandwidth, for the benchmarks' roofline. Returns a checksum so the loop is not removed. */
    static uint64_t cb_read_bytes(const void *p, size_t n, int n_threads) {
        const uint64_t *q = (const uint64_t *)p;
        long long words = (long long)(n / 8);
        uint64_t total = 0;
        #pragma omp parallel for schedule(static) num_threads(n_threads) reduction(+:total)
        for (long long i = 0; i < words; i += 8) {
            total += (q[i] ^ q[i + 1]) + (q[i + 2] ^ q[i + 3]) + (q[i + 4] ^ q[i + 5]) + (q[i + 6] ^ q[i + 7]);
        }
        return total;
    }
    """
    uint64_t cb_read_bytes(const void *p, size_t n, int n_threads) nogil


cdef extern from *:
    """
    /* The attainable float FMA rate of this machine: 10 independent chains of 8-lane FMAs per
     * thread (enough to cover the FMA latency), for the prefill GFLOP/s "next to peak". Returns the
     * number of floating-point operations done, or -1 where it cannot run (no GCC/Clang). */
    #if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    #include <immintrin.h>
    __attribute__((target("avx2,fma"))) static double cb_peak_fma_avx2(long long iters, int n_threads) {
        double total = 0.0;
        #pragma omp parallel num_threads(n_threads) reduction(+:total)
        {
            __m256 a[10];
            const __m256 m = _mm256_set1_ps(0.9999999f), c = _mm256_set1_ps(1e-7f);
            for (int k = 0; k < 10; k++) a[k] = _mm256_set1_ps(1.0f + k);
            for (long long i = 0; i < iters; i++)
                for (int k = 0; k < 10; k++) a[k] = _mm256_fmadd_ps(a[k], m, c);
            float lanes[8];
            __m256 s = a[0];
            for (int k = 1; k < 10; k++) s = _mm256_add_ps(s, a[k]);
            _mm256_storeu_ps(lanes, s);
            total += (double)(lanes[0] > 0.0f) * (double)iters * 10.0 * 8.0 * 2.0;
        }
        return total;
    }
    /* The attainable AVX2 int8 dot-product rate (no VNNI): 10 independent chains of the int8
     * kernels' step, 32 byte products through maddubs, pairs to int32 through madd, one add (an
     * 8-bit add per step varies the input, as the kernels' sign does). maddubs and madd are both
     * multiplies: where the core has one vector integer multiplier, this is the int8 ceiling.
     * Returns the operations done (2 per byte product), or -1 where it cannot run. */
    __attribute__((target("avx2,fma"))) static double cb_peak_int8_avx2(long long iters, int n_threads) {
        double total = 0.0;
        #pragma omp parallel num_threads(n_threads) reduction(+:total)
        {
            __m256i x[10], acc[10];
            const __m256i w = _mm256_set1_epi8(3), inc = _mm256_set1_epi8(1), ones = _mm256_set1_epi16(1);
            for (int k = 0; k < 10; k++) { x[k] = _mm256_set1_epi8((char)k); acc[k] = _mm256_setzero_si256(); }
            for (long long i = 0; i < iters; i++)
                for (int k = 0; k < 10; k++) {
                    x[k] = _mm256_add_epi8(x[k], inc);
                    acc[k] = _mm256_add_epi32(acc[k], _mm256_madd_epi16(_mm256_maddubs_epi16(w, x[k]), ones));
                }
            __m256i s = acc[0];
            for (int k = 1; k < 10; k++) s = _mm256_add_epi32(s, acc[k]);
            total += (double)(_mm256_extract_epi32(s, 0) != 12345) * (double)iters * 10.0 * 32.0 * 2.0;
        }
        return total;
    }
    #else
    static double cb_peak_fma_avx2(long long iters, int n_threads) { (void)iters; (void)n_threads; return -1.0; }
    static double cb_peak_int8_avx2(long long iters, int n_threads) { (void)iters; (void)n_threads; return -1.0; }
    #endif
    """
    double cb_peak_fma_avx2(long long iters, int n_threads) nogil
    double cb_peak_int8_avx2(long long iters, int n_threads) nogil


def bench_peak(str kind, int n_threads):
    """(operations done, seconds) of a peak loop on n_threads, or None without AVX2 or GCC:
    kind "fma" — AVX2 FMA chains (float operations); "int8" — the AVX2 int8 dot-product step of
    the int8 kernels without VNNI (maddubs + madd; 2 operations per byte product)."""
    import time
    if kind not in ("fma", "int8"):
        raise ValueError(f"bench_peak: kind must be 'fma' or 'int8', not {kind!r}")
    if "avx2" not in available_isas():
        return None
    cdef double ops
    cdef bint fma = kind == "fma"
    t0 = time.perf_counter()
    with nogil:
        ops = cb_peak_fma_avx2(20000000, n_threads) if fma else cb_peak_int8_avx2(10000000, n_threads)
    seconds = time.perf_counter() - t0
    return None if ops < 0 else (ops, seconds)


def bench_read(buf, int n_threads):
    """Read every byte of `buf` (C-contiguous, size a multiple of 64) once; returns a checksum."""
    cdef const unsigned char[::1] v = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    cdef size_t n = v.shape[0] // 64 * 64
    cdef uint64_t r
    with nogil:
        r = cb_read_bytes(&v[0], n, n_threads)
    return r
