"""Two builds' attention kernels in one process, alternated: the ratio of their speeds on the
same host state. This machine's speed moves by 20-40 % within minutes, so two processes run one
after the other can differ by more than the change being measured; here build B's and build A's
calls alternate (the order reversed every round) and the ratio is taken per round.

    python tools/bench/ab_attention.py A_TREE B_TREE [--positions 16384] [--rounds 20] [--kv q8]
                                       [--decode] [--isa avx512]

A_TREE and B_TREE are source trees built in place (`python setup.py build_ext --inplace`, as
tools/bench/ab_revisions.py's worktrees are). The workload is tools/bench_kernels.py
--prompt-attention's: the last 128 queries of a prompt of --positions positions, 32 heads over 4
KV heads of 128, 2 threads, through the engine's entry (cb_attention); --decode runs them one
query at a time, as decoding does. --isa forces a tier after import (a build whose self-test
fails, e.g. one with a part of a kernel switched off to time the rest, would otherwise fall back).
Prints each build's median GFLOP/s and the median of the per-round ratios B / A (> 1: B faster).
"""

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np


def load_build(tree: Path):
    """The build's colibri._probes (and its _kernels), imported from `tree` and then unlisted
    from sys.modules, so that the next build imports its own copies."""
    for name in [n for n in sys.modules if n == "colibri" or n.startswith("colibri.")]:
        del sys.modules[name]
    sys.path.insert(0, str(tree))
    try:
        import colibri._kernels as kernels
        import colibri._probes as probes
    except ImportError as e:
        raise SystemExit(f"ab_attention: {tree}: no built colibri there ({e})")
    finally:
        sys.path.remove(str(tree))
    if not Path(probes.__file__).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"ab_attention: {tree} has no built colibri (got {probes.__file__})")
    return probes, kernels


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--positions", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--kv", default="q8", choices=("f32", "f16", "q8"))
    ap.add_argument("--decode", action="store_true", help="one query at a time")
    ap.add_argument("--isa", default="", help="force this tier in both builds after import")
    args = ap.parse_args()
    builds = []
    for tree in (args.a, args.b):
        probes, kernels = load_build(tree)
        if args.isa:
            kernels.select_isa(args.isa)
        builds.append(probes)
    chunk, kv_heads, heads, head_dim, n = 128, 4, 32, 128, args.positions
    rng = np.random.default_rng(0)
    k = rng.standard_normal((kv_heads, n, head_dim), dtype=np.float32)
    v = rng.standard_normal((kv_heads, n, head_dim), dtype=np.float32)
    q = rng.standard_normal((chunk, heads, head_dim), dtype=np.float32)
    pos0 = n - chunk
    flop = 4 * heads * head_dim * sum(pos0 + t + 1 for t in range(chunk))
    reps = 1 if args.decode else 2

    def seconds(probes):
        return probes.bench_attention_prompt(q, k, v, pos0, 2, reps, args.decode, args.kv) / reps

    for probes in builds:
        seconds(probes)  # warm
    times = ([], [])
    for r in range(args.rounds):
        for which in (0, 1) if r % 2 == 0 else (1, 0):
            times[which].append(seconds(builds[which]))
    ratios = [a / b for a, b in zip(*times)]
    print(
        f"{args.kv}, {n} positions, {'one query at a time' if args.decode else 'a prompt block'}, "
        f"{args.rounds} rounds: A {flop / statistics.median(times[0]) / 1e9:.1f}, "
        f"B {flop / statistics.median(times[1]) / 1e9:.1f} GFLOP/s; B / A median {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()
