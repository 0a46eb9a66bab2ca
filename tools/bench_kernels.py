#!/usr/bin/env python3
"""Kernel throughput: matvec against the read bandwidth, prefill tiles against the FMA and int8 peaks.

Decode is memory-bound: a matvec kernel is as good as the fraction of the read bandwidth it
reaches on a matrix much larger than the last-level cache. For each storage format and layout
(--layouts rows,transposed) this times `W @ x` on a matrix of about --mb megabytes (by default
512, or 4 x the last-level cache the OS reports where that is more; the table says which), interleaved with a plain streaming read of a buffer of the same size, and prints GB/s and
the ratio. Medians of --repeat. (The transposed matrix has a huge output dimension here, so its
outputs live in L2 rather than L1 as in an expert's matrix: if anything it is measured low.)

The second table is the decode kernels' own ceiling: the same matvec on an expert-shaped
[3584, 1024] matrix that stays in the caches (L2/L3), GB/s of weights — what decode would reach
on a machine whose memory keeps up (this one's 2-thread bandwidth is 15-25 GB/s; the issue's
AVX-512 host has 45-80). Layouts side by side, interleaved (best of --repeat, each a loop of
passes inside one C call: no Python between them).

Prefill is compute-bound: the third table times the engine's matmul (cb_matmul, the tiles the
prefill uses) of --tokens prompt tokens against a [1024, cols] matrix that stays in the caches,
as GFLOP/s (2 x multiply-adds, also for the integer formats), next to the attainable float FMA
rate of the same threads (an AVX2 FMA loop: 16 FLOP per lane-8 FMA; AVX-512 doubles the
machine's float peak) and, for int8/int4, the attainable AVX2 int8 dot-product rate (maddubs +
madd chains, the int8 kernels' step without VNNI: on a core with one vector integer multiplier
this is the int8 ceiling; int4's unsigned nibbles skip most madds and can pass it; VNNI's
vpdpbusd does the step in one instruction). For the transposed int8/int4 matrices the other
variants the tier has are timed too, interleaved: the stored-order tile instead of the repacked
chunk, and the other int steps (AVX2 beside a VNNI step: _kernels.available_int_steps; the emulated
steps, _kernels.EMULATED_INT_STEPS, are left out), also in the matvec table.

    python tools/bench_kernels.py [--threads 2] [--mb N] [--repeat 9] [--isa avx512] [--tokens 128]
                                  [--layouts rows,transposed,interleaved]
    python tools/bench_kernels.py --sweep 1,2,4,8,32,128 --layouts transposed,interleaved
    python tools/bench_kernels.py --attention 256,1024,4096
    python tools/bench_kernels.py --prompt-attention 512,4096,16384
    python tools/bench_kernels.py --expert-prefill 768x2048x8,2048x768x8,3584x1024x32 --dtypes int8,int4,nl4,bf16

--attention: decode's attention alone, per context length: one query of a Mixtral-shaped model
(16 layers, 16 heads over 4 KV heads, head_dim 64) against every layer's f32 KV cache (32 KB per
position), GB/s of cache read next to the plain read of a buffer of the same size, interleaved.
(interleaved is for the block formats and bf16: the other float formats skip it.)

--expert-prefill: a MoE prefill's expert products, ROWSxCOLSxTOKENS each (Qwen3-30B-A3B's experts
are [768, 2048] / [2048, 768] with about 8 tokens each at a 128-token chunk, Mixtral-mini's [3584,
1024] / [1024, 3584] with about 32), in the default layout of each format (int formats interleaved,
bf16 rows with bf16 products where the CPU has them): GFLOP/s with the matrix in the caches and
with distinct copies streamed from memory (past 4 x the last-level cache, one product each, as
a prefill reads its experts), next to the 512-bit vpdpbusd and vdpbf16ps peaks measured in the
same run; the tier's other int steps beside (interleaved: AVX2's 256-bit tile).

--prompt-attention: a prompt chunk's attention alone, per context length: the last 128 queries of
a prompt of that length in one layer of Qwen3-MoE's shape (32 heads over 4 KV heads, head_dim 128),
as prefill computes them (blocks of queries sharing the cache rows) and one query at a time (as
decoding them would; the same bits), f32 and f16 caches, GFLOP/s (4 x heads x head_dim per query
and position) next to the FMA peak measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from colibri import _kernels, _probes, formats, quant
from colibri.bench import last_level_cache_bytes
from colibri.modeldir import to_storage


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--mb",
        type=int,
        default=None,
        help="size of the bf16 matrix in MB (default: 512, or 4 x the last-level cache where that is more)",
    )
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--isa", default=None, help="force a tier (default: the best)")
    ap.add_argument("--dtypes", default="f32,f16,bf16,int8,int4,mxfp4,nl4,int6")
    ap.add_argument("--tokens", type=int, default=128, help="prompt tokens of the prefill table")
    ap.add_argument("--layouts", default="rows,transposed,interleaved")
    ap.add_argument(
        "--sweep",
        default=None,
        help="token counts, e.g. 1,2,4,8,32,128: only the layouts' products of an expert-shaped "
        "[3584, 1024] int8/int4 matrix per token count, each layout's GB/s and the ratio to the first",
    )
    ap.add_argument(
        "--attention",
        default=None,
        help="context lengths, e.g. 256,1024,4096: only decode's attention over a 16-layer KV cache",
    )
    ap.add_argument(
        "--prompt-attention",
        default=None,
        help="context lengths, e.g. 512,4096,16384: only a prompt chunk's attention (Qwen3-MoE's heads)",
    )
    ap.add_argument(
        "--expert-prefill",
        default=None,
        help="ROWSxCOLSxTOKENS shapes, e.g. 768x2048x8,2048x768x8: only experts' prefill products, "
        "cache-resident and streamed from memory",
    )
    args = ap.parse_args()
    if args.isa:
        _kernels.select_isa(args.isa)
    rng = np.random.default_rng(0)
    if args.sweep:
        token_sweep(args, rng, [int(n) for n in args.sweep.split(",")])
        return
    if args.attention:
        attention_table(args, rng, [int(n) for n in args.attention.split(",")])
        return
    if args.prompt_attention:
        prompt_attention_table(args, rng, [int(n) for n in args.prompt_attention.split(",")])
        return
    if args.expert_prefill:
        expert_prefill_table(
            args, rng, [tuple(int(v) for v in shape.split("x")) for shape in args.expert_prefill.split(",")]
        )
        return
    llc = last_level_cache_bytes()
    if args.mb is None:  # "from memory" must be past the caches: a 300 MB L3 holds a 512 MB matrix's third
        args.mb = max(512, 4 * (llc or 0) >> 20)
    cols = args.cols
    rows = args.mb * (1 << 20) // (2 * cols)
    x = rng.standard_normal(cols).astype(np.float32)
    where = (
        "from memory"
        if llc is None or args.mb << 20 >= 4 * llc
        else f"partly from the cache (WARNING: --mb {args.mb} is within 4 x the last-level cache)"
    )
    print(
        f"tier {_kernels.isa()}, {args.threads} threads, matrix [{rows}, {cols}], median of {args.repeat}; "
        f"last-level cache {f'{llc >> 20} MB' if llc else 'unknown'}: this table runs {where}"
    )
    if _kernels.bf16_order() != "seq":  # (an AMX unit's order)
        print(f"interleaved bf16 products in the split order {_kernels.bf16_order()}: widened FMAs, not vdpbf16ps")
    print(f"{'format':>6} {'layout':>10} {'MB':>7} {'kernel GB/s':>12} {'read GB/s':>10} {'ratio':>6}")
    base = rng.standard_normal((1024, cols)).astype(np.float32)
    for dtype in args.dtypes.split(","):
        for layout in layouts_of(args, dtype):
            block = to_storage(base, dtype)  # quantize a slab once, tile it
            w = quant.from_rows(np.ascontiguousarray(np.tile(block, (rows // 1024, 1))), dtype, cols, layout)
            nbytes = w.nbytes
            read_buf = np.ones(nbytes // 8, np.uint64)
            _probes.kernel_matvec(w, x, dtype, args.threads, layout)  # warm: page in
            _probes.bench_read(read_buf, args.threads)
            steps = other_steps() if layout != "rows" and dtype in ("int8", "int4", "nl4", "int6") else []
            products = bf16_products_of(dtype, layout)
            kt, rt, st, bt = [], [], {k: [] for k in steps}, []
            x1 = x.reshape(1, -1)
            for _ in range(args.repeat):  # interleaved, A B A B
                kt.append(timed(lambda: _probes.kernel_matvec(w, x, dtype, args.threads, layout)))
                rt.append(timed(lambda: _probes.bench_read(read_buf, args.threads)))
                for step in steps:
                    with _kernels.int_kernels(step):
                        st[step].append(timed(lambda: _probes.kernel_matvec(w, x, dtype, args.threads, layout)))
                if products:
                    bt.append(timed(lambda: _probes.kernel_matmul(w, x1, dtype, args.threads, layout, True)))
            kgbs = nbytes / statistics.median(kt) / 1e9
            rgbs = nbytes / statistics.median(rt) / 1e9
            rest = (
                "  " + ", ".join(f"{k} step {nbytes / statistics.median(t) / 1e9:.1f}" for k, t in st.items())
                if st
                else ""
            )
            if bt:
                rest += f"  bf16 products {nbytes / statistics.median(bt) / 1e9:.1f} ({nbytes / statistics.median(bt) / 1e9 / rgbs:.2f})"
            print(f"{dtype:>6} {layout:>10} {nbytes / 1e6:7.0f} {kgbs:12.1f} {rgbs:10.1f} {kgbs / rgbs:6.2f}{rest}")
            del w, read_buf
    resident_table(args, rng)
    prefill_table(args, rng)


def token_sweep(args, rng, counts, rows=3584, cols=1024):
    """The layouts side by side per prompt length: what one expert's product costs in each."""
    w_f32 = rng.standard_normal((rows, cols)).astype(np.float32)
    print(
        f"tier {_kernels.isa()}, {args.threads} threads, [{rows}, {cols}] weights, best of {args.repeat}, "
        f"layouts interleaved in time; GB/s of weights per pass over all tokens"
    )
    for dtype in [d for d in args.dtypes.split(",") if d in quant.BLOCK_DTYPES]:
        stored = to_storage(w_f32, dtype)
        mats = {lay: quant.from_rows(stored, dtype, cols, lay) for lay in layouts_of(args, dtype)}
        first = next(iter(mats))
        for n in counts:
            x = rng.standard_normal((n, cols)).astype(np.float32)
            reps = max(1, int(2e8 / stored.nbytes / n))
            best = {lay: float("inf") for lay in mats}
            for _ in range(args.repeat):
                for lay, w in mats.items():
                    best[lay] = min(best[lay], _probes.bench_matmul(w, x, dtype, args.threads, reps, lay))
            cells = "  ".join(
                f"{lay} {stored.nbytes * reps / t / 1e9:6.1f} ({best[first] / t:.2f} x)" for lay, t in best.items()
            )
            print(f"{dtype:>5} {n:4d} tokens: {cells}")


def attention_table(args, rng, lengths, layers=16, kv_heads=4, heads=16, head_dim=64):
    """Decode's attention (cb_attention, every layer, one query) against the read bandwidth, with
    the f32, f16 and q8 caches (load(kv_cache=)) interleaved: ms per token of each, f32's over f16's,
    and each one's cache bytes per second."""
    print(
        f"tier {_kernels.isa()}, {args.threads} threads, {layers} layers x {heads} heads / {kv_heads} KV heads x "
        f"head_dim {head_dim}; median of {args.repeat}, interleaved with a read of the f32 cache's bytes"
    )
    print(
        f"{'positions':>9} {'f32 MB':>7} {'f32 ms':>8} {'f16 ms':>8} {'q8 ms':>8} {'f32/f16':>8} {'f32 GB/s':>9} "
        f"{'f16 GB/s':>9} {'q8 GB/s':>8} {'read GB/s':>10} {'f32 of read':>12}"
    )
    q = rng.standard_normal((heads, head_dim), dtype=np.float32)
    for n in lengths:
        k = rng.standard_normal((layers, kv_heads, n, head_dim), dtype=np.float32)
        v = rng.standard_normal((layers, kv_heads, n, head_dim), dtype=np.float32)
        k16, v16 = k.astype(np.float16), v.astype(np.float16)
        nbytes = k.nbytes + v.nbytes
        read_buf = np.ones(nbytes // 8, np.uint64)
        reps = max(1, int(3e8 / nbytes))
        _probes.bench_attention(q, k, v, n - 1, args.threads, 1)  # warm: page in
        _probes.bench_attention(q, k16, v16, n - 1, args.threads, 1, "f16")
        q8_bytes = nbytes * (head_dim + 4) / (4 * head_dim)
        at, ht, qt, rt = [], [], [], []
        for _ in range(args.repeat):  # (q8: the caches quantized per call, outside the timing)
            at.append(_probes.bench_attention(q, k, v, n - 1, args.threads, reps) / reps)
            ht.append(_probes.bench_attention(q, k16, v16, n - 1, args.threads, reps, "f16") / reps)
            qt.append(_probes.bench_attention(q, k, v, n - 1, args.threads, reps, "q8") / reps)
            rt.append(timed(lambda: _probes.bench_read(read_buf, args.threads)))
        a, h, q8, r = statistics.median(at), statistics.median(ht), statistics.median(qt), statistics.median(rt)
        print(
            f"{n:9d} {nbytes / 1e6:7.1f} {a * 1e3:8.3f} {h * 1e3:8.3f} {q8 * 1e3:8.3f} {a / h:8.2f} "
            f"{nbytes / a / 1e9:9.1f} {nbytes / 2 / h / 1e9:9.1f} {q8_bytes / q8 / 1e9:8.1f} {nbytes / r / 1e9:10.1f} "
            f"{r / a:12.2f}"
        )
        del k, v, k16, v16, read_buf


def prompt_attention_table(args, rng, lengths, chunk=128, kv_heads=4, heads=32, head_dim=128):
    """A prompt chunk's attention (cb_attention, n = chunk queries ending at each length) as the
    block kernel computes it and one query at a time, f32 and f16 caches, interleaved. The peak is
    the tier's FMA width's: the AVX-512 tier's block kernel runs 16 lanes."""
    peak = best_rate("fma", args.threads)
    wide = "avx512" in _kernels.isa() and best_rate("fma512", args.threads)
    if wide and peak and wide > peak:
        peak = wide
    print(
        f"tier {_kernels.isa()}, {args.threads} threads, the last {chunk} queries of a prompt, {heads} heads / "
        f"{kv_heads} KV heads x head_dim {head_dim}; median of {args.repeat}, interleaved; FMA peak "
        + (f"{peak:.0f} GFLOP/s" if peak else "n/a")
        + (" (512-bit)" if wide and wide >= peak else "")
    )
    print(
        f"{'positions':>9} {'cache':>5} {'block GFLOP/s':>14} {'one at a time':>14} {'block / one':>12} "
        f"{'block of peak':>14}"
    )
    for n in lengths:
        k = rng.standard_normal((kv_heads, n, head_dim), dtype=np.float32)
        v = rng.standard_normal((kv_heads, n, head_dim), dtype=np.float32)
        q = rng.standard_normal((chunk, heads, head_dim), dtype=np.float32)
        pos0 = n - chunk
        flop = 4 * heads * head_dim * sum(pos0 + t + 1 for t in range(chunk))
        for kv in ("f32", "f16", "q8"):
            kc, vc = (k.astype(np.float16), v.astype(np.float16)) if kv == "f16" else (k, v)  # q8: per call
            reps = max(1, int(2e10 / flop))
            _probes.bench_attention_prompt(q, kc, vc, pos0, args.threads, 1, False, kv)  # warm
            block, one = [], []
            for _ in range(args.repeat):
                block.append(_probes.bench_attention_prompt(q, kc, vc, pos0, args.threads, reps, False, kv) / reps)
                one.append(_probes.bench_attention_prompt(q, kc, vc, pos0, args.threads, reps, True, kv) / reps)
            b, o = flop / statistics.median(block) / 1e9, flop / statistics.median(one) / 1e9
            print(f"{n:9d} {kv:>5} {b:14.1f} {o:14.1f} {b / o:12.2f} " + (f"{b / peak:14.2f}" if peak else f"{'':>14}"))
        del k, v, q


def expert_prefill_table(args, rng, shapes):
    """Experts' prefill products in each format's default layout, from the caches and from memory."""
    vnni = best_rate("vnni512", args.threads)
    bf16_peak = best_rate("bf16", args.threads) if _kernels.has_bf16_products() else None
    llc = last_level_cache_bytes() or (32 << 20)
    print(
        f"tier {_kernels.isa()}, int step {_kernels.int_step()}, {args.threads} threads, median of {args.repeat}; "
        f"peaks: 512-bit vpdpbusd "
        + (f"{vnni:.0f} GOP/s" if vnni else "n/a")
        + ", vdpbf16ps "
        + (f"{bf16_peak:.0f} GFLOP/s" if bf16_peak else "n/a")
    )
    print(
        f"{'format':>6} {'shape':>18} {'cached GFLOP/s':>15} {'of peak':>8} {'from memory':>12} {'of peak':>8}  other steps (cached, from memory)"
    )
    for dtype in args.dtypes.split(","):
        layout = quant.default_layout(dtype)
        products = dtype == "bf16" and _kernels.has_bf16_products()
        peak = bf16_peak if products else vnni if dtype in ("int8", "int4", "mxfp4", "nl4", "int6") else None
        steps = other_steps() if layout == "interleaved" else []
        for rows, cols, n in shapes:
            w = quant.from_rows(
                to_storage(rng.standard_normal((rows, cols)).astype(np.float32), dtype), dtype, cols, layout
            )
            copies = [w.copy() for _ in range(max(2, -(-4 * llc // w.nbytes)))]
            x = rng.standard_normal((n, cols)).astype(np.float32)
            flop = 2.0 * rows * cols * n
            reps = max(1, int(2e9 / flop))

            def cached():
                return flop * reps / _probes.bench_matmul(w, x, dtype, args.threads, reps, layout, products) / 1e9

            def streamed():
                t = sum(_probes.bench_matmul(c, x, dtype, args.threads, 1, layout, products) for c in copies)
                return flop * len(copies) / t / 1e9

            cached(), streamed()  # warm: page in
            c, m, other = [], [], {k: ([], []) for k in steps}
            for _ in range(args.repeat):  # interleaved
                c.append(cached())
                m.append(streamed())
                for step in steps:
                    with _kernels.int_kernels(step):
                        other[step][0].append(cached())
                        other[step][1].append(streamed())
            cm, mm = statistics.median(c), statistics.median(m)
            rest = ", ".join(
                f"{k} {statistics.median(a):.0f}, {statistics.median(b):.0f}" for k, (a, b) in other.items()
            )
            of = (lambda g: f"{g / peak:8.0%}") if peak else (lambda g: f"{'':>8}")
            print(f"{dtype:>6} {f'[{rows},{cols}] x {n}':>18} {cm:15.0f} {of(cm)} {mm:12.0f} {of(mm)}  {rest or '-'}")
            del copies


def bf16_products_of(dtype, layout):
    """Whether the tables also time this format with bf16 products (load(bf16_products="bf16"):
    vdpbf16ps, the activations rounded to bf16), beside the exact widened path."""
    return dtype == "bf16" and layout in ("rows", "interleaved") and _kernels.has_bf16_products()


def layouts_of(args, dtype):
    """The --layouts a format has (colibri.formats, the table every layer asks)."""
    return [lay for lay in args.layouts.split(",") if lay in formats.layouts_of(dtype)]


def resident_table(args, rng, rows=3584, cols=1024):
    """Decode's matvec on a cache-resident expert-shaped matrix: the kernels' own ceiling."""
    w_f32 = rng.standard_normal((rows, cols)).astype(np.float32)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    print(
        f"\ndecode from the caches: [{rows}, {cols}] weights, {args.threads} thread(s), GB/s of weights, "
        f"best of {args.repeat}, layouts interleaved in time (this table runs from the caches by design)"
    )
    print(f"{'format':>6} " + " ".join(f"{lay:>12}" for lay in args.layouts.split(",")))
    for dtype in args.dtypes.split(","):
        stored = to_storage(w_f32, dtype)
        mats = {lay: quant.from_rows(stored, dtype, cols, lay) for lay in layouts_of(args, dtype)}
        reps = max(1, int(2e8 / stored.nbytes))  # about 0.2 GB of weights a measurement
        best = {lay: float("inf") for lay in mats}
        for lay, w in mats.items():
            _probes.bench_matmul(w, x, dtype, args.threads, reps, lay)  # warm the caches
        for _ in range(args.repeat):
            for lay, w in mats.items():
                best[lay] = min(best[lay], _probes.bench_matmul(w, x, dtype, args.threads, reps, lay))
        cells = [
            f"{stored.nbytes * reps / best[lay] / 1e9:12.1f}" if lay in best else f"{'-':>12}"
            for lay in args.layouts.split(",")
        ]
        print(f"{dtype:>6} " + " ".join(cells))
        for lay in (lay for lay in mats if bf16_products_of(dtype, lay)):
            t = min(
                _probes.bench_matmul(mats[lay], x, dtype, args.threads, reps, lay, True) for _ in range(args.repeat)
            )
            print(f"{'':>6} {lay} with bf16 products (vdpbf16ps): {stored.nbytes * reps / t / 1e9:.1f}")


def other_steps():
    """The int steps of this tier other than the one in use (the emulated ones left out)."""
    return [
        k for k in _kernels.available_int_steps() if k != _kernels.int_step() and k not in _kernels.EMULATED_INT_STEPS
    ]


def best_rate(kind, threads, tries=3):
    """The best of `tries` runs of a peak loop, in G operations per second (None: cannot run):
    a peak is what the machine can do, and a shared machine only ever takes some of it away."""
    runs = [_probes.bench_peak(kind, threads) for _ in range(tries)]
    return None if runs[0] is None else max(ops / seconds for ops, seconds in runs) / 1e9


def prefill_table(args, rng):
    cols, rows, n = args.cols, 1024, args.tokens
    x = rng.standard_normal((n, cols)).astype(np.float32)
    peak_gf, ipeak_g = best_rate("fma", args.threads), best_rate("int8", args.threads)
    wide = "avx512" in _kernels.isa() and best_rate("fma512", args.threads)
    if wide and peak_gf and wide > peak_gf:  # the tier's float kernels are 16 lanes wide
        peak_gf = wide
    bf16_peak = best_rate("bf16", args.threads) if _kernels.has_bf16_products() else None
    print(
        f"\nprefill: [{n} tokens] x [{rows}, {cols}] weights (cache-resident), median of {args.repeat}; "
        f"{args.threads} thread(s): FMA peak "
        + (f"{peak_gf:.0f} GFLOP/s" if peak_gf else "n/a")
        + (f" (AVX-512 {wide:.0f})" if wide else "")
        + ", AVX2 int8 dot peak (maddubs + madd) "
        + (f"{ipeak_g:.0f} GOP/s" if ipeak_g else "n/a")
        + (f", vdpbf16ps peak {bf16_peak:.0f} GFLOP/s" if bf16_peak else "")
    )
    step = _kernels.int_step()
    variants = [("stored-order", step, False)] + [(f"{k} step", k, True) for k in other_steps()]
    print(
        f"(int8/int4 transposed: the {step} step on repacked chunks, and interleaved with it "
        f"{', '.join(v[0] for v in variants)})"
    )
    print(f"{'format':>6} {'layout':>10} {'GFLOP/s':>8} {'of FMA':>7} {'of int8':>8}  other variants GFLOP/s")
    w_f32 = rng.standard_normal((rows, cols)).astype(np.float32)
    reps = 3
    for dtype in args.dtypes.split(","):
        for layout in layouts_of(args, dtype):
            w = quant.from_rows(to_storage(w_f32, dtype), dtype, cols, layout)
            if (
                layout == "interleaved" and dtype in quant.IGROUP_DTYPES
            ):  # no repack to switch off: the other steps only
                compared = [v for v in variants if v[2]]
            else:
                compared = variants if layout == "transposed" and dtype in ("int8", "int4") else []
            _probes.bench_matmul(w, x, dtype, args.threads, 1, layout)  # warm
            times, other_times = [], {v[0]: [] for v in compared}
            # bf16 products: vdpbf16ps, and where the int step in use puts a prompt's interleaved bf16
            # products on AMX tiles, those too (the AVX512-VNNI step's table: vdpbf16ps)
            products = {}
            if bf16_products_of(dtype, layout):
                on_amx = layout == "interleaved" and _kernels.bf16_products_on_amx()
                products = {"bf16 products": "avx512-vnni" if on_amx else None}
                if on_amx:
                    products["bf16 products on AMX tiles"] = None
            other_times.update({k: [] for k in products})
            for _ in range(args.repeat):
                times.append(_probes.bench_matmul(w, x, dtype, args.threads, reps, layout))
                for name, vstep, repack in compared:
                    with _kernels.int_kernels(vstep, repack):
                        other_times[name].append(_probes.bench_matmul(w, x, dtype, args.threads, reps, layout))
                for name, vstep in products.items():
                    with _kernels.int_kernels(vstep):
                        other_times[name].append(_probes.bench_matmul(w, x, dtype, args.threads, reps, layout, True))
            flop = 2.0 * rows * cols * n * reps
            gflops = flop / statistics.median(times) / 1e9
            of_fma = f"{gflops / peak_gf:7.0%}" if peak_gf else "    n/a"
            of_int8 = f"{gflops / ipeak_g:8.0%}" if ipeak_g and dtype in ("int8", "int4") else "       -"
            rest = ", ".join(f"{k} {flop / statistics.median(t) / 1e9:.1f}" for k, t in other_times.items()) or "-"
            if "bf16 products" in other_times and bf16_peak:
                rest += f" ({flop / statistics.median(other_times['bf16 products']) / 1e9 / bf16_peak:.0%} of vdpbf16ps"
                amx = other_times.get("bf16 products on AMX tiles")
                rest += (
                    f"; on AMX {statistics.median(other_times['bf16 products']) / statistics.median(amx):.2f}x)"
                    if amx
                    else ")"
                )
            print(f"{dtype:>6} {layout:>10} {gflops:8.1f} {of_fma} {of_int8}  {rest}")


if __name__ == "__main__":
    main()
