"""The code passes the linters configured in pyproject.toml ([tool.ruff], [tool.cython-lint]): pyflakes' checks (unused
imports, undefined names) and pycodestyle's errors, on the package, the tests and the tools, and is formatted as
`ruff format` writes it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    pytest.importorskip("ruff")
    ruff = shutil.which("ruff") or None
    cmd = [ruff] if ruff else [sys.executable, "-m", "ruff"]
    p = subprocess.run(
        [*cmd, "check", "--no-cache", "colibri", "tests", "tools"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr


def test_ruff_format_changes_nothing():
    """The Python code is as `ruff format` writes it ([tool.ruff]: 120 columns)."""
    pytest.importorskip("ruff")
    ruff = shutil.which("ruff") or None
    cmd = [ruff] if ruff else [sys.executable, "-m", "ruff"]
    p = subprocess.run(
        [*cmd, "format", "--check", "--no-cache", "colibri", "tests", "tools"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr


def test_cython_lint_finds_nothing():
    """The Cython modules, their .pxd contracts and the .pxi parts they include pass cython-lint
    ([tool.cython-lint])."""
    pytest.importorskip("cython_lint")
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "colibri").glob("*.p[xy][xdi]"))
    assert len(files) >= 11, files
    p = subprocess.run(
        [sys.executable, "-m", "cython_lint.cython_lint", *files], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stdout + p.stderr
