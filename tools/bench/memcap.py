#!/usr/bin/env python3
"""Colibri and llama.cpp under a real memory cap: a memory cgroup around each run.

For each cap (a percentage of the Colibri model directory's bytes; "none" = no cgroup) and each
run, interleaved: a fresh memory cgroup with that limit (v2 where this system has a writable
one, else v1; root only), every model file evicted from the page cache first (posix_fadvise
DONTNEED: a cold start), then

  colibri   a child process that loads the model with --options (default: none, so the plan
            comes from the cgroup's limit) and generates --gen tokens after a --prompt-len
            prompt (the first tokens of --text, else random ids), greedy;
  llama.cpp llama-bench -p PROMPT -n GEN -r 1 --no-warmup (default mmap) on --gguf, if given.

Each row reports decode and prefill tok/s, time to first token, bytes read from storage per
decoded token (/proc/<pid>/io read_bytes of the decode alone), major page faults, the expert
cache's hit rate and prefetch hit rate, the cgroup's peak usage, how often it hit its limit
(v1 failcnt / v2 memory.events max) and OOM kills; and whether Colibri's tokens equal the
uncapped ones. Medians over --runs. Nothing else heavy may run meanwhile.

Colibri's decode is also split into the cold start (its first --cold tokens: the cache filling)
and the steady state (the rest; --gen 288 gives tokens 33-288), and the steady state is set
against its limits:
  roofline   T_c + B_miss / BW_s a token: T_c the uncapped run's steady time a token decoding
             the same tokens again, warm (every page in memory; the same round), B_miss the bytes this run read from storage a steady token, BW_s the
             storage's read rate measured here first (the model's files read cold, 16 MB reads);
             `vs roofline` is the steady time a token over it (1.0: at the limit);
  belady     the expert-cache misses a steady token of Belady's policy (the expert used furthest
             in the future leaves) on the run's own decode routing with the run's cache capacity
             (the budget over an expert's bytes; an empty cache at the first decoded token), next
             to the cache's own misses a steady token (its demand misses: an expert its prefetch
             read in time counts as a hit, so the cache can miss less often than Belady's).

    sudo python tools/bench/memcap.py --model-dir /work/bench_cache/colibri/mixtral-mini-int8 \\
        --gguf /work/bench_cache/gguf/mixtral-mini-q8_0.gguf \\
        --llama-bench /work/bench_cache/llama.cpp-build/bin/llama-bench --caps none,100,75,50,25 --runs 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MB = 1 << 20

CHILD = r"""
import json, os, sys, time, numpy as np, colibri
from colibri import _engine, _os
from colibri.modeldir import ModelDir
a = json.loads(sys.argv[1])
md = ModelDir(a["model_dir"])
for rel in md.files:
    _os.evict_file_cache(md.root / rel)
t0 = time.perf_counter()
m = colibri.load(a["model_dir"], threads=a["threads"], n_ctx=a["n_ctx"], **a["options"])
load_s = time.perf_counter() - t0
if a["text"] and m.tokenizer is not None:
    ids = m.tokenizer.encode(open(a["text"]).read())[:a["prompt_len"]]
else:
    ids = np.random.default_rng(0).integers(0, m.config.vocab_size, a["prompt_len"]).tolist()
marks, routes = [], []
moe = [l for l, is_moe in enumerate(m.config.moe_layers) if is_moe]
def step(model):
    e = model._engine
    marks.append((time.perf_counter(), _os.read_io_bytes(), _os.page_faults()[1],
                  int(e.cache_stats[_engine.CACHE_STATS["misses"]])))
    routes.append(e.chosen[moe].tolist())
t = time.perf_counter()
tokens = list(m.generate(ids, max_new_tokens=a["gen"], stop_at_eos=False, reuse_prefix=False, on_step=step))
st = m.stats
ms = m.memory_stats()
warm_marks = None
if a["warm"]:  # the same generation again, every page in memory: the compute time a token
    cold_marks, marks = marks, []
    list(m.generate(ids, max_new_tokens=a["gen"], stop_at_eos=False, reuse_prefix=False, on_step=step))
    warm_marks, marks = marks, cold_marks
first, last = marks[0], marks[-1]
decoded = len(marks) - 1
print(json.dumps({
    "load_s": load_s, "ttft_ms": (first[0] - t) * 1000,
    "prefill_tok_s": st["prefill_tokens"] / st["prefill_seconds"],
    "decode_tok_s": st["decode_tokens"] / st["decode_seconds"],
    "read_mb_per_token": (last[1] - first[1]) / decoded / 1e6 if decoded and first[1] is not None else None,
    "major_faults": last[2], "cache_hit_rate": ms["cache_hit_rate"], "prefetch_hit_rate": ms["prefetch_hit_rate"],
    "prediction_hit_rate": ms["prediction_hit_rate"], "budget_mb": (ms["expert_budget_bytes"] or 0) / 2**20,
    "evictions": ms["experts_released"], "tokens": tokens,
    "marks": marks, "routes": routes[1:],  # a decoded token's routing: the steps after the first
    "expert_bytes": max(size for _, size in m.residency.spans.values()) if m.residency.spans else None,
    "warm_marks": warm_marks}))
"""


class Cgroup:
    """A memory cgroup of `limit` bytes (None: no cgroup: the command runs as it is)."""

    def __init__(self, limit):
        self.limit, self.dir, self.version = limit, None, None
        if limit is None:
            return
        name = f"colibri-memcap-{uuid.uuid4().hex[:8]}"
        v2 = Path("/sys/fs/cgroup")
        if (v2 / "cgroup.controllers").exists() and "memory" in (v2 / "cgroup.subtree_control").read_text():
            self.dir, self.version = v2 / name, 2
            self.dir.mkdir()
            (self.dir / "memory.max").write_text(str(limit))
            (self.dir / "memory.swap.max").write_text("0")
        else:
            self.dir, self.version = Path("/sys/fs/cgroup/memory") / name, 1
            self.dir.mkdir()
            (self.dir / "memory.limit_in_bytes").write_text(str(limit))

    def wrap(self, cmd: list) -> list:
        if self.dir is None:
            return cmd
        return ["sh", "-c", f'echo $$ > {self.dir}/cgroup.procs && exec "$@"', "sh"] + cmd

    def report(self) -> dict:
        if self.dir is None:
            return {"peak_mb": None, "limit_hits": None, "oom_kills": None}
        if self.version == 1:
            oom = dict(line.split() for line in (self.dir / "memory.oom_control").read_text().splitlines())
            return {
                "peak_mb": int((self.dir / "memory.max_usage_in_bytes").read_text()) / MB,
                "limit_hits": int((self.dir / "memory.failcnt").read_text()),
                "oom_kills": int(oom.get("oom_kill", 0)),
            }
        events = dict(line.split() for line in (self.dir / "memory.events").read_text().splitlines())
        peak = self.dir / "memory.peak"
        return {
            "peak_mb": int(peak.read_text()) / MB if peak.exists() else None,
            "limit_hits": int(events.get("max", 0)),
            "oom_kills": int(events.get("oom_kill", 0)),
        }

    def remove(self) -> None:
        if self.dir is not None:
            for _ in range(50):
                try:
                    self.dir.rmdir()
                    return
                except OSError:
                    time.sleep(0.1)


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_colibri(args, cg: Cgroup) -> dict:
    a = {
        "model_dir": str(args.model_dir),
        "threads": args.threads,
        "n_ctx": args.n_ctx,
        "gen": args.gen,
        "prompt_len": args.prompt_len,
        "text": str(args.text) if args.text else None,
        "options": json.loads(args.options),
        "warm": cg.limit is None,  # the uncapped run also decodes warm: the roofline's compute time
    }
    cmd = cg.wrap([sys.executable, "-c", CHILD, json.dumps(a)])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": "timeout"}
    if r.returncode != 0:
        last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
        return {"error": f"exit {r.returncode}: {last.split('ColibriError: ')[-1][:90]}"}
    return json.loads(r.stdout)


def run_llama(args, cg: Cgroup) -> dict:
    evict(args.gguf)
    cmd = cg.wrap(
        [
            str(args.llama_bench),
            "-m",
            str(args.gguf),
            "-p",
            str(args.prompt_len),
            "-n",
            str(args.gen),
            "-r",
            "1",
            "-t",
            str(args.threads),
            "--no-warmup",
            "-o",
            "json",
        ]
    )
    t = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": "timeout"}
    if r.returncode != 0:
        return {"error": f"exit {r.returncode}"}
    rows = json.loads(r.stdout)
    out = {"wall_s": time.perf_counter() - t}
    for row in rows:
        key = "prefill_tok_s" if row.get("n_prompt") else "decode_tok_s"
        out[key] = row["avg_ts"]
    return out


def storage_rate(model_dir: Path) -> float:
    """Bytes a second read from the model's files cold (16 MB reads, the page cache dropped first)."""
    files = sorted(p for p in model_dir.rglob("*.bin") if p.is_file())
    for p in files:
        evict(p)
    n, t = 0, time.perf_counter()
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(16 * MB):
                n += len(chunk)
    rate = n / (time.perf_counter() - t)
    for p in files:
        evict(p)
    return rate


def phases(r: dict, cold: int) -> dict:
    """Cold (decoded tokens 1..cold) and steady (the rest) of a Colibri run: seconds, storage bytes
    and cache misses a token."""
    marks = r.get("marks") or []
    out = {}
    for name, (a, b) in (("cold", (0, cold)), ("steady", (cold, len(marks) - 1))):
        if b <= a or len(marks) <= b:
            continue
        (t0, io0, _, miss0), (t1, io1, _, miss1) = marks[a], marks[b]
        out[f"{name}_s_per_token"] = (t1 - t0) / (b - a)
        out[f"{name}_read_mb_per_token"] = (io1 - io0) / (b - a) / 1e6 if io0 is not None else None
        out[f"{name}_misses_per_token"] = (miss1 - miss0) / (b - a)
    warm = r.get("warm_marks") or []
    if len(warm) > cold + 1:
        out["warm_steady_s_per_token"] = (warm[-1][0] - warm[cold][0]) / (len(warm) - 1 - cold)
    return out


def belady_misses(r: dict, cold: int) -> float | None:
    """Belady's misses a steady token on the run's decode routing at its cache's capacity."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from routing_cache import simulate

    routes, budget, size = r.get("routes"), (r.get("budget_mb") or 0) * MB, r.get("expert_bytes")
    if not routes or not budget or not size or len(routes) <= cold:
        return None
    import numpy as np

    tr = np.asarray(routes)  # [decoded tokens, MoE layers, k]
    capacity = max(int(budget // size), tr.shape[2])
    return (1 - simulate(tr, capacity, "belady", count_from=cold)) * tr.shape[1] * tr.shape[2]


def print_limits(results: dict, caps: list, bw: float, cold: int) -> None:
    """Colibri's cold start and steady state, the steady state against the roofline and Belady's."""
    uncapped = results.get(("colibri", None), [])
    print(f"\nColibri: cold start (decoded tokens 1-{cold}) and steady state; storage {bw / 1e6:.0f} MB/s\n")
    print(
        "| cap | cold tok/s | steady tok/s | steady read MB/token | roofline tok/s | time / roofline "
        "| misses/token | Belady's misses/token | misses / Belady's |"
    )
    print("|" + "---|" * 9)
    for cap in caps:
        rs = results.get(("colibri", cap), [])
        rows = []
        for i, r in enumerate(rs):
            t_c = uncapped[i].get("warm_steady_s_per_token") if i < len(uncapped) else None
            read = r.get("steady_read_mb_per_token")
            roof = t_c + read * 1e6 / bw if t_c is not None and read is not None else None
            belady = r.get("belady_misses_per_token")
            misses = r.get("steady_misses_per_token")
            rows.append(
                {
                    "cold": 1 / r["cold_s_per_token"] if r.get("cold_s_per_token") else None,
                    "steady": 1 / r["steady_s_per_token"] if r.get("steady_s_per_token") else None,
                    "read": read,
                    "roofline": 1 / roof if roof else None,
                    "vs": r["steady_s_per_token"] / roof if roof and r.get("steady_s_per_token") else None,
                    "misses": misses,
                    "belady": belady,
                    "over": misses / belady if belady and misses is not None else None,
                }
            )
        cells = [median([row[k] for row in rows]) for k in ("cold", "steady", "read", "roofline", "vs")]
        cells += [median([row[k] for row in rows]) for k in ("misses", "belady", "over")]
        label = "none" if cap is None else f"{cap:.0f} %"
        print(f"| {label} | " + " | ".join("" if v is None else f"{v:.3g}" for v in cells) + " |")


def median(values):
    vals = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(vals) if vals else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--gguf", type=Path)
    ap.add_argument("--llama-bench", type=Path)
    ap.add_argument("--caps", default="none,100,75,50,25", help="percentages of the model's bytes; none: no cgroup")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=256)
    ap.add_argument("--text", type=Path, help="prompt text (trained routing wants real text); default: random ids")
    ap.add_argument("--options", default="{}", help='colibri.load keywords as JSON, e.g. \'{"prefetch": "predict"}\'')
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--cold", type=int, default=32, help="decoded tokens counted as the cold start")
    ap.add_argument("--out", type=Path, help="write every run as JSON here")
    args = ap.parse_args()
    model_bytes = sum(p.stat().st_size for p in args.model_dir.rglob("*") if p.is_file())
    caps = [None if c == "none" else float(c) for c in args.caps.split(",")]
    engines = ["colibri"] + (["llama.cpp"] if args.gguf and args.llama_bench else [])
    results = {(e, c): [] for e in engines for c in caps}
    bw = storage_rate(args.model_dir)
    print(f"storage read rate {bw / 1e6:.0f} MB/s (the model's files, cold)", file=sys.stderr, flush=True)
    for run in range(args.runs):
        for cap in caps:
            for engine in engines:
                limit = None if cap is None else int(model_bytes * cap / 100) // 4096 * 4096
                cg = Cgroup(limit)
                try:
                    r = run_colibri(args, cg) if engine == "colibri" else run_llama(args, cg)
                    r.update(cg.report())
                    if engine == "colibri":
                        r.update(phases(r, args.cold))
                        r["belady_misses_per_token"] = belady_misses(r, args.cold)
                finally:
                    cg.remove()
                results[(engine, cap)].append(r)
                print(
                    f"run {run} cap {cap} {engine}: "
                    + json.dumps({k: v for k, v in r.items() if k not in ("tokens", "marks", "routes", "warm_marks")}),
                    file=sys.stderr,
                    flush=True,
                )
    reference = next((r["tokens"] for r in results.get(("colibri", None), []) if "tokens" in r), None)
    cols = [
        "decode_tok_s",
        "prefill_tok_s",
        "ttft_ms",
        "read_mb_per_token",
        "major_faults",
        "cache_hit_rate",
        "prefetch_hit_rate",
        "peak_mb",
        "limit_hits",
        "oom_kills",
    ]
    print(
        f"model {args.model_dir.name}: {model_bytes / MB:.0f} MB; prompt {args.prompt_len}, gen {args.gen}, "
        f"{args.threads} threads, n_ctx {args.n_ctx}, options {args.options}, medians of {args.runs} cold runs\n"
    )
    print(
        "| engine | cap | decode tok/s | prefill tok/s | TTFT ms | read MB/token | major faults | expert hit rate "
        "| prefetch hit rate | cgroup peak MB | limit hits | OOM kills | same tokens |"
    )
    print("|" + "---|" * 13)
    for (engine, cap), rs in results.items():
        cells = []
        for c in cols:
            v = median([r.get(c) for r in rs])
            cells.append(
                "" if v is None else (f"{100 * v:.1f} %" if "rate" in c else f"{v:.3g}" if v < 100 else f"{v:.0f}")
            )
        errors = sorted({r["error"] for r in rs if "error" in r})
        same = (
            ""
            if engine != "colibri" or reference is None
            else ("yes" if all(r.get("tokens") == reference for r in rs) else "NO")
        )
        label = "none" if cap is None else f"{cap:.0f} % ({model_bytes * cap / 100 / MB:.0f} MB)"
        print(
            f"| {engine} | {label} | " + " | ".join(cells) + f" | {same}{' ' + '; '.join(errors) if errors else ''} |"
        )
    print_limits(results, caps, bw, args.cold)
    if args.out:
        args.out.write_text(json.dumps({f"{e} {c}": rs for (e, c), rs in results.items()}, indent=1))


if __name__ == "__main__":
    main()
