#!/usr/bin/env python3
"""Which eviction policy, on trained routing: expert-cache hit rates simulated on a routing trace.

The trace: --text tokenized and run one token per engine call (teacher forcing, so the routing
is the model's on real text), recording every MoE layer's top-k — a model with trained routers
(the bundled demo, or tools/bench/pad_experts.py's padded demo, whose routing is the same).
On it, for caches of 25 / 50 / 75 % of the experts, the hit rate of

    lru       the least recently used expert leaves (csrc/expert_cache.h CB_EVICT_LRU)
    lfu       the least used, counts halved every n_experts uses (CB_EVICT_LFU)
    belady    the one used furthest in the future: the bound no policy can beat

with the current layer's experts never evicted, as the engine's cache does. And predictors of
the experts d layers ahead (the share of the k experts layer l + d chose that a guess of k named):

    router    the next layer's router on this layer's router input (what --prefetch predict
              reads one layer early), d = 1, as the engine counts it
    table     an online transition table: the k experts layer l + d chose most often after
              layer l chose the same top-1 expert (learned from the tokens before), d = 1, 2, 3
    previous  the experts layer l + d chose for the previous token

    python tools/bench/routing_cache.py [--model-dir colibri/data/demo] [--text tests/fixtures/demo/heldout_head.txt] [--tokens 2000]
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def trace(model_dir: Path, text: Path, tokens: int) -> tuple:
    """(chosen int [T, n_moe_layers, k], next-layer prediction hit rate)."""
    import colibri
    from colibri import _engine

    m = colibri.load(model_dir, threads=2, prefetch="predict")  # contexts of n_ctx positions, one after another
    ids = np.asarray(m.tokenizer.encode(text.read_text())[:tokens], np.int32)
    engine = m._engine  # one token per call: the routing of every position
    moe = [l for l, is_moe in enumerate(m.config.moe_layers) if is_moe]
    out = np.empty((1, m.config.vocab_size), np.float32)
    rows = []
    for pos in range(len(ids)):
        engine.run(ids[pos : pos + 1], pos % m.n_ctx, out, False)
        rows.append(engine.chosen[moe].copy())
    pf = engine.prefetch_stats
    hit = pf[_engine.PF_PREDICT_HITS] / pf[_engine.PF_PREDICTED] if pf[_engine.PF_PREDICTED] else None
    m.close()
    return np.stack(rows), hit


def simulate(tr: np.ndarray, capacity: int, policy: str, count_from: int = 0) -> float:
    """The hit rate of a cache of `capacity` experts under `policy` over the trace (an empty
    cache at its start), counting the uses of tokens count_from.. (the earlier ones warm it)."""
    T, L, k = tr.shape
    n = L * (int(tr.max()) + 1)
    resident = OrderedDict()  # key -> None, least recently used first
    freq, uses, hits, total = {}, 0, 0, 0
    seq = [(l, int(e)) for t in range(T) for l in range(L) for e in tr[t, l]]
    future = {}
    nxt = [0] * len(seq)
    for i in range(len(seq) - 1, -1, -1):  # next use of the same expert, for belady
        nxt[i] = future.get(seq[i], 1 << 62)
        future[seq[i]] = i
    next_use = {}
    i = 0
    for t in range(T):
        for l in range(L):
            current = {(l, int(e)) for e in tr[t, l]}
            for e in tr[t, l]:
                key = (l, int(e))
                counted = t >= count_from
                total += counted
                next_use[key] = nxt[i]
                i += 1
                freq[key] = freq.get(key, 0.0) + 1
                uses += 1
                if uses >= n:
                    freq = {x: f / 2 for x, f in freq.items()}
                    uses = 0
                if key in resident:
                    hits += counted
                    resident.move_to_end(key)
                    continue
                while len(resident) >= capacity:
                    candidates = [x for x in resident if x not in current]
                    if not candidates:
                        break
                    if policy == "lru":
                        victim = candidates[0]
                    elif policy == "lfu":
                        victim = min(candidates, key=lambda x: freq[x])  # ties: the least recent
                    else:
                        victim = max(candidates, key=lambda x: next_use[x])
                    del resident[victim]
                resident[key] = None
    return hits / total


def lookahead(tr: np.ndarray, d: int) -> tuple:
    """(table hit rate, previous-token hit rate) of guesses for layer l + d made at layer l."""
    T, L, k = tr.shape
    E = int(tr.max()) + 1
    counts = np.zeros((L, E, L, E))  # [l, top-1 at l, l + d, expert]
    table_hits = prev_hits = total = 0
    for t in range(T):
        for l in range(L - d):
            truth = set(tr[t, l + d].tolist())
            top1 = tr[t, l, 0]
            guess = set(np.argsort(-counts[l, top1, l + d], kind="stable")[:k].tolist())
            table_hits += len(guess & truth)
            if t:
                prev_hits += len(set(tr[t - 1, l + d].tolist()) & truth)
            total += k
            counts[l, top1, l + d, list(truth)] += 1
    return table_hits / total, prev_hits / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=ROOT / "colibri" / "data" / "demo")
    ap.add_argument("--text", type=Path, default=ROOT / "tests" / "fixtures" / "demo" / "heldout_head.txt")
    ap.add_argument("--tokens", type=int, default=2000)
    args = ap.parse_args()
    tr, predict_hit = trace(args.model_dir, args.text, args.tokens)
    T, L, k = tr.shape
    experts = L * (int(tr.max()) + 1)
    same = np.mean([len(set(tr[t, l]) & set(tr[t - 1, l])) / k for t in range(1, T) for l in range(L)])
    print(f"{args.model_dir.name}: {T} tokens of {args.text.name}, {L} MoE layers x {experts // L} experts, top-{k}")
    print(f"same experts as the previous token {100 * same:.1f} %\n")
    print("| predictor of layer l + d at layer l | d = 1 | d = 2 | d = 3 |")
    print("|---|---:|---:|---:|")
    rows = [lookahead(tr, d) if d < L else (None, None) for d in (1, 2, 3)]
    print(f"| router (the next layer's, on this layer's input) | {100 * predict_hit:.1f} % | | |")
    for i, name in enumerate(("transition table (top-1 -> top-k)", "previous token")):
        print(f"| {name} | " + " | ".join("" if r[i] is None else f"{100 * r[i]:.1f} %" for r in rows) + " |")
    print()
    print("| cache (experts) | lru | lfu | belady (bound) |")
    print("|---|---:|---:|---:|")
    for frac in (0.25, 0.5, 0.75):
        cap = max(k, int(experts * frac))
        row = [simulate(tr, cap, p) for p in ("lru", "lfu", "belady")]
        print(f"| {int(frac * 100)} % ({cap}) | " + " | ".join(f"{100 * h:.1f} %" for h in row) + " |")


if __name__ == "__main__":
    main()
