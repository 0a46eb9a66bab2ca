"""Blocks a Ctrl-C must not cut: SIGINT and SIGTERM held until the block ends.

What must happen whole: convert's renames that swap a model directory in and the removal of its
temporary one; `run`'s printing of a token and counting it (so "Interrupted after N tokens" is what
the user saw). The signals that arrive meanwhile are raised again, in order, once the handlers in
place before the block are back.
"""
from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def signals_deferred():
    """In the main thread: SIGINT and SIGTERM arriving during the block are delivered after it, to
    the handlers in place before it (elsewhere the block runs as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved, got = {}, []
    for sig in (signal.SIGINT, getattr(signal, "SIGTERM", None)):
        if sig is None:
            continue
        prev = signal.getsignal(sig)
        if prev is not None and prev != signal.SIG_IGN:
            saved[sig] = prev
            signal.signal(sig, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        for sig, prev in saved.items():
            signal.signal(sig, prev)
        for sig in dict.fromkeys(got):
            signal.raise_signal(sig)
