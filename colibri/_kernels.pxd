# The contract between the compiled modules and the kernels: what they share (csrc/api.h: the
# storage codes, the structs passed across, the sizes) and the kernels' entry points below.
#
# Every kernel body is compiled once, into this module: _kernels.pyx includes csrc/dispatch.h
# (the kernel table cb_kt, chosen at import, and the f16 table are its state) and the tiers. The
# other modules include only api.h through this file and call the kernels through the entry
# points at the end of it, so no module carries a copy of another's code.

from libc.stdint cimport uint8_t, int8_t, uint16_t, int32_t, uint32_t, int64_t

cdef extern from "api.h" nogil:
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
    int CB_KV_F32                # the KV cache's element types (a load option: kv_cache)
    int CB_KV_F16
    int CB_KV_Q8
    int CB_KV_Q8_MAX_HEAD_DIM    # head_dim a q8 cache serves
    size_t cb_row_stride(int dtype, int cols)      # bytes of one row of a matrix in the rows layout
    size_t cb_kv_row_bytes(int head_dim, int kv)   # bytes of one cache row (a KV head at a position)

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

cdef extern from "int_step.h" nogil:
    # the int steps (colibri._kernels.INT_STEPS names them) and what one gives the kernel table
    int CB_INT_STEP_SCALAR, CB_INT_STEP_AVX2, CB_INT_STEP_VNNI_EMULATED, CB_INT_STEP_AVXVNNI
    int CB_INT_STEP_AVX512VNNI, CB_INT_STEP_AMX_EMULATED, CB_INT_STEP_AMX, CB_INT_STEPS
    ctypedef struct cb_int_kernels:
        pass
    ctypedef struct cb_step_parts:   # the kernels a step built elsewhere calls back into
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
cdef int attention_score_rows(int n_heads, int n_threads) noexcept nogil   # rows of the scores scratch

# ---- the element-wise kernels (kernels_scalar.h: every tier's) -------------------------------

cdef void rmsnorm(float *out, const float *x, const float *weight, int n, float eps) noexcept nogil
cdef void add(float *acc, const float *x, int n) noexcept nogil             # acc += x
cdef void axpy(float *acc, float a, const float *x, int n) noexcept nogil   # acc += a * x
cdef void clip(float *x, float limit, int n) noexcept nogil                 # x = clamp(x, -limit, limit)
cdef void glu_clamped(float *gate, const float *up, int n, float alpha, float limit) noexcept nogil
cdef void scale(float *x, float a, int n) noexcept nogil                    # x *= a
cdef void softcap(float *x, float cap, int n) noexcept nogil                # x = cap * tanh(x / cap)
cdef void rope(float *v, int n_heads, int head_dim, int rot_dim, const float *cos_t, const float *sin_t) noexcept nogil
cdef bint all_finite(const float *x, int n) noexcept nogil
cdef float f16_to_f32(uint16_t h) noexcept nogil                           # exact (the f16 table)

# activation quantization scratch: bind_acts(act_arrays(rows, cols)) -> cb_act_q8 [rows] (free() it)
cdef cb_act_q8 *bind_acts(list arrays) except NULL

# ---- the int steps' registry, for the probes' test steps (csrc/test_steps.h) -----------------

cdef int install_int_step(int step, const cb_int_kernels *k) noexcept nogil   # k NULL: remove it
cdef int int_step_kernels(int step, cb_int_kernels *k) noexcept nogil   # the tier in use's, even if off
cdef const cb_step_parts *step_parts() noexcept nogil
cdef int search_bf16_order(int step) noexcept nogil   # import's search on step (CB_BF16_*, or -1 / -2 / -3)
