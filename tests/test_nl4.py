"""nl4: the non-linear 4-bit format (csrc/quant.h cb_igroup_nl4, colibri/quant.py).

Its kernels on every tier and int step against the exact product of its dequantized weights and
the quantized activations, prefill against decode bit for bit; the extremes of its integer sums;
the interleaved group's bytes against the documented packing; quantize / dequantize / interleave
round trips against the C reader; the quantizer's error against int4's and its use of
importance; and a whole model converted to nl4 against f32.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import colibri
from colibri import _kernels, _probes, quant
from colibri.modeldir import ModelDir

from conftest import FIXTURES, float32_dot_bound, kl_mean, reference


def _quantize_act(x):
    """numpy mirror of the activation quantization (test_kernels._quantize_act): the values the
    kernels multiply, float64."""
    b = x.reshape(-1, 32)
    amax = np.abs(b).max(axis=1)
    d = np.where(amax >= np.float32(1e-30), amax / np.float32(127), 0).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint((b * inv[:, None]).astype(np.float32)).astype(np.float64)
    return (q * d[:, None].astype(np.float64)).reshape(-1)


def _exact_weights(stored, cols):
    """The stored rows form's weights, exactly (row scale x sub x code in float64)."""
    blocks, row_scale = quant._nl4_parts(stored, cols)
    qs = blocks["qs"]
    v = quant.NL4_VALUES[np.concatenate([qs & 0x0F, qs >> 4], axis=2)].astype(np.float64)
    sub = np.repeat(blocks["sc"].astype(np.float64) - quant.NL4_SCALE_BIAS, 16, axis=2)
    return (row_scale.astype(np.float64)[:, None, None] * sub * v).reshape(len(stored), cols)


def _assert_exact_product(out, stored, x):
    """out [n, rows] is x (quantized per block) times the stored matrix within float32 error: the
    integer half-block sums are exact; each half rounds its scale product and its add, then the
    row scale rounds once."""
    w = _exact_weights(stored, x.shape[1])
    xr = np.stack([_quantize_act(row) for row in x])
    bound = float32_dot_bound(np.abs(xr) @ np.abs(w).T, x.shape[1] // 8 + 3)
    assert np.all(np.abs(out - xr @ w.T) <= bound)


@st.composite
def interleaved_case(draw):
    """(weights [8 k, 32 m] at one of three scales, tokens [n, 32 m]): an interleaved product
    (nl4's, and test_int6's)."""
    rows, cols = 8 * draw(st.integers(1, 83)), 32 * draw(st.sampled_from([1, 2, 3, 7, 10, 31, 33]))
    n = draw(st.integers(1, 23))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0]))
    return (
        rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(scale),
        rng.standard_normal((n, cols), dtype=np.float32),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(interleaved_case(), st.sampled_from([1, 2]))
def test_nl4_kernels_give_the_exact_product(isa, case, threads):
    """Every int step of the tier: the exact product within float32 error, every step the same
    bits, and each token's decode the bits of the prefill."""
    w, x = case
    stored = quant.quantize(w, "nl4")
    il = quant.interleave(stored, "nl4", w.shape[1])
    results = {}
    for step in _kernels.available_int_steps():
        with _kernels.int_kernels(step):
            results[step] = _probes.kernel_matmul(il, x, "nl4", threads, "interleaved")
            decoded = np.stack([_probes.kernel_matvec(il, row, "nl4", threads, "interleaved") for row in x[:3]])
        np.testing.assert_array_equal(decoded, results[step][:3], err_msg=f"{step}, decode")
        _assert_exact_product(results[step], stored, x)
    first = next(iter(results.values()))
    for step, got in results.items():
        np.testing.assert_array_equal(got, first, err_msg=step)


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("code", [0, 15])
def test_nl4_at_the_extremes_of_its_integer_sums(isa, code, sign):
    """Codes at the codebook's ends (-64: 0 after the offset; 56: 120, whose vpmaddubsw pair sums
    reach 2 x 120 x 127 = 30480), sub-scales at -32 and 31, activations at +-127, through every
    int step, prefill and decode, with enough groups (40) for the decode's side-by-side parts."""
    rows, cols = 320, 64
    blocks = np.zeros((rows, cols // 32), quant.NL4_BLOCK)
    blocks["qs"] = code | (code << 4)
    blocks["sc"][..., 0] = 0  # sub -32
    blocks["sc"][..., 1] = 63  # sub 31
    scales = np.full(rows, 2.0**-10, "<f4")
    stored = np.concatenate([blocks.view(np.uint8).reshape(rows, -1), scales.view(np.uint8).reshape(rows, 4)], axis=1)
    il = quant.interleave(stored, "nl4", cols)
    x = np.full((12, cols), sign * 3.0, np.float32)
    expect = _exact_weights(stored, cols) @ _quantize_act(x[0])
    assert np.all(np.abs(expect) > 0)
    for step in _kernels.available_int_steps():
        for n in (12, 1):
            with _kernels.int_kernels(step):
                got = _probes.kernel_matmul(il, x[:n], "nl4", 1, "interleaved")
            np.testing.assert_allclose(got, np.broadcast_to(expect, got.shape), rtol=1e-6, err_msg=f"{step} {n}")


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_nl4_interleave_round_trip_and_packing(groups, blocks, seed):
    """Interleaving is lossless; a group's 12 scale bytes hold sub_lo + 32 in the low 6 bits of
    byte r with the low 2 bits of sub_hi + 32 above them and its high 4 bits in the nibble r % 2
    of byte 8 + r / 2; the codes sit where int4 keeps its nibbles; the row scales follow the
    groups; and the C reader (the embedding lookup) gives quant.dequantize's floats."""
    rng = np.random.default_rng(seed)
    rows, cols = 8 * groups, 32 * blocks
    w = rng.standard_normal((rows, cols), dtype=np.float32)
    stored = quant.quantize(w, "nl4")
    il = quant.interleave(stored, "nl4", cols)
    assert il.size == quant.nl4_bytes(rows, cols) == rows // 8 * blocks * 140 + 4 * rows
    np.testing.assert_array_equal(quant.to_rows(il, "nl4", rows, cols, "interleaved"), stored)
    b, row_scale = quant._nl4_parts(stored, cols)
    flat = il.ravel()
    g = flat[: rows // 8 * blocks * 140].view(quant.NL4_GROUP).reshape(groups, blocks)
    np.testing.assert_array_equal(flat[rows // 8 * blocks * 140 :].view("<f4"), row_scale)
    gi, kb = groups - 1, blocks - 1
    sc = g[gi, kb]["sc"].astype(int)
    for r in range(8):
        lo, hi = b[8 * gi + r, kb]["sc"].astype(int)
        assert sc[r] & 63 == lo and sc[r] >> 6 == hi & 3
        assert (sc[8 + r // 2] >> (4 * (r % 2))) & 15 == hi >> 2
        for unit in range(4):
            np.testing.assert_array_equal(g[gi, kb]["qs"][unit, r], b[8 * gi + r, kb]["qs"][4 * unit : 4 * unit + 4])
    deq = quant.dequantize(stored, "nl4", cols)
    for r in (0, rows - 1):
        np.testing.assert_array_equal(_probes.kernel_dequant_row(il, r, cols, "nl4", "interleaved"), deq[r])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 2**32 - 1), st.sampled_from([1e-6, 1e-2, 1.0, 1e4]))
def test_nl4_quantize_bounds_and_zeros(groups, blocks, seed, scale):
    """Every sub-scale within the quantizer's [-31, 31], every weight within a step of the
    codebook's widest gap of its half-block's scale; zero rows quantize to zeros."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((8 * groups, 32 * blocks)) * scale).astype(np.float32)
    w[0] = 0.0
    stored = quant.quantize(w, "nl4")
    b, row_scale = quant._nl4_parts(stored, w.shape[1])
    sub = b["sc"].astype(int) - quant.NL4_SCALE_BIAS
    assert sub.min() >= -quant.NL4_SUB_MAX and sub.max() <= quant.NL4_SUB_MAX
    deq = quant.dequantize(stored, "nl4", w.shape[1])
    assert np.all(deq[0] == 0)
    # a half-block's error: at most its scale x the codebook's widest gap (12) -- the chosen
    # scale fits the block, or the block's largest weight would have given a smaller error
    step = np.abs(np.repeat(sub, 16, axis=2).reshape(w.shape) * row_scale[:, None]) * 12
    assert np.all(np.abs(deq - w) <= np.maximum(step, np.abs(w)) * (1 + 1e-5) + 1e-30)


def test_nl4_errs_less_than_int4_and_follows_importance():
    """On Gaussian weights (seeded): nl4's squared error is well under int4's round to nearest
    at fewer bits a weight; with an importance vector the weighted error drops below the
    unweighted search's."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((256, 512)).astype(np.float32)
    imp = rng.gamma(0.5, 1.0, 512).astype(np.float32)
    e_int4 = ((quant.dequantize(quant.quantize(w, "int4"), "int4", 512) - w) ** 2).mean()
    plain = quant.dequantize(quant.quantize(w, "nl4"), "nl4", 512)
    weighted = quant.dequantize(quant.quantize(w, "nl4", imp), "nl4", 512)
    assert ((plain - w) ** 2).mean() < 0.75 * e_int4
    assert quant.nl4_bytes(256, 512) < 256 * quant.row_bytes("int4", 512)  # stored bytes
    assert (imp * (weighted - w) ** 2).mean() < 0.95 * (imp * (plain - w) ** 2).mean()
    with pytest.raises(ValueError, match="importance"):
        quant.quantize(w, "nl4", imp[:-1])


def test_nl4_model_against_f32(tmp_path):
    """A fixture converted to nl4 loads and diverges from its f32 conversion less than int4 does
    (KL over the prompt's positions); its nl4 matrices are interleaved, and a matrix without whole
    groups of 8 rows is int4 (prefill = decode: test_models, test_batched_prefill_equals_token_by_token)."""
    from colibri.convert import convert

    hf = FIXTURES / "mixtral_a" / "hf"
    for fmt in ("f32", "nl4", "int4"):
        convert(hf, tmp_path / fmt, quantize=fmt, log=lambda *a: None)
    md = ModelDir(tmp_path / "nl4")
    kinds = {(t["dtype"], t.get("layout", "rows")) for t in md.tensors.values() if t["dtype"] in ("nl4", "int4")}
    assert ("nl4", "interleaved") in kinds and all(k == ("nl4", "interleaved") or k[0] == "int4" for k in kinds)
    ids = np.ascontiguousarray(reference("mixtral_a")["input_ids"], np.int32)
    ref = colibri.load(tmp_path / "f32").forward(ids)
    kl = {fmt: kl_mean(ref, colibri.load(tmp_path / fmt).forward(ids)) for fmt in ("nl4", "int4")}
    assert kl["nl4"] < 0.8 * kl["int4"], kl


def test_nl4_out_of_its_layout_is_refused(tmp_path):
    """nl4 exists only interleaved: a table entry that says rows is refused when the directory
    opens, naming the tensor; convert and relayout refuse the layout flags that ask for it."""
    import json
    from colibri.convert import convert, relayout
    from colibri.errors import ColibriError

    hf = FIXTURES / "mixtral_a" / "hf"
    with pytest.raises(
        ColibriError, match=re.escape("--expert-layout (--quantize nl4): nl4 has no rows layout, only interleaved")
    ):
        convert(hf, tmp_path / "x", quantize="nl4", expert_layout="rows", log=lambda *a: None)
    assert not (tmp_path / "x").exists()
    convert(hf, tmp_path / "nl4", quantize="nl4", log=lambda *a: None)
    with pytest.raises(
        ColibriError, match=r"--layout \(.* holds nl4 matrices\): nl4 has no transposed layout, only interleaved"
    ):
        relayout(tmp_path / "nl4", tmp_path / "y", layout="transposed", log=lambda *a: None)
    cfg_path = tmp_path / "nl4" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    name = next(n for n, t in cfg["tensors"].items() if t["dtype"] == "nl4")
    cfg["tensors"][name]["layout"] = "rows"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ColibriError, match=re.escape(f"{name}: nl4 has no rows layout, only interleaved")):
        ModelDir(tmp_path / "nl4")


def test_nl4_from_a_k_quant_gguf(tmp_path):
    """A Q4_K_M GGUF converted to nl4: the blocks that are not Colibri's own are requantized, with
    their error reported, and it is below int4's."""
    from colibri.convert import convert

    errors = {}
    for fmt in ("nl4", "int4"):
        lines = []
        convert(None, tmp_path / fmt, quantize=fmt, gguf=FIXTURES / "gguf" / "mixtral_a-Q4_K_M.gguf", log=lines.append)
        line = next(x for x in lines if "relative RMS error" in x)
        assert f"stored in {fmt}" in line
        errors[fmt] = [float(e) for e in re.findall(r"Q\w+ ([0-9.]+) \(", line)]
    assert all(0 < n < 0.8 * i for n, i in zip(errors["nl4"], errors["int4"])), errors
    ids = np.ascontiguousarray(reference("mixtral_a")["input_ids"], np.int32)
    assert np.isfinite(colibri.load(tmp_path / "nl4").forward(ids)).all()
