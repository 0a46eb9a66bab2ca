"""The package a user installs: `python -m build` makes an sdist and a wheel that `twine check
--strict` accepts, and the wheel, installed in a fresh virtual environment where no C compiler
can run (binary packages only, every compiler name on PATH a failing stub), runs the demo.

The wheel is built from this tree, whose compiled modules the editable install has just built:
setup.py's BuildExt takes them as they are where they are up to date (their stamp and times), so
this costs the packaging, not a second compile. pip fetches the dependencies' wheels from the
package index, as a user's install does.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEMO_PROMPT = "And the LORD said unto Moses"


def _run(cmd, timeout, **kw):
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))} -> {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    pytest.importorskip("build")
    pytest.importorskip("twine")
    out = tmp_path_factory.mktemp("dist")
    for kind in ("--sdist", "--wheel"):
        _run([sys.executable, "-m", "build", kind, "--outdir", out, REPO], timeout=1500, cwd=REPO)
    (sdist,) = out.glob("colibri_moe-*.tar.gz")
    (wheel,) = out.glob("colibri_moe-*.whl")
    return sdist, wheel


def test_twine_accepts_the_sdist_and_the_wheel(dists):
    _run([sys.executable, "-m", "twine", "check", "--strict", *dists], timeout=300)


def test_the_sdist_holds_what_a_build_needs_and_no_binaries(dists):
    sdist, _ = dists
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for needed in (
        "setup.py",
        "pyproject.toml",
        "README.md",
        "colibri/_kernels.pyx",
        "colibri/_engine.pxd",
        "colibri/_engine_layers.pxi",
        "colibri/csrc/api.h",
        "colibri/csrc/token_mask.h",
        "colibri/csrc/dispatch.h",
    ):
        assert needed in names, needed
    assert not [n for n in names if n.endswith((".so", ".pyd", ".flags", ".o"))]


def test_the_wheel_installs_without_a_compiler_and_runs_the_demo(dists, tmp_path):
    _, wheel = dists
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    for module in ("_kernels", "_engine", "_routing", "_probes"):
        assert any(n.startswith(f"colibri/{module}.") and n.endswith((".so", ".pyd")) for n in names), module
    assert any(n.startswith("colibri/data/") for n in names)  # the demo model
    assert not [n for n in names if n.endswith(".flags")]

    stubs = tmp_path / "no-compiler"
    stubs.mkdir()
    for name in ("cc", "gcc", "c++", "g++", "clang", "clang++", "x86_64-linux-gnu-gcc"):
        stub = stubs / name
        stub.write_text("#!/bin/sh\necho 'no C compiler here' >&2\nexit 1\n")
        stub.chmod(stub.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "COLIBRI"))}
    env.update(PATH=f"{stubs}{os.pathsep}{env.get('PATH', '')}", CC=str(stubs / "cc"), CXX=str(stubs / "c++"))
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], timeout=300, env=env)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    _run([python, "-m", "pip", "install", "-q", "--only-binary", ":all:", wheel], timeout=900, env=env)
    where = _run(
        [python, "-c", "import colibri, os; print(os.path.dirname(colibri.__file__))"],
        timeout=120,
        env=env,
        cwd=tmp_path,
    ).stdout.strip()
    assert Path(where).resolve().is_relative_to(venv.resolve()), where
    p = _run(
        [python, "-m", "colibri", "run", "--prompt", DEMO_PROMPT, "--max-new-tokens", "8", "--seed", "1"],
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert p.stdout.strip(), p.stderr
