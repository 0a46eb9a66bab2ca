"""DeepSeek-V3 / Kimi K2: what the generic checks of test_models.py do not cover.

test_models.py holds both DeepSeek-V3 cases (tools/make_fixtures.py) to transformers' f32, bf16
and f16 logits, greedy tokens and decode == forward: multi-head latent attention with and without
the low-rank query, interleaved and plain RoPE pairs, YaRN's mscale on the softmax scale, the
grouped sigmoid router with its correction bias, shared experts, a dense first layer. Here: the
KV cache holds the latent (its bytes measured), the int8 / int4 paths against transformers on the
very weights those formats store, the absorbed projections' storage, refusals (the expert budget and the
memory limit: test_memcap.py; the correction bias choosing, never weighing: test_glm4moe.py).
"""

from __future__ import annotations

import json
import shutil

import pytest

import colibri
from colibri.modeldir import ModelDir
from conftest import FIXTURES, colibri as run_cli, kl_mean, one_line_error, reference

# against transformers on exactly the weights the format stores: what is left is the per-block
# int8 rounding of the activations. On deepseekv3_a it measures 1.2e-3 (int8) and 1.0e-3 (int4);
# rounding transformers' own linear inputs the same way gives 1.04e-3 against the same reference
# (tools/make_fixtures.py activation_rounding_flips, which rounds the routed experts' inputs too
# since d99aad8; the fixture was drawn with no expert choice that this rounding flips): 1.10e-3
# (int8) / 1.05e-3 (int4), and Colibri's int4 logits then match to KL 5e-14, its int8 ones to 3e-4 (from position 2 on: an
# input of layer 0's dense MLP there lies 2e-6 of a step from a rounding tie, which the float32
# summation order decides)
KL_SAME_WEIGHTS_MAX = 3e-3


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_paths_against_transformers_on_the_same_weights(converted, dtype):
    ref = reference("deepseekv3_a")
    logits = colibri.load(converted("deepseekv3_a", dtype)).forward(ref["input_ids"])
    assert kl_mean(ref[f"logits_{dtype}w"], logits) <= KL_SAME_WEIGHTS_MAX


@pytest.mark.parametrize("case", ["deepseekv3_a", "deepseekv3_b"])
def test_the_kv_cache_holds_the_latent(converted, case):
    """kv_lora_rank + qk_rope_head_dim float32 numbers a token a layer, nothing else: the
    engine's cache arrays measured, against what full keys and values would take."""
    hf = json.loads((FIXTURES / case / "hf" / "config.json").read_text())
    n_ctx = 64
    m = colibri.load(converted(case), n_ctx=n_ctx)
    latent = hf["kv_lora_rank"] + hf["qk_rope_head_dim"]
    assert m.kv_cache_bytes == hf["num_hidden_layers"] * n_ctx * latent * 4
    full = hf["num_attention_heads"] * (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"] + hf["v_head_dim"])
    assert m.kv_cache_bytes < hf["num_hidden_layers"] * n_ctx * full * 4
    ref = reference(case)  # and the model still decodes from it
    out = list(m.generate(ref["input_ids"], max_new_tokens=len(ref["greedy_ids"]), stop_at_eos=False))
    assert out == ref["greedy_ids"].tolist()


@pytest.mark.parametrize(
    "dtype, absorbed", [("f32", "f32"), ("bf16", "f32"), ("f16", "f16"), ("int8", "f16"), ("int4", "f16")]
)
def test_absorbed_projections_are_float(converted, dtype, absorbed):
    """wkb / wvb are multiplied per head without quantized activations: f32 (holding the
    bf16-rounded values in a bf16 model) or f16."""
    md = ModelDir(converted("deepseekv3_a", dtype))
    for name in ("layers.1.wkb", "layers.1.wvb"):
        assert md.tensors[name]["dtype"] == absorbed
        assert md.tensors[name].get("layout", "rows") == "rows"


def test_info_names_the_latent_attention(converted):
    r = run_cli("info", "--model-dir", str(converted("deepseekv3_a")))
    assert r.returncode == 0, r.stderr
    assert "deepseek_v3" in r.stdout and "multi-head latent: a latent of 32 + a shared RoPE key of 8" in r.stdout
    assert "low-rank query 48" in r.stdout and "KV cache:     480 bytes a token" in r.stdout  # 3 layers x 40 x 4
    assert "sigmoid router, 4 groups (best 2)" in r.stdout


def test_attention_bias_is_refused(tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / "deepseekv3_b" / "hf", hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["attention_bias"] = True
    (hf / "config.json").write_text(json.dumps(cfg))
    one_line_error(
        run_cli("convert", "--hf-dir", hf, "--output-dir", tmp_path / "o"),
        "attention_bias true is not supported with multi-head latent attention",
    )
    assert not (tmp_path / "o").exists()
