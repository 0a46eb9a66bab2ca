"""Routing: exact top-k selection and softmax weights, float (expf) and lookup-table modes,
against a float64 numpy reference, for 1..256 experts and k = 1..8."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import colibri
from colibri import _probes, _routing
from conftest import reference

# expf mode: float32 exponentials and sums against float64
EXACT_RTOL = 1e-5
EXACT_ATOL = 2e-6
# table mode: each exponential errs by at most LUT_DELTA (softmax_lut.h); a weight over n terms
# by at most (n + 1) * LUT_DELTA, plus float32 rounding
LUT_DELTA = _routing.LUT_DELTA

finite = st.floats(-1e4, 1e4, width=32, allow_nan=False, allow_infinity=False)
TINY = float(np.float32(1e-30))


@st.composite
def router_logits(draw):
    """Logit vectors with shape: wide values, clusters of equal and nearly equal values."""
    n = draw(st.integers(1, 256))
    kind = draw(st.sampled_from(["wide", "clustered", "tiny", "equal"]))
    if kind == "wide":
        x = draw(hnp.arrays(np.float32, n, elements=finite))
    elif kind == "clustered":  # many exact ties and near-ties
        base = draw(st.floats(-100, 100, width=32))
        steps = draw(hnp.arrays(np.int8, n, elements=st.integers(-3, 3)))
        x = (
            np.float32(base) + steps.astype(np.float32) * np.float32(draw(st.sampled_from([0.0, 1e-6, 1e-3, 0.5])))
        ).astype(np.float32)
    elif kind == "tiny":
        x = draw(hnp.arrays(np.float32, n, elements=st.floats(-TINY, TINY, width=32)))
    else:
        x = np.full(n, draw(finite), np.float32)
    k = draw(st.integers(1, min(n, 8)))
    return x, k


def reference_route(x, k, norm):
    order = np.argsort(-x.astype(np.float64), kind="stable")[:k]  # ties: lowest index first
    z = x.astype(np.float64)
    p = np.exp(z - z.max())
    p /= p.sum()
    w = p[order]
    return order, (w / w.sum() if norm else w)


@settings(max_examples=400, deadline=None)
@given(router_logits(), st.booleans())
def test_exact_mode_matches_reference(case, norm):
    x, k = case
    chosen, weights = _probes.kernel_route(x, k, norm, False)
    ref_chosen, ref_w = reference_route(x, k, norm)
    assert chosen.tolist() == ref_chosen.tolist()
    assert len(set(chosen.tolist())) == k
    np.testing.assert_allclose(weights, ref_w, rtol=EXACT_RTOL, atol=EXACT_ATOL)
    if norm:
        assert abs(float(weights.sum()) - 1.0) <= 1e-5


@settings(max_examples=400, deadline=None)
@given(router_logits(), st.booleans())
def test_table_mode_is_within_its_documented_bound(case, norm):
    x, k = case
    chosen, weights = _probes.kernel_route(x, k, norm, True)
    ref_chosen, ref_w = reference_route(x, k, norm)
    assert chosen.tolist() == ref_chosen.tolist()  # selection never uses the table
    assert len(set(chosen.tolist())) == k
    terms = k if norm else len(x)
    assert np.all(np.abs(weights - ref_w) <= (terms + 1) * LUT_DELTA + 1e-6)
    if norm:
        assert abs(float(weights.sum()) - 1.0) <= 1e-5
    assert np.all(np.diff(weights) <= 1e-7)  # descending, like the logits


@pytest.mark.parametrize("use_lut", [False, True])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_logits_are_refused(use_lut, bad):
    x = np.array([0.5, 1.0, bad, -2.0], np.float32)
    with pytest.raises(ValueError, match="not finite"):
        _probes.kernel_route(x, 2, True, use_lut)


def test_ties_go_to_the_lowest_index():
    chosen, weights = _probes.kernel_route(np.zeros(8, np.float32), 3, False)
    assert chosen.tolist() == [0, 1, 2]
    np.testing.assert_allclose(weights, [0.125] * 3, rtol=1e-6)
    x = np.array([1, 3, 2, 3, 3, 0], np.float32)
    assert _probes.kernel_route(x, 4, True)[0].tolist() == [1, 3, 4, 2]


def test_k_outside_range_is_refused():
    with pytest.raises(ValueError):
        _probes.kernel_route(np.zeros(4, np.float32), 5, True)
    with pytest.raises(ValueError):
        _probes.kernel_route(np.zeros(4, np.float32), 0, True)


@pytest.mark.parametrize("case", ["mixtral_a", "olmoe_a", "qwen2moe_b"])
def test_table_mode_runs_whole_models(converted, case):
    """The table changes only the weights of the chosen experts, slightly."""
    ids = reference(case)["input_ids"]
    exact = colibri.load(converted(case)).forward(ids)
    table = colibri.load(converted(case), exact_softmax=False).forward(ids)
    assert np.isfinite(table).all()
    assert 0 < np.abs(exact - table).max() <= 0.1 * np.abs(exact).max()


def test_cli_routing_flags(converted):
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(__import__("pathlib").Path(colibri.__file__).parent.parent))
    outs = {}
    for flag in ("--exact-softmax", "--softmax-lut"):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "colibri",
                "run",
                "--model-dir",
                str(converted("mixtral_a")),
                "--tokens",
                "1,2,3",
                "--max-new-tokens",
                "4",
                "--ids",
                flag,
                "--verbose",
            ],
            env=env,
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
        outs[flag] = [line for line in r.stderr.splitlines() if line.startswith("Routing:")]
    import re

    experts = {flag: [re.findall(r"expert_\d+", line) for line in lines] for flag, lines in outs.items()}
    assert experts["--exact-softmax"] and experts["--exact-softmax"] == experts["--softmax-lut"]  # same selection


# ---- the sigmoid router (GLM-4.5 / DeepSeek-V3) -----------------------------------------------------


def reference_route_sigmoid(x, bias, k, n_group, topk_group, norm, scaling):
    """transformers' Glm4MoeTopkRouter in float64 (ties: lowest group, lowest expert)."""
    score = 1.0 / (1.0 + np.exp(-x.astype(np.float64)))
    choice = score + (0.0 if bias is None else bias.astype(np.float64))
    per = len(x) // n_group
    groups = choice.reshape(n_group, per)
    worth = np.sort(groups, axis=1)[:, ::-1][:, :2].sum(axis=1)
    kept = np.argsort(-worth, kind="stable")[:topk_group]
    masked = np.full_like(choice, -np.inf)
    for g in kept:
        masked[g * per : (g + 1) * per] = choice[g * per : (g + 1) * per]
    order = np.argsort(-masked, kind="stable")[:k]
    w = score[order]
    if norm:
        w = w / (w.sum() + 1e-20)
    return order, w * scaling


@st.composite
def sigmoid_cases(draw):
    n_group = draw(st.sampled_from([1, 1, 2, 4, 8]))
    per = draw(st.integers(2, 16))
    n = n_group * per
    x = draw(hnp.arrays(np.float32, n, elements=st.floats(-8, 8, width=32)))
    bias = draw(st.one_of(st.none(), hnp.arrays(np.float32, n, elements=st.floats(-0.5, 0.5, width=32))))
    topk_group = draw(st.integers(1, n_group))
    k = draw(st.integers(1, min(8, topk_group * per)))
    return x, bias, k, n_group, topk_group, draw(st.booleans()), draw(st.sampled_from([1.0, 1.5, 2.5]))


def _well_separated(values, k):
    s = np.sort(values)[::-1]
    return len(s) <= k or s[k - 1] - s[k] > 1e-5


@settings(max_examples=400, deadline=None)
@given(sigmoid_cases())
def test_sigmoid_router_matches_transformers_rule(case):
    x, bias, k, n_group, topk_group, norm, scaling = case
    chosen, weights = _probes.kernel_route_sigmoid(x, bias, k, n_group, topk_group, norm, scaling)
    ref_chosen, ref_w = reference_route_sigmoid(x, bias, k, n_group, topk_group, norm, scaling)
    score = 1.0 / (1.0 + np.exp(-x.astype(np.float64))) + (0 if bias is None else bias)
    per = len(x) // n_group
    worth = np.sort(score.reshape(n_group, per), axis=1)[:, ::-1][:, :2].sum(axis=1)
    kept_groups = np.argsort(-worth, kind="stable")[:topk_group]
    candidates = score.reshape(n_group, per)[kept_groups].reshape(-1)  # the top-k is taken among these
    if not (_well_separated(worth, topk_group) and _well_separated(candidates, k)):
        return  # float32 and float64 may order a near-tie differently: both are right
    assert sorted(chosen.tolist()) == sorted(ref_chosen.tolist())
    by_expert = dict(zip(ref_chosen.tolist(), ref_w))
    np.testing.assert_allclose(weights, [by_expert[e] for e in chosen.tolist()], rtol=1e-5, atol=1e-6)
    assert len(set(chosen.tolist())) == k
    kept = {e // per for e in chosen.tolist()}
    assert len(kept) <= topk_group  # only from the chosen groups


def test_sigmoid_router_bias_chooses_but_never_weighs():
    x = np.array([2.0, 1.0, 0.0, -1.0], np.float32)
    bias = np.array([0.0, 0.0, 0.0, 2.0], np.float32)
    chosen, weights = _probes.kernel_route_sigmoid(x, bias, 2, 1, 1, False, 1.0)
    assert chosen.tolist() == [3, 0]  # 3 chosen by its bias ...
    np.testing.assert_allclose(
        weights, 1 / (1 + np.exp(-x[[3, 0]].astype(np.float64))), rtol=1e-6
    )  # ... unbiased weight


@pytest.mark.parametrize(
    "bad",
    [dict(k=0), dict(k=5), dict(n_group=3), dict(topk_group=3), dict(n_group=4, topk_group=1, k=2), dict(nan=True)],
)
def test_sigmoid_router_refuses(bad):
    x = np.linspace(-1, 1, 4).astype(np.float32)
    if bad.pop("nan", False):
        x[1] = np.nan
    args = dict(k=2, n_group=2, topk_group=2)
    args.update(bad)
    with pytest.raises(ValueError):
        _probes.kernel_route_sigmoid(x, None, args["k"], args["n_group"], args["topk_group"], True, 1.0)
