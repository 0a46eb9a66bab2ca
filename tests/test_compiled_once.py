"""Each C function body is compiled into one module only.

The compiled modules are Cython over the headers in colibri/csrc: a module includes the headers of
its own `cdef extern from` blocks and those of every .pxd it cimports (transitively). The kernels'
bodies belong to _kernels, the router's to _routing, the expert cache's and the OS hints' to
_engine, the probes' to _probes; every other module reaches them through the owner's cimported
entry points and includes only the shared declarations (api.h, quant.h, target.h). So no module
carries a copy of another's code, and the build needs no -Wno-unused-function.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "colibri"
CSRC = PKG / "csrc"
MODULES = ["_kernels", "_routing", "_engine", "_probes"]

# a function definition that is compiled wherever its header is included: `static` without `inline`
BODY = re.compile(
    r"^(?:CB_TARGET_\w+\s+)?static\s+(?!inline\b|CB_ALWAYS_INLINE\b)[^;=()]*\b(\w+)\s*\([^;]*?\)\s*\{", re.M
)


def includes(header: str, seen: set) -> set:
    """`header` and every csrc header it includes, transitively."""
    if header in seen or not (CSRC / header).exists():
        return seen
    seen.add(header)
    for name in re.findall(r'#include "([\w.]+\.h)"', (CSRC / header).read_text()):
        includes(name, seen)
    return seen


def cimported(source: Path) -> set:
    text = source.read_text()
    return set(re.findall(r"cimport colibri\.(_\w+)", text)) | set(re.findall(r"from colibri\.(_\w+) cimport", text))


def headers_of(module: str) -> set:
    """The csrc headers module's C translation includes."""
    sources, todo = set(), [PKG / f"{module}.pyx", PKG / f"{module}.pxd"]
    while todo:
        source = todo.pop()
        if source in sources or not source.exists():
            continue
        sources.add(source)
        todo.extend(PKG / f"{name}.pxd" for name in cimported(source))
    found: set = set()
    for source in sources:
        for header in re.findall(r'cdef extern from "([\w.]+\.h)"', source.read_text()):
            includes(header, found)
    return found


def test_the_body_finder_finds_bodies():
    text = (CSRC / "routing.h").read_text()
    assert {"cb_route", "cb_route_sigmoid"} <= set(BODY.findall(text))
    assert "cb_topk_offer" not in BODY.findall(text)  # static inline: compiled only where called


# a template header's instantiation: its bodies named through a macro, `#define CB_VNNI_NAME(base) base##_avxvnni`
INSTANCE = re.compile(r"^#define (CB_\w+_NAME)\(base\) base##(\w+)", re.M)


def instances(headers: set) -> set:
    """The (naming macro, suffix) of every template instantiation in `headers`."""
    return {found for header in headers for found in INSTANCE.findall((CSRC / header).read_text())}


def test_every_function_body_is_compiled_in_one_module():
    reached = {module: headers_of(module) for module in MODULES}
    assert "dispatch.h" in reached["_kernels"] and "routing.h" in reached["_routing"]
    assert "expert_cache.h" in reached["_engine"] and "probes.h" in reached["_probes"]
    assert "test_steps.h" in reached["_probes"] and "test_steps.h" not in reached["_kernels"]
    for header in sorted(p.name for p in CSRC.glob("*.h")):
        bodies = BODY.findall((CSRC / header).read_text())
        owners = [module for module in MODULES if header in reached[module]]
        if bodies and all(re.fullmatch(r"CB_\w+_NAME", body) for body in bodies):
            continue  # a template (vnni_body.h, amx_body.h): its instantiations are checked below
        if bodies:
            assert len(owners) <= 1, f"{header} (bodies {bodies[:3]}) is compiled into {owners}"
    # a template is compiled again in each instantiation, under that instantiation's names: no two
    # modules instantiate one with the same names
    seen: dict = {}
    for module in MODULES:
        for found in instances(reached[module]):
            assert found not in seen, f"{found} is instantiated in {seen[found]} and {module}"
            seen[found] = module
    assert ("CB_VNNI_NAME", "_vnni_emulated") in seen and seen["CB_VNNI_NAME", "_vnni_emulated"] == "_probes"


def test_the_build_does_not_silence_unused_functions():
    assert "-Wno-unused-function" not in (REPO / "setup.py").read_text()
