"""Shared test fixtures: the transformers fixture cases, converted once per session.

`converted(case, dtype[, layout])` converts tests/fixtures/<case>/hf into a temporary Colibri model
directory (cached for the session) and returns its path; `reference(case)` loads the reference
outputs that tools/make_fixtures.py wrote with transformers.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from colibri import _kernels

FIXTURES = Path(__file__).parent / "fixtures"
CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "reference.npz").is_file() and (p / "hf").is_dir())
ARCH_OF_CASE = {c: c.rsplit("_", 1)[0] for c in CASES}

F32_UNIT_ROUNDOFF = 2.0 ** -24


def float32_dot_bound(abs_dot, n_ops):
    """The error bound of a float32 dot product (Higham, Accuracy and Stability of Numerical
    Algorithms, 3.1): |computed - exact| <= gamma(n) * sum_i |w_i x_i|, gamma(n) = n u / (1 - n u),
    u = 2^-24, whatever the order of the sum (sequential, in SIMD lanes, in a tree), n = the
    roundings on the longest path from a product to the result: cols + 1 for a float dot of
    length cols (the products round too); at most that for the block formats (exact integer block
    sums, two roundings per block). A constant relative tolerance is not a bound: 1.0 plus n halves
    of its ulp sums to 1.0 in float32, a relative error of n * 2^-24 (hypothesis found n = 170)."""
    gamma = n_ops * F32_UNIT_ROUNDOFF / (1 - n_ops * F32_UNIT_ROUNDOFF)
    return gamma * abs_dot + 1e-30


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    from colibri.convert import convert

    cache = {}

    def get(case: str, dtype: str = "f32", layout: str | None = None) -> Path:
        """layout None: the converter's default layouts; "rows" / "transposed" / "interleaved"
        (int8/int4): every matrix but the embedding in that layout."""
        key = (case, dtype, layout)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{case}_{dtype}_{layout or 'default'}") / "model"
            convert(FIXTURES / case / "hf", out, quantize=dtype, log=lambda *a: None,
                    expert_layout=layout, layout=layout)
            cache[key] = out
        return cache[key]
    return get


@pytest.fixture(params=_kernels.available_isas())
def isa(request):
    """Run the test on every kernel tier this CPU has, then restore the default tier."""
    before = _kernels.isa()
    _kernels.select_isa(request.param)
    yield request.param
    _kernels.select_isa(before)


def reference(case: str) -> dict:
    with np.load(FIXTURES / case / "reference.npz") as z:
        return {k: z[k] for k in z.files}
