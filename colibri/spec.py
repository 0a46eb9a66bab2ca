"""EngineSpec: everything the compiled layer loop needs, derived once, typed.

Design
------
The engine (`_engine.Engine`) takes one `EngineSpec` and nothing else: the hyperparameters as
the kernels see them (codes, not names), each layer's geometry (`LayerSpec`: MoE or dense, its
window, FFN width, head_dim, key/value heads, the rows of its KV ring, its RoPE tables), the
address of every tensor in the mapped directory (`TensorRef`) and the run options. Every value
that depends on two things — the prefill chunk on the context, a sliding layer's ring on its
window and the chunk, the expert count of a dense model, the top-k limit — is derived here and
only here; the engine checks what it is given, it does not recompute it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import _engine, _os, names
from ._kernels import ACT_CODES
from .errors import ColibriError
from .modeldir import TensorRef  # noqa: F401  (the tensors' type)


@dataclass(frozen=True)
class LayerSpec:
    moe: bool
    sliding_window: int  # 0: attends to every earlier position
    d_ff: int  # the dense MLP's width (0: none) or the experts' width
    head_dim: int
    n_kv_heads: int
    kv_ring: int  # rows of its KV cache: n_ctx, or window + prefill chunk
    attn_scale: float  # the factor on q.k (0: 1/sqrt(head_dim))
    rope_dim: int  # the first rope_dim values of each head rotate (head_dim: all)
    rope_cos: np.ndarray  # float32 [n_ctx, rope_dim / 2]
    rope_sin: np.ndarray  # float32 [n_ctx, rope_dim / 2]
    kv_rank: int = 0  # multi-head latent attention's latent width (0: not MLA; head_dim = rope_dim + kv_rank)
    q_lora: int = 0  # its low-rank query width (0: none)
    qk_head: int = 0  # its per-head query width (rope_dim + qk_nope_head_dim)
    v_head: int = 0  # its per-head value width


@dataclass(frozen=True)
class EngineSpec:
    d_model: int
    n_layers: int
    n_heads: int
    vocab: int
    n_experts: int  # routed experts per MoE layer (1 for a dense model: no router is read)
    top_k: int  # 1 .. _engine.MAX_TOP_K
    norm_topk_prob: bool
    use_lut: bool  # routing weights from the softmax table (not exact)
    sigmoid_router: bool  # GLM-4.5's router (routing.h cb_route_sigmoid) ...
    n_group: int  # ... its expert groups, of which
    topk_group: int  # ... the best topk_group are chosen from
    routed_scaling: float  # ... and its weights' factor
    qk_norm: int  # _engine.QK_NORM_CODES
    clip_qkv: float  # 0: none
    v_norm: bool
    act: int  # _kernels.ACT_CODES
    swiglu_alpha: float  # the clamped SwiGLU's sigmoid factor and clamp (act swiglu_clamped)
    swiglu_limit: float
    embed_scale: float
    softcap: float  # 0: none
    rms_eps: float
    n_ctx: int
    n_seq: int  # sequences the KV cache holds side by side (Engine.step decodes one token of each)
    prefill_chunk: int  # tokens per engine call at most, 1 .. n_ctx (the scratch rows)
    n_threads: int
    kv_cache: str  # the KV cache's elements: "f32", "f16" (half the bytes) or "q8" (_kernels.KV_CODES)
    bf16_products: bool  # bf16 matrices multiply activations rounded to bf16 (vdpbf16ps) where the tier can
    prefetch: int  # _engine.PREFETCH_CODES
    prefetch_chunk_bytes: int  # bytes per read advice call (0: no limit)
    expert_budget: int | None  # bytes of experts the expert cache admits at most (None: no budget)
    eviction: str  # the cache's policy, a key of _engine.EVICTION_CODES
    advice: tuple  # _os.EngineAdvice: the OS functions the cache's reader calls for an expert's pages
    cache_os: tuple  # _os.CacheAdvice: (posix_fadvise address or 0, POSIX_FADV_DONTNEED, read code)
    layers: tuple  # LayerSpec [n_layers]
    tensors: dict  # name -> TensorRef (modeldir's names: "embedding", "layers.3.wq", ...)
    expert_pages: dict  # (layer, expert) -> (address, bytes) of the expert's mapped span
    expert_fds: dict  # (layer, expert) -> an open descriptor of its file (for the page-cache drop)
    nextn: bool = False  # a multi-token-prediction block (config.nextn_block): Engine.run takes hidden_in
    skip_missed: float = 0.0  # > 0: decoded tokens skip light missed experts (load(skip_missed=); lossy)
    cache_routing: float = 0.0  # > 0: decoded tokens favour resident experts (load(cache_routing=); lossy)


def yarn_inv_freq(dim: int, theta: float, yarn: dict) -> tuple:
    """(inv_freq float32 [dim / 2], attention factor) of YaRN, as transformers'
    _compute_yarn_parameters computes them (float32 tensors, float64 Python scalars)."""
    factor, original = yarn["factor"], yarn["original_max_position_embeddings"]
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    interpolation = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(yarn["beta_fast"]), correction_dim(yarn["beta_slow"])
    if yarn["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a singular ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_factor = (np.float32(1) - ramp.astype(np.float32)).astype(np.float32)
    inv_freq = interpolation * (np.float32(1) - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq.astype(np.float32), float(yarn["attention_factor"])


def rope_tables(head_dim: int, theta: float, n_ctx: int, fraction: float = 1.0, yarn: dict | None = None) -> tuple:
    """cos, sin float32 [n_ctx, head_dim/2], computed the way transformers does (float32 freqs).

    fraction < 1 is transformers' "proportional" RoPE (Gemma 4's global layers): the first
    int(fraction * head_dim // 2) pairs rotate with frequencies theta**(-2i/head_dim) over the
    full head_dim, the remaining pairs have frequency 0 (cos 1, sin 0: unrotated). yarn
    (config.ModelConfig.yarn()): YaRN's blended frequencies, cos and sin times its attention factor."""
    scale = 1.0
    if yarn is not None:
        inv_freq, scale = yarn_inv_freq(head_dim, theta, yarn)
    else:
        rotated = int(fraction * head_dim // 2)
        exponent = np.arange(0, 2 * rotated, 2, dtype=np.float32) / np.float32(head_dim)
        inv_freq = np.zeros(head_dim // 2, np.float32)
        inv_freq[:rotated] = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
    freqs = np.arange(n_ctx, dtype=np.float32)[:, None] * inv_freq[None, :]
    cos = np.cos(freqs.astype(np.float64)).astype(np.float32)
    sin = np.sin(freqs.astype(np.float64)).astype(np.float32)
    if scale != 1.0:
        cos, sin = (cos * np.float32(scale)).astype(np.float32), (sin * np.float32(scale)).astype(np.float32)
    return cos, sin


def layer_specs(cfg, n_ctx: int, chunk: int) -> tuple:
    """Each layer's geometry; RoPE tables shared between layers of equal (head_dim, theta, fraction)."""
    tables = {}
    out = []
    for i in range(cfg.num_hidden_layers):
        hd = cfg.layer_head_dim(i)
        rot = cfg.layer_rotary_dim(i)  # partial rotary: frequencies over the rotated values
        theta, fraction = cfg.layer_rope(i)
        key = (rot, theta, fraction)
        if key not in tables:
            tables[key] = rope_tables(rot, theta, n_ctx, fraction, cfg.yarn())
        window = cfg.layer_window(i)
        cos, sin = tables[key]
        out.append(
            LayerSpec(
                moe=bool(cfg.moe_layers[i]),
                sliding_window=window,
                d_ff=cfg.layer_d_ff(i),
                head_dim=hd,
                n_kv_heads=cfg.layer_kv_heads_of(i),
                kv_ring=min(n_ctx, window + chunk) if window else n_ctx,
                rope_dim=rot,
                attn_scale=cfg.attention_scale or 0.0,
                rope_cos=cos,
                rope_sin=sin,
                kv_rank=cfg.kv_lora_rank,
                q_lora=cfg.q_lora_rank,
                qk_head=cfg.qk_nope_head_dim + rot if cfg.mla else 0,
                v_head=cfg.v_head_dim,
            )
        )
    return tuple(out)


def prefill_chunk(requested, n_ctx: int) -> int:
    """The engine's tokens per call: the request (default names.DEFAULT_PREFILL_CHUNK), at most n_ctx."""
    return max(1, min(requested or names.DEFAULT_PREFILL_CHUNK, n_ctx))


def build(
    cfg,
    tensors: dict,
    *,
    n_ctx: int,
    chunk: int,
    threads: int,
    exact_softmax: bool,
    prefetch: str,
    prefetch_chunk_bytes: int,
    expert_pages: dict,
    expert_budget: int | None = None,
    eviction: str = "lru",
    expert_fds: dict | None = None,
    advice=None,
    cache_os=None,
    kv_cache: str = "f32",
    bf16_products: bool = False,
    n_seq: int = 1,
    skip_missed: float | None = None,
    cache_routing: float | None = None,
) -> EngineSpec:
    """The spec of `cfg` (config.ModelConfig) over the mapped `tensors` (name -> TensorRef) with
    these run options (already validated by the caller, model.Model). advice, cache_os: the OS
    functions for the expert pages (default: colibri._os.engine_advice() and cache_advice(),
    what this OS has)."""
    top_k = max(cfg.num_experts_per_tok, 1)
    if top_k > _engine.MAX_TOP_K:
        raise ColibriError(f"num_experts_per_tok {cfg.num_experts_per_tok} exceeds the supported {_engine.MAX_TOP_K}")
    return EngineSpec(
        d_model=cfg.hidden_size,
        n_layers=cfg.num_hidden_layers,
        n_heads=cfg.num_attention_heads,
        vocab=cfg.vocab_size,
        n_experts=max(cfg.num_experts, 1),
        top_k=top_k,
        norm_topk_prob=bool(cfg.norm_topk_prob),
        use_lut=not exact_softmax,
        sigmoid_router=cfg.router_score == "sigmoid",
        n_group=int(cfg.n_group),
        topk_group=int(cfg.topk_group),
        routed_scaling=float(cfg.routed_scaling_factor),
        qk_norm=_engine.QK_NORM_CODES[cfg.qk_norm],
        clip_qkv=float(cfg.clip_qkv or 0.0),
        v_norm=bool(cfg.v_norm),
        act=ACT_CODES[cfg.hidden_act],
        swiglu_alpha=float(cfg.swiglu_alpha),
        swiglu_limit=float(cfg.swiglu_limit),
        embed_scale=float(cfg.embedding_scale),
        softcap=float(cfg.final_logit_softcapping or 0.0),
        rms_eps=float(cfg.rms_norm_eps),
        n_ctx=n_ctx,
        n_seq=int(n_seq),
        prefill_chunk=chunk,
        n_threads=threads,
        kv_cache=kv_cache,
        bf16_products=bool(bf16_products),
        prefetch=_engine.PREFETCH_CODES[prefetch],
        prefetch_chunk_bytes=int(prefetch_chunk_bytes),
        expert_budget=None if expert_budget is None else int(expert_budget),
        eviction=eviction,
        advice=_os.engine_advice() if advice is None else _os.EngineAdvice(*advice),
        cache_os=tuple(_os.cache_advice() if cache_os is None else cache_os),
        layers=layer_specs(cfg, n_ctx, chunk),
        tensors=tensors,
        expert_pages=dict(expert_pages),
        expert_fds=dict(expert_fds or {}),
        nextn=bool(cfg.nextn_block),
        skip_missed=float(skip_missed or 0.0),
        cache_routing=float(cache_routing or 0.0),
    )
