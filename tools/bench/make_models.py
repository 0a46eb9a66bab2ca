#!/usr/bin/env python3
"""Random-weight Hugging Face checkpoints in the shape of real MoE models, for benchmarks.

Design
------
* The model is never materialised: tensors are listed (name, shape) in the order and with the
  names transformers 5.x's `save_pretrained` writes (experts one by one: Mixtral
  `block_sparse_moe.experts.E.w1/w2/w3` = gate/down/up, OLMoE `mlp.experts.E.gate_proj/...`),
  then each tensor is drawn, rounded to bf16 and streamed into safetensors files that this
  script writes itself (8-byte header length, JSON header, raw little-endian data), sharded into
  files of at most 2 GB with a `model.safetensors.index.json`, as transformers shards.
* Weights ~ N(0, 0.02) from a generator seeded by (seed, tensor name), so a tensor's values do
  not depend on sharding or order; norm weights are 1. bf16 is rounded to nearest even.
* config.json is the transformers config class's own `to_json_string(use_diff=True)` with
  `architectures` and `dtype` set: byte for byte what `save_pretrained` writes (--self-check
  proves it, and the tensor names and shapes, against save_pretrained on a tiny model).
* tokenizer.model: a sentencepiece BPE model with exactly vocab_size pieces, trained in a few
  seconds on generated pseudo-words (<unk>=0, <s>=1, </s>=2, byte fallback). llama.cpp's
  convert_hf_to_gguf.py needs a tokenizer: for Mixtral (LlamaModel) it takes tokenizer.model
  (it would pad a smaller one with [PADn] pieces); OLMoE's converter only knows a BPE
  tokenizer.json whose pre-tokenizer checksum it recognises, which a synthetic tokenizer cannot
  have — gguf_convert.py in this folder tells it to use the tokenizer.model instead (llama-bench
  never tokenises text, so the vocabulary's kind does not affect the figures).

Usage:  python tools/bench/make_models.py mixtral-mini [olmoe-1b-7b] [--out /work/bench_cache/hf]
        python tools/bench/make_models.py --self-check
Needs numpy, sentencepiece and transformers (config classes; torch only for --self-check). Without
transformers, the shapes with a frozen config.json in tools/bench/configs (mixtral-mini,
qwen3-moe-4l, olmoe-1b-7b-8l: what transformers 5.25 wrote) are written from it, byte for byte the
same checkpoint; --no-tokenizer drops the sentencepiece tokenizer (e.g. on the lent device machine).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import struct
import sys
import time
import zlib
from pathlib import Path

import numpy as np

SHARD_BYTES = 2 * 10**9  # transformers' "2GB"
STD = 0.02
CHUNK = 1 << 24  # elements drawn at a time

MODELS = {
    "mixtral-mini": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            hidden_size=1024,
            num_hidden_layers=16,
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=3584,
            num_attention_heads=16,
            num_key_value_heads=4,
            vocab_size=32000,
            max_position_embeddings=4096,
        ),
    ),
    # the public allenai/OLMoE-1B-7B-0924 shape; the other fields are OlmoeConfig's defaults,
    # which are that model's (rope 1e4, no norm_topk_prob, eos 50279, ...)
    "olmoe-1b-7b": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(
            intermediate_size=1024,
            hidden_size=2048,
            num_hidden_layers=16,
            num_experts=64,
            num_experts_per_tok=8,
            num_attention_heads=16,
            num_key_value_heads=16,
            vocab_size=50304,
        ),
    ),
    # the same shape with 8 of its 16 layers (3.3 B parameters: its bf16 GGUF and Colibri directory fit
    # beside the other benchmark models on a 250 GB disk, the full one's six forms would not); the
    # output head is 16 % of a decoded token's weights instead of 9 % (issue 24's OLMoE rows)
    "olmoe-1b-7b-8l": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(
            intermediate_size=1024,
            hidden_size=2048,
            num_hidden_layers=8,
            num_experts=64,
            num_experts_per_tok=8,
            num_attention_heads=16,
            num_key_value_heads=16,
            vocab_size=50304,
        ),
    ),
    # the public google/gemma-4-26B-A4B text model (its text_config), as Gemma4ForCausalLM: 30 layers
    # (5 sliding-window : 1 full), 128 experts top-8 beside a dense MLP, full layers with
    # head_dim 512, 2 KV heads and k = v; no tokenizer (262144 pieces; benchmarks use token ids)
    "gemma4-26b-a4b": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(
            hidden_size=2816,
            num_hidden_layers=30,
            intermediate_size=2112,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            global_head_dim=512,
            num_global_key_value_heads=2,
            attention_k_eq_v=True,
            enable_moe_block=True,
            num_experts=128,
            top_k_experts=8,
            moe_intermediate_size=704,
            vocab_size=262144,
            sliding_window=1024,
            final_logit_softcapping=30.0,
            hidden_size_per_layer_input=0,
            max_position_embeddings=262144,
            eos_token_id=[1, 106],
        ),
    ),
    # the public openai/gpt-oss-20b shape (hidden 2880, 64 heads of 64 on 8 KV heads, 32 experts
    # top-4 of width 2880, vocab 201088, sliding window 128 on every other layer, YaRN), 4 of
    # its 24 layers; experts in the published MXFP4 layout (*_blocks / *_scales), the rest bf16
    "gpt-oss-20b-4l": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            num_hidden_layers=4,
            num_local_experts=32,
            vocab_size=201088,
            hidden_size=2880,
            intermediate_size=2880,
            head_dim=64,
            num_attention_heads=64,
            num_key_value_heads=8,
            sliding_window=128,
            num_experts_per_tok=4,
            eos_token_id=200002,
            pad_token_id=199999,
            max_position_embeddings=131072,
        ),
    ),
    # the public Qwen/Qwen3-30B-A3B shape (hidden 2048, 32 heads of 128 on 4 KV heads, q/k norms per
    # head, 128 experts top-8 of width 768, vocab 151936, rope 1e6, 40960 positions), 4 of its 48
    # layers: the long-context benchmarks' shape (issue 24)
    "qwen3-moe-4l": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            hidden_size=2048,
            num_hidden_layers=4,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            intermediate_size=6144,
            vocab_size=151936,
            max_position_embeddings=40960,
            norm_topk_prob=True,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
    # the public deepseek-ai/DeepSeek-V3 widths (hidden 7168, 128 heads, MLA q_lora 1536 / kv_lora 512,
    # nope 128 + rope 64, v 128, expert width 2048, dense width 18432, vocab 129280, YaRN x40),
    # scaled to fit: 3 layers (the first dense) of 16 experts top-8 in 8 groups (best 4), one shared
    "deepseek-v3-3l": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_hidden_layers=3,
            first_k_dense_replace=1,
            n_routed_experts=16,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            max_position_embeddings=163840,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 40.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096,
            },
        ),
    ),
}
NO_TOKENIZER = {
    "gemma4-26b-a4b",
    "gpt-oss-20b-4l",
    "deepseek-v3-3l",
    "qwen3-moe-4l",
}  # gguf_convert.py gives llama.cpp a vocabulary
TINY = {  # --self-check sizes
    "MixtralConfig": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
    ),
    "OlmoeConfig": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_experts=4,
        num_experts_per_tok=2,
        intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
    ),
    "DeepseekV3Config": dict(
        hidden_size=64,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        vocab_size=300,
    ),
    "Qwen3MoeConfig": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        intermediate_size=96,
        vocab_size=300,
        tie_word_embeddings=False,
    ),
    "Gemma4TextConfig": dict(
        hidden_size=64,
        num_hidden_layers=3,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        vocab_size=300,
        sliding_window=8,
        hidden_size_per_layer_input=0,
        layer_types=["sliding_attention", "full_attention", "full_attention"],
    ),
}


def make_config(cls_name: str, arch: str, kwargs: dict):
    import transformers

    cfg = getattr(transformers, cls_name)(**kwargs)
    cfg.architectures = [arch]
    cfg.dtype = "bfloat16"
    return cfg


# The config.json and generation_config.json transformers 5.25 wrote for some of the shapes above
# (NAME.json, NAME.generation_config.json), kept so that a machine without transformers (the lent
# device machine) can still write those checkpoints, the same bytes.
FROZEN_CONFIGS = Path(__file__).resolve().parent / "configs"


class FrozenConfig:
    """A frozen config.json read back: its fields as attributes (num_experts and num_local_experts
    as aliases of each other, as transformers' attribute maps have them); both files are written
    back verbatim."""

    def __init__(self, name: str):
        self.text = (FROZEN_CONFIGS / f"{name}.json").read_text()
        self.generation_text = (FROZEN_CONFIGS / f"{name}.generation_config.json").read_text()
        self.__dict__.update(json.loads(self.text))
        for a, b in (("num_experts", "num_local_experts"), ("num_local_experts", "num_experts")):
            if a not in self.__dict__ and b in self.__dict__:
                setattr(self, a, getattr(self, b))

    def to_json_string(self, use_diff: bool = True) -> str:
        return self.text


def config_for(name: str):
    """The model's config: transformers' own class, or without transformers the frozen one."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        if not (FROZEN_CONFIGS / f"{name}.json").is_file():
            raise SystemExit(f"{name} needs transformers (no frozen config in {FROZEN_CONFIGS})")
        return FrozenConfig(name)
    return make_config(*MODELS[name])


def generation_config_json(cfg) -> str:
    """generation_config.json: GenerationConfig.from_model_config's, or the frozen file."""
    if isinstance(cfg, FrozenConfig):
        return cfg.generation_text
    from transformers import GenerationConfig

    return GenerationConfig.from_model_config(cfg).to_json_string()


def gemma4_tensor_list(cfg) -> list:
    """Gemma4ForCausalLM with the MoE block: [(name, shape, is_one)]; 1-D weights (norms, router
    scales, layer_scalar) are 1."""
    d, V, E, mi, f = cfg.hidden_size, cfg.vocab_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.intermediate_size
    out = [("model.embed_tokens.weight", (V, d), False)]
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        hd, kvh = cfg.per_layer_config[i].head_dim, cfg.per_layer_config[i].num_key_value_heads
        q, kv = cfg.num_attention_heads * hd, kvh * hd
        out += [
            (p + "self_attn.q_proj.weight", (q, d), False),
            (p + "self_attn.q_norm.weight", (hd,), True),
            (p + "self_attn.k_proj.weight", (kv, d), False),
            (p + "self_attn.k_norm.weight", (hd,), True),
        ]
        if not (cfg.attention_k_eq_v and kind == "full_attention"):
            out.append((p + "self_attn.v_proj.weight", (kv, d), False))
        out += [
            (p + "self_attn.o_proj.weight", (d, q), False),
            (p + "mlp.gate_proj.weight", (f, d), False),
            (p + "mlp.up_proj.weight", (f, d), False),
            (p + "mlp.down_proj.weight", (d, f), False),
            (p + "router.proj.weight", (E, d), False),
            (p + "router.scale", (d,), True),
            (p + "router.per_expert_scale", (E,), True),
            (p + "experts.gate_up_proj", (E, 2 * mi, d), False),
            (p + "experts.down_proj", (E, d, mi), False),
            (p + "layer_scalar", (1,), True),
        ]
        out += [
            (p + n + ".weight", (d,), True)
            for n in (
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
                "post_feedforward_layernorm_1",
                "pre_feedforward_layernorm_2",
                "post_feedforward_layernorm_2",
            )
        ]
    return out + [("model.norm.weight", (d,), True)]


def gpt_oss_tensor_list(cfg) -> list:
    """GptOssForCausalLM as its published mxfp4 checkpoints name it: the experts' *_blocks (U8, random
    codes) and *_scales (U8, e8m0 near 2^-6: weights of about 0.02), every other tensor bf16."""
    d, V, E, f = cfg.hidden_size, cfg.vocab_size, cfg.num_local_experts, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    out = [("model.embed_tokens.weight", (V, d), False)]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (d,), True), (p + "post_attention_layernorm.weight", (d,), True)]
        for x, rows in (("q", q), ("k", kv), ("v", kv)):
            out += [
                (p + f"self_attn.{x}_proj.weight", (rows, d), False),
                (p + f"self_attn.{x}_proj.bias", (rows,), False),
            ]
        out += [
            (p + "self_attn.o_proj.weight", (d, q), False),
            (p + "self_attn.o_proj.bias", (d,), False),
            (p + "self_attn.sinks", (cfg.num_attention_heads,), False),
            (p + "mlp.router.weight", (E, d), False),
            (p + "mlp.router.bias", (E,), False),
        ]
        for proj, rows, cols in (("gate_up_proj", 2 * f, d), ("down_proj", d, f)):
            x = p + "mlp.experts." + proj
            out += [
                (x + "_blocks", (E, rows, cols // 32, 16), "blocks"),
                (x + "_scales", (E, rows, cols // 32), "scales"),
                (x + "_bias", (E, rows), False),
            ]
    return out + [("model.norm.weight", (d,), True), ("lm_head.weight", (V, d), False)]


def deepseek_v3_tensor_list(cfg) -> list:
    """DeepseekV3ForCausalLM as save_pretrained names it (experts one by one)."""
    d, V, E, H = cfg.hidden_size, cfg.vocab_size, cfg.n_routed_experts, cfg.num_attention_heads
    qk, R = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.kv_lora_rank
    out = [("model.embed_tokens.weight", (V, d), False)]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out += [
            (a + "q_a_proj.weight", (cfg.q_lora_rank, d), False),
            (a + "q_a_layernorm.weight", (cfg.q_lora_rank,), True),
            (a + "q_b_proj.weight", (H * qk, cfg.q_lora_rank), False),
            (a + "kv_a_proj_with_mqa.weight", (R + cfg.qk_rope_head_dim, d), False),
            (a + "kv_a_layernorm.weight", (R,), True),
            (a + "kv_b_proj.weight", (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), R), False),
            (a + "o_proj.weight", (d, H * cfg.v_head_dim), False),
        ]
        if i < cfg.first_k_dense_replace:
            f = cfg.intermediate_size
            out += [
                (p + "mlp.gate_proj.weight", (f, d), False),
                (p + "mlp.up_proj.weight", (f, d), False),
                (p + "mlp.down_proj.weight", (d, f), False),
            ]
        else:
            f, s = cfg.moe_intermediate_size, cfg.moe_intermediate_size * cfg.n_shared_experts
            out += [(p + "mlp.gate.weight", (E, d), False), (p + "mlp.gate.e_score_correction_bias", (E,), False)]
            for e in range(E):
                x = f"{p}mlp.experts.{e}."
                out += [
                    (x + "gate_proj.weight", (f, d), False),
                    (x + "up_proj.weight", (f, d), False),
                    (x + "down_proj.weight", (d, f), False),
                ]
            out += [
                (p + "mlp.shared_experts.gate_proj.weight", (s, d), False),
                (p + "mlp.shared_experts.up_proj.weight", (s, d), False),
                (p + "mlp.shared_experts.down_proj.weight", (d, s), False),
            ]
        out += [(p + "input_layernorm.weight", (d,), True), (p + "post_attention_layernorm.weight", (d,), True)]
    return out + [("model.norm.weight", (d,), True), ("lm_head.weight", (V, d), False)]


def tensor_list(cfg) -> list:
    """[(name, shape, kind)] in module order, named as save_pretrained names them; kind True: a
    norm weight (1), False: bf16 N(0, 0.02), "blocks" / "scales": mxfp4 bytes (U8)."""
    if cfg.model_type == "gemma4_text":
        return gemma4_tensor_list(cfg)
    if cfg.model_type == "gpt_oss":
        return gpt_oss_tensor_list(cfg)
    if cfg.model_type == "deepseek_v3":
        return deepseek_v3_tensor_list(cfg)
    d, L, V = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    hd = getattr(cfg, "head_dim", None) or d // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    qwen3 = cfg.model_type == "qwen3_moe"  # expert width apart, q/k norms per head
    f = cfg.moe_intermediate_size if qwen3 else cfg.intermediate_size
    mixtral = cfg.model_type == "mixtral"
    E = cfg.num_local_experts if mixtral else cfg.num_experts
    out = [("model.embed_tokens.weight", (V, d), False)]
    for i in range(L):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (q, d), False),
            (p + "self_attn.k_proj.weight", (kv, d), False),
            (p + "self_attn.v_proj.weight", (kv, d), False),
            (p + "self_attn.o_proj.weight", (d, q), False),
        ]
        if qwen3:
            out += [(p + "self_attn.q_norm.weight", (hd,), True), (p + "self_attn.k_norm.weight", (hd,), True)]
        elif not mixtral:  # OLMoE: RMSNorm over the whole projected q / k
            out += [(p + "self_attn.q_norm.weight", (q,), True), (p + "self_attn.k_norm.weight", (kv,), True)]
        moe = p + ("block_sparse_moe." if mixtral else "mlp.")
        out.append((moe + "gate.weight", (E, d), False))
        for e in range(E):
            x = f"{moe}experts.{e}."
            if mixtral:
                out += [
                    (x + "w1.weight", (f, d), False),
                    (x + "w2.weight", (d, f), False),
                    (x + "w3.weight", (f, d), False),
                ]
            else:
                out += [
                    (x + "gate_proj.weight", (f, d), False),
                    (x + "up_proj.weight", (f, d), False),
                    (x + "down_proj.weight", (d, f), False),
                ]
        out += [(p + "input_layernorm.weight", (d,), True), (p + "post_attention_layernorm.weight", (d,), True)]
    out += [("model.norm.weight", (d,), True)]
    if not cfg.tie_word_embeddings:
        out.append(("lm_head.weight", (V, d), False))
    return out


def element_bytes(kind) -> int:
    return 1 if kind in ("blocks", "scales") else 2


def bf16_values(name: str, shape, is_norm, seed: int):
    """Yield the tensor's bf16 bits (uint16 arrays) chunk by chunk (mxfp4 bytes for "blocks" /
    "scales": random codes, e8m0 scales 121 +- 1)."""
    n = int(np.prod(shape))
    if is_norm is True:
        yield np.full(n, 0x3F80, np.uint16)  # 1.0
        return
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if is_norm in ("blocks", "scales"):
        for start in range(0, n, CHUNK):
            k = min(CHUNK, n - start)
            yield (
                rng.integers(0, 256, k, dtype=np.uint8)
                if is_norm == "blocks"
                else rng.integers(120, 123, k, dtype=np.uint8)
            )
        return
    for start in range(0, n, CHUNK):
        x = rng.standard_normal(min(CHUNK, n - start), dtype=np.float32)
        x *= np.float32(STD)
        u = x.view(np.uint32)
        u += np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))  # round to nearest even
        yield (u >> np.uint32(16)).astype(np.uint16)


def plan_shards(tensors) -> list:
    shards, cur, size = [], [], 0
    for t in tensors:
        nb = int(np.prod(t[1])) * element_bytes(t[2])
        if cur and size + nb > SHARD_BYTES:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += nb
    shards.append(cur)
    return shards


def write_safetensors(path: Path, tensors, seed: int) -> None:
    header, off = {}, 0
    for name, shape, kind in tensors:
        nb = int(np.prod(shape)) * element_bytes(kind)
        header[name] = {
            "dtype": "U8" if element_bytes(kind) == 1 else "BF16",
            "shape": list(shape),
            "data_offsets": [off, off + nb],
        }
        off += nb
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for name, shape, is_norm in tensors:
            for chunk in bf16_values(name, shape, is_norm, seed):
                fh.write(chunk.tobytes() if chunk.dtype == np.uint8 else chunk.astype("<u2", copy=False).tobytes())


def train_tokenizer(vocab_size: int, seed: int = 0) -> bytes:
    """A sentencepiece BPE model with exactly vocab_size pieces, trained on pseudo-words."""
    import sentencepiece as spm

    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    n_words = max(4 * vocab_size, 60000)
    words = ["".join(rng.choice(letters, size=int(k))) for k in rng.integers(3, 11, size=n_words)]
    lines = [
        " ".join(words[j] for j in np.minimum(rng.zipf(1.1, size=12), n_words) - 1)
        for _ in range(max(vocab_size, 40000))
    ]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    if sp.vocab_size() != vocab_size:
        raise SystemExit(f"sentencepiece made {sp.vocab_size()} pieces, wanted {vocab_size}")
    return buf.getvalue()


def write_model(cfg, out: Path, seed: int = 0, tokenizer: bool = True) -> None:
    """Write the checkpoint into `out` (via a temporary sibling renamed into place)."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = tensor_list(cfg)
    shards = plan_shards(tensors)
    total = sum(int(np.prod(s)) * element_bytes(k) for _, s, k in tensors)
    print(
        f"[make_models] {out.name}: {len(tensors)} tensors, {total / 1e9:.2f} GB bf16, {len(shards)} shard(s)",
        flush=True,
    )
    if len(shards) == 1:
        write_safetensors(tmp / "model.safetensors", shards[0], seed)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            t0 = time.perf_counter()
            write_safetensors(tmp / fname, shard, seed)
            print(f"[make_models]   {fname} ({time.perf_counter() - t0:.0f} s)", flush=True)
            weight_map.update({name: fname for name, _, _ in shard})
        index = {"metadata": {"total_parameters": total // 2, "total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if cfg.model_type == "gpt_oss":  # as the published checkpoints say it
        cfg.quantization_config = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        }
    (tmp / "config.json").write_text(cfg.to_json_string(use_diff=True))
    (tmp / "generation_config.json").write_text(generation_config_json(cfg))
    if tokenizer:
        (tmp / "tokenizer.model").write_bytes(train_tokenizer(cfg.vocab_size))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def self_check() -> int:
    """Tiny models: our writer against transformers' save_pretrained (names, shapes, config)."""
    import tempfile
    import torch
    import transformers
    from safetensors import safe_open

    ok = True
    for cls_name, arch, _ in MODELS.values():
        if cls_name not in TINY:  # gpt-oss: the mxfp4 layout, which save_pretrained does not write
            continue
        cfg = make_config(cls_name, arch, TINY[cls_name])
        with tempfile.TemporaryDirectory() as d:
            ours, ref = Path(d) / "ours", Path(d) / "ref"
            write_model(cfg, ours, tokenizer=False)
            model = getattr(transformers, arch)(make_config(cls_name, arch, TINY[cls_name])).to(torch.bfloat16)
            model.save_pretrained(ref)

            def table(p):
                with safe_open(str(p / "model.safetensors"), "pt") as f:
                    return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}

            same_t = table(ours) == table(ref)
            same_c = (ours / "config.json").read_text() == (ref / "config.json").read_text()
            loaded, info = getattr(transformers, arch).from_pretrained(ours, output_loading_info=True)
            bad_keys = [k for v in info.values() for k in (v or [])]
            sd = loaded.state_dict()  # an expert weight as transformers sees it (stacked or not)
            probe = (
                "model.layers.1.self_attn." + ("q_a_proj" if cfg.model_type == "deepseek_v3" else "q_proj") + ".weight"
            )
            with safe_open(str(ours / "model.safetensors"), "pt") as f:
                q = f.get_tensor(probe)
            same_w = torch.equal(sd[probe], q)
            std = float(q.float().std())
            print(
                f"[self-check] {arch}: tensors {'==' if same_t else '!='} save_pretrained, "
                f"config.json {'==' if same_c else '!='}, from_pretrained problems {bad_keys or 'none'}, "
                f"weights {'==' if same_w else '!='} file, q_proj std {std:.4f}"
            )
            ok &= same_t and same_c and not bad_keys and same_w and abs(std - STD) < 0.005
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*", help=", ".join(MODELS))
    ap.add_argument("--out", default="/work/bench_cache/hf")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rewrite an existing checkpoint")
    ap.add_argument("--self-check", action="store_true")
    ap.add_argument(
        "--no-tokenizer",
        action="store_true",
        help="no tokenizer.model (needs no sentencepiece; Colibri's bench uses token ids)",
    )
    a = ap.parse_args(argv)
    if a.self_check:
        return self_check()
    if not a.models or set(a.models) - set(MODELS):
        ap.error(f"name models among {', '.join(MODELS)}, or pass --self-check")
    for name in a.models:
        out = Path(a.out) / name
        if (out / "config.json").is_file() and not a.force:
            print(f"[make_models] {out} exists (--force to rewrite)")
            continue
        t0 = time.perf_counter()
        write_model(config_for(name), out, seed=a.seed, tokenizer=name not in NO_TOKENIZER and not a.no_tokenizer)
        print(f"[make_models] wrote {out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
