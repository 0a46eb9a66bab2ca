#!/usr/bin/env python3
"""Colibri against llama.cpp, interleaved, with the machine's read bandwidth as the roofline.

    python tools/bench/run_bench.py --models mixtral-mini [olmoe-1b-7b] [--reps 3] [--threads 2]
    python tools/bench/run_bench.py --tiny --results-dir /tmp/r          # seconds, Colibri only
    python tools/bench/run_bench.py --model-dirs D1 D2 --no-llama --name mine

Design
------
* Format pairs: Colibri bf16 / llama.cpp bf16, int8 / q8_0, int4 / q4_0 (the models made by
  make_models.py and converted by convert_models.py into /work/bench_cache).
* Every measurement is its own process with one repetition, and the processes are interleaved:
  for each repetition, for each thread count: the bandwidth test, then for each pair Colibri and
  llama.cpp (the order of the two swapped every other repetition), so that drift of the machine
  (other load, thermal, page cache) spreads over both engines instead of biasing one.
    Colibri:   python -m colibri bench --model-dir D --prompt-len P --gen G --repeat 1 --threads T --json
    llama.cpp: llama-bench -m F -p P -n G -t T -r 1 -o json
  Before each run the model's files are read into the page cache (prewarm), so that neither
  engine pays for disk reads the other one caused; then both do one discarded warm-up run.
  Peak RSS is each process's high-water mark from
  wait4(); llama.cpp's TTFT is its pp time (it does not sample); P99 is Colibri's only.
* Bandwidth: readbw.c (compiled here with gcc -O3 -march=native -fopenmp) sums a 1 GiB buffer
  with T threads; its best of 5 passes (the attainable rate) is one measurement.
* Roofline: the bytes of weights one decoded token reads, from the model's tensor table: every
  tensor except the embedding table (one row of it is read), with the experts of each MoE layer
  counted top-k / num_experts (exactly k experts run per layer per token). The decode limit is
  bandwidth / bytes; each engine's tg is shown as a percentage of it. The GGUF's own bytes,
  computed the same way from its tensor list, are printed beside Colibri's.
* Figures are medians with min–max over the repetitions. The markdown goes to
  <results-dir>/<date>-<model>.md and stdout; the raw measurements to the same name .json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from convert_models import CACHE, LLAMA_BIN, pairs_of, stale_layouts, colibri_dir, gguf_file  # noqa: E402

TINY_FIXTURE = REPO / "tests" / "fixtures" / "mixtral_a" / "hf"
# Bench this tree's Colibri when it has a built extension (pip install -e . / build_ext --inplace),
# whatever `colibri` the interpreter would import otherwise.
SRC = REPO
if list((SRC / "colibri").glob("_kernels*.so")) or list((SRC / "colibri").glob("_kernels*.pyd")):
    sys.path.insert(0, str(SRC))
    COLIBRI_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
else:
    COLIBRI_ENV = None


# -- running one measurement ---------------------------------------------------------------------


def run_child(cmd, env=None) -> tuple:
    """(stdout, peak RSS bytes) of a command; raises with its stderr when it fails."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{err.read().decode()[-2000:]}")
        return out.read().decode(), usage.ru_maxrss * 1024


def run_colibri(model_dir, a, threads) -> dict:
    stdout, rss = run_child(
        [
            sys.executable,
            "-m",
            "colibri",
            "bench",
            "--model-dir",
            model_dir,
            "--prompt-len",
            a.prompt_len,
            "--gen",
            a.gen,
            "--repeat",
            1,
            "--threads",
            threads,
            "--json",
        ],
        env=COLIBRI_ENV,
    )
    r = json.loads(stdout)
    med = {k: r[k]["median"] for k in ("prefill_tok_s", "decode_tok_s", "ttft_ms", "decode_p99_ms")}
    return {
        "pp": med["prefill_tok_s"],
        "tg": med["decode_tok_s"],
        "ttft_ms": med["ttft_ms"],
        "p99_ms": med["decode_p99_ms"],
        "rss": rss,
        "load_s": r["load_seconds"],
    }


def run_llama(gguf, a, threads, bench=None, extra=()) -> dict:
    """llama-bench (llama.cpp's, or ik_llama.cpp's at `bench` with its `extra` flags: -rtr 1)."""
    stdout, rss = run_child(
        [
            bench or LLAMA_BIN / "llama-bench",
            "-m",
            gguf,
            "-p",
            a.prompt_len,
            "-n",
            a.gen,
            "-t",
            threads,
            "-r",
            1,
            "-o",
            "json",
            *extra,
        ]
    )
    tests = json.loads(stdout)
    pp = next(t for t in tests if t["n_prompt"] > 0 and t["n_gen"] == 0)
    tg = next(t for t in tests if t["n_gen"] > 0 and t["n_prompt"] == 0)
    return {
        "pp": pp["avg_ts"],
        "tg": tg["avg_ts"],
        "ttft_ms": pp["avg_ns"] / 1e6,
        "p99_ms": None,
        "rss": rss,
        "build": f"{tg.get('build_commit', '?')} ({tg.get('build_number', '?')})",
        "backend": tg.get("backends", tg.get("backend", "?")),
        "cpu": tg.get("cpu_info", "?"),
    }


TRANSFORMERS_CHILD = r"""
import json, sys, time
import torch
from transformers import AutoModelForCausalLM
a = json.loads(sys.argv[1])
torch.set_num_threads(a["threads"])
t0 = time.perf_counter()
m = AutoModelForCausalLM.from_pretrained(a["hf"], dtype=torch.bfloat16).eval()
load = time.perf_counter() - t0
ids = torch.randint(0, m.config.vocab_size, (1, a["prompt_len"]), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    t = time.perf_counter()
    out = m(ids, use_cache=True)
    pp = time.perf_counter() - t
    past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(a["gen"]):
        t = time.perf_counter()
        out = m(tok, past_key_values=past, use_cache=True)
        times.append(time.perf_counter() - t)
        past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
times.sort()
print(json.dumps({"pp": a["prompt_len"] / pp, "tg": len(times) / sum(times), "ttft_ms": pp * 1000,
                  "p99_ms": times[int(0.99 * (len(times) - 1))] * 1000, "load_s": load}))
"""


def run_transformers(hf_dir, a, threads) -> dict:
    """Hugging Face transformers (torch, bf16) as the Python baseline: prefill, then greedy decode
    with the KV cache, one token per forward."""
    stdout, rss = run_child(
        [
            sys.executable,
            "-c",
            TRANSFORMERS_CHILD,
            json.dumps(
                {"hf": str(hf_dir), "threads": int(threads), "prompt_len": int(a.prompt_len), "gen": int(a.gen)}
            ),
        ]
    )
    r = json.loads(stdout.strip().splitlines()[-1])
    return {
        "pp": r["pp"],
        "tg": r["tg"],
        "ttft_ms": r["ttft_ms"],
        "p99_ms": r["p99_ms"],
        "rss": rss,
        "load_s": r["load_s"],
    }


def evict(path) -> None:
    """Drop a model's files from the page cache (posix_fadvise DONTNEED): the next run is cold."""
    path = Path(path)
    for f in [f for f in path.rglob("*") if f.is_file()] if path.is_dir() else [path]:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


RUNNERS = {
    "colibri": lambda *x: run_colibri(*x),
    "llama.cpp": lambda *x: run_llama(*x),
    "transformers": lambda *x: run_transformers(*x),
    # ik_llama.cpp (github ikawrakow/ik_llama.cpp, built by the user: --ik-bench PATH), as it
    # comes and with its run-time repacking
    "ik_llama.cpp": lambda g, a, t: run_llama(g, a, t, a.ik_bench),
    "ik_llama.cpp -rtr": lambda g, a, t: run_llama(g, a, t, a.ik_bench, ("-rtr", 1)),
}
LLAMA_ENGINES = ("llama.cpp", "ik_llama.cpp", "ik_llama.cpp -rtr")


def prewarm(path, passes: int = 2) -> None:
    """Read a model's files into the page cache (twice, so the kernel keeps them on its active
    list) before a run: a model larger than half the RAM (OLMoE bf16: 14 GB per engine on 24 GB)
    would otherwise be partly evicted by the other engine's run and re-read from disk inside
    the timed region. Not timed."""
    path = Path(path)
    files = [f for f in path.rglob("*") if f.is_file()] if path.is_dir() else [path]
    buf = bytearray(1 << 24)
    for _ in range(passes):
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass


def readbw_binary() -> Path | None:
    exe = CACHE / "readbw"
    src = HERE / "readbw.c"
    if exe.is_file() and exe.stat().st_mtime >= src.stat().st_mtime:
        return exe
    if not shutil.which("gcc"):
        return None
    CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", str(src), "-o", str(exe)], check=True)
    return exe


def run_bandwidth(exe, threads, mib) -> float:
    """GB/s: the best of 5 passes of readbw, the attainable rate (numpy, one thread, if there is no gcc)."""
    if exe is None:
        import time
        import numpy as np

        buf = np.ones(mib * 2**17, np.float64)
        t0 = time.perf_counter()
        buf.sum()
        return buf.nbytes / (time.perf_counter() - t0) / 1e9
    stdout, _ = run_child([exe, mib, 5, threads], env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    return json.loads(stdout)["best_gbs"]


# -- bytes per token ---------------------------------------------------------------------------


def colibri_active_bytes(model_dir) -> tuple:
    """(bytes read per decoded token, top-k, num_experts): ModelDir.bytes_per_token."""
    from colibri.modeldir import ModelDir

    md = ModelDir(model_dir)
    return sum(md.bytes_per_token().values()), md.config.num_experts_per_tok, md.config.num_experts


def gguf_active_bytes(path, k, e) -> float | None:
    try:
        from gguf import GGUFReader
    except ImportError:
        return None
    total = 0.0
    for t in GGUFReader(str(path)).tensors:
        if t.name == "token_embd.weight":
            continue
        total += int(t.n_bytes) * (k / e if "_exps" in t.name else 1)
    return total


# -- the table -----------------------------------------------------------------------------------


def stat(values) -> tuple | None:
    vals = [v for v in values if v is not None]
    return (statistics.median(vals), min(vals), max(vals)) if vals else None


def cell(values, fmt="{:.1f}", scale=1.0) -> str:
    s = stat(values)
    if s is None:
        return "–"
    m, lo, hi = (x * scale for x in s)
    return f"{fmt.format(m)} ({fmt.format(lo)}–{fmt.format(hi)})"


def git_rev() -> str:
    try:
        rev = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout.strip()
        return rev + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def build_flags(bench) -> str:
    """What a llama-bench was built for, from its build directory's CMakeCache.txt: GGML_NATIVE=ON,
    or the instruction sets turned on (an AVX2-only build: tools/bench/build_llama.sh ISA=avx2)."""
    cache = Path(bench).resolve().parent.parent / "CMakeCache.txt"
    try:
        lines = cache.read_text().splitlines()
    except OSError:
        return "build flags unknown"
    entries = {}  # NAME:TYPE=VALUE lines
    for line in lines:
        if line.startswith("GGML_") and "=" in line:
            name_type, value = line.split("=", 1)
            entries[name_type.split(":")[0]] = value
    on = {k for k, v in entries.items() if v.upper() in ("ON", "1", "TRUE", "YES")}
    if "GGML_NATIVE" in on:
        return "GGML_NATIVE=ON"
    isas = [k[len("GGML_") :] for k in on if k.startswith(("GGML_AVX", "GGML_FMA", "GGML_F16C", "GGML_BMI2"))]
    return "GGML_NATIVE=OFF, " + "+".join(sorted(isas))


def report(name, a, rows, bw, active, cmdline, cold=None) -> str:
    """rows: {(engine, fmt, threads): [measurement, ...]}; bw: {threads: [GB/s]};
    cold: {(engine, fmt, threads): [TTFT ms after evicting the files]}."""
    cold = cold or {}
    import colibri
    from colibri import _kernels

    date = datetime.date.today().isoformat()
    llama_meta = next((m for (eng, _, _), ms in rows.items() if eng == "llama.cpp" for m in ms), None)
    ik_meta = next((m for (eng, _, _), ms in rows.items() if eng.startswith("ik_") for m in ms), None)
    title = "Colibri vs llama.cpp" if llama_meta else "Colibri"
    out = [
        f"# {name}: {title}, {date}",
        "",
        f"- Machine: {cpu_name()}, {os.cpu_count()} cores; Python {platform.python_version()}, {platform.system()}",
        f"- Colibri: git {git_rev()}, kernels {_kernels.isa()}, int step {_kernels.int_step()} ({Path(colibri.__file__).parent})",
        (
            f"- llama.cpp: build {llama_meta['build']}, {llama_meta['backend']}, Release, {build_flags(LLAMA_BIN / 'llama-bench')}, "
            f"OpenMP, no BLAS (llama-cpp-python 0.3.36's vendor/llama.cpp)"
            if llama_meta
            else "- llama.cpp: not run"
        ),
        *(
            [
                f"- ik_llama.cpp: build {ik_meta['build']}, {ik_meta['backend']}, Release, {build_flags(a.ik_bench)}, "
                f"OpenMP ({a.ik_bench}); '-rtr': its run-time repacking (-rtr 1)"
            ]
            if ik_meta
            else []
        ),
        f"- Work: prompt {a.prompt_len} random token ids, {a.gen} generated tokens; {a.reps} repetitions per row, "
        f"one process each, engines interleaved; figures are median (min–max)",
        "- Read bandwidth (readbw.c, 1 GiB, best of 5 passes per measurement): "
        + "; ".join(f"{t} threads: {cell(v, '{:.2f}')} GB/s" for t, v in sorted(bw.items())),
        "- Weights read per decoded token (all but the embedding table; experts × top-k/experts): "
        + "; ".join(
            f"{fmt} {c / 1e6:.1f} MB" + (f" (GGUF {g / 1e6:.1f} MB)" if g else "") for fmt, (c, g) in active.items()
        ),
        "",
        "| engine | format | threads | pp tok/s | tg tok/s | P99 ms/token | peak RSS MiB | TTFT ms warm | "
        "TTFT ms cold | tg % of roofline | Colibri / peer pp, tg |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    pairs = pairs_of(name)
    for (eng, fmt, threads), ms in rows.items():
        c_bytes, g_bytes = active[fmt if eng == "colibri" else dict((l, c) for c, l in pairs).get(fmt, fmt)]
        nbytes = g_bytes if eng in LLAMA_ENGINES and g_bytes else c_bytes
        limit = statistics.median(bw[threads]) * 1e9 / nbytes
        ratio = ""
        partners = [(e, l, threads) for c, l in pairs if c == fmt for e in LLAMA_ENGINES]
        if eng == "colibri":
            cp, ct = (stat([m["pp"] for m in ms])[0], stat([m["tg"] for m in ms])[0])
            for partner in partners:
                if partner in rows:
                    lp, lt = (stat([m["pp"] for m in rows[partner]])[0], stat([m["tg"] for m in rows[partner]])[0])
                    ratio += f"{'; ' if ratio else ''}{partner[0]}: {cp / lp:.2f}, {ct / lt:.2f}"
        out.append(
            f"| {eng} | {fmt} | {threads} | {cell([m['pp'] for m in ms])} | {cell([m['tg'] for m in ms], '{:.2f}')} | "
            f"{cell([m['p99_ms'] for m in ms], '{:.1f}')} | {cell([m['rss'] for m in ms], '{:.0f}', 2**-20)} | "
            f"{cell([m['ttft_ms'] for m in ms], '{:.0f}')} | {cell(cold.get((eng, fmt, threads), []), '{:.0f}')} | "
            f"{cell([m['tg'] / limit * 100 for m in ms], '{:.0f}')}% of {limit:.1f} tok/s | {ratio} |"
        )
    out += [
        "",
        "pp: prompt processing (prefill) of the whole prompt; tg: decoding one token at a time (Colibri: "
        "after the prompt, llama-bench: from an empty context). TTFT: Colibri's wall time to the first "
        "token (prefill + sampling); llama.cpp's pp time; transformers' prefill forward. Cold: once, "
        "right after the model's files were evicted from the page cache (load + first token for Colibri and "
        "transformers; llama-bench reports pp only). Peak RSS: the process's high-water mark "
        "(wait4), including the mapped weight pages touched. Roofline: tg limit = bandwidth / bytes "
        "read per token.",
        "",
        f"Command: `{cmdline}`",
        "",
    ]
    return "\n".join(out)


# -- main ----------------------------------------------------------------------------------------


def plan(a) -> list:
    """[(model name, [(engine, fmt, path), ...])]"""
    if a.tiny:
        d = Path(tempfile.mkdtemp(prefix="colibri-bench-tiny-"))
        entries = []
        for fmt in ("bf16", "int8"):
            out = d / fmt
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "colibri",
                    "convert",
                    "--hf-dir",
                    TINY_FIXTURE,
                    "--output-dir",
                    out,
                    "--quantize",
                    fmt,
                ],
                check=True,
                capture_output=True,
                env=COLIBRI_ENV,
            )
            entries.append(("colibri", fmt, out))
        return [("tiny", entries)]
    if a.model_dirs:
        entries = []
        for d in map(Path, a.model_dirs):
            if not (d / "config.json").is_file():
                raise SystemExit(f"{d} is not a Colibri model directory (no config.json)")
            label = json.loads((d / "config.json").read_text())["weight_dtype"]
            if any(label == f for _, f, _ in entries):
                label += f":{d.name}"
            entries.append(("colibri", label, d))
        return [(a.name, entries)]
    out = []
    for model in a.models:
        entries = []
        for cfmt, lfmt in pairs_of(model):
            if cfmt not in a.formats:
                continue
            entries.append(("colibri", cfmt, colibri_dir(model, cfmt)))
            if not a.no_llama:
                entries.append(("llama.cpp", lfmt, gguf_file(model, lfmt)))
            if a.ik_bench:
                entries += [
                    ("ik_llama.cpp", lfmt, gguf_file(model, lfmt)),
                    ("ik_llama.cpp -rtr", lfmt, gguf_file(model, lfmt)),
                ]
        if a.transformers and model == "mixtral-mini":
            entries.append(("transformers", "bf16", CACHE / "hf" / model))
        out.append((model, entries))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Colibri vs llama.cpp, interleaved, with a bandwidth roofline")
    ap.add_argument("--models", nargs="+", default=["mixtral-mini"], help="names made by make_models.py")
    ap.add_argument("--model-dirs", nargs="+", help="Colibri model directories to bench instead (Colibri only)")
    ap.add_argument("--name", default="custom", help="model name for --model-dirs in the report")
    ap.add_argument("--tiny", action="store_true", help="the bundled test fixture, Colibri only: seconds")
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    ap.add_argument(
        "--formats",
        default="bf16,int8,int4,mxfp4",
        help="Colibri formats (paired with bf16/q8_0/q4_0; mxfp4 with the MXFP4 GGUF)",
    )
    ap.add_argument(
        "--ik-bench",
        default=None,
        help="ik_llama.cpp's llama-bench (build it yourself): runs it as it comes and with -rtr 1",
    )
    ap.add_argument("--threads", default="2", help="comma-separated thread counts")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--bw-mib", type=int, default=1024, help="bandwidth test buffer")
    ap.add_argument("--results-dir", default=str(HERE / "results"))
    ap.add_argument("--no-prewarm", action="store_true", help="do not read each model into the page cache first")
    ap.add_argument(
        "--transformers",
        action="store_true",
        help="add Hugging Face transformers (bf16) as the Python baseline on mixtral-mini",
    )
    ap.add_argument(
        "--cold",
        action="store_true",
        help="once per engine and format, evict its files from the page cache and measure TTFT cold",
    )
    a = ap.parse_args(argv)
    if a.tiny:
        a.no_llama, a.bw_mib = True, min(a.bw_mib, 256)
    if a.model_dirs:
        a.no_llama = True
    a.formats = a.formats.split(",")
    thread_counts = [int(t) for t in a.threads.split(",")]
    cmdline = "python tools/bench/run_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)

    if not a.no_llama and not (LLAMA_BIN / "llama-bench").is_file():
        raise SystemExit(f"{LLAMA_BIN / 'llama-bench'} is missing: run tools/bench/build_llama.sh (or pass --no-llama)")
    bw_exe = readbw_binary()
    for name, entries in plan(a):
        missing = [str(p) for _, _, p in entries if not Path(p).exists()]
        if missing:
            raise SystemExit("missing (run make_models.py and convert_models.py): " + ", ".join(missing))
        stale = [
            f"{p} ({stale_layouts(Path(p), fmt)})"
            for eng, fmt, p in entries
            if eng == "colibri" and not a.model_dirs and stale_layouts(Path(p), fmt)
        ]
        if stale:
            raise SystemExit("not in the default layouts (convert_models.py relayouts them): " + ", ".join(stale))
        active = {}
        for eng, fmt, path in entries:
            if eng == "colibri":
                c, k, e = colibri_active_bytes(path)
                active[fmt] = [c, None]
        for eng, fmt, path in entries:
            if eng in LLAMA_ENGINES:
                cfmt = next(c for c, l in pairs_of(name) if l == fmt)
                active[cfmt][1] = gguf_active_bytes(path, k, e)
        rows = {(eng, fmt, t): [] for t in thread_counts for eng, fmt, _ in entries}
        bw = {t: [] for t in thread_counts}
        pairs = []  # a format's engines, one after another (reversed on odd repetitions)
        for entry in (e for e in entries if e[0] != "transformers"):
            if entry[0] == "colibri" or not pairs:
                pairs.append([entry])
            else:
                pairs[-1].append(entry)
        pairs += [[e] for e in entries if e[0] == "transformers"]
        cold = {}
        if a.cold:
            for t in thread_counts:
                for pair in pairs:
                    for eng, fmt, path in pair:
                        evict(path)
                        m = RUNNERS[eng](path, a, t)
                        cold.setdefault((eng, fmt, t), []).append(
                            m["ttft_ms"] + 1000 * m.get("load_s", 0) * (eng != "llama.cpp")
                        )
                        print(f"[{name}]   {eng:<9} {fmt:<5} cold TTFT {cold[(eng, fmt, t)][-1]:7.0f} ms", flush=True)
        unrunnable = {}
        for rep in range(a.reps):
            for t in thread_counts:
                bw[t].append(run_bandwidth(bw_exe, t, a.bw_mib))
                print(f"[{name}] rep {rep + 1}/{a.reps}, {t} threads: bandwidth {bw[t][-1]:.2f} GB/s", flush=True)
                for pair in pairs:
                    for eng, fmt, path in pair if rep % 2 == 0 else pair[::-1]:
                        if (eng, fmt) in unrunnable:
                            continue
                        if not a.no_prewarm:
                            prewarm(path)
                        try:
                            m = RUNNERS[eng](path, a, t)
                        except RuntimeError as e:
                            if eng == "colibri":
                                raise
                            # a peer that cannot load this model (ik_llama.cpp has no OLMoE, say):
                            # left out of this model's table, with its own last line as the reason
                            unrunnable[(eng, fmt)] = str(e).strip().splitlines()[-1]
                            print(f"[{name}]   {eng:<9} {fmt:<5} left out: {unrunnable[(eng, fmt)]}", flush=True)
                            continue
                        rows[(eng, fmt, t)].append(m)
                        print(
                            f"[{name}]   {eng:<9} {fmt:<5} pp {m['pp']:8.1f} tok/s  tg {m['tg']:7.2f} tok/s  "
                            f"TTFT {m['ttft_ms']:7.0f} ms  RSS {m['rss'] / 2**20:6.0f} MiB",
                            flush=True,
                        )
        rows = {key: ms for key, ms in rows.items() if ms}  # without the peers left out
        md = report(name, a, rows, bw, active, cmdline, cold)
        if unrunnable:
            md += "".join(f"\nLeft out: {eng} {fmt}: {why}\n" for (eng, fmt), why in unrunnable.items())
        results = Path(a.results_dir)
        results.mkdir(parents=True, exist_ok=True)
        stem = results / f"{datetime.date.today().isoformat()}-{name}"
        stem.with_suffix(".md").write_text(md)
        stem.with_suffix(".json").write_text(
            json.dumps(
                {
                    "model": name,
                    "bandwidth_gbs": bw,
                    "active_bytes": active,
                    "rows": [{"engine": e, "format": f, "threads": t, "runs": ms} for (e, f, t), ms in rows.items()],
                },
                indent=1,
                default=str,
            )
            + "\n"
        )
        print("\n" + md)
        print(f"[run_bench] wrote {stem.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
