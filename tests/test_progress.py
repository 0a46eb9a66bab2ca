"""colibri.progress: a bar on a terminal, plain periodic lines elsewhere, always on stderr; and the
commands that show it (convert, verify, eval, calibrate) with their stdout as it was."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest

from colibri import progress as progress_module
from colibri.cli import DEMO_DIR
from colibri.convert import convert
from colibri.progress import duration, progress, size
from conftest import FIXTURES, PACKAGE_ROOT, REPO

HF = FIXTURES / "qwen3moe_a" / "hf"
TEXT = (
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, "
    "conceived in Liberty, and dedicated to the proposition that all men are created equal. "
) * 4


class Clock:
    """A fake monotonic clock the test moves by hand."""

    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture(autouse=True)
def no_progress_env(monkeypatch):
    monkeypatch.delenv(progress_module.ENV, raising=False)


def env(**extra):
    e = {k: v for k, v in os.environ.items() if k not in (progress_module.ENV, "PYTHONWARNINGS")}
    e["PYTHONPATH"] = str(PACKAGE_ROOT)
    return {**e, **extra}


def cli(*args, **extra_env):
    return subprocess.run(
        [sys.executable, "-m", "colibri", *map(str, args)],
        capture_output=True,
        text=True,
        env=env(**extra_env),
        timeout=300,
        cwd=str(REPO),
    )


def test_plain_lines_at_the_interval_with_percentage_rate_and_time_left(capsys):
    stream, clock = io.StringIO(), Clock()
    with progress(400e6, "convert", unit="B", stream=stream, interval=10, clock=clock) as p:
        clock.t += 4
        p.update(40e6)
        assert stream.getvalue() == ""  # within the interval: nothing yet
        clock.t += 6
        p.update(60e6)  # 10 s: 100 MB of 400
        clock.t += 5
        p.update(50e6)  # 15 s: not again before 20 s
        clock.t += 5
        p.update(50e6)  # 20 s: 200 MB of 400
    lines = stream.getvalue().splitlines()
    assert lines == [
        "[INFO] convert: 100 MB / 400 MB (25 %), 10.0 MB/s, 30 s left",
        "[INFO] convert: 200 MB / 400 MB (50 %), 10.0 MB/s, 20 s left",
        "[INFO] convert: 200 MB / 400 MB (50 %), 10.0 MB/s, 20 s",
    ]  # the end line: time taken
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""  # only the stream given


def test_counted_units_and_at():
    stream, clock = io.StringIO(), Clock()
    with progress(8, "eval", unit="chunk", stream=stream, interval=10, clock=clock) as p:
        for i in range(1, 9):
            clock.t += 5
            p.at(i)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[INFO] eval: 2 / 8 chunks (25 %), 0.2 chunk/s, 30 s left"
    assert lines[1:] == [
        "[INFO] eval: 4 / 8 chunks (50 %), 0.2 chunk/s, 20 s left",
        "[INFO] eval: 6 / 8 chunks (75 %), 0.2 chunk/s, 10 s left",
        "[INFO] eval: 8 / 8 chunks (100 %), 0.2 chunk/s, 40 s",
    ]  # at 100 %: the end line only


def test_initial_units_are_not_in_the_rate():
    stream, clock = io.StringIO(), Clock()
    with progress(10, "calibrate", unit="chunk", stream=stream, interval=10, clock=clock, initial=1) as p:
        clock.t += 10
        p.at(3)
    assert stream.getvalue().splitlines()[0] == "[INFO] calibrate: 3 / 10 chunks (30 %), 0.2 chunk/s, 35 s left"


def test_stderr_by_default_never_stdout(capsys):
    clock = Clock()
    with progress(10, "verify", unit="file", clock=clock) as p:
        clock.t += 1
        p.update(10)
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == "[INFO] verify: 10 / 10 files (100 %), 10 file/s, 1.0 s\n"


def test_an_exception_prints_no_end_line():
    stream = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        with progress(10, "convert", unit="B", stream=stream, clock=Clock()) as p:
            p.update(3)
            raise KeyboardInterrupt
    assert stream.getvalue() == ""


def test_off_by_argument_or_environment(monkeypatch):
    for stream in (io.StringIO(), Terminal()):
        with progress(10, "convert", unit="B", stream=stream, enabled=False) as p:
            p.update(10)
        assert stream.getvalue() == ""
    monkeypatch.setenv(progress_module.ENV, "0")
    for stream in (io.StringIO(), Terminal()):
        with progress(10, "convert", unit="B", stream=stream) as p:
            p.update(10)
        assert stream.getvalue() == ""


def test_a_terminal_gets_a_tqdm_bar(capsys):
    tty = Terminal()
    with progress(2_000_000, "convert", unit="B", stream=tty) as p:
        p.update(1_000_000)
        p.update(1_000_000)
    text = tty.getvalue()
    assert "\r" in text and "convert" in text and "100%" in text and "2.00M/2.00M" in text and "B/s" in text, text
    assert "[INFO]" not in text  # the bar, not the plain lines
    assert capsys.readouterr().out == ""


def test_an_exception_wipes_the_bar():
    tty = Terminal()
    with pytest.raises(ValueError):
        with progress(10, "convert", unit="B", stream=tty) as p:
            p.update(3)
            raise ValueError
    assert tty.getvalue().endswith("\r"), repr(tty.getvalue())  # the line cleared, no newline left


def test_lines_forced_on_a_terminal(monkeypatch):
    monkeypatch.setenv(progress_module.ENV, "lines")
    tty = Terminal()
    with progress(4, "eval", unit="chunk", stream=tty, clock=Clock()) as p:
        p.update(4)
    assert tty.getvalue() == "[INFO] eval: 4 / 4 chunks (100 %), 0.0 s\n"


def test_sizes_and_durations():
    assert [size(n) for n in (950, 12_345, 210e6, 1.25e9, 40e9)] == ["950 B", "12.3 kB", "210 MB", "1.25 GB", "40.0 GB"]
    assert [duration(s) for s in (0.42, 45, 131, 3900)] == ["0.4 s", "45 s", "2 min 11 s", "1 h 05 min"]


def test_the_python_api_stays_silent(tmp_path, capfd):
    convert(HF, tmp_path / "out", quantize="int8", log=lambda *a: None)
    out = capfd.readouterr()
    assert out.out == "" and out.err == ""


LINE = re.compile(r"\[INFO\] convert: [\d.]+ kB / [\d.]+ kB \(100 %\), [\d.]+ [kMG]?B/s, [\d.]+ s")


def test_convert_cli_progress_on_stderr_stdout_as_before(tmp_path):
    on = cli("convert", "--hf-dir", HF, "--output-dir", tmp_path / "a", "--quantize", "int4")
    assert on.returncode == 0, on.stderr
    lines = on.stderr.splitlines()
    assert len(lines) == 1 and LINE.fullmatch(lines[0]), on.stderr
    assert "convert:" not in on.stdout and "Converted" in on.stdout
    off = cli("convert", "--hf-dir", HF, "--output-dir", tmp_path / "b", "--quantize", "int4", COLIBRI_PROGRESS="0")
    assert off.returncode == 0 and off.stderr == "", off.stderr
    assert off.stdout == on.stdout.replace(str(tmp_path / "a"), str(tmp_path / "b"))


def test_verify_and_eval_cli_progress_on_stderr(converted, tmp_path):
    d = converted("mixtral_a")
    v = cli("verify", "--model-dir", d)
    assert v.returncode == 0, v.stderr
    assert re.fullmatch(r"\[INFO\] verify: \S+ \S+ / \S+ \S+ \(100 %\), .*\n", v.stderr), v.stderr
    assert v.stdout.startswith("[INFO] OK: ") and "verify:" not in v.stdout
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    e = cli("eval", "--model-dir", d, "--text", text, "--ctx", "64", "--json")
    assert e.returncode == 0, e.stderr
    assert re.search(r"^\[INFO\] eval: (\d+) / \1 chunks \(100 %\)", e.stderr, re.M), e.stderr
    assert e.stdout.startswith("{") and len(e.stdout.splitlines()) == 1  # the JSON alone


def test_calibrate_cli_progress_on_stderr(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("In the beginning God created the heaven and the earth. " * 40, encoding="utf-8")
    r = cli("calibrate", "--model-dir", DEMO_DIR, "--text", text, "--output", tmp_path / "i.npz", "--ctx", "64")
    assert r.returncode == 0, r.stderr
    assert re.search(r"^\[INFO\] calibrate: (\d+) / \1 chunks \(100 %\)", r.stderr, re.M), r.stderr
    assert r.stdout == ""


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_convert_on_a_terminal_draws_the_bar_even_when_it_says_it_is_0_by_0(tmp_path):
    """stderr a fresh pty (0 columns, 0 rows, as `docker run -t` gives at first): tqdm would draw
    nothing at that size; the bar is drawn 80 columns wide. stdout stays the log."""
    primary, secondary = os.openpty()
    try:
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "colibri",
                "convert",
                "--hf-dir",
                str(HF),
                "--output-dir",
                str(tmp_path / "out"),
                "--quantize",
                "int4",
            ],
            stdout=subprocess.PIPE,
            stderr=secondary,
            env=env(),
            timeout=300,
            cwd=str(REPO),
        )
    finally:
        os.close(secondary)
    data = b""
    while True:
        try:
            chunk = os.read(primary, 1 << 16)
        except OSError:  # Linux: EIO once the other side is closed
            break
        if not chunk:
            break
        data += chunk
    os.close(primary)
    err = data.decode("utf-8", "replace")
    assert p.returncode == 0, err
    assert "\rconvert: 100%|" in err and "B/s]" in err and "[INFO]" not in err, err
    assert b"Converted" in p.stdout and b"convert:" not in p.stdout
