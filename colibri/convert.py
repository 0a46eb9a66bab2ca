"""Hugging Face checkpoint -> Colibri model directory.

Design
------
1. `ARCHITECTURES` is the registry, keyed by the HF architecture name: each entry turns the HF
   config into a `ModelConfig` (our flags). Tensor names are mapped by one shared rule table
   (`_RULES`), because the four supported families name their tensors the same way up to a few
   aliases (Mixtral's `block_sparse_moe` / `w1 w2 w3`).
2. Every HF tensor must be consumed by a rule; any that is not is an error naming it. Every tensor
   the config implies must be produced, with the shape it implies.
3. Expert tensors come either one per expert (`experts.E.gate_proj.weight`, as hub checkpoints
   and transformers 5.x's save_pretrained store them) or stacked (`experts.gate_up_proj`
   [E, 2*I, D] with gate rows first, `experts.down_proj` [E, D, I]); both are sliced lazily.
4. Output is written tensor by tensor into a temporary sibling directory, renamed into place only
   when complete: an interrupted conversion leaves nothing half-written.
   With progress=True (the command line) the bytes stored so far, their rate and the time left
   are shown on stderr as each tensor is converted (colibri.progress).

Matrices (embedding, lm_head, attention, experts, dense MLPs) are stored in the chosen
`--quantize` dtype; the router, the shared-expert gate, norms and biases stay f32. With int8 or
int4, a matrix whose number of columns is not a multiple of 32 (only in toy models) is stored in
f16 instead, and the converter says how many.

Layouts: `--expert-layout` stores the routed experts' matrices `rows` ([out, in]), `transposed`
([in, out]; for int8/int4 the same blocks, input-major in groups of 8 outputs: quant.transpose) or,
for int8/int4/mxfp4/bf16, `interleaved` (output-major groups of 8 outputs, 4 inputs at a time:
quant.interleave); `--layout` the other weight matrices (attention, dense MLPs, shared expert,
lm_head, and a tied embedding, which is also the output head; an untied embedding is only looked
up and stays rows). Which layouts a format has is the table of colibri.formats (nl4/int6: interleaved
only), which both flags are checked against (check_layout_flags). Either defaults to the faster
layout of the format (quant.default_layout). An
int8/int4/bf16 matrix whose rows are not a multiple of 8 stays `rows` (bf16: also one whose inputs
are not a multiple of 32), and so does an f32/f16 matrix asked to be interleaved (a toy matrix
kept in f16); `--quantize` f32/f16 with `interleaved` is an error.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .config import (
    MAX_EXPERTS,
    MAX_FFN,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_VOCAB,
    ModelConfig,
    shown,
)
from .errors import ColibriError
from .gguf_import import GGUFCheckpoint, requantization_error
from .hfcheckpoint import HFCheckpoint, to_f32
from . import _os, textfiles
from .interrupts import sigterm_cleans_up, signals_deferred
from .progress import progress as progress_bar
from .formats import FORMATS, check_layout, layouts_of
from .modeldir import (
    BLOCK_FORMATS,
    IMPORTANCE_FORMATS,
    CONFIG_NAME,
    NEXTN_DIR,
    FORMAT_NAME,
    MAX_CONFIG_BYTES,
    ROLES,
    WEIGHT_DTYPES,
    MappedModelDir,
    ModelDir,
    ModelDirWriter,
    from_storage,
    storage_nbytes,
    tensor_file,
    tensor_role,
    to_storage,
)
from . import quant
from .quant import LAYOUTS, QBLOCK, TGROUP, default_layout, from_rows

_EXPERT_MATRIX = re.compile(r"layers\.\d+\.experts\.\d+\.(gate|up|down)")

# a matrix whose rows are not a whole number of blocks cannot be int8/int4: it is stored in this
FALLBACK_DTYPE = "f16"
# a matrix whose rows are not whole groups of 8 cannot be nl4/int6 (interleaved only): stored in this
INTERLEAVED_ONLY_FALLBACK = {"nl4": "int4", "int6": "int8"}

# ---- the registry: HF config -> ModelConfig ---------------------------------------------------


_REQUIRED = object()


class _HF:
    """Typed reads of a Hugging Face config.json. Each read checks one field's JSON type (and, for
    the dimensions, its range, with config.py's bounds) and names the file and the field when it
    is wrong, before the value is used: a string where an integer belongs, a list for an object, a
    bool for a number are errors, not a TypeError deeper down or a value silently replaced. null
    means absent, as transformers writes unset fields."""

    def __init__(self, d: dict, where: str, arch: str = "", prefix: str = "", top: dict | None = None):
        self.d, self.where, self.arch, self.prefix = d, where, arch, prefix
        self.top = top or {}  # fields inherited from the top level (named without the prefix)

    def name(self, key) -> str:
        return key if key in self.top else self.prefix + key

    def fail(self, key, msg):
        raise ColibriError(f"{self.where}: {self.name(key)} {msg}")

    def raw(self, key, default=_REQUIRED):
        v = self.d.get(key)
        if v is None:
            if default is _REQUIRED:
                raise ColibriError(
                    f"{self.where}: missing field {self.name(key)!r}" + (f" for {self.arch}" if self.arch else "")
                )
            return default
        return v

    def int(self, key, default=_REQUIRED, lo=0, hi=None):
        v = self.raw(key, default)
        if v is default and default is not _REQUIRED:
            return v
        if type(v) is not int:
            self.fail(key, f"must be an integer, got {shown(v)}")
        if v < lo or (hi is not None and v > hi):
            self.fail(key, f"must be an integer in {lo}..{hi if hi is not None else 'inf'}, got {shown(v)}")
        return v

    def dim(self, key, default=_REQUIRED, hi=None, lo=1):
        return self.int(key, default, lo=lo, hi=hi)

    def num(self, key, default=_REQUIRED):
        v = self.raw(key, default)
        if v is default and default is not _REQUIRED:
            return v
        if type(v) not in (int, float):
            self.fail(key, f"must be a number, got {shown(v)}")
        try:
            return float(v)
        except OverflowError:
            self.fail(key, f"must be a finite number, got {shown(v)}")

    def bool(self, key, default):
        v = self.raw(key, default)
        if type(v) is not bool:
            self.fail(key, f"must be true or false, got {shown(v)}")
        return v

    def str(self, key, default=_REQUIRED):
        v = self.raw(key, default)
        if v is default and default is not _REQUIRED:
            return v
        if type(v) is not str:
            self.fail(key, f"must be a string, got {shown(v)}")
        return v

    def obj(self, key, default=None):
        v = self.raw(key, default)
        if v is default:
            return v
        if not isinstance(v, dict):
            self.fail(key, f"must be a JSON object, got {shown(v)}")
        return v

    def list(self, key, n=None, kind=None, default=None):
        """A list (of `n` items, each of JSON type `kind` where given), or default when absent."""
        v = self.raw(key, default)
        if v is default:
            return v
        if type(v) is not list or (n is not None and len(v) != n):
            self.fail(key, f"must be a list{f' of {n} items' if n is not None else ''}, got {shown(v)}")
        if kind is not None:
            for i, x in enumerate(v):
                if type(x) is not kind:
                    self.fail(f"{key}[{i}]", f"must be {_KIND_WORD[kind]}, got {shown(x)}")
        return v

    def token_ids(self, key, vocab: int) -> list:
        """eos_token_id / bos_token_id: an integer or a list of integers (null: none). Ids outside
        the vocabulary are dropped (checkpoints name ids of tokens they do not have); a string,
        a bool or a float is an error naming the field."""
        v = self.raw(key, None)
        if v is None:
            return []
        items = v if type(v) is list else [v]
        for i, t in enumerate(items):
            if type(t) is not int:
                where = f"{key}[{i}]" if type(v) is list else key
                self.fail(where, f"must be a token id (an integer), got {shown(t)}")
        return [t for t in items if 0 <= t < vocab]

    def token_id(self, key, vocab: int):
        """bos_token_id: one integer (null: none); outside the vocabulary: none."""
        v = self.raw(key, None)
        if v is not None and type(v) is not int:
            self.fail(key, f"must be a token id (an integer), got {shown(v)}")
        return v if v is not None and 0 <= v < vocab else None

    def sub(self, d: dict, prefix: str) -> "_HF":
        return _HF(d, self.where, self.arch, self.prefix + prefix)


_KIND_WORD = {int: "an integer", str: "a string", bool: "true or false", dict: "a JSON object"}


def _common(hf: _HF, own_attention: bool = True) -> dict:
    heads = hf.dim("num_attention_heads", hi=MAX_HEADS)
    hidden = hf.dim("hidden_size", hi=MAX_HIDDEN)
    vocab = hf.dim("vocab_size", hi=MAX_VOCAB)
    out = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=hf.dim("num_hidden_layers", hi=MAX_LAYERS),
        num_attention_heads=heads,
        rms_norm_eps=hf.num("rms_norm_eps", 1e-6),
        max_position_embeddings=hf.dim("max_position_embeddings", 4096, hi=MAX_POSITIONS),
        tie_word_embeddings=hf.bool("tie_word_embeddings", False),
        hidden_act=hf.str("hidden_act", "silu"),
        bos_token_id=hf.token_id("bos_token_id", vocab),
        eos_token_id=hf.token_ids("eos_token_id", vocab),
    )
    if own_attention:
        rope = hf.sub(hf.obj("rope_parameters", {}), "rope_parameters.")
        scaling = hf.sub(hf.obj("rope_scaling", {}), "rope_scaling.")
        rope_type = rope.str("rope_type", None)
        rope_type = rope.str("type", "default") if rope_type is None else rope_type
        scaling_type = scaling.str("rope_type", None)
        scaling_type = scaling.str("type", None) if scaling_type is None else scaling_type
        yarn = {}
        if rope_type == "yarn" or scaling_type == "yarn":
            yarn = _yarn(hf, rope if rope_type == "yarn" else scaling)
        elif rope_type != "default" or scaling_type not in (None, "default"):
            raise ColibriError(
                f"{hf.where}: RoPE type {shown(rope_type if rope_type != 'default' else scaling.d)} "
                f"is not supported (the default rotary embedding and YaRN are)"
            )
        theta = rope.num("rope_theta", None)
        head_dim = hf.dim("head_dim", 0, hi=MAX_HEAD_DIM, lo=0) or hidden // heads
        factor = rope.num("partial_rotary_factor", None)
        factor = hf.num("partial_rotary_factor", 1.0) if factor is None else factor
        if not 0 < factor <= 1:
            raise ColibriError(f"{hf.where}: partial_rotary_factor must be in (0, 1], got {shown(factor)}")
        out.update(
            num_key_value_heads=hf.dim("num_key_value_heads", 0, hi=MAX_HEADS, lo=0) or heads,
            head_dim=head_dim,
            rotary_dim=0 if factor == 1 else int(head_dim * factor),
            rope_theta=hf.num("rope_theta", 10000.0) if theta is None else theta,
            **yarn,
        )
    return out


def _yarn(hf: _HF, p: _HF) -> dict:
    """YaRN's parameters as transformers reads them (_compute_yarn_parameters); the attention
    factor resolved here: attention_factor, else mscale / mscale_all_dim, else 0.1 ln(factor) + 1."""
    original = p.dim("original_max_position_embeddings", hi=MAX_POSITIONS)
    factor = p.num("factor", None)
    factor = hf.dim("max_position_embeddings", hi=MAX_POSITIONS) / original if factor is None else factor
    if not 1.0 <= factor <= 1e4:
        raise ColibriError(f"{hf.where}: YaRN factor must be in [1, 1e4], got {shown(factor)}")

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.num("attention_factor", None)
    mscale, mscale_all = p.num("mscale", None), p.num("mscale_all_dim", None)
    if attention is None:
        attention = (
            get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if mscale and mscale_all else get_mscale(factor)
        )
    return dict(
        yarn_factor=float(factor),
        yarn_original_max_position_embeddings=original,
        yarn_beta_fast=float(p.num("beta_fast", None) or 32.0),
        yarn_beta_slow=float(p.num("beta_slow", None) or 1.0),
        yarn_truncate=p.bool("truncate", True),
        yarn_attention_factor=float(attention),
    )


def _experts(hf: _HF, *keys) -> int:
    """The first of `keys` present (the families name the expert count differently)."""
    for key in keys[:-1]:
        if hf.d.get(key) is not None:
            return hf.dim(key, hi=MAX_EXPERTS)
    return hf.dim(keys[-1], hi=MAX_EXPERTS)


def _sparse_layers(hf: _HF, experts: int) -> list:
    """Qwen-MoE rule: a layer is MoE unless listed in mlp_only_layers or off the sparse step."""
    n = hf.dim("num_hidden_layers", hi=MAX_LAYERS)
    step = hf.int("decoder_sparse_step", 1, lo=0, hi=MAX_LAYERS) or 1
    dense = set(hf.list("mlp_only_layers", kind=int, default=[]))
    return [(i not in dense) and experts > 0 and (i + 1) % step == 0 for i in range(n)]


def _uniform_window(n: int, window):
    if window:
        return {"sliding_window": window, "layer_types": ["sliding_attention"] * n}
    return {"sliding_window": None, "layer_types": ["full_attention"] * n}


def _mixtral(hf: _HF) -> dict:
    n = hf.dim("num_hidden_layers", hi=MAX_LAYERS)
    return dict(
        _common(hf),
        architecture="mixtral",
        num_experts=_experts(hf, "num_local_experts"),
        num_experts_per_tok=hf.dim("num_experts_per_tok", hi=MAX_EXPERTS),
        moe_intermediate_size=hf.dim("intermediate_size", hi=MAX_FFN),
        norm_topk_prob=True,
        moe_layers=[True] * n,
        **_uniform_window(n, hf.dim("sliding_window", 0, hi=MAX_POSITIONS, lo=0)),
    )


def _qwen3_moe(hf: _HF) -> dict:
    n = hf.dim("num_hidden_layers", hi=MAX_LAYERS)
    window = hf.dim("sliding_window", 0, hi=MAX_POSITIONS, lo=0) if hf.bool("use_sliding_window", False) else None
    bias = hf.bool("attention_bias", False)
    experts = _experts(hf, "num_experts", "num_local_experts")
    return dict(
        _common(hf),
        architecture="qwen3_moe",
        num_experts=experts,
        num_experts_per_tok=hf.dim("num_experts_per_tok", hi=MAX_EXPERTS),
        moe_intermediate_size=hf.dim("moe_intermediate_size", hi=MAX_FFN),
        intermediate_size=hf.dim("intermediate_size", 0, hi=MAX_FFN, lo=0),
        norm_topk_prob=hf.bool("norm_topk_prob", False),
        qk_norm="per_head",
        attention_bias=bias,
        attention_out_bias=bias,
        moe_layers=_sparse_layers(hf, experts),
        **_uniform_window(n, window),
    )


def _olmoe(hf: _HF) -> dict:
    n = hf.dim("num_hidden_layers", hi=MAX_LAYERS)
    bias = hf.bool("attention_bias", False)
    return dict(
        _common(hf),
        architecture="olmoe",
        num_experts=_experts(hf, "num_experts"),
        num_experts_per_tok=hf.dim("num_experts_per_tok", hi=MAX_EXPERTS),
        moe_intermediate_size=hf.dim("intermediate_size", hi=MAX_FFN),
        norm_topk_prob=hf.bool("norm_topk_prob", False),
        qk_norm="whole",
        clip_qkv=hf.num("clip_qkv", None),
        attention_bias=bias,
        attention_out_bias=bias,
        moe_layers=[True] * n,
        **_uniform_window(n, None),
    )


def _qwen2_moe(hf: _HF) -> dict:
    n = hf.dim("num_hidden_layers", hi=MAX_LAYERS)
    types = hf.list("layer_types", n=n, kind=str, default=None) or ["full_attention"] * n
    sliding = "sliding_attention" in types
    experts = _experts(hf, "num_experts")
    return dict(
        _common(hf),
        architecture="qwen2_moe",
        num_experts=experts,
        num_experts_per_tok=hf.dim("num_experts_per_tok", hi=MAX_EXPERTS),
        moe_intermediate_size=hf.dim("moe_intermediate_size", hi=MAX_FFN),
        intermediate_size=hf.dim("intermediate_size", 0, hi=MAX_FFN, lo=0),
        shared_expert_intermediate_size=hf.dim("shared_expert_intermediate_size", 0, hi=MAX_FFN, lo=0),
        norm_topk_prob=hf.bool("norm_topk_prob", False),
        attention_bias=hf.bool("qkv_bias", hf.bool("attention_bias", True)),
        moe_layers=_sparse_layers(hf, experts),
        layer_types=list(types),
        sliding_window=hf.dim("sliding_window", hi=MAX_POSITIONS) if sliding else None,
    )


def _glm4_moe(hf: _HF) -> dict:
    """GLM-4.5 / 4.6 / 4.5-Air: the first first_k_dense_replace layers dense, the rest MoE with a
    sigmoid router (e_score_correction_bias for the choice, group-limited), ungated shared experts,
    partial rotary. Its multi-token-prediction layers (num_nextn_predict_layers, stored after the
    last decoder layer) are not part of the model transformers runs: skipped."""
    n = hf.dim("num_hidden_layers", hi=MAX_LAYERS)
    experts = _experts(hf, "n_routed_experts")
    dense = hf.int("first_k_dense_replace", 0, hi=n)
    ff = hf.dim("moe_intermediate_size", hi=MAX_FFN)
    return dict(
        _common(hf),
        architecture="glm4_moe",
        num_experts=experts,
        num_experts_per_tok=hf.dim("num_experts_per_tok", hi=MAX_EXPERTS),
        moe_intermediate_size=ff,
        intermediate_size=hf.dim("intermediate_size", 0, hi=MAX_FFN, lo=0),
        shared_expert_intermediate_size=ff * hf.int("n_shared_experts", 0, hi=MAX_EXPERTS),
        shared_expert_gated=False,
        norm_topk_prob=hf.bool("norm_topk_prob", True),
        attention_bias=hf.bool("attention_bias", False),
        qk_norm="per_head" if hf.bool("use_qk_norm", False) else "none",
        router_score="sigmoid",
        router_bias=True,
        n_group=hf.dim("n_group", 1, hi=MAX_EXPERTS),
        topk_group=hf.dim("topk_group", 1, hi=MAX_EXPERTS),
        routed_scaling_factor=hf.num("routed_scaling_factor", 1.0),
        moe_layers=[i >= dense for i in range(n)],
        **_uniform_window(n, 0),
    )


# transformers' GptOssConfig defaults where a config.json says nothing of RoPE
_GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
    "rope_theta": 150000.0,
}


def _gpt_oss(hf: _HF) -> dict:
    """gpt-oss-20b / -120b: alternating sliding-window and full-attention layers (layer_types),
    attention sinks, biases on q/k/v/o, a router with a bias (top-k of the logits, softmax over the
    chosen), experts with biases and the clamped SwiGLU, YaRN. Its experts come in mxfp4
    (quantization_config.quant_method "mxfp4": *_blocks / *_scales) or as floats."""
    n = hf.dim("num_hidden_layers", hi=MAX_LAYERS)
    if hf.d.get("rope_parameters") is None and hf.d.get("rope_scaling") is None:
        hf = _HF(
            dict(hf.d, rope_parameters={**_GPT_OSS_ROPE, "rope_theta": hf.num("rope_theta", 150000.0)}),
            hf.where,
            hf.arch,
            hf.prefix,
        )
    quant = hf.sub(hf.obj("quantization_config", {}), "quantization_config.")
    method = quant.str("quant_method", None)
    if method not in (None, "mxfp4"):
        raise ColibriError(
            f"{hf.where}: quantization_config.quant_method {shown(method)} is not supported for "
            f"gpt-oss (mxfp4 is, and unquantized checkpoints)"
        )
    default_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    types = hf.list("layer_types", n=n, kind=str, default=None) or default_types
    bias = hf.bool("attention_bias", True)
    top_k = hf.dim("num_experts_per_tok", 0, hi=MAX_EXPERTS, lo=0) or hf.dim("experts_per_token", hi=MAX_EXPERTS)
    return dict(
        _common(hf),
        architecture="gpt_oss",
        num_experts=_experts(hf, "num_local_experts"),
        num_experts_per_tok=top_k,
        moe_intermediate_size=hf.dim("intermediate_size", hi=MAX_FFN),
        norm_topk_prob=True,
        attention_bias=bias,
        attention_out_bias=bias,
        attention_sinks=True,
        router_logit_bias=True,
        expert_bias=True,
        hidden_act="swiglu_clamped",
        swiglu_alpha=hf.num("swiglu_alpha", 1.702),
        swiglu_limit=hf.num("swiglu_limit", 7.0),
        moe_layers=[True] * n,
        layer_types=list(types),
        sliding_window=hf.dim("sliding_window", hi=MAX_POSITIONS) if "sliding_attention" in types else None,
    )


def _deepseek_v3(hf: _HF) -> dict:
    """DeepSeek-V3 / R1 and Kimi K2: multi-head latent attention (config.py: the KV cache holds the
    latent and the shared RoPE key; kv_b_proj absorbed into wkb / wvb), the first
    first_k_dense_replace layers dense, the rest MoE with GLM-4.5's router (sigmoid, correction
    bias, groups) and ungated shared experts. The next-token-prediction layers
    (num_nextn_predict_layers, stored after the last decoder layer) are not run by transformers:
    skipped, with a note."""
    n = hf.dim("num_hidden_layers", hi=MAX_LAYERS)
    experts = _experts(hf, "n_routed_experts")
    ff = hf.dim("moe_intermediate_size", hi=MAX_FFN)
    rank, rope = hf.dim("kv_lora_rank", hi=MAX_HIDDEN), hf.dim("qk_rope_head_dim", hi=MAX_HEAD_DIM)
    nope, v = hf.dim("qk_nope_head_dim", hi=MAX_HEAD_DIM), hf.dim("v_head_dim", hi=MAX_HEAD_DIM)
    if rope % 2:
        hf.fail("qk_rope_head_dim", f"must be even for rotary embeddings, got {rope}")
    if hf.bool("attention_bias", False):
        hf.fail("attention_bias", "true is not supported with multi-head latent attention (no published model has it)")
    common = _common(hf)
    scale = (nope + rope) ** -0.5
    rope_params = hf.obj("rope_parameters", None) or hf.obj("rope_scaling", None) or {}
    kind = rope_params.get("rope_type", rope_params.get("type", "default"))
    all_dim = rope_params.get("mscale_all_dim") if kind != "default" else None
    if all_dim:  # transformers' yarn_apply_mscale: the softmax scale times mscale^2
        factor = common.get("yarn_factor") or 1.0
        m = 0.1 * float(all_dim) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= m * m
    common.update(head_dim=rank + rope, num_key_value_heads=1, rotary_dim=rope)
    return dict(
        common,
        architecture="deepseek_v3",
        num_experts=experts,
        num_experts_per_tok=hf.dim("num_experts_per_tok", hi=MAX_EXPERTS),
        moe_intermediate_size=ff,
        intermediate_size=hf.dim("intermediate_size", 0, hi=MAX_FFN, lo=0),
        shared_expert_intermediate_size=ff * hf.int("n_shared_experts", 0, hi=MAX_EXPERTS),
        shared_expert_gated=False,
        norm_topk_prob=hf.bool("norm_topk_prob", True),
        router_score="sigmoid",
        router_bias=True,
        n_group=hf.dim("n_group", 1, hi=MAX_EXPERTS),
        topk_group=hf.dim("topk_group", 1, hi=MAX_EXPERTS),
        routed_scaling_factor=hf.num("routed_scaling_factor", 1.0),
        kv_lora_rank=rank,
        q_lora_rank=hf.dim("q_lora_rank", 0, hi=MAX_HIDDEN, lo=0),
        qk_nope_head_dim=nope,
        v_head_dim=v,
        attention_scale=scale,
        moe_layers=[i >= hf.int("first_k_dense_replace", 0, hi=n) for i in range(n)],
        **_uniform_window(n, 0),
    )


def _gemma4_text(hf: _HF) -> dict:
    """Gemma 4's text decoder with its MoE block (Gemma4TextConfig, enable_moe_block=True)."""

    def refuse(msg):
        raise ColibriError(f"Gemma 4: {msg}")

    if not hf.bool("enable_moe_block", False):
        refuse("enable_moe_block is false: this is a dense Gemma 4, and Colibri runs MoE models")
    if hf.int("hidden_size_per_layer_input", 0):
        refuse(
            f"per-layer input embeddings (hidden_size_per_layer_input={hf.d['hidden_size_per_layer_input']}) "
            f"are not supported"
        )
    if hf.int("num_kv_shared_layers", 0):
        refuse(
            f"num_kv_shared_layers={hf.d['num_kv_shared_layers']} (layers sharing another layer's KV) is not supported"
        )
    if hf.d.get("use_bidirectional_attention") is not None:
        refuse(
            f"use_bidirectional_attention={shown(hf.d['use_bidirectional_attention'])} is not supported (causal only)"
        )
    act = hf.str("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        refuse(f"hidden_activation {shown(act)} is not supported (gelu_pytorch_tanh)")
    n, d = hf.dim("num_hidden_layers", hi=MAX_LAYERS), hf.dim("hidden_size", hi=MAX_HIDDEN)
    types = list(
        hf.list("layer_types", n=n, kind=str, default=None)
        or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    )
    types[-1] = "full_attention"  # as Gemma4TextConfig forces it
    # per-layer head_dim / key-value heads: per_layer_config as saved, else what the config derives
    # from global_head_dim and num_global_key_value_heads for its full-attention layers
    head_dim = hf.dim("head_dim", 256, hi=MAX_HEAD_DIM)
    kv_heads = hf.dim("num_key_value_heads", 4, hi=MAX_HEADS)
    per_layer = hf.obj("per_layer_config", None)
    if per_layer is not None:
        overrides = {}
        for k, v in per_layer.items():
            if not (k.isascii() and k.isdigit() and len(k) <= 6 and int(k) < n):
                hf.fail(f"per_layer_config[{shown(k, 40)}]", f"must be keyed by a layer index in 0..{n - 1}")
            if not isinstance(v, dict):
                hf.fail(f"per_layer_config[{k!r}]", f"must be a JSON object, got {shown(v)}")
            sub = hf.sub(v, f"per_layer_config.{k}.")
            overrides[int(k)] = {
                "head_dim": sub.dim("head_dim", head_dim, hi=MAX_HEAD_DIM),
                "num_key_value_heads": sub.dim("num_key_value_heads", kv_heads, hi=MAX_HEADS),
            }
    else:
        ov = {"head_dim": hf.dim("global_head_dim", 512, hi=MAX_HEAD_DIM)}
        if hf.bool("attention_k_eq_v", False) and hf.d.get("num_global_key_value_heads") is not None:
            ov["num_key_value_heads"] = hf.dim("num_global_key_value_heads", hi=MAX_HEADS)
        overrides = {i: ov for i, t in enumerate(types) if t == "full_attention"}
    head_dims = [overrides.get(i, {}).get("head_dim", head_dim) for i in range(n)]
    kv = [overrides.get(i, {}).get("num_key_value_heads", kv_heads) for i in range(n)]
    rope = hf.obj("rope_parameters", None) or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    }
    thetas, fractions = [], []
    params = {}
    for t in sorted(set(types)):
        p = hf.sub(rope, "rope_parameters.").obj(t, {})
        sub = hf.sub(p, f"rope_parameters.{t}.")
        kind = sub.str("rope_type", "default")
        if kind not in ("default", "proportional") or sub.num("factor", 1.0) != 1.0:
            refuse(f"RoPE {shown(p)} of {t} layers is not supported (default, or proportional without scaling)")
        params[t] = (
            sub.num("rope_theta", 10_000.0),
            sub.num("partial_rotary_factor", 1.0) if kind == "proportional" else 1.0,
        )
    for t in types:
        thetas.append(params[t][0])
        fractions.append(params[t][1])
    common = _common(hf, own_attention=False)
    cap = hf.num("final_logit_softcapping", None)
    return dict(
        common,
        architecture="gemma4",
        hidden_act="gelu_tanh",
        rope_theta=thetas[-1],
        num_experts=_experts(hf, "num_experts"),
        num_experts_per_tok=hf.dim("top_k_experts", hi=MAX_EXPERTS),
        moe_intermediate_size=hf.dim("moe_intermediate_size", hi=MAX_FFN),
        intermediate_size=hf.dim("intermediate_size", hi=MAX_FFN),
        norm_topk_prob=True,
        qk_norm="per_head",
        v_norm=True,
        attention_scale=1.0,
        attention_bias=hf.bool("attention_bias", False),
        attention_out_bias=hf.bool("attention_bias", False),
        attention_k_eq_v=hf.bool("attention_k_eq_v", False),
        tie_word_embeddings=hf.bool("tie_word_embeddings", True),
        embedding_scale=float(np.float32(d**0.5)),
        final_logit_softcapping=cap if cap else None,
        sandwich_norms=True,
        moe_block="parallel",
        layer_scalar=True,
        moe_layers=[True] * n,
        layer_types=types,
        sliding_window=hf.dim("sliding_window", hi=MAX_POSITIONS) if "sliding_attention" in types else None,
        layer_head_dims=head_dims if len(set(head_dims)) > 1 else [],
        layer_kv_heads=kv if len(set(kv)) > 1 else [],
        head_dim=head_dims[-1] if len(set(head_dims)) == 1 else head_dim,
        num_key_value_heads=kv[-1] if len(set(kv)) == 1 else kv_heads,
        layer_rope_theta=thetas if len(set(thetas)) > 1 else [],
        layer_rope_fraction=fractions if any(f != 1.0 for f in fractions) else [],
    )


def _gemma4_multimodal(hf: _HF) -> dict:
    """Gemma4ForConditionalGeneration: the text model of text_config; the towers are ignored."""
    text = hf.obj("text_config", _REQUIRED)
    inherited = {
        k: hf.d[k]
        for k in ("tie_word_embeddings", "bos_token_id", "eos_token_id")
        if hf.d.get(k) is not None and text.get(k) is None
    }  # the hub's configs keep these at the top
    return _gemma4_text(_HF(dict(text, **inherited), hf.where, hf.arch, "text_config.", top=inherited))


ARCHITECTURES = {
    "MixtralForCausalLM": _mixtral,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "OlmoeForCausalLM": _olmoe,
    "Qwen2MoeForCausalLM": _qwen2_moe,
    "Gemma4ForCausalLM": _gemma4_text,
    "Gemma4ForConditionalGeneration": _gemma4_multimodal,
    "Glm4MoeForCausalLM": _glm4_moe,
    "GptOssForCausalLM": _gpt_oss,
    "DeepseekV3ForCausalLM": _deepseek_v3,
}

# multimodal checkpoints: the prefix of the text model's tensors (rewritten to "model."), and the
# prefixes of the parts Colibri does not run (vision / audio towers), skipped with a note
_TEXT_PREFIX = {"Gemma4ForConditionalGeneration": "model.language_model."}
_TOWER_PREFIXES = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")

# ---- tensor names: HF -> ours ----------------------------------------------------------------

_L = r"model\.layers\.(\d+)\."
_LAYER_NUMBER = re.compile(_L)
_MTP_ARCHS = ("Glm4MoeForCausalLM", "DeepseekV3ForCausalLM")
_MOE = r"(?:mlp|block_sparse_moe)\."
_EXPERT_PART = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
_IGNORED = re.compile(r"model\.rotary_emb\.inv_freq|model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

# (pattern, handler) where handler(match, hf_name) -> list of (our name, getter)
_RULES = [
    (r"model\.embed_tokens\.weight", lambda m: "embedding"),
    (r"lm_head\.weight", lambda m: "lm_head"),
    (r"model\.norm\.weight", lambda m: "final_norm"),
    (_L + r"input_layernorm\.weight", lambda m: f"layers.{m[1]}.attn_norm"),
    (_L + r"post_attention_layernorm\.weight", lambda m: f"layers.{m[1]}.ffn_norm"),
    (_L + r"self_attn\.([qkvo])_proj\.weight", lambda m: f"layers.{m[1]}.w{m[2]}"),
    (_L + r"self_attn\.([qkvo])_proj\.bias", lambda m: f"layers.{m[1]}.b{m[2]}"),
    (_L + r"self_attn\.([qk])_norm\.weight", lambda m: f"layers.{m[1]}.{m[2]}_norm"),
    (_L + _MOE + r"gate\.weight", lambda m: f"layers.{m[1]}.router"),
    (
        _L + _MOE + r"experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight",
        lambda m: f"layers.{m[1]}.experts.{int(m[2])}.{_EXPERT_PART[m[3]]}",
    ),
    (_L + "(?:" + _MOE + r")?experts\.gate_up_proj", "stacked_gate_up"),
    (_L + "(?:" + _MOE + r")?experts\.down_proj", "stacked_down"),
    (_L + r"mlp\.shared_expert\.(gate|up|down)_proj\.weight", lambda m: f"layers.{m[1]}.shared.{m[2]}"),
    (_L + r"mlp\.shared_expert_gate\.weight", lambda m: f"layers.{m[1]}.shared_gate"),
    (_L + r"mlp\.shared_experts\.(gate|up|down)_proj\.weight", lambda m: f"layers.{m[1]}.shared.{m[2]}"),
    (_L + r"mlp\.gate\.e_score_correction_bias", lambda m: f"layers.{m[1]}.router_bias"),
    (_L + r"mlp\.(gate|up|down)_proj\.weight", lambda m: f"layers.{m[1]}.mlp.{m[2]}"),
    # only in a _NextnView: the multi-token-prediction block's own tensors
    (r"model\.nextn\.(eh_proj|enorm|hnorm)\.weight", lambda m: f"nextn.{m[1]}"),
]
# Gemma 4 first: its post_attention_layernorm is a norm after attention, not the FFN's input norm
_GEMMA4_RULES = [
    (_L + r"post_attention_layernorm\.weight", lambda m: f"layers.{m[1]}.post_attn_norm"),
    (_L + r"pre_feedforward_layernorm\.weight", lambda m: f"layers.{m[1]}.ffn_norm"),
    (_L + r"post_feedforward_layernorm\.weight", lambda m: f"layers.{m[1]}.post_ffn_norm"),
    (_L + r"post_feedforward_layernorm_1\.weight", lambda m: f"layers.{m[1]}.post_mlp_norm"),
    (_L + r"pre_feedforward_layernorm_2\.weight", lambda m: f"layers.{m[1]}.pre_moe_norm"),
    (_L + r"post_feedforward_layernorm_2\.weight", lambda m: f"layers.{m[1]}.post_moe_norm"),
    (_L + r"router\.proj\.weight", lambda m: f"layers.{m[1]}.router"),
    (_L + r"router\.scale", lambda m: f"layers.{m[1]}.router_scale"),
    (_L + r"router\.per_expert_scale", lambda m: f"layers.{m[1]}.expert_scale"),
    (_L + r"layer_scalar", lambda m: f"layers.{m[1]}.layer_scalar"),
]
# gpt-oss first: its experts are stacked [E, in, out] with gate and up interleaved (gpt_oss_experts)
_GPT_OSS_RULES = [
    (_L + r"self_attn\.sinks", lambda m: f"layers.{m[1]}.sinks"),
    (_L + r"mlp\.router\.weight", lambda m: f"layers.{m[1]}.router"),
    (_L + r"mlp\.router\.bias", lambda m: f"layers.{m[1]}.router_logit_bias"),
    (_L + r"mlp\.experts\.(gate_up_proj|down_proj)(|_bias|_blocks|_scales)", "gpt_oss_experts"),
    # one expert's biases, by name (a GGUF's merged tensors cut per expert: gguf_import.py)
    (
        _L + r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.bias",
        lambda m: f"layers.{m[1]}.experts.{int(m[2])}.{m[3]}_bias",
    ),
]
# DeepSeek-V3 first: its attention is rewritten into the latent form (mla_tensors)
_DEEPSEEK_RULES = [
    (_L + r"self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)\.weight", "mla"),
    (_L + r"self_attn\.q_a_layernorm\.weight", lambda m: f"layers.{m[1]}.q_a_norm"),
    (_L + r"self_attn\.kv_a_layernorm\.weight", lambda m: f"layers.{m[1]}.kv_a_norm"),
]
_RULES = [(re.compile(p), h) for p, h in _RULES]
_DEEPSEEK_RULES = [(re.compile(p), h) for p, h in _DEEPSEEK_RULES] + _RULES
_GEMMA4_RULES = [(re.compile(p), h) for p, h in _GEMMA4_RULES] + _RULES
_GPT_OSS_RULES = [(re.compile(p), h) for p, h in _GPT_OSS_RULES] + _RULES
_RULES_BY_ARCH = {"gemma4": _GEMMA4_RULES, "gpt_oss": _GPT_OSS_RULES, "deepseek_v3": _DEEPSEEK_RULES}


def plan_tensors(
    ckpt: HFCheckpoint, cfg: ModelConfig, hf_arch: str = "", log=None, sources: dict | None = None
) -> dict:
    """our tensor name -> getter returning its float32 values; checks names and shapes (from the
    safetensors headers, before a byte of weights is read). sources, if given, receives our name
    -> the checkpoint tensor read as it, for the tensors read whole. Work and memory are linear in the
    number of checkpoint tensors and in the size of the config's table: a name for a layer or an
    expert the config does not have is refused, not planned; stacked experts are expanded only
    once their shape is the config's."""
    plan = {}
    source = {}  # our name -> HF name (for the shape check)
    unconsumed = []
    towers = 0
    text_prefix = _TEXT_PREFIX.get(hf_arch)
    # GLM-4.5's multi-token-prediction layers follow the decoder's: not part of the model run
    extra_layers = ckpt.config.get("num_nextn_predict_layers", 0) if hf_arch in _MTP_ARCHS else 0
    extra_layers = extra_layers if type(extra_layers) is int and 0 <= extra_layers <= 16 else 0
    mtp = range(cfg.num_hidden_layers, cfg.num_hidden_layers + extra_layers)
    skipped_mtp = 0
    for hf_name in ckpt.names():
        name_in = hf_name
        if text_prefix is not None:
            if hf_name.startswith(_TOWER_PREFIXES):
                towers += 1
                continue
            if hf_name.startswith(text_prefix):
                name_in = "model." + hf_name[len(text_prefix) :]
        if _IGNORED.fullmatch(name_in):
            continue
        layer = _LAYER_NUMBER.match(name_in)
        if layer and len(layer[1]) <= 6 and int(layer[1]) in mtp:
            skipped_mtp += 1
            continue
        for pattern, handler in _RULES_BY_ARCH.get(cfg.architecture, _RULES):
            m = pattern.fullmatch(name_in)
            if m is None:
                continue
            numbers = [g for g in m.groups() if g is not None and g.isdigit()]
            if numbers and (
                len(numbers[0]) > 6
                or int(numbers[0]) >= cfg.num_hidden_layers
                or any(len(g) > 6 or int(g) >= cfg.num_experts for g in numbers[1:])
            ):
                raise ColibriError(
                    f"{ckpt.root}: tensor {_cut(hf_name)} names a layer or an expert that config.json "
                    f"does not have ({cfg.num_hidden_layers} layers, {cfg.num_experts} experts)"
                )
            if handler == "mla":
                _plan_mla(ckpt, cfg, hf_name, int(m[1]), m[2], plan)
            elif handler == "gpt_oss_experts":
                _plan_gpt_oss_experts(ckpt, cfg, hf_name, int(m[1]), m[2], m[3], plan)
            elif handler in ("stacked_gate_up", "stacked_down"):
                shape = ckpt.shape(hf_name)
                E, ff, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
                want = (E, 2 * ff, d) if handler == "stacked_gate_up" else (E, d, ff)
                if tuple(shape) != want:
                    raise ColibriError(
                        f"{ckpt.root}: tensor {_cut(hf_name)} has shape {list(shape)}; config.json "
                        f"implies {list(want)} (num_experts, "
                        + (
                            "2 x moe_intermediate_size, hidden_size)"
                            if handler == "stacked_gate_up"
                            else "hidden_size, moe_intermediate_size)"
                        )
                    )
                for e in range(E):
                    base = f"layers.{m[1]}.experts.{e}."
                    if handler == "stacked_gate_up":
                        plan[base + "gate"] = _slice_getter(ckpt, hf_name, e, 0, ff)
                        plan[base + "up"] = _slice_getter(ckpt, hf_name, e, ff, 2 * ff)
                    else:
                        plan[base + "down"] = _slice_getter(ckpt, hf_name, e, None, None)
            else:
                name = handler(m)
                if name == "lm_head" and cfg.tie_word_embeddings:
                    break  # tied: the embedding serves as head
                if name in plan:
                    raise ColibriError(f"{_cut(hf_name)}: tensor {_cut(name)} is given twice in the checkpoint")
                source[name] = hf_name
                if name.endswith(("shared_gate", "layer_scalar")):
                    plan[name] = lambda n=hf_name: ckpt.f32(n).reshape(-1)
                else:
                    plan[name] = lambda n=hf_name: ckpt.f32(n)
            break
        else:
            unconsumed.append(hf_name)
    if skipped_mtp and log is not None:
        log(
            f"[INFO] {hf_arch}: {skipped_mtp} tensors of the multi-token-prediction layer(s) "
            f"{mtp.start}..{mtp.stop - 1} are not part of the model (transformers does not run them either)"
        )
    if towers and log is not None:
        log(f"[INFO] {hf_arch}: converting the text model; ignoring {towers} tensors of the vision/audio towers")
    if unconsumed:
        more = f" and {len(unconsumed) - 8} more" if len(unconsumed) > 8 else ""
        raise ColibriError(
            f"{ckpt.root}: tensor(s) not understood for {cfg.architecture}: "
            f"{', '.join(map(_cut, unconsumed[:8]))}{more}"
        )
    least = cfg.expert_tensor_count()
    if len(plan) < least:  # before the expected table is built: it may be large
        raise ColibriError(
            f"{ckpt.root}: the checkpoint has {len(plan)} tensors for the model, but config.json's "
            f"{sum(cfg.moe_layers)} MoE layers x {cfg.num_experts} experts need {least} expert "
            f"matrices alone (does config.json match the weights?)"
        )
    expected = cfg.expected_tensors()
    missing = [n for n in expected if n not in plan]
    if missing:
        raise ColibriError(
            f"{ckpt.root}: checkpoint lacks tensors for {', '.join(missing[:8])}"
            f"{' ...' if len(missing) > 8 else ''} (does config.json match the weights?)"
        )
    extra = [n for n in plan if n not in expected]
    if extra:
        raise ColibriError(
            f"{ckpt.root}: tensors {', '.join(map(_cut, extra[:8]))} do not fit the config "
            f"(e.g. biases where config.json says there are none)"
        )
    for name, hf_name in source.items():
        shape, want = tuple(ckpt.shape(hf_name)), expected[name][0]
        flat = name.endswith(("shared_gate", "layer_scalar"))  # [1, d] / [] read as [d] / [1]
        if (math.prod(shape) != math.prod(want)) if flat else shape != want:
            raise ColibriError(
                f"tensor {name}: expected shape {list(want)} from config.json, checkpoint has "
                f"{list(shape)} ({_cut(hf_name)})"
            )
    if sources is not None:
        sources.update(source)
    return plan


# the block's tensors named as the published checkpoints name them, after its layer's prefix:
# its own (-> the view's model.nextn.*), its final norm, and copies of the main model's
_NEXTN_OWN = ("eh_proj.weight", "enorm.weight", "hnorm.weight")
_NEXTN_NORM = "shared_head.norm.weight"
_NEXTN_COPIES = {"shared_head.head.weight": "lm_head.weight", "embed_tokens.weight": "model.embed_tokens.weight"}


class _NextnView:
    """A checkpoint's multi-token-prediction layer n seen as a one-layer checkpoint: its decoder
    layer's tensors as model.layers.0.*, shared_head.norm as model.norm, eh_proj / enorm / hnorm
    as model.nextn.* (plan_tensors' rules), the copies of the head and embedding left out."""

    def __init__(self, ckpt, layer: int):
        self.root, self.config = ckpt.root, dict(ckpt.config, num_nextn_predict_layers=0)
        prefix = f"model.layers.{layer}."
        self._names = {}
        for name in ckpt.names():
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix) :]
            if rest in _NEXTN_COPIES:
                continue
            ours = "model.norm.weight" if rest == _NEXTN_NORM else "model.nextn." + rest if rest in _NEXTN_OWN else None
            self._names[ours or "model.layers.0." + rest] = name
        self._ckpt = ckpt

    def names(self) -> list:
        return sorted(self._names)

    def shape(self, name: str) -> tuple:
        return self._ckpt.shape(self._names[name])

    def raw(self, name: str) -> tuple:
        return self._ckpt.raw(self._names[name])

    def f32(self, name: str) -> np.ndarray:
        return self._ckpt.f32(self._names[name])


def plan_nextn(ckpt, cfg: ModelConfig, hf_arch: str, log) -> tuple | None:
    """(config, plan, expected) of the checkpoint's first multi-token-prediction layer as a
    one-layer block (config.nextn_block) run by the drafter (model.NextnDrafter), or None where it
    has none (or an incomplete one, or one whose head or embedding is not the main model's: then
    the main model converts without it, and the log says why)."""
    layers = ckpt.config.get("num_nextn_predict_layers", 0) if hf_arch in _MTP_ARCHS else 0
    if type(layers) is not int or layers < 1 or not isinstance(ckpt, HFCheckpoint):
        return None
    n = cfg.num_hidden_layers
    names = set(ckpt.names())

    def skip(why):
        log(f"[INFO] {hf_arch}: the multi-token-prediction layer {n} is not kept ({why}); --draft mtp is unavailable")

    missing = [
        f"model.layers.{n}.{rest}" for rest in (*_NEXTN_OWN, _NEXTN_NORM) if f"model.layers.{n}.{rest}" not in names
    ]
    if missing:
        return skip(f"the checkpoint lacks {', '.join(missing)}")
    if not cfg.moe_layers or not cfg.moe_layers[-1]:
        return skip("the decoder's last layer is dense; the block's layer is taken to have its geometry")
    for rest, main in _NEXTN_COPIES.items():
        own = f"model.layers.{n}.{rest}"
        main = main if main in names or rest != "shared_head.head.weight" else "model.embed_tokens.weight"
        if own in names and (main not in names or not np.array_equal(ckpt.f32(own), ckpt.f32(main))):
            return skip(f"its {rest[: -len('.weight')]} is not the main model's {main[: -len('.weight')]}")
    one = {"num_hidden_layers": 1, "moe_layers": [True], "nextn_block": True}
    one.update({k: getattr(cfg, k)[-1:] for k in _PER_LAYER_LISTS if getattr(cfg, k)})
    sub = ModelConfig.from_dict(dict(cfg.to_dict(), **one), f"{ckpt.root}: layer {n}")
    plan = plan_tensors(_NextnView(ckpt, n), sub, hf_arch, None)
    log(
        f"[INFO] {hf_arch}: the multi-token-prediction layer {n} kept in {NEXTN_DIR}/ "
        f"(the drafter of --draft mtp; {layers - 1} further such layer(s) not kept)"
        if layers > 1
        else f"[INFO] {hf_arch}: the multi-token-prediction layer {n} kept in {NEXTN_DIR}/ (the drafter of --draft mtp)"
    )
    return sub, plan, sub.expected_tensors()


# ModelConfig's per-layer lists: a one-layer block keeps the last layer's entry
_PER_LAYER_LISTS = ("layer_types", "layer_head_dims", "layer_kv_heads", "layer_rope_theta", "layer_rope_fraction")


def _plan_mla(ckpt, cfg, hf_name: str, layer: int, proj: str, plan: dict) -> None:
    """DeepSeek-V3's attention projections -> the latent form (config.py, kv_lora_rank):
    q_proj / q_b_proj [H * (nope + rope), in] -> wq / wq_b, each head's rows reordered to
        [rope, nope], the rope rows de-interleaved where rope_interleave (pairs (2i, 2i + 1) become
        (i, i + rope / 2), the pairs cb_rope rotates: the dot products are unchanged)
    kv_a_proj_with_mqa [R + rope, d] -> wkv_a [rope, R] rows (rope rows reordered alike)
    kv_b_proj [H * (nope + v), R] -> wkb [H * R, nope] (each head's key rows, transposed: the
        latent query is wkb_h . q_nope_h) and wvb [H * v, R] (each head's value rows)"""
    H, R, rope, nope, v = (
        cfg.num_attention_heads,
        cfg.kv_lora_rank,
        cfg.rotary_dim,
        cfg.qk_nope_head_dim,
        cfg.v_head_dim,
    )
    interleaved = ckpt.config.get("rope_interleave", True) is not False
    perm = np.r_[0:rope:2, 1:rope:2] if interleaved else np.arange(rope)
    p = f"layers.{layer}."
    fanin = {
        "q_proj": cfg.hidden_size,
        "q_a_proj": cfg.hidden_size,
        "q_b_proj": cfg.q_lora_rank,
        "kv_a_proj_with_mqa": cfg.hidden_size,
        "kv_b_proj": R,
    }[proj]
    rows = {
        "q_proj": H * (nope + rope),
        "q_a_proj": cfg.q_lora_rank,
        "q_b_proj": H * (nope + rope),
        "kv_a_proj_with_mqa": R + rope,
        "kv_b_proj": H * (nope + v),
    }[proj]
    if proj.startswith("q_") and (proj != "q_proj") != bool(cfg.q_lora_rank):
        raise ColibriError(
            f"{ckpt.root}: tensor {_cut(hf_name)} does not fit config.json's q_lora_rank ({cfg.q_lora_rank or 'null'})"
        )
    if tuple(ckpt.shape(hf_name)) != (rows, fanin):
        raise ColibriError(
            f"{ckpt.root}: tensor {_cut(hf_name)} has shape {list(ckpt.shape(hf_name))}; config.json "
            f"implies {[rows, fanin]}"
        )

    # whole rows move: a matrix in its stored form (a GGUF's Q8_0, quant.StoredMatrix) stays as it is
    head = np.r_[nope + perm, 0:nope]
    query_rows = (np.arange(H)[:, None] * (nope + rope) + head).reshape(-1)  # per head [rope (reordered), nope]
    kv_a_rows = np.r_[R + perm, 0:R]

    def kv_b(w, part):
        w = (w.f32() if isinstance(w, quant.StoredMatrix) else w).reshape(H, nope + v, R)
        if part == "wkb":
            return np.ascontiguousarray(w[:, :nope].transpose(0, 2, 1)).reshape(H * R, nope)
        return np.ascontiguousarray(w[:, nope:]).reshape(H * v, R)

    if proj == "kv_b_proj":  # one read of kv_b_proj serves both halves
        read = _read_once(lambda: ckpt.f32(hf_name), 2)
        targets = {"wkb": lambda: kv_b(read(), "wkb"), "wvb": lambda: kv_b(read(), "wvb")}
    else:
        order = {"q_proj": query_rows, "q_b_proj": query_rows, "kv_a_proj_with_mqa": kv_a_rows, "q_a_proj": None}[proj]
        name = {"q_proj": "wq", "q_a_proj": "wq_a", "q_b_proj": "wq_b", "kv_a_proj_with_mqa": "wkv_a"}[proj]
        targets = {name: lambda: _rows_in_order(ckpt.f32(hf_name), order)}
    for name, get in targets.items():
        if p + name in plan:
            raise ColibriError(f"{_cut(hf_name)}: tensor {p + name} is given twice in the checkpoint")
        plan[p + name] = get


def _rows_in_order(w, order):
    """Matrix `w` (float32, or a quant.StoredMatrix kept as stored) with its rows in `order`."""
    if order is None:
        return w
    if isinstance(w, quant.StoredMatrix):
        return w.rows(order)
    return np.ascontiguousarray(w[order])


def _plan_gpt_oss_experts(ckpt, cfg, hf_name: str, layer: int, proj: str, part: str, plan: dict) -> None:
    """gpt-oss's stacked experts -> our per-expert tensors. Floats: gate_up_proj [E, D, 2F] ([in,
    out], gate in the even columns, up in the odd), down_proj [E, F, D]; mxfp4: *_blocks [E, out,
    in / 32, 16] and *_scales [E, out, in / 32] ([out, in], gate the even rows); biases
    gate_up_proj_bias [E, 2F] (interleaved alike), down_proj_bias [E, D]. A *_scales tensor is
    read with its *_blocks."""
    E, ff, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    gate_up = proj == "gate_up_proj"
    out_dim, in_dim = (2 * ff, d) if gate_up else (d, ff)
    want = {
        "": (E, in_dim, out_dim),
        "_bias": (E, out_dim),
        "_blocks": (E, out_dim, in_dim // QBLOCK, QBLOCK // 2),
        "_scales": (E, out_dim, in_dim // QBLOCK),
    }[part]
    shape = tuple(ckpt.shape(hf_name))
    if shape != want or (part in ("_blocks", "_scales") and in_dim % QBLOCK):
        raise ColibriError(
            f"{ckpt.root}: tensor {_cut(hf_name)} has shape {list(shape)}; config.json implies {list(want)}"
        )
    if part == "_scales":
        if hf_name[: -len("_scales")] + "_blocks" not in ckpt.names():
            raise ColibriError(f"{ckpt.root}: {_cut(hf_name)} has no {_cut(hf_name[:-7])}_blocks beside it")
        return
    if part == "_blocks":
        scales = hf_name[: -len("_blocks")] + "_scales"
        if scales not in ckpt.names():
            raise ColibriError(f"{ckpt.root}: {_cut(hf_name)} has no {_cut(scales)} beside it")
    for e in range(E):
        base = f"layers.{layer}.experts.{e}."
        names = [base + "gate", base + "up"] if gate_up else [base + "down"]
        if part == "_bias":
            names = [n + "_bias" for n in names]
        read = _read_once(_gpt_oss_reader(ckpt, hf_name, part, e), len(names))  # gate and up: one read
        for i, name in enumerate(names):
            if name in plan:
                raise ColibriError(f"{_cut(hf_name)}: tensor {name} is given twice in the checkpoint")
            plan[name] = _gpt_oss_getter(read, part, slice(i, None, 2) if gate_up else slice(None))


def _read_once(read, uses: int):
    """A getter that calls read() on its first call and hands the value to `uses` calls in all,
    dropping it after the last (two tensors cut from one checkpoint tensor: one read, one copy)."""
    state = {"left": uses}

    def get():
        if "value" not in state:
            state["value"] = read()
        value = state["value"]
        state["left"] -= 1
        if state["left"] == 0:  # the last use: drop it (a later call reads again)
            del state["value"]
            state["left"] = uses
        return value

    return get


def _gpt_oss_reader(ckpt, hf_name, part, expert):
    """Expert `expert` of a gpt-oss stacked tensor: float32 [in, out] (biases [out]), or the
    (blocks, scales) bytes of an mxfp4 one ([out, in / 32, 16], [out, in / 32])."""

    def read():
        if part == "_blocks":
            blocks, _ = ckpt.raw(hf_name)
            scales, _ = ckpt.raw(hf_name[: -len("_blocks")] + "_scales")
            return blocks[expert], scales[expert]
        arr, kind = ckpt.raw(hf_name)
        return to_f32(arr[expert], kind)  # a contiguous piece of the mapping

    return read


def _gpt_oss_getter(read, part, rows):
    """Our tensor from the expert's stacked values: its rows (gate the even, up the odd)."""

    def get():
        values = read()
        if part == "_blocks":
            return quant.StoredMatrix(
                quant.from_mx(values[0][rows], values[1][rows]), "mxfp4", values[1].shape[-1] * QBLOCK
            )
        if part == "_bias":
            return np.ascontiguousarray(values[rows])
        return np.ascontiguousarray(values[:, rows].T)  # [in, out] -> [out, in]

    return get


def _cut(name: str, limit: int = 120) -> str:
    """A tensor name from a checkpoint's header for a message (a name may be megabytes long)."""
    return name if len(name) <= limit else name[: limit - 3] + "..."


def _slice_getter(ckpt, hf_name, expert, row0, row1):
    def get():
        arr, kind = ckpt.raw(hf_name)
        return to_f32(arr[expert] if row0 is None else arr[expert, row0:row1], kind)

    return get


# ---- the conversion ----------------------------------------------------------------------------


def hf_model_config(ckpt: HFCheckpoint) -> tuple:
    where = getattr(ckpt, "config_source", None) or str(ckpt.root / "config.json")
    archs = ckpt.config.get("architectures")
    archs = [] if archs is None else archs
    if type(archs) is not list or not all(type(a) is str for a in archs):
        raise ColibriError(f"{where}: architectures must be a list of class names, got {shown(archs)}")
    supported = [a for a in archs if a in ARCHITECTURES]
    if not supported:
        raise ColibriError(
            f"{where}: architecture {shown(archs) if archs else 'unknown'} is not supported; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    arch = supported[0]
    fields = ARCHITECTURES[arch](_HF(ckpt.config, where, arch))
    return arch, ModelConfig.from_dict(fields, where)


def convert(
    hf_dir,
    output_dir,
    quantize: str | None = None,
    force: bool = False,
    log=print,
    ln_quant: str | None = None,
    expert_layout: str | None = None,
    layout: str | None = None,
    gguf=None,
    roles: dict | None = None,
    importance=None,
    progress: bool = False,
) -> ModelConfig:
    """Convert a HF checkpoint directory (hf_dir) or a GGUF file (gguf; gguf_import.py) into a
    Colibri model directory; returns its config. quantize: the weight format (default f32 for a
    checkpoint, the closest to the file's for a GGUF); roles: {role: format} for the matrices of
    some roles (modeldir.ROLES: e.g. attention and the output head at int8 beside int4 experts);
    importance: a `calibrate` file, whose statistics choose the int8/int4 scales (quant.py);
    progress: show the bytes written, with their rate and the time left, on stderr (colibri.progress;
    the command line's; off by default, whatever `log` is)."""
    roles = check_roles(roles)
    weights_of = None
    if importance is not None:
        from .calibrate import load_importance

        weights_of = (importance, load_importance(importance))
    if (hf_dir is None) == (gguf is None):
        raise ColibriError("convert reads one source: --hf-dir DIR (a Hugging Face checkpoint) or --gguf FILE")
    if ln_quant not in (None, "int16"):
        raise ColibriError(f"--ln-quant {ln_quant!r} is not supported; the option is int16")
    _check_layouts(expert_layout, layout)
    if quantize is not None and quantize not in WEIGHT_DTYPES:
        raise ColibriError(f"--quantize {quantize!r} is not supported; choose one of {', '.join(WEIGHT_DTYPES)}")
    source_flag, source = ("--gguf", gguf) if gguf is not None else ("--hf-dir", hf_dir)
    _check_output(Path(output_dir), force, {source_flag: source})  # before any work
    by_type = gguf is not None and quantize is None  # no --quantize: a GGUF's finer tensors keep their precision
    if gguf is not None:
        ckpt = GGUFCheckpoint(gguf)
        quantize = quantize or ckpt.default_format()
    else:
        ckpt = HFCheckpoint(hf_dir)
        quantize = quantize or "f32"
    check_layout_flags(quantize, expert_layout, layout)
    arch, cfg = hf_model_config(ckpt)
    sources = {}
    plan = plan_tensors(ckpt, cfg, arch, log, sources)
    nextn = plan_nextn(ckpt, cfg, arch, log)
    kept = ckpt.kept_formats(sources, quantize) if by_type else {}
    expected = cfg.expected_tensors()
    # a GGUF's text files are made from its metadata into a staging directory; a checkpoint's are read where they are
    staging = tempfile.TemporaryDirectory(prefix="colibri-gguf-text-") if gguf is not None else contextlib.nullcontext()
    with staging as staged, _staged_as(staged, gguf):
        text_dir = Path(hf_dir) if gguf is None else Path(staged)
        if gguf is not None:
            ckpt.write_text_files(text_dir, cfg.vocab_size)
        return _convert_planned(
            ckpt,
            arch,
            cfg,
            plan,
            expected,
            Path(output_dir),
            text_dir,
            quantize,
            force,
            log,
            ln_quant,
            expert_layout,
            layout,
            {source_flag: source},
            roles,
            weights_of,
            kept,
            progress,
            nextn,
        )


@contextlib.contextmanager
def _staged_as(staged, gguf):
    """An error about a GGUF's text files names the GGUF, not the staging directory they are
    written into from its metadata."""
    try:
        yield
    except ColibriError as e:
        if staged is None or staged not in str(e):
            raise
        raise ColibriError(
            str(e).replace(f"{staged}/", f"{gguf}: its metadata's ").replace(staged, str(gguf))
        ) from None


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def check_roles(roles) -> dict:
    """{role: format} from --role ROLE=FORMAT: known roles (modeldir.ROLES), storage formats."""
    roles = dict(roles or {})
    for role, fmt in roles.items():
        if role not in ROLES:
            raise ColibriError(f"--role {role}={fmt}: unknown role {role!r}; roles are {', '.join(ROLES)}")
        if fmt not in WEIGHT_DTYPES:
            raise ColibriError(
                f"--role {role}={fmt}: {fmt!r} is not a format; choose one of {', '.join(WEIGHT_DTYPES)}"
            )
    return roles


def _importance_for(weights_of, expected: dict, dtypes: dict, log, note: str | None = None) -> dict:
    """{tensor: importance [cols]} for the int8/int4/nl4/int6 matrices a calibrate file covers (its columns
    checked against the matrix), with a line saying how many; {} without a file."""
    if weights_of is None:
        return {}
    path, vectors = weights_of
    wanted = [n for n in expected if dtypes[n] in IMPORTANCE_FORMATS and len(expected[n][0]) == 2]
    out = {}
    for n in wanted:
        v = vectors.get(n)
        if v is None:
            continue
        cols = expected[n][0][1]
        if v.shape not in ((cols,), (cols, cols)):
            raise ColibriError(
                f"{path}: the statistics of {n} have {v.shape[-1]} columns, the matrix {cols}: "
                "calibrated on another model"
            )
        out[n] = v
    if wanted and not out:
        raise ColibriError(
            f"{path}: none of its tensors is an int8/int4 matrix of this model: calibrated on another "
            "model (run calibrate on a conversion of this checkpoint)"
        )
    full = sum(1 for v in out.values() if v.ndim == 2)
    log(
        f"[INFO] importance from {path}: {len(out)} of {len(wanted)} int8/int4/nl4/int6 matrices (the others, which no "
        "calibration token reached, round to nearest)"
        + (f"; {full} with their inputs' whole second moment, rounding errors compensated (GPTQ)" if full else "")
        + (note or "")
    )
    return out


def _convert_planned(
    ckpt,
    arch,
    cfg,
    plan,
    expected,
    out,
    text_dir,
    quantize,
    force,
    log,
    ln_quant,
    expert_layout,
    layout,
    inputs,
    roles,
    weights_of=None,
    kept=None,
    progress=False,
    nextn=None,
) -> ModelConfig:
    """convert's writing half: the planned tensors in their formats and layouts, the text files
    of `text_dir`, then what the conversion did, in the log. kept: {tensor: format} of a GGUF's
    finer tensors (GGUFCheckpoint.kept_formats), below --role, above `quantize`. progress: the
    tensors' stored bytes counted on stderr as each is read, converted and handed to the writer.
    nextn: plan_nextn's (config, plan, expected), written in the same formats into NEXTN_DIR/."""

    kept = kept or {}
    dtypes = {
        name: _dtype_for(shape, kind, quantize, ln_quant, name, roles, cfg.tie_word_embeddings, kept.get(name))
        for name, (shape, kind) in expected.items()
    }
    nextn_dtypes = (
        {n: _dtype_for(shape, kind, quantize, ln_quant, n, roles) for n, (shape, kind) in nextn[2].items()}
        if nextn
        else {}
    )
    if kept:
        counts = {}
        for name, fmt in kept.items():
            if dtypes.get(name) == fmt:
                counts[fmt] = counts.get(fmt, 0) + 1
        if counts:
            log(
                "[INFO] kept at the GGUF's finer precision (no --quantize): "
                + ", ".join(f"{n} matrices in {fmt}" for fmt, n in sorted(counts.items()))
                + f", the rest in {quantize} (--quantize FORMAT stores every matrix in one format)"
            )
    layouts = {
        name: _layout_for(name, shape, kind, dtypes[name], expert_layout, layout, cfg.tie_word_embeddings)
        for name, (shape, kind) in expected.items()
    }
    weights = [
        sum(storage_nbytes(dtypes[n], expected[n][0]) + 63 for n in names)  # + alignment padding
        for _, names in _files_of(expected)
    ]
    if nextn:
        weights.append(sum(storage_nbytes(nextn_dtypes[n], nextn[2][n][0]) + 63 for n in nextn[2]))
    text = [(text_dir / n).stat().st_size for n in textfiles.present(text_dir)]
    need = _space_needed(weights + text, len(expected), out.resolve().parent)

    copied = textfiles.validate(text_dir, cfg.vocab_size)  # before a byte is written
    importance = _importance_for(
        weights_of,
        expected,
        dtypes,
        log,
        "; a GGUF's Q8_0/Q4_0 blocks carried byte for byte keep their own scales"
        if isinstance(ckpt, GGUFCheckpoint)
        else None,
    )
    from_gguf = isinstance(ckpt, GGUFCheckpoint)
    requantized = {}  # GGUF type -> [(relative RMS error, elements)] (gguf_import.py)

    def values(name):
        v = plan[name]()
        if from_gguf and dtypes[name] != "f32" and ckpt.requantized(ckpt.last_read_type, dtypes[name]):
            requantized.setdefault(ckpt.last_read_type, []).append(
                (requantization_error(v, dtypes[name]), math.prod(v.shape))
            )
        return v

    def stored(name, bar):
        item = _stored(
            name,
            values(name),
            expected[name][0],
            dtypes[name],
            layouts[name],
            "bf16" if quantize == "bf16" and expected[name][1] == "absorbed" else None,
            importance.get(name),
        )
        bar.update(storage_nbytes(dtypes[name], expected[name][0]))
        return item

    def stored_nextn(name, bar):  # the block's tensors: no calibration statistics are of them
        shape, kind = nextn[2][name]
        dtype = nextn_dtypes[name]
        item = _stored(
            name,
            nextn[1][name](),
            shape,
            dtype,
            _layout_for(name, shape, kind, dtype, expert_layout, layout),
            "bf16" if quantize == "bf16" and kind == "absorbed" else None,
        )
        bar.update(storage_nbytes(dtype, shape))
        return item

    def write(writer):
        total = sum(storage_nbytes(dtypes[n], expected[n][0]) for n in expected)
        total += sum(storage_nbytes(nextn_dtypes[n], nextn[2][n][0]) for n in nextn_dtypes)
        with progress_bar(total, "convert", unit="B", enabled=progress) as bar:
            for rel, names in _files_of(expected):
                writer.write_file(rel, (stored(name, bar) for name in names))
            if nextn:
                block = _Writer(writer.root / NEXTN_DIR, writer.out / NEXTN_DIR)
                for rel, names in _files_of(nextn[2]):
                    block.write_file(rel, (stored_nextn(name, bar) for name in names))
                block.finish(
                    nextn[0],
                    quantize,
                    {"hf_architecture": arch, "converter": "colibri convert"},
                    ln_bits=16 if ln_quant else 32,
                )
        for name in copied:
            writer.add_file(name, text_dir / name)
        source = (
            {"gguf_architecture": ckpt.arch, "gguf_name": ckpt.root.name}
            if from_gguf
            else {"hf_dir_name": ckpt.root.resolve().name}
        )
        writer.finish(
            cfg,
            quantize,
            {"hf_architecture": arch, "converter": "colibri convert", **source},
            ln_bits=16 if ln_quant else 32,
        )

    _write_model_dir(out, force, need, write, inputs)
    if requantized:
        errors = ", ".join(
            f"{t} {math.sqrt(sum(e * e * n for e, n in v) / sum(n for _, n in v)):.4f} ({len(v)} tensors)"
            for t, v in sorted(requantized.items())
        )
        log(
            f"[INFO] GGUF-quantized tensors not in a Colibri format of their own were dequantized and stored in "
            f"{quantize}; relative RMS error against the GGUF's own values (first rows of each tensor): {errors}"
        )
    fallback = sum(
        1
        for n, (shape, kind) in expected.items()
        if kind == "matrix" and dtypes[n] == FALLBACK_DTYPE != quantize and shape[-1] % QBLOCK
    )
    if fallback:
        log(
            f"[INFO] {fallback} matrices have a column count that is not a multiple of {QBLOCK}: stored in {FALLBACK_DTYPE}"
        )
    kept = sum(
        1
        for n, (shape, _) in expected.items()
        if layouts[n] == "rows"
        and dtypes[n] in BLOCK_FORMATS
        and "transposed" in layouts_of(dtypes[n])
        and shape[0] % TGROUP
        and (n != "embedding" or cfg.tie_word_embeddings)
    )
    if kept:
        log(
            f"[INFO] {kept} int matrices have a row count that is not a multiple of {TGROUP}: stored in the rows layout"
        )
    per_token = ModelDir(out).bytes_per_token()
    total = sum(per_token.values())
    shown_roles = [r for r in (*ROLES, "router", "other") if per_token.get(r, 0) > 0.001 * total]
    log(
        f"[INFO] Bytes read per decoded token: {_size(total)} ("
        + ", ".join(f"{r} {_size(per_token[r])}" + (f" in {roles[r]}" if r in roles else "") for r in shown_roles)
        + ")"
    )
    expert_layouts = sorted({layouts[n] for n in expected if _EXPERT_MATRIX.fullmatch(n)}) or ["rows"]
    log(
        f"[INFO] Converted {f'{ckpt.root.name} ({ckpt.arch}, as {arch})' if from_gguf else arch} "
        f"({cfg.num_hidden_layers} layers, {cfg.num_experts} experts, "
        f"top-{cfg.num_experts_per_tok}) to {out} in {quantize}, experts {' and '.join(expert_layouts)}"
        + (
            f"; {'made from its metadata' if from_gguf else 'copied'} {', '.join(copied)}"
            if copied
            else " (no tokenizer.json or tokenizer.model: raw token ids only)"
        )
    )
    return cfg


def relayout(
    model_dir, output_dir, expert_layout: str | None = None, layout: str | None = None, force: bool = False, log=print
) -> ModelConfig:
    """The weights of a Colibri model directory in other layouts, as a new directory (the same
    numbers: no HF checkpoint needed, e.g. for a directory converted before the transposed layout
    became the default). Layout flags and defaults as in `convert`; other fields are kept."""
    _check_layouts(expert_layout, layout)
    src = ModelDir(model_dir)
    out = Path(output_dir)
    _check_output(out, force, {"--model-dir": src.root})
    cfg, expected = src.config, src.config.expected_tensors()
    for dtype in sorted({t["dtype"] for t in src.tensors.values()}):
        if len(layouts_of(dtype)) == 1 and dtype in FORMATS:  # nl4/int6: no other layout to fall back to
            for flag, value in (("--expert-layout", expert_layout), ("--layout", layout)):
                if value is not None:
                    check_layout(dtype, value, f"{flag} ({src.root} holds {dtype} matrices)")
    layouts = {
        n: _layout_for(n, shape, kind, src.tensors[n]["dtype"], expert_layout, layout, cfg.tie_word_embeddings)
        for n, (shape, kind) in expected.items()
    }
    in_tensor_files = {t["file"] for t in src.tensors.values()}
    sizes = {rel: entry["size"] for rel, entry in src.files.items()}
    for t in src.tensors.values():  # a tensor file: its tensors, each with its padding
        sizes[t["file"]] = 0
    for t in src.tensors.values():
        sizes[t["file"]] += t["nbytes"] + 63
    need = _space_needed(list(sizes.values()), len(src.tensors), out.resolve().parent)
    maps = MappedModelDir(src)

    def items(names):
        for rel in sorted({src.tensors[n]["file"] for n in names}):  # no damaged weights copied under a new checksum
            bad = src.verify(files=[rel])
            if bad:
                raise ColibriError(f"{src.root / rel}: {bad[0][1]} (re-copy the model directory)")
        for n in names:
            t = src.tensors[n]
            stored = maps.rows_array(n)
            extra = {"scale": t["scale"]} if "scale" in t else {}
            if layouts[n] != "rows":
                stored, extra["layout"] = from_rows(stored, t["dtype"], t["shape"][1], layouts[n]), layouts[n]
            yield n, stored, t["dtype"], tuple(t["shape"]), extra
            _os.release([(maps.address(n), t["nbytes"])])  # keep the RSS at one tensor

    def write(writer):
        for rel, names in _files_of(expected):
            writer.write_file(rel, items(names))
        for rel in sorted(set(src.files) - in_tensor_files):  # the text files
            writer.add_file(rel, src.root / rel)
        writer.finish(
            cfg,
            src.weight_dtype,
            {**src.raw.get("source", {}), "relayout": "colibri relayout"},
            ln_bits=src.raw.get("ln_gamma_quant_bits", 32),
        )

    try:
        _write_model_dir(out, force, need, write, {"--model-dir": src.root})
    finally:
        maps.close()
    expert_layouts = sorted({layouts[n] for n in expected if _EXPERT_MATRIX.fullmatch(n)}) or ["rows"]
    other = sorted(
        {
            layouts[n]
            for n, (_, kind) in expected.items()
            if kind == "matrix" and not _EXPERT_MATRIX.fullmatch(n) and (n != "embedding" or cfg.tie_word_embeddings)
        }
    )
    log(f"[INFO] Wrote {out}: experts {' and '.join(expert_layouts)}, other matrices {' and '.join(other) or 'rows'}")
    return cfg


def check_layout_flags(quantize: str, expert_layout: str | None, layout: str | None) -> None:
    """convert's --expert-layout and --layout against the table of formats (formats.check_layout): the
    routed experts' format is `quantize`, the other matrices' too, but for --quantize mxfp4's (MXFP4_DENSE_DTYPE)."""
    for flag, value, fmt in (
        ("--expert-layout", expert_layout, quantize),
        ("--layout", layout, MXFP4_DENSE_DTYPE if quantize == "mxfp4" else quantize),
    ):
        if value is not None:
            check_layout(fmt, value, f"{flag} (--quantize {quantize})")


def _check_layouts(expert_layout, layout) -> None:
    for flag, value in (("--expert-layout", expert_layout), ("--layout", layout)):
        if value is not None and value not in LAYOUTS:
            raise ColibriError(f"{flag} {value!r} is not supported; choose one of {', '.join(LAYOUTS)}")


def _files_of(expected: dict) -> list:
    """[(file, [tensor names in canonical order])] of a model directory, by file name."""
    by_file = {}
    for name in expected:
        by_file.setdefault(tensor_file(name), []).append(name)
    return sorted(by_file.items())


def _check_output(out: Path, force: bool, inputs: dict) -> None:
    """Refuse an output directory that --force may not replace (the rule of `_write_model_dir`).
    inputs: {flag: path} of the directories the command reads."""
    out = Path(out)
    if os.path.islink(out):
        target = os.readlink(out)
        raise ColibriError(
            f"--output-dir {out} is a symbolic link to {target}; Colibri does not replace a "
            f"directory through a link: pass the target itself (--output-dir {out.resolve()})"
        )
    resolved = out.resolve()
    if resolved.parent == resolved:
        raise ColibriError(f"--output-dir {out} is the root of a file system; choose a directory for the model")
    for flag, src in inputs.items():
        src = Path(src)
        relation = _overlap(resolved, src.resolve())
        if relation == "same":
            what = "the model directory" if flag == "--model-dir" else "the checkpoint directory"
            raise ColibriError(f"--output-dir {out} is {what} itself ({flag} {src}); choose another directory")
        if relation == "contains":
            raise ColibriError(
                f"--output-dir {out} contains the input {flag} {src}: replacing it would delete "
                f"the input; choose a directory outside it"
            )
        if relation == "inside":
            raise ColibriError(f"--output-dir {out} is inside the input {flag} {src}; choose a directory outside it")
    if not os.path.lexists(out):
        return
    if not out.is_dir():
        raise ColibriError(f"--output-dir {out} exists and is not a directory; choose another path")
    entries = os.listdir(out)
    if not entries:
        return
    kind = _colibri_or_what(out, len(entries))
    if kind is not None:
        raise ColibriError(
            f"output directory {out} is not empty and is not a Colibri model directory "
            f"(it holds {kind}); --force replaces only a Colibri model directory: choose a new "
            f"or empty directory"
        )
    if not force:
        raise ColibriError(
            f"output directory {out} exists and is not empty: it holds a Colibri model (use --force to replace it)"
        )


def _overlap(out: Path, src: Path) -> str | None:
    """How two resolved directories relate: "same", "contains" (out is an ancestor of src),
    "inside" (out is under src) or None. Compared by file identity where the paths exist (case-
    insensitive file systems, bind mounts), else by name."""

    def ident(p):
        try:
            st = os.stat(p)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    out_id, src_id = ident(out), ident(src)
    if out == src or (out_id is not None and out_id == src_id):
        return "same"
    if src.is_relative_to(out) or (out_id is not None and any(ident(p) == out_id for p in src.parents)):
        return "contains"
    if out.is_relative_to(src) or (src_id is not None and any(ident(p) == src_id for p in out.parents)):
        return "inside"
    return None


def _colibri_or_what(path: Path, n_entries: int) -> str | None:
    """None for a Colibri model directory (config.json says "format": "colibri"), else what the
    directory holds, in words."""
    n = f"{n_entries} entr{'y' if n_entries == 1 else 'ies'}"
    cfg = path / CONFIG_NAME
    if not cfg.is_file():
        return f"{n} and no Colibri {CONFIG_NAME}"
    try:
        if cfg.stat().st_size <= MAX_CONFIG_BYTES:
            doc = json.loads(cfg.read_text(encoding="utf-8"))
            if isinstance(doc, dict) and doc.get("format") == FORMAT_NAME:
                return None
    except (OSError, UnicodeDecodeError, ValueError):
        pass
    return f"{n} and a {CONFIG_NAME} that is not a Colibri one"


def _space_needed(file_sizes: list, n_tensors: int, parent: Path) -> int:
    """Bytes the output directory takes, with a margin, so that a full disk fails before writing:
    file_sizes lists every file but config.json (the weight files with up to 63 bytes of alignment
    padding per tensor, the copied text files); config.json is estimated from the tensor count;
    each file is rounded up to whole blocks of the file system."""
    try:
        block = os.statvfs(parent).f_frsize or 4096
    except (AttributeError, OSError):
        block = 4096
    config = 16384 + 1024 * n_tensors + 512 * len(file_sizes)
    total = sum(-(-size // block) * block for size in [*file_sizes, config])
    return total + total // 100 + (1 << 16)


class _Writer(ModelDirWriter):
    """ModelDirWriter whose write errors (a full disk: ENOSPC; EFBIG, EDQUOT, EIO) become one
    ColibriError naming the file being written; errors reading the input pass unchanged."""

    def __init__(self, root: Path, out: Path):
        super().__init__(root)
        self.out = out
        self._source_error = None

    def write_file(self, rel, items):
        with self._writing(rel):
            super().write_file(rel, self._reading(items))

    def add_file(self, rel, source):
        with self._writing(rel, source):
            super().add_file(rel, source)

    def finish(self, *args, **kwargs):
        with self._writing(CONFIG_NAME):
            super().finish(*args, **kwargs)

    def _reading(self, items):
        it = iter(items)
        while True:
            try:
                item = next(it)
            except StopIteration:
                return
            except OSError as e:
                self._source_error = e
                raise
            yield item

    @contextlib.contextmanager
    def _writing(self, rel, source=None):
        try:
            yield
        except OSError as e:
            if e is self._source_error or (source is not None and e.filename == str(source)):
                raise
            raise ColibriError(
                f"{e.strerror or e} while writing {self.root / rel}; the temporary directory "
                f"was removed and {self.out} is untouched"
            ) from e


def _write_model_dir(out: Path, force: bool, need: int, write, inputs: dict | None = None) -> None:
    """Let write(ModelDirWriter) fill a temporary sibling of `out`, renamed into place when
    complete, after the checks (again: the conversion may have taken a while):
    - `--force` replaces only a Colibri model directory (config.json says "format": "colibri");
      a non-empty directory that is not one is refused even with it, and so is a file;
    - never the input, a directory that contains it, or one inside it (inputs: {flag: path});
    - never through a symbolic link (the user is told to pass the target);
    - a disk without `need` bytes free fails before a byte is written.
    Whatever fails (a full disk, Ctrl-C, SIGTERM, an error in the weights) removes the temporary
    directory (interrupts.sigterm_cleans_up) and leaves a previous `out` as it was; whatever succeeds leaves no temporary behind."""
    out = Path(out)
    _check_output(out, force, inputs or {})
    target = out.resolve()  # not a link (checked): its parent's real path
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    if _remove_stale_temporaries(parent, target.name):  # a previous output was put back: judge it
        _check_output(out, force, inputs or {})
    free = shutil.disk_usage(parent).free
    if need > free:
        raise ColibriError(
            f"not enough disk space in {parent} for {out}: need {need / 1e6:.1f} MB, have {free / 1e6:.1f} MB"
        )
    tmp = None
    with sigterm_cleans_up():
        try:
            with signals_deferred():  # the directory exists <=> tmp names it
                tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=parent))
            os.chmod(tmp, 0o755)
            write(_Writer(tmp, out))
            _replace_dir(tmp, target)
        except BaseException:
            if tmp is not None:
                with signals_deferred():
                    shutil.rmtree(tmp, ignore_errors=True)
            raise


# largest magnitude each dtype can store (int8/int4: their f16 scale must stay finite)
_FINITE_LIMIT = {"f16": 65504.0, "int8": 65504.0 * 127, "int4": 65504.0 * 8}


# MLA's absorbed up-projections (config.py, kind "absorbed") are multiplied per head, each with
# its own input, so without quantized (or, for bf16, permuted) activations: f32 or f16. A bf16
# model keeps them bf16-rounded in f32 (the same numbers as its bf16 weights), a quantized one f16.
ABSORBED_DTYPE = {
    "f32": "f32",
    "bf16": "f32",
    "f16": "f16",
    "int8": "f16",
    "int4": "f16",
    "mxfp4": "f16",
    "nl4": "f16",
    "int6": "f16",
}

# --quantize mxfp4: the routed experts in mxfp4, every other matrix in this (gpt-oss's checkpoints
# keep attention, router, embedding and head in bf16 beside their mxfp4 experts)
MXFP4_DENSE_DTYPE = "bf16"


def _dtype_for(shape, kind, quantize, ln_quant=None, name="", roles=None, tied=False, kept=None):
    """The storage format of one tensor: --quantize, or its role's --role format (a tied
    embedding is the output head: --role head), or `kept` (a GGUF tensor's finer format)."""
    role = tensor_role(name)
    role_format = (roles or {}).get("head" if role == "embedding" and tied else role)
    if kind == "norm":
        return "int16" if ln_quant else "f32"
    if kind == "absorbed":  # MLA's per-head products: a float format every tier multiplies unquantized
        return ABSORBED_DTYPE[role_format or quantize]
    if kind != "matrix":
        return "f32"
    fmt = role_format or kept or quantize
    if role_format is None and kept is None and quantize == "mxfp4" and not _EXPERT_MATRIX.fullmatch(name):
        fmt = MXFP4_DENSE_DTYPE
    if fmt in BLOCK_FORMATS and shape[-1] % QBLOCK:
        return FALLBACK_DTYPE
    if "rows" not in layouts_of(fmt) and (len(shape) != 2 or shape[0] % TGROUP):  # nl4/int6: whole groups of rows
        return INTERLEAVED_ONLY_FALLBACK[fmt]
    return fmt


def _layout_for(name, shape, kind, dtype, expert_layout=None, layout=None, tied=False):
    """The layout of one tensor (module docstring): the routed experts' matrices take
    --expert-layout, other weight matrices --layout (the embedding only when tied: then it is the
    output head), by default the faster one for their format; one the format lacks (colibri.formats:
    a toy matrix kept in f16 asked interleaved, mxfp4 transposed), or a grouped one without whole groups
    of 8 rows, gives rows; nl4/int6 have only interleaved; everything else rows."""
    allowed = layouts_of(dtype)
    if kind != "matrix" or (name == "embedding" and not tied) or len(allowed) == 1:
        return "rows" if "rows" in allowed else allowed[0]  # nl4/int6: _dtype_for gave whole groups of rows
    wanted = expert_layout if _EXPERT_MATRIX.fullmatch(name) else layout
    wanted = wanted or default_layout(dtype)
    if wanted not in allowed or (FORMATS[dtype].grouped(wanted) and shape[0] % TGROUP):
        return "rows"
    if wanted == "interleaved" and shape[-1] % QBLOCK:  # interleaved bf16: whole 32-input blocks
        return "rows"
    return wanted


def _stored(name, values, shape, dtype, layout="rows", kind_rounding=None, importance=None):
    """(name, stored array, dtype, shape, extra table fields) for ModelDirWriter.write_file.
    values: float32, or a quant.StoredMatrix (an mxfp4 checkpoint's experts, a GGUF's Q8_0/Q4_0/
    MXFP4/F16/BF16 matrices), kept byte for byte when `dtype` is its format;
    kind_rounding "bf16": f32 storage of bf16-rounded values (ABSORBED_DTYPE); importance [cols]:
    the int8/int4 scale search's column weights (quant.quantize)."""
    if isinstance(values, quant.StoredMatrix):
        if tuple(values.shape) != shape:
            raise ColibriError(
                f"tensor {name}: expected shape {list(shape)} from config.json, checkpoint has {list(values.shape)}"
            )
        if values.not_finite():
            raise ColibriError(
                f"tensor {name}: the checkpoint's {values.dtype} values or block scales hold NaN or infinity"
            )
        if dtype == values.dtype and (layout == "rows" or dtype in BLOCK_FORMATS):
            if layout != "rows":
                return name, from_rows(values.stored(), dtype, shape[1], layout), dtype, shape, {"layout": layout}
            return name, values.stored(), dtype, shape, {}
        values = values.f32()
    if tuple(values.shape) != shape:
        raise ColibriError(
            f"tensor {name}: expected shape {list(shape)} from config.json, checkpoint has {list(values.shape)}"
        )
    if not np.isfinite(values).all():
        raise ColibriError(f"tensor {name}: the checkpoint holds NaN or infinite values")
    limit = _FINITE_LIMIT.get(dtype)
    if limit is not None and values.size and np.abs(values).max() > limit:
        raise ColibriError(
            f"tensor {name}: values up to {np.abs(values).max():.3g} do not fit {dtype} "
            f"(limit {limit:g}); convert with --quantize bf16 or f32"
        )
    if dtype == "int16":  # norm weights: w = scale * q, q in [-32767, 32767]
        amax = float(np.abs(values).max()) if values.size else 0.0
        scale = amax / 32767.0 if amax > 0 else 1.0
        q = np.clip(np.rint(values.astype(np.float64) / scale), -32767, 32767).astype("<i2")
        return name, q, dtype, shape, {"scale": scale}
    if dtype == "f32" and kind_rounding == "bf16":
        values = from_storage(to_storage(values, "bf16"), "bf16")
    stored = to_storage(values, dtype, importance)
    if layout != "rows":
        return name, from_rows(stored, dtype, shape[1], layout), dtype, shape, {"layout": layout}
    return name, stored, dtype, shape, {}


def _remove_stale_temporaries(parent: Path, name: str) -> bool:
    """Clear what a killed conversion to `name` left behind (its pid no longer runs): its
    temporary directory is deleted; a previous output it had moved aside (`.NAME.old-PID-*`, killed
    between the two renames of _replace_dir) is put back when `name` is missing, else deleted.
    Returns whether one was put back."""
    stale = []
    for kind in ("tmp", "old"):
        for p in sorted(parent.glob(f".{glob.escape(name)}.{kind}-*")):
            try:
                pid = int(p.name[len(name) + 6 :].split("-")[0])
            except ValueError:
                continue
            if not _pid_alive(pid):
                stale.append((kind, p))
    restored = False
    for kind, p in stale:
        if kind == "old" and not os.path.lexists(parent / name):
            os.replace(p, parent / name)
            restored = True
        else:
            _remove(p)
    return restored


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid() or os.name == "nt":  # on Windows os.kill(pid, 0) sends CTRL_C_EVENT
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished `tmp` to `out`. An existing `out` (an empty directory, or a Colibri one
    with --force) is first renamed aside and removed only once `tmp` is in its place; if that
    rename fails it is put back. Ctrl-C and SIGTERM wait until the swap is done."""
    with signals_deferred():
        old = None
        if os.path.lexists(out):
            old = out.with_name(f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
            os.replace(out, old)
        try:
            os.replace(tmp, out)
        except BaseException:
            if old is not None:
                os.replace(old, out)
            raise
        if old is not None:
            _remove(old)
