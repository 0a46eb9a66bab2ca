#!/usr/bin/env python3
"""A model with trained routing at a realistic size: the bundled demo with its experts zero-padded.

Each expert's intermediate dimension grows from 320 to --ff: the gate and up projections get
rows of zeros and the down projection columns of zeros. A zero row gives gate = up = 0, so
silu(0) * 0 = 0 feeds a zero column of down: no output changes, the routers stay the trained
ones (the demo was trained on the King James Bible), and the experts grow to tens of MB each —
the shape of a model whose routing is skewed and predictable, as real routers are and random
weights are not. The result is written as a Hugging Face Mixtral checkpoint (float32
safetensors, the demo's tokenizer.model) and converted with `colibri convert --quantize Q`.

    python tools/bench/pad_experts.py --ff 49152 --out /work/bench_cache/demo-padded [--quantize int8]

The demo's int8 weights are dequantized once; the converter quantizes them again (the padded
blocks are zeros, the real ones round-trip to within a step).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

from colibri import quant
from colibri.convert import convert
from colibri.modeldir import MappedModelDir, ModelDir

DEMO = Path(__file__).resolve().parents[2] / "colibri" / "data" / "demo"


def dequantized(maps: MappedModelDir, md: ModelDir, name: str) -> np.ndarray:
    t = md.tensors[name]
    rows, cols = t["shape"] if len(t["shape"]) == 2 else (1, t["shape"][0])
    stored = maps.array(name)
    if t["dtype"] == "f32":
        return np.array(stored, np.float32).reshape(t["shape"])
    rowwise = quant.to_rows(stored, t["dtype"], rows, cols, t["layout"])
    return quant.dequantize(rowwise, t["dtype"], cols).reshape(rows, cols).astype(np.float32)


def write_hf(out: Path, ff: int) -> Path:
    from safetensors.numpy import save_file

    md = ModelDir(DEMO)
    c = md.config
    maps = MappedModelDir(md)
    hf = out / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    tensors = {
        "model.embed_tokens.weight": dequantized(maps, md, "embedding"),
        "model.norm.weight": dequantized(maps, md, "final_norm"),
    }
    names = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
    for layer in range(c.num_hidden_layers):
        p, q = f"layers.{layer}.", f"model.layers.{layer}."
        tensors[q + "input_layernorm.weight"] = dequantized(maps, md, p + "attn_norm")
        tensors[q + "post_attention_layernorm.weight"] = dequantized(maps, md, p + "ffn_norm")
        for ours, theirs in names.items():
            tensors[q + f"self_attn.{theirs}.weight"] = dequantized(maps, md, p + ours)
        tensors[q + "block_sparse_moe.gate.weight"] = dequantized(maps, md, p + "router")
        for e in range(c.num_experts):
            gate, up, down = (dequantized(maps, md, f"{p}experts.{e}.{k}") for k in ("gate", "up", "down"))
            pad = ff - gate.shape[0]
            x = f"{q}block_sparse_moe.experts.{e}."
            tensors[x + "w1.weight"] = np.pad(gate, ((0, pad), (0, 0)))
            tensors[x + "w3.weight"] = np.pad(up, ((0, pad), (0, 0)))
            tensors[x + "w2.weight"] = np.pad(down, ((0, 0), (0, pad)))
    maps.close()
    save_file(tensors, str(hf / "model.safetensors"))
    config = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": ff,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "num_local_experts": c.num_experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "torch_dtype": "float32",
    }
    (hf / "config.json").write_text(json.dumps(config, indent=1))
    shutil.copy(DEMO / "tokenizer.model", hf / "tokenizer.model")
    return hf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ff", type=int, default=49152, help="the padded intermediate size (a multiple of 32)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quantize", default="int8")
    args = ap.parse_args()
    hf = write_hf(args.out, args.ff)
    convert(hf, args.out / args.quantize, quantize=args.quantize, force=True)
    shutil.rmtree(hf)  # gigabytes of float32: the converted directory is what runs


if __name__ == "__main__":
    main()
