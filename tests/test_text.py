"""The text side of a model: streaming text, stop strings, chat templates, generation_config,
prefix reuse of the KV cache, and the CLI's run --chat / chat / tokenizer commands.

Real vocabularies and transformers' reference ids are in test_tokenizers.py; here the tokenizers
are the bundled demo's sentencepiece model and a small BPE tokenizer.json trained in the test
(its ids fit the fixture models' vocabularies of a few hundred).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import colibri
from colibri import ColibriError
from colibri.chat import ChatTemplate
from colibri.cli import DEMO_DIR
from colibri.generation import GenerationDefaults
from colibri.streaming import StopStrings, TextStream
from colibri.tokenizer import SentencePieceTokenizer
from conftest import CHATML, FIXTURES, SMALL_VOCAB
from conftest import AS_LIMIT, colibri as run_cli, one_line_error


@pytest.fixture(scope="module")
def demo_tok():
    return SentencePieceTokenizer(DEMO_DIR / "tokenizer.model")


def limited(*args, **kwargs):
    """The CLI under the address-space limit of every error-path test (conftest.AS_LIMIT)."""
    return run_cli(*args, limit=AS_LIMIT, **kwargs)


# ---- streaming text ------------------------------------------------------------------------------


def stream_all(tok, ids, skip):
    s = TextStream(tok, skip_special_tokens=skip)
    pieces = [s.push(i) for i in ids] + [s.finish()]
    return pieces


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 4095), max_size=40), skip=st.booleans())
def test_streamed_pieces_concatenate_to_decode_sentencepiece(demo_tok, ids, skip):
    assert "".join(stream_all(demo_tok, ids, skip)) == demo_tok.decode(ids, skip_special_tokens=skip)


def test_streamed_text_holds_no_replacement_character_while_a_character_is_incomplete(demo_tok):
    ids = demo_tok.encode("And the LORD said unto Moses", add_special_tokens=False)
    pieces = stream_all(demo_tok, ids, True)
    assert "".join(pieces) == "And the LORD said unto Moses"
    assert sum(bool(p) for p in pieces) >= 4  # really incremental, not all at the end


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc xyz\n", max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=6),
    stops=st.lists(st.text(alphabet="abcz \n", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_stop_strings_are_found_across_any_split_and_cut(text, cuts, stops):
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0] + bounds, bounds + [len(text)])]
    s = StopStrings(stops)
    shown = ""
    for p in pieces:
        out, stopped = s.feed(p)
        shown += out
        if stopped:
            break
    else:
        shown += s.finish()
    # the stop that completes first (as text grows character by character), the earliest-starting
    # of those that complete there: what any split of the same text must find
    hits = [(text.find(x) + len(x), text.find(x), x) for x in stops if x in text]
    if hits:
        _, at, stop = min(hits)
        assert shown == text[:at] and s.stopped is not None and text[at:].startswith(s.stopped)
    else:
        assert shown == text and s.stopped is None


# ---- chat templates --------------------------------------------------------------------------------


def test_template_globals_filters_and_kwargs():
    t = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{{ m.content | tojson }}{% endfor %}"
        "{% if flag %}F{% endif %}{{ add_generation_prompt }}",
        "test",
        {"bos_token": "<s>"},
    )
    assert t.render([{"role": "user", "content": 'é<"x">'}], flag=True) == '<s>"é<\\"x\\">"FTrue'
    assert t.render([{"role": "user", "content": "a"}], add_generation_prompt=False) == '<s>"a"False'


def test_template_that_raises_shows_its_message():
    t = ChatTemplate(
        "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}ok",
        "tpl.jinja",
    )
    assert t.render([{"role": "user", "content": "hi"}]) == "ok"
    with pytest.raises(ColibriError, match="System role not supported"):
        t.render([{"role": "system", "content": "x"}])


@pytest.mark.parametrize(
    "messages", ["hello", [{"content": "no role"}], [["user", "hi"]], [{"role": "user", "content": 3}]]
)
def test_messages_of_the_wrong_shape_are_clear_errors(messages):
    with pytest.raises(ColibriError, match="messages"):
        ChatTemplate(CHATML, "t").render(messages)


def test_template_that_does_not_parse_names_its_file():
    with pytest.raises(ColibriError, match="t.jinja.*does not parse"):
        ChatTemplate("{% for x in %}", "t.jinja")


def test_sandbox_refuses_attribute_escapes():
    t = ChatTemplate("{{ messages.__class__.__mro__ }}", "t")
    with pytest.raises(ColibriError):
        t.render([{"role": "user", "content": "x"}])


HUGE_TEMPLATES = [
    "{{ 2 ** (2 ** 40) }}",  # folded at compile time by an unbounded sandbox: minutes and gigabytes at load
    "{{ (9 ** 9999999) % 7 }}",
    '{{ "x" * 10 ** 9 }}',
    "{% set n = 10 ** 8 %}{{ ([0] * n) | length }}",
    "{{ 10 ** 8 * [1, 2] }}",
]


def test_templates_that_compute_huge_numbers_or_strings_are_refused_promptly():
    """Each of these took seconds to minutes and gigabytes: refused now with one line naming the
    file. Run in a child with a time limit, so that a regression fails rather than hangs the suite."""
    code = (
        "import json, sys\n"
        "from colibri.chat import ChatTemplate\n"
        "from colibri.errors import ColibriError\n"
        "out = []\n"
        "for src in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        ChatTemplate(src, 'hostile.jinja').render([{'role': 'user', 'content': 'hi'}])\n"
        "        out.append('rendered')\n"
        "    except ColibriError as e:\n"
        "        out.append(str(e))\n"
        "print(json.dumps(out))\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, json.dumps(HUGE_TEMPLATES)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    for src, message in zip(HUGE_TEMPLATES, json.loads(p.stdout)):
        assert "hostile.jinja" in message and ("bits" in message or "items" in message), (src, message)


def test_bounded_operators_keep_ordinary_templates():
    t = ChatTemplate('{{ "-" * 80 }}|{{ 2 ** 10 }}|{{ 2.5 ** 2 }}|{{ 3 * 4 }}|{{ [0] * 3 }}|{{ 2 * "ab" }}', "t")
    assert t.render([{"role": "user", "content": "x"}]) == "-" * 80 + "|1024|6.25|12|[0, 0, 0]|abab"


@given(st.integers(-(2**70), 2**70), st.integers(-50, 5000))
def test_the_power_bound_is_the_result_size(base, exponent):
    from colibri.chat import TEMPLATE_MAX_INT_BITS, _huge_power

    if _huge_power(base, exponent):
        assert exponent > 0 and (abs(base) ** min(exponent, 5000)).bit_length() >= TEMPLATE_MAX_INT_BITS
    elif exponent >= 0:
        assert (base**exponent).bit_length() <= TEMPLATE_MAX_INT_BITS + 1


def test_continue_final_message():
    t = ChatTemplate(CHATML, "t")
    text = t.render(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the quick"}],
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert text.endswith("<|im_start|>assistant\nthe quick")


# ---- generation_config -----------------------------------------------------------------------------


def test_generation_config_defaults_follow_transformers(tmp_path):
    p = tmp_path / "generation_config.json"
    p.write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "eos_token_id": [3, 7]}))
    g = GenerationDefaults.from_file(p, 100)
    assert g.eos_token_id == (3, 7)
    settings_, taken = g.resolve(temperature=None, top_k=None, top_p=0.5)
    assert settings_["temperature"] == 0.6 and settings_["top_k"] == 50 and settings_["top_p"] == 0.5
    assert "temperature" in taken and "top_k" in taken and "top_p" not in taken
    p.write_text(json.dumps({"do_sample": False, "temperature": 0.6, "eos_token_id": 3}))
    settings_, taken = GenerationDefaults.from_file(p, 100).resolve()
    assert settings_["temperature"] == 0.0 and taken == []


@pytest.mark.parametrize(
    "doc, named",
    [
        ({"eos_token_id": "x"}, "eos_token_id"),
        ({"eos_token_id": [1, 500]}, "500"),
        ({"do_sample": True, "temperature": "hot"}, "temperature"),
    ],
)
def test_bad_generation_config_is_an_error(tmp_path, doc, named):
    p = tmp_path / "generation_config.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(ColibriError, match=named):
        GenerationDefaults.from_file(p, 100)


# ---- a model with tokenizer.json, a chat template and two EOS ids ----------------------------------


def test_convert_copies_and_lists_the_text_files(chat_hf, chat_model_dir):
    cfg = json.loads((chat_model_dir / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert name in cfg["files"] and (chat_model_dir / name).read_bytes() == (chat_hf / name).read_bytes()
    info = run_cli("info", "--model-dir", chat_model_dir)
    assert info.returncode == 0, info.stderr
    vocab = colibri.load(chat_model_dir).tokenizer.vocab_size
    assert 100 < vocab <= SMALL_VOCAB
    assert f"tokenizer:    tokenizer.json ({vocab} ids; adds no BOS/EOS, eos '<|im_end|>')" in info.stdout
    assert "chat:         template from tokenizer_config.json" in info.stdout
    assert "stop tokens:  3 '<|im_end|>', 1 '<|endoftext|>'" in info.stdout


def test_chat_template_ids_and_reply(chat_model_dir):
    m = colibri.load(chat_model_dir)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    ids = m.apply_chat_template(msgs)
    text = m.apply_chat_template(msgs, tokenize=False)
    assert (
        text
        == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids == m.tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == m.tokenizer.token_to_id("<|im_start|>")
    reply = m.chat(msgs, max_new_tokens=8)
    generated = m.last_generation.tokens
    assert reply == m.tokenizer.decode(generated, skip_special_tokens=True)
    assert "".join(m.chat(msgs, max_new_tokens=8, stream=True)) == reply


def test_either_of_two_eos_ids_stops(chat_hf, tmp_path):
    from colibri.convert import convert

    m = colibri.load(chat_hf.parent / "model")
    prompt = [5, 60, 17, 8, 90, 33]
    free = list(m.generate(prompt, max_new_tokens=12, stop_at_eos=False, temperature=1.0, seed=3))
    first = {t: i for i, t in reversed(list(enumerate(free)))}  # token -> first index
    a, b = sorted(first, key=first.get)[:2]  # two distinct tokens, a comes first
    for k, (eos, stop_at) in enumerate((([b, a], first[a]), ([a, b], first[a]), ([b, 250], first[b]))):
        hf = tmp_path / f"hf_{k}"
        shutil.copytree(chat_hf, hf)
        gc = json.loads((hf / "generation_config.json").read_text())
        (hf / "generation_config.json").write_text(json.dumps({**gc, "eos_token_id": eos}))
        cfg = json.loads((hf / "config.json").read_text())
        (hf / "config.json").write_text(json.dumps({**cfg, "eos_token_id": eos[0]}))
        convert(hf, tmp_path / f"m_{k}", log=lambda *a: None)
        got = list(colibri.load(tmp_path / f"m_{k}").generate(prompt, max_new_tokens=12, temperature=1.0, seed=3))
        assert got == free[: stop_at + 1], (eos, free)


# ---- the KV cache reused across turns --------------------------------------------------------------


@pytest.mark.parametrize("case, chunk", [("qwen3moe_a", None), ("mixtral_b", None), ("mixtral_b", 4)])
def test_prefix_reuse_gives_the_same_tokens_and_logits(converted, case, chunk):
    d = converted(case)
    warm = colibri.load(d, prefill_chunk=chunk)
    cold = colibri.load(d, prefill_chunk=chunk)
    rng = np.random.default_rng(0)
    p1 = rng.integers(3, 100, 20).tolist()
    out1 = list(warm.generate(p1, max_new_tokens=6, stop_at_eos=False))
    turns = [
        p1 + out1[:-1] + [11, 12, 13],  # the next turn: everything held is reused
        p1[:14] + [40, 41, 42, 43, 44, 45],  # a shorter common prefix: rewinds the cache
        p1[:3] + [9] * 30,
    ]  # far back: sliding rings may refuse the reuse
    for p in turns:
        got = list(warm.generate(p, max_new_tokens=5, stop_at_eos=False))
        want = list(cold.generate(p, max_new_tokens=5, stop_at_eos=False, reuse_prefix=False))
        assert got == want
        assert np.array_equal(warm.last_logits, cold.last_logits)
        assert cold.last_generation.reused_tokens == 0
    assert warm.stats["prefill_tokens"] + warm.stats["reused_tokens"] == len(turns[-1])


def test_reuse_counts_the_held_prefix(converted):
    m = colibri.load(converted("qwen3moe_a"))
    p1 = list(range(3, 23))
    out = list(m.generate(p1, max_new_tokens=4, stop_at_eos=False))
    list(m.generate(p1 + out + [50, 51], max_new_tokens=2, stop_at_eos=False))
    assert m.last_generation.reused_tokens == len(p1) + len(out) - 1  # the last token never ran
    list(m.generate(p1 + out + [50, 51], max_new_tokens=2, stop_at_eos=False))
    assert m.last_generation.reused_tokens == len(p1) + len(out) + 1  # all but the last prompt token


# ---- the CLI -----------------------------------------------------------------------------------------


def test_run_chat_and_prompt_sources(chat_model_dir, tmp_path):
    p = run_cli(
        "run",
        "--model-dir",
        chat_model_dir,
        "--chat",
        "--system",
        "be brief",
        "--prompt",
        "hello world",
        "--max-new-tokens",
        4,
        "--ids",
    )
    assert p.returncode == 0, p.stderr
    m = colibri.load(chat_model_dir)
    ids = m.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}])
    assert [int(t) for t in p.stdout.split()] == list(m.generate(ids, max_new_tokens=4))
    f = tmp_path / "prompt.txt"
    f.write_text("hello world", encoding="utf-8")
    a = run_cli("run", "--model-dir", chat_model_dir, "--prompt-file", f, "--max-new-tokens", 4, "--ids")
    b = run_cli("run", "--model-dir", chat_model_dir, "--prompt", "hello world", "--max-new-tokens", 4, "--ids")
    assert a.returncode == 0 and a.stdout == b.stdout
    env_cmd = [
        sys.executable,
        "-m",
        "colibri",
        "run",
        "--model-dir",
        str(chat_model_dir),
        "--prompt",
        "-",
        "--max-new-tokens",
        "4",
        "--ids",
    ]
    c = subprocess.run(env_cmd, input=b"hello world", capture_output=True)
    assert c.returncode == 0 and c.stdout.decode() == b.stdout


def test_bad_prompt_bytes_and_templates_are_one_line_errors(chat_model_dir, converted, tmp_path):
    f = tmp_path / "bad.txt"
    f.write_bytes(b"caf\xe9 latin-1")
    one_line_error(limited("run", "--model-dir", chat_model_dir, "--prompt-file", f), "bad.txt", "UTF-8")
    one_line_error(limited("run", "--model-dir", chat_model_dir, "--prompt", "caf\udce9"), "UTF-8")
    one_line_error(limited("run", "--model-dir", chat_model_dir, "--system", "x", "--prompt", "hi"), "--chat")
    no_template = converted("mixtral_a", "f32")  # a checkpoint without a chat template
    one_line_error(limited("run", "--model-dir", no_template, "--chat", "--prompt", "hi"), "chat template")


def test_chat_command_holds_a_conversation(chat_model_dir):
    cmd = [sys.executable, "-m", "colibri", "chat", "--model-dir", str(chat_model_dir), "--max-new-tokens", "3"]
    p = subprocess.run(
        cmd,
        input="hello world\nthe quick fox\n/reset\nhello\n/exit\nnot read\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr and "[INFO]" not in p.stdout
    speed = [ln for ln in p.stderr.splitlines() if ln.startswith("[INFO] Prompt:")]
    assert len(speed) == 3  # three replies, "not read" after /exit
    assert "reused from the cache" in speed[1] and "reused" not in speed[0]
    assert "Conversation reset" in p.stderr


def test_tokenizer_command_adds_text_files_without_reconverting(converted, chat_hf, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(converted("qwen3moe_a"), d)
    (d / "tokenizer.json").write_bytes((chat_hf / "tokenizer.json").read_bytes())  # copied in by hand
    p = run_cli("run", "--model-dir", d, "--tokens", "1,2", "--max-new-tokens", 1)
    assert p.returncode == 0 and "[WARN]" in p.stderr and "tokenizer.json" in p.stderr
    assert colibri.load(d).tokenizer is None  # ignored, and said so
    p = run_cli("tokenizer", "--model-dir", d, "--from", chat_hf)
    assert p.returncode == 0, p.stderr
    m = colibri.load(d)
    assert m.tokenizer is not None and m.chat_template is not None and m.unlisted_text_files == []
    assert run_cli("verify", "--model-dir", d).returncode == 0
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{not json")
    one_line_error(limited("tokenizer", "--model-dir", d, "--from", bad), "tokenizer.json")
    assert colibri.load(d).tokenizer.vocab_size == m.tokenizer.vocab_size  # unchanged


def test_tokenizer_larger_than_the_vocabulary_is_refused(converted, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"w{i}": i for i in range(300)}, unk_token="w0")).save(str(src / "tokenizer.json"))
    d = tmp_path / "m"
    shutil.copytree(converted("qwen3moe_a"), d)  # vocab_size 256
    one_line_error(limited("tokenizer", "--model-dir", d, "--from", src), "300", "256")


def test_convert_refuses_a_broken_tokenizer_before_writing(chat_hf, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(chat_hf, hf)
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    out = tmp_path / "out"
    one_line_error(limited("convert", "--hf-dir", hf, "--output-dir", out), "tokenizer_config.json")
    assert not out.exists()


def test_quantize_aliases_of_the_original_engine(tmp_path):
    p = run_cli(
        "convert", "--hf-dir", FIXTURES / "mixtral_a" / "hf", "--output-dir", tmp_path / "o", "--quantize", "fp16"
    )
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "o" / "config.json").read_text())["weight_dtype"] == "f16"
    one_line_error(
        limited(
            "convert", "--hf-dir", FIXTURES / "mixtral_a" / "hf", "--output-dir", tmp_path / "x", "--quantize", "3bit"
        ),
        "3bit",
    )


def test_a_template_that_raises_is_one_line_with_its_message(chat_model_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(chat_model_dir, d)
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                "{% endif %}{{ messages[0]['content'] }}",
                "eos_token": "<|im_end|>",
            }
        )
    )
    assert run_cli("tokenizer", "--model-dir", d, "--from", src).returncode == 0
    ok = run_cli("run", "--model-dir", d, "--chat", "--prompt", "hello", "--max-new-tokens", 2, "--ids")
    assert ok.returncode == 0, ok.stderr
    one_line_error(
        limited("run", "--model-dir", d, "--chat", "--system", "x", "--prompt", "hello"), "System role not supported"
    )


def test_an_invalid_tokenizer_model_is_refused_at_convert(tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / "mixtral_a" / "hf", hf)
    (hf / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    out = tmp_path / "out"
    one_line_error(limited("convert", "--hf-dir", hf, "--output-dir", out), "tokenizer.model")
    assert not out.exists()


def test_numpy_scalars_and_a_tiny_temperature(converted):
    m = colibri.load(
        converted("mixtral_a"),
        threads=np.int64(1),
        n_ctx=np.int32(64),
        prefill_chunk=np.int64(8),
        expert_cache_mb=np.float32(1.0),
    )
    greedy = list(m.generate([1, 2, 3], max_new_tokens=4, stop_at_eos=False))
    tiny = list(
        m.generate(
            [1, 2, 3],
            max_new_tokens=np.int64(4),
            stop_at_eos=False,
            temperature=np.float32(1e-30),
            top_k=np.int64(0),
            seed=np.int64(5),
        )
    )
    assert tiny == greedy  # no overflow, no NaN: the top token every time


def _two_messages_then_exit(monkeypatch):
    """chat's stdin (not a terminal): two messages, then /exit."""
    import io

    class Stdin:
        buffer = io.BytesIO(b"hello world\nthe quick fox\n/exit\n")

        @staticmethod
        def isatty():
            return False

    monkeypatch.setattr(sys, "stdin", Stdin)


def test_a_ctrl_c_while_a_reply_prints_keeps_what_was_shown(chat_model_dir, monkeypatch, capsys):
    """A SIGINT as a reply's second piece is about to be written: the piece is written, then the
    reply stops — and the history's assistant turn is exactly the text shown (no piece kept that
    the user never saw)."""
    import signal
    import colibri.cli
    import colibri.model

    conversations = []
    real_template = colibri.model.Model.apply_chat_template

    def recording_template(self, messages, *a, **kw):
        conversations.append([dict(m) for m in messages])
        return real_template(self, messages, *a, **kw)

    monkeypatch.setattr(colibri.model.Model, "apply_chat_template", recording_template)

    _two_messages_then_exit(monkeypatch)
    real_write, shown, turn = sys.stdout.write, [], {"pieces": 0}

    def write(text):
        if len(conversations) == 1 and text:  # the first reply's pieces
            turn["pieces"] += 1
            if turn["pieces"] == 2:
                signal.raise_signal(signal.SIGINT)  # before the piece is out
            shown.append(text)
        return real_write(text)

    monkeypatch.setattr(sys.stdout, "write", write)
    saved = signal.getsignal(signal.SIGINT)
    try:
        code = colibri.cli.main(["chat", "--model-dir", str(chat_model_dir), "--max-new-tokens", "6"])
    finally:
        signal.signal(signal.SIGINT, saved)
    err = capsys.readouterr().err
    assert code == 0 and "(reply stopped)" in err and len(conversations) == 2
    assert conversations[1][-2] == {"role": "assistant", "content": "".join(shown[:2])}


def test_ctrl_c_stops_the_reply_not_the_conversation(chat_model_dir, monkeypatch, capsys):
    """KeyboardInterrupt while a reply streams: the reply ends, the conversation goes on (the
    partial reply is kept in the history), /exit leaves with status 0."""
    import colibri.cli
    import colibri.model

    real_stream = colibri.model.Model.stream
    calls = []

    def interrupted_stream(self, prompt, *a, **kw):
        calls.append(list(prompt))
        pieces = real_stream(self, prompt, *a, **kw)
        if len(calls) == 1:

            def gen():
                yield next(pieces)
                raise KeyboardInterrupt

            return gen()
        return pieces

    monkeypatch.setattr(colibri.model.Model, "stream", interrupted_stream)

    _two_messages_then_exit(monkeypatch)
    code = colibri.cli.main(["chat", "--model-dir", str(chat_model_dir), "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 0 and "(reply stopped)" in err
    assert len(calls) == 2 and "hello world" in colibri.load(chat_model_dir).tokenizer.decode(calls[1])
