#!/usr/bin/env python3
"""Two source trees' interleaved prompt tile side by side, in one process.

    python tools/bench/ab_itile.py OLD_CSRC NEW_CSRC [--shapes 3584x1024x32,768x2048x8]
                                   [--dtypes int4,int8,int6,mxfp4] [--reps 30] [--entry avx2]
                                   [--from-memory]

--entry: the tile compared, avx2 (cb_itile_avx2, the default), avx512vnni (the AVX512-VNNI
step's 512-bit entry, cb_itile_wide_avx512vnni: needs AVX512_VNNI) or bf16x (the interleaved bf16
products, cb_itile_bf16x_avx512: needs AVX512_BF16), bf16 (widened, cb_itile_bf16_avx512) or
bf16-avx2 (cb_itile_bf16_avx2, the activations in CB_XP_PAIRS order as the engine gives them);
the bf16 entries take --dtypes bf16. --from-memory: each
product reads the next of enough copies of the matrix to fill 256 MB, so the weights come from
memory (as an engine's experts do) instead of the caches.

OLD_CSRC / NEW_CSRC: colibri/csrc directories (e.g. `git archive REV colibri/csrc | tar -x -C
/tmp/old`). Each tree's dispatch.h is compiled into its own object (gcc -O3, the kernels' own
target attributes), one thread; both tiles run on the same random interleaved matrix and the
same activations (quantized by the new tree's cb_quantize_act_avx2), alternating, best of 7 rounds
of --reps products each, the matrix staying in the caches. Prints GOP/s (2 x multiply-adds) of
each, their ratio, and whether the outputs are the same bits. Needs gcc and an AVX2 CPU.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

TU = r"""
#include "dispatch.h"
void FN(float *out, int ldo, const char *w, int dtype, const cb_act_q8 *acts, int cols, int g0, int g1, int n) {
    ENTRY(out, ldo, w, dtype, acts, cols, g0, g1, n);
}
"""
MAIN = r"""
#include <stdio.h>
#include <time.h>
#include "dispatch.h"
void itile_old(float *, int, const char *, int, const cb_act_q8 *, int, int, int, int);
void itile_new(float *, int, const char *, int, const cb_act_q8 *, int, int, int, int);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    const int rows = atoi(argv[1]), cols = atoi(argv[2]), n = atoi(argv[3]), reps = atoi(argv[5]);
    const int from_memory = atoi(argv[6]);
    const int dtype = !strcmp(argv[4], "int8") ? CB_INT8 : !strcmp(argv[4], "mxfp4") ? CB_MXFP4
                    : !strcmp(argv[4], "int6") ? CB_INT6 : !strcmp(argv[4], "nl4") ? CB_NL4
                    : !strcmp(argv[4], "bf16") ? CB_BF16 : CB_INT4;
    const int nb = cols / CB_QBLOCK, ng = rows / CB_TGROUP;
    const size_t gb = dtype == CB_BF16 ? 2 * CB_QBLOCK * CB_TGROUP : cb_group_bytes(dtype), bytes = (size_t)ng * nb * gb;
    const size_t copies = from_memory ? (((size_t)256 << 20) + bytes - 1) / bytes : 1;
    char *w = malloc(bytes * copies);
    srand(1);
    for (size_t i = 0; i < bytes; i++) w[i] = (char)rand();
    if (dtype == CB_BF16)                                /* finite bf16 weights: |w| in [2^-8, 2^8) */
        for (size_t i = 0; i < bytes / 2; i++) ((uint16_t *)(void *)w)[i] = (uint16_t)(0x3B80 + (rand() & 0x80FF) % 0x0800);
    else for (size_t g = 0; g < (size_t)ng * nb; g++)   /* finite scales: f16 (int formats), e8m0 (mxfp4) */
        for (int r = 0; r < CB_TGROUP; r++) {
            if (dtype == CB_MXFP4) ((uint8_t *)(w + g * gb))[r] = (uint8_t)(120 + (rand() & 7));
            else ((uint16_t *)(void *)(w + g * gb))[r] = (uint16_t)(0x2000 + (rand() & 0x3ff));
        }
    for (size_t c = 1; c < copies; c++) memcpy(w + c * bytes, w, bytes);
    cb_act_q8 *acts = calloc((size_t)n, sizeof *acts);
    float *x = malloc(sizeof(float) * (size_t)cols);
    for (int t = 0; t < n; t++) {
        for (int i = 0; i < cols; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
        acts[t].q = malloc((size_t)cols); acts[t].d = malloc(4 * (size_t)(nb + 1)); acts[t].s = malloc(4 * (size_t)(nb + 1));
        acts[t].nl4_off = malloc(8 * (size_t)(nb + 1)); acts[t].n = cols;
        cb_quantize_act_avx2(&acts[t], x, cols);
        float *xt = malloc(sizeof(float) * (size_t)cols);
        memcpy(xt, x, sizeof(float) * (size_t)cols);
        acts[t].x = xt;
        acts[t].xb = malloc(2 * (size_t)cols);
        for (int i = 0; i < cols; i++) { uint32_t u; memcpy(&u, &xt[i], 4); acts[t].xb[i] = (uint16_t)(u >> 16); }
        if (XP_PAIRS) { acts[t].xp = malloc(sizeof(float) * (size_t)cols); cb_permute_pairs(acts[t].xp, xt, cols); }
    }
    float *a = calloc((size_t)rows * n, 4), *b = calloc((size_t)rows * n, 4);
    double ta = 1e9, tb = 1e9;
    for (int r = 0; r < 7; r++) {
        double t0 = now();
        for (int k = 0; k < reps; k++) itile_old(a, rows, w + (size_t)(k % copies) * bytes, dtype, acts, cols, 0, ng, n);
        double t1 = now();
        for (int k = 0; k < reps; k++) itile_new(b, rows, w + (size_t)(k % copies) * bytes, dtype, acts, cols, 0, ng, n);
        double t2 = now();
        ta = t1 - t0 < ta ? t1 - t0 : ta;
        tb = t2 - t1 < tb ? t2 - t1 : tb;
    }
    const double ops = 2.0 * rows * cols * n * reps;
    printf("%.1f %.1f %d\n", ops / ta / 1e9, ops / tb / 1e9, memcmp(a, b, sizeof(float) * (size_t)rows * n) == 0);
    return 0;
}
"""
ENTRIES = {
    "avx2": "cb_itile_avx2",
    "avx512vnni": "cb_itile_wide_avx512vnni",
    "bf16x": "cb_itile_bf16x_avx512",
    "bf16": "cb_itile_bf16_avx512",
    "bf16-avx2": "cb_itile_bf16_avx2",
}


def build(old: Path, new: Path, work: Path, entry: str = "avx2") -> Path:
    (work / "tu.c").write_text(TU)
    (work / "main.c").write_text(MAIN)
    cc = ["gcc", "-O3", "-fopenmp"]
    subprocess.run(
        cc
        + [
            "-c",
            "-I",
            str(old),
            "-DFN=itile_old",
            f"-DENTRY={ENTRIES[entry]}",
            str(work / "tu.c"),
            "-o",
            str(work / "old.o"),
        ],
        check=True,
    )
    subprocess.run(
        cc
        + [
            "-c",
            "-I",
            str(new),
            "-DFN=itile_new",
            f"-DENTRY={ENTRIES[entry]}",
            str(work / "tu.c"),
            "-o",
            str(work / "new.o"),
        ],
        check=True,
    )
    exe = work / "ab_itile"
    subprocess.run(
        cc
        + [
            "-I",
            str(new),
            f"-DXP_PAIRS={int(entry == 'bf16-avx2')}",
            str(work / "main.c"),
            str(work / "old.o"),
            str(work / "new.o"),
            "-lm",
            "-o",
            str(exe),
        ],
        check=True,
    )
    return exe


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--shapes", default="3584x1024x32,768x2048x8,1024x3584x32")
    ap.add_argument("--dtypes", default="int4,int8,int6,mxfp4")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--entry", choices=sorted(ENTRIES), default="avx2")
    ap.add_argument("--from-memory", action="store_true")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(a.old, a.new, Path(tmp), a.entry)
        print(f"{'format':>6} {'shape x tokens':>20} {'old GOP/s':>10} {'new GOP/s':>10} {'new / old':>10}  bits")
        for dtype in a.dtypes.split(","):
            for shape in a.shapes.split(","):
                rows, cols, n = shape.split("x")
                out = subprocess.run(
                    [str(exe), rows, cols, n, dtype, str(a.reps), str(int(a.from_memory))],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout.split()
                old, new, same = float(out[0]), float(out[1]), out[2] == "1"
                print(
                    f"{dtype:>6} {f'[{rows},{cols}] x {n}':>20} {old:10.1f} {new:10.1f} {new / old:10.2f}  "
                    + ("same" if same else "DIFFER"),
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
