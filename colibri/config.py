"""ModelConfig: the architecture and hyperparameters of a Colibri model directory, validated once.

The field names are Hugging Face's (`num_experts_per_tok`, `norm_topk_prob`,
`moe_intermediate_size`, ...) so a config reads like the model card. Differences between the
supported architectures are a handful of flags here, resolved by the converter:

  qk_norm           "none" | "per_head" (Qwen3-MoE) | "whole" (OLMoE: over the full q / k vector)
  clip_qkv          clamp q, k, v to +-clip_qkv (OLMoE), or None
  attention_bias    q/k/v projections have biases (Qwen2-MoE, Qwen3-MoE/OLMoE attention_bias)
  attention_out_bias  the o projection has a bias (Qwen3-MoE/OLMoE attention_bias)
  moe_layers        for each layer, whether it is a MoE layer (else a dense SwiGLU MLP)
  layer_types       for each layer, "full_attention" or "sliding_attention" (with sliding_window)
  shared_expert_intermediate_size  > 0: a shared expert with a sigmoid gate (Qwen2-MoE)
  norm_topk_prob    renormalise the chosen experts' softmax weights (Mixtral: always)

Gemma 4 adds, each defaulting to the behaviour of the other families:
  layer_head_dims, layer_kv_heads   per-layer head_dim / num_key_value_heads ([]: the global ones)
  layer_rope_theta, layer_rope_fraction   per-layer RoPE base and the fraction of each head's
                    rotary pairs that rotate (transformers' "proportional" RoPE: frequencies over
                    the full head_dim, the remaining pairs pass unrotated); []: rope_theta, 1.0
  attention_scale   the factor on q.k (None: 1/sqrt(head_dim); Gemma 4: 1.0)
  v_norm            RMSNorm without weight over each value head
  attention_k_eq_v  full-attention layers have no v projection: v is the raw k projection
  embedding_scale   the embedding row is multiplied by it (Gemma: sqrt(hidden_size))
  final_logit_softcapping   logits = cap * tanh(logits / cap), or None
  sandwich_norms    norms after the attention and after the feed-forward block too
  moe_block         "replace": MoE layers have only the MoE block; "parallel" (Gemma 4): a dense
                    MLP beside it with its own norms (post_mlp_norm, pre_moe_norm, post_moe_norm),
                    the router reads the residual through a weightless RMSNorm times router_scale
                    and hidden_size**-0.5, and each chosen expert's weight is multiplied by
                    its expert_scale
  layer_scalar      the residual stream is multiplied by a per-layer scalar after each layer

GLM-4.5 (glm4_moe) adds, each defaulting to the behaviour of the families above:
  router_score      "softmax" | "sigmoid": the experts' scores are sigmoid(logits); the choice
                    is top-k of score + router_bias (e_score_correction_bias) within the best
                    topk_group of n_group groups (a group's worth: the sum of its two best biased
                    scores), the weights are the unbiased scores of the chosen, renormalised
                    with norm_topk_prob (denominator + 1e-20), times routed_scaling_factor
  n_group, topk_group, routed_scaling_factor, router_bias (a [num_experts] f32 vector per layer)
  shared_expert_gated  false: the shared expert's output is added as it is (no sigmoid gate)
  rotary_dim        > 0: only the first rotary_dim values of each head rotate, in pairs
                    (i, i + rotary_dim / 2), with frequencies over rotary_dim (transformers'
                    partial_rotary_factor); 0: the whole head

gpt-oss (gpt_oss) adds, each off by default:
  attention_sinks   a learned logit per head (layers.L.sinks) joins each softmax's denominator
                    and takes no value
  router_logit_bias the router has a bias (layers.L.router_logit_bias), added to its logits
  expert_bias       every routed expert has gate, up and down biases (experts.E.gate_bias ...)
  hidden_act "swiglu_clamped" with swiglu_alpha, swiglu_limit: gate = min(gate, limit), up =
                    clamp(up, -limit, limit), act = (up + 1) * gate * sigmoid(alpha * gate)

DeepSeek-V3 / Kimi K2 (deepseek_v3) add multi-head latent attention, off by default:
  kv_lora_rank      > 0: keys and values come from one latent of kv_lora_rank numbers a token
                    (kv_a_proj, its RMSNorm) beside one shared RoPE key of rotary_dim numbers; the
                    KV cache holds only those (head_dim = kv_lora_rank + rotary_dim, one KV head),
                    and kv_b_proj is absorbed: wkb (its key half, transposed per head) turns each
                    head's non-rotary query into a latent query, wvb (its value half) turns each
                    head's attention over the latents into its value
  q_lora_rank       > 0: the query goes through q_a_proj, its RMSNorm and q_b_proj; 0: q_proj
  qk_nope_head_dim, v_head_dim   the per-head widths of the non-rotary query and of the value
  (attention_scale holds qk_head_dim^-0.5 times YaRN's mscale(mscale_all_dim)^2)

YaRN RoPE (rope_type "yarn": long-context Qwen3, gpt-oss, DeepSeek-V3), off by default:
  yarn_factor       > 0: the context extension factor (0: plain RoPE)
  yarn_original_max_position_embeddings, yarn_beta_fast, yarn_beta_slow, yarn_truncate
                    transformers' _compute_yarn_parameters inputs: the frequencies blend
                    interpolation and extrapolation over a linear ramp between the two
                    correction dimensions
  yarn_attention_factor   cos and sin are multiplied by it (resolved by the converter from
                    attention_factor, or mscale / mscale_all_dim, or 0.1 ln(factor) + 1)
"""

from __future__ import annotations

import json
import reprlib
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from ._engine import QK_NORM_CODES
from ._kernels import ACT_CODES
from .errors import ColibriError

ARCHITECTURES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "gemma4", "glm4_moe", "gpt_oss", "deepseek_v3")
ROUTER_SCORES = ("softmax", "sigmoid")
QK_NORM_MODES = QK_NORM_CODES  # name -> the layer loop's code (defined once, in _engine.pyx)
HIDDEN_ACTS = ACT_CODES  # name -> the kernels' code (defined once, in _kernels.pyx)
MOE_BLOCKS = ("replace", "parallel")
LAYER_TYPES = ("full_attention", "sliding_attention")

# ---- bounds: every dimension and every product of dimensions that sizes a table, a loop or an
# allocation is checked against these before anything is built. They are far above any real model
# (the largest today: DeepSeek-V3 / Kimi K2 61 layers of 256 / 384 experts, hidden 7168, 163840
# positions; Qwen3-Next 48 layers of 512 experts; Llama 3 405B 126 layers, hidden 16384, 128
# heads, FFN 53248; Gemma 3/4 vocab 262144, head_dim 512; Llama 4 Scout 10M positions), so they
# refuse only a config.json that is damaged or hostile, in microseconds instead of minutes.
MAX_LAYERS = 4096  # 32x Llama 3 405B's 126
MAX_EXPERTS = 1 << 16  # per layer; 128x the largest (512)
MAX_EXPERT_INSTANCES = 1 << 17  # MoE layers x experts: one file + 3 tensors each; 5x Qwen3-Next's
# 24576 (at ~650 bytes of table per expert, a directory's config.json
# meets its 64 MB limit first, near 100000)
MAX_VOCAB = 1 << 22  # 16x Gemma's 262144
MAX_HIDDEN = 1 << 17  # 8x Llama 3 405B's 16384
MAX_HEADS = 1 << 12  # attention or key/value heads; 32x the largest (128)
MAX_HEAD_DIM = 1 << 12  # 8x Gemma 4's 512 (the RoPE tables are n_ctx x head_dim)
MAX_FFN = 1 << 18  # any intermediate size; 5x Llama 3 405B's 53248
MAX_POSITIONS = 1 << 30  # max_position_embeddings (and sliding_window); 100x Llama 4 Scout's
MAX_Q_DIM = 1 << 17  # heads x head_dim; 5x the largest (128 x 192)
MAX_ROPE_TABLE = 1 << 30  # max_position_embeddings x the RoPE tables' width (the rotated
# values of every distinct table, rope_table_widths): the cos and
# sin tables hold that many float32 at n_ctx = max_position_embeddings
# (4 GiB at the bound, and n_ctx never exceeds it); 5x Gemma 4's
# 262144 x (256 + 512)
MAX_EMBEDDING = 1 << 34  # vocab x hidden; 8x Llama 3 405B's 128256 x 16384
MAX_EXPERT_WEIGHTS = 1 << 37  # experts x moe_intermediate x hidden of one layer; 24x Kimi K2's
# 384 x 2048 x 7168
MAX_STOP_IDS = 1 << 16  # eos_token_id entries (a handful in practice)

_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxlist, _SHOW.maxdict, _SHOW.maxstring, _SHOW.maxlong, _SHOW.maxother = 3, 6, 4, 40, 40, 40


def shown(value, limit: int = 100) -> str:
    """repr() of a value from a JSON file for an error message: bounded in length and depth
    (a field may hold a million-element list or a 4000-digit integer)."""
    try:
        text = _SHOW.repr(value)
    except (RecursionError, ValueError, MemoryError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_json(path: Path, what: str, max_bytes: int):
    """The parsed contents of a JSON file, or a ColibriError naming it: too large, unreadable, not
    UTF-8, not JSON, an integer of more than 4300 digits, nesting too deep for the parser."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise ColibriError(f"{path} is larger than {max_bytes >> 20} MB; refusing to parse it as {what}")
        raw = path.read_bytes()
    except OSError as e:
        raise ColibriError(f"{path}: cannot read {what}: {e.strerror or e}") from None
    return parse_json(raw, path, what)


def parse_json(raw: bytes, where, what: str):
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ColibriError(f"{where}: {what} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise ColibriError(f"{where}: {what} is nested too deeply to be parsed") from None
    except json.JSONDecodeError as e:
        raise ColibriError(f"{where}: {what} is not valid JSON ({e})") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise ColibriError(f"{where}: {what} is not usable JSON ({str(e)[:120]})") from None
    except MemoryError:
        raise ColibriError(f"{where}: {what} is too large to be parsed") from None


def _is(v, kind) -> bool:
    if kind is None:
        return v is None
    if kind is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if kind is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    return isinstance(v, kind)


_KIND_NAMES = {None: "null", int: "an integer", float: "a number", bool: "true/false", str: "a string", list: "a list"}
# the JSON type of every field, checked before any value is used
_FIELD_TYPES = {
    "architecture": (str,),
    "hidden_act": (str,),
    "qk_norm": (str,),
    "vocab_size": (int,),
    "hidden_size": (int,),
    "num_hidden_layers": (int,),
    "num_attention_heads": (int,),
    "num_key_value_heads": (int,),
    "head_dim": (int,),
    "max_position_embeddings": (int,),
    "num_experts": (int,),
    "num_experts_per_tok": (int,),
    "moe_intermediate_size": (int,),
    "intermediate_size": (int,),
    "shared_expert_intermediate_size": (int,),
    "rms_norm_eps": (float,),
    "rope_theta": (float,),
    "clip_qkv": (float, None),
    "norm_topk_prob": (bool,),
    "tie_word_embeddings": (bool,),
    "attention_bias": (bool,),
    "attention_out_bias": (bool,),
    "sliding_window": (int, None),
    "bos_token_id": (int, None),
    "layer_types": (list,),
    "moe_layers": (list,),
    "eos_token_id": (list,),
    "layer_head_dims": (list,),
    "layer_kv_heads": (list,),
    "layer_rope_theta": (list,),
    "layer_rope_fraction": (list,),
    "attention_scale": (float, None),
    "v_norm": (bool,),
    "attention_k_eq_v": (bool,),
    "embedding_scale": (float,),
    "final_logit_softcapping": (float, None),
    "sandwich_norms": (bool,),
    "moe_block": (str,),
    "layer_scalar": (bool,),
    "router_score": (str,),
    "n_group": (int,),
    "topk_group": (int,),
    "routed_scaling_factor": (float,),
    "router_bias": (bool,),
    "shared_expert_gated": (bool,),
    "rotary_dim": (int,),
    "yarn_factor": (float,),
    "yarn_original_max_position_embeddings": (int,),
    "yarn_beta_fast": (float,),
    "yarn_beta_slow": (float,),
    "yarn_truncate": (bool,),
    "yarn_attention_factor": (float,),
    "attention_sinks": (bool,),
    "router_logit_bias": (bool,),
    "expert_bias": (bool,),
    "swiglu_alpha": (float,),
    "swiglu_limit": (float,),
    "kv_lora_rank": (int,),
    "q_lora_rank": (int,),
    "qk_nope_head_dim": (int,),
    "v_head_dim": (int,),
    "nextn_block": (bool,),
}


# fields added for Gemma 4 (after format version 1 was first written): optional, with defaults that
# mean the behaviour of every earlier model
EXTENSION_FIELDS = (
    "layer_head_dims",
    "layer_kv_heads",
    "layer_rope_theta",
    "layer_rope_fraction",
    "attention_scale",
    "v_norm",
    "attention_k_eq_v",
    "embedding_scale",
    "final_logit_softcapping",
    "sandwich_norms",
    "moe_block",
    "layer_scalar",
    "router_score",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "router_bias",
    "shared_expert_gated",
    "rotary_dim",
    "yarn_factor",
    "yarn_original_max_position_embeddings",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "yarn_truncate",
    "yarn_attention_factor",
    "attention_sinks",
    "router_logit_bias",
    "expert_bias",
    "swiglu_alpha",
    "swiglu_limit",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "v_head_dim",
    "nextn_block",
)


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int = 0  # dense layers' MLP width (0: no dense layers)
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    qk_norm: str = "none"
    clip_qkv: float | None = None
    attention_bias: bool = False
    attention_out_bias: bool = False
    sliding_window: int | None = None
    layer_types: list = field(default_factory=list)
    moe_layers: list = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_id: list = field(default_factory=list)
    layer_head_dims: list = field(default_factory=list)
    layer_kv_heads: list = field(default_factory=list)
    layer_rope_theta: list = field(default_factory=list)
    layer_rope_fraction: list = field(default_factory=list)
    attention_scale: float | None = None
    v_norm: bool = False
    attention_k_eq_v: bool = False
    embedding_scale: float = 1.0
    final_logit_softcapping: float | None = None
    sandwich_norms: bool = False
    moe_block: str = "replace"
    layer_scalar: bool = False
    router_score: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_bias: bool = False
    shared_expert_gated: bool = True
    rotary_dim: int = 0
    yarn_factor: float = 0.0
    yarn_original_max_position_embeddings: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_truncate: bool = True
    yarn_attention_factor: float = 1.0
    attention_sinks: bool = False
    router_logit_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # a multi-token-prediction block (DeepSeek-V3's, GLM-4.5's: a model directory's nextn/ part,
    # modeldir.NEXTN_DIR): one decoder layer over eh_proj([enorm(embed(next token)); hnorm(hidden)]),
    # its final norm shared_head.norm; the embedding and the head are the main model's
    nextn_block: bool = False

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        if not isinstance(d, dict):
            raise ColibriError(f"{source}: 'model' must be a JSON object, got {shown(d)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise ColibriError(f"{source}: unknown model field(s) {', '.join(shown(u, 40) for u in unknown[:5])}{more}")
        missing = [
            f.name for f in fields(cls) if f.name not in d and f.default is MISSING and f.default_factory is MISSING
        ]
        if missing:
            raise ColibriError(f"{source}: incomplete model section, missing {', '.join(missing)}")
        cfg = cls(**d)
        cfg.validate(source)
        return cfg

    def to_dict(self, omit_default_extensions: bool = False) -> dict:
        """All fields; with omit_default_extensions, the fields added after the first release
        (EXTENSION_FIELDS) are left out where they hold their default, so that a directory that
        does not use them stays readable by earlier Colibri versions (which refuse unknown fields)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if omit_default_extensions:
            for f in fields(self):
                if f.name in EXTENSION_FIELDS:
                    default = f.default_factory() if f.default_factory is not MISSING else f.default
                    if out[f.name] == default:
                        del out[f.name]
        return out

    # -- validation: everything the engine relies on, checked once with a clear message -------
    def validate(self, source: str = "config.json") -> None:
        """Types first, then each number's range, then the per-layer lists, then the products of
        dimensions (the MAX_* bounds): nothing here costs more than a pass over the layers."""

        def fail(msg):
            raise ColibriError(f"{source}: {msg}")

        for name, kinds in _FIELD_TYPES.items():
            v = getattr(self, name)
            if not any(_is(v, k) for k in kinds):
                fail(f"{name} must be {' or '.join(_KIND_NAMES[k] for k in kinds)}, got {shown(v)}")

        def bounded(name, lower, upper):
            v = getattr(self, name)
            if not lower <= v <= upper:
                fail(f"{name} must be an integer in {lower}..{upper}, got {shown(v)}")

        if self.architecture not in ARCHITECTURES:
            fail(f"unknown architecture {shown(self.architecture)}; supported: {', '.join(ARCHITECTURES)}")
        for name, upper in (
            ("vocab_size", MAX_VOCAB),
            ("hidden_size", MAX_HIDDEN),
            ("num_hidden_layers", MAX_LAYERS),
            ("num_attention_heads", MAX_HEADS),
            ("num_key_value_heads", MAX_HEADS),
            ("head_dim", MAX_HEAD_DIM),
            ("max_position_embeddings", MAX_POSITIONS),
            ("num_experts", MAX_EXPERTS),
            ("num_experts_per_tok", MAX_EXPERTS),
            ("moe_intermediate_size", MAX_FFN),
        ):
            bounded(name, 1, upper)
        for name in ("intermediate_size", "shared_expert_intermediate_size"):
            bounded(name, 0, MAX_FFN)
        if self.num_experts_per_tok > self.num_experts:
            fail(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})")
        if self.num_attention_heads % self.num_key_value_heads:
            fail(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        n = self.num_hidden_layers
        for name, kind, lower, upper in (
            ("layer_head_dims", int, 1, MAX_HEAD_DIM),
            ("layer_kv_heads", int, 1, MAX_HEADS),
            ("layer_rope_theta", float, 1.0, 1e12),
            ("layer_rope_fraction", float, 0.0, 1.0),
        ):
            v = getattr(self, name)
            if v and (len(v) != n or not all(_is(x, kind) and lower <= x <= upper for x in v)):
                fail(f"{name} must be empty or list {n} numbers in [{lower:g}, {upper:g}], got {shown(v)}")
        if len(self.moe_layers) != n or not all(isinstance(b, bool) for b in self.moe_layers):
            fail(f"moe_layers must list {n} booleans, got {shown(self.moe_layers)}")
        if len(self.layer_types) != n or any(type(t) is not str or t not in LAYER_TYPES for t in self.layer_types):
            fail(f"layer_types must list {n} of {', '.join(LAYER_TYPES)}, got {shown(self.layer_types)}")
        for layer in range(n):
            hd, kvh = self.layer_head_dim(layer), self.layer_kv_heads_of(layer)
            if hd % 2:
                fail(f"head_dim of layer {layer} must be even for rotary embeddings, got {hd}")
            if self.num_attention_heads % kvh:
                fail(
                    f"num_attention_heads ({self.num_attention_heads}) is not a multiple of the "
                    f"{kvh} key/value heads of layer {layer}"
                )

        for name, lower, upper in (("rms_norm_eps", 1e-12, 1.0), ("rope_theta", 1.0, 1e12)):
            v = getattr(self, name)
            if not lower <= v <= upper:  # also false for NaN (before the RoPE tables are counted)
                fail(f"{name} must be a number in [{lower:g}, {upper:g}], got {shown(v)}")

        # products of dimensions: what one table, loop or allocation is sized by
        head_dim = max(self.layer_head_dims or [self.head_dim])
        which = "the largest of layer_head_dims" if self.layer_head_dims else "head_dim"
        moe = sum(self.moe_layers)
        widths = self.rope_table_widths()
        width_name = "rotary_dim" if self.rotary_dim else "layer_head_dims" if self.layer_head_dims else "head_dim"
        width = (
            f"{width_name} {' + '.join(map(str, widths))}"
            if len(widths) <= 4
            else f"{width_name} summing to {sum(widths)} over {len(widths)} tables"
        )
        for what, value, limit in (
            (
                f"MoE layers ({moe} of num_hidden_layers) x num_experts ({self.num_experts})",
                moe * self.num_experts,
                MAX_EXPERT_INSTANCES,
            ),
            (
                f"num_attention_heads ({self.num_attention_heads}) x {which} ({head_dim})",
                self.num_attention_heads * head_dim,
                MAX_Q_DIM,
            ),
            (
                f"max_position_embeddings ({self.max_position_embeddings}) x the RoPE tables' width ({width})",
                self.max_position_embeddings * sum(widths),
                MAX_ROPE_TABLE,
            ),
            (
                f"vocab_size ({self.vocab_size}) x hidden_size ({self.hidden_size})",
                self.vocab_size * self.hidden_size,
                MAX_EMBEDDING,
            ),
            (
                f"num_experts ({self.num_experts}) x moe_intermediate_size ({self.moe_intermediate_size}) x "
                f"hidden_size ({self.hidden_size})",
                self.num_experts * self.moe_intermediate_size * self.hidden_size,
                MAX_EXPERT_WEIGHTS,
            ),
        ):
            if value > limit:
                fail(f"{what} = {value} exceeds {limit} (far beyond any real model: a damaged config.json?)")

        for name in ("attention_scale", "final_logit_softcapping"):
            v = getattr(self, name)
            if v is not None and not 0 < v < 1e30:
                fail(f"{name} must be a positive number or null, got {shown(v)}")
        if not 0 < self.embedding_scale < 1e30:
            fail(f"embedding_scale must be a positive number, got {shown(self.embedding_scale)}")
        if self.router_score not in ROUTER_SCORES:
            fail(f"router_score must be one of {', '.join(ROUTER_SCORES)}, got {shown(self.router_score)}")
        bounded("n_group", 1, min(self.num_experts, 64))  # routing.h holds 64 group scores
        bounded("topk_group", 1, self.n_group)
        if self.num_experts % self.n_group:
            fail(f"num_experts ({self.num_experts}) is not a multiple of n_group ({self.n_group})")
        if self.n_group > 1 and (self.router_score != "sigmoid" or self.num_experts // self.n_group < 2):
            fail("n_group > 1 needs router_score 'sigmoid' and at least 2 experts per group")
        if self.topk_group * (self.num_experts // self.n_group) < self.num_experts_per_tok:
            fail(
                f"topk_group ({self.topk_group}) groups of {self.num_experts // self.n_group} experts cannot hold "
                f"num_experts_per_tok ({self.num_experts_per_tok})"
            )
        if not 0 < self.routed_scaling_factor < 1e6:
            fail(f"routed_scaling_factor must be a positive number, got {shown(self.routed_scaling_factor)}")
        if self.router_bias and self.router_score != "sigmoid":
            fail("router_bias needs router_score 'sigmoid'")
        if self.rotary_dim:
            smallest = min(self.layer_head_dims or [self.head_dim])
            if not 2 <= self.rotary_dim <= smallest or self.rotary_dim % 2 or self.layer_rope_fraction:
                fail(
                    f"rotary_dim must be 0 or an even number up to head_dim ({smallest}), and not with "
                    f"layer_rope_fraction; got {shown(self.rotary_dim)}"
                )
        for name in ("yarn_beta_fast", "yarn_beta_slow", "yarn_attention_factor"):
            if not 0 < getattr(self, name) < 1e6:
                fail(f"{name} must be a positive number, got {shown(getattr(self, name))}")
        if self.yarn_factor and (
            not 1.0 <= self.yarn_factor <= 1e4 or self.layer_rope_fraction or self.layer_rope_theta
        ):
            fail(f"yarn_factor must be 0 or in [1, 1e4], and not with per-layer RoPE; got {shown(self.yarn_factor)}")
        bounded("yarn_original_max_position_embeddings", 1 if self.yarn_factor else 0, MAX_POSITIONS)
        for name in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            bounded(name, 0, MAX_HIDDEN)
        if self.kv_lora_rank:
            if (
                self.head_dim != self.kv_lora_rank + self.rotary_dim
                or self.num_key_value_heads != 1
                or self.qk_nope_head_dim < 1
                or self.v_head_dim < 1
                or self.layer_head_dims
                or self.layer_kv_heads
                or self.qk_norm != "none"
                or self.attention_bias
                or self.attention_out_bias
                or self.v_norm
                or self.attention_k_eq_v
                or "sliding_attention" in self.layer_types
                or self.attention_sinks
            ):
                fail(
                    "multi-head latent attention (kv_lora_rank > 0) needs head_dim = kv_lora_rank + rotary_dim, one "
                    "key/value head, qk_nope_head_dim and v_head_dim > 0, and none of per-layer geometry, q/k norms, "
                    "biases, v_norm, attention_k_eq_v, sliding windows, sinks"
                )
            if self.attention_scale is None:
                fail("multi-head latent attention needs attention_scale (qk_head_dim^-0.5 times YaRN's mscale^2)")
        elif self.q_lora_rank or self.qk_nope_head_dim or self.v_head_dim:
            fail("q_lora_rank, qk_nope_head_dim and v_head_dim are for multi-head latent attention (kv_lora_rank > 0)")
        for name in ("swiglu_alpha", "swiglu_limit"):
            if not 0 < getattr(self, name) < 1e6:
                fail(f"{name} must be a positive number, got {shown(getattr(self, name))}")
        if self.moe_block not in MOE_BLOCKS:
            fail(f"moe_block must be one of {', '.join(MOE_BLOCKS)}, got {shown(self.moe_block)}")
        if self.moe_block == "parallel" and self.intermediate_size < 1:
            fail("moe_block 'parallel' needs intermediate_size > 0 (the dense MLP beside the experts)")
        if self.hidden_act not in HIDDEN_ACTS:
            fail(f"hidden_act {shown(self.hidden_act)} is not supported (supported: {', '.join(HIDDEN_ACTS)})")
        if self.qk_norm not in QK_NORM_MODES:
            fail(f"qk_norm must be one of {', '.join(QK_NORM_MODES)}, got {shown(self.qk_norm)}")
        if self.qk_norm == "whole" and self.num_attention_heads * self.head_dim != self.hidden_size:
            # OLMoE's q_norm is sized hidden_size; it only lines up when heads*head_dim == hidden.
            fail("qk_norm 'whole' needs num_attention_heads * head_dim == hidden_size")
        if self.clip_qkv is not None and not 0 < self.clip_qkv < 1e30:
            fail(f"clip_qkv must be a positive number or null, got {shown(self.clip_qkv)}")
        if "sliding_attention" in self.layer_types or self.sliding_window is not None:
            if not isinstance(self.sliding_window, int) or not 1 <= self.sliding_window <= MAX_POSITIONS:
                fail(f"sliding_window must be an integer in 1..{MAX_POSITIONS}, got {shown(self.sliding_window)}")
        if not all(self.moe_layers) and self.intermediate_size < 1:
            fail("intermediate_size must be positive when some layers are dense")
        if len(self.eos_token_id) > MAX_STOP_IDS:
            fail(f"eos_token_id lists {len(self.eos_token_id)} ids; at most {MAX_STOP_IDS} are accepted")
        for t in self.eos_token_id:
            if not _is(t, int) or not 0 <= t < self.vocab_size:
                fail(f"eos_token_id {shown(t)} is not a token id in [0, {self.vocab_size})")
        if self.bos_token_id is not None and not 0 <= self.bos_token_id < self.vocab_size:
            fail(f"bos_token_id {shown(self.bos_token_id)} is outside the vocabulary [0, {self.vocab_size})")

    # -- derived quantities --------------------------------------------------------------------
    def layer_window(self, layer: int) -> int:
        """Attention window of a layer: 0 means every earlier position."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else 0

    def layer_d_ff(self, layer: int) -> int:
        if not self.moe_layers[layer]:
            return self.intermediate_size
        dense = self.intermediate_size if self.moe_block == "parallel" else 0
        return max(self.moe_intermediate_size, self.shared_expert_intermediate_size, dense)

    def layer_head_dim(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def layer_kv_heads_of(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_key_value_heads

    def layer_rotary_dim(self, layer: int) -> int:
        """How many values of each head rotate (the rest pass): rotary_dim, else the head_dim."""
        return self.rotary_dim or self.layer_head_dim(layer)

    def rope_table_widths(self) -> list:
        """The rotated values a position of each distinct RoPE table: spec.layer_specs builds one
        table (cos and sin, n_ctx x width / 2 each) per distinct (rotary dim, theta, fraction)."""
        seen = {}
        for layer in range(self.num_hidden_layers):
            seen.setdefault((self.layer_rotary_dim(layer), *self.layer_rope(layer)), self.layer_rotary_dim(layer))
        return list(seen.values())

    def yarn(self) -> dict | None:
        """The YaRN parameters spec.rope_tables takes, or None for plain RoPE."""
        if not self.yarn_factor:
            return None
        return {
            "factor": self.yarn_factor,
            "original_max_position_embeddings": self.yarn_original_max_position_embeddings,
            "beta_fast": self.yarn_beta_fast,
            "beta_slow": self.yarn_beta_slow,
            "truncate": self.yarn_truncate,
            "attention_factor": self.yarn_attention_factor,
        }

    def layer_rope(self, layer: int) -> tuple:
        """(base, fraction of the head's rotary pairs that rotate) of a layer."""
        theta = self.layer_rope_theta[layer] if self.layer_rope_theta else self.rope_theta
        return float(theta), float(self.layer_rope_fraction[layer] if self.layer_rope_fraction else 1.0)

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3): kv_lora_rank > 0."""
        return self.kv_lora_rank > 0

    def layer_has_v(self, layer: int) -> bool:
        """False where v is the k projection (Gemma 4's attention_k_eq_v on full-attention layers)."""
        return not (self.attention_k_eq_v and self.layer_types[layer] == "full_attention")

    def expert_tensor_count(self) -> int:
        """How many routed-expert tensors expected_tensors() lists (gate, up, down per expert of each
        MoE layer): a lower bound on the table's size that costs nothing to compute, checked before
        the table is built."""
        return 3 * self.num_experts * sum(self.moe_layers)

    def _mla_tensors(self, p: str) -> dict:
        """A multi-head latent attention layer's tensors (kind "absorbed": f32 or f16, rows)."""
        d, H, R, rope = self.hidden_size, self.num_attention_heads, self.kv_lora_rank, self.rotary_dim
        qk = self.qk_nope_head_dim + rope
        t = {}
        if self.q_lora_rank:
            t[p + "wq_a"] = ((self.q_lora_rank, d), "matrix")
            t[p + "q_a_norm"] = ((self.q_lora_rank,), "norm")
            t[p + "wq_b"] = ((H * qk, self.q_lora_rank), "matrix")
        else:
            t[p + "wq"] = ((H * qk, d), "matrix")
        t[p + "wkv_a"] = ((rope + R, d), "matrix")
        t[p + "kv_a_norm"] = ((R,), "norm")
        t[p + "wkb"] = ((H * R, self.qk_nope_head_dim), "absorbed")
        t[p + "wvb"] = ((H * self.v_head_dim, R), "absorbed")
        t[p + "wo"] = ((d, H * self.v_head_dim), "matrix")
        return t

    def expected_tensors(self) -> dict:
        """Every tensor a model of this config has: name -> (shape, kind).

        kind is "matrix" (stored in the model's weight dtype), "norm" (f32, or int16 with a scale
        under --ln-quant int16), "vector" (f32: biases, the shared-expert gate), "router" (f32 matrix)
        or "absorbed" (MLA's per-head up-projections: f32 in an f32 model, else f16; rows). The converter writes exactly these; the loader checks them.
        """
        d = self.hidden_size
        t = {"embedding": ((self.vocab_size, d), "matrix"), "final_norm": ((d,), "norm")}
        if not self.tie_word_embeddings:
            t["lm_head"] = ((self.vocab_size, d), "matrix")
        if self.nextn_block:  # the main model's embedding and head serve it
            t = {"final_norm": t["final_norm"], "nextn.eh_proj": ((d, 2 * d), "matrix")}
            t["nextn.enorm"] = t["nextn.hnorm"] = ((d,), "norm")
        for layer in range(self.num_hidden_layers):
            p = f"layers.{layer}."
            hd = self.layer_head_dim(layer)
            q_dim, kv_dim = self.num_attention_heads * hd, self.layer_kv_heads_of(layer) * hd
            t[p + "attn_norm"] = ((d,), "norm")
            t[p + "ffn_norm"] = ((d,), "norm")
            if self.sandwich_norms:
                t[p + "post_attn_norm"] = ((d,), "norm")
                t[p + "post_ffn_norm"] = ((d,), "norm")
            if self.layer_scalar:
                t[p + "layer_scalar"] = ((1,), "vector")
            if self.mla:
                t.update(self._mla_tensors(p))
            else:
                t[p + "wq"] = ((q_dim, d), "matrix")
                t[p + "wk"] = ((kv_dim, d), "matrix")
                if self.layer_has_v(layer):
                    t[p + "wv"] = ((kv_dim, d), "matrix")
                t[p + "wo"] = ((d, q_dim), "matrix")
            if self.attention_bias:
                t[p + "bq"] = ((q_dim,), "vector")
                t[p + "bk"] = ((kv_dim,), "vector")
                if self.layer_has_v(layer):
                    t[p + "bv"] = ((kv_dim,), "vector")
            if self.attention_out_bias:
                t[p + "bo"] = ((d,), "vector")
            if self.attention_sinks:
                t[p + "sinks"] = ((self.num_attention_heads,), "vector")
            if self.qk_norm == "per_head":
                t[p + "q_norm"] = ((hd,), "norm")
                t[p + "k_norm"] = ((hd,), "norm")
            elif self.qk_norm == "whole":
                t[p + "q_norm"] = ((q_dim,), "norm")
                t[p + "k_norm"] = ((kv_dim,), "norm")
            if self.moe_layers[layer]:
                ff = self.moe_intermediate_size
                t[p + "router"] = ((self.num_experts, d), "router")
                for e in range(self.num_experts):
                    t[f"{p}experts.{e}.gate"] = ((ff, d), "matrix")
                    t[f"{p}experts.{e}.up"] = ((ff, d), "matrix")
                    t[f"{p}experts.{e}.down"] = ((d, ff), "matrix")
                    if self.expert_bias:
                        t[f"{p}experts.{e}.gate_bias"] = ((ff,), "vector")
                        t[f"{p}experts.{e}.up_bias"] = ((ff,), "vector")
                        t[f"{p}experts.{e}.down_bias"] = ((d,), "vector")
                if self.shared_expert_intermediate_size:
                    sf = self.shared_expert_intermediate_size
                    t[p + "shared.gate"] = ((sf, d), "matrix")
                    t[p + "shared.up"] = ((sf, d), "matrix")
                    t[p + "shared.down"] = ((d, sf), "matrix")
                    if self.shared_expert_gated:
                        t[p + "shared_gate"] = ((d,), "vector")
                if self.router_bias:
                    t[p + "router_bias"] = ((self.num_experts,), "vector")
                if self.router_logit_bias:
                    t[p + "router_logit_bias"] = ((self.num_experts,), "vector")
                if self.moe_block == "parallel":
                    t[p + "router_scale"] = ((d,), "vector")
                    t[p + "expert_scale"] = ((self.num_experts,), "vector")
                    for norm in ("post_mlp_norm", "pre_moe_norm", "post_moe_norm"):
                        t[p + norm] = ((d,), "norm")
            if not self.moe_layers[layer] or self.moe_block == "parallel":
                ff = self.intermediate_size
                t[p + "mlp.gate"] = ((ff, d), "matrix")
                t[p + "mlp.up"] = ((ff, d), "matrix")
                t[p + "mlp.down"] = ((d, ff), "matrix")
        return t
