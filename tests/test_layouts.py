"""The storage layouts of a weight matrix: `rows` ([out, in]), `transposed` ([in, out]) and, for
int8/int4 and bf16, `interleaved` (output-major groups of 8 outputs, 4 inputs at a time).

Kernels of every tier and format in the transposed and interleaved layouts against numpy and
against the rows layout; prefill (one matmul over n tokens) against decode (n matvecs), bit for
bit; the block re-ordering of quant.transpose / quant.interleave; whole models in every layout.
(The converter's layout choice: test_convert.py; the directory's layout checks: test_modeldir.py;
relayout: test_relayout.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import colibri
from colibri import _kernels, _probes, quant
from colibri.modeldir import ModelDir, from_storage, to_storage

from conftest import float32_dot_bound, reference

# matvec against float64: conftest.float32_dot_bound; the two layouts against each other (each
# within that bound of the exact product): twice it
# whole-model logits, f32 weights, against transformers (as tests/test_models.py)
F32_RTOL = 1e-4
# whole-model logits of the two layouts on a SIMD tier: max |diff| <= MODEL_RTOL * max |logit|
# (int8/int4: a re-quantized activation on a rounding boundary moves one level, as across tiers
# in test_kernels.INT_TIER_RTOL)
MODEL_RTOL = {"f32": 1e-5, "bf16": 1e-5, "int8": 1e-2, "int4": 1e-2}
FORMATS = ("f32", "f16", "bf16", "int8", "int4")
BLOCK = ("int8", "int4")
ISAS = _kernels.available_isas()


def _store(w, dtype):
    """float32 [rows, cols] -> (rows-layout storage, transposed storage)."""
    stored = to_storage(w, dtype)
    return stored, quant.transpose(stored, dtype, w.shape[1])


def _in_layout(w, dtype, layout):
    """float32 [rows, cols] -> its storage in `layout`."""
    return quant.from_rows(to_storage(w, dtype), dtype, w.shape[1], layout)


# (dtype, layout) pairs that exist: interleaved is for int8/int4 and bf16 here (mxfp4/nl4/int6 apart)
FORMAT_LAYOUTS = [(d, lay) for d in FORMATS for lay in quant.LAYOUTS if lay != "interleaved" or d in BLOCK + ("bf16",)]


def _exact(stored, dtype, cols):
    return from_storage(stored, dtype, cols).astype(np.float64)


def _quantize_act(x):
    """numpy mirror of the activation quantization (see test_kernels._quantize_act)."""
    b = x.reshape(-1, 32)
    amax = np.abs(b).max(axis=1)
    d = np.where(amax >= np.float32(1e-30), amax / np.float32(127), 0).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    return (np.rint(b * inv[:, None]).astype(np.float64) * d[:, None]).reshape(-1)


def _assert_exact_product(out, stored, dtype, x):
    """out [n, rows] is x [n, cols] (quantized per block) times the stored int8/int4 matrix, within
    float32 summation error of the exact product."""
    exact_w = _exact(stored, dtype, x.shape[1])
    xr = np.stack([_quantize_act(row) for row in x])
    bound = float32_dot_bound(np.abs(xr) @ np.abs(exact_w).T, x.shape[1] + 1)
    assert np.all(np.abs(out - xr @ exact_w.T) <= bound)


finite32 = st.floats(-4.0, 4.0, width=32, allow_nan=False)


@st.composite
def layout_case(draw):
    """(dtype, w [rows, cols], x [cols]): any shape the format allows (int8/int4: rows a multiple
    of 8, cols of 32; float formats: anything)."""
    dtype = draw(st.sampled_from(FORMATS))
    if dtype in BLOCK:
        rows, cols = 8 * draw(st.integers(1, 9)), 32 * draw(st.integers(1, 10))
    else:
        rows, cols = draw(st.integers(1, 70)), draw(st.integers(1, 300))
    w = draw(hnp.arrays(np.float32, (rows, cols), elements=finite32))
    x = draw(hnp.arrays(np.float32, cols, elements=finite32))
    return dtype, w, x


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout_case(), st.sampled_from([1, 2]))
def test_transposed_matvec_matches_numpy(isa, case, threads):
    dtype, w, x = case
    stored, t = _store(w, dtype)
    exact_w = _exact(stored, dtype, w.shape[1])
    xr = _quantize_act(x) if dtype in BLOCK else x.astype(np.float64)
    ours = _probes.kernel_matvec(t, x, dtype, threads, "transposed")
    ref = exact_w @ xr
    bound = float32_dot_bound(np.abs(exact_w) @ np.abs(xr), w.shape[1] + 1)
    assert np.all(np.abs(ours - ref) <= bound)


@settings(max_examples=60, deadline=None)
@given(layout_case())
def test_layouts_give_the_same_bits_on_the_scalar_tier(case):
    """The scalar transposed kernel adds every output's products in the order of the scalar dot
    product: the two layouts of one matrix are the same numbers, bit for bit."""
    dtype, w, x = case
    stored, t = _store(w, dtype)
    before = _kernels.isa()
    _kernels.select_isa("scalar")
    try:
        np.testing.assert_array_equal(
            _probes.kernel_matvec(t, x, dtype, 1, "transposed"), _probes.kernel_matvec(stored, x, dtype, 1)
        )
    finally:
        _kernels.select_isa(before)


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("shape", [(520, 1024), (1032, 96), (24, 4096), (8200, 64)])
def test_large_transposed_matvec_with_threads_agrees_with_rows(isa, dtype, shape):
    """Shapes past the threading threshold, split unevenly over 2 threads (520 = 65 groups of 8);
    8200 outputs: each thread's range takes two decode passes (CB_TDECODE_OUTPUTS = 4096)."""
    rng = np.random.default_rng(sum(shape))
    w = rng.standard_normal(shape, dtype=np.float32)
    x = rng.standard_normal(shape[1], dtype=np.float32)
    stored, t = _store(w, dtype)
    rows = _probes.kernel_matvec(stored, x, dtype, 2)
    one = _probes.kernel_matvec(t, x, dtype, 1, "transposed")
    two = _probes.kernel_matvec(t, x, dtype, 2, "transposed")
    np.testing.assert_array_equal(one, two)
    exact_w = _exact(stored, dtype, shape[1])
    xr = _quantize_act(x) if dtype in BLOCK else x.astype(np.float64)
    bound = 2 * float32_dot_bound(np.abs(exact_w) @ np.abs(xr), shape[1] + 1)
    assert np.all(np.abs(two - rows) <= bound)


@pytest.mark.parametrize("dtype,layout", FORMAT_LAYOUTS)
def test_prefill_product_equals_token_by_token(isa, dtype, layout):
    """cb_matmul over n tokens (4-token tiles, and for transposed output chunks sized for the
    cache) gives each token exactly the bits of its own matvec, for every n: prefill == decode."""
    rng = np.random.default_rng(7)
    rows, cols = 1040, 256
    w = rng.standard_normal((rows, cols), dtype=np.float32)
    mat = _in_layout(w, dtype, layout)
    x = rng.standard_normal((17, cols), dtype=np.float32)
    single = np.stack([_probes.kernel_matvec(mat, x[i], dtype, 2, layout) for i in range(17)])
    for n in (2, 5, 8, 9, 17):  # from 8 tokens the transposed int8/int4 product repacks its chunks
        np.testing.assert_array_equal(_probes.kernel_matmul(mat, x[:n], dtype, 2, layout), single[:n])


@st.composite
def repack_case(draw):
    """(dtype, w [rows, cols], x [n, cols]) for the repacked prefill: whole groups and blocks,
    past one 32-block pass (cols > 1024) and one chunk of groups (about 128 KB: 12 groups at
    cols 1280) sometimes, 8..23 tokens (from 8 the product repacks; tiles of 4 and their tails)."""
    dtype = draw(st.sampled_from(BLOCK))
    rows, cols = 8 * draw(st.integers(1, 40)), 32 * draw(st.sampled_from([1, 2, 3, 7, 31, 32, 33, 40]))
    n = draw(st.integers(8, 23))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols), dtype=np.float32)
    x = rng.standard_normal((n, cols), dtype=np.float32)
    return dtype, w, x


def test_int_steps_available_and_default(isa):
    """Every SIMD tier has the AVX2 step and the VNNI step emulated in AVX2 (for these tests), the
    VNNI steps where the CPU has them, and uses the fastest by default; the scalar tier its own. A
    step the tier or CPU lacks is a clear error and changes nothing."""
    from colibri import _os

    feats = _kernels.cpu_features()
    expect = ["scalar"]
    if isa != "scalar":
        expect = ["avx2", "vnni-emulated"] + (["avx-vnni"] if feats["avx_vnni"] else [])
        if isa == "avx512" and feats["avx512_vnni"]:
            expect += ["avx512-vnni"] + (["amx-emulated"] if _kernels.HAVE_AMX else [])
            lent = (
                _kernels.HAVE_AMX
                and feats["amx_tile"]
                and feats["amx_int8"]
                and feats["os_amx"]
                and _os.request_tile_data()[0]
            )
            # where the tile state is lent, the amx step must pass its import-time self-test: a
            # failure (the step then off, with a warning) fails here
            assert not lent or "amx" not in _kernels.failed_int_steps(), _kernels.amx_status()
            expect += ["amx"] if lent else []
    assert _kernels.available_int_steps() == expect
    fastest = [k for k in expect if k not in _kernels.EMULATED_INT_STEPS][-1]
    assert _kernels.int_step() == fastest
    for name in [k for k in _kernels.INT_STEPS if k not in expect] + ["vnni"]:
        with pytest.raises(ValueError, match="int step"):
            _kernels.set_int_step(name)
        assert _kernels.int_step() == fastest


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(repack_case(), st.sampled_from([1, 2]))
def test_repacked_prefill_gives_the_bits_of_the_stored_order(isa, case, threads):
    """Every int step of the tier (AVX2 maddubs, the VNNI step emulated and, where the CPU has it,
    real), with the prefill's repacked chunks (SIMD tiers, n >= 8) and with the stored-order tiles,
    against the default step's stored-order tiles bit for bit; the products also against numpy,
    and each token's decode (one matvec) is the same bits."""
    dtype, w, x = case
    stored, t = _store(w, dtype)
    args = (t, x, dtype, threads, "transposed")
    with _kernels.int_kernels(repack=False):
        plain = _probes.kernel_matmul(*args)
    for step in _kernels.available_int_steps():
        for repack in (True, False):
            with _kernels.int_kernels(step, repack):
                got = _probes.kernel_matmul(*args)
            np.testing.assert_array_equal(got, plain, err_msg=f"{step}, repack {repack}")
        with _kernels.int_kernels(step):
            decoded = np.stack([_probes.kernel_matvec(t, row, dtype, threads, "transposed") for row in x[:3]])
        np.testing.assert_array_equal(decoded, plain[:3], err_msg=f"{step}, decode")
    _assert_exact_product(plain, stored, dtype, x)


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("dtype", BLOCK)
def test_repacked_prefill_at_the_extremes_of_its_integer_sums(isa, dtype, sign):
    """Weights at their largest code (int8: 127, which the VNNI kernels store as 255; int4: nibble
    15 — the first weight of each block, -0.8, sets the scale so that 0.7 stores as 15 —, whose 8
    products of a block AVX2 sums in int16: 8 * 2 * 15 * 127 = 30480 must not wrap) and every
    activation at +-127, through every int step of the tier, prefill (repacked or not) and decode."""
    rows, cols, n = 16, 64, 12
    w = np.full((rows, cols), 0.7, np.float32)
    if dtype == "int4":
        w[:, ::32] = -0.8
    x = np.full((n, cols), sign * 3.0, np.float32)
    stored, t = _store(w, dtype)
    if dtype == "int4":
        assert (stored.view(np.uint8)[:, 3:18] == 0xFF).all()  # block 0 of each row: all but one nibble 15
    else:
        assert (stored.view(np.int8)[:, 2:34] == 127).all()
    expect = _exact(stored, dtype, cols) @ _quantize_act(x[0])
    for step in _kernels.available_int_steps():
        for repack, n in ((True, 12), (False, 12), (True, 1)):
            with _kernels.int_kernels(step, repack):
                got = _probes.kernel_matmul(t, x[:n], dtype, 1, "transposed")
            np.testing.assert_allclose(
                got, np.broadcast_to(expect, got.shape), rtol=1e-6, err_msg=f"{step} {repack} {n}"
            )
            assert np.sign(got).min() == sign


@st.composite
def interleaved_case(draw):
    """(dtype, w [rows, cols], x [n, cols]): whole groups and blocks, past one 32-block prefill
    pass (cols > 1024) sometimes, 1..23 tokens (decode; 4- and 8-token tiles and their tails), and
    enough groups for the decode's 4 side-by-side parts plus a remainder (up to 83 groups)."""
    dtype = draw(st.sampled_from(BLOCK))
    rows, cols = 8 * draw(st.integers(1, 83)), 32 * draw(st.sampled_from([1, 2, 3, 7, 31, 32, 33, 40]))
    n = draw(st.integers(1, 23))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return dtype, rng.standard_normal((rows, cols), dtype=np.float32), rng.standard_normal((n, cols), dtype=np.float32)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(interleaved_case(), st.sampled_from([1, 2]))
def test_interleaved_gives_the_bits_of_transposed(isa, case, threads):
    """The interleaved tiles of every int step of the tier against the transposed layout's
    default kernels, bit for bit (both add each output's blocks in order with the same
    arithmetic: on the scalar tier, the rows layout's), prefill and each token's decode; and
    against numpy."""
    dtype, w, x = case
    stored, t = _store(w, dtype)
    il = quant.interleave(stored, dtype, w.shape[1])
    want = _probes.kernel_matmul(t, x, dtype, threads, "transposed")
    for step in _kernels.available_int_steps():
        with _kernels.int_kernels(step):
            got = _probes.kernel_matmul(il, x, dtype, threads, "interleaved")
            decoded = np.stack([_probes.kernel_matvec(il, row, dtype, threads, "interleaved") for row in x[:3]])
        np.testing.assert_array_equal(got, want, err_msg=step)
        np.testing.assert_array_equal(decoded, want[:3], err_msg=f"{step}, decode")
    _assert_exact_product(want, stored, dtype, x)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.sampled_from(["int8", "int4", "int6", "mxfp4"]),
    st.integers(1, 40),
    st.sampled_from([1, 7, 8, 9, 17, 40]),
    st.integers(2, 9),
    st.integers(0, 2**32 - 1),
    st.sampled_from([1, 2]),
)
def test_few_tokens_give_each_tokens_decode(isa, dtype, groups, blocks, n, seed, threads):
    """A product of a few tokens (sequences decoded together; the AVX512-VNNI step's few-token tile
    reads 4 streams a thread and takes the tokens 2 at a time over chunks of 8 blocks) gives each
    token's decode bit for bit, with every int step of the tier: groups for 4 streams and a
    remainder, rows of less than one chunk, whole chunks and a tail, token counts on both sides of
    the tile's limit (2..9)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((8 * groups, 32 * blocks), dtype=np.float32)
    x = rng.standard_normal((n, 32 * blocks), dtype=np.float32)
    il = quant.interleave(quant.quantize(w, dtype), dtype, w.shape[1])
    for step in _kernels.available_int_steps():
        with _kernels.int_kernels(step):
            got = _probes.kernel_matmul(il, x, dtype, threads, "interleaved")
            decoded = np.stack([_probes.kernel_matvec(il, row, dtype, threads, "interleaved") for row in x])
        np.testing.assert_array_equal(got, decoded, err_msg=f"{step}, {n} tokens")


@pytest.mark.parametrize("groups, blocks, threads", [(1, 1, 1), (4, 9, 1), (9, 40, 1), (41, 40, 2), (33, 64, 2)])
def test_two_int4_tokens_give_each_tokens_decode(isa, groups, blocks, threads):
    """Two int4 tokens (the AVX2 step reads them in decode's 4 streams, cb_ifew2_int4_avx2): each
    token's decode bit for bit with every int step, for fewer groups than streams, 4 streams and a
    remainder, on one thread and on two (41 x 40 and 33 x 64 blocks are past CB_PARALLEL_MIN_WORK's
    2^19 multiply-adds: each thread's share starts at its own group, with streams and a remainder)."""
    rng = np.random.default_rng(groups * 100 + blocks)
    w = rng.standard_normal((8 * groups, 32 * blocks), dtype=np.float32)
    x = rng.standard_normal((2, 32 * blocks), dtype=np.float32)
    il = quant.interleave(quant.quantize(w, "int4"), "int4", w.shape[1])
    for step in _kernels.available_int_steps():
        with _kernels.int_kernels(step):
            got = _probes.kernel_matmul(il, x, "int4", threads, "interleaved")
            decoded = np.stack([_probes.kernel_matvec(il, row, "int4", threads, "interleaved") for row in x])
        np.testing.assert_array_equal(got, decoded, err_msg=step)


@pytest.mark.parametrize("n", [16, 32, 47])
@pytest.mark.parametrize("dtype", ["int8", "int4", "int6", "mxfp4"])
def test_prompts_of_whole_tiles_and_tails_give_each_tokens_decode(isa, dtype, n):
    """Prompts of one, two and two-plus-a-tail tiles of 16 tokens (the AMX steps' tiles), 40 blocks
    (a 32-block chunk and a tail, whose sums continue in out), 41 groups (an odd last group), on 2
    threads, through every int step of the tier: each token's decode bit for bit, and the default
    step's product. The emulated AMX step runs wherever the CPU has AVX512-VNNI."""
    rng = np.random.default_rng(n)
    w = rng.standard_normal((8 * 41, 32 * 40), dtype=np.float32)
    x = rng.standard_normal((n, 32 * 40), dtype=np.float32)
    il = quant.interleave(quant.quantize(w, dtype), dtype, w.shape[1])
    want = _probes.kernel_matmul(il, x, dtype, 2, "interleaved")
    decoded = np.stack([_probes.kernel_matvec(il, row, dtype, 2, "interleaved") for row in x])
    np.testing.assert_array_equal(want, decoded)
    for step in _kernels.available_int_steps():
        with _kernels.int_kernels(step):
            got = _probes.kernel_matmul(il, x, dtype, 2, "interleaved")
        np.testing.assert_array_equal(got, want, err_msg=f"{step}, {n} tokens")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(interleaved_case(), st.sampled_from([1, 2]))
def test_interleaved_mxfp4_against_rows_and_numpy(isa, case, threads):
    """mxfp4 has no transposed layout: its interleaved tiles give the same bits with every int
    step, decode the bits of prefill, the exact integer product within float32 summation error,
    and on the scalar tier the rows layout's bits."""
    _, w, x = case
    stored = quant.quantize(w, "mxfp4")
    il = quant.interleave(stored, "mxfp4", w.shape[1])
    results = {}
    for step in _kernels.available_int_steps():
        with _kernels.int_kernels(step):
            results[step] = _probes.kernel_matmul(il, x, "mxfp4", threads, "interleaved")
            decoded = np.stack([_probes.kernel_matvec(il, row, "mxfp4", threads, "interleaved") for row in x[:3]])
        np.testing.assert_array_equal(decoded, results[step][:3], err_msg=f"{step}, decode")
    first = next(iter(results.values()))
    for step, got in results.items():
        np.testing.assert_array_equal(got, first, err_msg=step)
    _assert_exact_product(first, stored, "mxfp4", x)
    if _kernels.isa() == "scalar":
        np.testing.assert_array_equal(first, _probes.kernel_matmul(stored, x, "mxfp4", threads, "rows"))


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("dtype", BLOCK + ("mxfp4",))
def test_interleaved_at_the_extremes_of_its_integer_sums(isa, dtype, sign):
    """As for the repacked prefill: int8 at 127 (255 unsigned in the VNNI steps), int4 nibbles at
    15 (8 maddubs of a block summed in int16: 30480), mxfp4 codes at +-6 (24 after the offset: its
    int16 sums go to int32 every two vectors), activations at +-127, through every int step,
    prefill and decode, with enough groups (40) for the decode's side-by-side parts and the AVX2
    prompt's two-group tile on packed activations (CB_ITILE2_MIN_GROUPS_AVX2, 32), and 20 tokens
    for the AMX step's tile of 16 (its signed bytes at their largest: int8 127, int4 7, mxfp4 12,
    against activations of either sign)."""
    rows, cols, n = 320, 64, 20
    w = np.full((rows, cols), 0.7, np.float32)
    if dtype == "int4":
        w[:, ::32] = -0.8
    x = np.full((n, cols), sign * 3.0, np.float32)
    stored = to_storage(w, dtype)
    il = quant.interleave(stored, dtype, cols)
    expect = _exact(stored, dtype, cols) @ _quantize_act(x[0])
    for step in _kernels.available_int_steps():
        for n in (20, 12, 1):
            with _kernels.int_kernels(step):
                got = _probes.kernel_matmul(il, x[:n], dtype, 1, "interleaved")
            np.testing.assert_allclose(got, np.broadcast_to(expect, got.shape), rtol=1e-6, err_msg=f"{step} {n}")
            assert np.sign(got).min() == sign


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.integers(1, 11),
    st.sampled_from([1, 2, 3, 17, 33, 40]),
    st.integers(16, 56),
    st.sampled_from([1, 2]),
    st.integers(0, 2**32 - 1),
)
def test_the_amx_bf16_products_tile_gives_the_bits_of_decode(isa, groups, blocks, n, threads, seed):
    """The amx step's bf16 products tile (TDPBF16PS, kernels_amx.h: its tile ops emulated as the
    Intrinsics Guide defines the instruction; the real one too where the tile state is lent and it
    passed its self-test) against the AVX512_BF16 step's vdpbf16ps, bit for bit: whole tiles of 16
    tokens (a pair, and an odd one after it) and a tail, group pairs and an odd group, chunks of 64
    inputs and a padded half chunk (an odd number of blocks), past one block of B's chunks (40
    blocks: the lanes wait in the state); and each token's decode."""
    if isa != "avx512" or not _kernels.has_bf16_products() or "amx-emulated" not in _kernels.available_int_steps():
        pytest.skip("the AMX steps' bf16 tile needs the AVX-512 tier with AVX512_BF16 and a build with the amx steps")
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((8 * groups, 32 * blocks), dtype=np.float32)
    x = rng.standard_normal((n, 32 * blocks), dtype=np.float32)
    il = quant.interleave(to_storage(w, "bf16"), "bf16", w.shape[1])
    with _kernels.int_kernels("avx512-vnni"):
        want = _probes.kernel_matmul(il, x, "bf16", threads, "interleaved", bf16_products=True)
        decoded = np.stack(
            [
                _probes.kernel_matmul(il, x[t : t + 1], "bf16", 1, "interleaved", bf16_products=True)[0]
                for t in (0, 15, n - 1)
            ]
        )
    np.testing.assert_array_equal(decoded, want[[0, 15, n - 1]])
    steps = ["amx-emulated"] + (
        ["amx"] if "amx" in _kernels.available_int_steps() and not _kernels.amx_bf16_failed_check() else []
    )
    for step in steps:
        with _kernels.int_kernels(step):
            got = _probes.kernel_matmul(il, x, "bf16", threads, "interleaved", bf16_products=True)
        np.testing.assert_array_equal(got, want, err_msg=step)


def _bf16_products_lanes(w, x, order):
    """The interleaved bf16 products spec (kernels_scalar.h, cb_itile_bf16_lanes) in numpy float32:
    w [rows, cols] and x [n, cols] bf16 values; each output's lane p takes inputs 4c + 2p, + 1 of
    every vector c — "seq" (vdpbf16ps): the higher input's product, then the lower's, each addition
    rounded; a split order: over each 64 inputs from input 0, even = the higher inputs' products
    and odd = the lower's summed apart from zero, then joined to the lane as the order says. Every
    product of two bf16 values is exact in float32, so each float32 addition here is one rounding,
    as the kernels' FMAs."""
    lanes = np.zeros((2, x.shape[0], w.shape[0]), np.float32)

    def product(i):
        return x[:, i, None] * w[None, :, i]

    units = x.shape[1] // 4
    for c0 in range(0, units, 16 if order != "seq" else units):
        for p in range(2):
            if order == "seq":
                for c in range(units):
                    lanes[p] = lanes[p] + product(4 * c + 2 * p + 1)
                    lanes[p] = lanes[p] + product(4 * c + 2 * p)
                continue
            even = np.zeros_like(lanes[p])
            odd = np.zeros_like(lanes[p])
            for c in range(c0, min(c0 + 16, units)):
                even = even + product(4 * c + 2 * p + 1)
                odd = odd + product(4 * c + 2 * p)
            lanes[p] = {
                "split-sum": lambda: lanes[p] + (even + odd),
                "split-even": lambda: (lanes[p] + even) + odd,
                "split-odd": lambda: (lanes[p] + odd) + even,
            }[order]()
    return lanes[0] + lanes[1]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.sampled_from(sorted(_kernels.BF16_ORDERS)),
    st.integers(1, 11),
    st.sampled_from([1, 2, 3, 33, 40]),
    st.integers(1, 40),
    st.sampled_from([1, 2]),
    st.integers(0, 2**32 - 1),
)
def test_bf16_products_in_each_order_are_the_spec(isa, order, groups, blocks, n, threads, seed):
    """Interleaved bf16 products in each order of roundings (vdpbf16ps's sequence, and the split
    orders an AMX unit may follow: _kernels.BF16_ORDERS) against a numpy float32 spec of that order,
    bit for bit, on every int step (the amx-emulated step's TDPBF16PS tiles following the order):
    prompts of 1..40 tokens (the AMX tiles, their tails, the 4- and 8-token vector tiles) and each
    token's decode; 64-input spans whole and a half last one (an odd number of blocks)."""
    if isa != "avx512" or not _kernels.has_bf16_products():
        pytest.skip("bf16 products need the AVX-512 tier with AVX512_BF16")
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((8 * groups, 32 * blocks), dtype=np.float32)
    x = rng.standard_normal((n, 32 * blocks), dtype=np.float32)
    stored = to_storage(w, "bf16")
    il = quant.interleave(stored, "bf16", w.shape[1])
    want = _bf16_products_lanes(from_storage(stored, "bf16").astype(np.float32), _bf16_values(_bf16_bits(x)), order)
    before = _kernels.bf16_order()
    try:
        _kernels.set_bf16_order(order)
        for step in _kernels.available_int_steps():
            with _kernels.int_kernels(step):
                got = _probes.kernel_matmul(il, x, "bf16", threads, "interleaved", bf16_products=True)
                decoded = np.stack(
                    [
                        _probes.kernel_matmul(il, x[t : t + 1], "bf16", 1, "interleaved", bf16_products=True)[0]
                        for t in (0, n - 1)
                    ]
                )
            np.testing.assert_array_equal(got, want, err_msg=f"{order}, {step}")
            np.testing.assert_array_equal(decoded, want[[0, n - 1]], err_msg=f"{order}, {step}, decode")
    finally:
        _kernels.set_bf16_order(before)


@pytest.mark.parametrize("order", sorted(_kernels.BF16_ORDERS))
def test_bf16_products_flush_subnormals_alike_in_every_order(order):
    """Subnormals in bf16 products: the AMX tile (its emulation: DAZ, FTZ, as TDPBF16PS) and each
    token's decode (vdpbf16ps, or a split order's widened FMAs under MXCSR's DAZ and FTZ) give the
    same bits where inputs are subnormal and where products and sums underflow: weights and
    activations with subnormal elements, and a token and a group whose products all underflow."""
    if (
        _kernels.isa() != "avx512"
        or not _kernels.has_bf16_products()
        or "amx-emulated" not in _kernels.available_int_steps()
    ):
        pytest.skip("the AMX steps' bf16 tile needs the AVX-512 tier with AVX512_BF16 and a build with the amx steps")
    rng = np.random.default_rng(7)
    rows, cols, n = 24, 1056, 33
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    for a in (w, x):  # a tenth of the elements subnormal
        pick = rng.random(a.shape) < 0.1
        a[pick] = rng.uniform(-1, 1, pick.sum()).astype(np.float32) * np.float32(2.0**-127)
    w[8:16] *= np.float32(2.0**-66)  # group 1 x token 0: every product below 2^-126
    x[0] *= np.float32(2.0**-66)
    il = quant.interleave(to_storage(w, "bf16"), "bf16", cols)
    before = _kernels.bf16_order()
    try:
        _kernels.set_bf16_order(order)
        with _kernels.int_kernels("amx-emulated"):
            got = _probes.kernel_matmul(il, x, "bf16", 2, "interleaved", bf16_products=True)
        decoded = np.stack(
            [_probes.kernel_matmul(il, x[t : t + 1], "bf16", 1, "interleaved", bf16_products=True)[0] for t in range(n)]
        )
    finally:
        _kernels.set_bf16_order(before)
    np.testing.assert_array_equal(got, decoded)
    assert np.all(got[0, 8:16] == 0)  # (the underflowing products flushed)


@pytest.mark.parametrize("unit", sorted(_kernels.BF16_ORDERS))
def test_the_self_test_finds_the_amx_units_order_of_bf16_products(unit):
    """Import's search on an AMX host whose TDPBF16PS fails the vdpbf16ps order (dispatch.h,
    cb_self_test_step_bf16_orders), played by the emulated tile fixed to each order: it keeps exactly
    that order (every other fails the self-test's bit checks), and leaves the order in use as it
    was."""
    if (
        _kernels.isa() != "avx512"
        or not _kernels.has_bf16_products()
        or "amx-emulated" not in _kernels.available_int_steps()
    ):
        pytest.skip("the AMX steps' bf16 tile needs the AVX-512 tier with AVX512_BF16 and a build with the amx steps")
    before = _kernels.bf16_order(), _kernels.int_step()
    assert _probes.search_bf16_order_emulated(unit) == unit
    assert (_kernels.bf16_order(), _kernels.int_step()) == before


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_mxfp4_interleave_round_trip(groups, blocks, seed):
    """Interleaved mxfp4 is lossless (the checkpoint's bytes come back), its group holds the 8
    scales of the block, then each code where int4 keeps its nibble: element 4v + i of output
    r low in qs[v][r][i], element 16 + 4v + i high."""
    w = np.random.default_rng(seed).standard_normal((8 * groups, 32 * blocks), dtype=np.float32)
    stored = quant.quantize(w, "mxfp4")
    il = quant.interleave(stored, "mxfp4", w.shape[1])
    assert il.shape == (groups, blocks * 136)
    np.testing.assert_array_equal(quant.to_rows(il, "mxfp4", *w.shape, "interleaved"), stored)
    g = il.view(quant.IGROUP_DTYPES["mxfp4"]).reshape(groups, blocks)
    b = stored.view(quant.BLOCK_DTYPES["mxfp4"]).reshape(8 * groups, blocks)
    gi, kb = groups - 1, blocks - 1
    np.testing.assert_array_equal(g[gi, kb]["e"], b[8 * gi : 8 * gi + 8, kb]["e"])
    for r in range(8):
        qs = b[8 * gi + r, kb]["qs"]
        codes = np.stack([qs & 0x0F, qs >> 4], axis=-1).reshape(32)  # element order
        np.testing.assert_array_equal(g[gi, kb]["qs"][:, r] & 0x0F, codes[:16].reshape(4, 4))
        np.testing.assert_array_equal(g[gi, kb]["qs"][:, r] >> 4, codes[16:].reshape(4, 4))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(BLOCK), st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_interleave_round_trip(dtype, groups, blocks, seed):
    w = np.random.default_rng(seed).standard_normal((8 * groups, 32 * blocks), dtype=np.float32)
    stored = quant.quantize(w, dtype)
    il = quant.interleave(stored, dtype, w.shape[1])
    assert il.shape == (groups, blocks * quant.GROUP_BYTES[dtype])
    np.testing.assert_array_equal(quant.deinterleave(il, dtype, *w.shape), stored)
    np.testing.assert_array_equal(quant.to_rows(il, dtype, *w.shape, "interleaved"), stored)
    # group (g, kb): the 8 scales of block kb of outputs 8g .. 8g+7, then their weights 4 inputs
    # at a time (int4: byte i of unit v holds input 4v + i low, 16 + 4v + i high, as byte 4v + i
    # of the row's block)
    g = il.view(quant.IGROUP_DTYPES[dtype]).reshape(groups, blocks)
    b = stored.view(quant.BLOCK_DTYPES[dtype]).reshape(8 * groups, blocks)
    gi, kb = groups - 1, blocks - 1
    np.testing.assert_array_equal(g[gi, kb]["d"], b[8 * gi : 8 * gi + 8, kb]["d"])
    for r in range(8):
        for unit in range(g[gi, kb]["qs"].shape[0]):
            np.testing.assert_array_equal(g[gi, kb]["qs"][unit, r], b[8 * gi + r, kb]["qs"][4 * unit : 4 * unit + 4])


def _bf16_bits(a):
    """float -> bf16 bits, rounded to nearest even (as the engine's activation rounding)."""
    u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _bf16_values(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(interleaved_case(), st.sampled_from([1, 2]))
def test_interleaved_bf16_gives_the_scalar_bits_on_every_tier(isa, case, threads):
    """Interleaved bf16 widened to f32: each output's two lanes of FMAs in the scalar spec's order
    (kernels_scalar.h, cb_itile_bf16_lanes), so every tier gives the scalar tier's bits, a prompt
    the bits of each token's decode, and the exact product within float32 summation error."""
    _, w, x = case
    stored = to_storage(w, "bf16")
    il = quant.interleave(stored, "bf16", w.shape[1])
    got = _probes.kernel_matmul(il, x, "bf16", threads, "interleaved")
    decoded = np.stack([_probes.kernel_matvec(il, row, "bf16", threads, "interleaved") for row in x[:3]])
    np.testing.assert_array_equal(decoded, got[:3])
    before = _kernels.isa()
    _kernels.select_isa("scalar")
    try:
        np.testing.assert_array_equal(got, _probes.kernel_matmul(il, x, "bf16", 1, "interleaved"))
    finally:
        _kernels.select_isa(before)
    exact_w = _exact(stored, "bf16", w.shape[1])
    bound = float32_dot_bound(np.abs(x.astype(np.float64)) @ np.abs(exact_w).T, w.shape[1] + 1)
    assert np.all(np.abs(got - x.astype(np.float64) @ exact_w.T) <= bound)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(interleaved_case(), st.sampled_from([1, 2]))
def test_interleaved_bf16_products_are_the_rounded_activations_times_the_weights(isa, case, threads):
    """bf16 products (vdpbf16ps) from the interleaved layout: the activations rounded to bf16 times
    the weights, within float32 summation error of that exact product; a prompt the bits of each
    token's decode; the rows layout's bf16 products within twice the bound. A tier without them
    multiplies exactly (the widened path)."""
    _, w, x = case
    stored = to_storage(w, "bf16")
    il = quant.interleave(stored, "bf16", w.shape[1])
    got = _probes.kernel_matmul(il, x, "bf16", threads, "interleaved", bf16_products=True)
    decoded = np.stack(
        [_probes.kernel_matmul(il, row[None], "bf16", threads, "interleaved", bf16_products=True)[0] for row in x[:3]]
    )
    np.testing.assert_array_equal(decoded, got[:3])
    exact_w = _exact(stored, "bf16", w.shape[1])
    xr = _bf16_values(_bf16_bits(x)).astype(np.float64) if _kernels.has_bf16_products() else x.astype(np.float64)
    bound = float32_dot_bound(np.abs(xr) @ np.abs(exact_w).T, w.shape[1] + 1)
    assert np.all(np.abs(got - xr @ exact_w.T) <= bound)
    rows = _probes.kernel_matmul(stored, x, "bf16", threads, "rows", bf16_products=True)
    assert np.all(np.abs(got - rows) <= 2 * bound)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_interleave_bf16_round_trip(groups, blocks, seed):
    """cb_igroup_bf16's order: group g's bytes are its inputs 4 at a time, each 4 of its 8 outputs'
    in turn (vector c, output r, i: input 4c + i of output 8g + r)."""
    w = np.random.default_rng(seed).standard_normal((8 * groups, 32 * blocks), dtype=np.float32)
    stored = to_storage(w, "bf16")
    il = quant.interleave(stored, "bf16", w.shape[1])
    assert il.shape == (groups, blocks * 512) and il.dtype == np.uint8
    np.testing.assert_array_equal(quant.deinterleave(il, "bf16", *w.shape), stored)
    np.testing.assert_array_equal(quant.to_rows(il, "bf16", *w.shape, "interleaved"), stored)
    g = il.view(np.uint16).reshape(groups, 8 * blocks, 8, 4)
    gi, c, r = groups - 1, 8 * blocks - 1, 5
    np.testing.assert_array_equal(g[gi, c, r], stored[8 * gi + r, 4 * c : 4 * c + 4])


def test_interleaved_bf16_needs_whole_groups_and_blocks():
    with pytest.raises(ValueError, match="multiple of 8 rows and of 32 columns"):
        quant.interleave(to_storage(np.ones((12, 32), np.float32), "bf16"), "bf16", 32)
    with pytest.raises(ValueError, match="multiple of 8 rows and of 32 columns"):
        quant.interleave(to_storage(np.ones((8, 40), np.float32), "bf16"), "bf16", 40)
    with pytest.raises(ValueError, match="interleaved bf16 needs a multiple of 32 columns"):
        _probes.kernel_matvec(np.zeros((1, 640), np.uint8), np.zeros(40, np.float32), "bf16", 1, "interleaved")


def test_interleaved_needs_int_weights_and_whole_groups():
    with pytest.raises(ValueError, match="multiple of 8 rows"):
        quant.interleave(quant.quantize(np.ones((12, 32), np.float32), "int8"), "int8", 32)
    with pytest.raises(ValueError, match="quant.interleave: f32 has no interleaved layout, only rows or transposed"):
        quant.interleave(np.ones((8, 32), np.float32), "f32", 32)
    with pytest.raises(ValueError, match="quant.transpose: mxfp4 has no transposed layout, only rows or interleaved"):
        quant.transpose(quant.quantize(np.ones((8, 32), np.float32), "mxfp4"), "mxfp4", 32)
    with pytest.raises(ValueError, match="int8/int4"):
        _probes.kernel_matvec(np.zeros((8, 32), np.float32), np.zeros(32, np.float32), "f32", 1, "interleaved")
    with pytest.raises(ValueError, match="interleaved int4"):
        _probes.kernel_matvec(np.zeros((1, 100), np.uint8), np.zeros(32, np.float32), "int4", 1, "interleaved")


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(BLOCK), st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_transpose_round_trip(dtype, groups, blocks, seed):
    w = np.random.default_rng(seed).standard_normal((8 * groups, 32 * blocks), dtype=np.float32)
    stored = quant.quantize(w, dtype)
    t = quant.transpose(stored, dtype, w.shape[1])
    assert t.shape == (blocks, groups * quant.GROUP_BYTES[dtype])
    np.testing.assert_array_equal(quant.untranspose(t, dtype, *w.shape), stored)
    # group (kb, g) holds the scales, then the weights, of block kb of outputs 8g .. 8g+7
    g = t.view(quant.GROUP_DTYPES[dtype]).reshape(blocks, groups)
    b = stored.view(quant.BLOCK_DTYPES[dtype]).reshape(8 * groups, blocks)
    kb, gi = blocks - 1, groups - 1
    np.testing.assert_array_equal(g[kb, gi]["d"], b[8 * gi : 8 * gi + 8, kb]["d"])
    np.testing.assert_array_equal(g[kb, gi]["qs"], b[8 * gi : 8 * gi + 8, kb]["qs"])


def test_group_struct_sizes_agree_with_python():
    assert _probes.group_sizes() == quant.GROUP_BYTES == {"int8": 8 * 34, "int4": 8 * 18}
    assert {k: v.itemsize for k, v in quant.IGROUP_DTYPES.items()} == {
        **quant.GROUP_BYTES,
        "mxfp4": 8 * 17,
        "int6": 8 * 26,
    }
    assert _probes.igroup_sizes() == {k: v.itemsize for k, v in quant.IGROUP_DTYPES.items()}  # static_assert in C


@pytest.mark.parametrize("dtype", BLOCK)
def test_transposed_blocks_need_whole_groups(dtype):
    with pytest.raises(ValueError, match="multiple of 8 rows"):
        quant.transpose(quant.quantize(np.ones((12, 32), np.float32), dtype), dtype, 32)
    with pytest.raises(ValueError, match="transposed"):
        _probes.kernel_matvec(np.zeros((1, 100), np.uint8), np.zeros(32, np.float32), dtype, 1, "transposed")


def test_unknown_layout_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown layout"):
        _probes.kernel_matvec(np.zeros((2, 2), np.float32), np.zeros(2, np.float32), "f32", 1, "columns")


# ---- models ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["mixtral_a", "mixtral_b", "qwen2moe_b", "gemma4_b"])  # _b: tied embeddings
def test_f32_transposed_matches_transformers(converted, case):
    ref = reference(case)
    logits = colibri.load(converted(case, "f32", "transposed")).forward(ref["input_ids"])
    assert np.abs(logits - ref["logits_f32"]).max() <= F32_RTOL * np.abs(ref["logits_f32"]).max()


@pytest.mark.parametrize("dtype", ["f32", "bf16", "int8", "int4"])
def test_whole_model_in_every_layout(converted, dtype):
    """Scalar tier: the same bits in every layout. Every tier: the layouts agree, decoding token by
    token gives the prefill's logits. (Transposed and interleaved int matrices give the same bits
    on every tier — test_interleaved_gives_the_bits_of_transposed —, but the fixtures' f16-kept
    matrices are transposed in one directory and rows in the other.)"""
    ids = reference("qwen3moe_a")["input_ids"]
    others = ("transposed", "interleaved") if dtype in BLOCK else ("transposed",)
    before = _kernels.isa()
    try:
        for name in ISAS:
            _kernels.select_isa(name)
            # bf16 rows with bf16 products would not be the transposed layout's exact f32 products
            rows = colibri.load(converted("qwen3moe_a", dtype, "rows"), bf16_products="f32").forward(ids)
            got = {}
            for layout in others:
                m = colibri.load(converted("qwen3moe_a", dtype, layout), bf16_products="f32")
                t = got[layout] = m.forward(ids)
                if name == "scalar":
                    np.testing.assert_array_equal(t, rows)
                assert np.abs(t - rows).max() <= MODEL_RTOL[dtype] * np.abs(rows).max(), name
                stepped = np.stack([m.forward(ids[: i + 1])[-1] for i in range(len(ids))])
                np.testing.assert_array_equal(stepped[-1], t[-1])
    finally:
        _kernels.select_isa(before)


@pytest.mark.parametrize(
    "dtype, layout", [(d, lay) for d in BLOCK for lay in ("transposed", "interleaved")] + [("bf16", "interleaved")]
)
def test_whole_model_the_same_bits_with_every_int_step(isa, converted, dtype, layout):
    """A transposed or interleaved int8/int4 model gives the default int step's logits bit for bit
    with every step of the tier (the VNNI step emulated included): a 20-token prompt (transposed:
    repacked chunks), 5 tokens (stored-order tiles) and 1 (decode). So does an interleaved bf16 one
    with bf16 products where the tier has them (the amx steps' TDPBF16PS tile takes its prompts'
    whole tiles of 16 tokens)."""
    ids = np.resize(reference("qwen3moe_a")["input_ids"], 20)
    m = colibri.load(converted("qwen3moe_a", dtype, layout))
    expect = [m.forward(ids[:n]) for n in (20, 5, 1)]
    for step in _kernels.available_int_steps():
        with _kernels.int_kernels(step):
            for n, want in zip((20, 5, 1), expect):
                np.testing.assert_array_equal(m.forward(ids[:n]), want, err_msg=f"{step}, {n} tokens")


def test_whole_model_bf16_products_in_a_split_order(isa, converted):
    """An interleaved bf16 model with bf16 products in a split order (what an AMX unit that sums
    TDPBF16PS's even and odd products apart makes the engine use): every int step gives the default
    step's logits bit for bit at 20, 5 and 1 tokens (the amx-emulated step's tiles too), and they
    stay within the bf16 products' error of the vdpbf16ps order's."""
    if isa != "avx512" or not _kernels.has_bf16_products():
        pytest.skip("bf16 products need the AVX-512 tier with AVX512_BF16")
    ids = np.resize(reference("qwen3moe_a")["input_ids"], 20)
    m = colibri.load(converted("qwen3moe_a", "bf16", "interleaved"))
    seq = m.forward(ids)
    before = _kernels.bf16_order()
    try:
        _kernels.set_bf16_order("split-even")
        expect = [m.forward(ids[:n]) for n in (20, 5, 1)]
        for step in _kernels.available_int_steps():
            with _kernels.int_kernels(step):
                for n, want in zip((20, 5, 1), expect):
                    np.testing.assert_array_equal(m.forward(ids[:n]), want, err_msg=f"{step}, {n} tokens")
    finally:
        _kernels.set_bf16_order(before)
    assert not np.array_equal(expect[0], seq)  # the order reached the kernels
    assert np.abs(expect[0] - seq).max() <= MODEL_RTOL["bf16"] * np.abs(seq).max()


@settings(max_examples=60, deadline=None)
@given(layout_case(), st.integers(0, 10**6))
def test_embedding_row_from_either_layout(case, pick):
    """The embedding lookup of a (tied) transposed or interleaved embedding gathers the same row."""
    dtype, w, _ = case
    stored, t = _store(w, dtype)
    row = pick % w.shape[0]
    ref = from_storage(stored, dtype, w.shape[1])[row]
    np.testing.assert_array_equal(_probes.kernel_dequant_row(stored, row, w.shape[1], dtype), ref)
    np.testing.assert_array_equal(_probes.kernel_dequant_row(t, row, w.shape[1], dtype, "transposed"), ref)
    if dtype in BLOCK or (dtype == "bf16" and w.shape[0] % 8 == 0 and w.shape[1] % 32 == 0):
        il = quant.interleave(stored, dtype, w.shape[1])
        np.testing.assert_array_equal(_probes.kernel_dequant_row(il, row, w.shape[1], dtype, "interleaved"), ref)


def test_tied_embedding_in_a_group_layout_has_the_bits_of_rows(converted):
    """mixtral_b ties its embedding: int8 stores it interleaved by default, or transposed (it is
    the output head too; the lookup gathers its rows); at the scalar tier the logits are those of
    the all-rows directory, bit for bit."""
    assert ModelDir(converted("mixtral_b", "int8")).tensors["embedding"]["layout"] == "interleaved"
    ids = reference("mixtral_b")["input_ids"]
    before = _kernels.isa()
    try:
        _kernels.select_isa("scalar")
        rows = colibri.load(converted("mixtral_b", "int8", "rows")).forward(ids)
        for layout in ("interleaved", "transposed"):
            md = ModelDir(converted("mixtral_b", "int8", layout))
            assert md.config.tie_word_embeddings and md.tensors["embedding"]["layout"] == layout
            np.testing.assert_array_equal(colibri.load(md.root).forward(ids), rows, err_msg=layout)
    finally:
        _kernels.select_isa(before)


@pytest.mark.parametrize("dtype,layout", [(d, lay) for d, lay in FORMAT_LAYOUTS if d in ("bf16", "int8", "int4")])
def test_gate_and_up_with_the_activation_in_one_batch(isa, dtype, layout):
    """act(gate x) * up x from one batch of products, the activation applied in the region by
    each thread to the rows it computed: with the up product just before its gate and with another
    product between them — the same bits as the two products and the activation apart, for decode
    and prefill tiles (n = 1, 3, 9, 20 tokens) and 1 or 2 threads."""
    rng = np.random.default_rng(11)
    rows, cols = 1032, 256
    w_gate = rng.standard_normal((rows, cols), dtype=np.float32)
    w_up = rng.standard_normal((rows, cols), dtype=np.float32)
    gate, up = (_in_layout(w, dtype, layout) for w in (w_gate, w_up))
    for n in (1, 3, 9, 20):
        x = rng.standard_normal((n, cols), dtype=np.float32)
        for act in ("silu", "gelu_tanh"):
            fused = _probes.kernel_glu_product(gate, up, x, dtype, layout, act, 2)
            after = _probes.kernel_glu_product(gate, up, x, dtype, layout, act, 2, adjacent=False)
            one = _probes.kernel_glu_product(gate, up, x, dtype, layout, act, 1)
            np.testing.assert_array_equal(fused, after)
            np.testing.assert_array_equal(fused, one)
            g = _probes.kernel_matmul(gate, x, dtype, 1, layout)
            u = _probes.kernel_matmul(up, x, dtype, 1, layout)
            expect = np.stack([_probes.kernel_glu(g[t], u[t], act) for t in range(n)])
            np.testing.assert_array_equal(fused, expect)
