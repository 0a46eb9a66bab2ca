"""`python -m colibri`: Ctrl-C while the package is still importing is one line and status 130 too."""
import sys

try:
    from .cli import main
except KeyboardInterrupt:
    print("\n[INFO] Interrupted", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
