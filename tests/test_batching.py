"""Sequences decoded together (load(parallel=N), Engine.step, colibri.batching.Batch).

The contract: a sequence's logits in a step are the bits of decoding it alone — whatever the
other sequences are, at whatever positions — for every architecture (sliding-window rings,
attention sinks, MLA's latent cache, the parallel MoE block), and so a Batch's tokens are
generate()'s. Places in the KV cache are reused by the next sequence, after the longest prefix
they still hold.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import colibri
from colibri.batching import Batch
from conftest import CASES, reference


def _alone(m, ids):
    """Logits [T, vocab] of decoding ids token by token in sequence 0 of a fresh context."""
    out = np.empty((len(ids), m.config.vocab_size), np.float32)
    m._engine.reset()
    for t in range(len(ids)):
        assert m._engine.run(ids[t : t + 1], t, out[t : t + 1], True)[0] == 0
    return out


def _sequences(case, vocab):
    """Three different prompts of different lengths from the case's input ids."""
    ids = np.ascontiguousarray(reference(case)["input_ids"], np.int32)
    rng = np.random.default_rng(len(ids))
    other = rng.integers(0, vocab, len(ids) + 3).astype(np.int32)
    return [ids, other, np.ascontiguousarray(ids[::-1][: len(ids) - 2])]


@pytest.mark.parametrize("kv_cache, chunk", [("f32", None), ("q8", None), ("f32", 4)])
@pytest.mark.parametrize("dtype", ["f32", "int8"])
@pytest.mark.parametrize("case", CASES)
def test_a_step_gives_each_sequence_the_bits_of_decoding_it_alone(converted, case, dtype, kv_cache, chunk):
    """Three sequences, each prefilled to a different length in its own place of the cache
    (places 2, 0, 1: not their order), then stepped together to their ends, the shorter ones
    dropping out: every step's logits equal decoding that sequence alone, bit for bit. (A chunk
    of 4 makes the sliding-window layers' rings window + 4 rows: they wrap within the sequences.)"""
    path = converted(case, dtype)
    alone_model = colibri.load(path, threads=2, kv_cache=kv_cache, prefill_chunk=chunk)
    vocab = alone_model.config.vocab_size
    seqs = _sequences(case, vocab)
    want = [_alone(alone_model, s) for s in seqs]
    m = colibri.load(path, threads=2, kv_cache=kv_cache, parallel=3, prefill_chunk=chunk)
    places = [2, 0, 1]
    prefilled = [3, 1, 5]
    for s, place, k in zip(seqs, places, prefilled):
        out = np.empty((k, vocab), np.float32)
        assert m._engine.run(s[:k], 0, out, True, place)[0] == 0
        np.testing.assert_array_equal(out, want[places.index(place)][:k])
    pos = list(prefilled)
    while True:
        live = [i for i in range(3) if pos[i] < len(seqs[i])]
        if not live:
            break
        tokens = np.array([seqs[i][pos[i]] for i in live], np.int32)
        out = np.empty((len(live), vocab), np.float32)
        status = m._engine.step(
            tokens, np.array([places[i] for i in live], np.int32), np.array([pos[i] for i in live], np.int32), out
        )
        assert status[0] == 0
        for row, i in enumerate(live):
            np.testing.assert_array_equal(out[row], want[i][pos[i]], err_msg=f"sequence {i} at {pos[i]}")
            pos[i] += 1


@pytest.mark.parametrize("case", ["mixtral_a", "gemma4_a", "gpt_oss_a", "deepseekv3_a"])
def test_a_step_mixes_prompt_pieces_and_decoding_tokens(converted, case):
    """A step of one sequence's decoding token, another's prompt piece (consecutive positions,
    attended as one run) and a third's: with `want` marking the decoding token and each piece's
    last, the rows are those tokens' logits alone, bit for bit, and the pieces' caches serve
    the next step as a prompt run alone would."""
    path = converted(case, "int8")
    alone_model = colibri.load(path, threads=2, prefill_chunk=8)
    vocab = alone_model.config.vocab_size
    seqs = _sequences(case, vocab)
    want = [_alone(alone_model, s) for s in seqs]
    m = colibri.load(path, threads=2, parallel=3, prefill_chunk=8)
    out = np.empty((4, vocab), np.float32)
    assert m._engine.run(seqs[0][:4], 0, out[:1], False, 1)[0] == 0  # sequence 0 in place 1, 4 tokens
    pieces = [(1, seqs[0], 4, 1), (0, seqs[1], 0, 5), (2, seqs[2], 0, 2)]  # (place, ids, from, tokens)
    for round_ in range(2):
        tokens = np.concatenate([ids[f : f + k] for _, ids, f, k in pieces]).astype(np.int32)
        places = np.concatenate([np.full(k, p, np.int32) for p, _, _, k in pieces])
        positions = np.concatenate([np.arange(f, f + k, dtype=np.int32) for _, _, f, k in pieces])
        mask = np.concatenate([np.arange(k) == k - 1 for *_, k in pieces]).astype(np.uint8)
        assert m._engine.step(tokens, places, positions, out[:3], mask)[0] == 0
        for row, (i, (_, ids, f, k)) in enumerate(zip((0, 1, 2), pieces)):
            np.testing.assert_array_equal(out[row], want[i][f + k - 1], err_msg=f"round {round_}, sequence {i}")
        pieces = [(p, ids, f + k, 1 if i == 0 else 3) for i, (p, ids, f, k) in enumerate(pieces)]


def test_a_step_refuses_what_it_cannot_do(converted):
    m = colibri.load(converted("mixtral_a", "f32"), parallel=2)
    out = np.empty((2, m.config.vocab_size), np.float32)
    i32 = lambda *v: np.array(v, np.int32)  # noqa: E731
    side_by_side = "tokens in a step must be side by side at consecutive positions"
    with pytest.raises(ValueError, match=side_by_side):
        m._engine.step(i32(1, 2), i32(0, 0), i32(0, 2), out)
    with pytest.raises(ValueError, match=side_by_side):
        m._engine.step(i32(1, 2, 3), i32(0, 1, 0), i32(0, 0, 1), np.empty((3, m.config.vocab_size), np.float32))
    with pytest.raises(ValueError, match="wrong shape"):
        m._engine.step(i32(1, 2), i32(0, 1), i32(0, 0), out[:1])
    with pytest.raises(ValueError, match="outside 0..1"):
        m._engine.step(i32(1), i32(2), i32(0), out)
    with pytest.raises(ValueError, match="exceeds the context"):
        m._engine.step(i32(1), i32(0), i32(m.n_ctx), out)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m._engine.step(i32(m.config.vocab_size), i32(0), i32(0), out)
    with pytest.raises(ValueError, match="sequence 2 is outside"):
        m._engine.run(i32(1), 0, out[:1], False, 2)


@pytest.mark.parametrize("bad", [0, 65, -1, 2.5, True, "2"])
def test_parallel_must_be_a_sensible_integer(converted, bad):
    with pytest.raises(colibri.ColibriError, match="parallel must be an integer in 1..64"):
        colibri.load(converted("mixtral_a", "f32"), parallel=bad)


def test_parallel_beyond_the_prefill_chunk_is_refused(converted):
    with pytest.raises(colibri.ColibriError, match="parallel 4 exceeds the prefill chunk 2"):
        colibri.load(converted("mixtral_a", "f32"), parallel=4, prefill_chunk=2)


def test_the_kv_cache_is_allocated_per_sequence(converted):
    one = colibri.load(converted("gemma4_a", "f32"))
    three = colibri.load(converted("gemma4_a", "f32"), parallel=3)
    assert three.kv_cache_bytes == 3 * one.kv_cache_bytes


# ---- Batch ----------------------------------------------------------------------------------------

SETTINGS = [  # without drafts: a step then carries one token of each decoding sequence
    dict(draft="none"),
    dict(temperature=0.9, seed=5, logprobs=2, draft="none"),
    dict(temperature=0.7, top_k=5, seed=1, repetition_penalty=1.3, draft="none"),
]


@pytest.fixture(scope="module")
def pair(converted):
    """(a model with 3 places, the same model with 1) over the qwen3moe_a fixture."""
    path = converted("qwen3moe_a", "int8")
    return colibri.load(path, threads=2, parallel=3), colibri.load(path, threads=2)


def _generate_alone(m, ids, n, kw):
    tokens = list(m.generate(ids, n, reuse_prefix=False, **kw))
    return tokens, m.last_generation


@pytest.mark.parametrize("step_tokens", [None, 1, 4])
def test_a_batch_generates_what_generate_does_alone(pair, step_tokens):
    """Three prompts with different settings and lengths, added at different steps (with steps
    of 1 or 4 tokens the prompts run a piece a step, beside the others' tokens): each sequence's
    tokens, log-probabilities and finish reason are generate()'s."""
    m, alone = pair
    vocab = m.config.vocab_size
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, vocab, n).tolist() for n in (5, 9, 3)]
    lengths = [12, 4, 8]
    want = [_generate_alone(alone, p, n, kw) for p, n, kw in zip(prompts, lengths, SETTINGS)]
    with Batch(m, step_tokens=step_tokens) as b:
        seqs = [b.add(prompts[0], lengths[0], **SETTINGS[0])]
        b.step()
        b.step()
        seqs += [b.add(p, n, **kw) for p, n, kw in zip(prompts[1:], lengths[1:], SETTINGS[1:])]
        steps = 0
        while b.running:
            events = b.step()
            assert len({id(e[0]) for e in events}) == len(events)  # one token per sequence a step
            steps += 1
        if step_tokens is None:
            assert steps <= max(lengths)
    for seq, (tokens, record) in zip(seqs, want):
        assert seq.done and seq.record.tokens == tokens
        assert [p.logprob for p in seq.record.picks] == [p.logprob for p in record.picks]
        assert [p.top for p in seq.record.picks] == [p.top for p in record.picks]
        assert seq.record.finish_reason == record.finish_reason


def test_places_are_reused_and_a_next_turn_reuses_its_prefix(pair):
    m, alone = pair
    vocab = m.config.vocab_size
    rng = np.random.default_rng(3)
    first = rng.integers(0, vocab, 6).tolist()
    with Batch(m) as b:
        a = b.add(first, 4)
        others = [b.add(rng.integers(0, vocab, 4).tolist(), 2) for _ in range(2)]
        assert b.room == 0
        with pytest.raises(colibri.ColibriError, match="all 3 sequences of this model are running"):
            b.add(first, 1)
        while b.running:
            b.step()
        assert b.room == 3
        turn = first + a.record.tokens + rng.integers(0, vocab, 3).tolist()
        nxt = b.add(turn, 5)
        while b.running:
            b.step()
    assert nxt.record.reused_tokens == len(first) + len(a.record.tokens) - 1
    tokens, _ = _generate_alone(alone, turn, 5, {})
    assert nxt.record.tokens == tokens and all(o.done for o in others)


def test_a_batch_holds_the_model_until_closed(pair):
    m, _ = pair
    for bad in (0, -2, 1.5, True):
        with pytest.raises(colibri.ColibriError, match="step_tokens must be a positive integer"):
            Batch(m, step_tokens=bad)
    b = Batch(m)
    with pytest.raises(colibri.ColibriError, match="already generating"):
        list(m.generate([1, 2], 1))
    seq = b.add([1, 2, 3], 10)
    b.step()
    b.cancel(seq)
    assert seq.done and not b.running and b.room == 3
    b.close()
    b.close()
    with pytest.raises(colibri.ColibriError, match="closed"):
        b.add([1], 1)
    assert len(list(m.generate([1, 2], 2))) == 2


def test_a_batch_stops_at_stop_strings_and_streams_the_same_text(chat_model_dir):
    m = colibri.load(chat_model_dir, threads=2, parallel=2)
    alone = colibri.load(chat_model_dir, threads=2)
    prompt = m.encode("the quick brown")
    pieces = list(alone.stream(prompt, 16, reuse_prefix=False))
    text = "".join(pieces)
    stop = text[len(text) // 2 : len(text) // 2 + 2] if len(text) >= 4 else None
    want_stopped = "".join(alone.stream(prompt, 16, stop=stop, reuse_prefix=False))
    with Batch(m) as b:
        whole = b.add(prompt, 16)
        stopped = b.add(prompt, 16, stop=stop)
        got = {id(whole): "", id(stopped): ""}
        while b.running:
            for seq, _, _, shown in b.step():
                got[id(seq)] += shown
    assert got[id(whole)] == text
    assert got[id(stopped)] == want_stopped
    if stop:
        assert stopped.record.finish_reason == "stop" and stopped.record.stop == stop


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    plan=st.lists(
        st.tuples(st.integers(1, 9), st.integers(1, 6), st.integers(0, 3), st.booleans()), min_size=1, max_size=6
    ),
    step_tokens=st.integers(1, 8),
)
def test_any_schedule_of_adds_and_cancels_keeps_each_sequence_exact(pair, plan, step_tokens):
    """Sequences (prompt length, tokens wanted, steps to wait before adding it, whether it is
    cancelled halfway) added as room allows, steps of step_tokens: every one not cancelled
    generates generate()'s tokens, a cancelled one a prefix of them."""
    m, alone = pair
    vocab = m.config.vocab_size
    rng = np.random.default_rng(len(plan))
    jobs = [(rng.integers(0, vocab, n).tolist(), want, wait, cancel) for n, want, wait, cancel in plan]
    with Batch(m, step_tokens=step_tokens) as b:
        todo, started = list(jobs), []
        steps = 0
        while todo or b.running:
            while todo and b.room and todo[0][2] <= steps:
                prompt, want, _, cancel = todo.pop(0)
                started.append((b.add(prompt, want, stop_at_eos=False), prompt, want, cancel))
            for seq, prompt, want, cancel in started:
                if cancel and not seq.done and len(seq.record.tokens) >= want // 2 and seq.record.tokens:
                    b.cancel(seq)
            b.step()
            steps += 1
    for seq, prompt, want, cancel in started:
        tokens, _ = _generate_alone(alone, prompt, want, dict(stop_at_eos=False))
        got = seq.record.tokens
        assert got == tokens if not cancel else got == tokens[: len(got)]


def test_a_sequence_whose_sampling_fails_ends_alone(pair, monkeypatch):
    """One sequence's sampler raising ends that sequence (error set, place freed, its event's
    token None); the others generate generate()'s tokens."""
    from colibri import batching

    m, alone = pair
    real = batching.Sequence._take

    def take(self, logits):
        if self.max_new_tokens == 7 and len(self.record.tokens) == 2:
            raise colibri.ColibriError("the sampler failed")
        return real(self, logits)

    monkeypatch.setattr(batching.Sequence, "_take", take)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    with Batch(m, step_tokens=3) as b:
        seqs = [b.add(p, n) for p, n in zip(prompts, (5, 7, 6))]
        failed = []
        while b.running:
            failed += [e[0] for e in b.step() if e[1] is None]
        assert failed == [seqs[1]] and b.room == 3
    assert isinstance(seqs[1].error, colibri.ColibriError) and seqs[1].done and len(seqs[1].record.tokens) == 2
    for seq, p, n in ((seqs[0], prompts[0], 5), (seqs[2], prompts[2], 6)):
        assert seq.error is None and seq.record.tokens == _generate_alone(alone, p, n, {})[0]


def test_a_batch_on_a_closed_model_gives_it_back(converted):
    m = colibri.load(converted("mixtral_a", "f32"), parallel=2)
    m.close()
    with pytest.raises(colibri.ColibriError, match="has been closed"):
        Batch(m)
    assert not m._busy.locked()


@pytest.mark.parametrize("case", ["qwen3moe_a", "gpt_oss_a", "gemma4_a", "deepseekv3_a"])
def test_drafts_in_a_batch_keep_each_sequence_exact(converted, case):
    """Each sequence drafts for itself (n-gram lookups, or a prediction that is its own reply):
    several of its tokens may come in one step, and every sequence's tokens are generate()'s
    alone (sliding rings and MLA included; a chunk of 16 makes the rings window + 16 rows)."""
    m = colibri.load(converted(case), threads=2, parallel=3, prefill_chunk=16)
    alone = colibri.load(converted(case), threads=2, prefill_chunk=16)
    rng = np.random.default_rng(0)
    prompts = [(lambda b: b + b + b[:5])(rng.integers(0, m.config.vocab_size, 12).tolist()) for _ in range(3)]
    kws = [dict(), dict(temperature=0.8, seed=4), dict(temperature=1.0, top_k=10, seed=7)]
    want = [list(alone.generate(p, 40, draft="none", **kw)) for p, kw in zip(prompts, kws)]
    for extra in [{"draft": "ngram"}] + [{"prediction": w} for w in want[:1]]:
        with Batch(m, step_tokens=12) as b:
            seqs = [
                b.add(p, 40, **kw, **(extra if "draft" in extra else {"prediction": w}))
                for p, kw, w in zip(prompts, kws, want)
            ]
            steps = 0
            while b.running:
                b.step()
                steps += 1
        assert [s.record.tokens for s in seqs] == want, extra
        if "prediction" in extra:
            assert steps < 40 // 2 and all(s.record.speculation.accepted == s.record.speculation.drafted for s in seqs)
