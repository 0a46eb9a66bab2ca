#!/usr/bin/env python3
"""Generate tiny Hugging Face MoE checkpoints + reference outputs for Colibri's tests.

Design
------
* Every case is a *real* transformers model class (Mixtral, Qwen3-MoE, OLMoE,
  Qwen2-MoE) built from its config class with a handful of overrides, then
  re-initialised by THIS script from a seeded ``torch.Generator`` (we do not
  rely on transformers' init order):
      matrices (ndim >= 2, incl. embeddings, routers)  ~ N(0, init_std^2), init_std in 0.12..0.18
      1-D weights (all RMSNorms incl. q_norm/k_norm)  = 1 + 0.3 * N(0, 1)
      biases                                           = 0.1 * N(0, 1)
  so logits have spread and routing is decisive.
* References come from the in-memory model: eager attention, eager experts,
  float32, ``model.eval()``, ``torch.no_grad()``, one thread (byte-stable reruns).
    logits_f32   one forward over ``input_ids``
    logits_bf16  same forward after rounding every *matrix* weight (ndim >= 2) to
    logits_f16   bf16 / f16 and back, EXCEPT the MoE router (*TopKRouter.weight)
                 and Qwen2-MoE's ``shared_expert_gate.weight``; 1-D tensors stay f32.
                 (This is exactly what Colibri's converter stores in bf16/f16.)
    greedy_ids   12 new tokens from ``model.generate`` (greedy, EOS disabled),
                 cross-checked against the argmax of a full no-cache forward.
    router_margin  min over MoE layers/tokens of p_(k) - p_(k+1) (softmax probs),
                 over the f32 forward and the forward of input+greedy tokens.
    greedy_margin  min over the 12 greedy steps of logit(top1) - logit(top2),
                 over both generate()'s cached logits and the no-cache forward.
  If router margin (f32, greedy, bf16 and f16 forwards) < 1e-4 or greedy margin
  < 1e-3, the case's seed is bumped by 1 and the case regenerated; the seed
  actually used and the rejected ones are recorded in case.json.
* Storage variants: f32 single file (default), sharded (mixtral_b), stacked
  experts rewritten by hand (qwen3moe_b), bf16 / f16 checkpoints (olmoe_b /
  qwen2moe_b: the model is first rounded in full to that dtype, so the checkpoint
  is exactly the model that produced the references).
* Every checkpoint is re-loaded with ``from_pretrained(dtype=float32)`` and its
  logits compared against logits_f32 (result in case.json["reload_check"]).
* Output is deterministic: the .npz is written with fixed zip timestamps.

Layout: tests/fixtures/<case>/{hf/, reference.npz, case.json}; see
tests/fixtures/README.md.  Usage (from repo root):
    python tools/make_fixtures.py [--only CASE]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import shutil
import sys
import zipfile
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import transformers
from transformers import (
    Gemma4Config,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
    GenerationConfig,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "fixtures"
if str(REPO) not in sys.path:  # colibri.quant (the quantized references), run as a script
    sys.path.insert(1, str(REPO))

N_NEW = 12
MIN_ROUTER_MARGIN = 1e-4
MIN_GREEDY_MARGIN = 1e-3
MAX_ATTEMPTS = 50
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

# --------------------------------------------------------------------------- #
# Cases
# --------------------------------------------------------------------------- #
CASES: dict[str, dict] = {
    "mixtral_a": dict(
        arch="mixtral",
        config_cls=MixtralConfig,
        model_cls=MixtralForCausalLM,
        seed=1001,
        init_std=0.15,
        overrides=dict(
            vocab_size=128,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=48,
            tie_word_embeddings=False,
        ),
        storage="float32",
        layout="single",
        tokenizer=True,
        notes=[
            "untied",
            "sentencepiece BPE tokenizer.model (vocab 128) trained on the Gettysburg Address + "
            "Declaration of Independence opening; see case.json['tokenizer']",
        ],
    ),
    "mixtral_b": dict(
        arch="mixtral",
        config_cls=MixtralConfig,
        model_cls=MixtralForCausalLM,
        seed=2001,
        init_std=0.15,
        overrides=dict(
            vocab_size=160,
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=24,
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            sliding_window=8,
        ),
        storage="float32",
        layout="sharded",
        max_shard_size="200KB",
        notes=[
            "tied embeddings (no lm_head.weight in the checkpoint)",
            "head_dim=24 explicit (heads*head_dim=96 != hidden 64)",
            "sharded",
        ],
    ),
    "qwen3moe_a": dict(
        arch="qwen3_moe",
        config_cls=Qwen3MoeConfig,
        model_cls=Qwen3MoeForCausalLM,
        seed=3001,
        init_std=0.15,
        overrides=dict(
            vocab_size=256,
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            intermediate_size=80,
            mlp_only_layers=[1],
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
        storage="float32",
        layout="single",
        notes=["heads*head_dim=96 != hidden 64", "layer 1 dense (mlp_only_layers=[1])"],
    ),
    "qwen3moe_b": dict(
        arch="qwen3_moe",
        config_cls=Qwen3MoeConfig,
        model_cls=Qwen3MoeForCausalLM,
        seed=4001,
        init_std=0.15,
        overrides=dict(
            vocab_size=192,
            hidden_size=48,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            num_experts=4,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            intermediate_size=64,
            decoder_sparse_step=2,
            norm_topk_prob=False,
            attention_bias=True,
            tie_word_embeddings=False,
        ),
        storage="float32",
        layout="stacked",
        notes=[
            "decoder_sparse_step=2: MoE on layers 1,3, dense on 0,2",
            "attention_bias=True: q/k/v/o all have biases",
            "experts stacked: model.layers.L.mlp.experts.gate_up_proj [E, 2*I, H] (gate rows then up rows) "
            "and model.layers.L.mlp.experts.down_proj [E, H, I]",
        ],
    ),
    "qwen3moe_c": dict(
        arch="qwen3_moe",
        config_cls=Qwen3MoeConfig,
        model_cls=Qwen3MoeForCausalLM,
        seed=4101,
        init_std=0.15,
        overrides=dict(
            vocab_size=128,
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            tie_word_embeddings=False,
            max_position_embeddings=512,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 64,
            },
        ),
        storage="float32",
        layout="single",
        notes=[
            "YaRN RoPE: factor 8 over 64 original positions (blended frequencies, attention factor "
            "0.1 ln 8 + 1 on cos and sin)"
        ],
    ),
    "olmoe_a": dict(
        arch="olmoe",
        config_cls=OlmoeConfig,
        model_cls=OlmoeForCausalLM,
        seed=5001,
        init_std=0.15,
        overrides=dict(
            vocab_size=128,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            clip_qkv=None,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
        storage="float32",
        layout="single",
        notes=["q_norm over full q (hidden), k_norm over full k (kv_heads*head_dim), before the head split"],
    ),
    "olmoe_b": dict(
        arch="olmoe",
        config_cls=OlmoeConfig,
        model_cls=OlmoeForCausalLM,
        seed=6001,
        init_std=0.15,
        overrides=dict(
            vocab_size=200,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            clip_qkv=1.5,
            norm_topk_prob=True,
            tie_word_embeddings=True,
        ),
        storage="bfloat16",
        layout="single",
        notes=[
            "clip_qkv active (fraction clipped in case.json['clip_fraction'])",
            "tied embeddings",
            "checkpoint stored in bfloat16; ALL weights were rounded to bf16 before computing references, "
            "so logits_f32 = float32 forward of exactly the stored weights (logits_bf16 == logits_f32)",
        ],
    ),
    "qwen2moe_a": dict(
        arch="qwen2_moe",
        config_cls=Qwen2MoeConfig,
        model_cls=Qwen2MoeForCausalLM,
        seed=7001,
        init_std=0.15,
        overrides=dict(
            vocab_size=256,
            hidden_size=80,
            num_hidden_layers=4,
            num_attention_heads=5,
            num_key_value_heads=1,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=40,
            intermediate_size=96,
            decoder_sparse_step=2,
            qkv_bias=True,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
        storage="float32",
        layout="single",
        notes=[
            "decoder_sparse_step=2: MoE on layers 1,3, dense (intermediate 96) on 0,2",
            "shared expert (intermediate 40) gated by sigmoid(shared_expert_gate), gate kept f32 in bf16/f16 refs",
            "qkv_bias=True (o_proj has no bias)",
        ],
    ),
    "qwen2moe_b": dict(
        arch="qwen2_moe",
        config_cls=Qwen2MoeConfig,
        model_cls=Qwen2MoeForCausalLM,
        seed=8001,
        init_std=0.15,
        overrides=dict(
            vocab_size=144,
            hidden_size=96,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=4,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=48,
            intermediate_size=64,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            qkv_bias=True,
            norm_topk_prob=True,
            tie_word_embeddings=True,
        ),
        storage="float16",
        layout="single",
        notes=[
            "layer 0 dense (mlp_only_layers=[0]), layers 1,2 MoE",
            "tied embeddings",
            "checkpoint stored in float16; ALL weights were rounded to f16 before computing references, "
            "so logits_f32 = float32 forward of exactly the stored weights (logits_f16 == logits_f32)",
        ],
    ),
    "glm4moe_a": dict(
        arch="glm4_moe",
        config_cls=Glm4MoeConfig,
        model_cls=Glm4MoeForCausalLM,
        seed=9001,
        init_std=0.15,
        overrides=dict(
            vocab_size=160,
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            first_k_dense_replace=1,
            moe_intermediate_size=32,
            intermediate_size=64,
            n_shared_experts=1,
            attention_bias=True,
            use_qk_norm=True,
            norm_topk_prob=True,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        ),
        storage="float32",
        layout="single",
        quant_refs=("int8", "int4"),
        no_activation_flips=True,
        notes=[
            "sigmoid router + e_score_correction_bias (randomised) for the choice, 2 groups of 4, best 1 group",
            "routed_scaling_factor 1.5, norm_topk_prob",
            "layer 0 dense (first_k_dense_replace=1)",
            "one ungated shared expert",
            "partial rotary (half of head_dim 16)",
            "q/k/v biases, per-head q/k norms",
            "drawn so that rounding every matrix product's input but the router's as Colibri does (routed experts "
            "included) flips no expert choice of the int8 / int4 references",
        ],
    ),
    "glm4moe_b": dict(
        arch="glm4_moe",
        config_cls=Glm4MoeConfig,
        model_cls=Glm4MoeForCausalLM,
        seed=9101,
        init_std=0.15,
        overrides=dict(
            vocab_size=192,
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=24,
            n_routed_experts=4,
            num_experts_per_tok=3,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            first_k_dense_replace=0,
            moe_intermediate_size=16,
            intermediate_size=32,
            n_shared_experts=2,
            attention_bias=False,
            use_qk_norm=False,
            norm_topk_prob=False,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
        ),
        storage="bfloat16",
        layout="single",
        quant_refs=("int8", "int4"),
        notes=[
            "every layer MoE, one group, weights not renormalised",
            "two shared experts (intermediate 32)",
            "tied embeddings",
            "checkpoint stored in bfloat16 (references from exactly the stored weights)",
        ],
    ),
    "gpt_oss_a": dict(
        arch="gpt_oss",
        config_cls=GptOssConfig,
        model_cls=GptOssForCausalLM,
        seed=9474,
        init_std=0.15,
        overrides=dict(
            vocab_size=160,
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            sliding_window=6,
            swiglu_limit=1.5,
            swiglu_alpha=1.5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            max_position_embeddings=512,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        ),
        storage="float32",
        layout="single",
        quant_refs=("int8", "int4", "mxfp4"),
        min_router_margin=2e-3,
        max_attempts=400,  # no expert choice within reach of int8 activation rounding
        notes=[
            "attention sinks ~ N(0, 1.5^2) (they matter: see case.json['sinks_check'])",
            "sliding window 6 < T on layers 0 and 2, full attention on layer 1",
            "swiglu_limit 1.5, swiglu_alpha 1.5: the clamp is active (case.json['clamp_fraction'])",
            "router with a bias; experts stacked, gate/up interleaved, with biases (kept f32 in bf16/f16 refs)",
            "YaRN RoPE, factor 8 over 64 original positions, truncate false",
        ],
    ),
    "gpt_oss_b": dict(
        arch="gpt_oss",
        config_cls=GptOssConfig,
        model_cls=GptOssForCausalLM,
        seed=9301,
        init_std=0.15,
        overrides=dict(
            vocab_size=192,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=1,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=3,
            intermediate_size=64,
            sliding_window=5,
            swiglu_limit=2.0,
            layer_types=["full_attention", "sliding_attention"],
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
            },
        ),
        storage="bfloat16",
        layout="mxfp4",
        notes=[
            "experts in the published MXFP4 layout: mlp.experts.{gate_up,down}_proj_{blocks,scales} "
            "(config quantization_config.quant_method mxfp4); every other tensor bf16",
            "the model's experts were rounded to mxfp4 first, so logits_f32 is the float32 forward of "
            "exactly the stored weights (transformers dequantizes the checkpoint to those)",
            "gpt-oss-20b's RoPE (YaRN 32 over 4096, theta 150000), 8 heads of 8 on one KV head",
        ],
    ),
    "deepseekv3_a": dict(
        arch="deepseek_v3",
        config_cls=DeepseekV3Config,
        model_cls=DeepseekV3ForCausalLM,
        seed=9401,
        init_std=0.15,
        overrides=dict(
            vocab_size=160,
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=24,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            moe_intermediate_size=32,
            intermediate_size=64,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_interleave=True,
            max_position_embeddings=512,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 64,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
        ),
        storage="float32",
        layout="single",
        quant_refs=("int8", "int4"),
        no_activation_flips=True,
        max_attempts=200,
        notes=[
            "multi-head latent attention: q_lora_rank 48 (q_a_proj, q_a_layernorm, q_b_proj), kv_lora_rank 32, "
            "qk_nope 16 + qk_rope 8, v_head_dim 24 (!= nope), interleaved RoPE pairs",
            "YaRN x8 with mscale = mscale_all_dim = 1: the softmax scale is qk_head_dim^-0.5 * mscale^2",
            "sigmoid router + e_score_correction_bias, 4 groups of 2, best 2 groups, routed_scaling 2.5",
            "layer 0 dense (first_k_dense_replace 1), one shared expert",
        ],
    ),
    "deepseekv3_b": dict(
        arch="deepseek_v3",
        config_cls=DeepseekV3Config,
        model_cls=DeepseekV3ForCausalLM,
        seed=9501,
        init_std=0.15,
        overrides=dict(
            vocab_size=192,
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=6,
            q_lora_rank=None,
            kv_lora_rank=64,
            qk_nope_head_dim=8,
            qk_rope_head_dim=16,
            v_head_dim=8,
            n_routed_experts=4,
            num_experts_per_tok=3,
            n_group=1,
            topk_group=1,
            n_shared_experts=2,
            moe_intermediate_size=16,
            intermediate_size=32,
            first_k_dense_replace=0,
            routed_scaling_factor=1.0,
            norm_topk_prob=False,
            rope_interleave=False,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        storage="bfloat16",
        layout="single",
        notes=[
            "MLA without the q low-rank (q_proj), kv_lora_rank 64, nope 8 + rope 16, v 8, plain RoPE pairs",
            "every layer MoE, one group, weights not renormalised, two shared experts, tied embeddings",
            "checkpoint stored in bfloat16 (references from exactly the stored weights)",
        ],
    ),
}

# Gemma 4 with its MoE block (enable_moe_block=True): sliding and full layers, the full ones with
# their own head_dim / key-value heads / proportional RoPE, contexts longer than the window.
GEMMA4_A_TEXT = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=48,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    enable_moe_block=True,
    num_experts=8,
    top_k_experts=2,
    moe_intermediate_size=32,
    hidden_size_per_layer_input=0,
    sliding_window=8,
    final_logit_softcapping=3.0,
    tie_word_embeddings=True,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"],
)
GEMMA4_B_TEXT = dict(
    vocab_size=192,
    hidden_size=48,
    intermediate_size=40,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    global_head_dim=24,
    attention_k_eq_v=False,
    enable_moe_block=True,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=32,
    hidden_size_per_layer_input=0,
    sliding_window=6,
    final_logit_softcapping=None,
    tie_word_embeddings=True,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1000000.0},
    },
)
GEMMA4_B_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    position_embedding_size=64,
)


def gemma4_multimodal_config(**kw):
    """Gemma4Config with a tiny vision tower (no audio): the text part gets the special tokens."""
    text = {**kw.pop("text_config"), **{k: kw[k] for k in SPECIAL}, "initializer_range": kw["initializer_range"]}
    return Gemma4Config(
        text_config=text,
        vision_config=kw.pop("vision_config"),
        audio_config=None,
        tie_word_embeddings=True,
        initializer_range=kw["initializer_range"],
    )


CASES.update(
    {
        "gemma4_a": dict(
            arch="gemma4",
            config_cls=Gemma4TextConfig,
            model_cls=Gemma4ForCausalLM,
            seed=9001,
            init_std=0.15,
            overrides=GEMMA4_A_TEXT,
            storage="float32",
            layout="single",
            notes=[
                "Gemma4ForCausalLM, enable_moe_block: dense MLP + 8 experts top-2 in parallel in every layer",
                "layers S S F S F: sliding window 8 (T > 8) with head_dim 16, 2 KV heads, RoPE theta 1e4; "
                "full layers head_dim 32, 1 KV head, attention_k_eq_v (no v_proj), proportional RoPE 0.25",
                "final_logit_softcapping=3.0; router.scale, per_expert_scale, layer_scalar randomised",
            ],
        ),
        "gemma4_b": dict(
            arch="gemma4",
            config_cls=gemma4_multimodal_config,
            model_cls=Gemma4ForConditionalGeneration,
            seed=9101,
            init_std=0.15,
            overrides=dict(text_config=GEMMA4_B_TEXT, vision_config=GEMMA4_B_VISION),
            storage="bfloat16",
            layout="single",
            quant_refs=True,
            notes=[
                "Gemma4ForConditionalGeneration with a 1-layer vision tower: the converter takes the text model",
                "layers S F S F: window 6, full layers head_dim 24 with proportional RoPE 0.5, v_proj kept",
                "checkpoint stored in bfloat16; ALL weights (and layer_scalar buffers) were rounded to bf16 "
                "before computing references, so logits_f32 = float32 forward of exactly the stored weights",
                "logits_int8w / logits_int4w: transformers on the weights Colibri's int8 / int4 store (colibri.quant "
                "round trip of every text matrix except the router; f16 where columns are not a multiple of 32)",
            ],
        ),
    }
)

# Public-domain text for the tokenizer (Gettysburg Address, Declaration of Independence opening).
TOKENIZER_TEXT = """\
Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in Liberty, \
and dedicated to the proposition that all men are created equal.
Now we are engaged in a great civil war, testing whether that nation, or any nation so conceived and so dedicated, \
can long endure. We are met on a great battle-field of that war. We have come to dedicate a portion of that field, \
as a final resting place for those who here gave their lives that that nation might live. It is altogether fitting \
and proper that we should do this.
But, in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow -- this ground. The brave \
men, living and dead, who struggled here, have consecrated it, far above our poor power to add or detract. The world \
will little note, nor long remember what we say here, but it can never forget what they did here. It is for us the \
living, rather, to be dedicated here to the unfinished work which they who fought here have thus far so nobly \
advanced. It is rather for us to be here dedicated to the great task remaining before us -- that from these honored \
dead we take increased devotion to that cause for which they gave the last full measure of devotion -- that we here \
highly resolve that these dead shall not have died in vain -- that this nation, under God, shall have a new birth of \
freedom -- and that government of the people, by the people, for the people, shall not perish from the earth.
When in the Course of human events, it becomes necessary for one people to dissolve the political bands which have \
connected them with another, and to assume among the powers of the earth, the separate and equal station to which \
the Laws of Nature and of Nature's God entitle them, a decent respect to the opinions of mankind requires that they \
should declare the causes which impel them to the separation.
We hold these truths to be self-evident, that all men are created equal, that they are endowed by their Creator with \
certain unalienable Rights, that among these are Life, Liberty and the pursuit of Happiness.
"""
TOKENIZER_SAMPLES = [
    "We hold these truths to be self-evident.",
    "  the people,  by the people ",
    "Zebra #42 quietly!",  # Z, #, 4, 2, q, ! never occur in training text -> <unk>
]


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #
def save_npz_deterministic(path: Path, **arrays: np.ndarray) -> None:
    """np.savez_compressed equivalent with fixed zip timestamps (byte-stable)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(arrays):
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asarray(arrays[name]), allow_pickle=False)
            zf.writestr(info, buf.getvalue())


def router_param_names(model) -> set[str]:
    """Names of params kept in f32 by the converter: *TopKRouter weights and shared_expert_gate."""
    names = set()
    for mname, mod in model.named_modules():
        if type(mod).__name__.lower().endswith("topkrouter"):  # TopKRouter; GLM's Glm4MoeTopkRouter
            names.update(f"{mname}.{p}" for p, _ in mod.named_parameters(recurse=False))
        if type(mod).__name__ == "Gemma4TextRouter":
            names.update(f"{mname}.{p}" for p, _ in mod.named_parameters())
    for n, _ in model.named_parameters():
        if n.endswith(("shared_expert_gate.weight", "gate_up_proj_bias", "down_proj_bias")):
            names.add(n)  # (gpt-oss's expert biases are [E, out]: vectors to the converter)
    for n, _ in model.named_buffers():
        if n.endswith("e_score_correction_bias"):
            names.add(n)
    return names


@torch.no_grad()
def randomise(model, gen: torch.Generator, std: float, spread: float = 0.3) -> None:
    for name, p in model.named_parameters():  # named_parameters() de-duplicates tied weights
        if name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith("self_attn.sinks"):  # gpt-oss: logits beside the scores, spread to matter
            p.copy_(1.5 * torch.randn(p.shape, generator=gen))
        elif p.ndim == 1:  # RMSNorm scales (and Gemma 4's router / per-expert scales)
            p.copy_(1.0 + spread * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(std * torch.randn(p.shape, generator=gen))
    for name, b in model.named_buffers():  # Gemma 4's per-layer residual multiplier (a buffer, saved)
        if name.endswith("layer_scalar"):
            b.copy_(1.0 + spread * torch.randn(b.shape, generator=gen))
        if name.endswith("e_score_correction_bias"):  # GLM-4.5 / DeepSeek-V3: chooses, never weighs
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))


@torch.no_grad()
def rounded_copy(model, dtype: torch.dtype, matrices_only: bool):
    m = copy.deepcopy(model)
    keep = router_param_names(m) if matrices_only else set()
    for name, p in m.named_parameters():
        if name in keep or (matrices_only and p.ndim < 2):
            continue
        p.copy_(p.to(dtype).to(torch.float32))
    if not matrices_only:
        for name, b in m.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(b.to(dtype).to(torch.float32))
    return m


@torch.no_grad()
def forward(model, ids: torch.Tensor):
    if is_gemma4(model):  # Gemma4TextRouter returns probabilities first: log turns them back
        probs, hooks = [], []  # into logits (up to a constant per token) for the margins
        for mod in model.modules():
            if type(mod).__name__ == "Gemma4TextRouter":
                hooks.append(mod.register_forward_hook(lambda _m, _i, out: probs.append(out[0].float())))
        out = model(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], use_cache=False)
        for h in hooks:
            h.remove()
        return out.logits[0].float(), [torch.log(p) for p in probs]
    out = model(
        input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], use_cache=False, output_router_logits=True
    )
    rl = out.router_logits or ()
    return out.logits[0].float(), [r.float() for r in rl]


def is_gemma4(model) -> bool:
    return model.config.model_type in ("gemma4", "gemma4_text")


def text_config(model):
    return model.config.get_text_config()


def decoder_layers(model):
    return model.model.language_model.layers if hasattr(model.model, "language_model") else model.model.layers


def experts_per_token(model) -> int:
    c = text_config(model)
    return c.top_k_experts if is_gemma4(model) else c.num_experts_per_tok


def router_margin(router_logits, k: int) -> float:
    if not router_logits:
        return float("inf")
    m = float("inf")
    for rl in router_logits:
        p = torch.softmax(rl.double(), dim=-1)
        s = torch.sort(p, dim=-1, descending=True).values
        m = min(m, float((s[:, k - 1] - s[:, k]).min()))
    return m


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    t = torch.topk(logits.double(), 2, dim=-1).values
    return t[..., 0] - t[..., 1]


def moe_layer_indices(model) -> list[int]:
    return [
        i
        for i, layer in enumerate(decoder_layers(model))
        if hasattr(layer.mlp, "gate") or hasattr(layer.mlp, "router") or hasattr(layer, "router")
    ]


def build_model(spec: dict):
    cfg = spec["config_cls"](**{**spec["overrides"], **SPECIAL, "initializer_range": spec["init_std"]})
    model = spec["model_cls"](cfg)
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    model.eval()
    return model


def train_tokenizer(path: Path, vocab_size: int) -> dict:
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TOKENIZER_TEXT.splitlines()),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        normalization_rule_name="identity",
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        byte_fallback=False,
        pad_id=0,
        bos_id=1,
        eos_id=2,
        unk_id=3,
        num_threads=1,
        minloglevel=2,
    )
    path.write_bytes(buf.getvalue())
    sp = spm.SentencePieceProcessor(model_file=str(path))
    assert sp.vocab_size() == vocab_size, sp.vocab_size()
    assert (sp.pad_id(), sp.bos_id(), sp.eos_id(), sp.unk_id()) == (0, 1, 2, 3)
    return dict(
        file="hf/tokenizer.model",
        type="sentencepiece BPE",
        vocab_size=sp.vocab_size(),
        trainer=dict(
            model_type="bpe",
            normalization_rule_name="identity",
            add_dummy_prefix=True,
            remove_extra_whitespaces=False,
            byte_fallback=False,
            pad_id=0,
            bos_id=1,
            eos_id=2,
            unk_id=3,
        ),
        samples=[dict(text=t, ids=sp.encode(t), pieces=sp.encode(t, out_type=str)) for t in TOKENIZER_SAMPLES],
    )


def stack_experts(hf_dir: Path, model) -> list[str]:
    """Rewrite model.safetensors with per-layer stacked expert tensors (transformers 5.x in-memory layout)."""
    f32 = hf_dir / "model.safetensors"
    with safe_open(f32, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    new_names = []
    for L in moe_layer_indices(model):
        pre = f"model.layers.{L}.mlp.experts"
        E = model.model.layers[L].mlp.experts.num_experts
        gate = [tensors.pop(f"{pre}.{e}.gate_proj.weight") for e in range(E)]
        up = [tensors.pop(f"{pre}.{e}.up_proj.weight") for e in range(E)]
        down = [tensors.pop(f"{pre}.{e}.down_proj.weight") for e in range(E)]
        gu = torch.stack([torch.cat([g, u], 0) for g, u in zip(gate, up)]).contiguous()
        dn = torch.stack(down).contiguous()
        assert torch.equal(gu, model.model.layers[L].mlp.experts.gate_up_proj.detach())
        assert torch.equal(dn, model.model.layers[L].mlp.experts.down_proj.detach())
        tensors[f"{pre}.gate_up_proj"] = gu
        tensors[f"{pre}.down_proj"] = dn
        new_names += [f"{pre}.gate_up_proj", f"{pre}.down_proj"]
    assert not any(".experts." in k and k.split(".experts.")[1][0].isdigit() for k in tensors)
    save_file(tensors, str(f32), metadata=meta or {"format": "pt"})
    return new_names


def tensor_manifest(hf_dir: Path) -> dict:
    out = {}
    for st in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(st, "pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                out[k] = [list(sl.get_shape()), sl.get_dtype(), st.name]
    return dict(sorted(out.items()))


def summarise_names(names) -> list[str]:
    """Collapse layer/expert indices: model.layers.{L}.mlp.experts.{E}.w1.weight."""
    import re

    pats = sorted(
        {re.sub(r"\.experts\.\d+\.", ".experts.{E}.", re.sub(r"\.layers\.\d+\.", ".layers.{L}.", n)) for n in names}
    )
    return pats


# --------------------------------------------------------------------------- #
# Case generation
# --------------------------------------------------------------------------- #
def attempt(spec: dict, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = build_model(spec)
    randomise(model, gen, spec["init_std"], spec.get("norm_spread", 0.3))
    k = experts_per_token(model)
    V = text_config(model).vocab_size

    if spec["layout"] == "mxfp4":  # the experts as the mxfp4 checkpoint will hold them
        mxfp4_round_experts(model)
    storage = spec["storage"]
    if storage != "float32":  # the checkpoint dtype is the truth: round ALL weights first
        model = rounded_copy(model, getattr(torch, storage), matrices_only=False)
        model.eval()

    T = int(torch.randint(20, 29, (1,), generator=gen))
    ids = torch.randint(0, V, (T,), generator=gen, dtype=torch.int64)

    logits, rl = forward(model, ids)
    res = dict(model=model, ids=ids, logits=logits, router_logits=rl)

    # greedy continuation (KV-cached generate) ...
    gc = GenerationConfig(
        do_sample=False,
        max_new_tokens=N_NEW,
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=1,
        num_beams=1,
        temperature=None,
        top_p=None,
        top_k=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    default_gc = model.generation_config  # restored so the saved generation_config.json stays pristine
    model.generation_config = gc  # so that no default (e.g. eos_token_id=2) is merged back in
    with torch.no_grad():
        g = model.generate(ids[None], attention_mask=torch.ones_like(ids)[None], generation_config=gc)
    model.generation_config = default_gc
    new = g.sequences[0, T:].clone()
    assert new.numel() == N_NEW, new.numel()
    gen_logits = torch.stack([s[0] for s in g.logits])  # [N, V]
    assert torch.equal(gen_logits.argmax(-1), new)
    # ... cross-checked with one no-cache forward over input+continuation
    full = torch.cat([ids, new])
    full_logits, full_rl = forward(model, full)
    step_logits = full_logits[T - 1 : T - 1 + N_NEW]
    assert torch.equal(step_logits.argmax(-1), new), "cached generate disagrees with full forward"
    res["greedy"] = new
    res["greedy_vs_full_maxdiff"] = float((gen_logits - step_logits).abs().max())
    res["greedy_margin"] = min(float(top2_gap(gen_logits).min()), float(top2_gap(step_logits).min()))
    res["router_margin"] = min(router_margin(rl, k), router_margin(full_rl, k))

    for name, dt in (("bf16", torch.bfloat16), ("f16", torch.float16)):
        mr = rounded_copy(model, dt, matrices_only=True)
        lg, rlr = forward(mr, ids)
        res[f"logits_{name}"] = lg
        res[f"router_margin_{name}"] = router_margin(rlr, k)
        res[f"maxdiff_{name}_vs_f32"] = float((lg - logits).abs().max())
        # tokens whose selected expert *set* differs from the f32 forward (legit; refs stay self-consistent)
        res[f"routing_flips_{name}"] = sum(
            int((torch.topk(a, k).indices.sort(-1).values != torch.topk(b, k).indices.sort(-1).values).any(-1).sum())
            for a, b in zip(rl, rlr)
        )
        del mr
    if spec.get("quant_refs"):
        res["router_margin_quant"] = float("inf")
        res["activation_rounding_flips"] = 0
        for dt in spec["quant_refs"] if isinstance(spec["quant_refs"], (list, tuple)) else ("int8", "int4"):
            mq = quantized_copy(model, dt)
            res[f"logits_{dt}w"], rlq = forward(mq, ids)
            res["router_margin_quant"] = min(res["router_margin_quant"], router_margin(rlq, k))
            if spec.get("no_activation_flips"):
                res["activation_rounding_flips"] += activation_rounding_flips(mq, ids, dt)
    return res


@torch.no_grad()
def routed_experts(model, ids) -> list:
    """The expert sets each MoE layer's router chose for each token: [layer][token] frozensets
    (the routers that return their choice: the TopK / Topk routers' third output)."""
    chosen, hooks = [], []
    for mod in model.modules():
        if type(mod).__name__.lower().endswith("topkrouter"):
            hooks.append(
                mod.register_forward_hook(lambda _m, _i, out: chosen.append([frozenset(r.tolist()) for r in out[2]]))
            )
    forward(model, ids)
    for h in hooks:
        h.remove()
    return chosen


def colibri_rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x as Colibri multiplies it against int8/int4/mxfp4 weights (quant.h cb_quantize_act_scalar):
    blocks of 32 along the last axis, d = amax / 127 (0 where amax < 1e-30), q = rint(x * (1 / d)) as int8,
    back to q * d. Inputs whose width is not a multiple of 32 are returned as they are (those
    matrices are stored f16: no rounding)."""
    if x.shape[-1] % 32:
        return x
    b = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    d = torch.where(amax >= 1e-30, amax / 127, torch.zeros_like(amax))
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
    q = torch.round(b * inv)
    return (q * d).reshape(x.shape).to(x.dtype)


class RoundedProductInputs(torch.overrides.TorchFunctionMode):
    """Under it, the first operand of every matrix product (F.linear, matmul, @, mm, bmm) is
    rounded by colibri_rounded_activations; `count` says how many were."""

    PRODUCTS = {
        torch.nn.functional.linear,
        torch.matmul,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.mm,
        torch.Tensor.mm,
        torch.bmm,
        torch.Tensor.bmm,
    }

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.PRODUCTS:
            self.count += 1
            args = (colibri_rounded_activations(args[0]),) + tuple(args[1:])
        return func(*args, **(kwargs or {}))


def routed_expert_modules(model) -> list:
    """The modules that hold routed experts as 3-D parameters ([E, ., .]: transformers 5.x's
    stacked experts, applied by their own forward with F.linear or @, not through nn.Linear)."""
    return [mod for mod in model.modules() if any(p.ndim == 3 for p in mod.parameters(recurse=False))]


@contextlib.contextmanager
def colibri_activation_rounding(model, dtype: str):
    """Within it, the input of every matrix product that Colibri runs against `dtype` weights is
    rounded as Colibri rounds it (colibri_rounded_activations). int8 / int4: every nn.Linear's but
    the routers' (and shared_expert_gate's, both kept f32) and kv_b_proj's (f16 in the converter),
    and every routed expert's (gate/up and down of the stacked 3-D experts, which transformers
    applies with F.linear or @ in the experts' own forward, not through nn.Linear); mxfp4: the
    routed experts' only (the other matrices are bf16: no rounding)."""

    def rounded(_m, args):
        return (colibri_rounded_activations(args[0]),) + tuple(args[1:])

    def rounded_forward(orig):
        def forward(*args, **kwargs):
            mode = RoundedProductInputs()
            with mode:
                out = orig(*args, **kwargs)
            assert mode.count > 0, "no routed expert product was rounded"
            return out

        return forward

    hooks = []
    if dtype != "mxfp4":
        hooks = [
            mod.register_forward_pre_hook(rounded)
            for name, mod in model.named_modules()
            if isinstance(mod, torch.nn.Linear) and "router" not in name and not name.endswith(("gate", "kv_b_proj"))
        ]
    experts = [(mod, mod.__dict__.get("forward")) for mod in routed_expert_modules(model)]
    for mod, _ in experts:
        mod.forward = rounded_forward(mod.forward)
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        for mod, own in experts:
            del mod.forward
            if own is not None:
                mod.forward = own


@torch.no_grad()
def activation_rounding_flips(model, ids, dtype: str) -> int:
    """How many (layer, token) expert choices change under colibri_activation_rounding(model, dtype):
    a fixture whose quantized references that rounding flips would hold Colibri to a different routing."""
    plain = routed_experts(model, ids)
    with colibri_activation_rounding(model, dtype):
        noisy = routed_experts(model, ids)
    return sum(a != b for la, lb in zip(plain, noisy) for a, b in zip(la, lb))


@torch.no_grad()
def mxfp4_round_experts(model) -> None:
    """gpt-oss's stacked experts ([E, in, out]) rounded in place to what mxfp4 blocks of 32 inputs
    hold (colibri.quant's mxfp4 quantizer: power-of-two scale, nearest e2m1 value)."""
    from colibri.quant import dequantize, quantize

    for layer in model.model.layers:
        for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
            for e in range(p.shape[0]):
                w = p[e].detach().numpy().T.astype(np.float32)  # [out, in]
                back = dequantize(quantize(np.ascontiguousarray(w), "mxfp4"), "mxfp4", w.shape[1])
                p[e].copy_(torch.from_numpy(np.ascontiguousarray(back.T)))


def write_mxfp4_experts(hf_dir: Path, model) -> list[str]:
    """Rewrite the saved checkpoint's stacked experts in the published mxfp4 layout: for
    gate_up_proj [E, D, 2F] and down_proj [E, F, D] ([in, out]), *_blocks uint8 [E, out, in / 32, 16]
    and *_scales uint8 [E, out, in / 32]; config.json gets quantization_config mxfp4."""
    from colibri.quant import quantize, to_mx

    path = hf_dir / "model.safetensors"
    with safe_open(path, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    written = []
    for i, layer in enumerate(model.model.layers):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            del tensors[name]
            w = getattr(layer.mlp.experts, proj).detach().float().numpy()  # [E, in, out]
            blocks, scales = [], []
            for e in range(w.shape[0]):
                b, s_ = to_mx(quantize(np.ascontiguousarray(w[e].T), "mxfp4"), w.shape[1])
                blocks.append(b)
                scales.append(s_)
            tensors[name + "_blocks"] = torch.from_numpy(np.stack(blocks))
            tensors[name + "_scales"] = torch.from_numpy(np.stack(scales))
            written += [name + "_blocks", name + "_scales"]
    save_file(tensors, path, metadata=metadata)
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (hf_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return written


@torch.no_grad()
def quantized_copy(model, dtype: str):
    """The model with every text-model matrix replaced by what `colibri convert --quantize dtype`
    stores (router kept f32, f16 where the columns are not a multiple of 32; towers untouched).
    mxfp4: the routed experts in mxfp4, the other matrices bf16 (convert.MXFP4_DENSE_DTYPE).
    gpt-oss's stacked experts are [E, in, out]: quantized per expert along `in`, as converted."""
    from colibri.quant import QBLOCK, dequantize, quantize

    def stored(w, fmt):  # [rows, cols] float32 -> what the format holds
        if fmt == "bf16":
            return torch.from_numpy(w).to(torch.bfloat16).float().numpy()
        if fmt == "f16":
            return w.astype(np.float16).astype(np.float32)
        if w.shape[1] % QBLOCK:
            return w.astype(np.float16).astype(np.float32)
        return dequantize(quantize(w, fmt), fmt, w.shape[1])

    m = copy.deepcopy(model)
    keep = router_param_names(m)
    for name, p in m.named_parameters():
        if p.ndim < 2 or name in keep or "vision" in name or "audio" in name:
            continue
        stacked = name.endswith(("experts.gate_up_proj", "experts.down_proj")) and p.ndim == 3
        expert = stacked or ".experts." in name
        fmt = dtype if dtype != "mxfp4" or expert else "bf16"
        if name.endswith("kv_b_proj.weight"):  # MLA's absorbed up-projections: f16 (convert.py)
            fmt = "f16"
        if stacked and m.config.model_type == "gpt_oss":
            q = np.stack(
                [
                    stored(np.ascontiguousarray(p[e].detach().numpy().T.astype(np.float32)), fmt).T
                    for e in range(p.shape[0])
                ]
            )
        else:
            w = p.detach().numpy().astype(np.float32).reshape(-1, p.shape[-1])
            q = stored(w, fmt)
        p.copy_(torch.from_numpy(np.ascontiguousarray(q).reshape(p.shape)))
    return m


def clip_fraction(model, ids) -> dict:
    clip = model.config.clip_qkv
    counts = {"q": [0, 0], "k": [0, 0], "v": [0, 0]}
    hooks = []
    for layer in model.model.layers:
        a = layer.self_attn
        for key, mod in (("q", a.q_norm), ("k", a.k_norm), ("v", a.v_proj)):

            def h(_m, _i, out, key=key):
                counts[key][0] += int((out.abs() > clip).sum())
                counts[key][1] += out.numel()

            hooks.append(mod.register_forward_hook(h))
    forward(model, ids)
    for h in hooks:
        h.remove()
    return {key: round(c / n, 4) for key, (c, n) in counts.items()}


def sliding_window_check(model, ids, logits) -> dict:
    W = model.config.sliding_window
    with torch.no_grad():
        out = model(input_ids=ids[None], use_cache=False, output_attentions=True)
    att = out.attentions[0][0]  # [H, T, T]
    T = ids.numel()
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    allowed = (j <= i) & (j > i - W)
    honoured = bool((att[:, ~allowed] == 0).all() and (att[:, allowed] > 0).all())
    nowin = copy.deepcopy(model)
    nowin.config.sliding_window = None
    lg_nowin, _ = forward(nowin, ids)
    d = (lg_nowin - logits).abs().amax(-1)
    assert honoured, "eager attention ignored sliding_window"
    assert float(d[:W].max()) < 1e-4 and float(d[W:].max()) > 1e-2, d
    return dict(
        honoured_by_eager=honoured,
        semantics=f"query i attends keys j with i-{W} < j <= i (the last {W} positions incl. itself)",
        max_logit_change_without_window_positions_lt_W=float(d[:W].max()),  # float noise only (~1e-6)
        max_logit_change_without_window_positions_ge_W=float(d[W:].max()),
    )


@torch.no_grad()
def gpt_oss_checks(model, ids, logits) -> dict:
    """That the distinctive parts matter here: logits without sinks differ; the clamp is hit."""
    nosink = copy.deepcopy(model)
    for layer in nosink.model.layers:
        layer.self_attn.sinks.fill_(-1e4)
    d = float((forward(nosink, ids)[0] - logits).abs().max())
    assert d > 1e-2, d
    hits = [0, 0]
    hooks = []
    for layer in model.model.layers:

        def h(mod, inp, out):
            x, idx = inp[0], inp[1]
            for e in range(mod.num_experts):
                rows = (idx == e).any(-1)
                if rows.any():
                    gu = x[rows] @ mod.gate_up_proj[e] + mod.gate_up_proj_bias[e]
                    hits[0] += int((gu[..., ::2] > mod.limit).sum() + (gu[..., 1::2].abs() > mod.limit).sum())
                    hits[1] += gu.numel()

        hooks.append(layer.mlp.experts.register_forward_hook(h))
    forward(model, ids)
    for hk in hooks:
        hk.remove()
    assert hits[0] > 0, hits
    return dict(sinks_check=dict(max_logit_change_without_sinks=d), clamp_fraction=round(hits[0] / hits[1], 4))


def make_case(name: str) -> dict:
    spec = CASES[name]
    case_dir = OUT / name
    rejected = []
    seed = spec["seed"]
    for _ in range(spec.get("max_attempts", MAX_ATTEMPTS)):
        res = attempt(spec, seed)
        rm = min(res["router_margin"], res["router_margin_bf16"], res["router_margin_f16"])
        if "min_router_margin" in spec:  # the quantized references' routing must be as clear
            rm = min(rm, res.get("router_margin_quant", rm))
        if res.get("activation_rounding_flips"):
            rm = 0.0
        if rm >= spec.get("min_router_margin", MIN_ROUTER_MARGIN) and res["greedy_margin"] >= MIN_GREEDY_MARGIN:
            break
        rejected.append(dict(seed=seed, router_margin=rm, greedy_margin=res["greedy_margin"]))
        seed += 1
    else:
        raise RuntimeError(f"{name}: no acceptable seed in {spec.get('max_attempts', MAX_ATTEMPTS)} attempts")

    model, ids = res["model"], res["ids"]
    if case_dir.exists():
        shutil.rmtree(case_dir)
    hf_dir = case_dir / "hf"
    hf_dir.mkdir(parents=True)

    extra: dict = {}
    # ---- checkpoint
    storage = spec["storage"]
    save_model = model if storage == "float32" else copy.deepcopy(model).to(getattr(torch, storage))
    kw = {"max_shard_size": spec["max_shard_size"]} if spec["layout"] == "sharded" else {}
    save_model.save_pretrained(hf_dir, **kw)
    del save_model
    if spec["layout"] == "sharded":
        shards = sorted(p.name for p in hf_dir.glob("model-*.safetensors"))
        assert len(shards) >= 2 and (hf_dir / "model.safetensors.index.json").exists(), shards
        extra["shards"] = shards
    if spec["layout"] == "stacked":
        extra["stacked_tensors"] = stack_experts(hf_dir, model)
    if spec["layout"] == "mxfp4":
        extra["mxfp4_tensors"] = summarise_names(write_mxfp4_experts(hf_dir, model))
    if spec.get("tokenizer"):
        extra["tokenizer"] = train_tokenizer(hf_dir / "tokenizer.model", text_config(model).vocab_size)

    # ---- reload check (what transformers itself makes of the written files)
    try:
        re_m = (
            spec["model_cls"]
            .from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
            .eval()
        )
        lg, _ = forward(re_m, ids)
        diff = float((lg - res["logits"]).abs().max())
        extra["reload_check"] = dict(loads=True, max_abs_diff_vs_logits_f32=diff)
        assert diff <= 1e-5, f"{name}: reloaded checkpoint differs by {diff}"
        del re_m
    except AssertionError:
        raise
    except Exception as e:  # noqa: BLE001 - record, do not fail (e.g. unsupported stacked layout)
        extra["reload_check"] = dict(loads=False, error=f"{type(e).__name__}: {e}"[:500])

    if model.config.model_type == "olmoe" and model.config.clip_qkv is not None:
        extra["clip_fraction"] = clip_fraction(model, ids)
        assert all(v > 0 for v in extra["clip_fraction"].values()), extra["clip_fraction"]
    if model.config.model_type == "gpt_oss":
        extra.update(gpt_oss_checks(model, ids, res["logits"]))
    if getattr(model.config, "sliding_window", None) and model.config.model_type == "mixtral":
        assert ids.numel() > model.config.sliding_window
        extra["sliding_window_check"] = sliding_window_check(model, ids, res["logits"])

    # ---- references
    moe_layers = moe_layer_indices(model)
    rl = torch.stack(res["router_logits"]) if res["router_logits"] else torch.zeros(0)
    save_npz_deterministic(
        case_dir / "reference.npz",
        input_ids=ids.numpy().astype(np.int64),
        logits_f32=res["logits"].numpy().astype(np.float32),
        logits_bf16=res["logits_bf16"].numpy().astype(np.float32),
        logits_f16=res["logits_f16"].numpy().astype(np.float32),
        greedy_ids=res["greedy"].numpy().astype(np.int64),
        router_margin=np.float64(res["router_margin"]),
        greedy_margin=np.float64(res["greedy_margin"]),
        router_logits_f32=rl.numpy().astype(np.float32),
        moe_layers=np.asarray(moe_layers, dtype=np.int64),
        **{
            f"logits_{dt}w": res[f"logits_{dt}w"].numpy().astype(np.float32)
            for dt in ("int8", "int4", "mxfp4")
            if f"logits_{dt}w" in res
        },
    )

    manifest = tensor_manifest(hf_dir)
    kept_f32 = sorted(router_param_names(model))
    cfg_json = json.loads((hf_dir / "config.json").read_text())
    overrides = {k: v for k, v in spec["overrides"].items()}
    info = dict(
        case=name,
        architecture=cfg_json["architectures"][0],
        model_type=model.config.model_type,
        config_class=spec["config_cls"].__name__,
        overrides=overrides,
        special_tokens=SPECIAL,
        seed=seed,
        base_seed=spec["seed"],
        rejected_seeds=rejected,
        init=dict(
            matrices=f"N(0, {spec['init_std']}^2)",
            norm_weights=f"1 + {spec.get('norm_spread', 0.3)}*N(0,1)",
            biases="0.1*N(0,1)",
        ),
        storage_dtype=storage,
        layout=spec["layout"],
        notes=spec["notes"],
        T=int(ids.numel()),
        n_new=N_NEW,
        moe_layers=moe_layers,
        num_experts_per_tok=experts_per_token(model),
        kept_f32_in_bf16_f16_refs=summarise_names(kept_f32),
        margins=dict(
            router_margin_f32_and_greedy=res["router_margin"],
            router_margin_bf16=res["router_margin_bf16"],
            router_margin_f16=res["router_margin_f16"],
            greedy_margin=res["greedy_margin"],
        ),
        max_abs_diff=dict(
            logits_bf16_vs_f32=res["maxdiff_bf16_vs_f32"],
            logits_f16_vs_f32=res["maxdiff_f16_vs_f32"],
            generate_cached_vs_full_forward=res["greedy_vs_full_maxdiff"],
        ),
        routing_flips_vs_f32=dict(bf16=res["routing_flips_bf16"], f16=res["routing_flips_f16"]),
        tensor_name_patterns=summarise_names(manifest),
        num_tensors=len(manifest),
        files=sorted(str(p.relative_to(case_dir)) for p in case_dir.rglob("*") if p.is_file()) + ["case.json"],
        generator=dict(
            script="tools/make_fixtures.py",
            transformers=transformers.__version__,
            torch=torch.__version__,
            numpy=np.__version__,
        ),
        **extra,
    )
    (case_dir / "case.json").write_text(json.dumps(info, indent=2, sort_keys=False) + "\n")
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", action="append", choices=sorted(CASES), help="generate only this case (repeatable)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    names = args.only or list(CASES)
    for n in names:
        info = make_case(n)
        size = sum(p.stat().st_size for p in (OUT / n).rglob("*") if p.is_file())
        m = info["margins"]
        print(
            f"{n:11s} seed={info['seed']:5d} T={info['T']} size={size / 1024:.0f}KiB "
            f"router_margin={min(m['router_margin_f32_and_greedy'], m['router_margin_bf16'], m['router_margin_f16']):.2e} "
            f"greedy_margin={m['greedy_margin']:.2e} reload={info['reload_check']}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
