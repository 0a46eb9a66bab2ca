# The contract between Python and csrc/: every C declaration of the kernels, once.
#
# csrc/dispatch.h keeps its state in this module's copy of it (the kernel table cb_kt, chosen at
# import, and the f16 table): the functions marked STATEFUL below read it, so every other module
# calls them through this module's entry points at the end of this file, never directly. The
# stateless ones (element-wise arithmetic, sizes) may be called from anywhere.

from libc.stdint cimport uint8_t, int8_t, uint16_t, int32_t, uint32_t, int64_t

cdef extern from "kernels_scalar.h" nogil:
    # storage formats and layouts of a matrix (colibri._kernels.DTYPE_CODES / LAYOUT_CODES)
    int CB_F32, CB_F16, CB_BF16, CB_INT8, CB_INT4, CB_MXFP4, CB_NL4, CB_INT6
    int CB_ROWS, CB_TRANSPOSED, CB_INTERLEAVED
    # the FFN gate's activation (colibri._kernels.ACT_CODES)
    int CB_ACT_SILU, CB_ACT_GELU_TANH, CB_ACT_SWIGLU_CLAMPED
    ctypedef struct cb_act_q8:   # one activation vector quantized per block of 32 for the integer formats
        signed char *q     # [n]
        float *d           # [n / 32]
        int32_t *s         # [n / 32] the sum of each block's q
        int32_t *nl4_off   # [2 * n / 32] -64 x the sums of each block's first and last 16 q
        int n
        float *xp          # [n] or NULL: the activation reordered for a bf16 tile (CB_XP_*)
        uint16_t *xb       # [n] or NULL: the activation rounded to bf16 (bf16 products)

    # stateless
    float cb_f16_to_f32_exact(uint16_t h)
    float cb_bf16_to_f32(uint16_t h)
    size_t cb_row_stride(int dtype, int cols)
    void cb_rmsnorm(float *out, const float *x, const float *weight, int n, float eps)
    void cb_add(float *acc, const float *x, int n)
    void cb_axpy(float *acc, float a, const float *x, int n)
    void cb_clip(float *x, float limit, int n)
    void cb_glu_clamped(float *gate, const float *up, int n, float alpha, float limit)
    void cb_scale(float *x, float a, int n)
    void cb_softcap(float *x, float cap, int n)
    void cb_rope(float *v, int n_heads, int head_dim, int rot_dim, const float *cos_t, const float *sin_t)
    int cb_all_finite(const float *x, int n)

    # STATEFUL (the f16 table)
    void cb_init_tables()
    void cb_dequant_row(float *out, const void *w, int dtype, int layout, int row, int rows, int cols)

cdef extern from "dispatch.h" nogil:
    int CB_ISA_SCALAR, CB_ISA_AVX2, CB_ISA_AVX512
    int CB_INT_STEP_SCALAR, CB_INT_STEP_AVX2, CB_INT_STEP_VNNI_EMULATED, CB_INT_STEP_AVXVNNI
    int CB_INT_STEP_AVX512VNNI, CB_INT_STEP_AMX_EMULATED, CB_INT_STEP_AMX
    int CB_HAVE_AMX              # 1 where this build has the AMX step (x86-64, GCC or clang)
    ctypedef struct cb_cpu_features:
        int avx2, fma, f16c, avx512f, avx512bw, avx512vl, avx512dq
        int avx512_vnni, avx512_bf16, avx_vnni, amx_tile, amx_int8, amx_bf16, os_avx, os_avx512, os_amx
    ctypedef struct cb_selection:    # what filled the kernel table
        int isa
        int int_step
    ctypedef struct cb_matjob:   # one product of a batch: out[t * ldo + r] = W[r, :] . x[t * ldx + :], t < n
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

    # stateless
    cb_cpu_features cb_detect_cpu()
    int cb_best_isa(const cb_cpu_features *f)

    # STATEFUL (the kernel table)
    cb_selection cb_selected
    int cb_select_isa(int isa)
    int cb_self_test(int isa)
    int cb_self_test_step(int isa, int step)
    int cb_set_int_step(int step)
    int CB_BF16_SEQ, CB_BF16_ORDERS   # orders of bf16 products: CB_BF16_SEQ .. CB_BF16_ORDERS - 1
    const char *cb_bf16_order_names[]   # [CB_BF16_ORDERS] their names
    int cb_bf16_order            # the order in use (kernels_scalar.h); the import self-test sets it
    int cb_amx_bf16_unit_order   # the AMX unit's order its self-test found (-1: not known)
    int cb_set_bf16_order(int order)
    int cb_search_bf16_order_emulated(int isa, int unit)
    void cb_set_amx_granted(int granted)
    int *cb_int_step_failed_check  # [CB_INT_STEP_*]: the self-test check a step failed (0: none); it is off
    # tests: the interleaved kernels of these steps (bit CB_INT_STEP_*) miscompute
    void cb_set_faulty_int_steps(unsigned steps)
    int cb_amx_bf16_failed_check  # its bf16 products tile's failed check (0: none); that tile is off
    int cb_set_prefill_repack(int on)
    int cb_dpbusd_emulated(int32_t *out, const int32_t *acc, const uint8_t *u, const int8_t *s)
    void cb_glu(float *gate, const float *up, int n, int act)
    void cb_matmul(float *out, int ldo, const void *w, int dtype, int layout, const float *x, int ldx,
                   cb_act_q8 *acts, int n, int rows, int cols, int n_threads)
    void cb_matmul_jobs(const cb_matjob *jobs, int count, int n_threads)
    int cb_has_bf16_products()
    int cb_amx_bf16_installed()
    void cb_round_bf16(uint16_t *dst, const float *x, int n)
    int cb_attention_softmax(float *x, int n)
    void cb_quantize_act(cb_act_q8 *a, const float *x, int n)
    void cb_attention(float *out, int ldo, const float *q, int ldq, const void *k_cache,
                      const void *v_cache, float *scores, int n_heads, int n_kv_heads, int head_dim,
                      int n_ctx, int n, int pos0, int window, int ring, float scale, const float *sinks,
                      int n_threads, int kv)
    int cb_attention_score_rows(int n_heads, int n_threads)
    void cb_kv_store(void *dst, const float *src, int n, int kv)
    int CB_KV_F32                # the KV cache's element types (a load option: kv_cache)
    int CB_KV_F16
    int CB_KV_Q8
    int CB_KV_Q8_MAX_HEAD_DIM    # head_dim a q8 cache serves
    size_t cb_kv_row_bytes(int head_dim, int kv)   # bytes of one cache row (a KV head at a position)

cdef extern from "quant.h":
    int CB_QBLOCK                # weights per block of the integer formats (32)
    int CB_TGROUP                # outputs per group of the transposed / interleaved layouts (8)
    int CB_NL4_OFFSET            # nl4's codebook values + 64 are what the integer steps multiply
    int CB_NL4_SCALE_BIAS        # a stored six-bit nl4 scale is sub + 32
    int CB_INT6_OFFSET           # int6's codes + 32 are what the integer steps multiply
    ctypedef struct cb_block_int8:
        pass
    ctypedef struct cb_block_int4:
        pass
    ctypedef struct cb_block_mxfp4:
        pass
    ctypedef struct cb_group_int8:
        pass
    ctypedef struct cb_group_int4:
        pass
    ctypedef struct cb_igroup_int8:
        pass
    ctypedef struct cb_igroup_int4:
        pass
    ctypedef struct cb_igroup_int6:
        pass
    ctypedef struct cb_igroup_mxfp4:
        pass


# ---- the entry points: the kernels of the tier in use (this module's kernel table) ----------

cdef void matmul_jobs(const cb_matjob *jobs, int count, int n_threads) noexcept nogil
cdef void matmul(float *out, int ldo, const void *w, int dtype, int layout, const float *x, int ldx,
                 cb_act_q8 *acts, int n, int rows, int cols, int n_threads) noexcept nogil
cdef void attention(float *out, int ldo, const float *q, int ldq, const void *k_cache, const void *v_cache,
                    float *scores, int n_heads, int n_kv_heads, int head_dim, int n_ctx, int n, int pos0,
                    int window, int ring, float scale, const float *sinks, int n_threads, int kv) noexcept nogil
cdef void kv_store(void *dst, const float *src, int n, int kv) noexcept nogil
cdef void glu(float *gate, const float *up, int n, int act) noexcept nogil
cdef void dequant_row(float *out, const void *w, int dtype, int layout, int row, int rows, int cols) noexcept nogil
cdef void quantize_act(cb_act_q8 *a, const float *x, int n) noexcept nogil
cdef void round_bf16(uint16_t *dst, const float *x, int n) noexcept nogil
cdef int attention_softmax(float *x, int n) noexcept nogil
cdef int dpbusd_emulated(int32_t *out, const int32_t *acc, const uint8_t *u, const int8_t *s) noexcept nogil

# activation quantization scratch: bind_acts(act_arrays(rows, cols)) -> cb_act_q8 [rows] (free() it)
cdef cb_act_q8 *bind_acts(list arrays) except NULL

cdef extern from "quantize_nl4.h" nogil:
    # stateless: nl4's scale and code search (rows in parallel), into colibri.quant's rows form
    int CB_NL4_SUB_MAX           # the search's sub-scales lie in [-31, 31]
    void cb_quantize_nl4(uint8_t *out, const float *w, const float *importance, int rows, int cols, int n_threads)
    float cb_nl4_row_scale(float amax)
    void cb_nl4_search_halves(uint8_t *sc, uint8_t *codes, const float *x, const float *w, const float *s,
                              int rows, int n_threads)

cdef extern from "token_mask.h" nogil:
    # stateless: logits [n], a grammar's bitmask [ceil(n / 32)] -> out [n] (-inf where the bit is clear)
    void cb_mask_logits(const float *logits, const uint32_t *bits, float *out, int64_t n)
