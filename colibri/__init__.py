"""Colibri: CPU inference for Mixture-of-Experts language models.

    import colibri
    m = colibri.load("path/to/model")        # a directory made by `python -m colibri convert`
    logits = m.forward([1, 15, 27])          # float32 [T, vocab]
    for tok in m.generate([1, 15], max_new_tokens=16): ...

Importing the package is light: `load`, `Model` and `ModelConfig` (numpy and the compiled modules
behind them) are imported on first use, as is a submodule named as an attribute
(`colibri.modeldir`).

Ctrl-C while `python -m colibri` starts is one line and status 130. runpy imports this package,
then colibri/__main__.py, which imports colibri/cli.py, whose main() turns KeyboardInterrupt into
that line. Before main() runs, a KeyboardInterrupt would end in runpy's traceback, so for that
stretch, and only when this import is `python -m colibri` locating its main module, SIGINT has a
handler that prints the line and exits; cli.main() gives SIGINT its previous handler back
(_end_startup_guard) first thing inside its try.
"""

import os
import sys

_INTERRUPTED_LINE = "\n[INFO] Interrupted"  # as cli.main prints it
_previous_sigint = None


def _located_by_python_m() -> bool:
    """True while `python -m colibri` (or `-m colibri.__main__`) imports this package: sys.argv[0]
    is "-m" until the main module is found, and runpy's _run_module_as_main holds its name."""
    if sys.argv[:1] != ["-m"]:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_run_module_as_main" and frame.f_globals.get("__name__") == "runpy":
            return frame.f_locals.get("mod_name") in (__name__, f"{__name__}.__main__")
        frame = frame.f_back
    return False


def _interrupted_at_startup(signum, frame):
    # os._exit, not SystemExit: an exception raised inside an import that C code runs (numpy's
    # extension importing datetime) comes back wrapped in that module's ImportError traceback;
    # nothing needs cleaning up before the command has started
    print(_INTERRUPTED_LINE, file=sys.stderr, flush=True)
    os._exit(130)


def _signal_module():
    """The built-in _signal (already loaded at start-up: nothing is imported before the guard
    holds), else signal."""
    try:
        import _signal

        return _signal
    except ImportError:  # pragma: no cover - an interpreter without the built-in
        import signal

        return signal


def _end_startup_guard() -> None:
    """Give SIGINT back its previous handler (KeyboardInterrupt) if the start-up guard holds it."""
    global _previous_sigint
    if _previous_sigint is not None:
        sig = _signal_module()
        if sig.getsignal(sig.SIGINT) is _interrupted_at_startup:
            sig.signal(sig.SIGINT, _previous_sigint)
        _previous_sigint = None


if _located_by_python_m():
    _sig = _signal_module()
    if _sig.getsignal(_sig.SIGINT) is _sig.default_int_handler:  # not where SIGINT is ignored
        _previous_sigint = _sig.signal(_sig.SIGINT, _interrupted_at_startup)
    del _sig

from importlib import import_module as _import_module  # noqa: E402  (after the guard: Ctrl-C from here on is one line)
from importlib.util import find_spec as _find_spec  # noqa: E402

from .errors import ColibriError  # noqa: E402

__version__ = "0.1.0"
__all__ = ["load", "Model", "ModelConfig", "ColibriError", "__version__"]

_LAZY = {"load": ".model", "Model": ".model", "ModelConfig": ".config"}
_COMPILED = ("_engine", "_kernels", "_routing")  # setup.py's Cython extensions

_missing = [name for name in _COMPILED if _find_spec(f"{__name__}.{name}") is None]
if _missing:  # pragma: no cover - depends on the build
    raise ImportError(
        "Colibri's compiled modules are not built. Install the package with `pip install .` (or, in a "
        "source tree, `pip install -e .`: it compiles the Cython extensions; needs a C compiler). "
        f"(missing: {', '.join(f'{__name__}.{n}' for n in _missing)})"
    )


def __getattr__(name):
    if name in _LAZY:
        value = getattr(_import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("__") and _find_spec(f"{__name__}.{name}") is not None:
        return _import_module(f".{name}", __name__)  # `import colibri; colibri.modeldir.ModelDir`
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
