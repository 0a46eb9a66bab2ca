"""Build Colibri's compiled modules: Cython over the C headers in colibri/csrc, with OpenMP.

No -march=native: one build must run on any x86-64 CPU (ISA-specific kernels are compiled with
per-function target attributes and chosen at import). Cython directives are set here once;
COLIBRI_DEBUG=1 turns bounds and wraparound checks back on.
"""
import os
import sys

from Cython.Build import cythonize
from setuptools import Extension, setup

debug = os.environ.get("COLIBRI_DEBUG") == "1"

if sys.platform == "win32":
    # /std:c11: the headers use _Static_assert, which MSVC's C mode has only from C11; OpenMP 2.0
    # (/openmp) is all the code asks of it (signed loop indices, no collapse, no simd)
    compile_args = ["/O2", "/openmp", "/std:c11"]
    link_args = []
else:
    # each module includes the headers of every .pxd it cimports and calls a few of their static
    # functions; the compiler drops the rest, which is not worth a warning
    compile_args = ["-O3", "-fopenmp", "-fno-math-errno", "-Wno-unused-function"]
    link_args = ["-fopenmp"]
if debug and sys.platform != "win32":
    compile_args = ["-O0", "-g", "-fopenmp", "-Wno-unused-function"]

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

setup(
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
