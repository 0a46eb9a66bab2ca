#!/usr/bin/env python3
"""A make_models.py Mixtral checkpoint as llama.cpp's GGUF, without torch or llama.cpp's converter.

    python tools/bench/write_gguf.py HF_DIR OUT.gguf [--type bf16|q8_0|q4_0] [--check REF.gguf]

For a machine that has neither torch nor llama.cpp's sources (the lent AMX machine: amx_engine.py
--llama-bench / --ik-bench measure the peers there on GGUFs this writes). The tensors are what
convert_hf_to_gguf.py (--outtype bf16) and then `llama-quantize --pure` write for the same
checkpoint, bit for bit (the tensors; not their order in the file):
- llama.cpp's names for its `llama` architecture with merged experts (`blk.N.ffn_gate_exps`:
  [experts, ff, hidden] from the per-expert w1, w2 -> `ffn_down_exps`, w3 -> `ffn_up_exps`);
- the q and k projections' rows permuted per head ([heads, 2, head_dim / 2] -> [heads, head_dim /
  2, 2]) for GGML's adjacent-pair rotary embedding (the inverse of colibri/gguf_import.py's);
- norms and the router (`ffn_gate_inp`) f32, every other matrix (the embedding and the output head
  too) --type, quantized by the gguf package's reference code (`gguf.quants`: ggml's rounding); a
  matrix whose rows are not whole blocks f16, llama-quantize's fallback.
The metadata are the converter's keys for the model; the vocabulary is a stand-in of vocab_size
pieces (<unk>, <s>, </s>, the 256 byte pieces, then `▁tN`; cut short below 259 pieces): the checkpoints make_models.py writes
on such a machine have no tokenizer, and llama-bench never tokenizes text. --check compares every
tensor (name, type, shape, bytes) and the model's metadata (not the vocabulary's) with a reference GGUF made by llama.cpp's
own tools, and exits 1 on the first difference.

Needs numpy and the `gguf` package (an extra of colibri; a run on the lent machine puts a copy on
sys.path, see amx_engine.py). Reads the checkpoint with colibri's safetensors reader, one tensor at a
time; the GGUF is written to OUT.gguf.tmp and renamed when whole.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from colibri.hfcheckpoint import HFCheckpoint  # noqa: E402

# --type -> (the gguf type of the matrices, general.file_type as llama.cpp numbers it)
TYPES = {"f32": ("F32", 0), "bf16": ("BF16", 32), "q8_0": ("Q8_0", 7), "q4_0": ("Q4_0", 2)}
BYTE_PIECES = 256
BLOCK = 32  # weights a q8_0 / q4_0 block (rows of another length: f16, as llama-quantize does)


def permute_heads(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows [2, head_dim / 2] -> [head_dim / 2, 2]."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensors(ckpt: HFCheckpoint):
    """(gguf name, f32 values, quantizable), one at a time (a tied checkpoint has no output head:
    llama.cpp then reads token_embd, as the converter leaves it)."""
    cfg = ckpt.config
    heads, kv_heads, experts = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_local_experts"]
    yield "token_embd.weight", ckpt.f32("model.embed_tokens.weight"), True
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for hf, gg in (("w1", "ffn_gate_exps"), ("w2", "ffn_down_exps"), ("w3", "ffn_up_exps")):
            yield (
                b + gg + ".weight",
                np.stack([ckpt.f32(f"{p}block_sparse_moe.experts.{e}.{hf}.weight") for e in range(experts)]),
                True,
            )
        yield b + "ffn_gate_inp.weight", ckpt.f32(p + "block_sparse_moe.gate.weight"), False
        yield b + "attn_norm.weight", ckpt.f32(p + "input_layernorm.weight"), False
        yield b + "ffn_norm.weight", ckpt.f32(p + "post_attention_layernorm.weight"), False
        yield b + "attn_k.weight", permute_heads(ckpt.f32(p + "self_attn.k_proj.weight"), kv_heads), True
        yield b + "attn_output.weight", ckpt.f32(p + "self_attn.o_proj.weight"), True
        yield b + "attn_q.weight", permute_heads(ckpt.f32(p + "self_attn.q_proj.weight"), heads), True
        yield b + "attn_v.weight", ckpt.f32(p + "self_attn.v_proj.weight"), True
    yield "output_norm.weight", ckpt.f32("model.norm.weight"), False
    if not cfg.get("tie_word_embeddings"):
        yield "output.weight", ckpt.f32("lm_head.weight"), True


def stand_in_vocab(n: int) -> tuple:
    """(pieces, scores, token types) of an n-piece sentencepiece-style vocabulary."""
    import gguf

    tt = gguf.TokenType
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(BYTE_PIECES)]
    types = [tt.UNKNOWN, tt.CONTROL, tt.CONTROL] + [tt.BYTE] * BYTE_PIECES
    pieces += [f"\u2581t{i}" for i in range(n - len(pieces))]
    types += [tt.NORMAL] * (n - len(types))
    return pieces[:n], [0.0] * n, [int(t) for t in types[:n]]


def write(hf_dir: Path, out: Path, kind: str) -> None:
    import gguf

    ckpt = HFCheckpoint(hf_dir)
    cfg = ckpt.config
    if cfg.get("model_type") != "mixtral":
        sys.exit(f"write_gguf: {hf_dir}: model_type {cfg.get('model_type')!r}; only mixtral checkpoints are written")
    qtype, file_type = getattr(gguf.GGMLQuantizationType, TYPES[kind][0]), TYPES[kind][1]
    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_type("model")
    w.add_name(hf_dir.name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"] if "rope_parameters" in cfg else cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_file_type(file_type)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    pieces, scores, types = stand_in_vocab(cfg["vocab_size"])
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, values, quantizable in tensors(ckpt):
        if quantizable and kind != "f32" and (kind == "bf16" or values.shape[-1] % BLOCK == 0):
            # (the checkpoint is bf16: its values go through bf16 exactly as the converter's bf16 file)
            w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        elif quantizable and kind != "f32":  # llama-quantize's fallback for rows of part of a block
            w.add_tensor(
                name,
                gguf.quants.quantize(values, gguf.GGMLQuantizationType.F16),
                raw_dtype=gguf.GGMLQuantizationType.F16,
            )
        else:
            w.add_tensor(name, values.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)


def check(out: Path, ref: Path) -> int:
    """Every tensor and the model's metadata (not its name or vocabulary) of out against ref: 0 if
    they are the same, else 1 with a line naming the first difference."""
    import gguf

    a, b = gguf.GGUFReader(str(out)), gguf.GGUFReader(str(ref))
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    if set(ta) != set(tb):
        print(
            f"write_gguf --check: tensors differ: only here {sorted(set(ta) - set(tb))[:5]}, "
            f"only in {ref} {sorted(set(tb) - set(ta))[:5]}"
        )
        return 1
    for name, t in ta.items():
        u = tb[name]
        if (t.tensor_type, list(t.shape)) != (u.tensor_type, list(u.shape)):
            print(
                f"write_gguf --check: {name}: {t.tensor_type.name} {list(t.shape)} against "
                f"{u.tensor_type.name} {list(u.shape)}"
            )
            return 1
        if not np.array_equal(np.asarray(t.data).view(np.uint8), np.asarray(u.data).view(np.uint8)):
            print(f"write_gguf --check: {name}: the bytes differ")
            return 1
    skip = ("general.name", "general.basename", "general.size_label", "GGUF.", "tokenizer.")
    for key in sorted(set(a.fields) | set(b.fields)):
        if key.startswith(skip):
            continue
        ours, theirs = (r.fields[key].contents() if key in r.fields else "missing" for r in (a, b))
        if ours != theirs:
            print(f"write_gguf --check: metadata {key}: {ours} against {theirs}")
            return 1
    print(f"write_gguf --check: {len(ta)} tensors and the metadata equal {ref}'s")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("hf_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--type", choices=sorted(TYPES), default="q8_0")
    ap.add_argument("--check", type=Path, metavar="REF.gguf", help="compare with a GGUF llama.cpp's tools made")
    a = ap.parse_args(argv)
    write(a.hf_dir, a.out, a.type)
    print(f"write_gguf: {a.out} ({a.type}, {a.out.stat().st_size / 1e6:.1f} MB)")
    return check(a.out, a.check) if a.check else 0


if __name__ == "__main__":
    sys.exit(main())
