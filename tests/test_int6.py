"""int6: the 6-bit format (csrc/quant.h cb_igroup_int6, colibri/quant.py).

Its kernels on every tier and int step against the exact product of its dequantized weights and
the quantized activations, prefill against decode bit for bit; the extremes of its integer sums;
the interleaved group's bytes against the documented packing; quantize / dequantize / interleave
round trips against the C reader; its error against int8's and int4's and its use of importance;
and a model whose head and attention are int6 beside nl4 experts, against f32.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import colibri
from colibri import _kernels, _probes, quant
from colibri.modeldir import ModelDir, tensor_role

from conftest import FIXTURES, float32_dot_bound, kl_mean, reference
from test_nl4 import _quantize_act, interleaved_case


def _exact_weights(stored, cols):
    """The stored rows form's weights, exactly (scale x (u - 32) in float64), read bit by bit
    from the documented packing (not through quant.dequantize)."""
    rows = len(stored)
    blocks = np.ascontiguousarray(stored).view(quant.BLOCK_DTYPES["int6"]).reshape(rows, cols // 32)
    u = np.zeros((rows, cols // 32, 32), np.int64)
    for e in range(32):
        nib = blocks["qs"][..., e % 16] >> (4 * (e // 16)) & 15
        half, v, i = e // 16, (e % 16) // 4, e % 4
        byte, k = 4 * (v // 2) + i, 2 * (v % 2) + half
        u[..., e] = nib | (((blocks["qh"][..., byte] >> (2 * k)) & 3) << 4)
    d = blocks["d"].view(np.float16).astype(np.float64)[..., None]
    return (d * (u - 32)).reshape(rows, cols)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(interleaved_case(), st.sampled_from([1, 2]))
def test_int6_kernels_give_the_exact_product(isa, case, threads):
    """Every int step of the tier: the exact product within float32 error (integer block sums,
    then a scale product and an add per block), every step the same bits, and each token's
    decode the bits of the prefill."""
    w, x = case
    stored = quant.quantize(w, "int6")
    il = quant.interleave(stored, "int6", w.shape[1])
    exact = _exact_weights(stored, w.shape[1])
    np.testing.assert_array_equal(quant.dequantize(stored, "int6", w.shape[1]), exact.astype(np.float32))
    xr = np.stack([_quantize_act(row) for row in x])
    bound = float32_dot_bound(np.abs(xr) @ np.abs(exact).T, w.shape[1] // 16 + 3)
    results = {}
    for step in _kernels.available_int_steps():
        with _kernels.int_kernels(step):
            results[step] = _probes.kernel_matmul(il, x, "int6", threads, "interleaved")
            decoded = np.stack([_probes.kernel_matvec(il, row, "int6", threads, "interleaved") for row in x[:3]])
        np.testing.assert_array_equal(decoded, results[step][:3], err_msg=f"{step}, decode")
        assert np.all(np.abs(results[step] - xr @ exact.T) <= bound), step
    first = next(iter(results.values()))
    for step, got in results.items():
        np.testing.assert_array_equal(got, first, err_msg=step)


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("u", [0, 63])
def test_int6_at_the_extremes_of_its_integer_sums(isa, u, sign):
    """Codes at both ends (u = 0: -32; u = 63: 31, whose vpmaddubsw pair sums of a low and a high
    vector reach 2 x 2 x 63 x 127 = 32004 in int16), activations at +-127, through every int
    step, prefill and decode, with enough groups (40) for the decode's side-by-side parts."""
    rows, cols = 320, 64
    blocks = np.zeros((rows, cols // 32), quant.BLOCK_DTYPES["int6"])
    blocks["qs"] = (u & 15) | ((u & 15) << 4)
    blocks["qh"] = 0xFF if u >> 4 else 0
    blocks["d"] = np.float16(2.0**-10).view(np.uint16)
    stored = blocks.view(np.uint8).reshape(rows, -1)
    il = quant.interleave(stored, "int6", cols)
    x = np.full((12, cols), sign * 3.0, np.float32)
    expect = _exact_weights(stored, cols) @ _quantize_act(x[0])
    np.testing.assert_allclose(expect, sign * cols * (u - 32) * 2.0**-10 * 3.0, rtol=1e-6)  # every code at its end
    for step in _kernels.available_int_steps():
        for n in (12, 1):
            with _kernels.int_kernels(step):
                got = _probes.kernel_matmul(il, x[:n], "int6", 1, "interleaved")
            np.testing.assert_allclose(got, np.broadcast_to(expect, got.shape), rtol=1e-6, err_msg=f"{step} {n}")


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_int6_interleave_round_trip_and_packing(groups, blocks, seed):
    """Interleaving is lossless; a group is int4's (8 f16 scales, then the low 4 bits where int4
    keeps its nibbles) followed by qh[p][r][i], whose bits 2k, 2k + 1 hold the high 2 bits of
    vector 2p + k / 2's low (k even) or high (k odd) nibble; and the C reader (the embedding
    lookup) gives quant.dequantize's floats."""
    rng = np.random.default_rng(seed)
    rows, cols = 8 * groups, 32 * blocks
    w = rng.standard_normal((rows, cols), dtype=np.float32)
    stored = quant.quantize(w, "int6")
    il = quant.interleave(stored, "int6", cols)
    assert il.size == rows * quant.row_bytes("int6", cols) == rows // 8 * blocks * 208
    np.testing.assert_array_equal(quant.to_rows(il, "int6", rows, cols, "interleaved"), stored)
    exact = _exact_weights(stored, cols)
    g = il.ravel().view(quant.IGROUP_DTYPES["int6"]).reshape(groups, blocks)
    b = stored.view(quant.BLOCK_DTYPES["int6"]).reshape(rows, blocks)
    gi, kb = groups - 1, blocks - 1
    for r in range(8):
        row = 8 * gi + r
        scale = np.float64(g[gi, kb]["d"][r].view(np.float16))
        assert g[gi, kb]["d"][r] == b[row, kb]["d"]
        for v in range(4):
            for i in range(4):
                byte, h = g[gi, kb]["qs"][v, r, i], g[gi, kb]["qh"][v // 2, r, i]
                lo = (byte & 15) | (((h >> (4 * (v % 2))) & 3) << 4)
                hi = (byte >> 4) | (((h >> (4 * (v % 2) + 2)) & 3) << 4)
                assert scale * (int(lo) - 32) == exact[row, 32 * kb + 4 * v + i]
                assert scale * (int(hi) - 32) == exact[row, 32 * kb + 16 + 4 * v + i]
    deq = quant.dequantize(stored, "int6", cols)
    for r in (0, rows - 1):
        np.testing.assert_array_equal(_probes.kernel_dequant_row(il, r, cols, "int6", "interleaved"), deq[r])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 2**32 - 1), st.sampled_from([1e-6, 1e-2, 1.0, 1e4]))
def test_int6_quantize_beats_round_to_nearest_and_keeps_zeros(groups, blocks, seed, scale):
    """The scale search (no importance: plain squared error) errs no more, block by block, than
    round to nearest from the block's signed extreme at -32 (its f16 scale rounded away from
    zero), which itself errs by at most a step (half a step, but
    the opposite extreme's, which +32 would hold, clips to 31); zero rows stay zeros. At
    1e-6 the scales are f16 subnormals."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((8 * groups, 32 * blocks)) * scale).astype(np.float32)
    w[0] = 0.0
    deq = quant.dequantize(quant.quantize(w, "int6"), "int6", w.shape[1])
    assert np.all(deq[0] == 0)
    b = w.reshape(w.shape[0], -1, 32)
    extreme = np.take_along_axis(b, np.abs(b).argmax(axis=2)[..., None], axis=2)
    d = (extreme / np.float32(-32)).astype(np.float16)
    short = np.abs(d.astype(np.float32)) < np.abs(extreme / np.float32(32))
    d = np.where(short, np.nextafter(d, np.copysign(np.float16(np.inf), d)), d).astype(np.float32)
    q = np.clip(np.rint(np.divide(b, d, out=np.zeros_like(b), where=d != 0)), -32, 31)
    rtn = d * q
    assert np.all(np.abs(rtn - b) <= np.abs(d) * (1 + 1e-6) + 1e-30)
    err = ((deq.reshape(b.shape) - b) ** 2).sum(axis=2)
    assert np.all(err <= ((rtn - b) ** 2).sum(axis=2) * (1 + 1e-5) + 1e-37)


def test_int6_between_int4_and_int8_and_follows_importance():
    """On Gaussian weights (seeded): int6's squared error is about a sixteenth of int4's (two
    more bits) and above int8's; with an importance vector the weighted error drops below the
    unweighted search's."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((256, 512)).astype(np.float32)
    imp = rng.gamma(0.5, 1.0, 512).astype(np.float32)
    err = {f: ((quant.dequantize(quant.quantize(w, f), f, 512) - w) ** 2).mean() for f in ("int4", "int6", "int8")}
    assert err["int8"] < err["int6"] < err["int4"] / 12, err
    plain = quant.dequantize(quant.quantize(w, "int6"), "int6", 512)
    weighted = quant.dequantize(quant.quantize(w, "int6", imp), "int6", 512)
    assert (imp * (weighted - w) ** 2).mean() < 0.97 * (imp * (plain - w) ** 2).mean()
    assert quant.row_bytes("int6", 512) * 8 == 512 * 6.5


def test_int6_head_and_attention_beside_nl4_experts(tmp_path):
    """A fixture converted with nl4 experts and int6 attention and head: its int6 matrices are
    interleaved, and the model diverges from f32 less
    than plain nl4 does and more than the same mix at int8 (KL over the prompt's positions)."""
    from colibri.convert import convert

    hf = FIXTURES / "mixtral_a" / "hf"
    convert(hf, tmp_path / "f32", quantize="f32", log=lambda *a: None)
    convert(hf, tmp_path / "nl4", quantize="nl4", log=lambda *a: None)
    for fmt in ("int6", "int8"):
        convert(hf, tmp_path / f"mix{fmt}", quantize="nl4", roles={"attention": fmt, "head": fmt}, log=lambda *a: None)
    md = ModelDir(tmp_path / "mixint6")
    int6 = {n: t.get("layout") for n, t in md.tensors.items() if t["dtype"] == "int6"}
    roles = {tensor_role(n) for n in int6}
    assert roles <= {"attention", "head", "embedding"} and {"attention"} < roles, int6
    assert set(int6.values()) == {"interleaved"}, int6
    ids = np.ascontiguousarray(reference("mixtral_a")["input_ids"], np.int32)
    ref = colibri.load(tmp_path / "f32").forward(ids)
    kl = {d: kl_mean(ref, colibri.load(tmp_path / d).forward(ids)) for d in ("nl4", "mixint6", "mixint8")}
    assert kl["mixint8"] < kl["mixint6"] < kl["nl4"], kl


def test_int6_out_of_its_layout_is_refused(tmp_path):
    """int6 exists only interleaved: a table entry that says rows is refused when the directory
    opens, naming the tensor; convert refuses the layout flags that ask for it."""
    from colibri.convert import convert
    from colibri.errors import ColibriError

    hf = FIXTURES / "mixtral_a" / "hf"
    with pytest.raises(
        ColibriError, match=re.escape("--layout (--quantize int6): int6 has no transposed layout, only interleaved")
    ):
        convert(hf, tmp_path / "x", quantize="int6", layout="transposed", log=lambda *a: None)
    assert not (tmp_path / "x").exists()
    convert(hf, tmp_path / "int6", quantize="int6", log=lambda *a: None)
    cfg_path = tmp_path / "int6" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    name = next(n for n, t in cfg["tensors"].items() if t["dtype"] == "int6")
    cfg["tensors"][name]["layout"] = "rows"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ColibriError, match=re.escape(f"{name}: int6 has no rows layout, only interleaved")):
        ModelDir(tmp_path / "int6")
