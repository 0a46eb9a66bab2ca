"""The C kernels against numpy (float64 references), property-based over shapes and values."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from colibri import _kernels
from colibri.modeldir import from_storage, to_storage

# matvec: |ours - exact| <= MATVEC_RTOL * sum_i |w_i x_i| (float32 accumulation over <= 512 terms)
MATVEC_RTOL = 1e-5
# routing weights: float32 softmax against float64
ROUTE_ATOL = 2e-6
RMSNORM_RTOL = 2e-6


def test_f16_table_matches_numpy_for_every_bit_pattern():
    bits = np.arange(65536, dtype=np.uint16)
    ours = np.array([_kernels.kernel_f16_to_f32(int(b)) for b in bits], np.float32)
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


@settings(max_examples=60, deadline=None)
@given(matvec_case(), st.sampled_from(["f32", "f16", "bf16"]), st.sampled_from([1, 2]))
def test_matvec_matches_numpy(case, dtype, threads):
    w, x = case
    stored = to_storage(w, dtype)
    exact_w = from_storage(stored, dtype).astype(np.float64)
    ours = _kernels.kernel_matvec(stored, x, dtype, threads)
    ref = exact_w @ x.astype(np.float64)
    bound = MATVEC_RTOL * (np.abs(exact_w) @ np.abs(x.astype(np.float64))) + 1e-30
    assert np.all(np.abs(ours - ref) <= bound)


def test_matvec_large_enough_to_use_threads():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((512, 256), dtype=np.float32)
    x = rng.standard_normal(256, dtype=np.float32)
    one = _kernels.kernel_matvec(w, x, "f32", 1)
    two = _kernels.kernel_matvec(w, x, "f32", 2)
    np.testing.assert_array_equal(one, two)
    np.testing.assert_allclose(one, w.astype(np.float64) @ x, rtol=0, atol=1e-4)


logit_vectors = st.integers(1, 64).flatmap(
    lambda n: hnp.arrays(np.float32, n, elements=st.floats(-1e4, 1e4, width=32, allow_nan=False)))


@settings(max_examples=200, deadline=None)
@given(logit_vectors, st.data(), st.booleans())
def test_route_is_exact_top_k_with_reference_weights(logits, data, norm):
    n = len(logits)
    k = data.draw(st.integers(1, min(n, 8)))
    chosen, weights = _kernels.kernel_route(logits, k, norm)
    # exactly the reference top-k on the logits, ties to the lowest index, never a duplicate
    ref_order = np.argsort(-logits.astype(np.float64), kind="stable")[:k]
    assert chosen.tolist() == ref_order.tolist()
    assert len(set(chosen.tolist())) == k
    z = logits.astype(np.float64)
    p = np.exp(z - z.max())
    p /= p.sum()
    ref_w = p[ref_order]
    if norm:
        ref_w = ref_w / ref_w.sum()
        assert abs(weights.sum() - 1.0) <= 1e-5
    np.testing.assert_allclose(weights, ref_w, rtol=1e-5, atol=ROUTE_ATOL)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_route_refuses_non_finite_logits(bad):
    logits = np.array([0.5, bad, 1.0, -2.0], np.float32)
    with pytest.raises(ValueError, match="not finite"):
        _kernels.kernel_route(logits, 2, True)


def test_route_ties_go_to_the_lowest_index():
    chosen, weights = _kernels.kernel_route(np.zeros(8, np.float32), 3, False)
    assert chosen.tolist() == [0, 1, 2]
    np.testing.assert_allclose(weights, [0.125] * 3, rtol=1e-6)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 200).flatmap(lambda n: hnp.arrays(np.float32, n, elements=st.floats(-1e3, 1e3, width=32))),
       st.booleans(), st.sampled_from([1e-5, 1e-6]))
def test_rmsnorm_matches_numpy(x, with_weight, eps):
    weight = (np.linspace(-2, 2, len(x)).astype(np.float32) if with_weight else None)
    ours = _kernels.kernel_rmsnorm(x, weight, eps)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt(np.mean(x64 * x64) + eps)
    if with_weight:
        ref = ref * weight
    np.testing.assert_allclose(ours, ref, rtol=RMSNORM_RTOL, atol=1e-6)
