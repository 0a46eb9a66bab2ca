#!/usr/bin/env python3
"""Convert make_models.py's checkpoints for both engines, into /work/bench_cache.

    python tools/bench/convert_models.py mixtral-mini [olmoe-1b-7b] [--threads 1] [--force]

  Colibri:   python -m colibri convert --quantize bf16|int8|int4  ->  colibri/<model>-<fmt>/
  llama.cpp: gguf_convert.py (convert_hf_to_gguf.py) --outtype bf16  ->  gguf/<model>-bf16.gguf,
             then llama-quantize --pure to q8_0 and q4_0               ->  gguf/<model>-q8_0.gguf ...

Pairs: bf16 / bf16, int8 / q8_0, int4 / q4_0. Colibri's int8 and int4 are the same blocks as
ggml's q8_0 and q4_0 (32 weights with one f16 scale: 34 and 18 bytes), applied to every matrix
including the embedding and the output projection, with the routers and norms in f32.
llama-quantize's default recipe would instead keep output.weight in q6_K for q4_0; `--pure`
makes every matrix the named type, so both engines read the same bytes per token (run_bench.py
prints both files' active bytes). Existing outputs are kept unless --force. --drop-hf deletes
the Hugging Face checkpoint once every Colibri format and the bf16 GGUF exist (OLMoE-1B-7B in all
seven forms needs ~64 GB; deleting its 14 GB checkpoint before quantising keeps the peak lower).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("BENCH_CACHE", "/work/bench_cache"))
LLAMA_BIN = Path(
    os.environ.get("LLAMA_BIN", CACHE / "llama.cpp-build" / "bin")
)  # LLAMA_BIN=.../llama.cpp-build-avx2/bin: the AVX2-only build
PAIRS = (("bf16", "bf16"), ("int8", "q8_0"), ("int4", "q4_0"))
# gpt-oss in mxfp4 on both sides: Colibri's --quantize mxfp4 keeps the checkpoint's expert blocks
# and stores the rest bf16; convert_hf_to_gguf.py --outtype bf16 keeps them as MXFP4 and the rest bf16
# DeepSeek-V3-3l: int8 and int4 only (its bf16 forms would need 17 GB more disk); its bf16 GGUF is
# only the source of llama-quantize
# Qwen3-MoE-4l (the long-context shape): int4 / q4_0 only
PAIRS_OF = {
    "gpt-oss-20b-4l": (("mxfp4", "mxfp4"),),
    "deepseek-v3-3l": (("int8", "q8_0"), ("int4", "q4_0")),
    "qwen3-moe-4l": (("int4", "q4_0"),),
}
GGUF_SOURCE = {"gpt-oss-20b-4l": "mxfp4"}  # what convert_hf_to_gguf.py --outtype bf16 writes (default bf16)


def pairs_of(model: str) -> tuple:
    return PAIRS_OF.get(model, PAIRS)


def colibri_dir(model: str, fmt: str) -> Path:
    return CACHE / "colibri" / f"{model}-{fmt}"


def gguf_file(model: str, fmt: str) -> Path:
    return CACHE / "gguf" / f"{model}-{fmt}.gguf"


def run(cmd, threads: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    print("[convert] $ " + " ".join(map(str, cmd)), flush=True)
    t0 = time.perf_counter()
    subprocess.run([str(c) for c in cmd], check=True, env=env)
    print(f"[convert]   done in {time.perf_counter() - t0:.0f} s", flush=True)


def stale_layouts(out: Path, fmt: str) -> str:
    """The layouts of a cached Colibri directory's expert matrices, joined, when they are not the
    converter's default for `fmt` (a cache converted before the default changed); "" when current.
    Rows is allowed beside the default (a matrix that cannot be grouped stays rows), not instead."""
    from colibri.quant import default_layout

    tensors = json.loads((out / "config.json").read_text())["tensors"]
    found = {t.get("layout", "rows") for n, t in tensors.items() if ".experts." in n and len(t["shape"]) == 2}
    want = default_layout(fmt)
    current = found <= {want, "rows"} and (want in found or not found)
    return "" if current else " and ".join(sorted(found))


def convert(model: str, threads: int = 1, force: bool = False, engines=("colibri", "llama"), drop_hf=False) -> None:
    hf = CACHE / "hf" / model
    if not (hf / "config.json").is_file() and not (drop_hf and gguf_file(model, "bf16").is_file()):
        raise SystemExit(f"{hf} does not exist: run tools/bench/make_models.py {model}")
    pairs = pairs_of(model)
    if "colibri" in engines:
        for fmt, _ in pairs:
            out = colibri_dir(model, fmt)
            if (out / "config.json").is_file() and not force:
                stale = stale_layouts(out, fmt)
                if not stale:
                    print(f"[convert] {out} exists")
                    continue
                print(f"[convert] {out} exists with {stale} layouts, not today's default: relayout")
                tmp = out.with_name(out.name + ".relayout")
                run(
                    [sys.executable, "-m", "colibri", "relayout", "--model-dir", out, "--output-dir", tmp, "--force"],
                    threads,
                )
                shutil.rmtree(out)
                os.replace(tmp, out)
                continue
            run(
                [
                    sys.executable,
                    "-m",
                    "colibri",
                    "convert",
                    "--hf-dir",
                    hf,
                    "--output-dir",
                    out,
                    "--quantize",
                    fmt,
                    "--force",
                ],
                threads,
            )
    if "llama" in engines:
        gguf_file(model, "bf16").parent.mkdir(parents=True, exist_ok=True)
        bf16 = gguf_file(model, GGUF_SOURCE.get(model, "bf16"))  # the converter's output (bf16, + MXFP4 experts)
        if force or not bf16.is_file():
            tmp = bf16.with_suffix(".tmp")
            run([sys.executable, HERE / "gguf_convert.py", hf, "--outtype", "bf16", "--outfile", tmp], threads)
            os.replace(tmp, bf16)
    if drop_hf and hf.exists() and all(p.exists() for p in [colibri_dir(model, c) for c, _ in pairs] + [bf16]):
        print(f"[convert] removing {hf} (make_models.py remakes it identically)")
        shutil.rmtree(hf)
    if "llama" in engines:
        for _, fmt in pairs:
            out = gguf_file(model, fmt)
            if out == bf16:
                continue
            if out.is_file() and not force:
                print(f"[convert] {out} exists")
                continue
            tmp = out.with_suffix(".tmp")
            run([LLAMA_BIN / "llama-quantize", "--pure", bf16, tmp, fmt.upper(), threads], threads)
            os.replace(tmp, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="convert benchmark models for Colibri and llama.cpp")
    ap.add_argument("models", nargs="+")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--only", choices=("colibri", "llama"), help="convert for one engine only")
    ap.add_argument(
        "--drop-hf",
        action="store_true",
        help="delete the HF checkpoint once both engines' bf16 files exist (saves disk: OLMoE)",
    )
    a = ap.parse_args(argv)
    for m in a.models:
        convert(m, a.threads, a.force, (a.only,) if a.only else ("colibri", "llama"), a.drop_hf)
    return 0


if __name__ == "__main__":
    sys.exit(main())
