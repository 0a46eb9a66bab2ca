"""Two (or more) builds' decode products from memory in one process, alternated: each build's
kernel speed as a share of the plain read loop's, and its per-round ratio to the first build.

A decode product streams its matrix from memory once per token, so what decides its speed is how
close it comes to the read bandwidth, and this host's bandwidth moves by 20-40 % within minutes
(tools/bench/README.md). Here every round times the read loop and then each build's product on
the same matrix (the order reversed every other round), so the ratios compare builds on the same
host state, as tools/bench/ab_attention.py does for attention.

    python tools/bench/ab_matvec.py A_TREE B_TREE [C_TREE ...] [--dtype bf16] [--isa avx2]
                                    [--products] [--mb 512] [--rounds 20] [--cached]

The trees are source trees built in place (`python setup.py build_ext --inplace`). The matrix is
[rows, 4096] of --dtype in the interleaved layout, --mb megabytes (past the last-level cache);
--products uses bf16 products (vdpbf16ps) where the tier has them. --cached times instead an
expert-shaped [3584, 1024] matrix that stays in the caches (the kernels' own ceiling, where the
arithmetic and not the memory decides), in GB/s of weights, best of 3 each round.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_attention import load_build  # noqa: E402

COLS = 4096


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+", type=Path)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--isa", default=None, help="force a tier in every build (default: each build's best)")
    ap.add_argument("--products", action="store_true", help="bf16 products (vdpbf16ps) where the tier has them")
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cached", action="store_true", help="a cache-resident [3584, 1024] matrix instead")
    a = ap.parse_args()
    if len(a.trees) < 2:
        raise SystemExit("ab_matvec: give two or more built trees")
    builds = [load_build(tree) for tree in a.trees]  # (probes, kernels) of each
    if a.isa:
        for _, kernels in builds:
            kernels.select_isa(a.isa)
    from colibri import quant  # the pure-Python packing is the same in every tree
    from colibri.modeldir import to_storage

    rng = np.random.default_rng(0)
    if a.cached:
        cached_table(a, builds, rng, quant, to_storage)
        return
    rows = (a.mb << 20) // (2 * COLS) // 1024 * 1024
    slab = to_storage(rng.standard_normal((1024, COLS)).astype(np.float32), a.dtype)
    w = quant.from_rows(np.ascontiguousarray(np.tile(slab, (rows // 1024, 1))), a.dtype, COLS, "interleaved")
    x = rng.standard_normal(COLS).astype(np.float32)
    read_buf = np.ones(w.nbytes // 8, np.uint64)
    reader = builds[0][0]

    def product(probes):
        if a.products:
            return probes.kernel_matmul(w, x.reshape(1, -1), a.dtype, a.threads, "interleaved", True)
        return probes.kernel_matvec(w, x, a.dtype, a.threads, "interleaved")

    for probes, _ in builds:  # page in, warm each build's code
        product(probes)
    share = [[] for _ in builds]  # per round: read time / product time
    for r in range(a.rounds):
        read = timed(lambda: reader.bench_read(read_buf, a.threads))
        order = range(len(builds)) if r % 2 == 0 else reversed(range(len(builds)))
        for i in order:
            share[i].append(read / timed(lambda: product(builds[i][0])))
    print(
        f"{a.dtype} [{rows}, {COLS}] interleaved ({w.nbytes >> 20} MB), {a.threads} threads, tier "
        f"{a.isa or 'each build default'}{', bf16 products' if a.products else ''}, {a.rounds} rounds"
    )
    for i, tree in enumerate(a.trees):
        ratio = statistics.median(s / f for s, f in zip(share[i], share[0]))
        print(f"{str(tree):>40}  of the read loop {statistics.median(share[i]):.3f}  / first build {ratio:.3f}")


def cached_table(a, builds, rng, quant, to_storage, rows=3584, cols=1024) -> None:
    """Each build's decode product on one cache-resident matrix, alternated: GB/s of weights."""
    stored = to_storage(rng.standard_normal((rows, cols)).astype(np.float32), a.dtype)
    w = quant.from_rows(stored, a.dtype, cols, "interleaved")
    x = rng.standard_normal((1, cols)).astype(np.float32)
    reps = max(1, int(2e8 / stored.nbytes))  # about 0.2 GB of weights a measurement
    for probes, _ in builds:
        probes.bench_matmul(w, x, a.dtype, a.threads, reps, "interleaved", a.products)  # warm
    rate = [[] for _ in builds]
    for r in range(a.rounds):
        order = range(len(builds)) if r % 2 == 0 else reversed(range(len(builds)))
        for i in order:
            t = min(
                builds[i][0].bench_matmul(w, x, a.dtype, a.threads, reps, "interleaved", a.products) for _ in range(3)
            )
            rate[i].append(stored.nbytes * reps / t / 1e9)
    print(
        f"{a.dtype} [{rows}, {cols}] interleaved from the caches, {a.threads} threads, tier "
        f"{a.isa or 'each build default'}{', bf16 products' if a.products else ''}, {a.rounds} rounds"
    )
    for i, tree in enumerate(a.trees):
        ratio = statistics.median(s / f for s, f in zip(rate[i], rate[0]))
        print(f"{str(tree):>40}  {statistics.median(rate[i]):.1f} GB/s  / first build {ratio:.3f}")


if __name__ == "__main__":
    main()
