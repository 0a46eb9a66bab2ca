"""Build Colibri's compiled modules: Cython over the C headers in colibri/csrc, with OpenMP.

No -march=native: one build must run on any x86-64 CPU (ISA-specific kernels are compiled with
per-function target attributes and chosen at import). Cython directives are set here once;
COLIBRI_DEBUG=1 turns bounds and wraparound checks back on.
"""
import json
import os
import platform
import re
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
    # -g0: Python's own CFLAGS ask for debug information, which made _kernels' object 12x larger
    # and its compile a third longer; COLIBRI_DEBUG=1 builds with it
    compile_args = ["-O3", "-g0", "-fopenmp", "-fno-math-errno"]
    link_args = ["-fopenmp"]
if debug and sys.platform != "win32":
    compile_args = ["-O0", "-g", "-fopenmp"]



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


def gcc_parallel_lto() -> list:
    """["-flto=auto"] where the C compiler is GCC and can link a shared object with it, else []. The
    kernel module is one translation unit whose code generation (its attention kernels, specialised
    by heads x head_dim x cache type, are most of it) takes two minutes on one core; with link-time
    optimisation GCC compiles it in partitions, one per core, at link. The code is the same: the
    inlining decisions are made over the whole unit before it is partitioned. Not with clang (whose
    LTO needs its own linker) nor MSVC, nor in a COLIBRI_DEBUG build."""
    if sys.platform == "win32" or debug:
        return []
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    try:
        version = subprocess.run(cc + ["--version"], capture_output=True, text=True).stdout
        if "Free Software Foundation" not in version or "clang" in version:
            return []
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "lto.c")
            with open(src, "w") as f:
                f.write("int colibri_lto_probe(int x) { return x + 1; }\n")
            obj, lib = os.path.join(d, "lto.o"), os.path.join(d, "lto.so")
            ok = subprocess.run(cc + ["-O2", "-fPIC", "-flto=auto", "-c", src, "-o", obj], capture_output=True)
            ok = ok.returncode == 0 and subprocess.run(cc + ["-shared", "-flto=auto", obj, "-o", lib],
                                                       capture_output=True).returncode == 0
        return ["-flto=auto"] if ok else []
    except OSError:
        return []


if sys.platform != "win32" and not assembler_knows_amx():
    compile_args.append("-DCB_NO_AMX_ASM")
if sys.platform == "win32" and platform.machine().lower() in ("x86_64", "amd64") and not msvc_knows_amx_intrinsics():
    compile_args.append("/DCB_NO_AMX_INTRINSICS")

CSRC = os.path.join("colibri", "csrc")
HEADERS = [os.path.join(CSRC, name) for name in os.listdir(CSRC)]
PXDS = [os.path.join("colibri", p) for p in os.listdir("colibri") if p.endswith(".pxd")]
# the kernel table (_kernels) and its entry points; the router; the layer loop; the test and
# benchmark probes. Each .pyx has its contract with the others and with csrc/ in a .pxd.
MODULES = ["_kernels", "_routing", "_engine", "_probes"]
# the kernel module is compiled with these too, and linked with the compile flags (its code is made at link)
KERNEL_LTO = gcc_parallel_lto()
FLAGS = json.dumps({"compile": compile_args, "link": link_args, "kernel_lto": KERNEL_LTO, "debug": debug,
                    "python": sys.version})


def sources(name: str) -> list:
    """What module `name`'s translation reads: its .pyx, the .pxi parts it includes (_engine's, by
    job), the .pxd contracts and the headers."""
    pyx = os.path.join("colibri", f"{name}.pyx")
    with open(pyx) as f:
        parts = re.findall(r'^include "([\w.]+\.pxi)"', f.read(), re.M)
    return [pyx, *(os.path.join("colibri", part) for part in parts), *PXDS, *HEADERS]


def in_place(name: str) -> str:
    """Where an in-place build (an editable install) puts module `name`'s binary."""
    return os.path.join("colibri", name + sysconfig.get_config_var("EXT_SUFFIX"))


def up_to_date(name: str) -> bool:
    """Whether module `name`'s in-place binary was built from its .pyx, the .pxd / .pxi files and the
    headers as they are now, with these flags and this Python (its stamp): then it is taken as it
    is, and the module is neither translated by Cython nor compiled again. pip builds an editable
    install in a fresh temporary directory with a fresh Cython each time (whose own .pxd files are
    newer than any translation), so without this the README's second command (`pip install -e
    ".[test]"`) recompiled every module though nothing had changed; a wheel built from a built tree
    reuses them the same way."""
    binary, stamp = in_place(name), in_place(name) + ".flags"
    if not (os.path.exists(binary) and os.path.exists(stamp)):
        return False
    with open(stamp) as f:
        if f.read() != FLAGS:
            return False
    built = os.path.getmtime(binary)
    return all(os.path.getmtime(p) <= built for p in sources(name))


def extension(name: str) -> Extension:
    lto = KERNEL_LTO if name == "_kernels" else []
    return Extension(f"colibri.{name}", sources=[os.path.join("colibri", f"{name}.pyx")], include_dirs=[CSRC],
                     depends=sources(name)[1:], extra_compile_args=compile_args + lto,
                     extra_link_args=link_args + (compile_args + lto if lto else []))


class BuildExt(build_ext):
    """The modules compiled side by side (one per CPU); an up_to_date() one copied, not built. An
    in-place build stamps each binary it makes with the flags (FLAGS)."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

    def run(self):
        self._into_source = bool(self.inplace or getattr(self, "editable_mode", False))
        super().run()

    def build_extension(self, ext):
        name = ext.name.rpartition(".")[2]
        target = self.get_ext_fullpath(ext.name)
        if not self.force and name in CURRENT:
            if os.path.abspath(target) != os.path.abspath(in_place(name)):
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copy2(in_place(name), target)
            print(f"colibri: {ext.name} is up to date ({in_place(name)})")
            return
        # not up to date by its stamp (new flags, say) though its files may be older than its
        # binary: build it, where setuptools would compare only the files' times
        force, self.force = self.force, True
        try:
            super().build_extension(ext)
        finally:
            self.force = force
        if self._into_source:
            with open(in_place(name) + ".flags", "w") as f:
                f.write(FLAGS)


CURRENT = {name for name in MODULES if up_to_date(name)}
setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[extension(name) for name in MODULES if name in CURRENT] + cythonize(
        [extension(name) for name in MODULES if name not in CURRENT],
        compiler_directives={
            "language_level": 3,
            "boundscheck": debug,
            "wraparound": debug,
            "cdivision": True,
            "initializedcheck": debug,
        },
    ),
)
