"""--force and the output directory: what may be replaced, and what a failure leaves.

The rule (convert._write_model_dir): --force replaces only a Colibri model directory, never the
input, a directory containing it or one inside it, never through a symbolic link; a non-empty
directory that is not a Colibri one is refused even with --force. A refusal is one line on stderr
and exit status 2, and every file is byte-identical afterwards (the whole test directory is hashed
before and after, so a leftover temporary directory shows too). SIGTERM and a full disk clean up
like Ctrl-C: no temporary directory, the previous output as it was.

Every subprocess runs under an address-space limit (conftest.as_limit), every in-process call under
a headroom of as much (conftest.address_space_headroom): an attempted huge allocation fails the
test instead of swapping the machine.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import colibri
from colibri.cli import main
from colibri.convert import convert, relayout
from colibri.modeldir import ModelDirWriter
from conftest import ENV, FIXTURES, address_space_headroom, as_limit, big_checkpoint, convert_cmd

SILENT = dict(log=lambda *a: None)


def snapshot(root: Path) -> dict:
    """Every entry under root: files by sha256, links by target, directories by name."""
    seen = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                seen[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                seen[rel] = ("dir",)
            else:
                seen[rel] = ("file", hashlib.sha256(p.read_bytes()).hexdigest())
    return seen


@pytest.fixture(autouse=True)
def _headroom():
    with address_space_headroom():
        yield


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "colibri", *map(str, args)], env=ENV, capture_output=True, text=True, **as_limit()
    )


def refused(proc, *named) -> str:
    """The user-error contract: status 2, exactly one stderr line, naming each of `named`."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for text in named:
        assert str(text) in lines[0], f"{text!r} not named in {lines[0]!r}"
    return lines[0]


def temporaries(parent: Path) -> list:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


@pytest.fixture
def hf(tmp_path):
    """A checkpoint (with tokenizer.model and generation_config.json) at tmp_path/P/hf."""
    return Path(shutil.copytree(FIXTURES / "mixtral_a" / "hf", tmp_path / "P" / "hf"))


@pytest.fixture
def model(tmp_path):
    """A Colibri model directory at tmp_path/P/m."""
    out = tmp_path / "P" / "m"
    convert(FIXTURES / "mixtral_a" / "hf", out, **SILENT)
    return out


# ---- what --force may not replace ----------------------------------------------------------------


@pytest.mark.parametrize("force", [False, True])
def test_convert_output_is_the_input(tmp_path, hf, force):
    before = snapshot(tmp_path)
    line = refused(cli("convert", "--hf-dir", hf, "--output-dir", hf, *(["--force"] if force else [])), hf)
    assert "itself" in line
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("levels", [1, 2])
def test_convert_output_contains_the_input(tmp_path, hf, levels):
    parent = hf.parents[levels - 1]  # P, then tmp_path
    before = snapshot(tmp_path)
    line = refused(cli("convert", "--hf-dir", hf, "--output-dir", parent, "--force"), parent, hf)
    assert "contains the input" in line
    assert snapshot(tmp_path) == before


def test_convert_output_inside_the_input(tmp_path, hf):
    before = snapshot(tmp_path)
    line = refused(cli("convert", "--hf-dir", hf, "--output-dir", hf / "colibri", "--force"), hf / "colibri", hf)
    assert "inside the input" in line
    assert snapshot(tmp_path) == before


def test_convert_same_directory_by_another_spelling(tmp_path, hf):
    """`P/hf/../hf` and a link to P are the same directory as P/hf."""
    (tmp_path / "alias").symlink_to(tmp_path / "P")
    before = snapshot(tmp_path)
    for spelling in (hf / ".." / "hf", tmp_path / "alias" / "hf"):
        refused(cli("convert", "--hf-dir", hf, "--output-dir", spelling, "--force"), spelling)
    refused(
        cli("convert", "--hf-dir", tmp_path / "alias" / "hf", "--output-dir", tmp_path / "P", "--force"), tmp_path / "P"
    )
    assert snapshot(tmp_path) == before


def test_non_colibri_directory_is_refused_even_with_force(tmp_path, hf):
    out = tmp_path / "notes"
    out.mkdir()
    for name in ("a.txt", "b.txt"):
        (out / name).write_text(name)
    (out / "sub").mkdir()
    before = snapshot(tmp_path)
    for force in ([], ["--force"]):
        line = refused(cli("convert", "--hf-dir", hf, "--output-dir", out, *force), out)
        assert "3 entries and no Colibri config.json" in line
    assert snapshot(tmp_path) == before


def test_another_checkpoint_is_refused_even_with_force(tmp_path, hf):
    """A directory with a config.json that is not Colibri's (a Hugging Face checkpoint)."""
    other = Path(shutil.copytree(FIXTURES / "olmoe_a" / "hf", tmp_path / "other"))
    before = snapshot(tmp_path)
    line = refused(cli("convert", "--hf-dir", hf, "--output-dir", other, "--force"), other)
    assert "config.json that is not a Colibri one" in line
    assert snapshot(tmp_path) == before


def test_a_file_as_output_is_refused_even_with_force(tmp_path, hf):
    out = tmp_path / "model.bin"
    out.write_bytes(b"not a directory")
    before = snapshot(tmp_path)
    refused(cli("convert", "--hf-dir", hf, "--output-dir", out, "--force"), out)
    assert snapshot(tmp_path) == before


def test_relayout_output_is_its_source(tmp_path, model):
    before = snapshot(tmp_path)
    line = refused(cli("relayout", "--model-dir", model, "--output-dir", model, "--force"), model)
    assert "is the model directory itself" in line
    assert snapshot(tmp_path) == before


def test_relayout_output_contains_its_source(tmp_path, model):
    before = snapshot(tmp_path)
    line = refused(cli("relayout", "--model-dir", model, "--output-dir", model.parent, "--force"), model.parent)
    assert "contains the input" in line
    assert snapshot(tmp_path) == before


def test_relayout_output_inside_its_source(tmp_path, model):
    before = snapshot(tmp_path)
    refused(cli("relayout", "--model-dir", model, "--output-dir", model / "r", "--force"), model / "r")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("target", ["colibri", "other", "dangling"])
def test_symlinked_output_is_refused(tmp_path, hf, target):
    if target == "colibri":
        dest = tmp_path / "real"
        convert(FIXTURES / "olmoe_a" / "hf", dest, **SILENT)
    elif target == "other":
        dest = tmp_path / "real"
        dest.mkdir()
        (dest / "keep.txt").write_text("keep")
    else:
        dest = tmp_path / "nowhere"
    link = tmp_path / "link"
    link.symlink_to(dest)
    before = snapshot(tmp_path)
    line = refused(cli("convert", "--hf-dir", hf, "--output-dir", link, "--force"), link, dest)
    assert "symbolic link" in line
    assert snapshot(tmp_path) == before


# ---- what --force does replace -----------------------------------------------------------------------


def test_force_replaces_a_colibri_directory_and_leaves_no_temporaries(tmp_path, hf, converted):
    out = tmp_path / "out"
    convert(FIXTURES / "olmoe_a" / "hf", out, **SILENT)
    (out / "stray.txt").write_text("part of the old model directory")
    before = snapshot(tmp_path)
    line = refused(cli("convert", "--hf-dir", hf, "--output-dir", out), out)  # not without --force
    assert "--force" in line
    assert snapshot(tmp_path) == before

    p = cli("convert", "--hf-dir", hf, "--output-dir", out, "--force")
    assert p.returncode == 0, p.stderr
    assert not (out / "stray.txt").exists()
    assert json.loads((out / "config.json").read_text())["model"]["architecture"] == "mixtral"
    assert temporaries(tmp_path) == []
    assert cli("verify", "--model-dir", out).returncode == 0

    p = cli(
        "relayout",
        "--model-dir",
        converted("mixtral_a", "int8"),
        "--output-dir",
        out,
        "--force",
        "--expert-layout",
        "transposed",
    )
    assert p.returncode == 0, p.stderr
    assert temporaries(tmp_path) == [] and json.loads((out / "config.json").read_text())["weight_dtype"] == "int8"
    assert colibri.load(out).forward([1, 2, 3]).shape[0] == 3


def test_an_empty_directory_needs_no_force(tmp_path, hf):
    out = tmp_path / "empty"
    out.mkdir()
    assert cli("convert", "--hf-dir", hf, "--output-dir", out).returncode == 0
    assert (out / "config.json").is_file() and temporaries(tmp_path) == []


def test_a_previous_output_moved_aside_by_a_killed_run_is_put_back(tmp_path, hf):
    """Killed between the two renames of the swap: `.out.old-PID-*` holds the previous output."""
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    out = tmp_path / "out"
    convert(FIXTURES / "olmoe_a" / "hf", out, **SILENT)
    previous = snapshot(out)
    out.rename(tmp_path / f".out.old-{dead.pid}-0000abcd")
    line = refused(cli("convert", "--hf-dir", hf, "--output-dir", out), out)  # it is back: needs --force
    assert "--force" in line
    assert snapshot(out) == previous and temporaries(tmp_path) == []


# ---- interruptions -------------------------------------------------------------------------------------


@pytest.mark.parametrize("previous", [False, True])
def test_sigterm_during_convert_leaves_no_temporary_and_the_previous_output(tmp_path, previous):
    hf = big_checkpoint(tmp_path / "hf")
    out = tmp_path / "out"
    if previous:
        convert(FIXTURES / "olmoe_a" / "hf", out, **SILENT)
    before = snapshot(tmp_path)
    proc = subprocess.Popen(
        convert_cmd(hf, out, "--quantize", "int4", "--force"),
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        **as_limit(),
    )
    deadline = time.time() + 60
    midway = False
    while time.time() < deadline and proc.poll() is None:
        tmps = list(tmp_path.glob(".out.tmp-*"))
        if tmps and len(list(tmps[0].rglob("*.bin"))) >= 3:
            proc.send_signal(signal.SIGTERM)
            midway = True
            break
        time.sleep(0.002)
    _, err = proc.communicate(timeout=60)
    assert midway, "the conversion finished before it could be terminated"
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, err)
    assert b"Traceback" not in err
    assert temporaries(tmp_path) == []
    assert snapshot(tmp_path) == before


def test_sigterm_during_relayout_takes_the_cleanup_path_and_restores_the_handler(tmp_path, converted, monkeypatch):
    """In-process: SIGTERM in the middle of the writes removes the temporary directory, then the
    previous handler (here a recording one) gets the signal; as it returns, the call stops with
    KeyboardInterrupt, as Ctrl-C does. The handler is the previous one again afterwards."""
    out = tmp_path / "out"
    convert(FIXTURES / "olmoe_a" / "hf", out, **SILENT)
    before = snapshot(tmp_path)
    got = []

    def recording(signum, frame):
        got.append(signum)

    real = ModelDirWriter.write_file
    calls = []

    def write_file(self, rel, items):
        real(self, rel, items)
        calls.append(rel)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(ModelDirWriter, "write_file", write_file)
    saved = signal.signal(signal.SIGTERM, recording)
    try:
        with pytest.raises(KeyboardInterrupt):
            relayout(converted("mixtral_a", "int8"), out, expert_layout="transposed", force=True, **SILENT)
        assert signal.getsignal(signal.SIGTERM) is recording
    finally:
        signal.signal(signal.SIGTERM, saved)
    assert got == [signal.SIGTERM] and len(calls) == 3
    assert snapshot(tmp_path) == before


# ---- a full disk -----------------------------------------------------------------------------------------


def _fill_disk_at_third_file(monkeypatch):
    """ModelDirWriter.write_file: the third file gets 100 bytes, then ENOSPC (as a full disk does)."""
    real = ModelDirWriter.write_file
    calls = []

    def write_file(self, rel, items):
        calls.append(self.root / rel)
        if len(calls) < 3:
            return real(self, rel, items)
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ModelDirWriter, "write_file", write_file)
    return calls


def test_enospc_names_the_file_and_removes_the_temporary(tmp_path, hf, monkeypatch, capsys):
    out = tmp_path / "out"
    convert(FIXTURES / "olmoe_a" / "hf", out, **SILENT)
    before = snapshot(tmp_path)
    handler = signal.getsignal(signal.SIGTERM)
    calls = _fill_disk_at_third_file(monkeypatch)
    with pytest.raises(colibri.ColibriError, match="No space left on device") as e:
        convert(hf, out, force=True, **SILENT)
    assert str(calls[-1]) in str(e.value) and str(out) in str(e.value)
    assert snapshot(tmp_path) == before
    assert signal.getsignal(signal.SIGTERM) == handler

    calls.clear()  # the CLI: one line, status 2
    assert main(["convert", "--hf-dir", str(hf), "--output-dir", str(out), "--force"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "No space left on device" in err and str(calls[-1]) in err
    assert snapshot(tmp_path) == before


def test_enospc_in_relayout(tmp_path, converted, monkeypatch):
    out = tmp_path / "out"
    convert(FIXTURES / "olmoe_a" / "hf", out, **SILENT)
    before = snapshot(tmp_path)
    calls = _fill_disk_at_third_file(monkeypatch)
    with pytest.raises(colibri.ColibriError, match="No space left on device") as e:
        relayout(converted("mixtral_a", "int8"), out, expert_layout="transposed", force=True, **SILENT)
    assert str(calls[-1]) in str(e.value)
    assert snapshot(tmp_path) == before


Usage = collections.namedtuple("Usage", "total used free")


def test_space_check_counts_the_text_files(tmp_path, hf, monkeypatch):
    """The weights fit in 2 MB, the weights and a 3 MB generation_config.json do not: refused before
    a byte is written."""
    cfg = json.loads((hf / "generation_config.json").read_text())
    (hf / "generation_config.json").write_text(json.dumps(cfg) + " " * 3_000_000)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 40, (1 << 40) - 2_000_000, 2_000_000))
    writes = []
    monkeypatch.setattr(ModelDirWriter, "write_file", lambda self, rel, items: writes.append(rel))
    before = snapshot(tmp_path)
    with pytest.raises(colibri.ColibriError, match="not enough disk space"):
        convert(hf, tmp_path / "out", **SILENT)
    assert writes == [] and snapshot(tmp_path) == before


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of `size` at path (root only): a real file system that fills up."""
    path.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({(r.stderr or r.stdout).strip() or 'mount failed'}): "
            f"the real full-disk test needs root"
        )
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_a_really_full_disk(tmp_path, monkeypatch, capsys):
    """On a 1 MB tmpfs holding a previous model: a bigger model fails up front (the check); with the
    check fooled, the writes hit ENOSPC; both leave the previous model byte-identical."""
    with tmpfs(tmp_path / "disk", "1m") as disk:
        out = disk / "out"
        convert(FIXTURES / "mixtral_a" / "hf", out, **SILENT)  # about 0.5 MB
        before = snapshot(disk)
        line = refused(cli("convert", "--hf-dir", FIXTURES / "mixtral_b" / "hf", "--output-dir", out, "--force"), out)
        assert "not enough disk space" in line
        assert snapshot(disk) == before

        monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 40, 0, 1 << 40))
        assert (
            main(["convert", "--hf-dir", str(FIXTURES / "mixtral_b" / "hf"), "--output-dir", str(out), "--force"]) == 2
        )
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and "No space left on device" in err and str(disk / ".out.tmp-") in err
        assert snapshot(disk) == before


def test_the_space_check_is_conservative(tmp_path):
    """Whatever the size of the disk, a conversion either fails up front or succeeds: never ENOSPC
    halfway, and nothing is left behind on failure."""
    outcomes = set()
    for i, size in enumerate(("256k", "600k", "1m")):
        with tmpfs(tmp_path / f"disk{i}", size) as disk:
            try:
                convert(FIXTURES / "mixtral_a" / "hf", disk / "out", **SILENT)
            except colibri.ColibriError as e:
                assert "not enough disk space" in str(e), e
                assert list(disk.iterdir()) == []
                outcomes.add("refused")
            else:
                assert [p.name for p in disk.iterdir()] == ["out"]
                outcomes.add("converted")
    assert outcomes == {"refused", "converted"}
