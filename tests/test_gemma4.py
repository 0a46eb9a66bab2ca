"""Gemma 4 with its MoE block: what the generic checks of test_models.py do not cover.

test_models.py already holds both Gemma 4 cases (tools/make_fixtures.py) to transformers' f32,
bf16 and f16 logits, greedy tokens and decode == forward. Here: the sliding-window KV ring really
wrapping (a tiny prefill chunk makes the ring window + 2 rows), the cache's size, the parts of the
Gemma layer that must be present or absent in the converted directory, the multimodal checkpoint,
the refusals of unsupported Gemma 4 variants, and the int8 / int4 paths against transformers
running the very weights those formats store.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import colibri
from colibri.convert import convert
from conftest import FIXTURES, kl_mean, reference

REL_TOL = 1e-4  # as in test_models.py: float32 rounding only
# Colibri int8/int4 against transformers on the same rounded weights: what is left is the
# per-block int8 quantization of the activations (measured 1.1e-4 int8, 6e-5 int4 on gemma4_b)
KL_SAME_WEIGHTS_MAX = 1e-3
# int8 against f32 (llama.cpp's q8_0 is about 1e-3 on real models; the weight rounding alone,
# transformers on the int8 weights, measures 9.2e-4 on gemma4_b)
KL_INT8_VS_F32_MAX = 2e-3
TOP1_INT8_MIN = 0.95


@pytest.mark.parametrize("case", ["gemma4_a", "gemma4_b"])
def test_decoding_past_the_window_with_a_wrapping_kv_ring(converted, case):
    """prefill_chunk=2 makes each sliding layer's cache a ring of window + 2 rows; the prompt and
    12 greedy tokens run far past it (positions wrap several times), one token at a time and in
    chunks of 2, and every position still matches transformers' full forward."""
    ref = reference(case)
    ids = ref["input_ids"].tolist()
    m = colibri.load(converted(case), prefill_chunk=2)
    window = m.config.sliding_window
    assert len(ids) + len(ref["greedy_ids"]) > 2 * (window + 2)
    logits = m.forward(ids)  # chunks of 2
    expected = ref["logits_f32"]
    assert np.abs(logits - expected).max() <= REL_TOL * np.abs(expected).max()
    steps = []
    new = list(
        m.generate(
            ids,
            max_new_tokens=len(ref["greedy_ids"]),
            stop_at_eos=False,
            on_step=lambda model: steps.append(model.last_logits),
        )
    )
    assert new == ref["greedy_ids"].tolist()
    stepped = np.empty((len(ids), m.config.vocab_size), np.float32)  # one token at a time
    tokens = np.asarray(ids, np.int32)
    for t in range(len(ids)):
        assert m._engine.run(tokens[t : t + 1], t, stepped[t : t + 1], True)[0] == 0
    assert np.abs(stepped - expected).max() <= REL_TOL * np.abs(expected).max()


def test_sliding_layers_keep_only_their_window(converted):
    ref = reference("gemma4_a")
    c = colibri.load(converted("gemma4_a")).config
    chunk, n_ctx = 16, 1024
    m = colibri.load(converted("gemma4_a"), n_ctx=n_ctx, prefill_chunk=chunk)
    rows = {i: (c.sliding_window + chunk if t == "sliding_attention" else n_ctx) for i, t in enumerate(c.layer_types)}
    expected = sum(2 * 4 * rows[i] * c.layer_kv_heads_of(i) * c.layer_head_dim(i) for i in rows)
    assert m.kv_cache_bytes == expected
    full_cache = sum(2 * 4 * n_ctx * c.layer_kv_heads_of(i) * c.layer_head_dim(i) for i in rows)
    assert m.kv_cache_bytes < full_cache
    assert np.abs(m.forward(ref["input_ids"]) - ref["logits_f32"]).max() <= REL_TOL * np.abs(ref["logits_f32"]).max()


def test_converted_layout_of_the_gemma_layer(converted):
    cfg = json.loads((converted("gemma4_a") / "config.json").read_text())
    model, names = cfg["model"], set(cfg["tensors"])
    assert model["architecture"] == "gemma4" and model["moe_block"] == "parallel" and model["hidden_act"] == "gelu_tanh"
    assert model["layer_types"] == [
        "sliding_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
    ]
    assert model["layer_head_dims"] == [16, 16, 32, 16, 32] and model["layer_kv_heads"] == [2, 2, 1, 2, 1]
    assert model["layer_rope_fraction"] == [1.0, 1.0, 0.25, 1.0, 0.25]
    assert model["embedding_scale"] == pytest.approx(8.0) and model["final_logit_softcapping"] == 3.0
    for layer in range(5):
        p = f"layers.{layer}."
        for t in (
            "post_attn_norm",
            "post_ffn_norm",
            "post_mlp_norm",
            "pre_moe_norm",
            "post_moe_norm",
            "router_scale",
            "expert_scale",
            "layer_scalar",
            "mlp.gate",
            "experts.7.down",
            "q_norm",
            "k_norm",
        ):
            assert p + t in names, p + t
        # attention_k_eq_v: full-attention layers have no v projection
        assert (p + "wv" in names) == (model["layer_types"][layer] == "sliding_attention")
    assert cfg["tensors"]["layers.2.wq"]["shape"] == [4 * 32, 64]
    assert cfg["tensors"]["layers.2.wk"]["shape"] == [1 * 32, 64]
    assert cfg["tensors"]["layers.0.wk"]["shape"] == [2 * 16, 64]


def test_multimodal_checkpoint_converts_its_text_model(tmp_path):
    said = []
    convert(FIXTURES / "gemma4_b" / "hf", tmp_path / "m", log=said.append)
    assert any("Gemma4ForConditionalGeneration" in line and "vision" in line and "ignoring" in line for line in said)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert not any("vision" in n or "tower" in n for n in cfg["tensors"])
    assert cfg["source"]["hf_architecture"] == "Gemma4ForConditionalGeneration"


def test_multimodal_config_takes_special_tokens_from_the_top_level(tmp_path):
    """google/gemma-4-* configs keep eos_token_id ([1, 106]) beside text_config, not in it."""

    def edit(cfg):
        cfg["text_config"].pop("eos_token_id", None)
        cfg["eos_token_id"] = [2, 5]

    hf = _edited_checkpoint(tmp_path, edit, case="gemma4_b")
    convert(hf, tmp_path / "m", log=lambda *a: None)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model"]["eos_token_id"] == [2, 5]


def _edited_checkpoint(tmp_path, edit, case="gemma4_a"):
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / case / "hf", hf)
    cfg = json.loads((hf / "config.json").read_text())
    edit(cfg)
    (hf / "config.json").write_text(json.dumps(cfg))
    return hf


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("hidden_size_per_layer_input", 16, "per-layer input embeddings"),
        ("num_kv_shared_layers", 2, "num_kv_shared_layers"),
        ("enable_moe_block", False, "dense Gemma 4"),
        ("use_bidirectional_attention", "all", "use_bidirectional_attention"),
        ("hidden_activation", "silu", "hidden_activation"),
        (
            "rope_parameters",
            {
                "sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            },
            "RoPE",
        ),
    ],
)
def test_unsupported_gemma4_variants_are_refused_by_name(tmp_path, field, value, message):
    hf = _edited_checkpoint(tmp_path, lambda c: c.__setitem__(field, value))
    with pytest.raises(colibri.ColibriError, match=message):
        convert(hf, tmp_path / "out", log=lambda *a: None)
    assert not (tmp_path / "out").exists()


def test_cli_info_shows_the_layer_geometry(converted, capsys):
    from colibri.cli import main

    assert main(["info", "--model-dir", str(converted("gemma4_a"))]) == 0
    out = capsys.readouterr().out
    assert "gemma4" in out and "3 sliding-window layers (window 8), 2 full" in out
    assert "head_dim 32, 1 kv heads" in out and "on 0.25 of the pairs" in out


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_paths_against_transformers_on_the_same_weights(converted, dtype):
    """The engine's int8/int4 output is the stored weights' output: against transformers run on
    exactly the weights the format holds, only activation quantization remains."""
    ref = reference("gemma4_b")
    logits = colibri.load(converted("gemma4_b", dtype)).forward(ref["input_ids"])
    assert kl_mean(ref[f"logits_{dtype}w"], logits) <= KL_SAME_WEIGHTS_MAX


def test_int8_quality_against_f32(converted):
    ref = reference("gemma4_b")
    logits = colibri.load(converted("gemma4_b", "int8")).forward(ref["input_ids"])
    assert kl_mean(ref["logits_f32"], logits) <= KL_INT8_VS_F32_MAX
    assert (logits.argmax(-1) == ref["logits_f32"].argmax(-1)).mean() >= TOP1_INT8_MIN


def test_routing_matches_transformers_router(converted):
    """The experts and weights of the last prompt position in every layer: transformers' router
    probabilities (recorded by make_fixtures.py), top-k, renormalised, times per_expert_scale."""
    from colibri.hfcheckpoint import HFCheckpoint

    ref = reference("gemma4_a")
    ckpt = HFCheckpoint(FIXTURES / "gemma4_a" / "hf")
    m = colibri.load(converted("gemma4_a"))
    m.forward(ref["input_ids"])
    experts, weights = m.routing
    k = m.config.num_experts_per_tok
    for layer in range(m.config.num_hidden_layers):
        p = np.exp(ref["router_logits_f32"][layer, -1].astype(np.float64))  # log-probabilities
        top = np.argsort(-p, kind="stable")[:k]
        scale = ckpt.f32(f"model.layers.{layer}.router.per_expert_scale")
        expected = dict(zip(top.tolist(), p[top] / p[top].sum() * scale[top]))
        got = dict(zip(experts[layer].tolist(), weights[layer].tolist()))
        assert set(got) == set(expected), layer
        for e in got:
            assert got[e] == pytest.approx(expected[e], rel=1e-5)
