#!/usr/bin/env python3
"""The engine's prompt speed on two int steps (the AMX step against the AVX512-VNNI one), in one
call on a lent machine: build, make the model, convert, measure, interleaved.

    python tools/bench/amx_engine.py [--build | --build-if-needed] [--out DIR] [--model mixtral-mini] [--formats int8,bf16]
                                     [--steps amx,avx512-vnni] [--threads 16,1] [--prompt-len 512]
                                     [--rounds 3] [--budget-s 420] [--no-probe] [--no-kernels]
                                     [--chunks 128,512] [--variants default,bf16-pairs1,...]

Made for the lent AMX machine, where device time is short
and nothing can be fetched: --build compiles the extensions in place (`setup.py build_ext
--inplace`, about 4 minutes of a 16-core Xeon); --build-if-needed only where the extensions in place
were not built from these sources or do not import. The extensions are portable (no -march=native):
built here, stamped (`--stamp`: colibri/.build_sources, the sources' hash) and carried to the
machine with the stamp (the run call's `carry`), they save those minutes. The machine's python3 is
3.12 (the lent machines' image, with numpy, Cython, setuptools, jinja2 and tokenizers), so what it
imports is a cpython-312 build, made here beside ours by a 3.12 interpreter, stripped of its debug
information (a run call carries 64 MiB with the tracked files, which take about 45):

    python3.12 -m venv /tmp/v312 && /tmp/v312/bin/pip install numpy cython setuptools sentencepiece tokenizers jinja2
    /tmp/v312/bin/python setup.py build_ext --inplace && strip --strip-debug colibri/*.cpython-312-*.so
    /tmp/v312/bin/python tools/bench/amx_engine.py --stamp

and the run carries colibri/_{kernels,engine,probes,routing}.cpython-312-x86_64-linux-gnu.so (3.3
MB), colibri/.build_sources and build/amx_check.tar.xz (below), with `python3
tools/bench/amx_engine.py --build-if-needed --out $OUT` (checked on this Debian 12, glibc 2.36, with
pyenv's 3.12.1: no build, the same runs).

First (seconds; --no-probe skips it) it builds and runs tools/bench/amx_bf16_probe.c, which finds
the order of roundings of the machine's TDPBF16PS and VDPBF16PS (what an AMX bf16 prompt tile
with decode's bits has to follow), into OUT/amx_bf16_probe.txt. Then (--no-kernels skips it)
tools/bench/amx_check.c, the AMX tiles' bits and speed against the AVX-512 steps' at the kernel
level (16 to 256 tokens, one thread and all), once per --variants build of it: the committed tiles
("default", int8 and bf16) and the compile-time variants of their schedules (KERNEL_VARIANTS: the
int tile's pipeline and chunk, the bf16 tile's blocking), each timed in the formats it changes,
into OUT/amx_check-NAME.txt, with a table of the AMX tile's GOP/s and its ratio to the AVX-512 tile
per variant (OUT/amx_variants.json; a variant whose checks fail is listed apart): which schedule
to commit. The builds (about a minute each, in parallel) are kept in build/amx_check/ under their
sources' hash; --stamp makes them here and packs them into build/amx_check.tar.xz (0.6 MB), which a
run unpacks instead of building. The kernels get a third of --budget-s.

Then the checkpoint is written by make_models.py without transformers (its frozen config.json, no
tokenizer) and converted with `colibri convert`, all under --work, and rounds of `colibri bench
--json` (a prompt of --prompt-len tokens, 8 decoded) run, each round every format x thread count x
step once in turn (the steps' order reversed every other round), the step chosen by
COLIBRI_INT_STEP; with --chunks, each prefill chunk (bench --prefill-chunk: the AMX tiles take an
expert's tokens 16 at a time, so its share of a chunk matters) in turn too. The steps are checked
against the machine's before anything is made; no new run starts after --budget-s seconds from the
start, and a run that fails (or outlives the budget) is recorded and the others go on. Prints a
table of the median prefill and decode tok/s per format / threads / step and the first step's
ratio to the last, and rewrites OUT/amx_engine.json after every run (so a call killed at its time
limit keeps what it measured). On a machine without AMX, --steps avx512-vnni,avx2 exercises the
same path.

The peers, in the same rounds (--llama-bench, --ik-bench: the issue's "≥ 2x the best peer" on an
AMX host). The machine has no torch and no llama.cpp sources, so write_gguf.py writes the
checkpoint's GGUFs there (int8 -> q8_0, int4 -> q4_0, bf16 -> bf16: the tensors llama.cpp's
converter and `llama-quantize --pure` write, checked bit for bit here; a stand-in vocabulary), in
the background while the engine's conversions run; --gguf-path puts a copy of the gguf package
(with PyYAML, which it imports) on its PYTHONPATH. Binaries built here are carried: llama.cpp's from
`ISA=avx512 tools/bench/build_llama.sh` (AVX-512 with VNNI and BF16, no AMX: llama.cpp's AMX path
dies with SIGILL on these VMs), ik_llama.cpp's as its user builds it (shared libraries beside its
llama-bench are found there). Each runs `llama-bench -p PROMPT_LEN -n 8 -r 2 -t T -o json` (ik as
it comes and with -rtr 1) at --peer-threads (all cores; each one of --threads), and a second table gives their
prefill and decode with the ratio of the engine's first step (its best chunk) to the best peer. A
GGUF that could not be written is a failure in the JSON, and its format runs without the peers. What the run call carries for them (one more carry
path, build/peers.tar.xz, ~7 MB: stripped binaries and the packages, xz):

    build/peers/llama.cpp/llama-bench                   (ISA=avx512 tools/bench/build_llama.sh)
    build/peers/ik_llama.cpp/{llama-bench,libllama.so,libggml.so}   (the user's own AVX-512 build)
    build/peers/pylib/{gguf,yaml}                       (site-packages' gguf and PyYAML's .py files)

and the call (timeout_s about 560; all cores only, so that the budget holds two or three rounds
of every engine rather than one with the slow one-thread runs; the archive unpacked by Python, not
by a tar that may lack xz): `python3 -c "import tarfile;
tarfile.open('build/peers.tar.xz').extractall('build/peers', filter='data')" && PYTHONUNBUFFERED=1
python3 tools/bench/amx_engine.py --build-if-needed --out $OUT --threads $(nproc) --llama-bench
build/peers/llama.cpp/llama-bench --ik-bench build/peers/ik_llama.cpp/llama-bench --gguf-path
build/peers/pylib`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What the extensions are built from, and where the hash of those files is kept next to a build
# (git ignores it): --build-if-needed rebuilds unless the stamp is these sources'.
BUILD_SOURCES = ("setup.py", "colibri/*.pyx", "colibri/*.pxd", "colibri/csrc/*.h")
STAMP = ROOT / "colibri" / ".build_sources"


def sources_hash() -> str:
    h = hashlib.sha256()
    for pattern in BUILD_SOURCES:
        for path in sorted(ROOT.glob(pattern)):
            h.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


# amx_check.c builds to time against each other (kernels_amx.h's compile-time knobs): name -> (gcc -D
# flags, the formats whose tile they change). "default" is the committed build.
KERNEL_VARIANTS = {
    "default": ([], "int8,bf16"),
    "int-store0-ahead4": (["-DCB_AMX_STORE_DELAY=0", "-DCB_AMX_LOOKAHEAD=4"], "int8"),
    "int-store1-ahead2": (["-DCB_AMX_STORE_DELAY=1", "-DCB_AMX_LOOKAHEAD=2"], "int8"),
    "int-store2-ahead2": (["-DCB_AMX_STORE_DELAY=2", "-DCB_AMX_LOOKAHEAD=2"], "int8"),
    "int-store0-ahead2": (["-DCB_AMX_STORE_DELAY=0", "-DCB_AMX_LOOKAHEAD=2"], "int8"),
    "int-kblocks8": (["-DCB_AMX_KBLOCKS=8"], "int8"),
    "bf16-pairs1": (["-DCB_AMX_BF16_PAIRS=1", "-DCB_AMX_BF16_CHUNKS=16"], "bf16"),
    "bf16-chunks16": (["-DCB_AMX_BF16_CHUNKS=16"], "bf16"),
}
AMX_CHECK_FLAGS = ["-O3", "-fopenmp", "-Icolibri/csrc"]
VARIANT_DIR = ROOT / "build" / "amx_check"
# The builds of the current sources in one archive (xz: 0.6 MB for 14 MB of binaries that differ
# little), what a run call carries; unpacked into VARIANT_DIR where a build is missing.
VARIANT_ARCHIVE = ROOT / "build" / "amx_check.tar.xz"
# the engine's format -> the GGUF type with the same blocks (write_gguf.py --type)
PEER_TYPES = {"int8": "q8_0", "int4": "q4_0", "bf16": "bf16"}


def variant_binary(name: str) -> Path:
    """Where variant NAME's amx_check build is kept: named by the hash of what it is built from."""
    h = hashlib.sha256(" ".join(AMX_CHECK_FLAGS + KERNEL_VARIANTS[name][0]).encode())
    for path in sorted([ROOT / "tools/bench/amx_check.c", *(ROOT / "colibri/csrc").glob("*.h")]):
        h.update(path.read_bytes())
    return VARIANT_DIR / f"amx_check-{name}-{h.hexdigest()[:16]}"


def unpack_variants(names: list) -> None:
    """The carried archive's builds of these sources into VARIANT_DIR (only those: the file names
    carry the sources' hash, so a stale archive gives nothing)."""
    if not VARIANT_ARCHIVE.is_file():
        return
    wanted = {variant_binary(n).name: variant_binary(n) for n in names}
    with tarfile.open(VARIANT_ARCHIVE, "r:xz") as tar:
        for member in tar.getmembers():
            exe = wanted.get(member.name)
            if exe is None or exe.is_file() or not member.isfile():
                continue
            tmp = exe.with_suffix(".tmp")
            tmp.write_bytes(tar.extractfile(member).read())
            tmp.chmod(0o755)
            tmp.replace(exe)


def build_variants(names: list, deadline: float) -> dict:
    """Build the variants not already kept (or carried), in parallel, until the monotonic deadline:
    {name: binary, or the line that says why there is none}."""
    VARIANT_DIR.mkdir(parents=True, exist_ok=True)
    unpack_variants(names)
    built, procs = {}, {}
    for name in names:
        exe = variant_binary(name)
        if exe.is_file():
            built[name] = exe
            continue
        tmp = exe.with_suffix(".tmp")
        try:  # (its own process group: a timeout ends cc1 and as too, not only gcc)
            procs[name] = (
                exe,
                tmp,
                subprocess.Popen(
                    [
                        "gcc",
                        *AMX_CHECK_FLAGS,
                        *KERNEL_VARIANTS[name][0],
                        "tools/bench/amx_check.c",
                        "-o",
                        str(tmp),
                        "-lm",
                    ],
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                ),
            )
        except OSError as e:
            built[name] = f"gcc could not start: {e}"
    for name, (exe, tmp, p) in procs.items():
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            out, p.returncode = "gcc ran past the budget", -1
        if p.returncode == 0:
            tmp.replace(exe)  # (whole or not at all: a killed build leaves no binary)
            built[name] = exe
        else:
            tmp.unlink(missing_ok=True)
            built[name] = f"gcc failed ({p.returncode}): {out.strip()[-500:]}"
    return built


def stamp_variants(names: list) -> dict:
    """--stamp: build the variants, drop the builds of other sources, and archive the current ones
    for the run call to carry. {name: error} for those that failed."""
    built = build_variants(names, time.monotonic() + 1800)
    current = {b.name for b in built.values() if isinstance(b, Path)}
    for old in VARIANT_DIR.glob("amx_check-*"):
        if old.name not in current:
            old.unlink()
    with tarfile.open(VARIANT_ARCHIVE.with_suffix(".tmp"), "w:xz") as tar:
        for name in sorted(current):
            tar.add(VARIANT_DIR / name, arcname=name)
    VARIANT_ARCHIVE.with_suffix(".tmp").replace(VARIANT_ARCHIVE)
    return {n: b for n, b in built.items() if isinstance(b, str)}


def kernel_variants(a, deadline: float) -> None:
    """amx_check once per variant of --variants (built first, all at once), each in the formats it
    changes, one after another, none started after the deadline; OUT/amx_check-NAME.txt each, and
    the prefill lines as a table. A variant whose checks failed (a bits line, an exit status) is
    listed apart, not as a candidate."""
    threads = ",".join(map(str, sorted({1, cores()})))
    built = build_variants(a.variant_list, deadline)
    rows, failed = {}, {}  # (format, tokens, threads) -> {variant: (amx GOP/s, amx/avx512)}
    for name in a.variant_list:
        exe, left = built[name], deadline - time.monotonic()
        if isinstance(exe, str):
            text, failed[name] = f"amx_check {name}: {exe}\n", exe
        elif left <= 0:
            text, failed[name] = f"amx_check {name}: not run (the budget is spent)\n", "not run"
        else:
            try:
                p = subprocess.run(
                    [
                        str(exe),
                        *([] if name == "default" else ["--hardware-only"]),
                        "--dtypes",
                        KERNEL_VARIANTS[name][1],
                        "--tokens",
                        "16,64,256",
                        "--threads",
                        threads,
                        "--reps",
                        "5",
                    ],
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                    timeout=min(240.0, left),
                )
                text = p.stdout + p.stderr + (f"amx_check {name} exited with {p.returncode}\n" if p.returncode else "")
                if p.returncode:  # why: its error line, else its first failed check
                    why = [ln for ln in p.stderr.splitlines() if ln.strip()] or [
                        ln for ln in p.stdout.splitlines() if re.search(r"MISMATCH|FAILED|none of the orders", ln)
                    ]
                    failed[name] = f"exit {p.returncode}: {why[0] if why else 'see amx_check-' + name + '.txt'}"
            except (OSError, subprocess.TimeoutExpired) as e:
                text, failed[name] = f"amx_check {name} failed: {e}\n", str(e)
        (a.out / f"amx_check-{name}.txt").write_text(text)
        print(f"[amx_engine] amx_check {name}:\n{text}", end="", flush=True)
        if name in failed:
            continue
        for m in re.finditer(
            r"^prefill (\S+) \S+ tokens (\d+) threads (\d+): avx512 [\d.]+ GOP/s, amx ([\d.]+) GOP/s, "
            r"amx/avx512 ([\d.]+)$",
            text,
            re.M,
        ):
            rows.setdefault((m[1], int(m[2]), int(m[3])), {})[name] = (float(m[4]), float(m[5]))
    (a.out / "amx_variants.json").write_text(
        json.dumps(
            {
                "rows": [
                    {"format": f, "tokens": n, "threads": t, "variants": v} for (f, n, t), v in sorted(rows.items())
                ],
                "failed": failed,
            },
            indent=1,
        )
    )
    if rows:
        names = [n for n in a.variant_list if any(n in v for v in rows.values())]
        print("\n| format | tokens | threads | " + " | ".join(f"{n}: amx GOP/s (/ avx512)" for n in names) + " |")
        print("|---|---:|---:|" + "---|" * len(names))
        for (f, n, t), v in sorted(rows.items()):
            cells = [f"{v[x][0]:.1f} ({v[x][1]:.2f})" if x in v else "-" for x in names]
            print(f"| {f} | {n} | {t} | " + " | ".join(cells) + " |", flush=True)
    for name, why in failed.items():
        print(f"[amx_engine] variant {name} left out: {why}", flush=True)


class RunFailed(Exception):
    pass


def run(cmd: list, env: dict | None = None, log: Path | None = None, timeout: float | None = None) -> str:
    """Run cmd in the repository root; its stdout (its output to log). RunFailed names the command
    and ends with its stderr's tail when it fails or outlives timeout."""
    try:
        p = subprocess.run(
            cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        raise RunFailed(f"{' '.join(map(str, cmd))} ran past {timeout:.0f} s") from None
    if log is not None:
        log.write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        raise RunFailed(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return p.stdout


def cores() -> int:
    """The CPUs this process may run on (its affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", action="store_true", help="compile the extensions in place first")
    ap.add_argument(
        "--build-if-needed",
        action="store_true",
        help="compile them unless the stamp says they were built from these sources and they import",
    )
    ap.add_argument(
        "--stamp",
        action="store_true",
        help="only write the stamp for the extensions in place (just built from this tree) and stop",
    )
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/amx_engine")))
    ap.add_argument("--work", type=Path, default=Path("/tmp/amx_engine_work"))
    ap.add_argument("--model", default="mixtral-mini")
    ap.add_argument(
        "--formats",
        default="int8,bf16",
        help="bf16 runs bf16 products (the default where the CPU has AVX512_BF16): on the amx step "
        "its TDPBF16PS tile, on the others vdpbf16ps",
    )
    ap.add_argument("--steps", default="amx,avx512-vnni")
    ap.add_argument("--threads", default=f"{cores()},1")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--no-probe", action="store_true", help="skip the bf16 rounding-order probe")
    ap.add_argument("--no-kernels", action="store_true", help="skip amx_check.c (the tiles' bits and speed)")
    ap.add_argument(
        "--chunks", default="128,512", help='prefill chunks to run each of ("": the engine\'s default only)'
    )
    ap.add_argument(
        "--variants",
        default=",".join(KERNEL_VARIANTS),
        help=f"amx_check builds to time (of {', '.join(KERNEL_VARIANTS)})",
    )
    ap.add_argument("--llama-bench", type=Path, help="llama.cpp's llama-bench, run beside the engine")
    ap.add_argument(
        "--ik-bench", type=Path, help="ik_llama.cpp's llama-bench (build it yourself), run as it comes and with -rtr 1"
    )
    ap.add_argument("--gguf-path", type=Path, help="a directory with the gguf package (and PyYAML) for write_gguf.py")
    ap.add_argument("--peer-threads", default=str(cores()), help="the peers' thread counts")
    a = ap.parse_args(argv)
    a.llama_bench, a.ik_bench, a.gguf_path = (p and p.resolve() for p in (a.llama_bench, a.ik_bench, a.gguf_path))
    a.peers = {
        name: (bench, extra)
        for name, bench, extra in (
            ("llama.cpp", a.llama_bench, []),
            ("ik_llama.cpp", a.ik_bench, []),
            ("ik_llama.cpp -rtr", a.ik_bench, ["-rtr", "1"]),
        )
        if bench
    }
    for name, (bench, _) in a.peers.items():
        if not (bench.is_file() and os.access(bench, os.X_OK)):
            ap.error(f"{bench}: {name}'s llama-bench is not an executable file")
    try:
        a.peer_thread_list = list(dict.fromkeys(int(t) for t in a.peer_threads.split(",") if t))
        if not a.peer_thread_list or min(a.peer_thread_list) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--peer-threads {a.peer_threads!r}: give positive integers separated by commas")
    try:
        engine_threads = {int(t) for t in a.threads.split(",") if t}
    except ValueError:
        ap.error(f"--threads {a.threads!r}: give positive integers separated by commas")
    missing = [t for t in a.peer_thread_list if t not in engine_threads]
    if a.peers and missing:  # (the peers run in the engine's rounds, at its thread counts)
        ap.error(f"--peer-threads {','.join(map(str, missing))}: not among --threads {a.threads}")
    a.variant_list = list(dict.fromkeys(v for v in a.variants.split(",") if v))
    unknown = [v for v in a.variant_list if v not in KERNEL_VARIANTS]
    if unknown:
        ap.error(f"--variants {','.join(unknown)}: not a variant (the variants: {', '.join(KERNEL_VARIANTS)})")
    try:  # (checked before the minutes a lent machine spends building)
        a.chunk_list = list(dict.fromkeys(int(c) for c in a.chunks.split(",") if c)) or [None]
        if any(c is not None and c < 1 for c in a.chunk_list):
            raise ValueError
    except ValueError:
        ap.error(f"--chunks {a.chunks!r}: give positive integers separated by commas")
    try:
        if a.stamp:
            run(
                [sys.executable, "-c", "import colibri._kernels, colibri._engine, colibri._probes, colibri._routing"],
                timeout=120,
            )
            STAMP.write_text(sources_hash() + "\n")
            print(f"[amx_engine] {STAMP}: {STAMP.read_text().strip()}")
            if a.no_kernels:
                return 0
            failed = stamp_variants(a.variant_list)
            for name, error in failed.items():
                print(f"[amx_engine] amx_check {name}: {error}", file=sys.stderr)
            print(
                f"[amx_engine] amx_check builds in {VARIANT_ARCHIVE} (carry it): "
                f"{', '.join(n for n in a.variant_list if n not in failed)}"
            )
            return 1 if failed else 0
        return measure(a)
    except RunFailed as e:
        print(f"[amx_engine] {e}", file=sys.stderr)
        return 1


def standalone(out: Path, name: str, build: list, args: list, timeout: float) -> None:
    """Build tools/bench/NAME.c with gcc (build: its flags) and run it with args; its output to
    out/NAME.txt. A failure (or a check it reports failed: exit 1) is printed and recorded there,
    and the measurement goes on."""
    exe = out / name
    try:
        run(["gcc", *build, f"tools/bench/{name}.c", "-o", str(exe), "-lm"], timeout=120)
        p = subprocess.run([str(exe), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        text = p.stdout + p.stderr + (f"{name} exited with {p.returncode}\n" if p.returncode else "")
    except (RunFailed, OSError, subprocess.TimeoutExpired) as e:
        text = f"{name} failed: {e}\n"
    (out / f"{name}.txt").write_text(text)
    exe.unlink(missing_ok=True)
    print(text, end="", flush=True)


def start_ggufs(a, hf_dir: Path, formats: list) -> dict:
    """write_gguf.py for each format the peers run (when they are given and the GGUF is not there yet),
    in the background: {format: (path, its process or None)}."""
    if not a.peers:
        return {}
    env = dict(os.environ)
    if a.gguf_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(a.gguf_path), env.get("PYTHONPATH")) if p)
    started = {}
    for fmt in formats:
        if fmt not in PEER_TYPES:
            print(f"[amx_engine] the peers have no GGUF type for {fmt}: engine only", flush=True)
            continue
        path = a.work / f"{a.model}-{PEER_TYPES[fmt]}.gguf"
        proc = (
            None
            if path.is_file()
            else subprocess.Popen(
                [sys.executable, "tools/bench/write_gguf.py", str(hf_dir), str(path), "--type", PEER_TYPES[fmt]],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
        started[fmt] = (path, proc)
    return started


def finish_ggufs(started: dict, deadline: float) -> tuple:
    """({format: GGUF path} of those written, [failure records]): a GGUF not written by the monotonic
    deadline counts as failed (its writer killed), and its format runs without the peers."""
    done, failed = {}, []
    for fmt, (path, proc) in started.items():
        if proc is not None:
            try:
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, proc.returncode = proc.communicate()[0] + "\nwrite_gguf ran past its time", -1
            if proc.returncode != 0:
                error = f"write_gguf {fmt} failed ({proc.returncode}): {(out or '').strip()[-1500:]}"
                failed.append({"format": fmt, "engine": "write_gguf", "error": error})
                print(f"[amx_engine] {error}\n[amx_engine] {fmt} runs without the peers", flush=True)
                continue
        done[fmt] = path
    return done, failed


def stop_ggufs(started: dict) -> None:
    """Kill the writers still running (the measurement ended before their files were waited for)."""
    for _, proc in started.values():
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()


def run_peer(bench: Path, gguf: Path, prompt_len: int, threads: int, extra: list, timeout: float) -> tuple:
    """(prefill, decode) tok/s of one llama-bench run: a prompt of prompt_len tokens and 8 decoded, 2
    repetitions. Shared libraries beside the binary are found there (ik_llama.cpp's libllama, libggml)."""
    env = {"LD_LIBRARY_PATH": os.pathsep.join(p for p in (str(bench.parent), os.environ.get("LD_LIBRARY_PATH")) if p)}
    out = run(
        [
            str(bench),
            "-m",
            str(gguf),
            "-p",
            str(prompt_len),
            "-n",
            "8",
            "-r",
            "2",
            "-t",
            str(threads),
            "-o",
            "json",
            *extra,
        ],
        env=env,
        timeout=timeout,
    )
    try:
        tests = json.loads(out)
        pp = next(t for t in tests if t["n_prompt"] > 0 and t["n_gen"] == 0)
        tg = next(t for t in tests if t["n_gen"] > 0 and t["n_prompt"] == 0)
        return float(pp["avg_ts"]), float(tg["avg_ts"])
    except (ValueError, KeyError, TypeError, StopIteration):
        raise RunFailed(f"{bench}: no prefill and decode test in its JSON output: {out[-500:]!r}") from None


def peer_table(runs: list, formats: list, steps: list) -> None:
    """The peers' medians beside the engine's first step's (its best chunk) at the same thread counts."""
    peers = list(dict.fromkeys(x["engine"] for x in runs if x["engine"] != "colibri"))
    if not peers:
        return
    med = lambda rs, key: statistics.median(x[key] for x in rs) if rs else None  # noqa: E731
    print(
        f"\n| format | threads | colibri {steps[0]} prefill, decode | "
        + " | ".join(f"{p} prefill, decode" for p in peers)
        + " | colibri / best peer prefill, decode |"
    )
    print("|---|---:|---|" + "---|" * len(peers) + "---|")
    for fmt in formats:
        for th in sorted({x["threads"] for x in runs if x["format"] == fmt and x["engine"] != "colibri"}):
            ours = [
                x for x in runs if (x["format"], x["threads"], x["engine"], x["step"]) == (fmt, th, "colibri", steps[0])
            ]
            by_chunk = {}
            for x in ours:
                by_chunk.setdefault(x["chunk"], []).append(x)
            best = max(by_chunk.values(), key=lambda rs: med(rs, "prefill_tok_s"), default=[])
            cols = {p: [x for x in runs if (x["format"], x["threads"], x["engine"]) == (fmt, th, p)] for p in peers}
            cell = lambda rs: f"{med(rs, 'prefill_tok_s'):.1f}, {med(rs, 'decode_tok_s'):.1f}" if rs else "-"  # noqa: E731
            pp = [med(rs, "prefill_tok_s") for rs in cols.values() if rs]
            tg = [med(rs, "decode_tok_s") for rs in cols.values() if rs]
            ratio = (
                f"{med(best, 'prefill_tok_s') / max(pp):.2f}, {med(best, 'decode_tok_s') / max(tg):.2f}"
                if best and pp
                else "-"
            )
            print(f"| {fmt} | {th} | {cell(best)} | " + " | ".join(cell(rs) for rs in cols.values()) + f" | {ratio} |")


def measure(a) -> int:
    t0 = time.monotonic()
    a.out.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    if not a.no_probe:
        standalone(a.out, "amx_bf16_probe", ["-O2", "-ffp-contract=off"], ["256"], 120)
    if not a.no_kernels:  # (their share of the budget: a third; the engine's runs need the rest)
        kernel_variants(a, t0 + a.budget_s / 3)
    need_build = a.build
    if a.build_if_needed and not need_build:
        stamped = STAMP.is_file() and STAMP.read_text().strip() == sources_hash()
        try:
            if not stamped:
                raise RunFailed(f"{STAMP} is missing or names other sources")
            run([py, "-c", "import colibri._kernels, colibri._engine, colibri._probes, colibri._routing"], timeout=120)
        except RunFailed as e:
            print(f"[amx_engine] building the extensions: {str(e)[-300:]}", flush=True)
            need_build = True
        else:
            print("[amx_engine] the extensions in place were built from these sources: no build", flush=True)
    if need_build:
        run([py, "setup.py", "build_ext", "--inplace", "-j", str(cores())], log=a.out / "build.log")
        STAMP.write_text(sources_hash() + "\n")
        print(f"[amx_engine] built in {time.monotonic() - t0:.0f} s", flush=True)
    formats, steps = a.formats.split(","), a.steps.split(",")
    threads = list(dict.fromkeys(int(t) for t in a.threads.split(",")))
    chunks = a.chunk_list
    probe = json.loads(
        run(
            [
                py,
                "-c",
                "import json, colibri._kernels as k; print(json.dumps([k.isa(), k.int_step(), "
                "k.available_int_steps(), k.amx_status()]))",
            ]
        )
    )
    print(f"[amx_engine] tier {probe[0]}, int step {probe[1]}, available {probe[2]} | {probe[3]}", flush=True)
    missing = [s for s in steps if s not in probe[2]]
    if missing:  # before the model is made: a step the machine refuses would fail every run
        raise RunFailed(f"--steps {','.join(missing)}: not available here (available: {', '.join(probe[2])})")
    hf = a.work / "hf"
    if not (hf / a.model / "config.json").is_file():
        run([py, "tools/bench/make_models.py", a.model, "--out", str(hf), "--no-tokenizer"])
    ggufs = start_ggufs(a, hf / a.model, formats)
    try:
        dirs = {}
        for fmt in formats:
            d = a.work / f"{a.model}-{fmt}"
            if not (d / "config.json").is_file():
                run(
                    [
                        py,
                        "-m",
                        "colibri",
                        "convert",
                        "--hf-dir",
                        str(hf / a.model),
                        "--quantize",
                        fmt,
                        "--output-dir",
                        str(d),
                    ]
                )
            dirs[fmt] = d
        # (the files take ~30 s; a writer that hangs must not eat the engine's own runs)
        peer_files, failed = finish_ggufs(ggufs, min(t0 + a.budget_s / 2, time.monotonic() + 180))
    finally:
        stop_ggufs(ggufs)
    print(f"[amx_engine] model ready at {time.monotonic() - t0:.0f} s", flush=True)
    runs = []

    def save() -> None:
        (a.out / "amx_engine.json").write_text(
            json.dumps(
                {"args": {k: str(v) for k, v in vars(a).items()}, "machine": probe, "runs": runs, "failed": failed},
                indent=1,
            )
        )

    plan = []
    for r in range(a.rounds):
        for fmt in formats:
            for th in threads:
                engines = [("colibri", chunk, step) for chunk in chunks for step in steps]
                if th in a.peer_thread_list and fmt in peer_files:
                    engines += [(peer, None, None) for peer in a.peers]
                plan += [(r, fmt, th) + e for e in (engines if r % 2 == 0 else engines[::-1])]  # the other first
    for r, fmt, th, engine, chunk, step in plan:
        what = f"round {r} {fmt} {th} threads{'' if chunk is None else f' chunk {chunk}'} {step or engine}"
        left = a.budget_s - (time.monotonic() - t0)
        if left <= 0:
            print(f"[amx_engine] the budget ({a.budget_s:.0f} s) is spent: {len(runs)} runs", flush=True)
            break
        try:
            if engine == "colibri":
                res = json.loads(
                    run(
                        [
                            py,
                            "-m",
                            "colibri",
                            "bench",
                            "--model-dir",
                            str(dirs[fmt]),
                            "--prompt-len",
                            str(a.prompt_len),
                            "--gen",
                            "8",
                            "--repeat",
                            "2",
                            "--threads",
                            str(th),
                            "--json",
                            *([] if chunk is None else ["--prefill-chunk", str(chunk)]),
                        ],
                        env={"COLIBRI_INT_STEP": step},
                        timeout=left + 120,
                    )
                )
                speeds, chunk = (res["prefill_tok_s"]["median"], res["decode_tok_s"]["median"]), res["prefill_chunk"]
            else:
                bench, extra = a.peers[engine]
                speeds = run_peer(bench, peer_files[fmt], a.prompt_len, th, extra, timeout=left + 120)
        except RunFailed as e:  # recorded; the other runs go on
            failed.append(
                {
                    "round": r,
                    "format": fmt,
                    "threads": th,
                    "engine": engine,
                    "chunk": chunk,
                    "step": step,
                    "error": str(e)[-2000:],
                }
            )
            print(f"[amx_engine] {what}: {e}", flush=True)
        else:
            runs.append(
                {
                    "round": r,
                    "format": fmt,
                    "threads": th,
                    "engine": engine,
                    "chunk": chunk,
                    "step": step,
                    "prefill_tok_s": speeds[0],
                    "decode_tok_s": speeds[1],
                }
            )
            print(f"[amx_engine] {what}: prefill {speeds[0]:.1f} tok/s, decode {speeds[1]:.1f}", flush=True)
        save()  # after every run: a killed call keeps them
    save()
    peer_table(runs, formats, steps)
    runs = [x for x in runs if x["engine"] == "colibri"]
    print(
        "\n| format | threads | chunk | "
        + " | ".join(f"{s} prefill, decode" for s in steps)
        + f" | {steps[0]} / {steps[-1]} prefill |"
    )
    print("|---|---:|---:|" + "---|" * len(steps) + "---:|")
    for fmt in formats:
        for th, chunk in sorted({(x["threads"], x["chunk"]) for x in runs if x["format"] == fmt}):
            med = {}
            for s in steps:
                rs = [x for x in runs if (x["format"], x["threads"], x["chunk"], x["step"]) == (fmt, th, chunk, s)]
                med[s] = (
                    (
                        statistics.median(x["prefill_tok_s"] for x in rs),
                        statistics.median(x["decode_tok_s"] for x in rs),
                    )
                    if rs
                    else None
                )
            cells = [f"{m[0]:.1f}, {m[1]:.1f}" if m else "-" for m in med.values()]
            ratio = f"{med[steps[0]][0] / med[steps[-1]][0]:.2f}" if med[steps[0]] and med[steps[-1]] else "-"
            print(f"| {fmt} | {th} | {chunk} | " + " | ".join(cells) + f" | {ratio} |")
    print(
        f"\n[amx_engine] {len(runs)} engine runs ({len(failed)} failed) in {time.monotonic() - t0:.0f} s; every run in "
        f"{a.out / 'amx_engine.json'}"
    )
    return 0 if runs and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
