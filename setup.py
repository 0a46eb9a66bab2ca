"""Build colibri._kernels: Cython over the C headers in colibri/csrc, with OpenMP.

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
    compile_args = ["/O2", "/openmp"]
    link_args = []
else:
    compile_args = ["-O3", "-fopenmp", "-fno-math-errno"]
    link_args = ["-fopenmp"]
if debug and sys.platform != "win32":
    compile_args = ["-O0", "-g", "-fopenmp"]

extension = Extension(
    "colibri._kernels",
    sources=["colibri/_kernels.pyx"],
    include_dirs=["colibri/csrc"],
    depends=[os.path.join("colibri", "csrc", name) for name in os.listdir(os.path.join("colibri", "csrc"))],
    extra_compile_args=compile_args,
    extra_link_args=link_args,
)

setup(
    ext_modules=cythonize(
        [extension],
        compiler_directives={
            "language_level": 3,
            "boundscheck": debug,
            "wraparound": debug,
            "cdivision": True,
            "initializedcheck": debug,
        },
    ),
)
