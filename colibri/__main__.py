"""`python -m colibri`: Ctrl-C while the command line is still starting is one line and status 130.

The package's __init__ guards SIGINT from its first line when `python -m colibri` imports it;
cli.main() ends that guard inside its own KeyboardInterrupt handling. The except below covers
a start that did not go through `python -m` (runpy.run_module, a frozen launcher).
"""

import sys

# A directory named `colibri` in the current directory that is not the package (a clone's root,
# say) makes `colibri` a namespace package: its __init__ never runs and the imports below fail
# with a misleading ImportError. One line saying what is in the way instead.
_package = sys.modules.get(__package__ or "colibri")
if _package is not None and getattr(_package, "__file__", None) is None:
    _where = ", ".join(str(p) for p in getattr(_package, "__path__", []))
    print(
        f"error: 'colibri' resolves to the directory {_where}, which is not the installed package (it shadows "
        f"it); run python -m colibri from another directory, or rename that directory",
        file=sys.stderr,
    )
    raise SystemExit(2)

try:
    from .cli import main
except KeyboardInterrupt:
    print("\n[INFO] Interrupted", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
