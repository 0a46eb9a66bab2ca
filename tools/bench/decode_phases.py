#!/usr/bin/env python3
"""Where a decoded token's time goes, per phase, in Colibri and in the llama.cpp family.

    python tools/bench/decode_phases.py --model mixtral-mini --format int8 \
        [--llama-bench PATH] [--ik-bench PATH] [--threads 2] [--gen 1024] [--reps 3]

Design
------
* Each engine decodes a long run (Colibri: `python -m colibri bench --prompt-len 1 --gen G`;
  llama-bench: `-p 0 -n G`, ik_llama.cpp also with `-rtr 1`). After `--skip` seconds (the load, the
  warm-up) `perf record -p PID` samples every thread of the process for `--window` seconds, so the
  profile is decode only; the run's own decode rate (its JSON) gives the time a token takes.
* perf's samples are bucketed by symbol into phases (PHASES, first match wins): the weight
  products (every matrix kernel: the experts', attention's projections, the router's, the head's),
  the activations' quantization, attention over the KV cache, norms and element-wise work, the
  router's top-k, synchronisation (the OpenMP runtime: threads waiting at barriers, spinning),
  Python, the OS kernel, and the rest.
  A phase's ms/token is its share of the samples times the token's time.
* The products' read rate is the weights a token reads (run_bench.py's roofline bytes: all but the
  embedding table, experts x top-k / experts) over the time in the products: beside the machine's
  read bandwidth (readbw.c, measured in the same run), it says whether the kernels stream at the
  memory's speed or leave bandwidth unused, and how much time outside them costs.
* Each engine runs once, discarded, before the measured runs (its mapped pages faulted in); engines
  alternate within each repetition; figures are medians over `--reps`. JSON (command, host,
  date, commit) to tools/bench/results/<date>-decode-phases-<model>-<format>.json, a table to stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from convert_models import colibri_dir, gguf_file  # noqa: E402
from run_bench import (  # noqa: E402
    COLIBRI_ENV,
    colibri_active_bytes,
    cpu_name,
    git_rev,
    prewarm,
    readbw_binary,
    run_bandwidth,
)

# (phase, symbol pattern), first match wins; matched against "dso symbol"
PHASES = (
    ("kernel", r"\[kernel|^\[unknown\]"),
    ("sync", r"libgomp|libomp|libiomp|gomp_|GOMP_|omp_|ggml_barrier|do_spin|do_wait|futex|sched_yield|pthread_"),
    ("attention", r"attend|attention|softmax|soft_max|flash_attn|fattn|rope|kv_store|ggml_compute_forward_cpy"),
    ("quantize activations", r"quantize_act|quantize_row|quantize_mat|from_float|cb_prepare_"),
    (
        "weight products",
        r"cb_(i|t)?tile|cb_dot_|cb_matmul|cb_job_|tprefill|ggml_vec_dot|mul_mat|gemv|gemm|iqk_|repack",
    ),
    ("routing", r"cb_route|topk|top_k|argsort"),
    ("norms, element-wise", r"rmsnorm|rms_norm|cb_add|cb_axpy|cb_scale|cb_glu|glu|silu|swiglu|_add|_mul|get_rows"),
    ("python", r"libpython|_Py|Py[A-Z]|\.cpython-"),
)


def phase_of(dso: str, symbol: str) -> str:
    text = f"{dso} {symbol}"
    for phase, pattern in PHASES:
        if re.search(pattern, text):
            return phase
    return "other"


def perf_shares(data: Path) -> tuple:
    """({phase: share of samples}, [(share, dso, symbol)] of the 30 largest symbols) of a perf.data file."""
    out = subprocess.run(
        ["perf", "report", "-i", str(data), "--no-children", "--sort", "dso,symbol", "--stdio", "-q"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    shares: dict = {}
    symbols = []
    for line in out.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[[.k]\]\s+(.*)", line)
        if m:
            share, dso, symbol = float(m.group(1)) / 100, m.group(2), m.group(3).strip().split("  ")[0]
            phase = phase_of(dso, symbol)
            shares[phase] = shares.get(phase, 0.0) + share
            symbols.append((share, Path(dso).name, symbol))
    return shares, sorted(symbols, reverse=True)[:30]


def profile(cmd, env, skip: float, window: float) -> tuple:
    """(the command's stdout, {phase: share}, the largest symbols): perf attached for `window` s after `skip` s."""
    with tempfile.TemporaryDirectory() as d, tempfile.TemporaryFile() as out:
        p = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=subprocess.DEVNULL, env=env)
        time.sleep(skip)
        if p.poll() is not None:
            raise SystemExit(f"{cmd[0]} ended within --skip {skip} s: raise --gen")
        data = Path(d) / "perf.data"
        subprocess.run(
            ["perf", "record", "-q", "-F", "1999", "-o", str(data), "-p", str(p.pid), "--", "sleep", str(window)],
            check=True,
            capture_output=True,
        )
        if p.poll() is not None:
            raise SystemExit(f"{cmd[0]} ended inside the perf window: raise --gen")
        if p.wait() != 0:
            raise SystemExit(f"{' '.join(map(str, cmd))} failed ({p.returncode})")
        out.seek(0)
        return (out.read().decode(), *perf_shares(data))


def colibri_run(a) -> tuple:
    cmd = [sys.executable, "-m", "colibri", "bench", "--model-dir", colibri_dir(a.model, a.format)]
    cmd += ["--prompt-len", 1, "--gen", a.gen, "--repeat", 1, "--threads", a.threads, "--json"]
    stdout, shares, symbols = profile(cmd, COLIBRI_ENV, a.skip, a.window)
    return json.loads(stdout)["decode_tok_s"]["median"], shares, symbols


def llama_run(bench, gguf, a, extra=()) -> tuple:
    cmd = [bench, "-m", gguf, "-p", 0, "-n", a.gen, "-t", a.threads, "-r", 1, "-o", "json", *extra]
    stdout, shares, symbols = profile(cmd, None, a.skip, a.window)
    return json.loads(stdout)[0]["avg_ts"], shares, symbols


GGUF_OF = {"bf16": "bf16", "int8": "q8_0", "int4": "q4_0"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="mixtral-mini")
    ap.add_argument("--format", default="int8", choices=sorted(GGUF_OF))
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench")
    ap.add_argument("--ik-bench", help="ik_llama.cpp's llama-bench (run as it comes and with -rtr 1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gen", type=int, default=1024, help="tokens decoded per run (long enough for the window)")
    ap.add_argument("--skip", type=float, default=4.0, help="seconds before perf attaches (load, warm-up)")
    ap.add_argument("--window", type=float, default=5.0, help="seconds perf samples")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--results-dir", default=str(HERE / "results"))
    a = ap.parse_args(argv)
    gguf = gguf_file(a.model, GGUF_OF[a.format])
    engines = {"colibri": lambda: colibri_run(a)}
    if a.llama_bench:
        engines["llama.cpp"] = lambda: llama_run(a.llama_bench, gguf, a)
    if a.ik_bench:
        engines["ik_llama.cpp"] = lambda: llama_run(a.ik_bench, gguf, a)
        engines["ik_llama.cpp -rtr"] = lambda: llama_run(a.ik_bench, gguf, a, ("-rtr", 1))
    prewarm(colibri_dir(a.model, a.format))
    if len(engines) > 1:
        prewarm(gguf)
    active = colibri_active_bytes(colibri_dir(a.model, a.format))[0]
    bw_exe = readbw_binary()
    for name, run in engines.items():  # one discarded run each: the mapped pages, the page cache, the repacks
        run()
    runs: dict = {name: [] for name in engines}
    bandwidth = []
    for rep in range(a.reps):
        bandwidth.append(run_bandwidth(bw_exe, a.threads, 1024))
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))
        for name in order:
            tok_s, shares, symbols = engines[name]()
            runs[name].append({"tok_s": tok_s, "shares": shares, "symbols": symbols})
            print(f"[{name}] rep {rep + 1}: {tok_s:.1f} tok/s, products {shares.get('weight products', 0):.0%}")
    bw = statistics.median(bandwidth)
    phases = [p for p, _ in PHASES] + ["other"]
    print(f"\n{a.model} {a.format}, {a.threads} threads; read bandwidth {bw:.1f} GB/s; {active / 1e6:.1f} MB a token")
    print("| engine | tg tok/s | ms/token | " + " | ".join(phases) + " | products GB/s |")
    print("|---|---|---|" + "---|" * len(phases) + "---|")
    summary = {}
    for name, rs in runs.items():
        tok_s = statistics.median(r["tok_s"] for r in rs)
        ms = 1000 / tok_s
        per_phase = {p: statistics.median(r["shares"].get(p, 0.0) for r in rs) * ms for p in phases}
        products_gbs = active / (per_phase["weight products"] / 1000) / 1e9 if per_phase["weight products"] else None
        summary[name] = {"tok_s": tok_s, "ms_per_token": ms, "phase_ms": per_phase, "products_gbs": products_gbs}
        cells = " | ".join(f"{per_phase[p]:.2f}" for p in phases)
        gbs = f"{products_gbs:.1f}" if products_gbs else "–"
        print(f"| {name} | {tok_s:.1f} | {ms:.2f} | {cells} | {gbs} |")
    out = Path(a.results_dir) / f"{datetime.date.today()}-decode-phases-{a.model}-{a.format}.json"
    record = {
        "command": "python tools/bench/decode_phases.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "host": f"{cpu_name()}, {os.cpu_count()} CPUs, {platform.system()}",
        "date": str(datetime.date.today()),
        "commit": git_rev(),
        "model": a.model,
        "format": a.format,
        "threads": a.threads,
        "bandwidth_gbs": bandwidth,
        "active_bytes": active,
        "summary": summary,
        "runs": runs,
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\n[decode_phases] wrote {out}")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
