"""Build Colibri's compiled modules: Cython over the C headers in colibri/csrc, with OpenMP.

No -march=native: one build must run on any x86-64 CPU (ISA-specific kernels are compiled with
per-function target attributes and chosen at import). Cython directives are set here once;
COLIBRI_DEBUG=1 turns bounds and wraparound checks back on.
"""
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

debug = os.environ.get("COLIBRI_DEBUG") == "1"

if sys.platform == "win32":
    # /std:c11: the headers use _Static_assert, which MSVC's C mode has only from C11; OpenMP 2.0
    # (/openmp) is all the code asks of it (signed loop indices, no collapse, no simd)
    compile_args = ["/O2", "/openmp", "/std:c11"]
    link_args = []
else:
    # each module includes the headers of every .pxd it cimports and calls a few of their static
    # functions; the compiler drops the rest, which is not worth a warning
    # -g0: Python's own CFLAGS ask for debug information, which made _kernels' object 12x larger
    # and its compile a third longer; COLIBRI_DEBUG=1 builds with it
    compile_args = ["-O3", "-g0", "-fopenmp", "-fno-math-errno", "-Wno-unused-function"]
    link_args = ["-fopenmp"]
if debug and sys.platform != "win32":
    compile_args = ["-O0", "-g", "-fopenmp", "-Wno-unused-function"]



def assembler_knows_amx() -> bool:
    """Whether the C compiler's assembler knows AMX's tile instructions (binutils 2.36+, LLVM 12+):
    kernels_amx.h writes them as inline asm on x86-64 GCC/clang, which an older assembler would
    reject, failing the whole build on any CPU. Where it does not, CB_NO_AMX_ASM leaves the AMX
    step out of the build (amx_status() says so) and everything else is as before."""
    if sys.platform == "win32" or platform.machine().lower() not in ("x86_64", "amd64"):
        return True                  # no tile asm is compiled there (kernels_amx.h)
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "amx.c")
        with open(src, "w") as f:
            f.write('void colibri_amx_probe(void) { __asm__ volatile("tilerelease"); }\n')
        try:
            return subprocess.run(cc + ["-c", src, "-o", os.path.join(d, "amx.o")], capture_output=True).returncode == 0
        except OSError:
            return True              # no such compiler: the build itself will say so


def msvc_knows_amx_intrinsics() -> bool:
    """Whether MSVC's immintrin.h has the _tile_* intrinsics (kernels_amx.h takes them there: cl.exe
    has no inline assembly on x86-64). Where it does not (an older Visual Studio), CB_NO_AMX_INTRINSICS
    leaves the AMX step out of the build, as CB_NO_AMX_ASM does elsewhere."""
    from setuptools._distutils import ccompiler, errors
    compiler = ccompiler.new_compiler()
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "amx.c")
        with open(src, "w") as f:
            f.write("#include <immintrin.h>\nvoid colibri_amx_probe(void) { _tile_release(); }\n")
        try:                         # (C4013, an undeclared function, is only a warning in C: made an error)
            compiler.compile([src], output_dir=d, extra_postargs=["/we4013"])
            return True
        except (errors.CompileError, errors.DistutilsError, OSError):
            return False


if sys.platform != "win32" and not assembler_knows_amx():
    compile_args.append("-DCB_NO_AMX_ASM")
if sys.platform == "win32" and platform.machine().lower() in ("x86_64", "amd64") and not msvc_knows_amx_intrinsics():
    compile_args.append("/DCB_NO_AMX_INTRINSICS")

CSRC = os.path.join("colibri", "csrc")
HEADERS = [os.path.join(CSRC, name) for name in os.listdir(CSRC)]
# the kernel table (_kernels) and its entry points; the router; the layer loop; the test and
# benchmark probes. Each .pyx has its contract with the others and with csrc/ in a .pxd.
MODULES = ["_kernels", "_routing", "_engine", "_probes"]
extensions = [
    Extension(
        f"colibri.{name}",
        sources=[os.path.join("colibri", f"{name}.pyx")],
        include_dirs=[CSRC],
        depends=HEADERS + [os.path.join("colibri", p) for p in os.listdir("colibri") if p.endswith(".pxd")],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    )
    for name in MODULES
]



def _newer_than(paths, target) -> bool:
    """Whether any of paths was modified after target."""
    mtime = os.path.getmtime(target)
    return any(os.path.getmtime(p) > mtime for p in paths if os.path.exists(p))


class BuildExt(build_ext):
    """The modules compiled side by side (one per CPU), and a module left alone where its in-place
    copy (colibri/*.so or *.pyd, what an editable install imports) is newer than its C source,
    headers and .pxd contracts and was built with the same flags (a stamp beside it): pip builds
    an editable install in a fresh temporary directory each time, so without this the README's
    second command (`pip install -e ".[test]"`) recompiled every module though nothing changed."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

    def run(self):
        self._into_source = bool(self.inplace or getattr(self, "editable_mode", False))
        super().run()

    def _in_place(self, ext) -> str:
        package = ext.name.split(".")[:-1]
        return os.path.join(*package, os.path.basename(self.get_ext_fullpath(ext.name)))

    def _flags(self, ext) -> str:
        return json.dumps({"compile": ext.extra_compile_args, "link": ext.extra_link_args,
                           "debug": debug, "python": sys.version})

    def build_extension(self, ext):
        target, in_place = self.get_ext_fullpath(ext.name), self._in_place(ext)
        stamp = in_place + ".flags"
        if (self._into_source and not self.force and os.path.exists(in_place) and os.path.exists(stamp)
                and open(stamp).read() == self._flags(ext) and not _newer_than(ext.sources + ext.depends, in_place)):
            if os.path.abspath(target) != os.path.abspath(in_place):
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copy2(in_place, target)
            print(f"colibri: {ext.name} is up to date ({in_place})")
            return
        super().build_extension(ext)
        if self._into_source:
            with open(stamp, "w") as f:
                f.write(self._flags(ext))


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=cythonize(
        extensions,
        compiler_directives={
            "language_level": 3,
            "boundscheck": debug,
            "wraparound": debug,
            "cdivision": True,
            "initializedcheck": debug,
        },
    ),
)
