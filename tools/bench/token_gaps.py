#!/usr/bin/env python3
"""Where in a generation the slow decode tokens fall: is a P99 one token the engine makes slow
every time (the first after the prompt, a cache boundary) or the host's, anywhere?

    python tools/bench/token_gaps.py MODEL_DIR [--reps 24] [--gen 128] [--prompt-len 8]

Generates --gen tokens after the same random prompt --reps times (no prefix reuse, as `colibri
bench`) and times every decoded token (the first, which carries the prompt, is left out). Each
repetition's times are divided by its median; prints the token positions with the highest median
of that ratio over the repetitions, the positions most often above 1.3x, and each repetition's
P99 / P50. A position the engine makes slow shows a median ratio well above 1; the host's
interruptions only raise the frequency of no position in particular.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--reps", type=int, default=24)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    if a.gen < 3 or a.reps < 1:
        ap.error("--gen must be at least 3 (the first token carries the prompt) and --reps at least 1")
    import colibri

    model = colibri.load(a.model_dir, threads=a.threads)
    # positions below count the decoded tokens after the first generated one, from 0
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, a.prompt_len).tolist()
    gaps = []  # [rep][decoded token] seconds
    for _ in range(a.reps):
        times, last = [], time.perf_counter()
        for _ in model.generate(prompt, max_new_tokens=a.gen, stop_at_eos=False, reuse_prefix=False):
            now = time.perf_counter()
            times.append(now - last)
            last = now
        gaps.append(times[1:])
    model.close()
    g = np.array(gaps)
    ratio = g / np.median(g, axis=1, keepdims=True)  # [rep][token]: each repetition against its median
    med = np.median(ratio, axis=0)
    slow = (ratio > 1.3).mean(axis=0)
    print(f"{a.reps} repetitions of {g.shape[1]} decoded tokens; median token {1000 * np.median(g):.2f} ms")
    print("highest median ratio (position: ratio):", ", ".join(f"{i}: {med[i]:.3f}" for i in np.argsort(-med)[:8]))
    print(
        "most often above 1.3x (position: share of repetitions):",
        ", ".join(f"{i}: {slow[i]:.2f}" for i in np.argsort(-slow, kind="stable")[:8]),
    )
    print(
        "P99 / P50 per repetition:", " ".join(f"{x:.2f}" for x in np.percentile(g, 99, axis=1) / np.median(g, axis=1))
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
