"""Real vocabularies: Colibri's tokenizers give transformers' ids and text and llama.cpp's reference
tokenizations; the real chat templates give transformers' ids.

The fixtures (tests/fixtures/text, made by tools/make_text_fixtures.py from llama.cpp's test
vocabularies in the llama-cpp-python sdist, with transformers) hold per vocabulary the
tokenizer files as transformers saves them (tokenizer.json xz-compressed), and `cases.json`:
every llama.cpp `.inp` string and a few hundred more (Unicode, emoji, code, whitespace runs,
special tokens written in the text) with transformers' ids with and without special tokens and
its decodes. A vocabulary that also has a `tokenizer.model` (Llama/Mixtral sentencepiece) is
checked through both backends.
"""

from __future__ import annotations

import json
import lzma
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from colibri.chat import ChatTemplate
from colibri.streaming import TextStream
from colibri.tokenizer import TOKENIZER_JSON, TOKENIZER_MODEL, load_tokenizer
from conftest import render_on_the_fixture_day

TEXT = Path(__file__).parent / "fixtures" / "text"
VOCABS = (
    sorted(p.name for p in (TEXT / "vocab").iterdir() if (p / "cases.json").is_file())
    if (TEXT / "vocab").is_dir()
    else []
)
CHATS = sorted(p.stem for p in (TEXT / "chat").glob("*.json")) if (TEXT / "chat").is_dir() else []
SMALL_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def backends_of(vocab: str) -> list:
    src = TEXT / "vocab" / vocab
    out = []
    if (src / f"{TOKENIZER_JSON}.xz").is_file():
        out.append(TOKENIZER_JSON)
    if (src / TOKENIZER_MODEL).is_file():
        out.append(TOKENIZER_MODEL)
    return out


_CACHE = {}


def tokenizer(vocab: str, backend: str, tmp_root: Path):
    """The vocabulary's tokenizer through one backend, from a directory holding only its files."""
    key = (vocab, backend)
    if key not in _CACHE:
        src = TEXT / "vocab" / vocab
        d = tmp_root / f"{vocab}-{backend.replace('.', '_')}"
        d.mkdir(parents=True, exist_ok=True)
        files = []
        for name in SMALL_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, d / name)
                files.append(name)
        if backend == TOKENIZER_JSON:
            (d / TOKENIZER_JSON).write_bytes(lzma.decompress((src / f"{TOKENIZER_JSON}.xz").read_bytes()))
        else:
            shutil.copyfile(src / TOKENIZER_MODEL, d / TOKENIZER_MODEL)
        _CACHE[key] = load_tokenizer(d, files + [backend])
    return _CACHE[key]


def cases(vocab: str) -> list:
    return json.loads((TEXT / "vocab" / vocab / "cases.json").read_text(encoding="utf-8"))


PAIRS = [(v, b) for v in VOCABS for b in backends_of(v)]


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("vocab")


def test_the_fixtures_are_there():
    for needed in ("qwen2", "gemma-4", "llama-spm", "gpt-neox"):
        assert needed in VOCABS, f"tests/fixtures/text/vocab/{needed} is missing (tools/make_text_fixtures.py)"
    assert TOKENIZER_MODEL in backends_of("llama-spm")
    assert len(CHATS) >= 4


@pytest.mark.parametrize("vocab, backend", PAIRS)
def test_encode_gives_transformers_ids(tmp_root, vocab, backend):
    tok = tokenizer(vocab, backend, tmp_root)
    bad = []
    for c in cases(vocab):
        got = (tok.encode(c["text"], add_special_tokens=True), tok.encode(c["text"], add_special_tokens=False))
        if got != (c["ids"], c["ids_plain"]):
            bad.append((c["text"], got, (c["ids"], c["ids_plain"])))
    assert not bad, f"{len(bad)} of {len(cases(vocab))} strings differ; first: {bad[0]!r}"


@pytest.mark.parametrize("vocab, backend", PAIRS)
def test_encode_gives_llama_cpp_reference_ids(tmp_root, vocab, backend):
    """Every llama.cpp reference tokenization, except the ones where transformers itself is known
    to differ (meta.json's reference_mismatches: Qwen's NFC); those give transformers' ids."""
    tok = tokenizer(vocab, backend, tmp_root)
    refs = [c for c in cases(vocab) if c.get("llama_cpp") is not None]
    if not refs:
        pytest.skip(f"{vocab} has no llama.cpp reference tokenizations")
    meta = json.loads((TEXT / "vocab" / vocab / "meta.json").read_text(encoding="utf-8"))
    known = {m["text"]: m["transformers"] for m in meta.get("reference_mismatches", [])}
    bad = []
    for c in refs:
        want = known.get(c["text"], c["llama_cpp"])
        got = tok.encode(c["text"], add_special_tokens=False)
        if got != want:
            bad.append((c["text"], got, want))
    assert not bad, f"{len(bad)} of {len(refs)} differ; first: {bad[0]!r}"
    assert len(known) <= 3  # only qwen35's three decomposed strings


@pytest.mark.parametrize("vocab, backend", PAIRS)
def test_decode_gives_transformers_text(tmp_root, vocab, backend):
    tok = tokenizer(vocab, backend, tmp_root)
    bad = []
    for c in cases(vocab):
        got = (tok.decode(c["ids"]), tok.decode(c["ids"], skip_special_tokens=True))
        if got != (c["decoded"], c["decoded_skip"]):
            bad.append((c["ids"], got, (c["decoded"], c["decoded_skip"])))
    assert not bad, f"{len(bad)} of {len(cases(vocab))} differ; first: {bad[0]!r}"


@pytest.mark.parametrize("vocab, backend", PAIRS)
def test_streaming_real_text_reassembles_it(tmp_root, vocab, backend):
    tok = tokenizer(vocab, backend, tmp_root)
    for c in cases(vocab):
        s = TextStream(tok, skip_special_tokens=False)
        pieces = [s.push(i) for i in c["ids"]] + [s.finish()]
        assert "".join(pieces) == c["decoded"]
        assert all("\ufffd" not in p for p in pieces) or "\ufffd" in c["decoded"]


@pytest.mark.parametrize("vocab, backend", PAIRS)
def test_streamed_pieces_of_random_ids_concatenate_to_decode(tmp_root, vocab, backend):
    tok = tokenizer(vocab, backend, tmp_root)
    byte_ids = sorted(tok.byte_piece_ids)
    special = sorted(tok.special_ids)[:20]
    ids = st.one_of(
        st.integers(0, tok.vocab_size - 1), st.sampled_from(byte_ids or [0]), st.sampled_from(special or [0])
    )

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(seq=st.lists(ids, max_size=30), skip=st.booleans())
    def check(seq, skip):
        s = TextStream(tok, skip_special_tokens=skip)
        pieces = [s.push(i) for i in seq] + [s.finish()]
        assert "".join(pieces) == tok.decode(seq, skip_special_tokens=skip)

    check()


@pytest.mark.parametrize("name", CHATS)
def test_chat_template_gives_transformers_ids(tmp_root, name, monkeypatch):
    spec = json.loads((TEXT / "chat" / f"{name}.json").read_text(encoding="utf-8"))
    render_on_the_fixture_day(monkeypatch, spec)
    source = (TEXT / "chat" / spec["template_file"]).read_text(encoding="utf-8")
    tok = tokenizer(spec["vocab"], backends_of(spec["vocab"])[0], tmp_root)
    template = ChatTemplate(source, spec["template_file"], tok.special_tokens_map)
    assert spec["cases"]
    for c in spec["cases"]:
        kwargs = c.get("kwargs") or {}
        if "error" in c:
            with pytest.raises(ValueError):
                template.render(c["messages"], add_generation_prompt=c["add_generation_prompt"], **kwargs)
            continue
        text = template.render(c["messages"], add_generation_prompt=c["add_generation_prompt"], **kwargs)
        assert text == c["text"], (c["messages"], kwargs)
        assert tok.encode(text, add_special_tokens=False) == c["ids"]
