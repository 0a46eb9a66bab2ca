"""The C core on Windows compilers, as far as a Linux machine can take it.

- MinGW-w64 cross-compiles every csrc header (the Windows branches of os_hints.h and
  expert_cache.h included) with -Werror, and two programs run under Wine: tests/win/core_check.c
  (CPU detection, every tier and int step against the scalar spec, the Win32 file-mapping,
  prefetch, trim and VirtualAlloc path) and tests/win/cache_check.c (the expert cache's reader
  threads).
- clang in MSVC mode (--target=x86_64-pc-windows-msvc, syntax only, MinGW's C library headers
  standing in for the Windows SDK's, tests/win/msvc_prelude.h poisoning GCC-only syntax) parses
  every header as cl.exe's C11 mode sees it; snippets of GCC-only syntax show that the check bites.
- The OpenMP pragmas are within what MSVC's /openmp (OpenMP 2.0) accepts.

What is not tested here: cl.exe itself (its diagnostics, its code generation) and a real Windows
kernel (Wine keeps no working set, so the trim is exercised but not observed). Each test skips,
saying why, where its compiler or Wine is missing (.ci/run installs them when it can)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "colibri" / "csrc"
MINGW = shutil.which("x86_64-w64-mingw32-gcc")
WINE = (
    shutil.which("wine64")
    or shutil.which("wine")
    or next((p for p in ("/usr/lib/wine/wine64",) if Path(p).exists()), None)
)
FLAGS = ["-std=c11", "-O2", "-Wall", "-Wextra", "-Wno-unused-function", "-Werror", f"-I{CSRC}"]

CLANG = shutil.which("clang")
MINGW_INCLUDE = Path("/usr/x86_64-w64-mingw32/include")
# cl.exe's view: no GNU mode; every intrinsic declared (MSVC declares them all, whatever /arch says);
# freestanding only so that clang's intrin.h and MinGW's setjmp.h do not both declare _setjmp.
MSVC_FLAGS = [
    "--target=x86_64-pc-windows-msvc",
    "-fsyntax-only",
    "-fms-compatibility",
    "-std=c11",
    "-ffreestanding",
    "-fopenmp",
    "-mavx2",
    "-mfma",
    "-mf16c",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512dq",
    "-mavx512vnni",
    "-mavx512bf16",
    "-mavxvnni",
    "-mamx-tile",
    "-mamx-int8",
    "-mamx-bf16",
    "-Wall",
    "-Werror",
    "-Werror=gnu",
    "-Werror=vla",
    "-Wno-unused-function",
    "-include",
    str(ROOT / "tests" / "win" / "msvc_prelude.h"),
    "-idirafter",
    str(MINGW_INCLUDE),
    f"-I{CSRC}",
]

needs_mingw = pytest.mark.skipif(MINGW is None, reason="no x86_64-w64-mingw32-gcc (apt: gcc-mingw-w64-x86-64)")
needs_msvc_mode = pytest.mark.skipif(
    CLANG is None or not MINGW_INCLUDE.is_dir(),
    reason="no clang, or no MinGW headers to stand in for the Windows SDK (apt: clang gcc-mingw-w64-x86-64)",
)


def run_under_wine(exe: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [WINE, str(exe)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"WINEDEBUG": "-all", "WINEPREFIX": str(tmp_path / "wine"), "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )


def compiled_headers() -> list:
    """The headers the compiled modules include (their `cdef extern from` lines): the entry
    points of csrc, which include the rest (the tiers, vnni_body.h inside its functions)."""
    found = set()
    for source in sorted([*(ROOT / "colibri").glob("*.pxd"), *(ROOT / "colibri").glob("*.pyx")]):
        found.update(re.findall(r'cdef extern from "([\w.]+\.h)"', source.read_text()))
    return sorted(found)


def test_the_entry_headers_are_found():
    assert {"dispatch.h", "routing.h", "os_hints.h", "expert_cache.h"} <= set(compiled_headers())


@needs_mingw
def test_every_header_compiles_for_windows(tmp_path):
    headers = compiled_headers()
    src = tmp_path / "all.c"
    src.write_text("".join(f'#include "{h}"\n' for h in headers) + "int main(void) { return 0; }\n")
    r = subprocess.run(
        [MINGW, *FLAGS, "-fopenmp", "-c", str(src), "-o", str(tmp_path / "all.o")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-3000:]


@needs_mingw
def test_the_expert_cache_runs_its_win32_readers(tmp_path):
    exe = tmp_path / "cache_check.exe"
    r = subprocess.run(
        [MINGW, *FLAGS, str(ROOT / "tests" / "win" / "cache_check.c"), "-o", str(exe)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-3000:]
    if WINE is None:
        pytest.skip("built for Windows, but no wine64 to run it (apt: wine64)")
    run = run_under_wine(exe, tmp_path)
    assert run.returncode == 0, (run.stdout, run.stderr[-2000:])
    assert run.stdout.startswith("resident ") and "evictions" in run.stdout


@needs_mingw
def test_the_core_runs_its_tiers_and_the_win32_path_under_wine(tmp_path):
    """core_check.exe, built with OpenMP (libgomp linked statically: nothing to install): the CPU
    detection agrees with the Linux build's, every tier up to the best passes the scalar spec on
    every int step it has here, and the file-mapping / prefetch / trim / VirtualAlloc lines hold."""
    from colibri import _kernels

    exe = tmp_path / "core_check.exe"
    r = subprocess.run(
        [MINGW, *FLAGS, "-fopenmp", str(ROOT / "tests" / "win" / "core_check.c"), "-static", "-o", str(exe)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    if WINE is None:
        pytest.skip("built for Windows, but no wine64 to run it (apt: wine64)")
    run = run_under_wine(exe, tmp_path)
    out = run.stdout.splitlines()
    assert run.returncode == 0, (run.stdout, run.stderr[-2000:])
    best = re.match(r"cpu best=(\w+)", out[0])
    assert best and best.group(1) == _kernels.available_isas()[-1], out[0]
    tiers = [line.split()[1] for line in out if line.startswith("tier ")]
    assert tiers == _kernels.available_isas(), out
    assert all(line.split()[2] == "ok" for line in out if line.startswith("tier ")), out
    for part in ("map", "alloc"):
        assert any(line.startswith(f"{part} ok") for line in out), out


def _msvc_parse(tmp_path: Path, source: str) -> subprocess.CompletedProcess:
    src = tmp_path / "msvc_check.c"
    src.write_text(source)
    return subprocess.run([CLANG, *MSVC_FLAGS, str(src)], capture_output=True, text=True)


@needs_msvc_mode
def test_every_header_parses_as_msvc_c11(tmp_path):
    """Every header as cl.exe /std:c11 sees it: no __GNUC__, no __clang__, _MSC_VER set."""
    includes = "".join(f'#include "{h}"\n' for h in compiled_headers())
    r = _msvc_parse(tmp_path, includes + "int main(void) { return 0; }\n")
    assert r.returncode == 0, r.stderr[-4000:]


@needs_msvc_mode
def test_the_msvc_build_has_the_amx_steps(tmp_path):
    """cl.exe has no inline assembly on x86-64: there the AMX steps take immintrin.h's _tile_*
    intrinsics (kernels_amx.h), so an MSVC build has them too (and the emulated one the tests use)."""
    r = _msvc_parse(
        tmp_path,
        '#include "dispatch.h"\n#if !CB_HAVE_AMX || defined(CB_AMX_ASM)\n'
        '#error "no AMX step through the intrinsics"\n#endif\nint main(void) { return 0; }\n',
    )
    assert r.returncode == 0, r.stderr[-3000:]


GCC = shutil.which("gcc")


@pytest.mark.skipif(GCC is None or not shutil.which("objdump"), reason="no gcc or objdump")
def test_the_amx_intrinsics_give_the_tile_instructions(tmp_path):
    """The intrinsics branch of the tile ops (MSVC's), built by GCC with CB_AMX_INTRINSICS: it
    compiles, emits the same tile instructions as the inline-asm branch — each product and zeroing
    on the same tiles in the same operand order —, and the AMX kernels' emulated bits still hold
    (tools/bench/amx_check.c --emulated; the tile ops themselves run only on an AMX CPU)."""
    exe = {}
    for branch, extra in (
        ("asm", []),
        ("intrinsics", ["-DCB_AMX_INTRINSICS", "-mamx-tile", "-mamx-int8", "-mamx-bf16"]),
    ):
        exe[branch] = tmp_path / f"amx_check_{branch}"
        r = subprocess.run(
            [
                GCC,
                "-O2",
                "-fopenmp",
                *extra,
                f"-I{CSRC}",
                str(ROOT / "tools" / "bench" / "amx_check.c"),
                "-o",
                str(exe[branch]),
                "-lm",
            ],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr[-3000:]
    kinds, products = {}, {}
    for branch, path in exe.items():
        dump = subprocess.run(["objdump", "-d", str(path)], capture_output=True, text=True, check=True).stdout
        kinds[branch] = set(
            re.findall(r"\b(ldtilecfg|tilerelease|tileloadd|tilestored|tilezero|tdpbssd|tdpbf16ps)\b", dump)
        )
        products[branch] = set(re.findall(r"\b((?:tdpbssd|tdpbf16ps|tilezero)\s+[%\w,]+)", dump))
    assert (
        kinds["intrinsics"]
        == kinds["asm"]
        == {"ldtilecfg", "tilerelease", "tileloadd", "tilestored", "tilezero", "tdpbssd", "tdpbf16ps"}
    )
    assert products["intrinsics"] == products["asm"] and len(products["asm"]) >= 8
    from colibri import _kernels

    if "amx-emulated" not in _kernels.available_int_steps():
        pytest.skip("the emulated AMX step's bits need AVX512-VNNI (the builds and their instructions checked)")
    run = subprocess.run([str(exe["intrinsics"]), "--emulated"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:]


@needs_msvc_mode
@pytest.mark.parametrize(
    "snippet",
    [
        "static int __attribute__((unused)) x;",  # a GNU attribute
        "static int f(void) { return ({ 1; }); }",  # a statement expression
        "static __thread int t;",  # GCC's thread-local
        "static int g(int v) { return __builtin_expect(v, 0); }",  # a GCC builtin
        'static void h(void) { __asm__("nop"); }',  # inline assembly
        "static int z[0];",  # a zero-length array
        "static void v(int n) { int a[n]; a[0] = 0; (void)a; }",  # a variable-length array
    ],
)
def test_the_msvc_check_rejects_gcc_only_syntax(tmp_path, snippet):
    r = _msvc_parse(tmp_path, f'#include "dispatch.h"\n{snippet}\nint main(void) {{ return 0; }}\n')
    assert r.returncode != 0, f"clang's MSVC mode accepted: {snippet}"
    control = _msvc_parse(
        tmp_path, '#include "dispatch.h"\nstatic int ok(void) { return 0; }\nint main(void) { return ok(); }\n'
    )
    assert control.returncode == 0, control.stderr[-2000:]


# OpenMP 2.0 (MSVC's /openmp): its directives and clauses, no collapse/simd/task/target, and a
# `for` loop's index of a signed integral type (C3016 otherwise).
OPENMP_2_DIRECTIVES = {
    "parallel",
    "for",
    "sections",
    "section",
    "single",
    "master",
    "critical",
    "barrier",
    "atomic",
    "flush",
    "ordered",
    "threadprivate",
}
OPENMP_2_CLAUSES = {
    "private",
    "firstprivate",
    "lastprivate",
    "shared",
    "default",
    "reduction",
    "copyin",
    "copyprivate",
    "schedule",
    "nowait",
    "ordered",
    "if",
    "num_threads",
}
SIGNED_INDEX = re.compile(r"for\s*\(\s*(?:int|long|long long|ptrdiff_t|int32_t|int64_t|Py_ssize_t)\s+\w+\s*=")


def openmp_pragmas() -> list:
    """(file, pragma text, the line after it) for every `#pragma omp` of csrc and the .pyx files."""
    found = []
    for path in sorted([*CSRC.glob("*.h"), *(ROOT / "colibri").glob("*.pyx")]):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"\s*#\s*pragma\s+omp\s+(.*)", line)
            if m:
                found.append((path.name, m.group(1), lines[i + 1].strip() if i + 1 < len(lines) else ""))
    return found


def openmp_2_problems(text: str, following: str) -> list:
    """What in `#pragma omp <text>` (and the line after it) MSVC's OpenMP 2.0 would reject."""
    words = re.sub(r"\([^()]*\)", "", text).split()  # clause arguments dropped
    problems = [w for w in words if w not in OPENMP_2_DIRECTIVES | OPENMP_2_CLAUSES]
    if not words or words[0] not in OPENMP_2_DIRECTIVES:
        problems.append(f"directive {words[:1]}")
    if "for" in words[:2] and not SIGNED_INDEX.match(following):
        problems.append(f"loop index not signed: {following}")
    return problems


def test_openmp_pragmas_are_within_openmp_2_0():
    pragmas = openmp_pragmas()
    assert len(pragmas) >= 2, "OpenMP pragmas not found: the scan is broken"
    for name, text, following in pragmas:
        assert not openmp_2_problems(text, following), (name, text, following)


@pytest.mark.parametrize(
    "text, following",
    [
        ("parallel for collapse(2)", "for (int i = 0; i < n; i++)"),
        ("parallel for simd", "for (int i = 0; i < n; i++)"),
        ("task", "{"),
        ("parallel for schedule(static)", "for (size_t i = 0; i < n; i++)"),
        ("parallel for", "for (unsigned i = 0; i < n; i++)"),
    ],
)
def test_the_openmp_check_rejects_what_openmp_2_0_lacks(text, following):
    assert openmp_2_problems(text, following)
