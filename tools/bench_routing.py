#!/usr/bin/env python3
"""Routing micro-benchmark and the quality cost of the softmax lookup table.

1. Nanoseconds per routing call (one token, one layer: top-k selection + weights) for 8, 64 and
   128 experts: Colibri's expf mode, its uint8 table mode, and numpy (softmax + argpartition),
   interleaved, median of --repeat rounds of --calls calls each.
2. On the test fixtures (tests/fixtures, converted to f32): KL divergence of the next-token
   distribution between table mode and expf mode, and top-1 agreement.

    python tools/bench_routing.py [--calls 20000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import colibri
from colibri import _kernels, _probes
from colibri.convert import convert

ROOT = Path(__file__).resolve().parent.parent


def numpy_route(logits, k, norm):
    z = logits - logits.max()
    p = np.exp(z)
    p /= p.sum()
    idx = np.argpartition(-p, k - 1)[:k]
    w = p[idx]
    return idx, (w / w.sum() if norm else w)


def speed(calls, repeat):
    rng = np.random.default_rng(0)
    print(f"{'experts':>7} {'k':>2} {'norm':>5} {'expf ns':>8} {'table ns':>9} {'numpy ns':>9}")
    rows = []
    for n_experts, k, norm in ((8, 2, True), (64, 8, False), (128, 8, True)):
        logits = rng.standard_normal((calls, n_experts)).astype(np.float32) * 2
        few = logits[:2000]
        t_exact, t_lut, t_np = [], [], []
        for _ in range(repeat):
            t_exact.append(_probes.bench_route(logits, k, norm, False) / calls)
            t_lut.append(_probes.bench_route(logits, k, norm, True) / calls)
            t = time.perf_counter()
            for row in few:
                numpy_route(row, k, norm)
            t_np.append((time.perf_counter() - t) / len(few))
        r = [statistics.median(t) * 1e9 for t in (t_exact, t_lut, t_np)]
        rows.append((n_experts, k, norm, *r))
        print(f"{n_experts:7d} {k:2d} {str(norm):>5} {r[0]:8.0f} {r[1]:9.0f} {r[2]:9.0f}")
    return rows


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def quality():
    print(f"\n{'fixture':>12} {'KL mean':>9} {'KL max':>9} {'top-1':>6}")
    for case in sorted(p.name for p in (ROOT / "tests" / "fixtures").iterdir() if (p / "hf").is_dir()):
        ids = np.load(ROOT / "tests" / "fixtures" / case / "reference.npz")["input_ids"]
        with tempfile.TemporaryDirectory() as tmp:
            convert(ROOT / "tests" / "fixtures" / case / "hf", Path(tmp) / "m", log=lambda *a: None)
            exact = colibri.load(Path(tmp) / "m").forward(ids).astype(np.float64)
            table = colibri.load(Path(tmp) / "m", exact_softmax=False).forward(ids).astype(np.float64)
        p, q = log_softmax(exact), log_softmax(table)
        kl = (np.exp(p) * (p - q)).sum(-1)
        top1 = (exact.argmax(-1) == table.argmax(-1)).mean()
        print(f"{case:>12} {kl.mean():9.2e} {kl.max():9.2e} {top1:6.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    print(f"tier {_kernels.isa()}; one routing call = top-k + weights for one token of one layer")
    speed(args.calls, args.repeat)
    quality()


if __name__ == "__main__":
    main()
