#!/usr/bin/env python3
"""4-bit quality per byte, Colibri against llama.cpp, on one trained checkpoint and one text.

Both engines quantize the same Hugging Face checkpoint with an importance matrix from the same
calibration text, and each measures the KL divergence of its 4-bit model from its own full-
precision one on the same held-out chunks:

  Colibri     convert --quantize f32 / int4 / nl4 (and nl4 with --role ROLE=FORMAT mixes: int8 or int6
              attention and head);
              calibrate on the calibration text (the f32 conversion) for --importance, twice: the
              mean squares alone (--second-moments diag) and every matrix's whole second moment
              (--second-moments all: compensated rounding, colibri.gptq).
  llama.cpp   convert_hf_to_gguf.py --outtype f32; llama-imatrix on the calibration text;
              llama-quantize --imatrix to Q4_0, Q4_K_M and IQ4_XS; llama-perplexity
              --kl-divergence-base on f32, then --kl-divergence for each.

The chunks are llama-perplexity's: the text tokenized once with BOS in front, cut into
n = tokens / ctx chunks of ctx tokens, each chunk's first token replaced by BOS, and only the
second half of each chunk scored (logits at positions ctx/2 .. ctx-2). Colibri's KL is computed
here on exactly those positions. Both texts are made one line first (whitespace runs to one
space: sentencepiece's normalizer, which Colibri's tokenizer follows, turns a newline into a space;
llama.cpp's SPM tokenizer keeps it as a byte). The token ids are checked first: llama-tokenize's ids of the
text must be Colibri's tokenizer's (a unigram vocabulary such as the demo's fails this; train
with tools/train_demo.py --tokenizer bpe). "read per token" is the bytes a decoded token reads:
Colibri's ModelDir.bytes_per_token, and the same count over the GGUF's tensors (every tensor
once, a routed expert's top_k / n_experts, an untied token embedding one row).

    python tools/bench/quant_vs_llama.py --hf-dir /work/demo2_build/hf --text /work/demo2_build/heldout.txt \\
        --calib /work/demo_build/calib.txt --llama-bin /work/bench_cache/llama.cpp-build/bin --work /work/qvl [--ctx 256]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import colibri  # noqa: E402
from colibri.calibrate import calibrate, save  # noqa: E402
from colibri.convert import convert  # noqa: E402
from colibri.evaluate import log_softmax, read_text  # noqa: E402
from colibri.modeldir import ModelDir  # noqa: E402

LLAMA_CPP_DIR = Path(os.environ.get("LLAMA_CPP_DIR", "/work/bench_cache/llama_cpp_python-0.3.36/vendor/llama.cpp"))
# (label, llama-quantize type, its flags): --pure stores every matrix in the type (no 6-bit
# output tensor, no k-quant mixture): the counterpart of Colibri's plain int4
LLAMA_TYPES = [
    ("Q4_0 --pure", "Q4_0", ["--pure"]),
    ("Q4_0", "Q4_0", []),
    ("Q4_K_M", "Q4_K_M", []),
    ("IQ4_XS", "IQ4_XS", []),
]
# (label, format, roles, importance: None, "diag" (calibrate --second-moments diag: the mean squares)
# or "all" (every matrix's whole second moment: GPTQ-style compensated rounding, colibri.gptq))
COLIBRI_VARIANTS = [
    ("int4", "int4", {}, None),
    ("int4, importance", "int4", {}, "diag"),
    ("int4, second moments", "int4", {}, "all"),
    ("nl4", "nl4", {}, None),
    ("nl4, importance", "nl4", {}, "diag"),
    ("nl4, second moments", "nl4", {}, "all"),
    ("nl4, importance, attention + head int8", "nl4", {"attention": "int8", "head": "int8"}, "diag"),
    ("nl4, importance, attention + head int6", "nl4", {"attention": "int6", "head": "int6"}, "diag"),
    ("nl4, second moments, head int6", "nl4", {"head": "int6"}, "all"),
    ("nl4, second moments, attention + head int6", "nl4", {"attention": "int6", "head": "int6"}, "all"),
]


def sh(cmd, **kw):
    print("$", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True, **kw)


def llama_ids(bin_dir: Path, gguf: Path, text_path: Path) -> list:
    out = sh([bin_dir / "llama-tokenize", "-m", gguf, "-f", text_path, "--ids", "--log-disable"]).stdout
    return json.loads(out.strip().splitlines()[-1])


def chunks(ids: list, ctx: int, bos: int) -> list:
    """llama-perplexity's chunks of [BOS] + ids."""
    toks = [bos] + list(ids)
    out = []
    for i in range(len(toks) // ctx):
        c = toks[i * ctx : (i + 1) * ctx]
        c[0] = bos
        out.append(c)
    return out


def colibri_kl(model, ref, chunk_list, ctx: int) -> float:
    first = ctx // 2
    kls = []
    for c in chunk_list:
        lp = log_softmax(model.forward(c))[first : ctx - 1]
        lr = log_softmax(ref.forward(c))[first : ctx - 1]
        kls.append((np.exp(lr) * (lr - lp)).sum(-1))
    return float(np.concatenate(kls).mean())


def gguf_bytes_per_token(path: Path) -> float:
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    n_exp = int(r.fields[f"{arch}.expert_count"].parts[-1][0])
    top_k = int(r.fields[f"{arch}.expert_used_count"].parts[-1][0])
    names = {t.name for t in r.tensors}
    total = 0.0
    for t in r.tensors:
        n = int(t.n_bytes)
        if "_exps" in t.name:
            n *= top_k / n_exp
        elif t.name == "token_embd.weight" and "output.weight" in names:
            n /= int(t.shape[-1])  # an untied embedding: one row a token
        total += n
    return total


def llama_kl(bin_dir: Path, gguf: Path, text: Path, base: Path, ctx: int, threads: int) -> float:
    for _ in range(3):  # seen here: now and then a run ends without its statistics (exit 0)
        out = sh(
            [
                bin_dir / "llama-perplexity",
                "-m",
                gguf,
                "-f",
                text,
                "-c",
                ctx,
                "-b",
                ctx,
                "-t",
                threads,
                "--kl-divergence-base",
                base,
                "--kl-divergence",
            ]
        )
        m = re.search(r"Mean\s+KLD:\s+([0-9.eE+-]+)", out.stdout + out.stderr)
        if m:
            return float(m.group(1))
        print(f"no 'Mean KLD' in llama-perplexity's output; its last lines: {(out.stdout + out.stderr)[-400:]!r}")
    raise RuntimeError(f"no 'Mean KLD' in llama-perplexity's output for {gguf}, three times")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--text", required=True, help="the held-out text")
    ap.add_argument("--calib", required=True, help="the calibration text (disjoint from --text)")
    ap.add_argument("--llama-bin", required=True, help="llama.cpp's bin/ (tools/bench/build_llama.sh)")
    ap.add_argument("--work", required=True, help="a directory for the conversions")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--calib-tokens", type=int, default=40000)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    work, bin_dir, ctx = Path(args.work), Path(args.llama_bin), args.ctx
    work.mkdir(parents=True, exist_ok=True)
    # one line: sentencepiece's normalizer (Colibri's tokenizer, as transformers') turns a newline
    # into a space, llama.cpp's SPM tokenizer keeps it as a byte token
    text_path, calib_path = work / "text.txt", work / "calib.txt"
    text_path.write_text(" ".join(read_text(args.text).split()), encoding="utf-8")
    calib_path.write_text(" ".join(read_text(args.calib).split()), encoding="utf-8")

    # llama.cpp: f32 GGUF, importance matrix, quantizations
    f32_gguf = work / "f32.gguf"
    if not f32_gguf.exists():
        sh(
            [
                sys.executable,
                LLAMA_CPP_DIR / "convert_hf_to_gguf.py",
                args.hf_dir,
                "--outtype",
                "f32",
                "--outfile",
                f32_gguf,
            ]
        )
    imatrix = work / "imatrix.gguf"
    if not imatrix.exists():
        sh(
            [
                bin_dir / "llama-imatrix",
                "-m",
                f32_gguf,
                "-f",
                calib_path,
                "-o",
                imatrix,
                "-c",
                ctx,
                "-t",
                args.threads,
                "--chunks",
                max(1, args.calib_tokens // ctx),
            ]
        )
    ggufs = {}
    for label, qtype, flags in LLAMA_TYPES:
        q = work / (re.sub(r"[^A-Za-z0-9_]+", "-", label) + ".gguf")
        if not q.exists():
            sh([bin_dir / "llama-quantize", *flags, "--imatrix", imatrix, f32_gguf, q, qtype, args.threads])
        ggufs[label] = q

    # the same token ids
    model_f32_dir = work / "colibri-f32"
    if not model_f32_dir.exists():
        convert(args.hf_dir, model_f32_dir, quantize="f32", log=lambda *a: None)
    ref = colibri.load(model_f32_dir)
    text = read_text(text_path)
    ids = ref.tokenizer.encode(text, add_special_tokens=False)
    theirs = llama_ids(bin_dir, f32_gguf, text_path)
    if theirs[:1] == [ref.config.bos_token_id]:
        theirs = theirs[1:]
    same = theirs == list(ids)
    print(f"token ids: Colibri {len(ids)}, llama.cpp {len(theirs)}: {'the same' if same else 'DIFFERENT'}")
    if not same:
        print("the engines tokenize the text differently: the comparison would not be of the same positions")
        return 1
    chunk_list = chunks(ids, ctx, ref.config.bos_token_id)
    print(f"{len(chunk_list)} chunks of {ctx}, {len(chunk_list) * (ctx - 1 - ctx // 2)} scored positions")

    rows = []
    base = work / "f32.kld"
    sh(
        [
            bin_dir / "llama-perplexity",
            "-m",
            f32_gguf,
            "-f",
            text_path,
            "-c",
            ctx,
            "-b",
            ctx,
            "-t",
            args.threads,
            "--kl-divergence-base",
            base,
        ]
    )
    llama_f32_bytes = gguf_bytes_per_token(f32_gguf)
    q4_0 = None
    for qtype, q in ggufs.items():
        kl, b = llama_kl(bin_dir, q, text_path, base, ctx, args.threads), gguf_bytes_per_token(q)
        q4_0 = q4_0 or (kl, b)
        rows.append(("llama.cpp", f"{qtype}, imatrix", b, kl, kl / q4_0[0], b / q4_0[1]))
    # ratios: to each engine's plain 4-bit (llama.cpp's Q4_0 --pure, Colibri's int4)

    imp = {mode: work / f"importance-{mode}.npz" for mode in ("diag", "all")}
    for mode, path in imp.items():
        if not path.exists():
            save(
                calibrate(
                    model_f32_dir, read_text(calib_path), ctx=ctx, max_tokens=args.calib_tokens, second_moments=mode
                ),
                path,
            )
    int4_row = None
    for label, fmt, roles, imp_mode in COLIBRI_VARIANTS:
        d = work / ("colibri-" + re.sub(r"[^a-z0-9]+", "-", label))
        if not d.exists():
            convert(
                args.hf_dir,
                d,
                quantize=fmt,
                roles=roles,
                importance=imp[imp_mode] if imp_mode else None,
                log=lambda *a: None,
            )
        b = sum(ModelDir(d).bytes_per_token().values())
        kl = colibri_kl(colibri.load(d), ref, chunk_list, ctx)
        int4_row = int4_row or (kl, b)
        rows.append(("Colibri", label, b, kl, kl / int4_row[0], b / int4_row[1]))

    print(
        f"\nfull precision read per token: llama.cpp f32 {llama_f32_bytes:,.0f} B, "
        f"Colibri f32 {sum(ModelDir(model_f32_dir).bytes_per_token().values()):,.0f} B"
    )
    print("| engine | format | read per token | KL mean | KL / the engine's pure q4_0 | bytes / its pure q4_0 |")
    print("|---|---|---:|---:|---:|---:|")
    for eng, label, b, kl, rk, rb in rows:
        print(f"| {eng} | {label} | {b:,.0f} B | {kl:.6f} | {rk:.2f} | {rb:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
