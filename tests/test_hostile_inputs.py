"""Hostile inputs (issue 70): files and texts made to crash, hang or exhaust the engine's readers.

Each defect class has its test: importance files (`convert --importance`: cut short, of the wrong
shapes, zip bombs), tokenizer.json files that make the Rust `tokenizers` panic, chat templates
that loop without end, and `tokenizer --from` stopped by SIGTERM or refusing a file. The contract:
one line naming the user's file or value, a non-zero status, no traceback, no hang, nothing left
half-written. Budgets are counted, not timed: no test here measures time.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import colibri
from colibri import ColibriError, calibrate, chat
from colibri.chat import ChatTemplate
from colibri.convert import convert
from colibri.textfiles import STAGING_NAME
from colibri.tokenizer import HFTokenizer
from conftest import AS_LIMIT, FIXTURES, PACKAGE_ROOT, REPO, colibri as run_cli, one_line_error, reference

HF = FIXTURES / "mixtral_a" / "hf"
USER = [{"role": "user", "content": "hi"}]


def limited(*args, **kwargs):
    return run_cli(*args, limit=AS_LIMIT, **kwargs)


def _model_copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "model"))


# ---- importance files (convert --importance) --------------------------------------------------------


@pytest.fixture(scope="module")
def importance_bytes(tmp_path_factory, converted):
    """A real calibrate file of mixtral_a: mean squares, counts and whole second moments."""
    m = colibri.load(
        converted("mixtral_a", "f32"),
        capture_inputs=True,
        second_moments=lambda shapes: calibrate.second_moment_names(shapes, "dense")[0],
    )
    m.forward(reference("mixtral_a")["input_ids"])
    path = tmp_path_factory.mktemp("importance") / "imp.npz"
    calibrate.save(
        {
            "tensors": calibrate.summarize(m.input_stats),
            "grams": calibrate.summarize_grams(m.input_grams, m.input_stats),
            "meta": {"model_dir": "x", "architecture": "x", "tokens": 1, "ctx": 1},
        },
        path,
    )
    return path.read_bytes()


def _arrays(data: bytes) -> dict:
    with np.load(io.BytesIO(data)) as z:
        return {k: z[k] for k in z.files}


def _load_all(path) -> dict:
    """load_importance, then every array read as convert reads it."""
    return {k: np.asarray(v) for k, v in calibrate.load_importance(path).items()}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.floats(0.0, 0.999))
def test_an_importance_file_cut_short_is_refused_naming_it(importance_bytes, tmp_path, cut):
    path = tmp_path / "cut.npz"
    path.write_bytes(importance_bytes[: int(len(importance_bytes) * cut)])
    with pytest.raises(ColibriError, match=str(path)):
        _load_all(path)


SHAPES = st.lists(st.integers(0, 80), max_size=3).map(tuple)
DTYPES = st.sampled_from([np.float32, np.float64, np.int64, np.int32, ">f4", np.float16])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["mean_sq", "count", "gram"]), shape=SHAPES, dtype=DTYPES, data=st.data())
def test_an_importance_member_of_any_shape_loads_as_calibrate_wrote_it_or_is_refused(
    importance_bytes, tmp_path, kind, shape, dtype, data
):
    """A member of one tensor replaced by an array of any shape and dtype: either the file still
    reads as a calibrate file (each array of the shape its header declares, float32, finite) or
    the error is one ColibriError naming the file: never numpy's or zipfile's exceptions."""
    arrays = _arrays(importance_bytes)
    name = data.draw(st.sampled_from(sorted(k.split("/", 1)[1] for k in arrays if k.startswith(kind + "/"))))
    arrays[f"{kind}/{name}"] = np.ones(shape, dtype)
    path = tmp_path / "member.npz"
    np.savez(path, **arrays)
    try:
        loaded = _load_all(path)
    except ColibriError as e:
        assert str(path) in str(e)
        return
    for n, v in loaded.items():
        assert v.dtype == np.float32 and v.ndim in (1, 2) and np.isfinite(v).all(), n


@pytest.mark.parametrize(
    "meta",
    [np.array(json.dumps([1, 2])), np.array(json.dumps("colibri-importance-1")), np.arange(3), np.array(b"{}")],
    ids=["list", "string", "ints", "bytes"],
)
def test_an_importance_meta_of_another_type_is_refused(importance_bytes, tmp_path, meta):
    arrays = _arrays(importance_bytes)
    arrays["meta"] = meta
    path = tmp_path / "meta.npz"
    np.savez(path, **arrays)
    with pytest.raises(ColibriError, match="not a Colibri importance file"):
        calibrate.load_importance(path)


def test_importance_files_that_are_not_calibrate_s_are_one_line(importance_bytes, tmp_path):
    plain = tmp_path / "plain.npy"
    np.save(plain, np.ones(3, np.float32))
    counts = tmp_path / "counts.npz"
    arrays = _arrays(importance_bytes)
    arrays["count/layers.0.wq"] = np.arange(3)
    np.savez(counts, **arrays)
    for path, says in ((plain, "not a Colibri importance file"), (counts, "count/layers.0.wq")):
        out = tmp_path / f"out-{path.stem}"
        proc = limited("convert", "--hf-dir", HF, "--output-dir", out, "--quantize", "int4", "--importance", path)
        one_line_error(proc, path, says)
        assert not out.exists()


def _bomb(path: Path, arrays: dict, name: str, shape: tuple) -> None:
    """`arrays` and a deflated member of zeros `name` of float32 `shape`: a small file that
    declares a large array (64 MB for [4096, 4096], about 64 kB on disk)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for key, a in arrays.items():
            with z.open(key + ".npy", "w") as f:
                np.lib.format.write_array(f, a)
        with z.open(name + ".npy", "w", force_zip64=True) as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": shape})
            left = int(np.prod(shape)) * 4
            zeros = bytes(1 << 20)
            while left:
                f.write(zeros[: min(left, len(zeros))])
                left -= min(left, len(zeros))


def test_an_importance_zip_bomb_is_never_read(importance_bytes, tmp_path, monkeypatch):
    """Members convert does not use are never read (an unused 64 MB array: the conversion runs and
    reads the members of its matrices only); a used tensor whose declared shape is not its
    matrix's is refused before a byte of it is read; a shape past MAX_COLS is refused at load."""
    arrays = _arrays(importance_bytes)
    read = []
    real = calibrate._read_member
    monkeypatch.setattr(calibrate, "_read_member", lambda z, info: read.append(info.filename) or real(z, info))
    unused = tmp_path / "unused.npz"
    _bomb(unused, {**arrays, "count/unused": np.array(5, np.int64)}, "gram/unused", (4096, 4096))
    assert unused.stat().st_size < 2 << 20
    convert(HF, tmp_path / "a", quantize="int4", importance=unused, log=lambda *a: None)
    assert any(name.startswith("gram/") for name in read) and "gram/unused.npy" not in read

    read.clear()
    used = tmp_path / "used.npz"
    for part in ("wq", "wk", "wv"):  # the matrices that share the input, and its second moment
        arrays[f"mean_sq/layers.0.{part}"] = np.ones(4096, np.float32)
    _bomb(used, {k: v for k, v in arrays.items() if k != "gram/layers.0.wq"}, "gram/layers.0.wq", (4096, 4096))
    with pytest.raises(ColibriError, match="another model"):
        convert(HF, tmp_path / "b", quantize="int4", importance=used, log=lambda *a: None)
    assert "gram/layers.0.wq.npy" not in read and not (tmp_path / "b").exists()

    huge = tmp_path / "huge.npz"
    _bomb(huge, arrays, "mean_sq/unused", (calibrate.MAX_COLS + 1,))
    with pytest.raises(ColibriError, match="mean_sq/unused"):
        calibrate.load_importance(huge)


def test_damaged_statistics_found_while_converting_remove_the_output(importance_bytes, tmp_path):
    """A used member whose values are damaged (NaN in a second moment) is found when its matrix is
    quantized: one line naming the file and the member, and no output directory."""
    arrays = _arrays(importance_bytes)
    gram = arrays["gram/layers.0.wq"].copy()
    gram[0, 0] = np.nan
    arrays["gram/layers.0.wq"] = gram
    path = tmp_path / "nan.npz"
    np.savez(path, **arrays)
    out = tmp_path / "out"
    proc = limited("convert", "--hf-dir", HF, "--output-dir", out, "--quantize", "int4", "--importance", path)
    one_line_error(proc, path, "gram/layers.0.wq", "damaged")
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


# ---- tokenizer.json files the Rust tokenizers library panics on ---------------------------------------

BACKTRACKING = "(a|a)+$"  # exponential backtracking: oniguruma's retry limit makes tokenizers panic


def _hostile_tokenizer(chat_hf: Path, where: Path, **changes) -> Path:
    tok = json.loads((chat_hf / "tokenizer.json").read_text(encoding="utf-8"))
    tok.update(changes)
    where.mkdir(parents=True, exist_ok=True)
    (where / "tokenizer.json").write_text(json.dumps(tok), encoding="utf-8")
    return where


MISSING_TOKEN = {  # a post-processor naming a special token it does not define: a panic at load
    "type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {},
}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(0, 3000), tail=st.sampled_from(["", "c", " b", "\n"]))
def test_a_tokenizer_panic_on_a_text_is_a_colibri_error(chat_hf, tmp_path_factory, n, tail):
    """Whatever the text, a tokenizer whose normalizer backtracks without end gives ids or one
    ColibriError naming the file, never pyo3's PanicException (a BaseException)."""
    where = tmp_path_factory.mktemp("norm")
    pattern = {"type": "Replace", "pattern": {"Regex": BACKTRACKING}, "content": "b"}
    tok = HFTokenizer(_hostile_tokenizer(chat_hf, where, normalizer=pattern) / "tokenizer.json")
    try:
        ids = tok.encode("a" * n + tail)
    except ColibriError as e:
        assert str(where / "tokenizer.json") in str(e) and "backtracks" in str(e)
    else:
        assert all(isinstance(i, int) for i in ids)
    assert tok.encode("hello world")  # the tokenizer still works after a panic


def test_tokenizer_panics_are_one_line_in_the_cli(chat_hf, chat_model_dir, tmp_path, monkeypatch):
    """At load (`tokenizer --from`): the line names the user's file, not a staged copy; at encode
    (`run --prompt`): the line names the model's file. Rust's own panic lines (and backtrace,
    RUST_BACKTRACE=1) are not printed."""
    monkeypatch.setenv("RUST_BACKTRACE", "1")  # the conftest helper passes the environment on
    d = _model_copy(chat_model_dir, tmp_path)
    src = _hostile_tokenizer(chat_hf, tmp_path / "src", post_processor=MISSING_TOKEN)
    line = one_line_error(limited("tokenizer", "--model-dir", d, "--from", src), src / "tokenizer.json")
    assert STAGING_NAME not in line and not (d / STAGING_NAME).exists()
    split = {"type": "Split", "pattern": {"Regex": BACKTRACKING}, "behavior": "Isolated", "invert": False}
    src = _hostile_tokenizer(chat_hf, tmp_path / "src2", pre_tokenizer=split)
    assert run_cli("tokenizer", "--model-dir", d, "--from", src).returncode == 0  # it loads: the text decides
    proc = limited("run", "--model-dir", d, "--prompt", "a" * 3000 + "c", "--max-new-tokens", 1)
    one_line_error(proc, d / "tokenizer.json", "failed on this text")


# ---- chat templates that loop without end ----------------------------------------------------------


def test_nested_loops_are_stopped_by_the_step_budget(monkeypatch):
    """A render takes TEMPLATE_MAX_STEPS + TEMPLATE_STEPS_PER_PAIR * n^2 steps (n: messages and
    tools); loops are counted whatever their shape: nested, filtered, recursive."""
    monkeypatch.setattr(chat, "TEMPLATE_MAX_STEPS", 1000)
    limit = 1000 + chat.TEMPLATE_STEPS_PER_PAIR
    items = str(list(range(40)))  # a literal: no range() or repetition steps, the loops' own only
    hostile = {
        "nested": "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}",
        "filtered": f"{{% for a in {items} %}}{{% for b in {items} if false %}}{{% endfor %}}{{% endfor %}}",
        "recursive": "{% for x in [1, 2] recursive %}{% if loop.depth < 12 %}{{ loop([1, 2]) }}{% endif %}{% endfor %}",
        "range": "{% for a in [1, 2] %}{{ range(1000) | sum }}{% endfor %}",
        "repetition": "{% for a in [1, 2] %}{{ ('x' * 1000) | length }}{% endfor %}",
    }
    for source in hostile.values():
        with pytest.raises(ColibriError, match=rf"t\.jinja\) was stopped: more than {limit:,} steps"):
            ChatTemplate(source, "t.jinja").render(USER)


@settings(max_examples=60, deadline=None)
@given(a=st.integers(0, 60), b=st.integers(0, 60), n=st.integers(1, 4))
def test_the_step_budget_is_exact(a, b, n):
    """range(k) takes k steps, each loop item one: 2a + 2ab steps for an a x b nested loop, which
    renders iff they fit the budget of n messages (TEMPLATE_MAX_STEPS lowered by the test)."""
    source = "{% for i in range(" + str(a) + ") %}{% for j in range(" + str(b) + ") %}x{% endfor %}{% endfor %}"
    saved = chat.TEMPLATE_MAX_STEPS
    chat.TEMPLATE_MAX_STEPS = 2000
    try:
        limit = 2000 + chat.TEMPLATE_STEPS_PER_PAIR * n * n
        t = ChatTemplate(source, "t.jinja")
        if 2 * a + 2 * a * b <= limit:
            assert t.render(USER * n) == "x" * (a * b)
        else:
            with pytest.raises(ColibriError, match="t.jinja"):
                t.render(USER * n)
    finally:
        chat.TEMPLATE_MAX_STEPS = saved


def test_a_render_past_the_character_bound_is_stopped(monkeypatch):
    monkeypatch.setattr(chat, "TEMPLATE_MAX_CHARS", 100)
    t = ChatTemplate("{% for i in range(101) %}x{% endfor %}", "t.jinja")
    with pytest.raises(ColibriError, match="more than 100 characters"):
        t.render(USER)
    assert ChatTemplate("{% for i in range(100) %}x{% endfor %}", "t").render(USER) == "x" * 100


def test_a_looping_template_is_one_line_in_run_and_chat(chat_model_dir, tmp_path):
    """`tokenizer --from` takes the template (it compiles); `run --chat` stops its render with one
    line naming it; `chat` says the same line and goes on reading."""
    d = _model_copy(chat_model_dir, tmp_path)
    src = tmp_path / "src"
    src.mkdir()
    (src / "chat_template.jinja").write_text(
        "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}", encoding="utf-8"
    )
    assert run_cli("tokenizer", "--model-dir", d, "--from", src).returncode == 0
    proc = limited("run", "--model-dir", d, "--chat", "--prompt", "hi", "--max-new-tokens", 1)
    one_line_error(proc, d / "chat_template.jinja", "was stopped", "steps")
    proc = subprocess.run(
        [sys.executable, "-m", "colibri", "chat", "--model-dir", str(d), "--quiet"],
        input="hi\n",
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(PACKAGE_ROOT)},
        cwd=str(REPO),
    )
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert str(d / "chat_template.jinja") in proc.stderr and "was stopped" in proc.stderr


# ---- tokenizer --from: SIGTERM and the names in its errors ------------------------------------------

_TERMINATED_IMPORT = """
import os, signal, sys
import colibri.textfiles as textfiles
from colibri.cli import main

load = textfiles.TextSide.load


def terminated(*args, **kwargs):  # SIGTERM while the staged files are validated
    os.kill(os.getpid(), signal.SIGTERM)
    return load(*args, **kwargs)


textfiles.TextSide.load = terminated
sys.exit(main(["tokenizer", "--model-dir", sys.argv[1], "--from", sys.argv[2]]))
"""


@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or os.name != "posix", reason="POSIX signals")
def test_sigterm_during_tokenizer_import_leaves_the_model_directory_as_it_was(chat_model_dir, chat_hf, tmp_path):
    d = _model_copy(chat_model_dir, tmp_path)
    before = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
    proc = subprocess.run(
        [sys.executable, "-c", _TERMINATED_IMPORT, str(d), str(chat_hf)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(PACKAGE_ROOT)},
    )
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert "Traceback" not in proc.stderr
    assert {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()} == before
    assert not (d / STAGING_NAME).exists()


def test_tokenizer_import_errors_name_the_user_s_files(chat_model_dir, tmp_path):
    d = _model_copy(chat_model_dir, tmp_path)
    src = tmp_path / "src"
    src.mkdir()
    for name, text in (
        ("chat_template.jinja", "{% for x in %}"),
        ("tokenizer_config.json", "[1, 2]"),
        ("tokenizer.json", "{not json"),
    ):
        for p in src.iterdir():
            p.unlink()
        (src / name).write_text(text, encoding="utf-8")
        line = one_line_error(limited("tokenizer", "--model-dir", d, "--from", src), src / name)
        assert STAGING_NAME not in line
    assert not (d / STAGING_NAME).exists()


@pytest.mark.parametrize(
    "source, bound",
    [
        ('{{ "x" | center(400000000) }}', "a text of more than"),
        ('{{ "x" | indent(400000000) }}', "a text of more than"),
        ('{{ "x".ljust(400000000) }}', "a text of more than"),
        ('{{ "x".zfill(400000000) }}', "a text of more than"),
        ('{{ "%0400000000d" % 1 }}', "a format width of more than"),
        ('{{ "%0400000000d" | format(1) }}', "a format width of more than"),
        ('{{ "{:>400000000}".format(1) }}', "a format width of more than"),
    ],
)
def test_a_width_past_the_character_bound_is_refused_before_the_text_is_built(source, bound):
    """One operation that would build a text of hundreds of megabytes (a padding filter or method,
    a format width) is stopped before it runs, not after the text exists."""
    tracemalloc.start()
    try:
        with pytest.raises(ColibriError, match=rf"t\.jinja\) was stopped: {bound}"):
            ChatTemplate(source, "t.jinja").render(USER)
        assert tracemalloc.get_traced_memory()[1] < 16 << 20
    finally:
        tracemalloc.stop()


def test_widths_and_numbers_a_template_uses_still_render():
    source = (
        '{{ "%05d" % 3 }}|{{ "{:>5}".format(1) }}|{{ "ab" | center(6) }}|{{ "%d" | format(1733600000) }}|'
        '{{ "{}".format(1733600000) }}|{{ "x".rjust(3) }}|{{ messages[0].content | indent(2) }}'
    )
    assert ChatTemplate(source, "t").render(USER) == "00003|    1|  ab  |1733600000|1733600000|  x|hi"


def test_a_gguf_s_text_file_errors_name_the_gguf_not_the_staging(tmp_path, monkeypatch):
    from colibri.gguf_import import GGUFCheckpoint

    def broken_template(self, where, vocab_size):
        (Path(where) / "chat_template.jinja").write_text("{% for %}")
        return ["chat_template.jinja"]

    monkeypatch.setattr(GGUFCheckpoint, "write_text_files", broken_template)
    gguf = FIXTURES / "gguf" / "mixtral_a-Q8_0.gguf"
    with pytest.raises(ColibriError) as e:
        convert(None, tmp_path / "out", gguf=gguf, log=lambda *a: None)
    assert str(gguf) in str(e.value) and "colibri-gguf-text-" not in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists()
