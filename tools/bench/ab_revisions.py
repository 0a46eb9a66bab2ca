#!/usr/bin/env python3
"""Two Colibri revisions on the same model, interleaved: `python -m colibri bench` A, B, A, B ...

Each revision is checked out into its own git worktree under $BENCH_CACHE/ab/<rev> and built in
place (`setup.py build_ext --inplace`); runs alternate between them (PYTHONPATH points at the
directory of its package), one process per run, so both see the same machine state. Prints each pair and
the medians of prefill and decode tok/s with the ratio B / A. A kernel change is measured this
way on this shared, noisy machine, not by two runs minutes apart.

    python tools/bench/ab_revisions.py REV_A REV_B --model-dir D [--pairs 3] [--threads 2]
                                        [--prompt-len 128] [--gen 48] [--repeat 3]
                                        [--bench-args '--kv-cache q8 --n-ctx 16500']
REV may be a commit, a branch, or "worktree" (the current checkout as it is, built in place).
With --model-dir-b, B runs on that directory instead: one revision on two model directories (two
expert layouts, say): `ab_revisions.py worktree worktree --model-dir D --model-dir-b D2`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("BENCH_CACHE", "/work/bench_cache"))


def prepare(rev: str) -> Path:
    """The directory that holds `rev`'s colibri package (src/ before the top-level layout), built."""
    if rev == "worktree":
        root = REPO
    else:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", rev], cwd=REPO, check=True, capture_output=True, text=True
        ).stdout.strip()
        root = CACHE / "ab" / sha
        if not root.exists():
            subprocess.run(["git", "worktree", "add", "--detach", str(root), sha], cwd=REPO, check=True)
    subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"], cwd=root, check=True, stdout=subprocess.DEVNULL
    )
    return root / "src" if (root / "src" / "colibri").is_dir() else root  # the layout before/after 2026-12-01


def run(src: Path, model_dir: str, args) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "colibri",
        "bench",
        "--model-dir",
        model_dir,
        "--json",
        "--prompt-len",
        str(args.prompt_len),
        "--gen",
        str(args.gen),
        "--repeat",
        str(args.repeat),
        "--threads",
        str(args.threads),
        *shlex.split(args.bench_args),
    ]
    out = subprocess.run(
        cmd, env=dict(os.environ, PYTHONPATH=str(src)), check=True, capture_output=True, text=True, cwd="/"
    ).stdout
    d = json.loads(out)
    return {"pp": d["prefill_tok_s"]["median"], "tg": d["decode_tok_s"]["median"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rev_a")
    ap.add_argument("rev_b")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--model-dir-b", default=None, help="B's model directory (default: --model-dir)")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=3, help="bench's repetitions in each process (its median counts)")
    ap.add_argument(
        "--bench-args",
        default="",
        help="more arguments for `colibri bench`, as one string (e.g. '--kv-cache q8 --n-ctx 16500')",
    )
    args = ap.parse_args()
    revs = (args.rev_a, args.rev_b)  # the same revision twice measures the noise (A/A)
    src = [prepare(rev) for rev in dict.fromkeys(revs)]
    src = src * 2 if len(src) == 1 else src
    dirs = (args.model_dir, args.model_dir_b or args.model_dir)
    if args.model_dir_b:  # name the runs by what differs
        revs = tuple(f"{r}:{Path(d).name}" for r, d in zip(revs, dirs))
    got = ([], [])
    for i in range(args.pairs):
        for k in (0, 1):
            got[k].append(run(src[k], dirs[k], args))
            print(
                f"pair {i + 1} {'AB'[k]} {revs[k]:>12}: prefill {got[k][-1]['pp']:.1f} tok/s, "
                f"decode {got[k][-1]['tg']:.2f} tok/s",
                flush=True,
            )
    for key, label in (("pp", "prefill"), ("tg", "decode")):
        a = statistics.median(r[key] for r in got[0])
        b = statistics.median(r[key] for r in got[1])
        print(f"{label}: {revs[0]} {a:.1f}, {revs[1]} {b:.1f} tok/s (medians of {args.pairs}), B / A = {b / a:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
