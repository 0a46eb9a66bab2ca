"""Sampling: greedy, penalties, temperature, top_k / top_p / min_p, draws and logprobs against slow,
obviously-correct numpy references (full sorts, Python loops, float64)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colibri import ColibriError
from colibri.sampling import MAX_LOGPROBS, Pick, Sampler

# the empirical distribution of DRAWS seeded draws is within TV_BOUND (total variation) of the
# reference; the expected TV for 20 categories and 20,000 draws is about 0.012
DRAWS = 20_000
TV_BOUND = 0.03
# survivors' probabilities: the same float64 operations as the reference, up to the final sum
PROB_RTOL = 1e-12
# logprobs: float64 log_softmax of float32 logits, summed in another order
LOGPROB_ATOL = 1e-9
# penalties: the amount in float64, the result rounded to float32 (half an ulp)
F32_EPS = float(np.finfo(np.float32).eps)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def logit_vectors(draw, max_n=300, min_n=1):
    """float32 logits with shape: wide, peaked, flat (many ties), a few levels, -inf masks."""
    n = draw(st.integers(min_n, max_n))
    kind = draw(st.sampled_from(["normal", "peaked", "levels", "flat", "masked"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "normal":
        x = rng.standard_normal(n) * draw(st.sampled_from([0.1, 1.0, 5.0, 30.0]))
    elif kind == "peaked":
        x = rng.standard_normal(n)
        x[rng.integers(n)] += 12.0
    elif kind == "levels":
        x = rng.integers(0, 4, n) * 0.5
    elif kind == "flat":
        x = np.full(n, 1.25)
    else:
        x = rng.standard_normal(n) * 3
        x[rng.random(n) < 0.5] = -np.inf
        x[rng.integers(n)] = 0.5  # at least one finite
    return (x + draw(st.sampled_from([0.0, -100.0, 40.0]))).astype(np.float32)


temperatures = st.sampled_from([0.05, 0.3, 0.7, 1.0, 2.5])
top_ks = st.one_of(st.just(0), st.integers(1, 12), st.integers(1, 400))
top_ps = st.one_of(st.just(1.0), st.floats(0.01, 1.0), st.sampled_from([0.5, 0.9, 0.95, 0.999999]))
min_ps = st.one_of(st.just(0.0), st.floats(0.0, 1.0), st.sampled_from([0.05, 0.1, 1.0]))


def ranking(x):
    """Full sort: penalised logit descending, ties by lower id."""
    return sorted(range(len(x)), key=lambda i: (-float(x[i]), i))


def reference_distribution(x, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """The module's definition, step by step, with a full sort and a Python loop for top_p."""
    n = len(x)
    lmax = float(np.max(x))
    e = np.exp((x.astype(np.float64) - lmax) / temperature)  # over the vocabulary
    kept = ranking(x)
    if 0 < top_k < n:
        kept = kept[:top_k]
    if top_p < 1.0:
        s = e[sorted(kept)].sum()  # summed in id order
        mass, prefix = 0.0, []
        for i in kept:
            prefix.append(i)
            mass += e[i] / s
            if mass >= top_p:
                break
        kept = prefix
    if min_p > 0.0:
        kept = [i for i in kept if e[i] >= min_p]  # p / p_max >= min_p
    kept = sorted(i for i in kept if e[i] > 0)
    w = e[kept]
    return np.array(kept, np.int64), w / w.sum()


def log_softmax64(x):
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def one_hot(n, token, value=100.0):
    x = np.zeros(n, np.float32)
    x[token] = value
    return x


# ---- greedy -------------------------------------------------------------------------------


@SETTINGS
@given(logit_vectors())
def test_greedy_is_argmax_with_ties_to_the_lowest_id(x):
    s = Sampler()
    token = s(x)
    assert token == ranking(x)[0]
    assert token == int(np.flatnonzero(x == x.max())[0])
    state = s.rng.bit_generator.state
    assert s.pick(x) == Pick(token)
    assert s.rng.bit_generator.state == state  # greedy does not draw


@SETTINGS
@given(logit_vectors(), temperatures, top_ps, min_ps, st.integers(0, 1000))
def test_top_k_one_is_greedy_at_any_temperature(x, t, top_p, min_p, seed):
    s = Sampler(temperature=t, top_k=1, top_p=top_p, min_p=min_p, seed=seed)
    assert [s(x) for _ in range(3)] == [Sampler()(x)] * 3


# ---- truncation: survivors against the reference ------------------------------------------


@SETTINGS
@given(logit_vectors(), temperatures, top_ks, top_ps, min_ps, st.integers(0, 2**32 - 1))
def test_survivors_and_draws_match_the_full_sort_reference(x, t, k, top_p, min_p, seed):
    s = Sampler(temperature=t, top_k=k, top_p=top_p, min_p=min_p, seed=seed)
    ids, p = s.distribution(x)
    ref_ids, ref_p = reference_distribution(x, t, k, top_p, min_p)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(p, ref_p, rtol=PROB_RTOL, atol=0)
    allowed = set(ref_ids.tolist())
    for _ in range(5):
        assert s(x) in allowed


@pytest.mark.parametrize(
    "n, kind, top_k, top_p, min_p",
    [
        (20_000, "flat", 0, 0.9, 0.0),  # top_p grows 64 -> 512 -> 4096 -> 32768 (all)
        (20_000, "flat", 0, 0.9, 0.5),  # min_p keeps every tie
        (50_000, "normal", 0, 0.95, 0.0),
        (50_000, "normal", 0, 0.95, 0.3),  # min_p cuts inside the candidates: early stop
        (50_000, "levels", 0, 0.3, 0.0),  # ties straddle every candidate boundary
        (50_000, "levels", 40, 1.0, 0.0),  # top_k inside a tie: the lowest ids
        (50_000, "normal", 40, 0.8, 0.05),
        (50_000, "sorted", 64, 0.99, 0.0),  # the top-k all in one block of the prefilter
        (50_000, "normal", 0, 1.0, 0.05),  # min_p alone
        (50_000, "masked", 0, 0.99, 0.0),
    ],
)
def test_fast_paths_equal_the_full_sort_on_large_vocabularies(n, kind, top_k, top_p, min_p):
    rng = np.random.default_rng(n + top_k)
    x = {
        "flat": lambda: np.zeros(n),
        "normal": lambda: rng.standard_normal(n) * 2,
        "levels": lambda: rng.integers(0, 3, n) * 1e-3,
        "sorted": lambda: np.arange(n) * 1e-3,
        "masked": lambda: np.where(rng.random(n) < 0.9, -np.inf, rng.standard_normal(n)),
    }[kind]()
    x = x.astype(np.float32)
    ids, p = Sampler(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p).distribution(x)
    ref_ids, ref_p = reference_distribution(x, 0.8, top_k, top_p, min_p)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(p, ref_p, rtol=PROB_RTOL, atol=0)


def test_known_truncations():
    x = np.log(np.array([0.1, 0.4, 0.2, 0.3], np.float32))
    dist = lambda **kw: Sampler(temperature=1.0, **kw).distribution(x)[0].tolist()
    assert dist() == [0, 1, 2, 3]
    assert dist(top_k=2) == [1, 3]
    assert dist(top_p=0.65) == [1, 3]  # 0.4 + 0.3 >= 0.65
    assert dist(top_p=0.75) == [1, 2, 3]
    assert dist(min_p=0.45) == [1, 2, 3]  # 0.2 >= 0.45 * 0.4
    assert dist(min_p=0.6) == [1, 3]
    assert dist(min_p=0.8) == [1]
    assert dist(top_k=3, top_p=0.7, min_p=0.7) == [1, 3]  # 0.4 / 0.9 + 0.3 / 0.9 >= 0.7
    assert dist(top_k=3, top_p=0.7, min_p=0.8) == [1]
    ids, p = Sampler(temperature=1.0, top_k=2).distribution(x)
    np.testing.assert_allclose(p, [4 / 7, 3 / 7], rtol=1e-6)


# ---- the draws follow the distribution ------------------------------------------------------


@pytest.mark.parametrize(
    "seed, kw",
    [
        (0, dict(temperature=1.0)),
        (1, dict(temperature=0.7, top_k=8)),
        (2, dict(temperature=1.3, top_p=0.9)),
        (3, dict(temperature=1.0, min_p=0.1)),
        (4, dict(temperature=0.9, top_k=12, top_p=0.95, min_p=0.02)),
    ],
)
def test_empirical_distribution_matches_the_reference(seed, kw):
    x = (np.random.default_rng(100 + seed).standard_normal(20) * 1.5).astype(np.float32)
    s = Sampler(seed=seed, **kw)
    counts = np.bincount([s(x) for _ in range(DRAWS)], minlength=x.size) / DRAWS
    ids, p = reference_distribution(x, **kw)
    ref = np.zeros(x.size)
    ref[ids] = p
    assert 0.5 * np.abs(counts - ref).sum() <= TV_BOUND
    assert set(np.flatnonzero(counts)) <= set(ids.tolist())


def test_a_large_vocabulary_draw_uses_every_part_of_the_distribution():
    x = np.zeros(10_000, np.float32)  # uniform: the two-level inverse CDF
    s = Sampler(temperature=1.0, seed=5)
    tokens = np.array([s(x) for _ in range(4000)])
    assert tokens.min() < 500 and tokens.max() > 9500
    assert abs(tokens.mean() - 4999.5) < 300


def test_zero_probability_tokens_are_never_drawn():
    x = np.full(5000, -np.inf, np.float32)
    x[[7, 4999]] = [0.0, -800.0]  # exp underflows to 0 for id 4999
    s = Sampler(temperature=1.0, seed=0)
    assert {s(x) for _ in range(200)} == {7}


# ---- penalties -----------------------------------------------------------------------------


def transformers_repetition(x, history, penalty):
    """RepetitionPenaltyLogitsProcessor: gather, where(score < 0, score * p, score / p), scatter."""
    y = x.copy()
    ids = np.unique(np.asarray(history, np.int64))
    score = y[ids]
    y[ids] = np.where(score < 0, score * penalty, score / penalty)
    return y


def test_repetition_penalty_known_answer():
    x = np.array([2.0, -1.0, 0.5, -3.0, 0.0, 4.0], np.float32)
    s = Sampler(repetition_penalty=2.0)
    s.reset([0, 1, 1, 4, 0])
    np.testing.assert_array_equal(s.penalized(x), np.array([1.0, -2.0, 0.5, -3.0, 0.0, 4.0], np.float32))
    assert s(x) == 5  # 4.0 wins; now 5 is in the history too
    np.testing.assert_array_equal(s.penalized(x), np.array([1.0, -2.0, 0.5, -3.0, 0.0, 2.0], np.float32))
    assert s(x) == 5  # each distinct id is penalised once
    np.testing.assert_array_equal(s.penalized(x), np.array([1.0, -2.0, 0.5, -3.0, 0.0, 2.0], np.float32))
    assert x.tolist() == [2.0, -1.0, 0.5, -3.0, 0.0, 4.0]  # the caller's logits untouched
    y = s.penalized(x)
    y[:] = 7.0  # a copy, not the sampler's scratch array
    assert s.penalized(x)[5] == 2.0


@SETTINGS
@given(
    logit_vectors(max_n=64),
    st.floats(0.2, 3.0),
    st.lists(st.integers(0, 63), max_size=30),
    st.lists(st.integers(0, 63), max_size=10),
)
def test_repetition_penalty_matches_transformers(x, penalty, prompt, generated):
    prompt = [i % x.size for i in prompt]
    generated = [i % x.size for i in generated]
    s = Sampler(repetition_penalty=penalty)
    s.reset(prompt)
    for token in generated:
        s._record(token)
    np.testing.assert_array_equal(s.penalized(x), transformers_repetition(x, prompt + generated, penalty))


@SETTINGS
@given(
    st.integers(2, 50),
    st.floats(-2, 2),
    st.floats(-2, 2),
    st.lists(st.integers(0, 49), max_size=20),
    st.lists(st.integers(0, 49), min_size=1, max_size=20),
    st.integers(0, 2**32 - 1),
)
def test_presence_and_frequency_change_only_generated_ids_by_the_exact_amounts(
    n, presence, frequency, prompt, generated, seed
):
    prompt = [i % n for i in prompt]
    generated = [i % n for i in generated]
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    s = Sampler(presence_penalty=presence, frequency_penalty=frequency)
    s.reset(prompt)
    for token in generated:  # each forced by a one-hot, greedy pick
        assert s(one_hot(n, token, 1e4)) == token
    counts = np.bincount(generated, minlength=n).astype(np.float64)
    expected = x.astype(np.float64) - (presence * (counts > 0) + frequency * counts)
    y = s.penalized(x)
    assert y.dtype == np.float32
    untouched = counts == 0
    np.testing.assert_array_equal(y[untouched], x[untouched])  # prompt ids included
    np.testing.assert_array_equal(y[~untouched], expected[~untouched].astype(np.float32))
    np.testing.assert_allclose(y, expected, rtol=F32_EPS, atol=F32_EPS)


def test_penalties_apply_in_order_and_reset_clears_them():
    x = np.array([3.0, 2.0, 1.0], np.float32)
    s = Sampler(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25)
    s.reset([1])
    s._record(0)
    s._record(0)
    np.testing.assert_allclose(s.penalized(x), [3.0 / 1.5 - 0.5 - 0.5, 2.0 / 1.5, 1.0], rtol=1e-6)
    assert s(x) == 1
    s.reset([])
    np.testing.assert_array_equal(s.penalized(x), x)


def test_greedy_with_penalties_avoids_repeats():
    s = Sampler(repetition_penalty=10.0)
    x = np.array([1.0, 0.9, 0.8], np.float32)
    s.reset([])
    assert [s(x) for _ in range(3)] == [0, 1, 2]
    assert s.describe() == "greedy, repetition_penalty 10"


# ---- reproducibility -----------------------------------------------------------------------


def test_the_same_seed_gives_the_same_sequence_and_others_differ():
    rng = np.random.default_rng(9)
    xs = [(rng.standard_normal(2000) * 2).astype(np.float32) for _ in range(30)]
    kw = dict(temperature=1.0, top_p=0.95, repetition_penalty=1.2, frequency_penalty=0.3)

    def run(seed):
        s = Sampler(seed=seed, **kw)
        s.reset([1, 2, 3])
        return [s(x) for x in xs]

    assert run(7) == run(7)
    assert len({tuple(run(seed)) for seed in (7, 8, 9, 10)}) > 1


def test_one_uniform_per_sampled_token():
    x = np.array([5.0, 1.0, 0.0], np.float32)
    s = Sampler(temperature=1.0, top_k=1, seed=3)
    r = np.random.default_rng(3)
    for _ in range(4):
        s(x)
        r.random()
    assert s.rng.random() == r.random()


# ---- logprobs ------------------------------------------------------------------------------


@SETTINGS
@given(
    logit_vectors(),
    st.integers(0, MAX_LOGPROBS),
    st.sampled_from([0.0, 0.7, 1.5]),
    st.sampled_from([1.0, 1.3]),
    st.integers(0, 1000),
)
def test_logprobs_are_log_softmax_of_the_raw_logits(x, n, t, penalty, seed):
    s = Sampler(temperature=t, top_k=5, repetition_penalty=penalty, seed=seed, logprobs=n)
    s.reset([0])
    ref = log_softmax64(x)
    for _ in range(2):
        p = s.pick(x)
        assert isinstance(p.logprob, float)
        assert abs(p.logprob - ref[p.token]) <= LOGPROB_ATOL
        assert len(p.top) == min(n, x.size)
        assert [i for i, _ in p.top] == ranking(x)[:n]  # ties: lower id first
        for i, lp in p.top:
            assert lp == ref[i] == -np.inf or abs(lp - ref[i]) <= LOGPROB_ATOL
        lps = [lp for _, lp in p.top]
        assert lps == sorted(lps, reverse=True)


def test_logprobs_off_and_zero():
    x = np.array([0.0, 1.0], np.float32)
    assert Sampler().pick(x) == Pick(1, None, ())
    p = Sampler(logprobs=0).pick(x)
    assert p.top == () and p.logprob == pytest.approx(-math.log1p(math.exp(-1.0)), abs=LOGPROB_ATOL)
    p = Sampler(logprobs=2).pick(x)
    assert [i for i, _ in p.top] == [1, 0]


# ---- settings and errors -------------------------------------------------------------------


def test_backward_compatible_calls():
    x = (np.random.default_rng(0).standard_normal(500)).astype(np.float32)
    assert Sampler(0.8, 5, 0.9, 3)(x) == Sampler(temperature=0.8, top_k=5, top_p=0.9, seed=3)(x)
    token = Sampler(temperature=0.0, top_k=0, top_p=1.0, seed=0)(x)
    assert type(token) is int and token == int(np.argmax(x))


def test_describe():
    assert Sampler().describe() == "greedy"
    assert (
        Sampler(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, seed=1).describe()
        == "temperature 0.7, top_k 20, top_p 0.8, min_p 0.05, seed 1"
    )
    assert (
        Sampler(temperature=1.0, presence_penalty=-0.5, frequency_penalty=0.25, logprobs=3).describe()
        == "temperature 1, presence_penalty -0.5, frequency_penalty 0.25, seed 0, logprobs 3"
    )


@pytest.mark.parametrize(
    "name, bad",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", True),
        ("temperature", "warm"),
        ("temperature", None),
        ("top_k", -1),
        ("top_k", 2.0),
        ("top_k", True),
        ("top_k", "20"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", float("nan")),
        ("top_p", False),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("min_p", float("inf")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", float("inf")),
        ("repetition_penalty", float("nan")),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("presence_penalty", float("nan")),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", "0.5"),
        ("seed", -5),
        ("seed", 1.5),
        ("seed", True),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", 2.0),
        ("logprobs", True),
    ],
)
def test_bad_settings_name_the_parameter_range_and_value(name, bad):
    with pytest.raises(ColibriError) as e:
        Sampler(**{name: bad})
    msg = str(e.value)
    assert msg.startswith(name + " must be ") and repr(bad) in msg


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(temperature=1.0),
        dict(temperature=1.0, top_k=3),
        dict(temperature=1.0, top_p=0.5),
        dict(temperature=1.0, min_p=0.1),
        dict(repetition_penalty=1.2),
        dict(logprobs=2),
    ],
)
def test_bad_logits_are_errors(kw):
    s = Sampler(**kw)
    s.reset([0])
    for value, word in ((np.nan, "NaN"), (np.inf, "+inf")):
        x = np.zeros(300, np.float32)
        x[123] = value
        with pytest.raises(ColibriError, match="^logits contain " + re.escape(word) + " .*at id 123"):
            s.pick(x)
    with pytest.raises(ColibriError, match="all -inf"):
        s.pick(np.full(300, -np.inf, np.float32))
    for bad in (np.zeros((2, 3), np.float32), np.zeros(0, np.float32), np.arange(5)):
        with pytest.raises(ColibriError, match="logits must be"):
            s.pick(bad)


def test_bad_histories_are_errors():
    s = Sampler(repetition_penalty=1.1)
    for bad in ([-1], [1.5], [[1, 2]], [True]):
        with pytest.raises(ColibriError, match="prompt_ids"):
            s.reset(bad)
    s.reset([10])
    with pytest.raises(ColibriError, match="token id 10 .*5 entries"):
        s.pick(np.zeros(5, np.float32))
    with pytest.raises(ColibriError, match=r"repetition_penalty must be a number in \[1e-30, 1e30\]"):
        Sampler(repetition_penalty=1e-38)  # float32 logits would divide to infinity
    s = Sampler(repetition_penalty=1e-30)  # in range, and still too much for a logit of 1e10
    s.reset([0])
    with pytest.raises(ColibriError, match=r"after the penalties contain \+inf"):
        s.pick(np.array([1e10, 0.0], np.float32))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-20, 20, width=32), min_size=2, max_size=40),
    st.dictionaries(st.integers(0, 39), st.floats(-100, 100), max_size=6),
    st.floats(0.1, 2.0),
    st.integers(0, 2**31),
)
def test_logit_bias_adds_to_exactly_those_logits(x, bias, t, seed):
    """The distribution with a bias is the plain sampler's over the logits with the bias added."""
    logits = np.asarray(x, np.float32)
    bias = {k: v for k, v in bias.items() if k < logits.size}
    biased = logits.astype(np.float64)
    for k, v in bias.items():
        biased[k] += v
    ids, p = Sampler(t, seed=seed, logit_bias=bias).distribution(logits)
    ref_ids, ref_p = Sampler(t, seed=seed).distribution(biased.astype(np.float32))
    assert np.array_equal(ids, ref_ids) and np.allclose(p, ref_p, rtol=1e-5, atol=1e-9)
    if bias:
        top = max(bias, key=lambda k: (biased[k], -k))
        assert Sampler(0.0, logit_bias={top: 100.0}).pick(logits).token == top


@pytest.mark.parametrize(
    "bias, message",
    [
        ([1], "must be a dict"),
        ({-1: 1.0}, "token ids >= 0"),
        ({"3": 1.0}, "token ids >= 0"),
        ({1: 101.0}, r"\[-100, 100\]"),
        ({1: float("nan")}, r"\[-100, 100\]"),
        ({1: True}, r"\[-100, 100\]"),
    ],
)
def test_bad_logit_bias_is_one_clear_error(bias, message):
    with pytest.raises(ColibriError, match=message):
        Sampler(logit_bias=bias)
    with pytest.raises(ColibriError, match="outside the vocabulary"):
        Sampler(logit_bias={10: 1.0}).pick(np.zeros(4, np.float32))
