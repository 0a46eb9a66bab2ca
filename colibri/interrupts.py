"""Blocks a Ctrl-C must not cut: SIGINT (and SIGTERM) held until the block ends; blocks whose
cleanup a SIGTERM must run (sigterm_cleans_up).

What must happen whole: convert's renames that swap a model directory in and the removal of its
temporary one; `run`'s printing of a token and counting it (so "Interrupted after N tokens" is what
the user saw). The signals that arrive meanwhile are raised again once the handlers in place
before the block are back. The handlers are swapped, not the thread's signal mask: a process-wide
signal goes to any thread whose mask lets it through (the OpenMP workers'), and CPython runs the
Python handler in the main thread at its next check whichever thread took it.

CPython's signal.signal() runs the handlers of signals already pending before it installs a new
one, so a restore can raise (a SIGINT that came just after SIGINT's own restore, its handler
raising KeyboardInterrupt): every handler is still put back, and the first such exception is
raised after all of them are.
"""

from __future__ import annotations

import contextlib
import signal
import threading

# what convert holds back; `run` holds back SIGINT alone (its SIGTERM has no count to keep right)
DEFERRED_SIGNALS = tuple(s for s in (signal.SIGINT, getattr(signal, "SIGTERM", None)) if s is not None)


def _restore(sig, handler) -> BaseException | None:
    """signal.signal(sig, handler), retried until installed; the first exception a pending
    handler raised meanwhile is returned (the handler is installed all the same)."""
    error = None
    while True:
        try:
            signal.signal(sig, handler)
            return error
        except BaseException as e:  # noqa: BLE001 - a pending signal's handler, raised before the swap
            error = error or e


@contextlib.contextmanager
def signals_deferred(signals=DEFERRED_SIGNALS):
    """In the main thread: `signals` arriving during the block are delivered after it, to the
    handlers in place before it (elsewhere the block runs as it is). A signal whose handler is
    ignored or not Python's to change (set from C) is left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved, got = {}, []
    try:
        for sig in signals:
            prev = signal.getsignal(sig)
            if prev is None or prev == signal.SIG_IGN:
                continue
            signal.signal(sig, lambda signum, frame: got.append(signum))
            saved[sig] = prev
        yield
    finally:
        error = None
        for sig, prev in saved.items():
            error = error or _restore(sig, prev)
        for sig in dict.fromkeys(got):  # each once, in the order they first came
            try:
                signal.raise_signal(sig)  # its handler runs here (the default one may end the process)
            except BaseException as e:  # noqa: BLE001 - raised after the others had their turn
                error = error or e
        if error is not None:
            raise error


class Terminated(BaseException):
    """SIGTERM inside sigterm_cleans_up: raised where the main thread is, so that its `finally`
    blocks and `except BaseException` cleanups run as they do for Ctrl-C."""


@contextlib.contextmanager
def sigterm_cleans_up():
    """In the main thread: a SIGTERM during the block raises Terminated, which takes the block's
    cleanup path (a staging directory removed); then the handler in place before gets the signal
    (the default one ends the process, as SIGTERM does). A second SIGTERM does not cut the
    cleanup. Where the handler is not Python's (set from C), ignored, or not the main thread,
    the block runs as it is."""
    sig = getattr(signal, "SIGTERM", None)
    main = threading.current_thread() is threading.main_thread()
    prev = signal.getsignal(sig) if sig is not None and main else None
    if prev is None or prev == signal.SIG_IGN:
        yield
        return
    fired = []

    def handler(signum, frame):
        if not fired:
            fired.append(signum)
            raise Terminated()

    signal.signal(sig, handler)
    try:
        yield
    except Terminated:
        signal.signal(sig, prev)
        signal.raise_signal(sig)  # the previous handler's turn
        raise KeyboardInterrupt from None  # it returned: stop as Ctrl-C does
    finally:
        signal.signal(sig, prev)
