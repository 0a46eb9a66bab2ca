# cython: language_level=3
"""The kernel table of Colibri: the SIMD tier, chosen once at import, and the entry points to it.

Design
------
csrc/dispatch.h fills one kernel table (`cb_kt`) for a tier — scalar, avx2 or avx512 — from what
the CPU and OS support (COLIBRI_ISA forces one); this module owns that table and the f16 table,
and is the only module that compiles the kernels (the extern blocks below). Other modules (the
layer loop in _engine, the test and benchmark probes in _probes) include only csrc/api.h and call
the kernels through the entry points declared in _kernels.pxd, so selecting a tier changes every
kernel at once and nothing else, and no module carries a copy of the kernels. The code tables
of the formats, layouts and activations are defined here once, from the C enums.
"""

from libc.stdint cimport uintptr_t, uint8_t, uint16_t, int32_t, uint32_t, int64_t
from libc.stdlib cimport calloc

cdef extern from "dispatch.h" nogil:
    # the kernel table (its state: cb_kt, chosen at import), its drivers and the tiers
    int CB_ISA_SCALAR, CB_ISA_AVX2, CB_ISA_AVX512
    int CB_HAVE_AMX              # 1 where this build has the AMX step (x86-64, GCC or clang)
    ctypedef struct cb_cpu_features:
        int avx2, fma, f16c, avx512f, avx512bw, avx512vl, avx512dq
        int avx512_vnni, avx512_bf16, avx_vnni, amx_tile, amx_int8, amx_bf16, os_avx, os_avx512, os_amx
    ctypedef struct cb_selection:    # what filled the kernel table
        int isa
        int int_step
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
    int cb_search_bf16_order(int isa, int step)
    void cb_set_amx_granted(int granted)
    int *cb_int_step_failed_check  # [CB_INT_STEP_*]: the self-test check a step failed (0: none); it is off
    int cb_install_int_step(int step, const cb_int_kernels *k)   # the probes' test steps (int_step.h)
    int cb_int_step_kernels_of(int step, int isa, cb_int_kernels *k, int any)
    const cb_step_parts *cb_step_parts_of_kernels()
    int cb_int_step_installed(int step)
    int cb_amx_bf16_failed_check  # its bf16 products tile's failed check (0: none); that tile is off
    int cb_set_prefill_repack(int on)
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
    # kernels_scalar.h's element-wise kernels and conversions (every tier's)
    float cb_f16_to_f32_exact(uint16_t h)
    float cb_bf16_to_f32(uint16_t h)
    void cb_rmsnorm(float *out, const float *x, const float *weight, int n, float eps)
    void cb_add(float *acc, const float *x, int n)
    void cb_axpy(float *acc, float a, const float *x, int n)
    void cb_clip(float *x, float limit, int n)
    void cb_glu_clamped(float *gate, const float *up, int n, float alpha, float limit)
    void cb_scale(float *x, float a, int n)
    void cb_softcap(float *x, float cap, int n)
    void cb_rope(float *v, int n_heads, int head_dim, int rot_dim, const float *cos_t, const float *sin_t)
    int cb_all_finite(const float *x, int n)

    # the f16 table (state)
    void cb_init_tables()
    void cb_dequant_row(float *out, const void *w, int dtype, int layout, int row, int rows, int cols)

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


import os
import numpy as np

from colibri import names
from colibri._os import arena

cb_init_tables()

DTYPE_CODES = dict(zip(names.FORMATS, (CB_F32, CB_F16, CB_BF16, CB_INT8, CB_INT4, CB_MXFP4, CB_NL4, CB_INT6)))
LAYOUT_CODES = dict(zip(names.LAYOUTS, (CB_ROWS, CB_TRANSPOSED, CB_INTERLEAVED)))
# config.json's hidden_act, normalised; swiglu_clamped: gpt-oss's experts (swiglu_alpha, swiglu_limit)
ACT_CODES = {"silu": CB_ACT_SILU, "gelu_tanh": CB_ACT_GELU_TANH, "swiglu_clamped": CB_ACT_SWIGLU_CLAMPED}
# stored as blocks of 32 with a scale, multiplied against quantized activations
BLOCK_FORMATS = tuple(name for name, code in DTYPE_CODES.items()
                      if code in (CB_INT8, CB_INT4, CB_MXFP4, CB_NL4, CB_INT6))
# ... of which these also have the transposed layout (groups of 8 outputs), and these the interleaved one
GROUP_FORMATS = tuple(name for name, code in DTYPE_CODES.items() if code in (CB_INT8, CB_INT4))
INTERLEAVED_FORMATS = BLOCK_FORMATS + ("bf16",)      # bf16: cb_igroup_bf16, groups of 8 outputs x 4 inputs
# ... and these have no other layout (no rows kernels: quant.h)
INTERLEAVED_ONLY_FORMATS = tuple(name for name, code in DTYPE_CODES.items() if code in (CB_NL4, CB_INT6))
QBLOCK = CB_QBLOCK               # weights per block of the integer formats (quant.h)
NL4_OFFSET = CB_NL4_OFFSET       # nl4's codes are multiplied as value + 64 (quant.h)
NL4_SCALE_BIAS = CB_NL4_SCALE_BIAS   # a stored six-bit nl4 scale is sub + 32, sub in [-32, 31]
INT6_OFFSET = CB_INT6_OFFSET     # int6's codes are stored as code + 32, 0 .. 63 (quant.h)
NL4_SUB_MAX = CB_NL4_SUB_MAX     # nl4's quantizer keeps its six-bit scales in [-31, 31] (quantize_nl4.h)
TGROUP = CB_TGROUP               # outputs per group of the transposed and interleaved layouts

# ---- the SIMD tier, chosen once at import (COLIBRI_ISA forces one) ---------------------------

ISA_NAMES = {"scalar": CB_ISA_SCALAR, "avx2": CB_ISA_AVX2, "avx512": CB_ISA_AVX512}
KV_CODES = dict(zip(names.KV_CACHE_TYPES, (CB_KV_F32, CB_KV_F16, CB_KV_Q8)))     # the KV cache's element types


def cpu_features():
    """What this CPU and OS support: {feature name: bool} — the AVX ones where the OS saves their
    state too (os_avx, os_avx512), AMX's as the CPU has them (os_amx and the OS's loan decide
    whether they can run: amx_status)."""
    cdef cb_cpu_features f = cb_detect_cpu()
    return {"avx2": bool(f.avx2), "fma": bool(f.fma), "f16c": bool(f.f16c), "avx512f": bool(f.avx512f),
            "avx512bw": bool(f.avx512bw), "avx512vl": bool(f.avx512vl), "avx512dq": bool(f.avx512dq),
            "avx512_vnni": bool(f.avx512_vnni), "avx512_bf16": bool(f.avx512_bf16),
            "avx_vnni": bool(f.avx_vnni), "amx_tile": bool(f.amx_tile), "amx_int8": bool(f.amx_int8),
            "amx_bf16": bool(f.amx_bf16), "os_avx": bool(f.os_avx), "os_avx512": bool(f.os_avx512),
            "os_amx": bool(f.os_amx)}


# Whether this build has the AMX steps (x86-64: GCC/clang with an assembler that knows the tile
# instructions — kernels_amx.h, setup.py's probe — or MSVC, through the _tile_* intrinsics); the
# emulated one comes with them.
HAVE_AMX = bool(CB_HAVE_AMX)


def amx_bf16_failed_check():
    """The import-time self-test check the amx step's bf16 products tile failed (that tile is then
    off: bf16 prompts take vdpbf16ps; the int tiles stay on AMX), or 0."""
    return cb_amx_bf16_failed_check


def amx_status(features=None):
    """One line on AMX here: absent from the CPU, not enabled by the OS (XCR0), refused by it (why),
    or its tile state granted to this process (asked once, _os.request_tile_data) and whether the
    amx int step runs (it can fail its self-test, or another step be chosen). `features`:
    cpu_features()' dict (tests pass others)."""
    from colibri import _os
    f = cpu_features() if features is None else features
    if not f["amx_tile"]:
        return "no AMX on this CPU"
    kinds = "+".join(k for k in ("int8", "bf16") if f[f"amx_{k}"]) or "no products"
    if not f["os_amx"]:
        return f"AMX ({kinds}) on this CPU, but the OS does not enable its tile state (XCR0 bits 17-18)"
    granted, why = _os.request_tile_data()
    if not granted:
        return f"AMX ({kinds}) on this CPU, but the OS refused its tile state: {why}"
    if not CB_HAVE_AMX:
        return (f"AMX ({kinds}): tile state granted by the OS, but this build has no amx step (it needs a 64-bit "
                f"build: GCC or clang with an assembler that knows the tile instructions, or MSVC)")
    amx_check = failed_int_steps().get("amx")
    if amx_check:
        return (f"AMX ({kinds}): tile state granted by the OS, but the amx step failed its self-test "
                f"(check {amx_check}): the {int_step()} step runs")
    if not f["amx_int8"]:
        return f"AMX ({kinds}): tile state granted by the OS; no int8 products, so no step uses it"
    if cb_amx_bf16_failed_check:
        bf16 = (f"; its bf16 products tile failed its self-test (check {cb_amx_bf16_failed_check}) in every order: "
                f"bf16 prompts take vdpbf16ps")
    elif cb_amx_bf16_unit_order >= 0 and cb_amx_bf16_unit_order != cb_bf16_order:
        bf16 = (f"; bf16 products in order {bf16_order()}, not the tile unit's "
                f"({_BF16_ORDER_NAMES[cb_amx_bf16_unit_order]}): bf16 prompts off its tiles")
    elif cb_amx_bf16_unit_order > 0:
        bf16 = f"; bf16 products in the tile unit's order ({bf16_order()}), decode too"
    else:
        bf16 = ""
    return f"AMX ({kinds}): tile state granted by the OS; int step in use: {int_step()}{bf16}"


def _grant_amx():
    """Ask the OS for the tile state where this build has the amx step, the CPU AMX-INT8 and XCR0
    enables it, and tell the kernel table whether it was lent (the step needs it). Once, at import."""
    from colibri import _os
    f = cpu_features()
    if CB_HAVE_AMX and f["amx_tile"] and f["amx_int8"] and f["os_amx"]:
        cb_set_amx_granted(_os.request_tile_data()[0])


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


# How the transposed int8/int4 kernels (decode tiles, repacked prefill) multiply bytes (int_step.h,
# CB_INT_STEP_*): the scalar tier's C, AVX2 maddubs + madd, the VNNI step emulated in AVX2, AVX-VNNI,
# AVX512-VNNI, AVX512-VNNI with the interleaved prompts on AMX tiles (kernels_amx.h), and those tiles
# emulated in C. All give the same bits.
INT_STEPS = {"scalar": CB_INT_STEP_SCALAR, "avx2": CB_INT_STEP_AVX2, "vnni-emulated": CB_INT_STEP_VNNI_EMULATED,
             "avx-vnni": CB_INT_STEP_AVXVNNI, "avx512-vnni": CB_INT_STEP_AVX512VNNI,
             "amx-emulated": CB_INT_STEP_AMX_EMULATED, "amx": CB_INT_STEP_AMX}
# The steps that exist to test another's bits on CPUs without it: built and installed by the probes
# (colibri._probes.install_test_steps), never in a production run.
EMULATED_INT_STEPS = ("vnni-emulated", "amx-emulated")


def int_step():
    """The step of the transposed int8/int4 kernels in use (an INT_STEPS name)."""
    return {v: k for k, v in INT_STEPS.items()}[cb_selected.int_step]


def available_int_steps():
    """The INT_STEPS the current tier can run on this CPU, slowest first."""
    before = cb_selected.int_step
    steps = [name for name, step in INT_STEPS.items() if cb_set_int_step(step) == 0]
    cb_set_int_step(before)
    return steps


def failed_int_steps():
    """{INT_STEPS name: self-test check}: the steps the tiers' self-tests turned off (each failed
    where a slower step of its tier passed: dispatch.h, cb_self_test); empty where none."""
    return {name: cb_int_step_failed_check[step] for name, step in INT_STEPS.items()
            if cb_int_step_failed_check[step]}


def set_int_step(str name):
    """Use step `name` for the transposed int8/int4 kernels from now on (tests and benchmarks
    compare them; selecting a tier picks the fastest). ValueError if unknown or if this tier and
    CPU cannot run it."""
    if name not in INT_STEPS:
        raise ValueError(f"{name!r} is not an int step; choose one of {', '.join(INT_STEPS)}")
    if cb_set_int_step(INT_STEPS[name]) != 0:
        off = failed_int_steps().get(name)
        if name in EMULATED_INT_STEPS and not cb_int_step_installed(INT_STEPS[name]):
            raise ValueError(f"int step {name} is a test step: colibri._probes.install_test_steps() installs it")
        raise ValueError((f"int step {name} is off: it failed the import self-test (check {off})" if off else
                          f"int step {name} cannot run on tier {isa()} of this CPU")
                         + f"; available: {', '.join(available_int_steps())}")


# The orders of roundings of the interleaved bf16 products (kernels_scalar.h, cb_bf16_order):
# vdpbf16ps's sequence, or one of the split orders an AMX unit's TDPBF16PS may follow (the even and
# odd products of each 64 inputs summed apart, then joined to the lane: lane + (even + odd),
# (lane + even) + odd, (lane + odd) + even). The import self-test keeps "seq" unless the AMX tile
# passes only in a split order; decode and every bf16 products tile then follow it.
BF16_ORDERS = {cb_bf16_order_names[order].decode(): order for order in range(CB_BF16_SEQ, CB_BF16_ORDERS)}
_BF16_ORDER_NAMES = {code: name for name, code in BF16_ORDERS.items()}


def bf16_order():
    """The order of the interleaved bf16 products in use (a BF16_ORDERS name)."""
    return _BF16_ORDER_NAMES[cb_bf16_order]


def _bf16_order_code(str name):
    if name not in BF16_ORDERS:
        raise ValueError(f"{name!r} is not an order of bf16 products; choose one of {', '.join(BF16_ORDERS)}")
    return BF16_ORDERS[name]


def set_bf16_order(str name):
    """Use order `name` for the interleaved bf16 products from now on (tests run the split orders'
    kernels on any AVX512_BF16 CPU; the engine keeps what the import self-test chose; on an AMX host
    an order other than its unit's takes bf16 prompts off its tiles, keeping prompt = decode).
    ValueError if it is not one."""
    cb_set_bf16_order(_bf16_order_code(name))


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
    return {v: k for k, v in ISA_NAMES.items()}[cb_selected.isa]


def self_test(str name):
    """Run the known-answer self-test of tier `name` against the scalar spec (dispatch.h,
    cb_self_test: every format and layout through the drivers, attention, GLU; small enough to run
    at import). Returns None when it passes (the tier stays selected) or a message naming the
    failing check (the tier stays selected too: the caller picks another)."""
    code = cb_self_test(ISA_NAMES[name])
    if code == 0:
        return None
    if code < 0:
        return f"tier {name} cannot run on this CPU"
    return f"the {name} kernels disagree with the scalar spec (self-test check {code})"


def self_test_int_step(str step):
    """The self-test of the current tier with int step `step` (an INT_STEPS name; the AMX steps add
    a whole tile of tokens in each format they take): None when it passes, else the failing check's
    message. The selection is restored after."""
    before = cb_selected.int_step
    code = cb_self_test_step(cb_selected.isa, INT_STEPS[step])
    cb_set_int_step(before)
    if code == 0:
        return None
    return f"int step {step} cannot run here" if code < 0 else f"int step {step}: self-test check {code} failed"


def choose_tier(forced: str, available, test):
    """(tier, warning or None, error or None): the tier to run. forced (COLIBRI_ISA, "" for none)
    must pass `test` (a failure is an error: the user asked for it); otherwise the fastest of
    `available` (slowest first) that passes, the ones that failed named in one warning."""
    if forced:
        if forced not in ISA_NAMES:
            return None, None, f"COLIBRI_ISA={forced!r} is not a tier; choose one of {', '.join(ISA_NAMES)}"
        if forced not in available:
            return None, None, (f"COLIBRI_ISA={forced}: this CPU (or OS) does not support it; "
                                f"available: {', '.join(available)}")
        failure = test(forced)
        return (None, None, f"COLIBRI_ISA={forced}: {failure}") if failure else (forced, None, None)
    failed = []
    for name in sorted(available, key=ISA_NAMES.get, reverse=True):
        failure = test(name) if name != "scalar" else None        # the spec itself
        if failure is None:
            return name, (f"colibri: {'; '.join(failed)}; using the {name} tier" if failed else None), None
        failed.append(failure)
    return "scalar", None, None


def int_step_warnings():
    """The lines import warns with after the tier's self-test: each int step it turned off, and the
    AMX bf16 products tile where only that tile was."""
    failed = failed_int_steps()
    lines = [f"colibri: the {name} int step failed its self-test (check {check}); using the {int_step()} step"
             for name, check in failed.items()]
    if cb_amx_bf16_failed_check and "amx" not in failed:
        lines.append(f"colibri: the amx step's bf16 products tile failed its self-test (check "
                     f"{cb_amx_bf16_failed_check}); bf16 prompts take vdpbf16ps")
    return lines


def _select_at_import():
    """The tier at import: COLIBRI_ISA's, or the fastest that passes its self-test; then the int
    step COLIBRI_INT_STEP names, if set (e.g. COLIBRI_ISA=avx2 COLIBRI_INT_STEP=avx2: the kernels
    an AVX2-only CPU runs, on a newer CPU that also has AVX-VNNI). Returns the int step's error
    (the tier chosen is kept), or None; a tier that cannot be had raises ValueError."""
    import os
    import warnings
    _grant_amx()
    name, warning, error = choose_tier(os.environ.get("COLIBRI_ISA", "").strip().lower(), available_isas(),
                                       self_test)
    if warning:
        warnings.warn(warning, RuntimeWarning, stacklevel=2)
    if error:
        raise ValueError(error)
    select_isa(name)
    for line in int_step_warnings():
        warnings.warn(line, RuntimeWarning, stacklevel=2)
    step = os.environ.get("COLIBRI_INT_STEP", "").strip().lower()
    if step:
        try:
            set_int_step(step)
        except ValueError as e:   # the tier stays; its fastest step is in use; load reports this
            return f"COLIBRI_INT_STEP={step}: {e}"
    return None


try:
    ISA_ERROR = _select_at_import()
except ValueError as e:           # keep importable; loading a model reports the error
    select_isa(choose_tier("", available_isas(), self_test)[0])
    ISA_ERROR = str(e)


# ---- the entry points (declared in _kernels.pxd) --------------------------------------------

cdef void matmul_jobs(const cb_matjob *jobs, int count, int n_threads) noexcept nogil:
    """Several products in one parallel region (cb_matmul_jobs)."""
    cb_matmul_jobs(jobs, count, n_threads)


cdef void matmul(float *out, int ldo, const void *w, int dtype, int layout, const float *x, int ldx,
                 cb_act_q8 *acts, int n, int rows, int cols, int n_threads) noexcept nogil:
    """out[t * ldo + r] = W[r, :] . x[t * ldx + :] for t < n, r < rows (cb_matmul)."""
    cb_matmul(out, ldo, w, dtype, layout, x, ldx, acts, n, rows, cols, n_threads)


cdef void attention(float *out, int ldo, const float *q, int ldq, const void *k_cache, const void *v_cache,
                    float *scores, int n_heads, int n_kv_heads, int head_dim, int n_ctx, int n, int pos0,
                    int window, int ring, float scale, const float *sinks, int n_threads, int kv) noexcept nogil:
    """Causal attention of n queries at positions pos0.. over the cache (cb_attention) of kv
    (KV_CODES) elements; scores [n_heads, n_ctx + 1], sinks [n_heads] or NULL."""
    cb_attention(out, ldo, q, ldq, k_cache, v_cache, scores, n_heads, n_kv_heads, head_dim, n_ctx, n, pos0,
                 window, ring, scale, sinks, n_threads, kv)


cdef void kv_store(void *dst, const float *src, int n, int kv) noexcept nogil:
    """n floats into a cache row of kv (KV_CODES) elements (cb_kv_store)."""
    cb_kv_store(dst, src, n, kv)


cdef void glu(float *gate, const float *up, int n, int act) noexcept nogil:
    """gate[n] = act(gate) * up in place (cb_glu)."""
    cb_glu(gate, up, n, act)


cdef void dequant_row(float *out, const void *w, int dtype, int layout, int row, int rows, int cols) noexcept nogil:
    """Row `row` of a stored matrix as float32 [cols] (the embedding lookup)."""
    cb_dequant_row(out, w, dtype, layout, row, rows, cols)


cdef void quantize_act(cb_act_q8 *a, const float *x, int n) noexcept nogil:
    cb_quantize_act(a, x, n)


cdef void round_bf16(uint16_t *dst, const float *x, int n) noexcept nogil:
    """n activations rounded to bf16 as bf16 products take them (cb_kernel_table.round_bf16)."""
    cb_round_bf16(dst, x, n)


cdef int attention_softmax(float *x, int n) noexcept nogil:
    return cb_attention_softmax(x, n)


cdef int install_int_step(int step, const cb_int_kernels *k) noexcept nogil:
    return cb_install_int_step(step, k)


cdef int int_step_kernels(int step, cb_int_kernels *k) noexcept nogil:
    return cb_int_step_kernels_of(step, cb_selected.isa, k, 1)


cdef const cb_step_parts *step_parts() noexcept nogil:
    return cb_step_parts_of_kernels()


cdef int search_bf16_order(int step) noexcept nogil:
    return cb_search_bf16_order(cb_selected.isa, step)


# ---- activation quantization scratch ----------------------------------------------------------

cdef int attention_score_rows(int n_heads, int n_threads) noexcept nogil:
    return cb_attention_score_rows(n_heads, n_threads)


cdef void rmsnorm(float *out, const float *x, const float *weight, int n, float eps) noexcept nogil:
    cb_rmsnorm(out, x, weight, n, eps)


cdef void add(float *acc, const float *x, int n) noexcept nogil:
    cb_add(acc, x, n)


cdef void axpy(float *acc, float a, const float *x, int n) noexcept nogil:
    cb_axpy(acc, a, x, n)


cdef void clip(float *x, float limit, int n) noexcept nogil:
    cb_clip(x, limit, n)


cdef void glu_clamped(float *gate, const float *up, int n, float alpha, float limit) noexcept nogil:
    cb_glu_clamped(gate, up, n, alpha, limit)


cdef void scale(float *x, float a, int n) noexcept nogil:
    cb_scale(x, a, n)


cdef void softcap(float *x, float cap, int n) noexcept nogil:
    cb_softcap(x, cap, n)


cdef void rope(float *v, int n_heads, int head_dim, int rot_dim, const float *cos_t, const float *sin_t) noexcept nogil:
    cb_rope(v, n_heads, head_dim, rot_dim, cos_t, sin_t)


cdef bint all_finite(const float *x, int n) noexcept nogil:
    return cb_all_finite(x, n) != 0


cdef float f16_to_f32(uint16_t h) noexcept nogil:
    return cb_f16_to_f32_exact(h)


def act_specs(int rows, int cols, bint bf16_products=False):
    """{name: (shape, dtype)} of the arrays behind `rows` activation quantization scratches
    (cb_act_q8) of up to `cols` values: q int8 [rows, cols], d float32 and s int32 [rows, cols / 32
    + 1], nl4_off int32 [rows, 2 * (cols / 32 + 1)], and xp float32 [rows, cols], the reordered input of
    the AVX-512 rows and AVX2 interleaved bf16 tiles (CB_XP_*) — left out where no tier this CPU can run
    reads it (the drivers skip the reordering when xp is NULL; untouched, its pages cost nothing); with
    bf16_products, xb uint16 [rows, cols]: the activations rounded to bf16, which make the drivers
    take bf16 products (vdpbf16ps) wherever the tier has them."""
    blocks = cols // 32 + 1
    specs = {"q": ((rows, cols), np.int8), "d": ((rows, blocks), np.float32), "s": ((rows, blocks), np.int32),
             "nl4_off": ((rows, 2 * blocks), np.int32)}
    if "avx2" in available_isas():
        specs["xp"] = ((rows, cols), np.float32)
    if bf16_products:
        specs["xb"] = ((rows, cols), np.uint16)
    return specs


ACT_ARRAYS = ("q", "d", "s", "nl4_off", "xp", "xb")     # the order of act_arrays' list (bind_acts reads it)


def act_arrays(int rows, int cols, bint bf16_products=False):
    """[q, d, s, nl4_off, xp or None, xb or None]: the arrays of act_specs, zero-filled in one region from
    colibri._os."""
    a = arena(act_specs(rows, cols, bf16_products))
    return [a.get(name) for name in ACT_ARRAYS]


def has_bf16_products():
    """Whether the tier in use multiplies bf16 weights by bf16 activations (AVX512_BF16's
    vdpbf16ps): what load(bf16_products="auto") takes."""
    return bool(cb_has_bf16_products())


def bf16_products_on_amx():
    """Whether a prompt's bf16 products (interleaved) run on the AMX step's TDPBF16PS tile (or its
    emulation) with the int step in use, rather than on vdpbf16ps."""
    return bool(cb_amx_bf16_installed())


cdef cb_act_q8 *bind_acts(list arrays) except NULL:
    """A calloc'd cb_act_q8 [rows] (free() it) pointing into the arrays of act_arrays (ACT_ARRAYS
    order), which must outlive it."""
    q, d, s, nl4_off, xp, xb = arrays
    cdef int t, rows = q.shape[0]
    cdef cb_act_q8 *acts = <cb_act_q8 *>calloc(max(rows, 1), sizeof(cb_act_q8))
    if acts == NULL:
        raise MemoryError("cannot allocate the activation scratch")
    for t in range(rows):
        acts[t].q = <signed char *><uintptr_t>q[t].ctypes.data
        acts[t].d = <float *><uintptr_t>d[t].ctypes.data
        acts[t].s = <int32_t *><uintptr_t>s[t].ctypes.data
        acts[t].nl4_off = <int32_t *><uintptr_t>nl4_off[t].ctypes.data
        acts[t].n = 0
        acts[t].xp = NULL if xp is None else <float *><uintptr_t>xp[t].ctypes.data
        acts[t].xb = NULL if xb is None else <uint16_t *><uintptr_t>xb[t].ctypes.data
    return acts


def quantize_nl4(w, importance=None, int n_threads=0):
    """float32 [rows, cols] (cols % 32 == 0) -> uint8 [rows, cols / 32 * 18 + 4]: nl4's rows form
    (colibri.quant), its scales and codes chosen by csrc/quantize_nl4.h; importance float32 [cols]
    or None (the weights' own squares then weigh the error); n_threads 0: every CPU."""
    cdef const float[:, ::1] wv = np.ascontiguousarray(w, np.float32)
    cdef int rows = wv.shape[0], cols = wv.shape[1]
    if cols % 32:
        raise ValueError(f"nl4 needs a multiple of 32 columns, got {cols}")
    cdef const float[::1] iv
    cdef const float *ip = NULL
    if importance is not None:
        iv = np.ascontiguousarray(importance, np.float32)
        if iv.shape[0] != cols:
            raise ValueError(f"importance must be {cols} values, got {iv.shape[0]}")
        ip = &iv[0]
    out = np.zeros((rows, cols // 32 * 18 + 4), np.uint8)
    cdef uint8_t[:, ::1] ov = out
    if n_threads <= 0:
        n_threads = os.cpu_count() or 1
    if rows and cols:
        with nogil:
            cb_quantize_nl4(&ov[0, 0], &wv[0, 0], ip, rows, cols, n_threads)
    return out


def nl4_row_scales(w):
    """float32 [rows, cols] -> float32 [rows]: the f32 scale nl4 gives each row (quantize_nl4.h)."""
    a = np.abs(np.asarray(w, np.float32))
    amax = a.max(axis=1) if a.shape[1] else np.zeros(a.shape[0], np.float32)
    return np.array([cb_nl4_row_scale(v) for v in amax.tolist()], np.float32)


def nl4_search_halves(x, w, s, int n_threads=0):
    """Half-blocks x float32 [rows, 16] under row scales s float32 [rows], weighed by w float32 [16]
    -> (stored six-bit scales uint8 [rows], codes uint8 [rows, 16]): quantize_nl4.h's search of one
    half-block, for colibri.quant's error-compensating quantizer."""
    cdef const float[:, ::1] xv = np.ascontiguousarray(x, np.float32)
    cdef const float[::1] wv = np.ascontiguousarray(w, np.float32)
    cdef const float[::1] sv = np.ascontiguousarray(s, np.float32)
    cdef int rows = xv.shape[0]
    if xv.shape[1] != 16 or wv.shape[0] != 16 or sv.shape[0] != rows:
        raise ValueError(f"nl4_search_halves needs x [rows, 16], w [16], s [rows]; got {list(np.shape(x))}, "
                         f"{wv.shape[0]}, {sv.shape[0]}")
    sc = np.zeros(rows, np.uint8)
    codes = np.zeros((rows, 16), np.uint8)
    cdef uint8_t[::1] scv = sc
    cdef uint8_t[:, ::1] cv = codes
    if n_threads <= 0:
        n_threads = os.cpu_count() or 1
    if rows:
        with nogil:
            cb_nl4_search_halves(&scv[0], &cv[0, 0], &xv[0, 0], &wv[0], &sv[0], rows, n_threads)
    return sc, codes


def mask_logits(const float[::1] logits, const uint32_t[::1] bits, float[::1] out):
    """logits float32 [n], a grammar's bitmask uint32 [ceil(n / 32)] (bit i & 31 of word i >> 5:
    token i allowed) -> writes out float32 [n]: the logit where allowed, -inf elsewhere
    (token_mask.h)."""
    cdef int64_t n = logits.shape[0]
    if out.shape[0] != n or bits.shape[0] != (n + 31) // 32:
        raise ValueError(f"mask_logits needs logits [n], bits [ceil(n / 32)], out [n]; got {n}, "
                         f"{bits.shape[0]}, {out.shape[0]}")
    if n and &out[0] == &logits[0]:
        raise ValueError("mask_logits: out must not be logits")
    if n:
        with nogil:
            cb_mask_logits(&logits[0], &bits[0], &out[0], n)
