"""Constrained decoding (colibri.constraint, llguidance) and seed=None.

The models are the random-weight qwen3moe_a fixture with small tokenizers trained here on JSON
text (so every character JSON needs is a token), one of each kind the bridge reads: tokenizer.json
with a ByteLevel decoder (llguidance reads the file itself), tokenizer.json with a Metaspace
decoder and tokenizer.model (sentencepiece; both through the piece list). Random weights write
nothing valid on their own: whatever validates was made valid by the constraint.
"""

from __future__ import annotations

import json
import lzma
import re
import shutil
import string
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

import llguidance  # noqa: E402

import colibri  # noqa: E402
from colibri import constraint as C  # noqa: E402
from colibri._kernels import mask_logits  # noqa: E402
from colibri.batching import Batch  # noqa: E402
from colibri.errors import ColibriError  # noqa: E402
from colibri.sampling import Sampler  # noqa: E402
from colibri.tokenizer import HFTokenizer  # noqa: E402
from conftest import FIXTURES  # noqa: E402

SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB = 240  # the model's 256 ids: 16 of padding that must never be allowed
KINDS = ("bytelevel", "metaspace", "sentencepiece")
PROMPT = [5, 17, 42, 9]
QWEN3_VOCAB = 151_936  # Qwen3's vocab_size (its tokenizer has 151,665 ids)


def _json_corpus() -> list:
    rng = np.random.default_rng(0)
    words = ["name", "age", "items", "id", "tags", "ok", "value", "true", "false", "null", "kind", "data"]
    docs = []
    for _ in range(300):
        d = {
            str(rng.choice(words)): [int(rng.integers(-50, 900)), str(rng.choice(words)), [1, 2, 3], {"x": True}, None][
                int(rng.integers(5))
            ]
            for _ in range(int(rng.integers(1, 5)))
        }
        docs += [json.dumps(d), json.dumps(d, indent=2)]
    return docs + [string.printable] * 3


def _make_tokenizer(hf, kind):
    if kind == "sentencepiece":
        import sentencepiece as spm

        corpus = hf / "corpus.txt"
        corpus.write_text("\n".join(_json_corpus()))
        spm.SentencePieceTrainer.train(
            input=str(corpus),
            model_prefix=str(hf / "tokenizer"),
            vocab_size=200,
            model_type="bpe",
            character_coverage=1.0,
            bos_id=1,
            eos_id=2,
            unk_id=0,
            pad_id=-1,
            minloglevel=2,
            required_chars="".join(c for c in string.printable if not c.isspace()),
        )
        corpus.unlink()
        (hf / "tokenizer.vocab").unlink()
        (hf / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if kind == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(_json_corpus(), trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIALS))
    tok.save(str(hf / "tokenizer.json"))
    end, eot = SPECIALS.index("<|im_end|>"), SPECIALS.index("<|endoftext|>")
    (hf / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False})
    )
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "eos_token_id": end}))
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [end, eot]}))


@pytest.fixture(scope="session")
def json_dirs(tmp_path_factory):
    """{kind: a converted qwen3moe_a directory with a JSON-capable tokenizer of that kind}."""
    from colibri.convert import convert

    out = {}
    for kind in KINDS:
        root = tmp_path_factory.mktemp(f"json_{kind}")
        hf = root / "hf"
        shutil.copytree(FIXTURES / "qwen3moe_a" / "hf", hf)
        _make_tokenizer(hf, kind)
        convert(hf, root / "model", log=lambda *a: None)
        out[kind] = root / "model"
    return out


@pytest.fixture(scope="module")
def models(json_dirs):
    loaded = {kind: colibri.load(path, threads=1) for kind, path in json_dirs.items()}
    yield loaded
    for m in loaded.values():
        m.close()


@pytest.fixture(scope="module")
def qwen3_vocab(tmp_path_factory):
    """The Qwen3 tokenizer (ByteLevel, 151,665 ids) as a 151,936-id model's Vocabulary."""
    path = tmp_path_factory.mktemp("qwen3") / "tokenizer.json"
    path.write_bytes(lzma.decompress((FIXTURES / "text" / "vocab" / "qwen3" / "tokenizer.json.xz").read_bytes()))
    tok = HFTokenizer(path, json.loads((FIXTURES / "text" / "vocab" / "qwen3" / "tokenizer_config.json").read_text()))
    return C.Vocabulary(tok, QWEN3_VOCAB, [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")])


def _text(m, tokens) -> str:
    return m.tokenizer.decode(tokens, skip_special_tokens=True)


def _run(m, **kw):
    """(tokens, record) of one generation after PROMPT."""
    tokens = list(m.generate(PROMPT, **{"max_new_tokens": 400, **kw}))
    return tokens, m.last_generation


# ---- JSON schemas drawn by hypothesis ---------------------------------------------------------------

NAMES = st.sampled_from(["a", "id", "name", "tags", "x_1", "ok", "Z"])
PATTERNS = [r"^[a-z]{1,4}$", r"^[0-9]{2}-[A-Z]$", r"^(yes|no)$", r"^x{1,12}$"]  # bounded: a random model
# may write an unbounded run (x+) until max_new_tokens, greedy or sampled
LEAVES = st.one_of(
    st.tuples(st.integers(-1000, 1000), st.integers(0, 2000)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
    ),
    st.lists(
        st.one_of(st.integers(-99, 99), st.text(alphabet="abcxyz 09", max_size=4), st.none()),
        min_size=1,
        max_size=4,
        unique_by=json.dumps,
    ).map(lambda v: {"enum": v}),
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.sampled_from(PATTERNS).map(lambda p: {"type": "string", "pattern": p}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.integers(-5, 5).map(lambda v: {"const": v}),
)


def _object(props, required):
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _extend(children):
    objects = st.dictionaries(NAMES, children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(lambda req: _object(props, req))
    )
    arrays = st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}
    )
    any_of = st.lists(children, min_size=2, max_size=2).map(lambda s: {"anyOf": s})
    return st.one_of(objects, arrays, any_of)


SCHEMAS = st.dictionaries(NAMES, st.recursive(LEAVES, _extend, max_leaves=5), min_size=1, max_size=3).flatmap(
    lambda props: st.lists(st.sampled_from(sorted(props)), min_size=1, unique=True).map(lambda req: _object(props, req))
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(schema=SCHEMAS, seed=st.integers(0, 2**32 - 1))
@pytest.mark.parametrize("kind", KINDS)
def test_drawn_schemas_give_valid_json_greedy_and_sampled(models, kind, schema, seed):
    """Whatever the random model writes under the schema, greedy or sampled, json.loads reads it
    and jsonschema accepts it; the generation ends at a stop token the constraint let through."""
    m = models[kind]
    for settings_ in (dict(), dict(temperature=1.0, seed=seed)):
        tokens, record = _run(m, json_schema=schema, max_new_tokens=1500, **settings_)
        assert record.finish_reason == "stop", (schema, _text(m, tokens))
        assert tokens[-1] in m.stop_token_ids
        text = _text(m, tokens)
        jsonschema.validate(json.loads(text), schema)


def test_without_the_constraint_the_fixture_writes_no_json(models):
    """The premise of the tests: the random model does not write JSON by itself."""
    for m in models.values():
        text = _text(m, list(m.generate(PROMPT, max_new_tokens=40)))
        with pytest.raises(ValueError):
            json.loads(text)


@pytest.mark.parametrize("kind", KINDS)
def test_json_object_and_string_schema(models, kind):
    m = models[kind]
    for seed in (1, 2):  # (greedy loops in a string on one of them: any JSON object is unbounded)
        tokens, record = _run(m, json_object=True, max_new_tokens=1500, temperature=1.0, seed=seed)
        assert record.finish_reason == "stop"
        assert isinstance(json.loads(_text(m, tokens)), dict)
    schema = json.dumps(
        {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 7}},
            "required": ["n"],
            "additionalProperties": False,
        }
    )  # JSON text
    text = m.complete(PROMPT, 200, json_schema=schema, temperature=0.9, seed=4)
    assert 3 <= json.loads(text)["n"] <= 7


# ---- grammars and regexes -------------------------------------------------------------------------

GRAMMAR = r"""
start: item ("," item)~0..2
item: WORD | NUMBER | "true"
WORD: /[a-c]{1,3}/
NUMBER: /-?[0-9]{1,2}/
"""
GRAMMAR_LANGUAGE = re.compile(r"(?:[a-c]{1,3}|-?[0-9]{1,2}|true)(?:,(?:[a-c]{1,3}|-?[0-9]{1,2}|true)){0,2}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [None, 0, 1, 2])
def test_grammar_and_regex_outputs_match(models, kind, seed):
    m = models[kind]
    kw = dict() if seed is None else dict(temperature=1.0, seed=seed)
    for regex in (r"\d{3}-[a-z]{2,4}", r"(yes|no|maybe)!", r"[A-Z][a-z]{0,6}( [a-z]{1,5}){0,2}\."):
        tokens, record = _run(m, regex=regex, **kw)
        assert record.finish_reason == "stop" and re.fullmatch(regex, _text(m, tokens)), (regex, _text(m, tokens))
    tokens, record = _run(m, grammar=GRAMMAR, **kw)
    assert record.finish_reason == "stop" and GRAMMAR_LANGUAGE.fullmatch(_text(m, tokens)), _text(m, tokens)


def test_stop_at_eos_false_still_ends_when_the_grammar_is_complete(models):
    """Once the grammar is complete only the stop tokens are allowed; the one chosen ends the
    generation although stop_at_eos is False (it is yielded, as stop_at_eos=False yields EOS)."""
    m = models["bytelevel"]
    tokens, record = _run(m, regex=r"ab[0-9]", stop_at_eos=False, max_new_tokens=50)
    assert record.finish_reason == "stop" and len(tokens) < 50
    assert tokens[-1] in m.stop_token_ids and _text(m, tokens) == _text(m, tokens[:-1])
    assert re.fullmatch(r"ab[0-9]", _text(m, tokens))
    assert "regex" in record.sampler.describe()


def test_the_demo_model_follows_a_regex():
    """A trained sentencepiece model (the bundled demo: no byte pieces, no JSON characters)."""
    m = colibri.load(colibri.__path__[0] + "/data/demo", threads=1)
    text = m.complete("And God said", 60, regex=r" [a-z]+(, [a-z]+){2}\.")
    assert re.fullmatch(r"[a-z]+(, [a-z]+){2}\.", text), text  # the decode drops one leading space
    with pytest.raises(ColibriError, match=r"^the json_object constraint allows no token of this vocabulary after 0"):
        m.complete("And God said", 20, json_object=True)  # no "{" in its vocabulary
    m.close()


def test_padding_ids_and_specials_are_never_allowed(models):
    for m in models.values():
        c = m._constraint(regex=r"(.|\n)*")
        allowed = c.allowed()
        assert m.tokenizer.vocab_size < 256 and allowed.shape == (256,)
        assert not allowed[m.tokenizer.vocab_size :].any()
        specials = set(m.tokenizer.special_ids) - set(m.stop_token_ids)
        assert specials and not allowed[sorted(specials)].any()
        assert allowed[sorted(m.stop_token_ids)].all()  # (.|\n)* is complete anywhere: EOS allowed
        assert allowed.sum() > 100


def test_a_grammar_the_vocabulary_cannot_write_is_an_error_not_a_hang(chat_model_dir):
    """conftest's chat tokenizer has no '"' and no '€': no token can start either."""
    m = colibri.load(chat_model_dir, threads=1)
    for regex in ('"x"', "€+"):
        with pytest.raises(ColibriError, match="allows no token of this vocabulary after 0 tokens") as e:
            list(m.generate([5, 6], max_new_tokens=10, regex=regex))
        assert "\n" not in str(e.value)
    tokens = list(m.generate([5, 6], max_new_tokens=30, regex=r"hello( world)?"))  # what it can write
    assert re.fullmatch(r"hello( world)?", _text(m, tokens))
    m.close()


# ---- the mask, checked against numpy ------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "home": {
            "anyOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"],
                    "additionalProperties": False,
                },
            ]
        },
    },
    "required": ["name", "age", "tags", "home"],
    "additionalProperties": False,
}


def _reference_mask(matcher, n) -> np.ndarray:
    """bool [n] from llguidance's own bytes, unpacked with numpy."""
    bits = np.frombuffer(matcher.compute_bitmask(), np.uint8)
    return np.unpackbits(bits, bitorder="little")[:n].astype(bool)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_masked_pick_is_the_pick_over_the_allowed_tokens(qwen3_vocab, temperature):
    """At Qwen3's 151,936 ids: greedy is the argmax over the allowed tokens (numpy over an
    independent matcher's mask); sampling draws what a plain Sampler draws from logits with the
    rest set to -inf; distribution() is the softmax over the allowed; logprobs are the model's
    own; the caller's logits are untouched."""
    n = QWEN3_VOCAB
    text = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_pattern": C.WHITESPACE})
    ref = llguidance.LLMatcher(qwen3_vocab.ll, text, log_level=0)
    s = Sampler(temperature=temperature, seed=3, logprobs=2, constraint=C.Constraint(qwen3_vocab, json_schema=SCHEMA))
    plain = Sampler(temperature=temperature, seed=3)
    rng = np.random.default_rng(7)
    steps = 0
    while not s.finished:
        logits = (rng.standard_normal(n) * 4).astype(np.float32)
        before = logits.copy()
        allowed = _reference_mask(ref, n)
        ids, p = s.distribution(logits)
        assert allowed[ids].all()
        if temperature:
            z = logits[allowed].astype(np.float64) / temperature
            want = np.exp(z - z.max())
            np.testing.assert_allclose(p, want / want.sum(), rtol=1e-9)
        pick = s.pick(logits)
        ids = np.flatnonzero(allowed)
        if temperature == 0.0:
            assert pick.token == ids[np.argmax(logits[ids])]
        else:  # a draw over every id first; where refused, over the allowed
            first = plain(logits)
            assert pick.token == (
                first if allowed[first] else plain(np.where(allowed, logits, -np.inf).astype(np.float32))
            )
        log_p = logits.astype(np.float64) - logits.max()
        log_p -= np.log(np.exp(log_p).sum())
        assert pick.logprob == pytest.approx(log_p[pick.token], abs=1e-9)
        np.testing.assert_array_equal(logits, before)
        assert ref.consume_token(pick.token)
        steps += 1
        assert steps < 500
    jsonschema.validate(json.loads(qwen3_vocab.decode(s.constraint._tokens[:-1])), SCHEMA)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 700), seed=st.integers(0, 2**32 - 1), density=st.sampled_from([0.0, 0.03, 0.5, 1.0]))
def test_mask_logits_keeps_allowed_values_bit_for_bit(n, seed, density):
    """token_mask.h: out[i] = logits[i] (every bit, NaN and -0.0 too) where bit i is set, -inf
    elsewhere; the bits past n are ignored."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(n).astype(np.float32)
    logits[rng.random(n) < 0.05] = np.nan
    logits[rng.random(n) < 0.05] = -0.0
    allowed = rng.random(n) < density
    packed = np.packbits(np.concatenate([allowed, rng.random(32 * ((n + 31) // 32) - n) < 0.5]), bitorder="little")
    out = np.empty_like(logits)
    mask_logits(logits, packed.view(np.uint32), out)
    want = np.where(allowed, logits, np.float32(-np.inf)).astype(np.float32)
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))


def test_mask_logits_refuses_mismatched_shapes():
    logits = np.zeros(40, np.float32)
    with pytest.raises(ValueError, match="ceil"):
        mask_logits(logits, np.zeros(1, np.uint32), np.empty(40, np.float32))
    with pytest.raises(ValueError, match="must not be logits"):
        mask_logits(logits, np.zeros(2, np.uint32), logits)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_one_token_check_agrees_with_the_mask(qwen3_vocab, seed):
    """allows(token) without a mask (llguidance's validate_tokens) says what the mask's bit says:
    along a document, for the document's token, stop tokens, specials, padding ids and random
    ones -- so picking without the mask never lets through what the mask forbids."""
    doc = {"name": "Ada", "age": 36, "tags": ["red", "blue"], "home": {"zip": "01815"}}
    ids = qwen3_vocab.ll.tokenize_str(json.dumps(doc)) + [qwen3_vocab.stop_ids[0]]
    rng = np.random.default_rng(seed)
    probe = C.Constraint(qwen3_vocab, json_schema=SCHEMA, background=False)
    check = C.Constraint(qwen3_vocab, json_schema=SCHEMA, background=False)
    specials = [151643, 151644, 151645, 151657, QWEN3_VOCAB - 1, QWEN3_VOCAB - 300]
    for token in ids:
        allowed = check.allowed()
        for t in [token, *specials, *rng.integers(0, QWEN3_VOCAB, 8).tolist()]:
            assert probe.allows(t) == allowed[t], (t, probe.text())
            assert probe._known is False  # no mask was computed for the answer
        probe.consume(token)
        check.consume(token)
    assert probe.finished and check.finished


def test_an_allowed_pick_computes_no_mask(qwen3_vocab, monkeypatch):
    """Greedy logits that favour the grammar's own continuation: every token is picked without
    a mask; a logit vector that favours a forbidden token gets one."""
    doc = json.dumps({"name": "Ada", "age": 36, "tags": ["red"], "home": None})
    ids = qwen3_vocab.ll.tokenize_str(doc) + [qwen3_vocab.stop_ids[0]]
    masks = []
    compute = C.Constraint._compute
    monkeypatch.setattr(C.Constraint, "_compute", lambda self: masks.append(1) or compute(self))
    s = Sampler(temperature=0.0, constraint=C.Constraint(qwen3_vocab, json_schema=SCHEMA, background=False))
    for token in ids:
        logits = np.zeros(QWEN3_VOCAB, np.float32)
        logits[token] = 5.0
        assert s(logits) == token
    assert s.finished and not masks
    s.reset(())
    logits = np.zeros(QWEN3_VOCAB, np.float32)
    logits[qwen3_vocab.ll.tokenize_str("hello")[0]] = 9.0  # an object must start with "{"
    assert qwen3_vocab.decode([s(logits)]).lstrip().startswith("{") and len(masks) == 1


def test_sampling_without_the_mask_first_keeps_the_masked_distribution(models):
    """Untruncated sampling draws over every id and masks only a refused draw: the tokens still
    come with the masked softmax's probabilities (distribution()), here where the grammar's
    tokens hold about half the mass."""
    m = models["bytelevel"]
    c = C.Constraint(m._constraint(regex="x").vocab, regex=r"[0-9]+", background=False)
    allowed = c.allowed().copy()
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal(allowed.size) * 1.5).astype(np.float32)
    logits[allowed] += np.float32(np.log((~allowed).sum() / allowed.sum()))  # A ~ 0.5
    s = Sampler(temperature=1.0, seed=4, constraint=c)
    ids, p = s.distribution(logits)
    n = 20_000
    counts = np.zeros(allowed.size)
    for _ in range(n):
        s.reset(())
        counts[s(logits)] += 1
    assert counts[~allowed].sum() == 0
    f = counts[ids] / n
    assert np.all(np.abs(f - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-3)


def test_background_and_inline_masks_give_the_same_tokens(models, monkeypatch):
    m = models["bytelevel"]
    runs = {}
    for background in (True, False):
        monkeypatch.setattr(C, "BACKGROUND", background)
        runs[background] = [
            _run(m, json_schema=SCHEMA, max_new_tokens=1500, **kw)[0]
            for kw in (dict(), dict(temperature=1.0, seed=11), dict(temperature=0.7, top_k=20, seed=2))
        ]
        runs[background].append(_run(m, grammar=GRAMMAR, temperature=1.0, seed=5)[0])
    assert runs[True] == runs[False]
    c = m._constraint(json_schema=SCHEMA)
    assert c.background is False


def test_the_mask_is_computed_while_the_engine_runs(qwen3_vocab):
    """consume() returns before the next mask is known: the worker computes it meanwhile."""
    c = C.Constraint(qwen3_vocab, json_object=True, background=True)
    c.allowed()
    c.consume(qwen3_vocab.ll.tokenize_str("{")[0])
    assert c._future is not None and c._allowed is None
    assert c.allowed().sum() > 1 and c._future is None


# ---- Batch ----------------------------------------------------------------------------------------


def test_batch_of_constrained_sequences_gives_what_each_gets_alone(json_dirs):
    path = json_dirs["metaspace"]
    alone = colibri.load(path, threads=1)
    jobs = [
        (PROMPT, dict(json_schema=SCHEMA, temperature=0.9, seed=1)),
        ([7, 7, 3, 100, 20, 1], dict(regex=r"[a-c]{2,5}-\d", temperature=1.0, seed=2)),
        ([30, 31], dict(json_object=True)),
    ]
    want, reasons = [], []
    for ids, kw in jobs:
        want.append(list(alone.generate(ids, max_new_tokens=1500, **kw)))
        reasons.append(alone.last_generation.finish_reason)
    assert reasons[:2] == ["stop", "stop"]
    alone.close()
    m = colibri.load(path, threads=1, parallel=2)
    with Batch(m) as batch:
        seqs = [batch.add(ids, 1500, **kw) for ids, kw in jobs[:2]]
        while batch.running:
            batch.step()
            if batch.room and len(seqs) < 3:
                seqs.append(batch.add(jobs[2][0], 1500, **jobs[2][1]))
        for seq, tokens, reason in zip(seqs, want, reasons):
            assert seq.error is None and seq.record.finish_reason == reason
            assert seq.record.tokens == tokens
    m.close()


# ---- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(json_schema={"type": "objectx"}), "json_schema cannot be compiled: Invalid type: objectx"),
        (dict(json_schema={"type": "string", "format": "nonsense"}), "json_schema cannot be compiled: Unknown format"),
        (
            dict(json_schema={"oneOf": [{"type": "integer"}, {"type": "number"}]}),
            "json_schema cannot be compiled: oneOf",
        ),
        (
            dict(json_schema={"type": "object", "properties": {}, "required": ["b"], "additionalProperties": False}),
            "json_schema cannot be compiled: Unsatisfiable schema",
        ),
        (dict(json_schema="{bad"), "json_schema is not valid JSON: Expecting"),
        (dict(json_schema=5), "json_schema must be a JSON object"),
        (dict(json_schema="x" * (C.MAX_SPEC_CHARS + 1)), f"the limit is {C.MAX_SPEC_CHARS}"),
        (dict(json_schema={"enum": list(range(100_000))}), "json_schema cannot be compiled: initial lexer"),
        (dict(grammar="start: foo\nfoo: bar"), 'grammar cannot be compiled: at 2(6): unknown name: "bar"'),
        (dict(grammar=b"start: a"), "grammar must be a str"),
        (dict(regex="a(b"), 'regex cannot be compiled: at 1(8): invalid regex "a(b"'),
        (
            dict(regex="a", grammar="start: a"),
            "give at most one of json_schema, json_object, grammar, regex; got grammar, regex",
        ),
        (dict(json_object="yes"), "json_object must be True or False"),
    ],
)
def test_bad_constraints_are_one_line_errors(models, kw, message):
    m = models["bytelevel"]
    with pytest.raises(ColibriError) as e:
        m.generate(PROMPT, 10, **kw)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(ColibriError):
        with Batch(m) as batch:
            batch.add(PROMPT, 10, **kw)


def test_compilation_is_bounded_in_time(models, monkeypatch):
    real = llguidance.LLMatcher

    class Slow:
        grammar_from_json_schema = staticmethod(real.grammar_from_json_schema)
        grammar_from_lark = staticmethod(real.grammar_from_lark)
        grammar_from_regex = staticmethod(real.grammar_from_regex)

        def __new__(cls, *a, **kw):
            time.sleep(2.0)
            return real(*a, **kw)

    fake = type(sys)("llguidance")
    fake.__dict__.update(
        {k: getattr(llguidance, k) for k in ("LLParserLimits", "LLTokenizer", "TokenizerWrapper")}, LLMatcher=Slow
    )
    monkeypatch.setattr(C, "_llguidance", lambda: fake)
    monkeypatch.setattr(C, "COMPILE_SECONDS", 0.2)
    t0 = time.perf_counter()
    with pytest.raises(ColibriError, match=r"^regex took longer than 0.2 s to compile; simplify it$"):
        models["bytelevel"].generate(PROMPT, 10, regex="abc")
    assert time.perf_counter() - t0 < 1.5


def test_without_llguidance_a_clear_error_and_plain_generation_still_works(json_dirs, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance -> ImportError
    m = colibri.load(json_dirs["sentencepiece"], threads=1)
    with pytest.raises(ColibriError, match=r"^constrained decoding .*needs llguidance: pip install llguidance$"):
        m.generate(PROMPT, 5, json_object=True)
    assert len(list(m.generate(PROMPT, 5, stop_at_eos=False))) == 5
    m.close()


def test_a_model_without_a_tokenizer_is_refused(converted):
    m = colibri.load(converted("qwen3moe_a"), threads=1)
    with pytest.raises(ColibriError, match="has no tokenizer"):
        m.generate(PROMPT, 5, regex="a")
    m.close()


def test_the_vocabulary_is_built_once_per_model(models):
    m = models["metaspace"]
    m._constraint(regex="a")
    vocab = m._constraint_vocab
    m._constraint(json_object=True)
    assert m._constraint_vocab is vocab


# ---- seed=None ------------------------------------------------------------------------------------


def test_seed_none_draws_a_fresh_seed_and_reports_it():
    seeds = {Sampler(temperature=1.0, seed=None).seed for _ in range(8)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert Sampler(seed=0).seed == 0  # ints stay as given
    s = Sampler(temperature=1.0, seed=None)
    assert f"seed {s.seed}" in s.describe()


def test_seed_none_in_generate_is_recorded_and_replays(models):
    m = models["bytelevel"]
    runs = [(_run(m, temperature=1.0, seed=None, max_new_tokens=30, stop_at_eos=False)) for _ in range(2)]
    (a, ra), (b, rb) = runs
    assert ra.sampler.seed != rb.sampler.seed
    assert _run(m, temperature=1.0, seed=ra.sampler.seed, max_new_tokens=30, stop_at_eos=False)[0] == a
    tokens, record = _run(m, temperature=1.0, seed=None, json_schema=SCHEMA, max_new_tokens=1500)
    assert _run(m, temperature=1.0, seed=record.sampler.seed, json_schema=SCHEMA, max_new_tokens=1500)[0] == tokens
    with Batch(m) as batch:
        seq = batch.add(PROMPT, 30, temperature=1.0, seed=None, stop_at_eos=False)
        while batch.running:
            batch.step()
    assert seq.record.tokens == _run(m, temperature=1.0, seed=seq.sampler.seed, max_new_tokens=30, stop_at_eos=False)[0]
    assert list(m.generate(PROMPT, 5, stop_at_eos=False)) == list(m.generate(PROMPT, 5, stop_at_eos=False))


def test_constraint_state_is_per_generation(models):
    """A Sampler reset for a new generation restarts its constraint; a thread per Model."""
    m = models["bytelevel"]
    first = _run(m, regex=r"[a-z]{3}")[0]
    c = m.last_generation.sampler.constraint
    assert c.finished
    m.last_generation.sampler.reset(PROMPT)
    assert not c.finished and c.text() == ""
    assert threading.active_count() < 50
    assert _run(m, regex=r"[a-z]{3}")[0] == first
