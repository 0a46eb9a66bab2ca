# cython: language_level=3
"""Probes of the kernels, for the tests and the benchmarks: not used by the engine.

Thin wrappers that call one kernel of the tier in use (through _kernels' entry points, so
`_kernels.select_isa` switches them too) on numpy arrays, `bench_*` loops that time a kernel with
no Python between repetitions (tools/bench_kernels.py, tools/bench_routing.py), and the machine's
attainable read bandwidth and peak FMA, int8, bf16 and VNNI rates for the rooflines.
"""

from libc.stdint cimport uintptr_t, uint8_t, int8_t, uint16_t, int32_t, uint64_t
from libc.stdlib cimport free
from libc.math cimport sqrtf

cimport colibri._kernels as kernels
from colibri._kernels cimport cb_kv_row_bytes
cimport colibri._routing as routing
from colibri._kernels cimport (cb_act_q8, cb_matjob, CB_INT8, CB_INT4, CB_MXFP4, CB_NL4, CB_INT6, CB_BF16,
                               cb_block_mxfp4, cb_igroup_int8, cb_igroup_int4, cb_igroup_mxfp4, cb_igroup_int6,
                               cb_row_stride, cb_block_int8, cb_block_int4,
                               cb_group_int8, cb_group_int4)
from colibri._routing cimport CB_MAX_TOP_K

import numpy as np

from colibri._kernels import (ACT_CODES, DTYPE_CODES, KV_CODES, LAYOUT_CODES, act_arrays, available_isas,
                              cpu_features, isa)


def kernel_f16_to_f32(uint16_t h):
    return kernels.f16_to_f32(h)


def _stored_rows(w, int cols, str dtype, str layout):
    """The number of outputs of a stored matrix w (see kernel_matvec); ValueError if w cannot hold
    a matrix of `cols` inputs in that format and layout."""
    if dtype not in DTYPE_CODES:
        raise ValueError(f"unknown dtype {dtype!r}")
    if layout not in LAYOUT_CODES:
        raise ValueError(f"unknown layout {layout!r}")
    cdef int code = DTYPE_CODES[dtype]
    block = code == CB_INT8 or code == CB_INT4 or code == CB_MXFP4 or code == CB_NL4 or code == CB_INT6
    if block and cols % 32:
        raise ValueError(f"{dtype} needs a multiple of 32 columns, got {cols}")
    if code == CB_MXFP4 and layout == "transposed":
        raise ValueError("mxfp4 has no transposed layout")
    if code == CB_INT6 and layout != "interleaved":
        raise ValueError("int6 has only the interleaved layout")
    if code == CB_NL4:              # [rows / 8, cols / 32 * 140 + 32]: the groups, then the row scales
        if layout != "interleaved":
            raise ValueError("nl4 has only the interleaved layout")
        if w.ndim != 2 or w.shape[1] != cols // 32 * 140 + 32:
            raise ValueError(f"interleaved nl4 needs [rows / 8, cols / 32 * 140 + 32], got {w.shape}")
        return w.shape[0] * 8
    if layout == "rows":
        rows = w.shape[0]
    elif layout == "interleaved":    # [rows / 8, cols / 32 * group bytes]
        if code == CB_BF16 and cols % 32:
            raise ValueError(f"interleaved bf16 needs a multiple of 32 columns, got {cols}")
        if not block and code != CB_BF16:
            raise ValueError(f"the interleaved layout is for int8/int4/mxfp4/int6/bf16, not {dtype}")
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


cdef cb_act_q8 *_test_acts(int n, int cols, list keep, bint bf16_products=False) except NULL:
    """Activation quantization scratch for n tokens of `cols` values (free() it); the numpy
    arrays behind it go into `keep`, which must outlive its use. bf16_products: with the bf16
    activations that make bf16 matrices take bf16 products where the tier has them."""
    arrays = act_arrays(n, cols, bf16_products)
    keep.extend(arrays)
    return kernels.bind_acts(arrays)


def kernel_matvec(w, const float[::1] x, str dtype, int n_threads=1, str layout="rows"):
    """W @ x through the kernel table of the current tier.

    w: the stored matrix, C-contiguous. rows layout: [rows, cols] float32 (f32), uint16
    (f16/bf16), or [rows, cols // 32 * block bytes] uint8 for int8/int4; transposed layout: the
    float formats [cols, rows], int8/int4 [cols // 32, rows // 8 * group bytes] uint8 (see
    colibri.quant.transpose)."""
    return kernel_matmul(w, np.asarray(x).reshape(1, -1), dtype, n_threads, layout)[0]   # cb_matvec is n = 1


def bench_matmul(w, const float[:, ::1] x, str dtype, int n_threads, int reps, str layout="rows",
                 bint bf16_products=False):
    """Seconds for `reps` products out[n, rows] = x[n, cols] @ W[rows, cols]^T through the engine's
    cb_matmul (n = 1: the decode matvec; n > 1: a prefill tile pass), with no Python between
    repetitions: what tools/bench_kernels.py times. W is stored as in kernel_matvec;
    bf16_products as in kernel_matmul."""
    import time
    w = np.ascontiguousarray(w)
    cdef int n = x.shape[0], cols = x.shape[1], _rep
    cdef int rows = _stored_rows(w, cols, dtype, layout)
    cdef int code = DTYPE_CODES[dtype]
    cdef int lay = LAYOUT_CODES[layout]
    if n < 1 or reps < 1:
        raise ValueError("bench_matmul: needs n >= 1 tokens and reps >= 1")
    out = np.zeros((n, rows), np.float32)
    keep = []
    cdef cb_act_q8 *acts = _test_acts(n, cols, keep, bf16_products)
    cdef float[:, ::1] o = out
    cdef const void *wp = <const void *><uintptr_t>w.ctypes.data
    t0 = time.perf_counter()
    with nogil:
        for _rep in range(reps):
            kernels.matmul(&o[0, 0], rows, wp, code, lay, &x[0, 0], cols, acts, n, rows, cols, n_threads)
    seconds = time.perf_counter() - t0
    free(acts)
    return seconds


def bench_attention(const float[:, ::1] q, k_layers, v_layers, int pos, int n_threads, int reps, str kv="f32"):
    """Seconds for `reps` decode steps' attention: one query q [n_heads, head_dim] against every
    layer's cache in k_layers / v_layers float32 [n_layers, n_kv_heads, ring, head_dim] (the
    engine's order), positions 0..pos, through cb_attention with no Python between layers or
    repetitions: what tools/bench_kernels.py --attention times. kv: the caches' elements (_kv_cache)."""
    import time
    if np.ndim(k_layers) != 4 or np.shape(v_layers) != np.shape(k_layers) or np.shape(k_layers)[3] != q.shape[1] \
            or np.shape(k_layers)[1] < 1 or q.shape[0] % np.shape(k_layers)[1] or not 0 <= pos < np.shape(k_layers)[2] \
            or reps < 1:
        raise ValueError("bench_attention: q [n_heads, head_dim], caches [n_layers, n_kv_heads, ring, head_dim], "
                         "0 <= pos < ring, reps >= 1")
    ka, va = _kv_cache(k_layers, kv), _kv_cache(v_layers, kv)
    cdef int n_layers = ka.shape[0], n_kv = ka.shape[1], ring = ka.shape[2], head_dim = q.shape[1]
    cdef int n_heads = q.shape[0], _rep, layer
    out = np.zeros((n_heads, head_dim), np.float32)
    scores = np.zeros((n_heads, pos + 2), np.float32)         # [n_heads, n_ctx + 1]
    cdef float[:, ::1] o = out, sc = scores
    cdef const char *kp = <const char *><uintptr_t>ka.ctypes.data
    cdef const char *vp = <const char *><uintptr_t>va.ctypes.data
    cdef size_t layer_bytes = ka.strides[0]
    cdef int code = KV_CODES[kv]
    cdef float scale = 1.0 / sqrtf(head_dim)
    t0 = time.perf_counter()
    with nogil:
        for _rep in range(reps):
            for layer in range(n_layers):
                kernels.attention(&o[0, 0], 0, &q[0, 0], 0, kp + layer * layer_bytes, vp + layer * layer_bytes,
                                  &sc[0, 0], n_heads, n_kv, head_dim, pos + 1, 1, pos, 0, ring, scale, NULL,
                                  n_threads, code)
    return time.perf_counter() - t0


def bench_attention_prompt(q, k_cache, v_cache, int pos0, int n_threads, int reps, bint one_at_a_time=False,
                           str kv="f32"):
    """Seconds for `reps` attentions of a prompt chunk: q float32 [n, n_heads, head_dim] at
    positions pos0.. against engine-order caches [n_kv_heads, ring >= pos0 + n, head_dim], through
    cb_attention as the engine's prefill calls it (n queries, blocks sharing the cache rows), or
    with one_at_a_time as decode calls it (n calls of one query): what tools/bench_kernels.py
    --prompt-attention times."""
    import time
    qa = np.ascontiguousarray(q, np.float32)
    ka, va = np.asarray(k_cache), np.asarray(v_cache)
    if qa.ndim != 3 or ka.ndim != 3 or va.shape != ka.shape or ka.shape[2] != qa.shape[2] \
            or qa.shape[1] % ka.shape[0] or pos0 < 0 or pos0 + qa.shape[0] > ka.shape[1] or reps < 1:
        raise ValueError("bench_attention_prompt: q [n, n_heads, head_dim], caches [n_kv_heads, ring, head_dim], "
                         "pos0 + n <= ring, reps >= 1")
    ka, va = _kv_cache(ka, kv), _kv_cache(va, kv)
    cdef int n = qa.shape[0], n_heads = qa.shape[1], head_dim = qa.shape[2], n_kv = ka.shape[0], ring = ka.shape[1]
    cdef int n_ctx = ring, _rep, t, ld = n_heads * head_dim
    out = np.zeros((n, n_heads, head_dim), np.float32)
    scores = np.zeros((kernels.attention_score_rows(n_heads, n_threads), n_ctx + 1), np.float32)
    cdef float *o = <float *><uintptr_t>out.ctypes.data
    cdef float *sc = <float *><uintptr_t>scores.ctypes.data
    cdef const float *qp = <const float *><uintptr_t>qa.ctypes.data
    cdef const void *kp = <const void *><uintptr_t>ka.ctypes.data
    cdef const void *vp = <const void *><uintptr_t>va.ctypes.data
    cdef int code = KV_CODES[kv]
    cdef float scale = 1.0 / sqrtf(head_dim)
    cdef bint one = one_at_a_time
    t0 = time.perf_counter()
    with nogil:
        for _rep in range(reps):
            if one:
                for t in range(n):
                    kernels.attention(o + <size_t>t * ld, ld, qp + <size_t>t * ld, ld, kp, vp, sc, n_heads, n_kv,
                                      head_dim, n_ctx, 1, pos0 + t, 0, ring, scale, NULL, n_threads, code)
            else:
                kernels.attention(o, ld, qp, ld, kp, vp, sc, n_heads, n_kv, head_dim, n_ctx, n, pos0, 0, ring, scale,
                                  NULL, n_threads, code)
    return time.perf_counter() - t0


def kernel_matmul(w, const float[:, ::1] x, str dtype, int n_threads=1, str layout="rows",
                  bint bf16_products=False):
    """out [n, rows] = x [n, cols] @ W^T through cb_matmul (the prefill product), W stored as in
    kernel_matvec. bf16_products: the activations also rounded to bf16 (acts.xb), which a bf16
    rows matrix then multiplies by vdpbf16ps where the tier has it (_kernels.has_bf16_products)."""
    w = np.ascontiguousarray(w)
    cdef int n = x.shape[0], cols = x.shape[1]
    cdef int rows = _stored_rows(w, cols, dtype, layout)
    cdef int code = DTYPE_CODES[dtype]
    cdef int lay = LAYOUT_CODES[layout]
    out = np.zeros((n, rows), np.float32)
    if n == 0 or rows == 0 or cols == 0:
        return out
    keep = []
    cdef cb_act_q8 *acts = _test_acts(n, cols, keep, bf16_products)
    cdef float[:, ::1] o = out
    cdef const void *wp = <const void *><uintptr_t>w.ctypes.data
    with nogil:
        kernels.matmul(&o[0, 0], rows, wp, code, lay, &x[0, 0], cols, acts, n, rows, cols, n_threads)
    free(acts)
    return out


def kernel_round_bf16(const float[::1] x):
    """x rounded to bf16 (uint16 bits) by the current tier, as bf16 products round activations."""
    out = np.zeros(x.shape[0], np.uint16)
    cdef uint16_t[::1] o = out
    if x.shape[0]:
        kernels.round_bf16(&o[0], &x[0], x.shape[0])
    return out


def kernel_glu(const float[::1] gate, const float[::1] up, str act):
    """act(gate) * up through the current tier's cb_glu (act: "silu" or "gelu_tanh")."""
    if gate.shape[0] != up.shape[0]:
        raise ValueError("kernel_glu: gate and up must have the same length")
    if act not in ACT_CODES:
        raise ValueError(f"kernel_glu: act must be one of {', '.join(ACT_CODES)}, not {act!r}")
    out = np.array(gate, np.float32)
    cdef float[::1] o = out
    cdef int n = gate.shape[0], code = ACT_CODES[act]
    if n:
        kernels.glu(&o[0], &up[0], n, code)
    return out


# ---- the test steps (csrc/test_steps.h): built here, installed into _kernels' registry on request

cdef extern from "test_steps.h" nogil:
    void cb_test_steps_bind(const kernels.cb_step_parts *parts)
    int cb_test_step_kernels(int step, kernels.cb_int_kernels *k)
    void cb_make_faulty(int step, kernels.cb_int_kernels *k)
    int cb_dpbusd_emulated(int32_t *out, const int32_t *acc, const uint8_t *u, const int8_t *s)
    int cb_amx_emu_unit_order     # the order the emulated AMX unit adds in (-1: the order in use)

_TEST_STEPS = {"vnni-emulated": kernels.CB_INT_STEP_VNNI_EMULATED, "amx-emulated": kernels.CB_INT_STEP_AMX_EMULATED}
_faulty = set()                   # the INT_STEPS names set_faulty_int_steps made faulty


cdef void _install(int step, bint faulty):
    """Install step `step` as the tests want it: its test kernels (an emulated step) or none (a
    production step), with its interleaved kernel made faulty where asked."""
    cdef kernels.cb_int_kernels k
    cdef bint test_step = cb_test_step_kernels(step, &k) == 0
    kernels.install_int_step(step, &k if test_step else NULL)
    if faulty and kernels.int_step_kernels(step, &k) == 0:
        cb_make_faulty(step, &k)
        kernels.install_int_step(step, &k)


def install_test_steps():
    """Install the test steps this build has (the VNNI step emulated in AVX2, the AMX tiles emulated
    in C) into _kernels' registry: _kernels.set_int_step and available_int_steps then offer them
    where the tier and CPU can run them. The step in use stays. Returns their names."""
    cb_test_steps_bind(kernels.step_parts())
    cdef kernels.cb_int_kernels k
    for name, step in _TEST_STEPS.items():
        _install(step, name in _faulty)
    return [name for name, step in _TEST_STEPS.items() if cb_test_step_kernels(step, &k) == 0]


def remove_test_steps():
    """Take the test steps out of _kernels' registry (the faults too): a production run's registry."""
    _faulty.clear()
    for step in range(kernels.CB_INT_STEPS):
        kernels.install_int_step(step, NULL)


def set_faulty_int_steps(names=()):  # no-cython-lint: `names` (shadowing colibri.names) is the keyword callers use
    """Make the interleaved kernels of the int steps `names` miscompute from now on (none: every step
    as it is), so the self-test's fallback can be run on a CPU whose steps all agree. The table is
    refilled with the step in use."""
    from colibri._kernels import INT_STEPS
    if isinstance(names, str):
        raise ValueError(f"set_faulty_int_steps takes a list of int steps, got the string {names!r}")
    for name in names:
        if name not in INT_STEPS or name == "scalar":    # (the scalar step is every check's spec)
            raise ValueError(f"{name!r} is not an int step that can be made faulty; choose of "
                             f"{', '.join(k for k in INT_STEPS if k != 'scalar')}")
    cb_test_steps_bind(kernels.step_parts())
    _faulty.clear()
    _faulty.update(names)
    for name, step in INT_STEPS.items():
        if name != "scalar":
            _install(step, name in _faulty)


def search_bf16_order_emulated(str unit):
    """Play an AMX unit whose TDPBF16PS adds in order `unit` (a _kernels.BF16_ORDERS name: the
    emulated tile fixed to it) and run import's search for the order of bf16 products on the
    amx-emulated step of the tier in use (dispatch.h, cb_search_bf16_order): the order it keeps,
    None where none passes. Everything it changes is restored. ValueError where the tier has no
    amx-emulated step with a bf16 tile, or a check outside that tile fails."""
    global cb_amx_emu_unit_order
    from colibri._kernels import BF16_ORDERS
    if unit not in BF16_ORDERS:
        raise ValueError(f"{unit!r} is not an order of bf16 products; choose one of {', '.join(BF16_ORDERS)}")
    before = cb_amx_emu_unit_order
    cb_amx_emu_unit_order = BF16_ORDERS[unit]
    try:
        found = kernels.search_bf16_order(kernels.CB_INT_STEP_AMX_EMULATED)
    finally:
        cb_amx_emu_unit_order = before
    if found == -3:
        raise ValueError(f"tier {isa()} has no amx-emulated step with a bf16 products tile here")
    if found == -2:
        raise ValueError("the amx-emulated step failed a self-test check outside its bf16 products tile")
    return None if found == -1 else {code: name for name, code in BF16_ORDERS.items()}[found]


def kernel_dpbusd_emulated(const int32_t[::1] acc, const uint8_t[::1] u, const int8_t[::1] s):
    """acc [8] + the VNNI step (vpdpbusd) of u [32] and s [32] as emulated in AVX2 for the
    "vnni-emulated" int step. ValueError on a tier without AVX2."""
    if acc.shape[0] != 8 or u.shape[0] != 32 or s.shape[0] != 32:
        raise ValueError("kernel_dpbusd_emulated: acc [8] int32, u [32] uint8, s [32] int8")
    out = np.empty(8, np.int32)
    cdef int32_t[::1] o = out
    if isa() == "scalar" or cb_dpbusd_emulated(&o[0], &acc[0], &u[0], &s[0]) != 0:
        raise ValueError(f"kernel_dpbusd_emulated: tier {isa()} has no AVX2")
    return out


def kernel_glu_product(gate, up, const float[:, ::1] x, str dtype, str layout, str act, int n_threads,
                       bint adjacent=True):
    """act(x @ gate^T) * (x @ up^T) [n, rows] through one cb_matmul_jobs batch (each thread applies
    the activation to the gate rows it computed), gate and up stored as in kernel_matvec.
    adjacent: the batch is [up, gate]; otherwise [up, another product, gate]."""
    gate = np.ascontiguousarray(gate)
    up = np.ascontiguousarray(up)
    if act not in ACT_CODES:
        raise ValueError(f"kernel_glu_product: act must be one of {', '.join(ACT_CODES)}, not {act!r}")
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
    jobs[count - 1].glu_act = ACT_CODES[act]
    with nogil:
        kernels.matmul_jobs(jobs, count, n_threads)
    free(acts)
    return out


def _kv_cache(x, str kv):
    """float rows x [..., head_dim] as a KV cache of kv (KV_CODES) elements, stored as the engine
    stores them (cb_kv_store, the tier's): f32 as is, f16 rounded, q8 rows of [f32 scale, head_dim
    int8 codes] -> float32 / float16 [..., head_dim] or uint8 [..., head_dim + 4]."""
    if kv not in KV_CODES:
        raise ValueError(f"kv {kv!r}: one of {', '.join(KV_CODES)}")
    rows = np.ascontiguousarray(x, np.float32)
    if kv != "q8":
        return np.ascontiguousarray(rows, np.float16 if kv == "f16" else np.float32)
    cdef int head_dim = rows.shape[rows.ndim - 1], r
    flat = rows.reshape(-1, head_dim)
    out = np.zeros((flat.shape[0], cb_kv_row_bytes(head_dim, kernels.CB_KV_Q8)), np.uint8)
    cdef const float *src = <const float *><uintptr_t>flat.ctypes.data
    cdef char *dst = <char *><uintptr_t>out.ctypes.data
    cdef size_t rbytes = out.shape[1]
    for r in range(flat.shape[0]):
        kernels.kv_store(dst + <size_t>r * rbytes, src + <size_t>r * head_dim, head_dim, kernels.CB_KV_Q8)
    return out.reshape(tuple(rows.shape)[:rows.ndim - 1] + (out.shape[1],))


def kernel_attention(q, k_cache, v_cache, int n_kv_heads, int start, int pos, int n_threads=1, sinks=None,
                     str kv="f32"):
    """One query's causal attention through the tier's kernel (cb_attention): q float32 [n_heads,
    head_dim] (roped), k_cache / v_cache float32 [ring, n_kv_heads * head_dim] holding position p
    in row p % ring — or already in the engine's order [n_kv_heads, ring, head_dim] (C-contiguous
    float32, used as they are: tools/bench_kernels.py); attends positions start..pos with scale
    1/sqrt(head_dim); sinks float32 [n_heads] or None: attention sinks; kv: the caches stored as
    the engine stores that element type (_kv_cache: f16 rounded, q8 quantized). -> [n_heads, head_dim]."""
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
        ka = np.ascontiguousarray(np.asarray(k_cache, np.float32).reshape(ring, n_kv_heads, head_dim)
                                  .transpose(1, 0, 2))
        va = np.ascontiguousarray(np.asarray(v_cache, np.float32).reshape(ring, n_kv_heads, head_dim)
                                  .transpose(1, 0, 2))
    if not 0 <= start <= pos or pos - start + 1 > ring:
        raise ValueError("kernel_attention: positions start..pos must fit the ring")
    cdef int n_ctx = pos - start + 1
    out = np.zeros((n_heads, head_dim), np.float32)
    scores = np.zeros((n_heads, n_ctx + 1), np.float32)
    cdef float[:, ::1] o = out, sc = scores
    cdef const float[:, ::1] qv = qa
    sink_array = None if sinks is None else np.ascontiguousarray(sinks, np.float32).reshape(-1)
    if sink_array is not None and sink_array.shape[0] != n_heads:
        raise ValueError("kernel_attention: sinks [n_heads]")
    cdef const float *sink_ptr = NULL
    if sink_array is not None:
        sink_ptr = <const float *><uintptr_t>sink_array.ctypes.data
    ka, va = _kv_cache(ka, kv), _kv_cache(va, kv)
    cdef const void *kp = <const void *><uintptr_t>ka.ctypes.data
    cdef const void *vp = <const void *><uintptr_t>va.ctypes.data
    cdef int code = KV_CODES[kv]
    with nogil:
        kernels.attention(&o[0, 0], 0, &qv[0, 0], 0, kp, vp, &sc[0, 0], n_heads, n_kv_heads, head_dim,
                          n_ctx, 1, pos, pos - start + 1 if start > 0 else 0, ring, 1.0 / sqrtf(head_dim), sink_ptr,
                          n_threads, code)
    return out


def kernel_attention_prompt(q, k_cache, v_cache, int n_kv_heads, int pos0, int window=0, int n_threads=1,
                            sinks=None, str kv="f32"):
    """A prompt's causal attention through the tier's kernel (cb_attention with n queries, the
    engine's prefill call): q float32 [n, n_heads, head_dim] for positions pos0 .. pos0 + n - 1,
    their keys and values already in the engine-order caches float32 [n_kv_heads, ring,
    head_dim] (position p in row p % ring); window > 0: each query sees its last `window`
    positions; sinks and kv as kernel_attention. -> [n, n_heads, head_dim]."""
    qa = np.ascontiguousarray(q, np.float32)
    if qa.ndim != 3 or np.ndim(k_cache) != 3 or n_kv_heads < 1 or qa.shape[1] % n_kv_heads:
        raise ValueError("kernel_attention_prompt: q [n, n_heads, head_dim], caches [n_kv_heads, ring, head_dim]")
    cdef int n = qa.shape[0], n_heads = qa.shape[1], head_dim = qa.shape[2], ring = np.shape(k_cache)[1]
    if np.shape(k_cache) != (n_kv_heads, ring, head_dim) or np.shape(v_cache) != np.shape(k_cache) or n < 1:
        raise ValueError("kernel_attention_prompt: caches [n_kv_heads, ring, head_dim], n >= 1")
    cdef int n_ctx = pos0 + n
    if pos0 < 0 or window < 0 or (ring < n_ctx and not (window > 0 and ring >= window + n - 1)):
        raise ValueError("kernel_attention_prompt: the ring must hold every query's positions")
    ka, va = _kv_cache(k_cache, kv), _kv_cache(v_cache, kv)
    out = np.zeros((n, n_heads, head_dim), np.float32)
    scores = np.zeros((kernels.attention_score_rows(n_heads, n_threads), n_ctx + 1), np.float32)
    sink_array = None if sinks is None else np.ascontiguousarray(sinks, np.float32).reshape(-1)
    if sink_array is not None and sink_array.shape[0] != n_heads:
        raise ValueError("kernel_attention_prompt: sinks [n_heads]")
    cdef const float *sink_ptr = NULL
    if sink_array is not None:
        sink_ptr = <const float *><uintptr_t>sink_array.ctypes.data
    cdef float *o = <float *><uintptr_t>out.ctypes.data
    cdef float *sc = <float *><uintptr_t>scores.ctypes.data
    cdef const float *qp = <const float *><uintptr_t>qa.ctypes.data
    cdef const void *kp = <const void *><uintptr_t>ka.ctypes.data
    cdef const void *vp = <const void *><uintptr_t>va.ctypes.data
    cdef int code = KV_CODES[kv]
    with nogil:
        kernels.attention(o, n_heads * head_dim, qp, n_heads * head_dim, kp, vp, sc, n_heads, n_kv_heads, head_dim,
                          n_ctx, n, pos0, window, ring, 1.0 / sqrtf(head_dim), sink_ptr, n_threads, code)
    return out


def kernel_kv_store(const float[::1] x, str kv="f16"):
    """x as a cache row of kv elements (cb_kv_store: the tier's conversion): f16 -> uint16 [n]; q8
    -> uint8 [4 + n] (the f32 scale's bytes, then the codes)."""
    if kv == "q8":
        return _kv_cache(np.asarray(x), "q8")
    out = np.zeros(x.shape[0], np.uint16)
    if x.shape[0] == 0:
        return out
    cdef uint16_t[::1] o = out
    with nogil:
        kernels.kv_store(&o[0], &x[0], x.shape[0], kernels.CB_KV_F16)
    return out


def kernel_attention_softmax(x):
    """The current tier's attention softmax of float32 x [n] (a copy); None when x holds NaN/inf
    (cb_softmax's contract: nothing normalised)."""
    out = np.array(x, np.float32).reshape(-1)
    cdef float[::1] o = out
    if out.shape[0] == 0:
        return out
    return out if kernels.attention_softmax(&o[0], out.shape[0]) == 0 else None


def kernel_quantize_act(const float[::1] x):
    """(q int8 [n], d float32 [n / 32], s int32 [n / 32], nl4_off int32 [n / 32, 2]): the current
    tier's per-block activation quantization (s: each block's sum of q; nl4_off: -64 x the sums
    of its first and last 16)."""
    cdef int n = x.shape[0]
    if n % 32:
        raise ValueError(f"activations are quantized in blocks of 32, got {n} values")
    q = np.zeros(max(n, 32), np.int8)
    d = np.zeros(max(n // 32, 1), np.float32)
    s = np.zeros(max(n // 32, 1), np.int32)
    off = np.zeros(2 * max(n // 32, 1), np.int32)
    cdef cb_act_q8 act
    act.q = <signed char *><uintptr_t>q.ctypes.data
    act.d = <float *><uintptr_t>d.ctypes.data
    act.s = <int32_t *><uintptr_t>s.ctypes.data
    act.nl4_off = <int32_t *><uintptr_t>off.ctypes.data
    act.xp = NULL
    act.xb = NULL
    if n:
        kernels.quantize_act(&act, &x[0], n)
    return q[:n], d[:n // 32], s[:n // 32], off[:2 * (n // 32)].reshape(-1, 2)


def kernel_dequant_row(w, int row, int cols, str dtype, str layout="rows"):
    """Row `row` of a stored matrix (as in kernel_matvec) as float32 [cols] (the embedding lookup)."""
    w = np.ascontiguousarray(w)
    cdef int rows = _stored_rows(w, cols, dtype, layout)
    if not 0 <= row < rows:
        raise ValueError(f"row {row} is outside 0..{rows - 1}")
    out = np.zeros(cols, np.float32)
    cdef float[::1] o = out
    kernels.dequant_row(&o[0], <const void *><uintptr_t>w.ctypes.data, DTYPE_CODES[dtype], LAYOUT_CODES[layout], row,
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
    if routing.route(&b[0], b.shape[0], k, norm_topk_prob, use_lut, &c[0], &w[0]) != 0:
        raise ValueError("router logits are not finite")
    return chosen, weights


def kernel_route_sigmoid(const float[::1] logits, bias, int k, int n_group, int topk_group, bint norm_topk_prob,
                         float scaling):
    """The sigmoid router (routing.h cb_route_sigmoid): (chosen int32 [k], weights float32 [k]);
    bias float32 [n_experts] or None; ValueError when routing.h refuses."""
    buf = np.array(logits, np.float32)
    bias_buf = None if bias is None else np.ascontiguousarray(bias, np.float32)
    chosen = np.zeros(max(k, 1), np.int32)
    weights = np.zeros(max(k, 1), np.float32)
    cdef float[::1] b = buf
    cdef int[::1] c = chosen
    cdef float[::1] w = weights
    cdef float[::1] bb
    cdef const float *bias_ptr = NULL
    if bias_buf is not None:
        if bias_buf.shape != buf.shape:
            raise ValueError("bias must have one value per expert")
        bb = bias_buf
        bias_ptr = &bb[0]
    if routing.route_sigmoid(&b[0], bias_ptr, b.shape[0], k, n_group, topk_group, norm_topk_prob, scaling,
                             &c[0], &w[0]) != 0:
        raise ValueError("refused: non-finite logits, or k / n_group / topk_group out of range")
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
            routing.route(&logits[i, 0], e, k, norm_topk_prob, use_lut, &c[0], &w[0])
    return time.perf_counter() - t0


def kernel_rmsnorm(const float[::1] x, weight, float eps):
    out = np.zeros(x.shape[0], np.float32)
    cdef float[::1] o = out
    cdef const float[::1] wv
    if weight is None:
        kernels.rmsnorm(&o[0], &x[0], NULL, x.shape[0], eps)
    else:
        wv = np.ascontiguousarray(weight, np.float32)
        kernels.rmsnorm(&o[0], &x[0], &wv[0], x.shape[0], eps)
    return out


def block_sizes():
    """sizeof of the C block structs, for the test that they agree with colibri.quant (int6, which
    has no rows struct: an eighth of its interleaved group, what a row's block takes)."""
    return {"int8": sizeof(cb_block_int8), "int4": sizeof(cb_block_int4), "mxfp4": sizeof(cb_block_mxfp4),
            "int6": sizeof(cb_igroup_int6) // 8}


def igroup_sizes():
    """sizeof of the C group structs of the interleaved layout."""
    return {"int8": sizeof(cb_igroup_int8), "int4": sizeof(cb_igroup_int4), "mxfp4": sizeof(cb_igroup_mxfp4),
            "int6": sizeof(cb_igroup_int6)}


def group_sizes():
    """sizeof of the C group structs of the transposed layout (8 blocks each)."""
    return {"int8": sizeof(cb_group_int8), "int4": sizeof(cb_group_int4)}


PEAKS = ("fma", "fma512", "int8", "bf16", "vnni512")     # bench_peak's kinds (csrc/probes.h)


def bench_peak(str kind, int n_threads):
    """(operations done, seconds) of a peak loop on n_threads (csrc/probes.h), or None where this
    CPU cannot run it: kind "fma" — AVX2 FMA chains (float operations); "fma512" — AVX-512 FMA
    chains; "int8" — the AVX2 int8 dot-product step of the int8 kernels without VNNI (maddubs +
    madd; 2 operations per byte product); "bf16" — AVX512_BF16's vdpbf16ps (2 per bf16 product);
    "vnni512" — 512-bit vpdpbusd (2 per byte product)."""
    import time
    if kind not in PEAKS:
        raise ValueError(f"bench_peak: kind must be one of {', '.join(PEAKS)}, not {kind!r}")
    features = cpu_features()
    runs = {"fma": "avx2" in available_isas(), "int8": "avx2" in available_isas(),
            "fma512": "avx512" in available_isas(),
            "bf16": "avx512" in available_isas() and features["avx512_bf16"],
            "vnni512": "avx512" in available_isas() and features["avx512_vnni"]}
    if not runs[kind]:
        return None
    cdef double ops
    cdef int code = PEAKS.index(kind)
    t0 = time.perf_counter()
    with nogil:
        if code == 0:
            ops = cb_peak_fma_avx2(20000000, n_threads)
        elif code == 1:
            ops = cb_peak_fma_avx512(10000000, n_threads)
        elif code == 2:
            ops = cb_peak_int8_avx2(10000000, n_threads)
        elif code == 3:
            ops = cb_peak_bf16_avx512(10000000, n_threads)
        else:
            ops = cb_peak_vnni_avx512(10000000, n_threads)
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
