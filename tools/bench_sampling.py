#!/usr/bin/env python3
"""Microseconds per token of Sampler.pick for vocabularies of 32,000, 151,936 and 262,144.

Each setting picks --tokens tokens from a pool of synthetic float32 logit vectors (normal(0, 2)
with 20 tokens lifted by 8-14, a peaked next-token distribution like a model's) and the median of
--repeat rounds is reported. "penalties" runs with a 1000-token prompt in the history, which
grows as it picks. "argsort (old)" is the previous Sampler's temperature + top_p path (a full
argsort of the vocabulary per token), for comparison.

    python tools/bench_sampling.py [--tokens 40] [--repeat 5] [--vocab 32000 151936 262144]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from colibri.sampling import Sampler

SETTINGS = [
    ("greedy", dict()),
    ("temperature 0.7, top_k 40", dict(temperature=0.7, top_k=40)),
    ("temperature 0.7, top_p 0.95", dict(temperature=0.7, top_p=0.95)),
    ("temperature 1, min_p 0.05", dict(temperature=1.0, min_p=0.05)),
    ("temperature 0.7 (no truncation)", dict(temperature=0.7)),
    (
        "penalties: top_p 0.95, rep 1.1, pres 0.5, freq 0.5",
        dict(temperature=0.7, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5),
    ),
    ("greedy, logprobs 5", dict(logprobs=5)),
    ("temperature 0.7, top_k 40, logprobs 5", dict(temperature=0.7, top_k=40, logprobs=5)),
]


class OldSampler:
    """The previous implementation's sampling path: full stable argsort, then top_p."""

    def __init__(self, temperature, top_p, seed=0):
        self.t, self.top_p, self.rng = temperature, top_p, np.random.default_rng(seed)

    def pick(self, logits):
        z = logits.astype(np.float64) / self.t
        order = np.argsort(-z, kind="stable")
        p = np.exp(z[order] - z[order[0]])
        p /= p.sum()
        keep = int(np.searchsorted(np.cumsum(p), self.top_p) + 1)
        return int(order[self.rng.choice(keep, p=p[:keep] / p[:keep].sum())])


def logit_pool(vocab, count=8, seed=0):
    rng = np.random.default_rng(seed)
    pool = []
    for _ in range(count):
        x = rng.standard_normal(vocab) * 2.0
        x[rng.choice(vocab, 20, replace=False)] += rng.uniform(8, 14, 20)
        pool.append(x.astype(np.float32))
    return pool


def time_sampler(make, pool, tokens, repeat, prompt):
    rounds = []
    for r in range(repeat):
        s = make()
        if hasattr(s, "reset"):
            s.reset(prompt)
        t = time.perf_counter()
        for i in range(tokens):
            s.pick(pool[i % len(pool)])
        rounds.append((time.perf_counter() - t) / tokens * 1e6)
    return statistics.median(rounds)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=40, help="picks per round")
    ap.add_argument("--repeat", type=int, default=5, help="rounds; the median is reported")
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936, 262144])
    args = ap.parse_args()
    pools = {v: logit_pool(v) for v in args.vocab}
    prompts = {v: np.random.default_rng(1).integers(0, v, 1000) for v in args.vocab}
    rows = [(name, (lambda kw=kw: Sampler(**kw))) for name, kw in SETTINGS]
    rows.append(("argsort (old): temperature 0.7, top_p 0.95", lambda: OldSampler(0.7, 0.95)))
    width = max(len(name) for name, _ in rows)
    print(f"{'us per token (median)':<{width}} " + " ".join(f"{v:>9}" for v in args.vocab))
    for name, make in rows:
        old = name.startswith("argsort")
        cells = [
            time_sampler(
                make,
                pools[v],
                max(4, args.tokens // 4) if old else args.tokens,
                max(3, args.repeat // 2) if old else args.repeat,
                prompts[v],
            )
            for v in args.vocab
        ]
        print(f"{name:<{width}} " + " ".join(f"{c:>9.0f}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
