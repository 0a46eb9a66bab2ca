"""Progress of long work (convert, calibrate, verify, eval) on stderr, never on stdout.

Design
------
One interface, `progress(total, desc, unit)`: a context manager whose object takes
`update(n)` as units of work finish (bytes written or hashed: unit "B", shown in kB/MB/GB with
a rate in MB/s; or a count of named units: "chunk", "file"). What it draws depends on the
stream (stderr unless given):
- a terminal (isatty): a tqdm bar, redrawn in place, with the rate and the time left;
- anything else (a log file, a pipe, CI): plain lines, one at most every PLAIN_INTERVAL_S
  seconds while the work goes on and one when it ends, e.g.
      [INFO] convert: 12.3 / 40.0 GB (31 %), 210 MB/s, 2 min 11 s left
      [INFO] convert: 40.0 / 40.0 GB (100 %), 205 MB/s, 3 min 15 s
  so a log shows the work alive without a line per tensor. Work that ends within the interval
  prints the end line only. Work that ends in an exception (an error, Ctrl-C, SIGTERM) prints
  no end line: an error stays the one line the CLI promises for it.
It never writes to stdout: several commands print their results there for scripts to parse
(`eval --json`, `verify`'s OK line, convert's log). On a terminal, an exception wipes the bar.

What is counted: convert (a checkpoint or a GGUF), the bytes of the tensors as stored in the
new directory, each counted once it is read, converted (quantized, GPTQ-compensated) and handed
to the writer, so the rate is MB of output a second; verify, the bytes of the files hashed;
calibrate and eval, the chunks of --ctx tokens run (their callbacks' unit; calibrate's bar opens
as its first chunk ends, once the model's load lines are out).

Who asks for it. The library stays silent: convert(), calibrate() and evaluate() draw nothing
by themselves (convert takes progress=True, calibrate and evaluate a callback), so a program
or a test that calls them with a discarding `log` gets no output at all; progress is the
command line's, whose functions (cli.py, evaluate.run_eval) turn it on. The environment
variable COLIBRI_PROGRESS turns it off everywhere ("0", "off", "no", "false", "none") or
forces the plain lines on a terminal too ("lines"). tqdm is a core dependency; were it missing,
a terminal gets the plain lines.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time

PLAIN_INTERVAL_S = 10.0  # the most often a plain progress line is printed
ENV = "COLIBRI_PROGRESS"
_OFF = ("0", "off", "no", "false", "none")


def _mode(stream) -> str:
    """'off', 'bar' or 'lines' for `stream` under COLIBRI_PROGRESS."""
    env = os.environ.get(ENV, "").strip().lower()
    if env in _OFF:
        return "off"
    if env == "lines":
        return "lines"
    try:
        tty = bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # a closed or stream-less stderr
        tty = False
    return "bar" if tty else "lines"


def _sized(stream) -> bool:
    """Does the terminal `stream` give a size tqdm can draw in (not 0 columns or 0 rows)?"""
    try:
        columns, lines = os.get_terminal_size(stream.fileno())
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        return False
    return columns > 0 and lines > 0


def size(n: float) -> str:
    """Bytes in decimal units: 950 B, 12.3 kB, 210 MB, 1.25 GB."""
    for limit, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= limit:
            v = n / limit
            return f"{v:.2f} {unit}" if v < 10 else f"{v:.1f} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{n:.0f} B"


def duration(s: float) -> str:
    """Seconds as people read them: 0.4 s, 45 s, 2 min 11 s, 1 h 05 min."""
    if s < 9.95:
        return f"{max(0.0, s):.1f} s"
    s = int(round(s))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class _Progress:
    """update(n): n more units done; at(done): `done` units done in all (for callbacks that count
    from the start, as calibrate's and evaluate's (i, n))."""

    done = 0
    initial = 0

    def update(self, n=1) -> None:
        self.done += n
        self._show(n)

    def at(self, done) -> None:
        if done > self.done:
            self.update(done - self.done)

    def _show(self, n) -> None:
        pass


class _Off(_Progress):
    """Progress that shows nothing."""


class _Lines(_Progress):
    """Plain lines on `stream`: at most every `interval` seconds of `clock`, and at the end."""

    def __init__(self, total, desc, unit, stream, interval, clock, initial=0):
        self.total, self.desc, self.unit, self.stream = total, desc, unit, stream
        self.interval, self.clock = interval, clock
        self.done = self.initial = initial
        self.start = self.last = clock()

    def _show(self, n) -> None:
        now = self.clock()
        if now - self.last >= self.interval and not (self.total and self.done >= self.total):  # then the end line
            self.last = now
            self._print(now, end=False)

    def close(self) -> None:
        self._print(self.clock(), end=True)

    def _amount(self, n) -> str:
        if self.unit == "B":
            return size(n)
        return f"{n:,}".replace(",", " ")

    def _print(self, now, end: bool) -> None:
        elapsed = now - self.start
        rate = (self.done - self.initial) / elapsed if elapsed > 0 else None
        total = self.total
        if self.unit == "B":
            line = f"{self.desc}: {size(self.done)}" + (f" / {size(total)}" if total else "")
            speed = f"{size(rate)}/s" if rate else None
        else:
            line = f"{self.desc}: {self._amount(self.done)}" + (f" / {self._amount(total)}" if total else "")
            line += f" {self.unit}s" if self.unit != "it" else ""
            speed = f"{rate:.3g} {self.unit}/s" if rate else None
        if total:
            line += f" ({int(100 * self.done // total)} %)"
        if speed:
            line += f", {speed}"
        if end:
            line += f", {duration(elapsed)}"
        elif rate and total and total > self.done:
            line += f", {duration((total - self.done) / rate)} left"
        print(f"[INFO] {line}", file=self.stream, flush=True)


class _Bar(_Progress):
    """A tqdm bar on `stream`."""

    def __init__(self, bar):
        self.bar = bar

    def _show(self, n) -> None:
        self.bar.update(n)


@contextlib.contextmanager
def progress(
    total,
    desc: str,
    unit: str = "it",
    enabled: bool = True,
    stream=None,
    interval: float | None = None,
    clock=time.monotonic,
    initial=0,
):
    """Show the progress of `total` units of work (None: unknown) as `desc` on `stream` (stderr):
    `with progress(n_bytes, "convert", unit="B") as p: ... p.update(k) ...` (or p.at(done)).
    unit "B": bytes; any other name counts that unit ("chunk", "file"). enabled=False (or
    COLIBRI_PROGRESS=0): nothing is shown. interval: seconds between plain lines (default
    PLAIN_INTERVAL_S); initial: units already done when it opens (not in the rate); clock: the
    time source of the plain lines (tests pass a fake one)."""
    stream = sys.stderr if stream is None else stream
    mode = "off" if not enabled or stream is None else _mode(stream)
    if mode == "bar":
        try:
            from tqdm import tqdm
        except ImportError:
            mode = "lines"
    if mode == "off":
        yield _Off()
        return
    if mode == "lines":
        p = _Lines(total, desc, unit, stream, PLAIN_INTERVAL_S if interval is None else interval, clock, initial)
        yield p  # an exception propagates from here: no end line
        p.close()
        return
    byte = unit == "B"
    sized = _sized(stream)  # a terminal that says it is 0 x 0 (a fresh pty): tqdm would draw nothing
    bar = tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=byte,
        unit_divisor=1000,
        file=stream,
        dynamic_ncols=sized,
        ncols=None if sized else 80,
        nrows=None if sized else 24,
        leave=True,
        disable=False,
        initial=initial,
    )
    p = _Bar(bar)
    p.done = p.initial = initial
    try:
        yield p
    except BaseException:
        bar.leave = False  # the bar is wiped: an error stays the one line below the command
        raise
    finally:
        bar.close()
