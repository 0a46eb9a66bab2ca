"""Interruptions and resources: a killed or out-of-space conversion leaves nothing half-written,
mmap=False gives the same results, a bad COLIBRI_ISA is a clear error, Ctrl-C at any moment of
the start is one line, and every hostile flag value or allocation too large is one line too.

Every error path's subprocess runs under an address-space limit (conftest.as_limit: RLIMIT_AS),
every in-process call under as much headroom (conftest.address_space_headroom), so an attempted
huge allocation fails the test instead of swapping the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import colibri
from colibri import cli
from colibri.cli import DEMO_DIR
from colibri.config import MAX_ROPE_TABLE
from conftest import (
    AS_LIMIT,
    ENV,
    FIXTURES,
    PACKAGE_ROOT,
    address_space_headroom,
    as_limit,
    big_checkpoint,
    colibri as run_cli,
    convert_cmd,
    one_line_error,
    reference,
)


@pytest.fixture(autouse=True)
def _headroom():
    """The in-process calls too: at most AS_LIMIT more address space than the process maps now."""
    with address_space_headroom():
        yield


@pytest.mark.parametrize("previous", [False, True])
def test_killed_conversion_leaves_nothing_or_the_previous_directory(tmp_path, previous):
    hf = big_checkpoint(tmp_path / "hf")
    out = tmp_path / "out"
    if previous:
        subprocess.run(convert_cmd(FIXTURES / "olmoe_a" / "hf", out), check=True, env=ENV, capture_output=True)
        before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    proc = subprocess.Popen(
        convert_cmd(hf, out, "--quantize", "int4", "--force"),
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        **as_limit(),
    )
    deadline = time.time() + 60
    killed_midway = False
    while time.time() < deadline and proc.poll() is None:
        tmps = list(tmp_path.glob(".out.tmp-*"))
        if tmps and len(list(tmps[0].rglob("*.bin"))) >= 3:
            proc.send_signal(signal.SIGKILL)
            killed_midway = True
            break
        time.sleep(0.002)
    proc.wait()
    assert killed_midway, "the conversion finished before it could be killed"
    if previous:
        after = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        assert after == before
    else:
        assert not out.exists()
    # the killed run's temporary directory is hidden, and the next conversion removes it
    subprocess.run(
        convert_cmd(FIXTURES / "olmoe_a" / "hf", tmp_path / "out", "--force"), check=True, env=ENV, capture_output=True
    )
    assert not list(tmp_path.glob(".out.tmp-*"))
    assert colibri.load(out).forward([1, 2, 3]).shape == (3, 128)


def _limit_file_size():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))


def test_full_disk_fails_cleanly(tmp_path):
    hf = big_checkpoint(tmp_path / "hf")
    out = tmp_path / "out"
    r = subprocess.run(
        convert_cmd(hf, out, "--quantize", "int8"),
        env=ENV,
        capture_output=True,
        text=True,
        **as_limit(then=_limit_file_size),
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr and "File too large" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_reading_instead_of_mapping_gives_the_same_logits(converted):
    ref = reference("qwen2moe_b")
    mapped = colibri.load(converted("qwen2moe_b", "int8")).forward(ref["input_ids"])
    read = colibri.load(converted("qwen2moe_b", "int8"), mmap=False).forward(ref["input_ids"])
    np.testing.assert_array_equal(mapped, read)


@pytest.mark.parametrize(
    "variable,value",
    [("COLIBRI_ISA", "avx9000"), ("COLIBRI_INT_STEP", "vnni9000"), ("COLIBRI_INT_STEP", "vnni-emulated")],
)
def test_bad_kernel_variable_is_one_clear_line(converted, variable, value):
    env = dict(ENV, **{variable: value})
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "run", "--model-dir", str(converted("mixtral_a")), "--tokens", "1,2"],
        env=env,
        capture_output=True,
        text=True,
        **as_limit(),
    )
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and value in r.stderr and "Traceback" not in r.stderr


def test_no_mmap_flag(converted):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "colibri",
            "run",
            "--model-dir",
            str(converted("mixtral_a")),
            "--tokens",
            "1,2",
            "--max-new-tokens",
            "3",
            "--no-mmap",
            "--ids",
        ],
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and len(r.stdout.split()) == 3, r.stderr


def test_ctrl_c_stops_generation_cleanly(tmp_path):
    hf = big_checkpoint(tmp_path / "hf")
    out = tmp_path / "m"
    subprocess.run(convert_cmd(hf, out), check=True, env=ENV, capture_output=True)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "colibri",
            "run",
            "--model-dir",
            str(out),
            "--tokens",
            "1,2,3",
            "--max-new-tokens",
            "4000",
            "--ignore-eos",
            "--ids",
            "--threads",
            "1",
        ],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **as_limit(),
    )
    seen = b""
    while seen.count(b" ") < 12:  # a few tokens are out
        chunk = proc.stdout.read1(4096)
        assert chunk, "generation ended before it could be interrupted"
        seen += chunk
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=30)
    text = (seen + rest).decode()
    assert proc.returncode == 130
    assert "Traceback" not in err.decode()
    generated = text.split("\n")[0].split()
    assert 0 < len(generated) < 4000
    assert f"Interrupted after {len(generated)} tokens" in err.decode()


@pytest.fixture
def sigint_restored():
    """cli.main installs its own SIGINT handler (it records the Ctrl-C and raises): put back pytest's."""
    saved = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, saved)


def _run_ids(model_dir, capsys):
    code = cli.main(
        [
            "run",
            "--model-dir",
            str(model_dir),
            "--tokens",
            "1,2,3",
            "--max-new-tokens",
            "8",
            "--ignore-eos",
            "--ids",
            "--threads",
            "1",
        ]
    )
    out, err = capsys.readouterr()
    return code, out.split("\n")[0].split(), err


def test_a_ctrl_c_after_a_token_is_sampled_counts_what_was_printed(converted, capsys, monkeypatch, sigint_restored):
    """A Ctrl-C between a token's sampling (the generation's record holds it) and its printing: the
    line says the ids printed, not the ids sampled (once 19 for 18)."""
    real = colibri.Model._generate

    def interrupted_after_sampling(self, *a, **k):
        for i, t in enumerate(real(self, *a, **k)):
            if i == 3:
                assert len(self.last_generation.tokens) == 4  # sampled and recorded, not printed
                raise KeyboardInterrupt
            yield t

    monkeypatch.setattr(colibri.Model, "_generate", interrupted_after_sampling)
    code, printed, err = _run_ids(converted("mixtral_a"), capsys)
    assert code == cli.EXIT_INTERRUPTED and len(printed) == 3
    assert "Interrupted after 3 tokens" in err


def test_a_ctrl_c_while_a_token_prints_comes_after_it(converted, capsys, monkeypatch, sigint_restored):
    """A SIGINT that arrives while a token is being written is raised once it is written and
    counted (signals_deferred): the line's count is still what was printed."""
    real_write, writes = sys.stdout.write, []

    def write_then_interrupt(text):
        writes.append(text)
        n = real_write(text)
        if len(writes) == 3:
            signal.raise_signal(signal.SIGINT)  # mid-block: before the flush and the count
        return n

    monkeypatch.setattr(sys.stdout, "write", write_then_interrupt)
    code, printed, err = _run_ids(converted("mixtral_a"), capsys)
    assert code == cli.EXIT_INTERRUPTED and len(printed) == 3
    assert "Interrupted after 3 tokens" in err


def test_deferred_signals_come_after_the_block_and_every_handler_is_put_back(monkeypatch):
    """signals_deferred: a signal raised inside the block runs its handler when the block ends (the
    block's statements after it still run); every handler is put back even when putting one back
    runs a pending handler that raises (CPython's signal.signal runs pending ones first)."""
    from colibri import interrupts

    ran, before = [], {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(KeyboardInterrupt):
        with interrupts.signals_deferred():
            signal.raise_signal(signal.SIGINT)
            ran.append("printed")
            ran.append("counted")
    assert ran == ["printed", "counted"]
    assert {s: signal.getsignal(s) for s in before} == before
    real_signal, restores = signal.signal, []

    def a_pending_sigint_during_the_second_restore(sig, handler):
        restores.append(sig)
        if len(restores) == 4:  # two installs, then the restores: the second one is hit
            raise KeyboardInterrupt
        return real_signal(sig, handler)

    monkeypatch.setattr(interrupts.signal, "signal", a_pending_sigint_during_the_second_restore)
    with pytest.raises(KeyboardInterrupt):
        with interrupts.signals_deferred():
            ran.append("whole")
    monkeypatch.undo()
    assert ran[-1] == "whole"
    assert restores == [signal.SIGINT, signal.SIGTERM, signal.SIGINT, signal.SIGTERM, signal.SIGTERM]  # retried
    assert {s: signal.getsignal(s) for s in before} == before  # SIGTERM's too, after the retry


@pytest.mark.parametrize("tensor", ["layers.1.experts.0.up", "layers.0.router", "lm_head"])
def test_nan_in_a_weight_file_is_reported_not_sampled(converted, tmp_path, tensor):
    """A damaged weight that keeps the file size: load succeeds, the first step says NaN."""
    d = tmp_path / "m"
    shutil.copytree(converted("mixtral_a"), d)
    t = json.loads((d / "config.json").read_text())["tensors"][tensor]
    nan = np.full(t["nbytes"] // 4, np.nan, np.float32).tobytes()
    with open(d / t["file"], "r+b") as f:
        f.seek(t["offset"])
        f.write(nan)
    with address_space_headroom():
        m = colibri.load(d)
        with pytest.raises(colibri.ColibriError, match="NaN or infinite.*verify"):
            list(m.generate(list(range(1, 20)), max_new_tokens=3))
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "run", "--model-dir", str(d), "--tokens", ",".join(map(str, range(1, 20)))],
        env=ENV,
        capture_output=True,
        text=True,
        **as_limit(),
    )
    assert r.returncode == 2 and "NaN or infinite" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "flag, value, named",
    [("--threads", "2147483648", "1..1024"), ("--expert-cache-mb", "inf", "inf"), ("--expert-cache-mb", "nan", "nan")],
)
def test_absurd_flag_values_are_one_line(converted, flag, value, named):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "colibri",
            "run",
            "--model-dir",
            str(converted("mixtral_a")),
            "--tokens",
            "1,2",
            flag,
            value,
        ],
        env=ENV,
        capture_output=True,
        text=True,
        **as_limit(),
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.splitlines()) == 1 and named in r.stderr, r.stderr


# ---- Ctrl-C while `python -m colibri` starts ------------------------------------------------------

# A sitecustomize that counts the imports from the package's first submodule on (colibri/__init__.py
# installs its guard before it) and sends this process SIGINT as import number SIGINT_AT_IMPORT
# begins: the interrupt lands at a chosen moment of the start, every time.
SIGINT_HOOK = r"""
import os, signal, sys

AT = int(os.environ.get("SIGINT_AT_IMPORT", "-1"))
LOG = os.environ.get("IMPORT_LOG")


class _InterruptAtImport:
    count = -1

    def find_spec(self, name, path=None, target=None):
        if self.count < 0 and not name.startswith("colibri."):
            return None
        self.count += 1
        if LOG:
            with open(LOG, "a") as f:
                f.write(name + "\n")
        if self.count == AT:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None


sys.meta_path.insert(0, _InterruptAtImport())
"""


def _interrupted_start(hook_dir: Path, at: int, log: Path | None = None):
    env = dict(ENV, PYTHONPATH=os.pathsep.join([str(hook_dir), str(PACKAGE_ROOT)]), SIGINT_AT_IMPORT=str(at))
    if log is not None:
        env["IMPORT_LOG"] = str(log)
    return subprocess.run(
        [sys.executable, "-m", "colibri", "info", "--model-dir", str(DEMO_DIR)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        **as_limit(),
    )


def test_ctrl_c_at_any_import_of_the_start_is_one_line(tmp_path):
    """SIGINT as each of a spread of the imports `python -m colibri info` makes begins (the package's
    own, numpy's, the compiled modules', the tokenizer's): status 130 and the one line, never a
    traceback; an interrupt that comes after the last import: a clean finish."""
    (tmp_path / "sitecustomize.py").write_text(SIGINT_HOOK)
    log = tmp_path / "imports.txt"
    first = _interrupted_start(tmp_path, -1, log)
    assert first.returncode == 0 and "architecture" in first.stdout, first.stderr
    imports = log.read_text().split()
    assert imports[0] == "colibri.errors" and "numpy" in imports and "colibri._engine" in imports, imports[:10]
    n = len(imports)
    chosen = sorted(
        set(range(min(8, n)))
        | set(range(0, n, max(1, n // 16)))
        | {n - 1, imports.index("numpy"), imports.index("colibri.cli"), imports.index("colibri._engine")}
    )
    for at in chosen:
        r = _interrupted_start(tmp_path, at)
        where = f"SIGINT as import {at} ({imports[at]}) began"
        assert "Traceback" not in r.stderr, f"{where}:\n{r.stderr}"
        assert r.returncode == 130, (where, r.returncode, r.stderr)
        assert r.stderr.strip() == "[INFO] Interrupted", (where, r.stderr)
    late = _interrupted_start(tmp_path, n + 10)  # never reached: the command finishes
    assert late.returncode == 0 and late.stdout == first.stdout, late.stderr


def test_ctrl_c_while_the_arguments_are_parsed_is_one_line(monkeypatch, capsys):
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["info", "--model-dir", str(DEMO_DIR)]) == 130
    assert capsys.readouterr().err.strip() == "[INFO] Interrupted"


def test_import_colibri_is_light_and_leaves_sigint_alone():
    """`import colibri` imports neither numpy nor the compiled modules and keeps Python's SIGINT
    handler (the start-up guard is only for `python -m colibri`); the public names still resolve."""
    code = (
        "import signal, sys\n"
        "import colibri\n"
        "assert signal.getsignal(signal.SIGINT) is signal.default_int_handler\n"
        "heavy = sorted(m for m in ('numpy', 'colibri._engine', 'colibri.model') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
        "assert colibri.ColibriError.__module__ == 'colibri.errors' and colibri.__version__\n"
        "from colibri import load, Model, ModelConfig\n"
        "assert load is colibri.load and Model.__name__ == 'Model' and ModelConfig.__name__ == 'ModelConfig'\n"
        "assert set(colibri.__all__) <= set(dir(colibri))\n"
        "assert colibri.modeldir.ModelDir and colibri._kernels.isa()\n"
        "try:\n"
        "    colibri.no_such_name\n"
        "except AttributeError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, **as_limit())
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# ---- allocations too large: refused up front, else one line --------------------------------------


def _demo_with(tmp_path: Path, **model) -> Path:
    d = Path(shutil.copytree(DEMO_DIR, tmp_path / "demo"))
    doc = json.loads((d / "config.json").read_text())
    doc["model"].update(model)
    (d / "config.json").write_text(json.dumps(doc))
    return d


def test_a_rope_table_past_the_bound_is_refused_before_allocation(tmp_path):
    """max_position_embeddings x head_dim (64) = 2 x MAX_ROPE_TABLE: `info` and `run --n-ctx` at that
    context refuse the config.json at once, naming the value (the former bound, 2^34, let it through
    to a 16 GB allocation)."""
    head_dim = json.loads((DEMO_DIR / "config.json").read_text())["model"]["head_dim"]
    positions = 2 * MAX_ROPE_TABLE // head_dim
    d = _demo_with(tmp_path, max_position_embeddings=positions)
    for args in (["info"], ["run", "--tokens", "1,2", "--n-ctx", positions]):
        t = time.perf_counter()
        line = one_line_error(
            run_cli(*args, "--model-dir", d, limit=AS_LIMIT),
            d / "config.json",
            f"max_position_embeddings ({positions})",
            "RoPE tables",
            str(MAX_ROPE_TABLE),
        )
        assert time.perf_counter() - t < 30, line


def test_an_allocation_that_fails_is_one_line_out_of_memory(tmp_path):
    """At the bound the RoPE tables are 4 GiB: under the 2 GiB address-space limit their allocation
    raises numpy's MemoryError subclass, and main() says "out of memory" in one line."""
    head_dim = json.loads((DEMO_DIR / "config.json").read_text())["model"]["head_dim"]
    positions = MAX_ROPE_TABLE // head_dim
    assert positions * head_dim * 4 > AS_LIMIT
    d = _demo_with(tmp_path, max_position_embeddings=positions)
    r = run_cli("run", "--model-dir", d, "--tokens", "1,2", "--n-ctx", positions, limit=AS_LIMIT)
    line = one_line_error(r, "error: out of memory: ", "while running run")
    assert "_ArrayMemoryError" not in line


def _numpy_memory_error():
    """numpy's own: a subclass of MemoryError (an exabyte: refused without being tried)."""
    try:
        np.empty(1 << 60, np.uint8)
    except MemoryError as e:
        assert type(e) is not MemoryError
        return e
    raise AssertionError("an exabyte was allocated")


@pytest.mark.parametrize(
    "error, named",
    [
        (MemoryError, "error: out of memory: no details"),
        (_numpy_memory_error, "error: out of memory: Unable to allocate"),
        (
            lambda: OverflowError("Python int too large to convert to C long"),
            "error: OverflowError: Python int too large",
        ),
        (
            lambda: RecursionError("maximum recursion depth exceeded"),
            "error: input nested too deeply: maximum recursion",
        ),
        (lambda: ValueError("a message\nof two lines"), "error: ValueError: a message of two lines"),
    ],
    ids=["MemoryError", "numpy's MemoryError", "OverflowError", "RecursionError", "ValueError of two lines"],
)
def test_each_resource_error_of_a_command_is_one_line(monkeypatch, capsys, error, named):
    def failing(args):
        raise error()

    monkeypatch.setattr(cli, "cmd_info", failing)
    assert cli.main(["info", "--model-dir", str(DEMO_DIR)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(named) and "while running info" in err, err


# ---- hostile values for every numeric flag of `run` ----------------------------------------------


def _numeric_run_flags() -> list:
    """The options of `run` whose value is a number (cli's types), by their first spelling."""
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    numeric = (int, float, cli._positive_int, cli._number)
    return sorted(a.option_strings[0] for a in sub.choices["run"]._actions if a.type in numeric)


NUMERIC_RUN_FLAGS = _numeric_run_flags()

hostile_values = st.one_of(
    st.sampled_from(
        [
            "0",
            "-1",
            "1",
            "2",
            "3",
            "64",
            "512",
            "513",
            "1024",
            "1025",
            "2147483648",
            "2147483649",
            str(2**63),
            str(2**64),
            "9" * 400,
            "9" * 5000,
            "1e400",
            "-1e400",
            "1e-400",
            "5e-324",
            "1e308",
            "1e-300",
            "nan",
            "-nan",
            "NaN",
            "inf",
            "-inf",
            "Infinity",
            "",
            " ",
            "abc",
            "1.5",
            "0.5",
            "-0.0",
            "0x10",
            "1_000",
            "+3",
            " 7 ",
            "\u0663",
            "\uff11",
            "None",
            "True",
        ]
    ),
    st.integers(-(2**80), 2**80).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=6),
)


def test_the_numeric_flags_are_the_ones_the_issue_names():
    assert {
        "--threads",
        "--n-ctx",
        "--max-new-tokens",
        "--temperature",
        "--top-p",
        "--top-k",
        "--min-p",
        "--expert-cache-mb",
        "--memory-limit-mb",
        "--seed",
    } <= set(NUMERIC_RUN_FLAGS), NUMERIC_RUN_FLAGS


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)  # _headroom
@given(pairs=st.lists(st.tuples(st.sampled_from(NUMERIC_RUN_FLAGS), hostile_values), min_size=1, max_size=2))
def test_hostile_numeric_flag_values_are_one_line_or_run(pairs):
    """`run` on the bundled demo model with hostile values (as the shell passes them: strings) for
    one or two numeric flags: status 0 (nothing on stderr under --quiet) or 2 with one stderr line;
    never a traceback, a crash or another status."""
    args = ["run", "--tokens", "1,2", "--max-new-tokens", "2", "--ids", "--quiet"]
    args += [f"{flag}={value}" for flag, value in pairs]
    note(repr(args))
    r = run_cli(*args, timeout=120, limit=AS_LIMIT)
    assert "Traceback" not in r.stderr, r.stderr
    if r.returncode == 0:
        assert r.stderr == "" and r.stdout.strip(), (r.stdout, r.stderr)
    else:
        one_line_error(r)


def test_threads_that_cannot_be_created_are_one_line():
    """1024 threads (the accepted bound) need 8 GiB of stacks: under the 2 GiB limit most cannot be
    created, which must be one line, status 2."""
    r = run_cli(
        "run", "--tokens", "1,2", "--max-new-tokens", "2", "--ids", "--quiet", "--threads", "1024", limit=AS_LIMIT
    )
    one_line_error(r, "thread")


def test_a_tiny_repetition_penalty_is_one_line():
    one_line_error(
        run_cli(
            "run",
            "--tokens",
            "1,2",
            "--max-new-tokens",
            "2",
            "--ids",
            "--quiet",
            "--repetition-penalty=1e-300",
            limit=AS_LIMIT,
        ),
        "repetition_penalty",
    )


def test_a_tiny_temperature_is_greedy_and_silent():
    r = run_cli(
        "run", "--tokens", "1,2", "--max-new-tokens", "2", "--ids", "--quiet", "--temperature=5e-324", limit=AS_LIMIT
    )
    greedy = run_cli("run", "--tokens", "1,2", "--max-new-tokens", "2", "--ids", "--quiet", limit=AS_LIMIT)
    assert r.returncode == 0 and r.stdout == greedy.stdout
    assert r.stderr == "", r.stderr
