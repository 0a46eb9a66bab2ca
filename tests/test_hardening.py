"""Interruptions and resources: a killed or out-of-space conversion leaves nothing half-written,
mmap=False gives the same results, a bad COLIBRI_ISA is a clear error."""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import colibri
from conftest import ENV, FIXTURES, big_checkpoint, convert_cmd, reference, write_safetensors

@pytest.mark.parametrize("previous", [False, True])
def test_killed_conversion_leaves_nothing_or_the_previous_directory(tmp_path, previous):
    hf = big_checkpoint(tmp_path / "hf")
    out = tmp_path / "out"
    if previous:
        subprocess.run(convert_cmd(FIXTURES / "olmoe_a" / "hf", out), check=True, env=ENV, capture_output=True)
        before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    proc = subprocess.Popen(convert_cmd(hf, out, "--quantize", "int4", "--force"), env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
    subprocess.run(convert_cmd(FIXTURES / "olmoe_a" / "hf", tmp_path / "out", "--force"), check=True, env=ENV,
                   capture_output=True)
    assert not list(tmp_path.glob(".out.tmp-*"))
    assert colibri.load(out).forward([1, 2, 3]).shape == (3, 128)


def _limit_file_size():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))


def test_full_disk_fails_cleanly(tmp_path):
    hf = big_checkpoint(tmp_path / "hf")
    out = tmp_path / "out"
    r = subprocess.run(convert_cmd(hf, out, "--quantize", "int8"), env=ENV, capture_output=True, text=True,
                       preexec_fn=_limit_file_size)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr and "File too large" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_reading_instead_of_mapping_gives_the_same_logits(converted):
    ref = reference("qwen2moe_b")
    mapped = colibri.load(converted("qwen2moe_b", "int8")).forward(ref["input_ids"])
    read = colibri.load(converted("qwen2moe_b", "int8"), mmap=False).forward(ref["input_ids"])
    np.testing.assert_array_equal(mapped, read)


def test_bad_colibri_isa_is_one_clear_line(converted):
    env = dict(ENV, COLIBRI_ISA="avx9000")
    r = subprocess.run([sys.executable, "-m", "colibri", "run", "--model-dir", str(converted("mixtral_a")),
                        "--tokens", "1,2"], env=env, capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "avx9000" in r.stderr and "Traceback" not in r.stderr


def test_no_mmap_flag(converted):
    r = subprocess.run([sys.executable, "-m", "colibri", "run", "--model-dir", str(converted("mixtral_a")),
                        "--tokens", "1,2", "--max-new-tokens", "3", "--no-mmap", "--ids"],
                       env=ENV, capture_output=True, text=True)
    assert r.returncode == 0 and len(r.stdout.split()) == 3, r.stderr


def test_ctrl_c_stops_generation_cleanly(tmp_path):
    hf = big_checkpoint(tmp_path / "hf")
    out = tmp_path / "m"
    subprocess.run(convert_cmd(hf, out), check=True, env=ENV, capture_output=True)
    proc = subprocess.Popen([sys.executable, "-m", "colibri", "run", "--model-dir", str(out), "--tokens", "1,2,3",
                             "--max-new-tokens", "4000", "--ignore-eos", "--ids", "--threads", "1"],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = b""
    while seen.count(b" ") < 12:                         # a few tokens are out
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


@pytest.mark.parametrize("tensor", ["layers.1.experts.0.up", "layers.0.router", "lm_head"])
def test_nan_in_a_weight_file_is_reported_not_sampled(converted, tmp_path, tensor):
    """A damaged weight that keeps the file size: load succeeds, the first step says NaN."""
    import shutil
    d = tmp_path / "m"
    shutil.copytree(converted("mixtral_a"), d)
    t = json.loads((d / "config.json").read_text())["tensors"][tensor]
    nan = np.full(t["nbytes"] // 4, np.nan, np.float32).tobytes()
    with open(d / t["file"], "r+b") as f:
        f.seek(t["offset"])
        f.write(nan)
    m = colibri.load(d)
    with pytest.raises(colibri.ColibriError, match="NaN or infinite.*verify"):
        list(m.generate(list(range(1, 20)), max_new_tokens=3))
    r = subprocess.run([sys.executable, "-m", "colibri", "run", "--model-dir", str(d), "--tokens",
                        ",".join(map(str, range(1, 20)))], env=ENV, capture_output=True, text=True)
    assert r.returncode == 2 and "NaN or infinite" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("flag, value, named", [("--threads", "2147483648", "1..1024"),
                                                ("--expert-cache-mb", "inf", "inf"),
                                                ("--expert-cache-mb", "nan", "nan")])
def test_absurd_flag_values_are_one_line(converted, flag, value, named):
    r = subprocess.run([sys.executable, "-m", "colibri", "run", "--model-dir", str(converted("mixtral_a")),
                        "--tokens", "1,2", flag, value], env=ENV, capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.splitlines()) == 1 and named in r.stderr, r.stderr
