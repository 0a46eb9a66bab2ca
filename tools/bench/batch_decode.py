#!/usr/bin/env python3
"""Decode tokens per second in all, B sequences decoded together (colibri.batching.Batch).

For each B, rounds alternate over the B values (the host's bandwidth moves within a minute): B
random prompts of --prompt tokens are run, then --gen tokens of each are decoded, one engine pass
per token of all of them; the figure is the decode steps' tokens over their time, the median of
--rounds rounds, and the ratio to B = 1 of the same round. --expert-cache-mb runs under an
expert budget (load(expert_cache_mb=)) and adds the decode steps' expert-cache hit rate.
--drafts none,ngram runs each B with each draft source (Batch.add(draft=): every sequence drafts
for itself, its drafts verified in the shared step) and adds each source's rate over the first's
in the same round; --repeat makes each prompt a random third repeated three times, text a
sequence goes on quoting (n-gram drafts find it), where random prompts find almost none.

    python tools/bench/batch_decode.py --model-dir D --batches 1,2,4,8 --gen 64 --rounds 3
                                       [--expert-cache-mb 900] [--drafts none,ngram --repeat]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def prompt_ids(rng, vocab: int, n: int, repeat: bool) -> list:
    """n random ids, or (repeat) a random third of them three times over."""
    if not repeat:
        return rng.integers(3, vocab, n).tolist()
    third = rng.integers(3, vocab, max(1, n // 3)).tolist()
    return (third * 3 + third)[:n]


def one_round(m, B: int, prompt: int, gen: int, rng, draft: str = "none", repeat: bool = False) -> tuple:
    """(decode tokens/s in all, the decode steps' expert-cache hit rate or None without a budget)."""
    from colibri.batching import Batch

    with Batch(m, step_tokens=max(B, prompt * B)) as b:  # the prompts in one pass, before timing
        for _ in range(B):
            ids = prompt_ids(rng, m.config.vocab_size, prompt, repeat)
            b.add(ids, gen + 1, stop_at_eos=False, draft=draft)
        b.step()
        before = m.memory_stats() if m.expert_budget is not None else None
        t, n = time.perf_counter(), 0
        while b.running:
            n += len(b.step())
        rate = n / (time.perf_counter() - t)
    if before is None:
        return rate, None
    after = m.memory_stats()
    hits, misses = (after[k] - before[k] for k in ("cache_hits", "cache_misses"))
    return rate, hits / (hits + misses) if hits + misses else None


def main(argv=None) -> int:
    import colibri

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--expert-cache-mb", type=float, default=None)
    ap.add_argument("--drafts", default="none", help="draft sources, each run at every B (none,ngram)")
    ap.add_argument("--repeat", action="store_true", help="prompts that repeat a random third")
    a = ap.parse_args(argv)
    batches = [int(v) for v in a.batches.split(",")]
    drafts = a.drafts.split(",")
    m = colibri.load(
        a.model_dir,
        threads=a.threads,
        parallel=max(batches),
        n_ctx=a.prompt + a.gen + 8,
        prefill_chunk=max(max(batches) * a.prompt, max(batches)),
        expert_cache_mb=a.expert_cache_mb,
    )
    rng = np.random.default_rng(0)
    one_round(m, 1, a.prompt, 8, rng)  # page the weights in
    runs = [(B, d) for B in batches for d in drafts]
    rates = {run: [] for run in runs}
    hit_rates = {run: [] for run in runs}
    for _ in range(a.rounds):
        for B, d in runs:
            seed = int(rng.integers(1 << 30))  # each draft source of a B on the same prompts
            rate, hit_rate = one_round(m, B, a.prompt, a.gen, np.random.default_rng(seed), d, a.repeat)
            rates[B, d].append(rate)
            hit_rates[B, d].append(hit_rate)
    budget = m.expert_budget is not None
    print(
        "| B | drafts | decode tok/s in all (median; rounds) | per sequence | vs B = 1 | vs drafts "
        + drafts[0]
        + " |"
        + (" expert-cache hit rate |" if budget else "")
    )
    print("|---:|---|---|---:|---:|---:|" + ("---:|" if budget else ""))
    for B, d in runs:
        med = statistics.median(rates[B, d])
        ratio = statistics.median(r / r1 for r, r1 in zip(rates[B, d], rates[batches[0], d]))
        over = statistics.median(r / r0 for r, r0 in zip(rates[B, d], rates[B, drafts[0]]))
        known = [h for h in hit_rates[B, d] if h is not None]  # None: a round without a cache use
        hit = (f" {statistics.median(known):.3f} |" if known else " – |") if budget else ""
        print(
            f"| {B} | {d} | {med:.1f} ({', '.join(f'{r:.1f}' for r in rates[B, d])}) | {med / B:.1f} | "
            f"{ratio:.2f} | {over:.2f} |{hit}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
