#!/usr/bin/env python3
"""Quality of every storage option on a held-out text: perplexity and divergence from f32.

Converts one Hugging Face checkpoint into each variant (f32, bf16, f16, int8, int4, f32 with
--ln-quant int16, int8 with --ln-quant int16) and runs `eval` on the text with the f32 directory
as the reference; bf16 both ways (exact f32 products, and bf16 products: the activations rounded
to bf16, where the CPU has vdpbf16ps); also the routing lookup table (exact_softmax=False)
against expf on f32.
Prints a markdown table.

    python tools/quality_table.py --hf-dir /work/demo_build/hf --text /work/demo_build/heldout.txt [--ctx 256]
    python tools/quality_table.py --hf-dir ... --text ... --roles     # int4 with other roles at int8
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import colibri
from colibri import _kernels
from colibri.convert import convert
from colibri.evaluate import evaluate

VARIANTS = [
    ("f32", "f32", None),
    ("bf16", "bf16", None),
    ("f16", "f16", None),
    ("int8", "int8", None),
    ("int4", "int4", None),
    ("nl4", "nl4", None),
    ("f32 + int16 norms", "f32", "int16"),
    ("int8 + int16 norms", "int8", "int16"),
]
BF16_PRODUCTS_VARIANT = "bf16, bf16 products (vdpbf16ps)"  # the bf16 directory, load(bf16_products="bf16")
# --role variants: (label, --quantize, {role: format}); the bytes column is then the bytes a decoded
# token reads (ModelDir.bytes_per_token), the figure decode speed follows
ROLE_VARIANTS = [
    ("int4", "int4", {}),
    ("int4, attention int8", "int4", {"attention": "int8"}),
    ("int4, head int8", "int4", {"head": "int8"}),
    ("int4, attention + head int8", "int4", {"attention": "int8", "head": "int8"}),
    ("nl4", "nl4", {}),
    ("nl4, attention + head int8", "nl4", {"attention": "int8", "head": "int8"}),
    ("int8, experts int4 (the embedding too at int8)", "int8", {"experts": "int4"}),
    ("int8", "int8", {}),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--max-chars", type=int, default=None, help="evaluate only the first N characters")
    ap.add_argument(
        "--roles",
        action="store_true",
        help="the --role variants instead (int4 experts with other roles at int8), with bytes per token",
    )
    args = ap.parse_args()
    if args.roles:
        return roles_table(args)
    text = Path(args.text).read_text(encoding="utf-8")
    if args.max_chars:
        text = text[: args.max_chars]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for label, q, ln in VARIANTS:
            d = Path(tmp) / label.replace(" ", "_").replace("+", "")
            convert(args.hf_dir, d, quantize=q, ln_quant=ln, log=lambda *a: None)
            dirs[label] = d
        ref = colibri.load(dirs["f32"])
        for label, _, _ in VARIANTS:
            r = evaluate(colibri.load(dirs[label], bf16_products="f32"), text, ctx=args.ctx, reference=ref)
            size = sum(p.stat().st_size for p in dirs[label].rglob("*.bin"))
            rows.append((label, size, r))
            if label == "bf16" and _kernels.has_bf16_products():
                r = evaluate(colibri.load(dirs[label], bf16_products="bf16"), text, ctx=args.ctx, reference=ref)
                rows.append((BF16_PRODUCTS_VARIANT, size, r))
        r = evaluate(colibri.load(dirs["f32"], exact_softmax=False), text, ctx=args.ctx, reference=ref)
        rows.append(("f32, routing table (--softmax-lut)", None, r))
    print(f"{rows[0][2]['scored']} scored tokens, ctx {args.ctx}\n")
    print("| variant | weights | perplexity | Δ ppl vs f32 | KL mean | KL p99 | top-1 agreement | RMS Δp |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base = rows[0][2]["perplexity"]
    for label, size, r in rows:
        mb = "" if size is None else f"{size / 1e6:.1f} MB"
        print(
            f"| {label} | {mb} | {r['perplexity']:.4f} | {r['perplexity'] - base:+.4f} | {r['kl_mean']:.6f} | "
            f"{r['kl_p99']:.6f} | {100 * r['top1_agreement']:.2f} % | {100 * r['rms_delta_p']:.3f} % |"
        )


def roles_table(args) -> None:
    from colibri.modeldir import ModelDir

    text = Path(args.text).read_text(encoding="utf-8")[: args.max_chars]
    with tempfile.TemporaryDirectory() as tmp:
        convert(args.hf_dir, Path(tmp) / "f32", quantize="f32", log=lambda *a: None)
        ref = colibri.load(Path(tmp) / "f32")
        print("| variant | read per token | KL mean | KL p99 | top-1 agreement | Δ ppl vs f32 |")
        print("|---|---:|---:|---:|---:|---:|")
        base = evaluate(ref, text, ctx=args.ctx)["perplexity"]
        for i, (label, q, roles) in enumerate(ROLE_VARIANTS):
            d = Path(tmp) / f"v{i}"
            convert(args.hf_dir, d, quantize=q, roles=roles, log=lambda *a: None)
            r = evaluate(colibri.load(d), text, ctx=args.ctx, reference=ref)
            per = sum(ModelDir(d).bytes_per_token().values())
            print(
                f"| {label} | {per / 1e6:.2f} MB | {r['kl_mean']:.6f} | {r['kl_p99']:.6f} | "
                f"{100 * r['top1_agreement']:.2f} % | {r['perplexity'] - base:+.4f} |"
            )


if __name__ == "__main__":
    main()
