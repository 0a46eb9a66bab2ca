"""The C kernels against numpy (float64 references), property-based over shapes and values."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import colibri
from colibri import _kernels, _probes, quant
from colibri.modeldir import from_storage, to_storage
from conftest import float32_dot_bound

# whole-model logits of a SIMD tier against the scalar tier: max |diff| <= TIER_RTOL * max |logit|.
# Float formats differ only by summation order. Integer formats compute exact integer block dot
# products in every tier, but the float sum over blocks differs in order (~1e-7), and the next
# matvec re-quantizes its input to int8: a value sitting on a rounding boundary moves one level,
# a difference of up to a few 1e-3 of the logit scale (measured 2.4e-3 on mixtral_a int4).
TIER_RTOL = 1e-5
INT_TIER_RTOL = 1e-2
FLOAT_DTYPES = ("f32", "f16", "bf16")
BLOCK_DTYPES = ("int8", "int4", "mxfp4")
ISAS = _kernels.available_isas()


RMSNORM_RTOL = 2e-6
# the FFN activation of a SIMD tier (polynomial exp) against the scalar tier (libm expf / tanhf):
# |simd - scalar| <= GLU_RTOL * |scalar| + GLU_ATOL * |gate * up| (the tanh GELU's 1 + tanh(u)
# cancels where u << 0: the scalar form is off there by ~1e-7 |x|, the sigmoid form is not)
GLU_RTOL = 1e-6
GLU_ATOL = 2e-7


def test_f16_table_matches_numpy_for_every_bit_pattern():
    bits = np.arange(65536, dtype=np.uint16)
    ours = np.array([_probes.kernel_f16_to_f32(int(b)) for b in bits], np.float32)
    ref = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(ours), nan)
    assert np.array_equal(ours[~nan].view(np.uint32), ref[~nan].view(np.uint32))


finite32 = st.floats(-4.0, 4.0, width=32, allow_nan=False)


@st.composite
def matvec_case(draw):
    rows = draw(st.integers(1, 40))
    cols = draw(st.integers(1, 300))
    w = draw(hnp.arrays(np.float32, (rows, cols), elements=finite32))
    x = draw(hnp.arrays(np.float32, cols, elements=finite32))
    return w, x


def _quantize_act(x):
    """numpy mirror of cb_quantize_act_scalar: per block of 32, d = amax / 127, q = rint(x / d);
    blocks with amax < 1e-30 are zero."""
    b = x.reshape(-1, 32)
    amax = np.abs(b).max(axis=1)
    d = np.where(amax >= np.float32(1e-30), amax / np.float32(127), 0).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint(b * inv[:, None]).astype(np.float64)
    return (q * d[:, None].astype(np.float64)).reshape(-1)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.integers(0, 12).flatmap(
        lambda nb: hnp.arrays(
            np.float32,
            32 * nb,
            elements=st.floats(-1e6, 1e6, width=32) | st.sampled_from([0.0, 1e-35, -1e-38, 0.5, -2.5]),
        )
    )
)
def test_activation_quantization_is_the_scalar_one_bit_for_bit(isa, x):
    """Every tier quantizes activations to exactly the bytes and scales of the scalar reference
    (numpy mirror: d = amax / 127, q = rint(x * (1 / d)), tiny blocks zero), ties and signed
    zeros included; and each block's sum of q (what unsigned weights take off) and -64 times the
    sums of its halves (nl4's offsets)."""
    q, d, sums, nl4_off = _probes.kernel_quantize_act(x)
    b = x.reshape(-1, 32)
    amax = np.abs(b).max(axis=1) if len(b) else np.zeros(0, np.float32)
    ref_d = np.where(amax >= np.float32(1e-30), amax / np.float32(127), 0).astype(np.float32)
    inv = np.where(ref_d > 0, np.float32(1) / np.where(ref_d > 0, ref_d, 1), 0).astype(np.float32)
    ref_q = np.rint((b * inv[:, None]).astype(np.float32)).astype(np.int8).reshape(-1)
    np.testing.assert_array_equal(d, ref_d)
    np.testing.assert_array_equal(q, ref_q)
    np.testing.assert_array_equal(sums, ref_q.reshape(-1, 32).astype(np.int64).sum(axis=1))
    halves = ref_q.reshape(-1, 2, 16).astype(np.int64).sum(axis=2)
    np.testing.assert_array_equal(nl4_off, -quant.NL4_OFFSET * halves)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(matvec_case(), st.sampled_from(FLOAT_DTYPES), st.sampled_from([1, 2]))
def test_float_matvec_matches_numpy(isa, case, dtype, threads):
    w, x = case
    stored = to_storage(w, dtype)
    exact_w = from_storage(stored, dtype).astype(np.float64)
    ours = _probes.kernel_matvec(stored, x, dtype, threads)
    ref = exact_w @ x.astype(np.float64)
    bound = float32_dot_bound(np.abs(exact_w) @ np.abs(x.astype(np.float64)), w.shape[1] + 1)
    assert np.all(np.abs(ours - ref) <= bound)


@st.composite
def block_matvec_case(draw):
    rows = draw(st.integers(1, 40))
    cols = 32 * draw(st.integers(1, 12))
    w = draw(hnp.arrays(np.float32, (rows, cols), elements=finite32))
    x = draw(hnp.arrays(np.float32, cols, elements=finite32))
    return w, x


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(block_matvec_case(), st.sampled_from(BLOCK_DTYPES), st.sampled_from([1, 2]))
def test_block_matvec_matches_numpy(isa, case, dtype, threads):
    """int8/int4 weights times activations quantized per block: the exact integer result."""
    w, x = case
    stored = quant.quantize(w, dtype)
    exact_w = quant.dequantize(stored, dtype, w.shape[1]).astype(np.float64)
    xq = _quantize_act(x)
    ours = _probes.kernel_matvec(stored, x, dtype, threads)
    ref = exact_w @ xq
    bound = float32_dot_bound(np.abs(exact_w) @ np.abs(xq), w.shape[1] + 1)
    assert np.all(np.abs(ours - ref) <= bound)


@pytest.mark.parametrize("dtype", BLOCK_DTYPES)
def test_block_formats_need_whole_blocks(dtype):
    with pytest.raises(ValueError, match="multiple of 32"):
        _probes.kernel_matvec(np.zeros((2, 34), np.uint8), np.zeros(40, np.float32), dtype)


def test_block_struct_sizes_agree_with_python():
    assert _probes.block_sizes() == quant.BLOCK_BYTES == {"int8": 34, "int4": 18, "mxfp4": 17, "int6": 26}


@settings(max_examples=60, deadline=None)
@given(block_matvec_case(), st.sampled_from(("int8", "int4")))
def test_quantize_round_trip_error_is_bounded(case, dtype):
    w, _ = case
    stored = quant.quantize(w, dtype)
    assert stored.shape == (w.shape[0], w.shape[1] // 32 * quant.BLOCK_BYTES[dtype])
    back = quant.dequantize(stored, dtype, w.shape[1]).astype(np.float64)
    blocks = stored.view(quant.BLOCK_DTYPES[dtype]).reshape(w.shape[0], -1)
    scale = np.abs(blocks["d"].view(np.float16).astype(np.float64))[..., None]  # [rows, nblocks, 1]
    amax = np.abs(w.astype(np.float64)).reshape(w.shape[0], -1, 32).max(axis=2, keepdims=True)
    levels = 127 if dtype == "int8" else 8
    # the stored scale never shrinks below amax / levels (no clipping of the largest weight;
    # blocks whose scale underflows float32 are all but zero) and is at most one f16 step above it
    assert np.all((scale * levels >= amax * (1 - 1e-6)) | (amax < 1e-30))
    assert np.all(scale <= amax / levels * (1 + 2**-10) + 2**-24)
    err = np.abs(back - w).reshape(w.shape[0], -1, 32)
    step = scale * (0.5 if dtype == "int8" else 1.0)  # see colibri/quant.py
    assert np.all(err <= step * (1 + 1e-6) + 1e-30)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + BLOCK_DTYPES)
def test_dequant_row_matches_python(dtype):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((5, 64)).astype(np.float32)
    stored = to_storage(w, dtype)
    ref = from_storage(stored, dtype, 64)
    for row in range(5):
        np.testing.assert_array_equal(_probes.kernel_dequant_row(stored, row, 64, dtype), ref[row])


@pytest.mark.parametrize("dtype", ["f32", "bf16", "int8", "int4"])
def test_whole_model_agrees_across_tiers(converted, dtype):
    from conftest import reference

    ids = reference("mixtral_a")["input_ids"]
    before = _kernels.isa()
    try:
        results = {}
        for name in ISAS:
            _kernels.select_isa(name)
            results[name] = colibri.load(converted("mixtral_a", dtype), bf16_products="f32").forward(ids)
    finally:
        _kernels.select_isa(before)
    scale = np.abs(results["scalar"]).max()
    tol = INT_TIER_RTOL if dtype in BLOCK_DTYPES else TIER_RTOL
    for name, logits in results.items():
        assert np.abs(logits - results["scalar"]).max() <= tol * scale, name
        assert (logits.argmax(-1) == results["scalar"].argmax(-1)).mean() >= 0.95, name


def test_forcing_a_tier_the_cpu_lacks_is_a_clear_error():
    with pytest.raises(ValueError, match="not a tier"):
        _kernels.select_isa("avx1024")


def test_matvec_large_enough_to_use_threads():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((1024, 1024), dtype=np.float32)  # past CB_PARALLEL_MIN_WORK
    x = rng.standard_normal(1024, dtype=np.float32)
    one = _probes.kernel_matvec(w, x, "f32", 1)
    two = _probes.kernel_matvec(w, x, "f32", 2)
    np.testing.assert_array_equal(one, two)
    np.testing.assert_allclose(one, w.astype(np.float64) @ x, rtol=0, atol=1e-3)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 200).flatmap(lambda n: hnp.arrays(np.float32, n, elements=st.floats(-1e3, 1e3, width=32))),
    st.booleans(),
    st.sampled_from([1e-5, 1e-6]),
)
def test_rmsnorm_matches_numpy(x, with_weight, eps):
    weight = np.linspace(-2, 2, len(x)).astype(np.float32) if with_weight else None
    ours = _probes.kernel_rmsnorm(x, weight, eps)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt(np.mean(x64 * x64) + eps)
    if with_weight:
        ref = ref * weight
    np.testing.assert_allclose(ours, ref, rtol=RMSNORM_RTOL, atol=1e-6)


def test_peak_loops_count_their_operations():
    """The peak loops bench_kernels.py prints next to the prefill figures: operations counted as
    iterations x chains x lanes x 2, and a clear error for an unknown kind."""
    avx512 = "avx512" in _kernels.available_isas()
    runs = {
        "fma": "avx2" in _kernels.available_isas(),
        "int8": "avx2" in _kernels.available_isas(),
        "fma512": avx512,
        "bf16": avx512 and _kernels.cpu_features()["avx512_bf16"],
        "vnni512": avx512 and _kernels.cpu_features()["avx512_vnni"],
    }
    assert set(runs) == set(_probes.PEAKS)
    for kind, per_iter in (
        ("fma", 10 * 8 * 2),
        ("int8", 10 * 32 * 2),
        ("fma512", 10 * 16 * 2),
        ("bf16", 10 * 32 * 2),
        ("vnni512", 10 * 64 * 2),
    ):
        got = _probes.bench_peak(kind, 1)
        if not runs[kind]:
            assert got is None
            continue
        ops, seconds = got
        assert seconds > 0 and ops % per_iter == 0 and ops > 0
    with pytest.raises(ValueError, match="kind"):
        _probes.bench_peak("avx", 1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 70), st.sampled_from(["silu", "gelu_tanh"]), st.integers(0, 2**32 - 1))
def test_glu_of_every_tier_agrees_with_the_scalar_one(isa, n, act, seed):
    """act(gate) * up: gates across the float range the activations see (|x| up to 100, where
    SiLU/GELU saturate and exp is clamped), lengths that are not multiples of 8 (the tail)."""
    if isa == "scalar":
        pytest.skip("the reference itself")
    rng = np.random.default_rng(seed)
    gate = (rng.standard_normal(n) * rng.choice([0.1, 3.0, 40.0], n)).astype(np.float32)
    gate[: n // 10] = rng.choice([-100.0, -87.5, 0.0, 88.5, 100.0], n // 10)
    up = rng.uniform(-4, 4, n).astype(np.float32)
    ours = _probes.kernel_glu(gate, up, act)
    before = _kernels.isa()
    _kernels.select_isa("scalar")
    try:
        ref = _probes.kernel_glu(gate, up, act)
    finally:
        _kernels.select_isa(before)
    assert np.all(np.isfinite(ours))
    assert np.all(np.abs(ours - ref) <= GLU_RTOL * np.abs(ref) + GLU_ATOL * np.abs(gate * up))
    # an element's bits do not depend on where the call starts (threads apply it to their rows)
    for start in (1, 3, n // 2):
        np.testing.assert_array_equal(_probes.kernel_glu(gate[start:], up[start:], act), ours[start:])


def _vpdpbusd(acc, u, s):
    """The instruction's definition (Intel SDM, VPDPBUSD): each int32 lane of acc plus the 4
    products of its unsigned bytes of u and signed bytes of s, without saturation (wraps mod 2^32)."""
    prods = u.astype(np.int64).reshape(8, 4) * s.astype(np.int64).reshape(8, 4)
    return ((acc.astype(np.int64) + prods.sum(axis=1) + 2**31) % 2**32 - 2**31).astype(np.int32)


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.int32, 8), hnp.arrays(np.uint8, 32), hnp.arrays(np.int8, 32))
def test_emulated_vnni_step_is_the_instruction(acc, u, s):
    """The AVX2 stand-in for vpdpbusd that tests the VNNI prefill body on CPUs without VNNI: exactly
    the instruction's result, extremes (255 * -128, int32 wrap-around) included."""
    if "avx2" not in _kernels.available_isas():
        pytest.skip("no AVX2")
    before = _kernels.isa()
    _kernels.select_isa("avx2")
    try:
        np.testing.assert_array_equal(_probes.kernel_dpbusd_emulated(acc, u, s), _vpdpbusd(acc, u, s))
        extremes = (np.full(32, 255, np.uint8), np.full(32, -128, np.int8))
        np.testing.assert_array_equal(_probes.kernel_dpbusd_emulated(acc, *extremes), _vpdpbusd(acc, *extremes))
    finally:
        _kernels.select_isa(before)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(hnp.arrays(np.float32, st.integers(1, 300), elements=st.floats(-200, 200, width=32)))
def test_attention_softmax_matches_float64(isa, x):
    """The tier's attention softmax (AVX2: a polynomial exp, 8 lanes) against float64: each
    probability within 4 ulp, plus the rounding of x - max in float32 (half an ulp of |x - max|,
    which exp turns into that relative error), plus the float32 summation bound of the normaliser
    (gamma(n)); scores far below the largest (exp underflow) at most the smallest normal float."""
    got = _probes.kernel_attention_softmax(x)
    z = x.astype(np.float64) - x.max()
    ref = np.exp(z) / np.exp(z).sum()
    rel = 4 * 2.0**-24 + np.abs(z) * 2.0**-24 + float32_dot_bound(np.ones(1), len(x))[0]
    bound = ref * rel + np.finfo(np.float32).tiny
    assert np.all(np.abs(got - ref) <= bound)


def test_attention_softmax_of_non_finite_scores_is_refused(isa):
    assert _probes.kernel_attention_softmax(np.array([0.0, np.nan, 1.0] * 5, np.float32)) is None
    assert _probes.kernel_attention_softmax(np.array([np.inf] + [0.0] * 9, np.float32)) is None


@pytest.mark.skipif("avx512" not in _kernels.available_isas(), reason="this CPU has no AVX-512 tier")
@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 300), elements=st.floats(-200, 200, width=32)))
def test_the_avx512_softmax_gives_the_avx2_bits(x):
    """The AVX-512 tier's attention softmax (16-lane exp, the sum in the AVX2 loop's 8-lane chains
    and order) is the AVX2 one bit for bit at every length (64-element steps in 8 chains, then
    16-element steps, an 8-element step, the scalar tail), and refuses a NaN or an infinity
    wherever it is."""
    before, got = _kernels.isa(), {}
    try:
        for tier in ("avx2", "avx512"):
            _kernels.select_isa(tier)
            got[tier] = _probes.kernel_attention_softmax(x)
            for where in {0, len(x) // 2, len(x) - 1}:
                for bad in (np.nan, np.inf):
                    y = x.copy()
                    y[where] = bad
                    assert _probes.kernel_attention_softmax(y) is None, (tier, where, bad)
    finally:
        _kernels.select_isa(before)
    np.testing.assert_array_equal(got["avx512"], got["avx2"])


@st.composite
def attention_case(draw):
    """(q [heads, hd], k, v [ring, kv * hd], kv heads, start, pos): query heads per KV head 1..9
    (the kernel takes 4 at a time), head_dim a multiple of 8 or not, positions wrapping the ring and
    crossing the AVX2 value pass's blocks (2 KB of rows: 8 rows at head_dim 64, 4 at 128 and 256)."""
    kv, group = draw(st.integers(1, 3)), draw(st.integers(1, 9))
    hd = draw(st.sampled_from([8, 12, 16, 24, 64, 128, 256]))
    ring = draw(st.integers(1, 80))
    n = draw(st.integers(1, ring))  # positions attended
    start = draw(st.integers(0, 100))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((kv * group, hd), dtype=np.float32)
    k = rng.standard_normal((ring, kv * hd), dtype=np.float32)
    v = rng.standard_normal((ring, kv * hd), dtype=np.float32)
    # attention sinks (gpt-oss) on some: logits from far below to far above the scores
    sinks = rng.uniform(-6, 6, kv * group).astype(np.float32) if draw(st.booleans()) else None
    return q, k, v, kv, start, start + n - 1, sinks


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(attention_case(), st.sampled_from([1, 2]))
def test_attention_matches_numpy(isa, case, threads):
    """Grouped-query attention of one query (transformers' repeat_kv: head h reads KV head
    h // group) over a ring buffer, against float64: within a bound of float32 sums of the scores'
    and outputs' length, on every tier and thread count. With sinks, head h's sink logit joins
    the softmax (transformers' eager_attention_forward for gpt-oss) and takes no value."""
    q, k, v, kv, start, pos, sinks = case
    heads, hd = q.shape
    got = _probes.kernel_attention(q, k, v, kv, start, pos, threads, sinks)
    rows = [p % k.shape[0] for p in range(start, pos + 1)]
    for h in range(heads):
        kh = k[rows, (h // (heads // kv)) * hd :][:, :hd].astype(np.float64)
        vh = v[rows, (h // (heads // kv)) * hd :][:, :hd].astype(np.float64)
        s = kh @ q[h].astype(np.float64) / np.sqrt(hd)
        both = s if sinks is None else np.append(s, sinks[h])
        p = np.exp(s - both.max())
        p /= np.exp(both - both.max()).sum()
        ref = p @ vh
        # scores err <= gamma(hd) * |k||q| / sqrt(hd) moves p by about that much relatively
        s_err = float32_dot_bound(np.abs(kh) @ np.abs(q[h].astype(np.float64)), hd + 1) / np.sqrt(hd)
        p_rel = 2 * s_err.max() + 8 * 2.0**-24 + float32_dot_bound(np.ones(1), len(rows))[0]
        bound = p_rel * (p @ np.abs(vh)) + float32_dot_bound(p @ np.abs(vh), len(rows) + 1)
        assert np.all(np.abs(got[h] - ref) <= bound), h


@st.composite
def prompt_attention_case(draw):
    """A prompt's queries (n of them, across the 8-query blocks) at positions pos0.., full
    attention over n_ctx = pos0 + n rows or a sliding window over a ring of window + n - 1 rows;
    head_dim a multiple of 8 or not (and of 16 or not: the AVX-512 value pass's 16-column vectors
    and its last 8 columns; 8 to 512 in the AVX-512 key blocks of 16 KB, 4 to 512 rows; 520 past
    them), groups of 1..9 query heads per KV head."""
    kv, group = draw(st.integers(1, 2)), draw(st.integers(1, 9))
    hd = draw(st.sampled_from([8, 12, 24, 40, 64, 80, 128, 256, 512, 520]))
    n = draw(st.integers(1, 20))
    pos0 = draw(st.integers(0, 60))
    window = draw(st.sampled_from([0, 0, 1, 5, 17]))
    ring = pos0 + n if window == 0 else max(window + n - 1, 1)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((n, kv * group, hd), dtype=np.float32)
    k = rng.standard_normal((kv, ring, hd), dtype=np.float32)
    v = rng.standard_normal((kv, ring, hd), dtype=np.float32)
    sinks = rng.uniform(-6, 6, kv * group).astype(np.float32) if draw(st.booleans()) else None
    return q, k, v, kv, pos0, window, sinks, draw(st.sampled_from(["f32", "f16", "q8"]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt_attention_case(), st.sampled_from([1, 2]))
def test_a_prompts_attention_is_decoding_each_query_bit_for_bit(isa, case, threads):
    """cb_attention over n queries (blocks of 8 with the cache rows shared, threads taking the
    (head group, block) pairs) gives each query exactly the bits of attending it alone, as decode
    does: with sliding windows, sinks, both cache types and every tier."""
    q, k, v, kv, pos0, window, sinks, kvt = case
    n, heads, hd = q.shape
    ring = k.shape[1]
    got = _probes.kernel_attention_prompt(q, k, v, kv, pos0, window, threads, sinks, kvt)
    rows = np.arange(ring)
    for t in range(n):
        pos = pos0 + t
        start = max(pos - window + 1, 0) if window else 0
        # kernel_attention's [ring, kv * hd] form of the same cache, position p in row p % ring
        flat_k, flat_v = (np.ascontiguousarray(a.transpose(1, 0, 2)).reshape(ring, kv * hd) for a in (k, v))
        one = _probes.kernel_attention(q[t], flat_k[rows], flat_v[rows], kv, start, pos, threads, sinks, kvt)
        np.testing.assert_array_equal(got[t], one, err_msg=f"query {t} at {pos}")


@pytest.mark.skipif("avx512" not in _kernels.available_isas(), reason="this CPU has no AVX-512 tier")
@settings(max_examples=100, deadline=None)
@given(prompt_attention_case(), st.sampled_from([1, 2]))
def test_the_avx512_attention_gives_the_avx2_bits(case, threads):
    """The AVX-512 tier's attention (512-bit vectors: key row pairs per vector, a prompt's key
    blocks converted once into pairs and its scores gathered by transposing adds, 16-column value
    vectors) sums each score in the AVX2 tier's hadd-tree order and adds each output's positions
    in the same order: a prompt's and the last query's decode give the AVX2 tier's bits."""
    q, k, v, kv, pos0, window, sinks, kvt = case
    n, heads, hd = q.shape
    ring = k.shape[1]
    flat_k, flat_v = (np.ascontiguousarray(a.transpose(1, 0, 2)).reshape(ring, kv * hd) for a in (k, v))
    pos = pos0 + n - 1
    start = max(pos - window + 1, 0) if window else 0
    before, got = _kernels.isa(), {}
    try:
        for tier in ("avx2", "avx512"):
            _kernels.select_isa(tier)
            got[tier] = (
                _probes.kernel_attention_prompt(q, k, v, kv, pos0, window, threads, sinks, kvt),
                _probes.kernel_attention(q[-1], flat_k, flat_v, kv, start, pos, threads, sinks, kvt),
            )
    finally:
        _kernels.select_isa(before)
    np.testing.assert_array_equal(got["avx512"][0], got["avx2"][0], err_msg="prompt")
    np.testing.assert_array_equal(got["avx512"][1], got["avx2"][1], err_msg="decode")


def test_attention_takes_caches_in_the_engine_order(isa):
    """kernel_attention on caches already [n_kv_heads, ring, head_dim] (what bench_attention times)
    gives the bits of the [ring, n_kv_heads * head_dim] form; bench_attention refuses other shapes."""
    rng = np.random.default_rng(7)
    kv, hd, ring = 2, 64, 37
    q = rng.standard_normal((6, hd), dtype=np.float32)
    k = rng.standard_normal((ring, kv * hd), dtype=np.float32)
    v = rng.standard_normal((ring, kv * hd), dtype=np.float32)
    engine_order = [np.ascontiguousarray(a.reshape(ring, kv, hd).transpose(1, 0, 2)) for a in (k, v)]
    np.testing.assert_array_equal(
        _probes.kernel_attention(q, *engine_order, kv, 30, 60, 2), _probes.kernel_attention(q, k, v, kv, 30, 60, 2)
    )
    with pytest.raises(ValueError, match="engine-order caches"):
        _probes.kernel_attention(q, engine_order[0], engine_order[1][:, :-1], kv, 0, 3)
    layers = np.stack([engine_order[0]] * 2)
    assert _probes.bench_attention(q, layers, layers, ring - 1, 1, 1) > 0
    with pytest.raises(ValueError, match="bench_attention"):
        _probes.bench_attention(q, layers, layers, ring, 1, 1)


@pytest.mark.parametrize("tier", list(_kernels.ISA_NAMES))
def test_every_tier_this_cpu_lacks_is_reported(tier):
    """Every test parametrised by the `isa` fixture runs on the tiers this CPU has; a tier it lacks
    is skipped here by name, with the CPU features it would need, so a missing AVX-512 run shows
    in the summary (pytest -rs) instead of passing silently. On a tier it has: the tier selects,
    its int steps are listed, and the scalar spec is among the tiers."""
    features = _kernels.cpu_features()
    if tier not in _kernels.available_isas():
        have = ", ".join(name for name, on in features.items() if on) or "none"
        pytest.skip(f"tier {tier} not run: this CPU/OS lacks it (features: {have})")
    before = _kernels.isa()
    try:
        _kernels.select_isa(tier)
        assert _kernels.isa() == tier and _kernels.int_step() in _kernels.available_int_steps()
    finally:
        _kernels.select_isa(before)
    assert "scalar" in _kernels.available_isas()


def test_the_self_test_passes_on_every_tier_and_keeps_it(isa):
    """The import-time known-answer test (dispatch.h cb_self_test: every format and layout,
    attention with and without sinks, both GLUs, against the scalar spec) passes here on every
    tier the CPU has, and leaves that tier selected."""
    assert _kernels.self_test(isa) is None
    assert _kernels.isa() == isa


def test_every_int_step_passes_the_self_test(isa):
    """Each int step the tier has here passes the import-time self-test (the AMX steps with a
    whole tile of 16 tokens and one more in int8, int4, int6 and mxfp4, against the AVX512-VNNI
    step's bits), and the step in use stays selected."""
    before = _kernels.int_step()
    for step in _kernels.available_int_steps():
        assert _kernels.self_test_int_step(step) is None, step
        assert _kernels.int_step() == before
    if "amx" not in _kernels.available_int_steps():
        assert _kernels.self_test_int_step("amx") == "int step amx cannot run here"


def test_an_int_step_that_fails_the_self_test_is_turned_off(isa):
    """The tier's self-test as import runs it, with int steps made to miscompute: where the fastest
    steps fail and a slower one passes, they are turned off (each named, with its check, in
    import's warnings; set_int_step names the check too) and the tier kept with the slower step;
    where the tier's slowest step fails too, the tier's own code is at fault: the self-test fails
    and no step is left off. A later self-test starts afresh."""
    steps = [s for s in _kernels.available_int_steps() if s not in _kernels.EMULATED_INT_STEPS]
    if len(steps) < 2:
        pytest.skip(f"tier {isa} has one int step here ({steps[0]})")
    int_step_lines = lambda: [line for line in _kernels.int_step_warnings() if " int step " in line]
    try:
        for k in range(1, len(steps)):  # the fastest k steps fail
            faulty = steps[-k:]
            _probes.set_faulty_int_steps(faulty)
            assert _kernels.self_test(isa) is None, faulty
            assert _kernels.isa() == isa and _kernels.int_step() == steps[-k - 1]
            failed = _kernels.failed_int_steps()
            assert sorted(failed) == sorted(faulty) and all(check > 0 for check in failed.values())
            assert not set(faulty) & set(_kernels.available_int_steps())
            for name in faulty:
                assert (
                    f"colibri: the {name} int step failed its self-test (check {failed[name]}); "
                    f"using the {steps[-k - 1]} step"
                ) in int_step_lines()
            with pytest.raises(
                ValueError,
                match=f"int step {faulty[0]} is off: it failed the import self-test \\(check {failed[faulty[0]]}\\)",
            ):
                _kernels.set_int_step(faulty[0])
        _probes.set_faulty_int_steps(steps)  # every step: the tier's fault
        message = _kernels.self_test(isa)
        assert message is not None and "disagree with the scalar spec" in message
        assert _kernels.failed_int_steps() == {}
        _probes.set_faulty_int_steps([steps[0]])  # only the slowest: the fastest runs
        assert _kernels.self_test(isa) is None and _kernels.int_step() == steps[-1]
        assert _kernels.failed_int_steps() == {} and int_step_lines() == []
    finally:
        _probes.set_faulty_int_steps([])
        assert _kernels.self_test(isa) is None
    assert _kernels.failed_int_steps() == {} and _kernels.int_step() == steps[-1]
    with pytest.raises(ValueError, match="list of int steps"):
        _probes.set_faulty_int_steps(steps[-1])
    with pytest.raises(ValueError, match="can be made faulty"):
        _probes.set_faulty_int_steps(["scalar"])


def test_a_lower_tiers_self_test_keeps_what_a_higher_one_found():
    """A tier's self-test tests its own steps afresh and leaves alone what an earlier one found of
    the steps it does not have, and the order of bf16 products: the AVX2 tier's test does not turn
    the AVX-512 tier's failed VNNI step back on (nor the AMX step that takes it as its reference)."""
    if "avx512" not in _kernels.available_isas():
        pytest.skip("no AVX-512 tier here")
    before, order_before = _kernels.isa(), _kernels.bf16_order()
    try:
        _kernels.select_isa("avx512")
        steps = [s for s in _kernels.available_int_steps() if s not in _kernels.EMULATED_INT_STEPS]
        if "avx512-vnni" not in steps:
            pytest.skip("no AVX512-VNNI step here")
        at = steps.index("avx512-vnni")
        faulty, fallback = steps[at:], steps[at - 1]
        _probes.set_faulty_int_steps(faulty)
        assert _kernels.self_test("avx512") is None and _kernels.int_step() == fallback
        _probes.set_faulty_int_steps([])  # the fault gone: only the self-test's marks keep them off
        _kernels.set_bf16_order("split-odd")
        assert _kernels.self_test("avx2") is None and _kernels.isa() == "avx2"
        assert sorted(_kernels.failed_int_steps()) == sorted(faulty)
        _kernels.select_isa("avx512")
        assert _kernels.int_step() == fallback and _kernels.bf16_order() == "split-odd"
        _kernels.set_bf16_order("seq")
        assert _kernels.self_test("avx512") is None  # its own steps afresh
        assert _kernels.failed_int_steps() == {} and _kernels.int_step() == steps[-1]
    finally:
        _probes.set_faulty_int_steps([])
        _kernels.set_bf16_order("seq")
        assert _kernels.self_test("avx512") is None
        _kernels.set_bf16_order(order_before)
        _kernels.select_isa(before)


def test_a_tier_that_fails_its_self_test_is_not_used():
    """choose_tier: the fastest tier that passes, the failures named in one warning; a forced tier
    (COLIBRI_ISA) that fails, is unknown or unavailable is an error naming it."""
    tiers = ["scalar", "avx2", "avx512"]
    broken = {"avx512": "the avx512 kernels disagree with the scalar spec (self-test check 7)"}
    name, warning, error = _kernels.choose_tier("", tiers, broken.get)
    assert (name, error) == ("avx2", None) and "check 7" in warning and "using the avx2 tier" in warning
    assert _kernels.choose_tier("", tiers, lambda n: None) == ("avx512", None, None)
    assert _kernels.choose_tier("", tiers, lambda n: "bad")[0] == "scalar"  # the spec is never tested
    assert _kernels.choose_tier("avx2", tiers, broken.get) == ("avx2", None, None)
    name, _, error = _kernels.choose_tier("avx512", tiers, broken.get)
    assert name is None and error.startswith("COLIBRI_ISA=avx512: ") and "check 7" in error
    assert "not a tier" in _kernels.choose_tier("avx1024", tiers, broken.get)[2]
    assert "does not support it" in _kernels.choose_tier("avx512", ["scalar", "avx2"], broken.get)[2]


def test_a_production_run_holds_no_test_step():
    """The test steps (csrc/test_steps.h) are built in the probes, not in the kernel module: a
    process that imports only the kernels offers none of them; installed (as this session's conftest
    does) they are offered where the tier can run them, and removed they are gone again, the step in
    use kept or, where it was one of them, the tier's fastest."""
    probe = "from colibri import _kernels as k; print(' '.join(k.available_int_steps()))"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert r.stdout.split() and not set(r.stdout.split()) & set(_kernels.EMULATED_INT_STEPS)
    if _kernels.isa() == "scalar":
        pytest.skip("the scalar tier has no test step")
    before = _kernels.int_step()
    try:
        _kernels.set_int_step("vnni-emulated")
        _probes.remove_test_steps()
        assert not set(_kernels.available_int_steps()) & set(_kernels.EMULATED_INT_STEPS)
        assert _kernels.int_step() == _kernels.available_int_steps()[-1]
        with pytest.raises(ValueError, match="vnni-emulated is a test step"):
            _kernels.set_int_step("vnni-emulated")
    finally:
        assert "vnni-emulated" in _probes.install_test_steps()
        _kernels.set_int_step(before)
    assert "vnni-emulated" in _kernels.available_int_steps()


def test_colibri_int_step_forces_the_step_at_import():
    """COLIBRI_INT_STEP chooses the step after the tier (COLIBRI_ISA=avx2 COLIBRI_INT_STEP=avx2: what
    an AVX2-only host runs); a test step, which a production run's registry does not hold (the
    probes build and install it), and an unknown step are errors that name the variable (kept for
    load to raise), the tier's fastest step in use."""
    if "avx2" not in _kernels.available_isas():
        pytest.skip("this CPU has no AVX2 tier")
    probe = "from colibri import _kernels as k; print(k.isa(), k.int_step(), k.ISA_ERROR)"
    env = dict(os.environ, COLIBRI_ISA="avx2", COLIBRI_INT_STEP="vnni-emulated")
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert (
        r.stdout.startswith("avx2 ")
        and "COLIBRI_INT_STEP=vnni-emulated: int step vnni-emulated is a test step" in r.stdout
    )
    assert "vnni-emulated" not in r.stdout.split()[1]
    env["COLIBRI_INT_STEP"] = "avx2"
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert r.stdout.split() == ["avx2", "avx2", "None"]
    env["COLIBRI_INT_STEP"] = "avx9000-vnni"
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert "COLIBRI_INT_STEP=avx9000-vnni" in r.stdout and "not an int step" in r.stdout


# ---- the f16 KV cache (load(kv_cache="f16")) -------------------------------------------------


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    hnp.arrays(
        np.float32,
        st.integers(1, 67),
        elements=st.one_of(
            st.floats(width=32, allow_nan=False),
            st.floats(-(2.0**-13), 2.0**-13, width=32),
            st.floats(-70000.0, 70000.0, width=32),
            st.sampled_from([np.inf, -np.inf, 65504.0, 65520.0, 65519.996, 2.0**-25, 2.0**-24, 3 * 2.0**-26, -0.0]).map(
                np.float32
            ),
        ),
    )
)
def test_the_f16_cache_store_rounds_as_numpy(isa, x):
    """cb_kv_store (F16C on the AVX2 and AVX-512 tiers, the scalar spec elsewhere): round to nearest
    even, overflow to infinity, subnormals kept — numpy's astype(float16) bit for bit."""
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(_probes.kernel_kv_store(x), want)


def test_the_f16_cache_store_keeps_nan():
    x = np.array([np.nan, -np.nan, 1.0], np.float32)
    got = _probes.kernel_kv_store(x).view(np.float16)
    assert np.isnan(got[:2]).all() and got[2] == 1.0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.sampled_from([8, 16, 24, 64, 128]),
    st.sampled_from([(4, 1), (8, 2), (6, 3), (8, 8)]),
    st.integers(1, 70),
    st.integers(0, 2**31 - 1),
    st.booleans(),
)
def test_attention_over_an_f16_cache_is_attention_over_its_values(isa, head_dim, heads, positions, seed, sinks):
    """Reading f16 keys and values converts them exactly: the result equals f32 attention over
    the same (f16-rounded) cache, bit for bit, on every tier."""
    n_heads, n_kv = heads
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n_heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((n_kv, positions, head_dim)).astype(np.float16)
    v = rng.standard_normal((n_kv, positions, head_dim)).astype(np.float16)
    s = rng.standard_normal(n_heads).astype(np.float32) if sinks else None
    start = positions // 3
    ours = _probes.kernel_attention(q, k, v, n_kv, start, positions - 1, sinks=s, kv="f16")
    theirs = _probes.kernel_attention(
        q, k.astype(np.float32), v.astype(np.float32), n_kv, start, positions - 1, sinks=s
    )
    np.testing.assert_array_equal(ours, theirs)


# ---- the q8 KV cache (load(kv_cache="q8")) ---------------------------------------------------


def _q8_rows(x):
    """numpy mirror of cb_kv_store_q8 on rows x [..., head_dim] -> (scale [...], codes int8 [..., head_dim])."""
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        amax = np.abs(x).max(-1)
        amax = np.where(np.isnan(x).any(-1), np.float32(np.nan), amax).astype(np.float32)
        d = (amax / np.float32(127)).astype(np.float32)
        ok = (d > 0) & np.isfinite(d)
        codes = np.where(ok[..., None], np.rint(x / np.where(ok, d, 1)[..., None]), 0)
    return d, np.clip(codes, -127, 127).astype(np.int8)


def _q8_values(d, codes):
    with np.errstate(invalid="ignore"):  # 0 x inf: a non-finite row reads back as NaN
        return (codes.astype(np.float32) * d[..., None]).astype(np.float32)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    hnp.arrays(
        np.float32,
        st.integers(1, 67),
        elements=st.one_of(
            st.floats(-(2.0**100), 2.0**100, width=32),
            st.floats(-(2.0**-100), 2.0**-100, width=32),
            st.just(np.float32(0.0)),
            st.floats(width=32, allow_nan=False).filter(lambda f: abs(f) < 2.0**-120),
        ),
    )
)
def test_the_q8_cache_store_is_its_numpy_mirror(isa, x):
    """cb_kv_store for q8 (the same code on every tier): the row's f32 scale max|x| / 127, then the
    codes round(x / scale) to nearest even — an all-zero row has scale 0 and codes 0; every value
    is within half a step (and a rounding) of its dequantized one where the scale is a normal
    float, and within 127 smallest normals where it is not (a row below 1.5e-36: no real key)."""
    got = _probes.kernel_kv_store(x, "q8")
    d, codes = _q8_rows(x)
    assert got.shape == (4 + x.shape[0],)
    assert got[:4].view(np.float32)[0] == d
    np.testing.assert_array_equal(got[4:].view(np.int8), codes)
    back = _q8_values(d, codes).astype(np.float64)
    step = np.float64(d) if d >= np.finfo(np.float32).tiny else 254 * np.float64(np.finfo(np.float32).tiny)
    assert np.all(np.abs(back - x) <= 0.5 * step * (1 + 1e-6) + np.abs(back) * 2.0**-23 + 2.0**-149)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_q8_row_with_nan_or_infinity_reads_back_as_nan(bad):
    """Non-finite keys stay visible: the row's scale is NaN or infinite, its codes 0, so every
    value reads back as NaN (0 x inf) and the engine's finiteness check fails as with f32."""
    x = np.array([1.0, bad, -2.0], np.float32)
    got = _probes.kernel_kv_store(x, "q8")
    assert not np.isfinite(got[:4].view(np.float32)[0]) and not got[4:].any()
    assert np.isnan(_q8_values(got[:4].view(np.float32), got[4:].view(np.int8)[None])).all()


def _q8_attention(q, k, v, start, pos, sinks):
    """numpy mirror of q8 attention (cb_attend_head): q [n_heads, hd], caches [n_kv, ring, hd]
    float32 holding position p in row p (ring > pos) as the engine would store them. Scores to the
    bit (integer sums of codes, then two float32 roundings); the softmax's exponentials in float64;
    the values in groups of 32 positions from multiples of 32, each weight exp(s - max s) x its
    row's scale coded as an int16, round(w x 32767 / the group's largest), the integer sums times
    largest / 32767; the output divided by the exponentials' sum at the end."""
    n_heads, hd = q.shape
    n_kv = k.shape[0]
    scale = np.float32(1.0 / np.float64(np.sqrt(np.float32(hd))))
    qd, qc = _q8_rows(q)
    kd, kc = _q8_rows(k[:, start : pos + 1])
    vd, vc = _q8_rows(v[:, start : pos + 1])
    out = np.zeros((n_heads, hd))
    for h in range(n_heads):
        g = h // (n_heads // n_kv)
        sums = kc[g].astype(np.int64) @ qc[h].astype(np.int64)
        assert np.abs(sums).max(initial=0) < 2**24
        scores = (sums.astype(np.float32) * kd[g]).astype(np.float32) * np.float32(qd[h] * scale)
        logits = scores.astype(np.float64)
        if sinks is not None:
            logits = np.append(logits, np.float64(sinks[h]))
        p = np.exp(logits - logits.max())
        w = p[: pos - start + 1].astype(np.float32) * vd[g]
        for g0 in range(start - start % 32, pos + 1, 32):
            span = slice(max(g0, start) - start, min(g0 + 32, pos + 1) - start)
            wmax = w[span].max()
            if wmax < np.float32(2.0**-100):  # a group that small adds nothing
                continue
            gs, inv = np.float32(wmax / np.float32(32767)), np.float32(np.float32(32767) / wmax)
            wq = np.minimum(np.rint((w[span] * inv).astype(np.float32)), 32767).astype(np.int64)
            out[h] += (wq[:, None] * vc[g][span]).sum(0).astype(np.float32).astype(np.float64) * np.float64(gs)
        out[h] /= p.sum()
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.sampled_from([8, 12, 16, 24, 40, 48, 56, 64, 96, 128, 136, 200]),
    st.sampled_from([(4, 1), (8, 2), (6, 3), (8, 8), (8, 1), (16, 2), (7, 1), (18, 2)]),
    st.integers(1, 70),
    st.integers(0, 2**31 - 1),
    st.booleans(),
)
def test_attention_over_a_q8_cache_works_on_the_codes(isa, head_dim, heads, positions, seed, sinks):
    """q8 attention: the query head quantized as a row is stored, each score the exact integer sum
    of code products times the key row's scale, then the query's scale x 1/sqrt(head_dim); the
    values in groups of 32 positions with int16 weights. Equal to the numpy mirror up to the
    softmax's float32 rounding (a weight's code may move by one), on every tier (decode's units of
    1-8 heads; spans starting inside a group; head_dim a multiple of 64, 32, 16, 8 or none of
    them, 48 = 32 + 16, 56 = 32 + 16 + 8, 96 = 64 + 32: the integer kernels' tails)."""
    n_heads, n_kv = heads
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((n_heads, head_dim)) * rng.uniform(0.1, 4, (n_heads, 1))).astype(np.float32)
    k = (rng.standard_normal((n_kv, positions, head_dim)) * rng.uniform(0.1, 10, (n_kv, positions, 1))).astype(
        np.float32
    )
    v = rng.standard_normal((n_kv, positions, head_dim)).astype(np.float32)
    s = rng.standard_normal(n_heads).astype(np.float32) if sinks else None
    start = positions // 3
    ours = _probes.kernel_attention(q, k, v, n_kv, start, positions - 1, sinks=s, kv="q8")
    theirs = _q8_attention(q, k, v, start, positions - 1, s)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.abs(theirs).max())


def test_q8_attention_is_not_f32_attention_over_the_dequantized_rows():
    """The mirror above is what the kernels compute and not the f32 attention over dequantized
    keys (the first q8 cache's contract): with a query whose codes round coarsely, the two differ
    by far more than the test's tolerance, so the test above can tell them apart."""
    rng = np.random.default_rng(3)
    hd, n = 64, 40
    q = rng.standard_normal((2, hd)).astype(np.float32) * np.float32(3)
    q[:, 0] = 40  # one large element: the others round to few codes
    k = rng.standard_normal((1, n, hd)).astype(np.float32) * np.float32(4)
    v = rng.standard_normal((1, n, hd)).astype(np.float32)
    ours = _probes.kernel_attention(q, k, v, 1, 0, n - 1, kv="q8")
    theirs = _q8_attention(q, k, v, 0, n - 1, None)
    dequantized = _probes.kernel_attention(q, _q8_values(*_q8_rows(k)), _q8_values(*_q8_rows(v)), 1, 0, n - 1)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.abs(theirs).max())
    assert np.abs(ours - dequantized).max() > 1e-2 * np.abs(dequantized).max()


# ---- bf16 products (load(bf16_products=): AVX512_BF16's vdpbf16ps) ---------------------------

BF16_PRODUCTS_TIER = "avx512" if "avx512" in ISAS and _kernels.cpu_features()["avx512_bf16"] else None
needs_bf16_products = pytest.mark.skipif(
    BF16_PRODUCTS_TIER is None, reason="this CPU has no AVX512_BF16 (vdpbf16ps): bf16 products run only where it does"
)


def _round_bf16(x):
    """numpy mirror of vcvtneps2bf16: round to nearest even, denormal inputs to signed zero, NaN
    quieted; uint16 bits."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    denormal = (bits & 0x7F800000) == 0
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = np.where(denormal, ((bits >> 16) & 0x8000).astype(np.uint16), rounded)
    return np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded).astype(np.uint16)


def _bf16_values(bits):
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    hnp.arrays(
        np.uint32,
        st.integers(1, 70),
        elements=st.one_of(
            st.integers(0, 2**32 - 1),
            st.sampled_from(
                [
                    0x3F808000,
                    0x3F818000,
                    0x3F80FFFF,
                    0x7F7FFFFF,
                    0x7F800000,
                    0x7FC00001,
                    0x7F800001,
                    0x00000001,
                    0x807FFFFF,
                    0x80000000,
                ]
            ),
        ),
    )
)
def test_the_bf16_rounding_is_vcvtneps2bf16s(isa, bits):
    """Every tier rounds activations to bf16 as the instruction does (ties to even, denormals to
    zero, NaN kept a NaN): the scalar spec and the AVX-512 vector code bit for bit."""
    x = bits.view(np.float32)
    got, want = _probes.kernel_round_bf16(x), _round_bf16(x)
    nan = np.isnan(_bf16_values(want))
    np.testing.assert_array_equal(np.isnan(_bf16_values(got)), nan)
    np.testing.assert_array_equal(got[~nan], want[~nan])


@needs_bf16_products
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 300), st.integers(1, 9), st.sampled_from([1, 2]), st.integers(0, 2**31 - 1))
def test_bf16_products_are_the_rounded_activations_times_the_weights(rows, cols, n, threads, seed):
    """vdpbf16ps: each product of a bf16 weight and the bf16-rounded activation is exact, the f32
    sums within summation-order error of the float64 result; every token of a prefill gives the
    bits of decoding it alone (the tile's order does not depend on its shape); tails of any width."""
    rng = np.random.default_rng(seed)
    w = to_storage(rng.uniform(-4, 4, (rows, cols)).astype(np.float32), "bf16")
    x = rng.uniform(-4, 4, (n, cols)).astype(np.float32)
    before = _kernels.isa()
    try:
        _kernels.select_isa(BF16_PRODUCTS_TIER)
        assert _kernels.has_bf16_products()
        got = _probes.kernel_matmul(w, x, "bf16", threads, bf16_products=True)
        alone = np.stack(
            [_probes.kernel_matmul(w, x[t : t + 1], "bf16", threads, bf16_products=True)[0] for t in range(n)]
        )
    finally:
        _kernels.select_isa(before)
    wf = from_storage(w, "bf16").astype(np.float64)
    xr = _bf16_values(_round_bf16(x)).astype(np.float64)
    ref = xr @ wf.T
    bound = float32_dot_bound(np.abs(xr) @ np.abs(wf.T), cols + 1)
    assert np.all(np.abs(got - ref) <= bound)
    np.testing.assert_array_equal(alone, got)


def test_a_tier_without_bf16_products_multiplies_exactly():
    """Where the tier has no vdpbf16ps (avx2, scalar), a model's bf16 activations are ignored: the
    exact f32 products, bit for bit those of bf16_products=False."""
    rng = np.random.default_rng(1)
    w = to_storage(rng.standard_normal((24, 100)).astype(np.float32), "bf16")
    x = rng.standard_normal((5, 100)).astype(np.float32)
    before = _kernels.isa()
    try:
        for name in [t for t in ISAS if t != BF16_PRODUCTS_TIER]:
            _kernels.select_isa(name)
            assert not _kernels.has_bf16_products()
            np.testing.assert_array_equal(
                _probes.kernel_matmul(w, x, "bf16", bf16_products=True), _probes.kernel_matmul(w, x, "bf16")
            )
    finally:
        _kernels.select_isa(before)
