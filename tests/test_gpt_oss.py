"""gpt-oss: what the generic checks of test_models.py do not cover.

test_models.py holds both gpt-oss cases (tools/make_fixtures.py) to transformers' f32, bf16 and
f16 logits, greedy tokens and decode == forward: attention sinks, sliding and full layers with a
window shorter than the prompt, biases everywhere, the router's bias, the clamped SwiGLU with its
clamp hit, YaRN. Here: the mxfp4 format (the checkpoint's blocks kept byte for byte, its kernels
against the numbers it holds, its quantizer), the int8 / int4 / mxfp4 paths against transformers
on the very weights those formats store, that the distinctive parts matter, the expert budget,
and the refusals.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import colibri
from colibri import quant
from colibri.modeldir import MappedModelDir, ModelDir
from conftest import FIXTURES, colibri as run_cli, kl_mean, one_line_error, reference

REL_TOL = 1e-4  # float32 rounding only (as test_models.py)
# against transformers on exactly the weights the format stores: what is left is the per-block
# int8 quantization of the activations (measured on gpt_oss_a: int8 5.6e-4, int4 9.2e-4, mxfp4
# 7.8e-5; gpt_oss_b mxfp4 1.4e-4); the fixture was drawn with no expert choice closer than 2e-3
# in probability, f32 or quantized; rounding every product's input as Colibri does (make_fixtures'
# hook) still flips one int4 choice (MoE layer 2, token 10: that position's KL 5.5e-3), which the
# mean stays under. test_gemma4.py's bound.
KL_SAME_WEIGHTS_MAX = 1e-3


def convert_args(hf, out, *extra):
    return ("convert", "--hf-dir", hf, "--output-dir", out, *extra)


@pytest.mark.parametrize("dtype", ["int8", "int4", "mxfp4"])
def test_quantized_paths_against_transformers_on_the_same_weights(converted, dtype):
    ref = reference("gpt_oss_a")
    logits = colibri.load(converted("gpt_oss_a", dtype)).forward(ref["input_ids"])
    assert kl_mean(ref[f"logits_{dtype}w"], logits) <= KL_SAME_WEIGHTS_MAX


def test_mxfp4_checkpoint_kept_as_mxfp4_matches_transformers(converted):
    """gpt_oss_b's experts are the checkpoint's mxfp4 (its other weights bf16): converted with
    --quantize mxfp4 nothing is rounded, so only the activations' int8 rounding remains (the bf16
    matrices with exact f32 products, as transformers computes them)."""
    ref = reference("gpt_oss_b")
    m = colibri.load(converted("gpt_oss_b", "mxfp4"), bf16_products="f32")
    assert kl_mean(ref["logits_f32"], m.forward(ref["input_ids"])) <= KL_SAME_WEIGHTS_MAX
    out = list(m.generate(ref["input_ids"], max_new_tokens=len(ref["greedy_ids"]), stop_at_eos=False))
    assert np.mean(np.asarray(out) == ref["greedy_ids"]) >= 0.9


def test_mxfp4_blocks_and_scales_are_the_checkpoints_byte_for_byte(converted):
    from safetensors import safe_open

    md = MappedModelDir(ModelDir(converted("gpt_oss_b", "mxfp4")))
    cfg = md.md.config
    with safe_open(FIXTURES / "gpt_oss_b" / "hf" / "model.safetensors", "np") as f:
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}.mlp.experts."
            gate_up = (f.get_tensor(p + "gate_up_proj_blocks"), f.get_tensor(p + "gate_up_proj_scales"))
            down = (f.get_tensor(p + "down_proj_blocks"), f.get_tensor(p + "down_proj_scales"))
            for e in range(cfg.num_experts):
                for part, (blocks, scales), rows in (
                    ("gate", gate_up, slice(0, None, 2)),
                    ("up", gate_up, slice(1, None, 2)),
                    ("down", down, slice(None)),
                ):
                    name = f"layers.{layer}.experts.{e}.{part}"
                    assert md.md.tensors[name]["dtype"] == "mxfp4"
                    assert md.md.tensors[name].get("layout") == "interleaved"  # the default
                    b, s = quant.to_mx(np.asarray(md.rows_array(name)), md.md.tensors[name]["shape"][1])
                    np.testing.assert_array_equal(b, blocks[e, rows])
                    np.testing.assert_array_equal(s, scales[e, rows])
    assert md.md.tensors["layers.0.wq"]["dtype"] == "bf16"  # the rest as the checkpoint keeps it
    md.close()


def test_mxfp4_checkpoint_converts_exactly_to_f32(converted):
    """Dequantized at convert, the f32 model is transformers' (test_models also checks this
    through the generic cases); and the f32 experts are exactly the mxfp4 values."""
    md = MappedModelDir(ModelDir(converted("gpt_oss_b", "f32")))
    mx = MappedModelDir(ModelDir(converted("gpt_oss_b", "mxfp4")))
    name = "layers.1.experts.2.down"
    cols = mx.md.tensors[name]["shape"][1]
    np.testing.assert_array_equal(
        np.asarray(md.array(name)), quant.dequantize(np.asarray(mx.rows_array(name)), "mxfp4", cols)
    )
    md.close()
    mx.close()


def _edited(converted, tmp_path, case, dtype, edit):
    d = tmp_path / "m"
    shutil.copytree(converted(case, dtype), d)
    edit(d)
    return d


def test_the_sinks_matter(converted, tmp_path):
    """Sinks pushed to -1e4 (no weight in any softmax) change the logits far beyond tolerance."""
    ref = reference("gpt_oss_a")

    def no_sinks(d):
        md = ModelDir(d)
        for layer in range(md.config.num_hidden_layers):
            t = md.tensors[f"layers.{layer}.sinks"]
            with open(d / t["file"], "r+b") as f:
                f.seek(t["offset"])
                f.write(np.full(t["shape"], -1e4, np.float32).tobytes())  # (sizes kept; verify would object)

    logits = colibri.load(_edited(converted, tmp_path, "gpt_oss_a", "f32", no_sinks)).forward(ref["input_ids"])
    assert np.abs(logits - ref["logits_f32"]).max() > 100 * REL_TOL * np.abs(ref["logits_f32"]).max()


def test_window_and_sinks_under_a_wrapping_ring(converted):
    """prefill_chunk=2: each sliding layer's cache is a ring of window + 2 rows, wrapped many
    times over the prompt and the greedy tokens; every position still matches transformers."""
    ref = reference("gpt_oss_a")
    m = colibri.load(converted("gpt_oss_a"), prefill_chunk=2)
    assert len(ref["input_ids"]) + len(ref["greedy_ids"]) > 4 * (m.config.sliding_window + 2)
    logits = m.forward(ref["input_ids"])
    assert np.abs(logits - ref["logits_f32"]).max() <= REL_TOL * np.abs(ref["logits_f32"]).max()
    out = list(m.generate(ref["input_ids"], max_new_tokens=len(ref["greedy_ids"]), stop_at_eos=False))
    assert out == ref["greedy_ids"].tolist()


def test_info_names_the_features(converted):
    r = run_cli("info", "--model-dir", str(converted("gpt_oss_b", "mxfp4")))
    assert r.returncode == 0, r.stderr
    assert "gpt_oss" in r.stdout and "weights:      mxfp4" in r.stdout
    assert "attention sinks (8 logits a layer)" in r.stdout and "clamped SwiGLU (alpha 1.702, limit 2)" in r.stdout
    assert "1 sliding-window layers (window 5), 1 full" in r.stdout
    assert "KV cache:     128 bytes a token" in r.stdout  # 2 layers x (k + v) x 1 head x 8 x 4 bytes


def test_mxfp4_transposed_is_refused_and_rows_is_the_same_model(converted, tmp_path):
    r = run_cli(
        *convert_args(
            FIXTURES / "gpt_oss_b" / "hf", tmp_path / "o", "--quantize", "mxfp4", "--expert-layout", "transposed"
        )
    )
    one_line_error(r, "--expert-layout (--quantize mxfp4): mxfp4 has no transposed layout, only rows or interleaved")
    assert not (tmp_path / "o").exists()
    from colibri.convert import convert

    convert(
        FIXTURES / "gpt_oss_b" / "hf", tmp_path / "rows", quantize="mxfp4", expert_layout="rows", log=lambda *a: None
    )
    ref = reference("gpt_oss_b")
    rows = colibri.load(tmp_path / "rows").forward(ref["input_ids"])
    interleaved = colibri.load(converted("gpt_oss_b", "mxfp4")).forward(ref["input_ids"])
    assert ModelDir(tmp_path / "rows").tensors["layers.0.experts.1.up"].get("layout", "rows") == "rows"
    assert kl_mean(rows, interleaved) < 1e-6


def test_nan_scales_are_refused(tmp_path):
    """An e8m0 scale of 255 (NaN) in the checkpoint is one clear line, nothing written."""
    from colibri.hfcheckpoint import SafetensorsFile

    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / "gpt_oss_b" / "hf", hf)
    st_file = SafetensorsFile(hf / "model.safetensors")
    _, shape, begin = st_file.entries["model.layers.1.mlp.experts.down_proj_scales"]  # U8 [E, out, in / 32]
    with open(hf / "model.safetensors", "r+b") as f:
        f.seek(st_file.data_start + begin + (2 * shape[1] + 5) * shape[2] + 1)  # [2, 5, 1]
        f.write(bytes([255]))
    for q in ("mxfp4", "f32"):
        r = run_cli(*convert_args(hf, tmp_path / q, "--quantize", q))
        one_line_error(r, "layers.1.experts.2.down", "NaN")
        assert not (tmp_path / q).exists()


def test_unknown_quantization_is_refused(tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / "gpt_oss_b" / "hf", hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "awq"
    (hf / "config.json").write_text(json.dumps(cfg))
    one_line_error(run_cli(*convert_args(hf, tmp_path / "o")), "quant_method 'awq' is not supported")


# ---- the mxfp4 format --------------------------------------------------------------------------

finite = st.floats(-1e6, 1e6, width=32) | st.sampled_from([0.0, -0.0, 1e-38, 6.0, -3.0, 0.25, 0.75])


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 6).flatmap(
        lambda rows: st.integers(1, 5).flatmap(lambda nb: hnp.arrays(np.float32, (rows, 32 * nb), elements=finite))
    )
)
def test_mxfp4_quantizer_picks_the_scale_and_the_nearest_value(w):
    """Per block: the smallest power-of-two scale with max |w| / scale <= 6, every weight the
    nearest e2m1 value times it (a tie to either neighbour), signs kept; and the stored bytes
    round-trip through the checkpoint's blocks / scales split."""
    stored = quant.quantize(w, "mxfp4")
    blocks, scales = quant.to_mx(stored, w.shape[1])
    np.testing.assert_array_equal(quant.from_mx(blocks, scales), stored)
    back = quant.dequantize(stored, "mxfp4", w.shape[1]).astype(np.float64).reshape(w.shape[0], -1, 32)
    x = w.astype(np.float64).reshape(w.shape[0], -1, 32)
    scale = np.ldexp(1.0, scales.astype(np.int64) - 127)[..., None]
    amax = np.abs(x).max(axis=2, keepdims=True)
    assert (scales < 255).all()
    assert np.all((amax <= 6 * scale) | (scales[..., None] == 254))
    assert np.all((amax > 3 * scale) | (scales[..., None] == 0) | (amax == 0))  # no smaller scale fits
    levels = np.concatenate([-quant.FP4_VALUES[:8][::-1], quant.FP4_VALUES[:8]])
    nearest = np.abs((x / scale)[..., None] - levels).min(axis=-1) * scale
    assert np.all(np.abs(back - x) <= nearest * (1 + 1e-9) + 1e-300)
    assert np.all((back == 0) | (np.sign(back) == np.sign(x)))


def test_mxfp4_dequantizes_as_transformers_does():
    """transformers' convert_moe_packed_tensors: lut[low nibble] for element 2j, lut[high] for
    2j + 1, times ldexp(1, scale - 127)."""
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, (5, 3, 16), dtype=np.uint8)
    scales = rng.integers(100, 140, (5, 3), dtype=np.uint8)
    got = quant.dequantize(quant.from_mx(blocks, scales), "mxfp4", 96)
    want = np.empty((5, 3, 32), np.float32)
    want[..., 0::2] = quant.FP4_VALUES[blocks & 0x0F]
    want[..., 1::2] = quant.FP4_VALUES[blocks >> 4]
    want *= np.ldexp(np.float32(1), scales.astype(np.int32) - 127)[..., None]
    np.testing.assert_array_equal(got, want.reshape(5, 96))
