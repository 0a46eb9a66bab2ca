#!/usr/bin/env python3
"""Decode tokens per second in all, B sequences decoded together (colibri.batching.Batch).

For each B, rounds alternate over the B values (the host's bandwidth moves within a minute): B
random prompts of --prompt tokens are run, then --gen tokens of each are decoded, one engine pass
per token of all of them; the figure is the decode steps' tokens over their time, the median of
--rounds rounds, and the ratio to B = 1 of the same round.

    python tools/bench/batch_decode.py --model-dir D --batches 1,2,4,8 --gen 64 --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def one_round(m, B: int, prompt: int, gen: int, rng) -> float:
    from colibri.batching import Batch

    with Batch(m, step_tokens=max(B, prompt * B)) as b:     # the prompts in one pass, before timing
        for _ in range(B):
            b.add(rng.integers(3, m.config.vocab_size, prompt).tolist(), gen + 1, stop_at_eos=False)
        b.step()
        t, n = time.perf_counter(), 0
        while b.running:
            n += len(b.step())
        return n / (time.perf_counter() - t)


def main(argv=None) -> int:
    import colibri

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    batches = [int(v) for v in a.batches.split(",")]
    m = colibri.load(a.model_dir, threads=a.threads, parallel=max(batches), n_ctx=a.prompt + a.gen + 8,
                     prefill_chunk=max(max(batches) * a.prompt, max(batches)))
    rng = np.random.default_rng(0)
    one_round(m, 1, a.prompt, 8, rng)                        # page the weights in
    rates = {B: [] for B in batches}
    for _ in range(a.rounds):
        for B in batches:
            rates[B].append(one_round(m, B, a.prompt, a.gen, rng))
    print("| B | decode tok/s in all (median; rounds) | per sequence | vs B = 1 (median of the rounds' ratios) |")
    print("|---:|---|---:|---:|")
    for B in batches:
        med = statistics.median(rates[B])
        ratio = statistics.median(r / r1 for r, r1 in zip(rates[B], rates[batches[0]]))
        print(f"| {B} | {med:.1f} ({', '.join(f'{r:.1f}' for r in rates[B])}) | {med / B:.1f} | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
