"""Colibri: CPU inference for Mixture-of-Experts language models.

    import colibri
    m = colibri.load("path/to/model")        # a directory made by `python -m colibri convert`
    logits = m.forward([1, 15, 27])          # float32 [T, vocab]
    for tok in m.generate([1, 15], max_new_tokens=16): ...
"""
try:
    from . import _engine, _kernels, _routing  # noqa: F401  (the compiled modules: setup.py)
except ImportError as e:  # pragma: no cover - depends on the build
    raise ImportError(
        "Colibri's compiled modules are not built. Install the package with `pip install .` (or, in a "
        "source tree, `pip install -e .`: it compiles the Cython extensions; needs a C compiler). "
        f"({e})") from None

from .config import ModelConfig
from .errors import ColibriError
from .model import Model, load

__version__ = "0.1.0"
__all__ = ["load", "Model", "ModelConfig", "ColibriError", "__version__"]
