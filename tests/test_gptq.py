"""Error-compensating quantization (colibri.gptq) and the second moments calibrate collects for it:
the output error against the diagonal path on correlated inputs, the diagonal case equal to the
diagonal path byte for byte, the engine's x x^T sums, the file's checks, and convert using them."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import colibri
from colibri import calibrate, quant
from colibri.convert import convert
from colibri.errors import ColibriError
from conftest import AS_LIMIT, FIXTURES, colibri as run_cli, kl_mean, one_line_error, reference

FORMATS = quant.SECOND_MOMENT_FORMATS


def _correlated(rng, cols, rank, n=4000):
    """A second moment of inputs that are a few directions plus noise, columns of unequal size (as
    hidden states are), and weights of a matching size."""
    basis = rng.standard_normal((cols, rank))
    x = rng.standard_normal((n, rank)) @ basis.T + 0.2 * rng.standard_normal((n, cols))
    x *= rng.uniform(0.3, 3.0, cols)
    return (x.T @ x / n).astype(np.float32)


def _output_error(w, stored, dtype, h):
    d = quant.dequantize(stored, dtype, w.shape[1]).astype(np.float64) - w
    return float(np.einsum("rc,cd,rd->", d, h.astype(np.float64), d))


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    dtype=st.sampled_from(FORMATS),
    rows=st.sampled_from([8, 24, 64]),
    nb=st.integers(2, 6),
    rank=st.integers(1, 12),
    seed=st.integers(0, 2**31 - 1),
)
def test_compensation_lowers_the_output_error_on_correlated_inputs(dtype, rows, nb, rank, seed):
    """Summed over the rows, (w - q)^T H (w - q) under the whole second moment is below the diagonal
    path's (the same scales' rule, each column rounded alone)."""
    rng = np.random.default_rng(seed)
    cols = 32 * nb
    h = _correlated(rng, cols, rank)
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    diag = quant.quantize(w, dtype, np.diagonal(h).copy())
    full = quant.quantize(w, dtype, h)
    assert full.shape == diag.shape and full.dtype == np.uint8
    assert _output_error(w, full, dtype, h) < _output_error(w, diag, dtype, h)


@settings(max_examples=16, deadline=None)
@given(
    dtype=st.sampled_from(FORMATS), rows=st.sampled_from([8, 16]), nb=st.integers(1, 5), seed=st.integers(0, 2**31 - 1)
)
def test_a_diagonal_second_moment_gives_the_diagonal_path_s_bytes(dtype, rows, nb, seed):
    """Uncorrelated inputs: no error has anywhere to go, so the bytes are the diagonal path's."""
    rng = np.random.default_rng(seed)
    cols = 32 * nb
    imp = rng.uniform(0.01, 4.0, cols).astype(np.float32)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    np.testing.assert_array_equal(quant.quantize(w, dtype, np.diag(imp)), quant.quantize(w, dtype, imp))


def test_an_indefinite_second_moment_falls_back_to_its_diagonal():
    """A second moment no dampening makes positive definite (here, strongly negative off the
    diagonal) leaves nothing to compensate with: the diagonal path's bytes."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    h = np.full((64, 64), -5.0, np.float32)
    np.fill_diagonal(h, 1.0)
    np.testing.assert_array_equal(quant.quantize(w, "int4", h), quant.quantize(w, "int4", np.diagonal(h).copy()))


def test_a_bad_second_moment_is_refused():
    w = np.ones((8, 64), np.float32)
    with pytest.raises(ValueError, match="second moment"):
        quant.quantize(w, "int4", np.ones((32, 32), np.float32))
    with pytest.raises(ValueError, match="not mxfp4"):
        quant.quantize(w, "mxfp4", np.eye(64, dtype=np.float32))
    bad = np.eye(64, dtype=np.float32)
    bad[3, 3] = np.nan
    with pytest.raises(ValueError, match="finite"):
        quant.quantize(w, "nl4", bad)


def test_the_engine_sums_x_x_t_beside_the_squares(converted):
    """The chosen matrices' sums: symmetric, positive semi-definite, their diagonal the squares'
    sums (to float32 rounding: csrc/gram.h sums a product's tokens in float32); the logits
    unchanged; a matrix that shares its owner's input (wk: wq's) collects nothing itself."""
    ids = reference("mixtral_a")["input_ids"]
    plain = colibri.load(converted("mixtral_a", "f32"))
    picked = lambda shapes: {n for n in shapes if n.endswith((".wq", ".experts.1.gate")) or n == "lm_head"}
    m = colibri.load(converted("mixtral_a", "f32"), capture_inputs=True, second_moments=picked)
    np.testing.assert_array_equal(m.forward(ids), plain.forward(ids))
    assert set(m.input_grams) == picked(m.input_stats)
    grams = calibrate.summarize_grams(m.input_grams, m.input_stats)
    assert grams
    for name, g in grams.items():
        stats = m.input_stats[name]
        np.testing.assert_allclose(np.diagonal(g), stats[:-1] / stats[-1], rtol=1e-5, atol=1e-12)
        np.testing.assert_array_equal(g, g.T)
        assert np.linalg.eigvalsh(g.astype(np.float64)).min() > -1e-4 * max(float(np.abs(g).max()), 1e-30), name
        if name.endswith(".wq"):  # the same input as wk / wv: their squares are the same sums
            np.testing.assert_array_equal(m.input_stats[name[:-3] + ".wk"], stats)


def test_many_tokens_a_product_and_one_at_a_time_sum_the_same(converted):
    """Products of many tokens (csrc/gram.h: the tokens transposed, then dot products) and of one
    token each (prefill_chunk=1: no transposition) give the same second moments, to float32
    rounding."""
    ids = reference("mixtral_a")["input_ids"]
    picked = lambda shapes: {n for n in shapes if n.endswith((".wq", ".experts.0.gate")) or n == "lm_head"}
    a = colibri.load(converted("mixtral_a", "f32"), capture_inputs=True, second_moments=picked)
    b = colibri.load(converted("mixtral_a", "f32"), capture_inputs=True, second_moments=picked, prefill_chunk=1)
    a.forward(ids)
    b.forward(ids)
    assert set(a.input_grams) == set(b.input_grams) == picked(a.input_stats)
    for name, g in a.input_grams.items():
        np.testing.assert_allclose(g, b.input_grams[name], rtol=1e-4, atol=1e-5 * float(np.abs(g).max()))


def test_which_matrices_collect_second_moments(monkeypatch):
    shapes = {
        "lm_head": (64, 32),
        "layers.0.wq": (32, 32),
        "layers.0.wk": (16, 32),
        "layers.0.wo": (32, 48),
        "layers.0.experts.0.gate": (48, 32),
        "layers.0.experts.0.up": (48, 32),
        "layers.0.experts.0.down": (32, 48),
    }
    assert calibrate.second_moment_names(shapes, "diag") == (frozenset(), "diag")
    dense = {"lm_head", "layers.0.wq", "layers.0.wo"}  # wk shares wq's input
    assert calibrate.second_moment_names(shapes, "dense") == (dense, "dense")
    assert calibrate.second_moment_names(shapes, "all") == (
        dense | {"layers.0.experts.0.gate", "layers.0.experts.0.down"},
        "all",
    )
    assert calibrate.second_moment_names(shapes, "auto") == (dense, "dense")
    assert calibrate.input_owner("layers.3.experts.5.up") == "layers.3.experts.5.gate"
    # a budget for two 32-wide inputs: the head first, then the narrowest; wo (48 wide) is left out
    monkeypatch.setattr(calibrate, "SECOND_MOMENT_BUDGET_MB", 2 * 32**2 * 8 / 2**20)
    lines = []
    assert calibrate.second_moment_names(shapes, "auto", lines.append) == ({"lm_head", "layers.0.wq"}, "dense")
    assert "2 of the 3 inputs" in lines[0]
    monkeypatch.setattr(calibrate, "SECOND_MOMENT_BUDGET_MB", 0.001)
    assert calibrate.second_moment_names(shapes, "auto") == (frozenset(), "diag")
    with pytest.raises(ColibriError, match="--second-moments"):
        calibrate.second_moment_names(shapes, "full")


def _second_moment_file(model_dir, ids, path, mode="all"):
    m = colibri.load(
        model_dir, capture_inputs=True, second_moments=lambda shapes: calibrate.second_moment_names(shapes, mode)[0]
    )
    m.forward(ids)
    calibrate.save(
        {
            "tensors": calibrate.summarize(m.input_stats),
            "grams": calibrate.summarize_grams(m.input_grams, m.input_stats),
            "meta": {"model_dir": str(model_dir), "architecture": "x", "tokens": len(ids), "ctx": len(ids)},
        },
        path,
    )


@pytest.mark.parametrize("dtype", ["int4", "nl4"])
def test_convert_with_second_moments_moves_the_logits_less(converted, tmp_path, dtype):
    """convert --importance with second moments: the log says how many matrices took them, and on
    the tokens calibrated on, the logits are nearer transformers' f32 ones than with the diagonals."""
    ids = reference("mixtral_a")["input_ids"]
    full, diag = tmp_path / "full.npz", tmp_path / "diag.npz"
    _second_moment_file(converted("mixtral_a", "f32"), ids, full)
    _second_moment_file(converted("mixtral_a", "f32"), ids, diag, "diag")
    assert any(k.startswith("gram/") for k in np.load(full).files)
    lines = []
    convert(FIXTURES / "mixtral_a" / "hf", tmp_path / "g", quantize=dtype, importance=full, log=lines.append)
    convert(FIXTURES / "mixtral_a" / "hf", tmp_path / "d", quantize=dtype, importance=diag, log=lambda s: None)
    assert any("whole second moment" in line for line in lines)
    want = reference("mixtral_a")["logits_f32"]
    kl_full = kl_mean(want, colibri.load(tmp_path / "g").forward(ids))
    kl_diag = kl_mean(want, colibri.load(tmp_path / "d").forward(ids))
    assert kl_full < kl_diag


def test_a_damaged_second_moment_is_one_line(tmp_path):
    hf = FIXTURES / "mixtral_a" / "hf"
    for i, gram in enumerate(
        [
            np.triu(np.ones((64, 64), np.float32)),  # not symmetric
            np.ones((3, 3), np.float32),  # not [cols, cols]
            np.eye(64).astype(np.float64),
        ]
    ):  # not float32
        path = tmp_path / f"bad{i}.npz"
        np.savez(
            path,
            meta=np.array(json.dumps({"format": calibrate.FORMAT})),
            **{
                "mean_sq/layers.0.wq": np.ones(64, np.float32),
                "count/layers.0.wq": np.array(3),
                "gram/layers.0.wq": gram,
            },
        )
        one_line_error(
            run_cli(
                "convert",
                "--hf-dir",
                hf,
                "--output-dir",
                tmp_path / f"o{i}",
                "--quantize",
                "int4",
                "--importance",
                path,
                limit=AS_LIMIT,
            ),
            f"bad{i}.npz",
            "layers.0.wq",
            "damaged",
        )
        assert not (tmp_path / f"o{i}").exists()
