"""The documentation: the site builds strictly, the README stays a front door, and its set-up
section gives exactly the commands CI runs.

- `mkdocs build --strict` succeeds (mkdocs.yml turns a broken link, a missing anchor, or a page
  left out of the nav into an error), and a broken link does make it fail, so the strictness
  itself is checked.
- README.md is at most 250 lines.
- README.md contains the two set-up commands of `.ci/run` (its main job and its test command),
  read from `.ci/run` itself.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import mkdocs  # noqa: F401  (the test extra has it: a missing package is an error, not a skip)

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250


def _build(root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_docs_build_strictly(tmp_path):
    r = _build(REPO, tmp_path / "site")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def _copy_docs(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(REPO / "docs", root / "docs")
    shutil.copy(REPO / "mkdocs.yml", root / "mkdocs.yml")
    return root


def test_a_broken_link_fails_the_build(tmp_path):
    root = _copy_docs(tmp_path)
    with open(root / "docs" / "index.md", "a", encoding="utf-8") as f:
        f.write("\nSee [a page that does not exist](no-such-page.md).\n")
    r = _build(root, tmp_path / "site")
    assert r.returncode != 0, r.stdout + r.stderr
    assert "no-such-page.md" in r.stdout + r.stderr


def test_a_page_missing_from_the_nav_fails_the_build(tmp_path):
    root = _copy_docs(tmp_path)
    (root / "docs" / "orphan.md").write_text("# Orphan\n\nNot in the nav.\n", encoding="utf-8")
    r = _build(root, tmp_path / "site")
    assert r.returncode != 0, r.stdout + r.stderr
    assert "orphan.md" in r.stdout + r.stderr


def test_every_page_is_in_the_nav():
    nav = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md"))
    assert pages, "docs/ has no pages"
    assert [p for p in pages if not re.search(rf":\s*{re.escape(p)}\s*$", nav, re.M)] == []


def test_readme_is_short():
    n = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail into docs/"


def _ci_setup_commands() -> list[str]:
    """The commands .ci/run runs after its "README set-up command N" banners."""
    lines = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    cmds = []
    for i, line in enumerate(lines):
        if re.search(r"README set-up command \d", line):
            cmd = next(l.strip() for l in lines[i + 1 :] if l.strip() and not l.strip().startswith("#"))
            cmds.append(cmd)
    return cmds


def test_readme_gives_the_ci_setup_commands():
    cmds = _ci_setup_commands()
    assert len(cmds) == 2, f".ci/run: expected two 'README set-up command' banners, found {cmds}"
    assert cmds[0].startswith("pip install -e . && python -m colibri run"), cmds
    assert cmds[1].startswith('pip install -e ".[test]" && python -m pytest'), cmds
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    # each command on a line of its own in a ```sh block of the README
    blocks = re.findall(r"^```(?:sh|bash|console)?\n(.*?)^```", readme, re.M | re.S)
    block_lines = {l.strip() for b in blocks for l in b.splitlines()}
    for cmd in cmds:
        assert cmd in block_lines, f"README.md does not give .ci/run's command as a line of a code block: {cmd}"
    # in CI's order: the main job first, then the tests
    assert readme.index(cmds[0]) < readme.index(cmds[1])
