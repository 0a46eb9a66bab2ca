"""`python -m colibri`: Ctrl-C while the command line is still starting is one line and status 130.

The package's __init__ guards SIGINT from its first line when `python -m colibri` imports it;
cli.main() ends that guard inside its own KeyboardInterrupt handling. The except below covers
a start that did not go through `python -m` (runpy.run_module, a frozen launcher).
"""
import sys

try:
    from .cli import main
except KeyboardInterrupt:
    print("\n[INFO] Interrupted", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
