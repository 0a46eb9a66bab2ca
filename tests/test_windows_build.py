"""The C core on a Windows compiler: Debian's mingw-w64 cross-compiles every csrc header (the
Windows branches of os_hints.h and expert_cache.h included), and the expert cache's Win32 reader
threads run under Wine. Skipped, saying why, where the compiler or Wine is missing (.ci/run
installs them when it can)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "colibri" / "csrc"
MINGW = shutil.which("x86_64-w64-mingw32-gcc")
WINE = shutil.which("wine64") or shutil.which("wine") or next(
    (p for p in ("/usr/lib/wine/wine64",) if Path(p).exists()), None)
FLAGS = ["-std=c11", "-O2", "-Wall", "-Wextra", "-Wno-unused-function", "-Werror", f"-I{CSRC}"]

needs_mingw = pytest.mark.skipif(MINGW is None, reason="no x86_64-w64-mingw32-gcc (apt: gcc-mingw-w64-x86-64)")


def compiled_headers() -> list:
    """The headers the compiled modules include (their `cdef extern from` lines): the entry
    points of csrc, which include the rest (the tiers, vnni_body.h inside its functions)."""
    found = set()
    for pxd in sorted((ROOT / "colibri").glob("*.px[dy]")):
        found.update(re.findall(r'cdef extern from "([\w.]+\.h)"', pxd.read_text()))
    return sorted(found)


def test_the_entry_headers_are_found():
    assert {"dispatch.h", "routing.h", "os_hints.h", "expert_cache.h"} <= set(compiled_headers())


@needs_mingw
def test_every_header_compiles_for_windows(tmp_path):
    headers = compiled_headers()
    src = tmp_path / "all.c"
    src.write_text("".join(f'#include "{h}"\n' for h in headers) + "int main(void) { return 0; }\n")
    r = subprocess.run([MINGW, *FLAGS, "-fopenmp", "-c", str(src), "-o", str(tmp_path / "all.o")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


@needs_mingw
def test_the_expert_cache_runs_its_win32_readers(tmp_path):
    exe = tmp_path / "cache_check.exe"
    r = subprocess.run([MINGW, *FLAGS, str(ROOT / "tests" / "win" / "cache_check.c"), "-o", str(exe)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    if WINE is None:
        pytest.skip("built for Windows, but no wine64 to run it (apt: wine64)")
    run = subprocess.run([WINE, str(exe)], capture_output=True, text=True, timeout=120,
                         env={"WINEDEBUG": "-all", "WINEPREFIX": str(tmp_path / "wine"), "HOME": str(tmp_path),
                              "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, (run.stdout, run.stderr[-2000:])
    assert run.stdout.startswith("resident ") and "evictions" in run.stdout
