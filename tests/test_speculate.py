"""Speculative decoding (generate(draft=, draft_max=, prediction=), colibri.speculate).

The contract: the tokens are those of plain decoding — greedy or sampled, for every architecture,
whatever the drafts (n-gram lookups, a prediction that is all right, all wrong, or right in
parts), across prefill-chunk and sliding-window boundaries — because each token is picked from
the logits of its own position (a chunk's are decoding's bit for bit) with the generation's own
sampler, and a draft is kept only while it equals the pick.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import colibri
from colibri import speculate
from conftest import CASES


def _repetitive_prompt(m, seed=0):
    """A prompt that repeats itself (n-gram lookups find drafts in it)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, m.config.vocab_size, 24).tolist()
    return base + base + base[:10]


def _run(m, prompt, n, **kw):
    tokens = list(m.generate(prompt, n, **kw))
    rec = m.last_generation
    return tokens, [p.logprob for p in rec.picks], rec.speculation


@pytest.mark.parametrize("case", CASES)
def test_speculation_gives_the_tokens_of_plain_decoding(converted, case):
    """Greedy and sampled, n-gram drafts and predictions that are all right, all wrong or right in
    parts: the tokens and their log-probabilities are plain decoding's. A prefill chunk of 8 makes
    the sliding-window rings window + 8 rows, so refused drafts wrap them."""
    m = colibri.load(converted(case), threads=2, prefill_chunk=8)
    prompt = _repetitive_prompt(m)
    n = min(48, m.n_ctx - len(prompt))
    vocab = m.config.vocab_size
    for kw in ({}, {"temperature": 0.9, "top_k": 20, "seed": 5}):
        want = _run(m, prompt, n, draft="none", **kw)
        assert want[2] is None
        wrong = np.random.default_rng(1).integers(0, vocab, n).tolist()
        half = want[0][: n // 2] + wrong[: n // 2]
        for extra in ({"draft": "ngram"}, {"prediction": want[0]}, {"prediction": wrong}, {"prediction": half}):
            got = _run(m, prompt, n, **extra, **kw)
            assert got[0] == want[0], (case, kw, list(extra))
            assert got[1] == want[1]
            assert got[2] is not None and got[2].accepted <= got[2].drafted
        right = _run(m, prompt, n, prediction=want[0], **kw)[2]
        # a right prediction: no draft refused, and every engine call after the prompt verified some
        assert right.accepted == right.drafted and right.drafted + right.chunks >= len(want[0]) - 2


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.integers(0, 2**31 - 1),
    st.floats(0.3, 1.5),
    st.integers(1, 12),
    st.sampled_from([None, 0.9]),
    st.sampled_from([None, 1.2]),
)
def test_sampled_tokens_are_those_of_plain_decoding_for_any_seed(qwen, seed, temperature, draft_max, top_p, penalty):
    """The same seed gives the same tokens with and without drafts (so every token's distribution
    is plain decoding's): the sampler draws from the same logits in the same order."""
    prompt = _repetitive_prompt(qwen, seed % 7)
    kw = dict(temperature=temperature, seed=seed, top_p=top_p, repetition_penalty=penalty)
    want = _run(qwen, prompt, 40, draft="none", **kw)
    got = _run(qwen, prompt, 40, draft="ngram", draft_max=draft_max, **kw)
    assert got[0] == want[0] and got[1] == want[1]


@pytest.fixture(scope="module")
def qwen(converted):
    return colibri.load(converted("qwen3moe_a"), threads=2)


def test_a_constrained_generation_is_unchanged(chat_model_dir):
    pytest.importorskip("llguidance")
    m = colibri.load(chat_model_dir, threads=2)
    ids = m.encode("hello world hello world hello world")
    for kw in ({}, {"temperature": 1.0, "seed": 3}):
        want = _run(m, ids, 40, draft="none", regex=r"(hello|world| ){1,60}", **kw)
        for extra in ({"draft": "ngram"}, {"prediction": want[0]}):
            assert _run(m, ids, 40, regex=r"(hello|world| ){1,60}", **extra, **kw)[0] == want[0]


def test_drafts_stop_at_the_context_and_the_length(qwen):
    """Near the end of the context and of max_new_tokens the drafts shrink: nothing runs past
    either (an engine call past n_ctx would be refused)."""
    prompt = _repetitive_prompt(qwen)
    m = colibri.load(qwen.path, threads=2, n_ctx=len(prompt) + 12)
    want = _run(m, prompt, 12, draft="none")
    got = _run(m, prompt, 12, prediction=want[0], draft_max=64)
    assert got[0] == want[0] and got[2].drafted > 0  # drafted, and none past the context


def test_no_drafts_under_an_expert_budget_unless_asked(converted):
    m = colibri.load(converted("qwen3moe_a"), threads=2, expert_cache_mb=0.05)
    prompt = _repetitive_prompt(m)
    assert _run(m, prompt, 8)[2] is None
    assert _run(m, prompt, 8, draft="ngram")[2] is not None


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(draft="medusa"), "draft must be one of none, ngram, mtp, auto"),
        (dict(draft="mtp"), "draft mtp needs a multi-token-prediction block"),
        (dict(draft_max=0), "draft_max must be an integer in 1..64"),
        (dict(draft_max=True), "draft_max must be an integer in 1..64"),
        (dict(prediction=[10**9]), "token id 1000000000 is outside the vocabulary"),
        (dict(prediction=[1, 2], draft="ngram"), 'prediction needs draft "auto"'),
    ],
)
def test_bad_speculation_options_are_clear_errors(qwen, kw, message):
    with pytest.raises(colibri.ColibriError, match=message):
        qwen.generate([1, 2, 3], 4, **kw)


@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.integers(1, 10))
def test_an_ngram_draft_follows_an_earlier_occurrence_of_the_suffix(tokens, k):
    """What the index proposes is what followed the latest earlier occurrence of the longest
    suffix of 2..4 tokens that occurred before; nothing when none did."""
    index = speculate.NgramIndex()
    index.extend(tokens, len(tokens))
    draft = index.follow(tokens, tokens, k)
    for n in range(min(speculate.NGRAM_MAX, len(tokens)), speculate.NGRAM_MIN - 1, -1):
        suffix = tokens[-n:]
        ends = [e for e in range(n, len(tokens)) if tokens[e - n : e] == suffix]
        if ends:
            assert draft == tokens[max(ends) : max(ends) + k]
            return
    assert draft == []


def test_the_draft_length_adapts_and_drafting_pauses_when_refused():
    d = speculate.Drafter([1, 2, 3, 1, 2, 3, 1, 2], draft_max=6)
    assert d.propose(10) == [3, 1, 2]
    d.verified(6, 6)
    assert d.length == 6
    d.verified(6, 1)
    assert d.length == 2
    for _ in range(4):
        d.verified(2, 0)
    assert d.paused == speculate.PAUSE_TOKENS and d.propose(10) == []
    for t in range(speculate.PAUSE_TOKENS):
        d.push(t)
    assert d.paused == 0
    assert d.stats.drafted == 6 + 6 + 8 and d.stats.accepted == 7
