#!/usr/bin/env python3
"""Decode and prefill at long contexts: Colibri against llama.cpp and ik_llama.cpp, interleaved.

    python tools/bench/long_context.py --model-dir COLIBRI_DIR --gguf FILE.gguf \
        --llama-bench PATH [--ik-bench PATH] [--depths 512,4096,16384] [--reps 2] [--threads 2] \
        [--out results.json]

For each depth D and repetition, every file is read into the page cache, then in turn:
  Colibri      `python -m colibri bench --prompt-len D --gen 32` with the KV cache in f32 and in f16
               (prefill tok/s of the D-token prompt, decode tok/s of the 32 tokens after it);
  llama.cpp    llama-bench `-p D -n 0` (prefill) and `-p 0 -n 32 -d D` (decode at depth D), with
               flash attention off and on;
  ik_llama.cpp (optional; users build it themselves, nothing here builds it) llama-bench `-p D -n 0`
               and `-gp D,32` (decode after a D-token prompt), with `-rtr 1` (its repacked rows, its
               fastest here), flash attention off and on.
--skip leaves out the engines whose names contain any of its comma-separated parts (a part ending in
"$" must be the whole name: 'ik_llama.cpp -rtr fa on$' leaves out the f16 cache's row, not the q8_0's).
The peers keep their default KV cache (f16, as Colibri's --kv-cache f16). The order of the
engines is reversed every other repetition. Prints one line per measurement and, at the end, the
median of each (engine, depth) and Colibri's ratio to the best peer; --out writes every run as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def warm(paths) -> None:
    """Read every file into the page cache, so no engine pays the first read."""
    for p in paths:
        for f in [p] if p.is_file() else sorted(p.rglob("*")):
            if f.is_file():
                with open(f, "rb") as fh:
                    while fh.read(1 << 24):
                        pass


def colibri(model_dir: Path, depth: int, kv: str, threads: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "colibri",
        "bench",
        "--model-dir",
        str(model_dir),
        "--n-ctx",
        str(depth + 64),
        "--prompt-len",
        str(depth),
        "--gen",
        "32",
        "--repeat",
        "1",
        "--threads",
        str(threads),
        "--kv-cache",
        kv,
        "--json",
    ]
    r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return {"pp": r["prefill_tok_s"]["median"], "tg": r["decode_tok_s"]["median"]}


def llama_bench(binary: Path, gguf: Path, args: list, threads: int) -> float:
    """avg_ts of the one test the arguments describe (-o json)."""
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json"] + args
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    tests = json.loads(out[out.index("[") :])
    return float(tests[-1]["avg_ts"])


def peer_runs(a) -> list:
    """(name, {metric: llama-bench arguments}) of each peer configuration."""
    runs = []
    for fa_name, fa in (("off", "off"), ("on", "on")):
        runs.append(
            (
                f"llama.cpp fa {fa_name}",
                a.llama_bench,
                lambda d, fa=fa: {
                    "pp": ["-p", str(d), "-n", "0", "-fa", fa],
                    "tg": ["-p", "0", "-n", "32", "-d", str(d), "-fa", fa],
                },
            )
        )
    if a.ik_bench:
        for fa_name, fa in (("off", "0"), ("on", "1")):
            runs.append(
                (
                    f"ik_llama.cpp -rtr fa {fa_name}",
                    a.ik_bench,
                    lambda d, fa=fa: {
                        "pp": ["-p", str(d), "-n", "0", "-fa", fa, "-rtr", "1"],
                        "tg": ["-gp", f"{d},32", "-fa", fa, "-rtr", "1"],
                    },
                )
            )
        # its 8-bit KV cache (q8_0 keys and values; a quantized V cache needs its flash attention)
        q8 = ["-fa", "1", "-rtr", "1", "-ctk", "q8_0", "-ctv", "q8_0"]
        runs.append(
            (
                "ik_llama.cpp -rtr fa on kv q8_0",
                a.ik_bench,
                lambda d: {"pp": ["-p", str(d), "-n", "0"] + q8, "tg": ["-gp", f"{d},32"] + q8},
            )
        )
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--llama-bench", type=Path, required=True)
    ap.add_argument("--ik-bench", type=Path, default=None)
    ap.add_argument("--depths", default="512,4096,16384")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--skip",
        default="",
        help="comma-separated substrings of engine names not to run, e.g. "
        "'llama.cpp fa,colibri kv f32' (llama.cpp's rows, not ik_llama.cpp's; a 16k prefill takes minutes per engine)",
    )
    a = ap.parse_args(argv)
    skip = [s for s in a.skip.split(",") if s]
    results = []  # {"engine", "depth", "rep", "pp", "tg"}

    def record(engine, depth, rep, pp, tg):
        results.append({"engine": engine, "depth": depth, "rep": rep, "pp": pp, "tg": tg})
        print(f"depth {depth:6d} rep {rep}  {engine:28s} pp {pp:8.1f}  tg {tg:7.2f}", flush=True)
        if a.out:
            a.out.write_text(json.dumps(results, indent=1) + "\n")

    for depth in [int(d) for d in a.depths.split(",")]:
        for rep in range(a.reps):
            warm([a.model_dir, a.gguf])
            engines = [(f"colibri kv {kv}", None, kv) for kv in ("f32", "f16", "q8")] + [
                (name, binary, make) for name, binary, make in peer_runs(a)
            ]
            engines = [e for e in engines if not any(s[:-1] == e[0] if s.endswith("$") else s in e[0] for s in skip)]
            if rep % 2:
                engines.reverse()
            for name, binary, what in engines:
                if binary is None:
                    r = colibri(a.model_dir, depth, what, a.threads)
                    record(name, depth, rep, r["pp"], r["tg"])
                else:
                    tests = what(depth)
                    record(
                        name,
                        depth,
                        rep,
                        llama_bench(binary, a.gguf, tests["pp"], a.threads),
                        llama_bench(binary, a.gguf, tests["tg"], a.threads),
                    )
    print("\nmedians (each Colibri cache / the best peer):")
    for depth in sorted({r["depth"] for r in results}):
        rows = {}
        for r in results:
            if r["depth"] == depth:
                rows.setdefault(r["engine"], []).append(r)
        med = {
            e: (statistics.median(x["pp"] for x in v), statistics.median(x["tg"] for x in v)) for e, v in rows.items()
        }
        peers = [m for e, m in med.items() if not e.startswith("colibri")]
        for e, (pp, tg) in med.items():
            print(f"depth {depth:6d}  {e:28s} pp {pp:8.1f}  tg {tg:7.2f}")
        for e, (pp, tg) in med.items():
            if peers and e.startswith("colibri"):
                print(
                    f"depth {depth:6d}  {e} / best peer: pp {pp / max(p for p, _ in peers):.2f}, "
                    f"tg {tg / max(t for _, t in peers):.2f}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
