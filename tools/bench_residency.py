#!/usr/bin/env python3
"""Expert residency under a memory budget: decode speed, peak RSS and disk reads per token.

For one model directory (ideally one whose experts dominate its size, e.g. the OLMoE-1B-7B shape
in int8), every combination of

    budget   : none, 100 %, 50 %, 25 % of the expert bytes (expert_cache_mb)
    cache    : warm (files in the page cache) or cold (evicted with posix_fadvise DONTNEED first)
    prefetch : none, routed, predict

runs in a fresh process (so peak RSS is its own): load, a 32-token prompt, --gen decoded tokens,
and reports decode tok/s, peak RSS, bytes read from storage per decoded token (/proc/self/io),
major page faults, and the prediction hit rate. Prints a markdown table.

    python tools/bench_residency.py --model-dir /work/bench_cache/colibri/olmoe-1b-7b-int8 [--gen 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, time, numpy as np, colibri
from colibri import _os
args = json.loads(sys.argv[1])
from colibri.modeldir import ModelDir
md = ModelDir(args["model_dir"])
if args["cold"]:
    for rel in md.files:
        _os.evict_file_cache(md.root / rel)
io0 = _os.read_io_bytes()
m = colibri.load(args["model_dir"], threads=args["threads"], prefetch=args["prefetch"],
                 expert_cache_mb=args["budget_mb"])
ids = np.random.default_rng(0).integers(0, m.config.vocab_size, 32)
io1 = _os.read_io_bytes()
t = time.perf_counter()
out = list(m.generate(ids, max_new_tokens=args["gen"], stop_at_eos=False))
st = m.stats
io2 = _os.read_io_bytes()
mem = m.memory_stats()
print(json.dumps({"decode_tok_s": st["decode_tokens"] / st["decode_seconds"],
                  "prefill_s": st["prefill_seconds"], "peak_rss": mem["peak_rss_bytes"],
                  "read_per_token": (io2 - io1) / max(1, len(out)), "major_faults": mem["major_page_faults"],
                  "hit_rate": mem["prediction_hit_rate"], "resident": mem["resident_expert_bytes"],
                  "tokens": out}))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budgets", default="none,1,0.5,0.25", help="fractions of the expert bytes, or none")
    ap.add_argument("--caches", default="warm,cold")
    ap.add_argument("--prefetch", default="none,routed,predict")
    args = ap.parse_args()
    from colibri.modeldir import ModelDir

    md = ModelDir(args.model_dir)
    expert = sum(t["nbytes"] for n, t in md.tensors.items() if ".experts." in n)
    total = sum(f["size"] for f in md.files.values())
    print(
        f"{args.model_dir}: {total / 1e9:.2f} GB, experts {expert / 1e9:.2f} GB; "
        f"{args.gen} decoded tokens after a 32-token prompt, {args.threads} threads\n"
    )
    print(
        "| budget | cache | prefetch | decode tok/s | peak RSS | read from disk per token | major faults | prediction hits |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    reference = None
    budgets = [None if b == "none" else float(b) for b in args.budgets.split(",")]
    for frac in budgets:
        for cold in [c == "cold" for c in args.caches.split(",")]:
            for prefetch in args.prefetch.split(","):
                cfg = {
                    "model_dir": args.model_dir,
                    "threads": args.threads,
                    "gen": args.gen,
                    "cold": cold,
                    "prefetch": prefetch,
                    "budget_mb": None if frac is None else expert * frac / (1 << 20),
                }
                r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], capture_output=True, text=True)
                if r.returncode:
                    print(f"| {frac} | {cold} | {prefetch} | failed: {r.stderr.strip().splitlines()[-1]} |")
                    continue
                out = json.loads(r.stdout.strip().splitlines()[-1])
                reference = reference or out["tokens"]
                same = "" if out["tokens"] == reference else " (tokens differ!)"
                hit = "" if out["hit_rate"] is None else f"{100 * out['hit_rate']:.0f} %"
                print(
                    f"| {'none' if frac is None else f'{frac * 100:g} %'} | {'cold' if cold else 'warm'} | "
                    f"{prefetch} | {out['decode_tok_s']:.1f}{same} | {out['peak_rss'] / 1e9:.2f} GB | "
                    f"{out['read_per_token'] / 1e6:.1f} MB | {out['major_faults']} | {hit} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
