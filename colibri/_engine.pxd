# The layer loop's data, as C sees it: the per-layer tables of pointers into the mapped weights,
# the hyperparameters, the scratch arena. Built once by _engine.Engine from an EngineSpec
# (colibri.spec).

from libc.stdint cimport int32_t, int64_t, uint8_t, uintptr_t
from colibri._kernels cimport cb_act_q8, cb_matjob

cdef extern from "os_hints.h" nogil:
    # advice to the OS about an expert's pages, through the functions colibri._os resolved
    # (colibri._os.engine_advice): read ahead, or drop them
    int CB_ADVICE_NONE, CB_ADVICE_MADVISE, CB_ADVICE_WIN32
    ctypedef struct cb_os_advice:
        int kind
        uintptr_t will_need
        uintptr_t release
        int will_need_arg
        int release_arg
    int cb_will_need(const cb_os_advice *a, const void *start, size_t length, size_t chunk)
    int cb_release_pages(const cb_os_advice *a, const void *start, size_t length)

cdef extern from "gram.h" nogil:
    # g [cols, cols] (upper triangle) += x^T x over n tokens; xt: float scratch [cols * n]
    void cb_gram_add(double *g, const float *x, int ldx, int n, int cols, float *xt)

cdef extern from "expert_cache.h" nogil:
    # which experts hold memory under a byte budget, and the reader threads that read and drop
    # them (csrc/expert_cache.h explains the design)
    int CB_EVICT_LRU, CB_EVICT_LFU
    int CB_CS_HITS, CB_CS_MISSES, CB_CS_PREFETCHES, CB_CS_PREFETCH_HITS, CB_CS_EVICTIONS, CB_CS_WASTED
    int CB_CS_OVER_BUDGET, CB_CS_READ_CALLS, CB_CS_READ_BYTES, CB_CS_DROPS, CB_CS_FAILURES, CB_CS_N
    ctypedef struct cb_cache_os:
        uintptr_t fadvise
        int dontneed
        int read_arg
    ctypedef struct cb_range_entry:
        pass
    ctypedef struct cb_expert_cache:
        int n
        const cb_range_entry *pages
        const int32_t *fds
        uint8_t *resident
        uint8_t *fresh
        int64_t *last_use
        float *freq
        int64_t budget
        int64_t bytes
        int64_t peak
        int policy
        int64_t *stats
        cb_os_advice advice
        cb_cache_os os
        size_t chunk
    int cb_cache_start(cb_expert_cache *c)
    void cb_cache_drain(cb_expert_cache *c)
    void cb_cache_stop(cb_expert_cache *c)
    void cb_cache_layer(cb_expert_cache *c)
    void cb_cache_use(cb_expert_cache *c, int i, int read)
    void cb_cache_prefetch(cb_expert_cache *c, int i)
    void cb_cache_done(cb_expert_cache *c, int i)
    int64_t cb_cache_expert_bytes(const cb_expert_cache *c, int i)
    int cb_cache_hold(cb_expert_cache *c, int i)


cdef struct Mat:
    const void *data      # [rows, cols] of `dtype` in `layout` (kernels_scalar.h, quant.h)
    int dtype             # CB_F32 .. CB_INT6 (_kernels.DTYPE_CODES)
    int layout            # CB_ROWS / CB_TRANSPOSED / CB_INTERLEAVED (_kernels.LAYOUT_CODES)
    int rows
    int cols
    # [cols + 1] or NULL: the sum of each input column's squares over the tokens multiplied, then
    # their count (colibri.calibrate: Model(capture_inputs=True))
    double *input_stats
    # [cols, cols] or NULL: the sums of x[c] x[c'] (c <= c', the upper triangle) over the same
    # tokens (calibrate --second-moments: Model(second_moments=))
    double *input_gram

cdef struct FFN:          # down(act(gate x) * up x), act: Hyper.act (SwiGLU, GeGLU, gpt-oss's clamped SwiGLU)
    Mat gate              # [d_ff, d_model]
    Mat up                # [d_ff, d_model]
    Mat down              # [d_model, d_ff]
    const float *gate_b   # [d_ff] or NULL: biases (gpt-oss's experts), added to each product
    const float *up_b     # [d_ff] or NULL
    const float *down_b   # [d_model] or NULL

cdef struct Layer:
    int head_dim              # this layer's attention geometry (Gemma 4: global layers differ)
    int n_kv_heads
    float attn_scale          # the factor on q.k
    int rope_dim              # the first rope_dim values of each head rotate (head_dim: all)
    const float *rope_cos     # [n_ctx, rope_dim / 2]
    const float *rope_sin     # [n_ctx, rope_dim / 2]
    const float *attn_norm    # [d_model]
    Mat wq                    # [n_heads * head_dim, d_model]
    Mat wk                    # [n_kv_heads * head_dim, d_model]
    Mat wv                    # [n_kv_heads * head_dim, d_model]; data NULL: v is the k projection
    Mat wo                    # [d_model, n_heads * head_dim]
    const float *bq           # [n_heads * head_dim] or NULL
    const float *bk           # [n_kv_heads * head_dim] or NULL
    const float *bv           # [n_kv_heads * head_dim] or NULL
    const float *bo           # [d_model] or NULL
    const float *sinks        # [n_heads] or NULL: attention sinks (gpt-oss), a logit per head, no value
    # multi-head latent attention (DeepSeek-V3; mla 0: the q/k/v projections above): head_dim is
    # rope_dim + kv_rank, the cache row [shared RoPE key, latent] of the one KV head (k_cache and
    # v_cache are the same array); per head, the query [rope_dim, nope] is turned into [rope_dim,
    # kv_rank] by wkb, and the attention's latent value into v_head values by wvb
    int mla
    int kv_rank               # kv_lora_rank
    int qk_head               # the query's per-head width: rope_dim + nope
    int v_head                # the value's per-head width (wo's input: n_heads * v_head)
    Mat wq_a                  # [q_lora_rank, d_model], data NULL: wq [n_heads * qk_head, d_model] instead
    const float *q_a_norm     # [q_lora_rank]
    Mat wq_b                  # [n_heads * qk_head, q_lora_rank], each head's rows [rope, nope]
    Mat wkv_a                 # [rope_dim + kv_rank, d_model]
    const float *kv_a_norm    # [kv_rank]
    Mat wkb                   # [n_heads * kv_rank, nope] f32/f16 rows: head h's rows h * kv_rank ..
    Mat wvb                   # [n_heads * v_head, kv_rank] f32/f16 rows: head h's rows h * v_head ..
    const float *q_norm       # [head_dim] (per head) or [n_heads * head_dim] (whole) or NULL
    const float *k_norm       # [head_dim] or [n_kv_heads * head_dim] or NULL
    const float *ffn_norm     # [d_model]
    const float *post_attn_norm   # [d_model] or NULL (Gemma's sandwich norms)
    const float *post_ffn_norm    # [d_model] or NULL
    float layer_scalar        # the residual stream is multiplied by it after the layer (1: no-op)
    int sliding_window        # 0: attend to every earlier position
    int is_moe
    Mat router                # [n_experts, d_model] f32 (MoE layers)
    const float *router_bias  # [n_experts] or NULL: the sigmoid router's choice bias
    const float *router_logit_bias  # [n_experts] or NULL: added to the router's logits (gpt-oss)
    FFN *experts              # [n_experts] (MoE layers)
    int expert0               # the index of its expert 0 in the expert cache: layer * n_experts
    int has_shared
    FFN shared                # the shared expert (Qwen2-MoE)
    const float *shared_gate  # [d_model]: sigmoid(shared_gate . x) scales the shared expert; NULL: 1
    FFN dense                 # the dense MLP (non-MoE layers, and beside the MoE when parallel)
    int parallel              # Gemma 4: dense MLP and MoE side by side, each with its own norms
    const float *post_mlp_norm    # [d_model] (parallel) after the dense MLP
    const float *pre_moe_norm     # [d_model] (parallel) the experts' input norm
    const float *post_moe_norm    # [d_model] (parallel) after the experts
    const float *router_scale     # [d_model] (parallel) the router reads rmsnorm(x) * router_scale * d**-0.5
    const float *expert_scale     # [n_experts] or NULL: multiplies each chosen expert's weight
    int kv_ring               # rows of the cache: n_ctx, or window + prefill chunk (sliding layers)
    # [n_seq, n_kv_heads, kv_ring, head_dim] of Hyper.kv elements (a q8 row: cb_kv_row_bytes), position
    # p of a sequence in row p % kv_ring of each of its heads
    void *k_cache
    void *v_cache             # [n_seq, n_kv_heads, kv_ring, head_dim]
    size_t kv_seq_bytes       # bytes of one sequence's keys (and of its values): n_kv_heads * kv_ring rows

cdef struct Hyper:
    int d_model
    int n_layers
    int n_heads
    int vocab
    int n_experts
    int top_k
    int norm_topk_prob
    int use_lut               # routing exponentials from the softmax table instead of expf
    int sigmoid_router        # GLM-4.5 / DeepSeek-V3: routing.h cb_route_sigmoid
    int n_group               # its expert groups ...
    int topk_group            # ... of which the best topk_group are chosen from
    float routed_scaling      # its weights' factor
    int prefetch              # PREFETCH_NONE / _ROUTED / _PREDICT
    # under an expert budget: a prompt's call may stream its experts (expert_cache_step,
    # Scratch.stream_layer)
    int stream_prefill
    # > 0: a decoded token's chosen expert that the cache does not hold, is not its top one and
    # weighs less than skip_missed / top_k of the chosen weights is skipped (the rest renormalised)
    float skip_missed
    # > 0: a decoded token's router logits of the experts the cache holds are raised by this
    # times the logits' range before its top-k is chosen; the chosen keep the router's weights
    float cache_routing
    int qk_norm
    float clip_qkv            # 0: no clipping
    int v_norm                # RMSNorm without weight over each value head (Gemma 4)
    int act                   # CB_ACT_SILU / CB_ACT_GELU_TANH / CB_ACT_SWIGLU_CLAMPED of the FFN gate
    float swiglu_alpha        # CB_ACT_SWIGLU_CLAMPED's sigmoid factor ...
    float swiglu_limit        # ... and clamp
    float embed_scale         # the embedding row is multiplied by it (1: no-op)
    float softcap             # final logit soft-capping (0: none)
    float router_root         # d_model ** -0.5 (the parallel MoE's router input)
    float rms_eps
    int n_ctx
    int n_seq                 # sequences in the KV cache (Engine.step)
    int n_threads
    int kv                    # the KV cache's element type (_kernels.KV_CODES: f32, f16, q8)

cdef struct Nextn:
    # A multi-token-prediction block's input (config.nextn_block): the embedded next token and the
    # main model's hidden state, each normed, joined and projected into the residual stream.
    Mat eh_proj               # [d_model, 2 * d_model]
    const float *enorm        # [d_model] the embedded token's norm
    const float *hnorm        # [d_model] the hidden state's norm
    float *joined             # [cap, 2 * d_model] scratch: [enorm(embed(token)); hnorm(hidden)] per token


cdef struct Scratch:
    # Every buffer of one engine call: up to `cap` tokens (a prefill chunk; decode is one), rows
    # [cap, ...] with token t in row t. Sized once from the config (Engine.__init__).
    int cap
    # Whose cache the call's tokens use: a chunk is `seq`'s positions pos0..; a step (tok_seq not
    # NULL) is one token of each of several sequences, token t sequence tok_seq[t] at tok_pos[t].
    int seq
    const int *tok_seq    # [n] or NULL
    const int *tok_pos    # [n] or NULL
    const unsigned char *tok_want   # [n] or NULL: a step's tokens whose logits are wanted (WANT_SOME)
    float *x          # [cap, d_model] the residual streams
    float *xb         # [cap, d_model] normed inputs of a block
    float *xb2        # [cap, d_model] outputs of a block
    float *q          # [cap, n_heads * max head_dim]
    float *att        # [cap, n_heads * max head_dim] attention outputs before wo
    float *k          # [cap, max kv_dim] keys of the tokens, before they go to the cache rows
    float *v          # [cap, max kv_dim] their values
    # [rows, n_ctx + 1] (the positions, and an attention sink): a row per head where cap is 1,
    # else cb_attention_score_rows(n_heads, n_threads) rows (a block of queries per thread)
    float *scores
    float *rx         # [cap, d_model] router inputs (parallel MoE)
    float *xe         # [cap, d_model] expert inputs (parallel MoE)
    float *xm         # [cap, d_model] expert outputs (parallel MoE)
    float *mla_qa     # [cap, q_lora_rank] MLA: the low-rank query
    float *mla_q      # [cap, n_heads * qk_head] MLA: the heads' queries before the absorption
    float *mla_o      # [cap, n_heads * v_head] MLA: the heads' values
    cb_matjob *head_jobs  # [n_heads] MLA: one product per head
    cb_act_q8 *acts   # [cap] activation quantization of the block inputs (_kernels.act_specs, max_cols)
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
    int64_t *prefetch_stats   # [PF_N] prediction counters, see PF_*
    cb_expert_cache *cache    # the expert cache and its reader (NULL: none, nothing is advised)
    int *expert_m             # [n_experts] tokens of the call routed to each expert (several tokens, a cache)
    int stream_layer          # this layer's experts streamed one a wave (expert_cache_step decides; 0: used together)
    float *router2    # [n_experts] router logits of the next layer (prediction)
    float *pred_w     # [top_k] scratch weights of a prediction


# a started expert cache over numpy arrays the caller keeps alive (_engine.pyx explains the shapes)
cdef cb_expert_cache *cache_new(pages, fds, resident, fresh, last_use, freq, stats, long long budget, str policy,
                                advice, cache_os, size_t chunk) except NULL
