"""Block quantization of weight matrices: int8, int4, mxfp4, nl4 and int6, mirrored from csrc/quant.h.

    int8: blocks of 32 weights with one f16 scale d:  w ~= d * q,        q in [-127, 127]   (34 bytes)
    int4: blocks of 32 weights with one f16 scale d:  w ~= d * (q - 8),  q in [0, 15]       (18 bytes)
          byte j of a block holds element j in its low nibble and element j + 16 in its high one
    mxfp4: blocks of 32 e2m1 codes with one e8m0 scale e: w = 2^(e - 127) * FP4_VALUES[q]       (17 bytes)
          byte j holds element 2j low and 2j + 1 high: gpt-oss's *_blocks and *_scales as they are
          (`from_mx`, `to_mx`); rows or interleaved (the int4 group's order, the e8m0 scales first)

    nl4: a 16-value non-linear codebook (NL4_VALUES: IQ4_NL's values halved) under a signed 6-bit
          scale per 16 weights and an f32 scale per row: w = row_scale * sub * NL4_VALUES[q]; the
          engine stores it interleaved only (csrc/quant.h, cb_igroup_nl4: 140-byte groups, then the
          rows' f32 scales). Its rows form here is [rows, cols / 32 * 18 + 4]: per block of 32 the
          two scales + 32 (a byte each) and int4's nibble order, then the row's f32 scale.
    int6: blocks of 32 weights with one f16 scale d:  w ~= d * (u - 32), u in [0, 63]     (26 bytes)
          the low 4 bits of u in int4's nibble order (16 bytes), then the high 2 bits (8 bytes,
          INT6_HIGH_ORDER); the engine stores it interleaved only (csrc/quant.h, cb_igroup_int6:
          the same bytes, 8 outputs a group).

A row of `cols` weights is cols / 32 consecutive blocks (cols must be a multiple of 32). The
`transposed` layout stores the same blocks input-major in groups of 8 outputs (their 8 scales
first, then their 8 blocks' weights; csrc/quant.h): `transpose` / `untranspose` convert. The
`interleaved` layout stores them output-major in groups of 8 outputs, a group's
weights 4 inputs at a time (csrc/quant.h, cb_igroup_int8/int4): `interleave` / `deinterleave`;
`from_rows` / `to_rows` convert to and from any layout the format has (colibri.formats). The
scale is rounded to f16 first (away from zero, so the largest weight never clips) and the
weights are quantized against the rounded scale, so dequantization reproduces exactly what the
kernels compute with. int8 errs by at most half a step (d / 2); int4, whose levels run from -8d
to 7d, by at most d, for a block whose extremes are opposite and equal.
"""

from __future__ import annotations

import numpy as np

# the C definitions (csrc/quant.h, kernels_scalar.h); NL4_OFFSET and NL4_SUB_MAX also as quant.X (the tests)
from ._kernels import LAYOUT_CODES, NL4_SCALE_BIAS, QBLOCK, TGROUP, quantize_nl4
from ._kernels import NL4_OFFSET, NL4_SUB_MAX  # noqa: F401 (re-exported)
from .formats import FORMATS, check_layout

BLOCK_DTYPES = {
    "int8": np.dtype([("d", "<u2"), ("qs", "i1", (QBLOCK,))]),
    "int4": np.dtype([("d", "<u2"), ("qs", "u1", (QBLOCK // 2,))]),
    "mxfp4": np.dtype([("e", "u1"), ("qs", "u1", (QBLOCK // 2,))]),
    "int6": np.dtype([("d", "<u2"), ("qs", "u1", (QBLOCK // 2,)), ("qh", "u1", (QBLOCK // 4,))]),
}
BLOCK_BYTES = {name: dt.itemsize for name, dt in BLOCK_DTYPES.items()}  # int8: 34, int4: 18, mxfp4: 17, int6: 26
# the e2m1 values by code (OCP microscaling formats; transformers' FP4_VALUES)
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)
E8M0_NAN = 255  # the e8m0 code that means NaN: refused in a checkpoint
GROUP_DTYPES = {
    "int8": np.dtype([("d", "<u2", (TGROUP,)), ("qs", "i1", (TGROUP, QBLOCK))]),
    "int4": np.dtype([("d", "<u2", (TGROUP,)), ("qs", "u1", (TGROUP, QBLOCK // 2))]),
}
GROUP_BYTES = {name: dt.itemsize for name, dt in GROUP_DTYPES.items()}  # int8: 272, int4: 144
# a group of the interleaved layout: qs[unit][output][4] = inputs 4 * unit .. + 3 (int8: 8 units of
# 4 inputs; int4: 4 units of 4 bytes, byte i of unit v holding input 4v + i low, 16 + 4v + i high)
IGROUP_DTYPES = {
    "int8": np.dtype([("d", "<u2", (TGROUP,)), ("qs", "i1", (8, TGROUP, 4))]),
    "int4": np.dtype([("d", "<u2", (TGROUP,)), ("qs", "u1", (4, TGROUP, 4))]),
    # mxfp4: the 8 e8m0 scales, then the codes where int4 keeps its nibbles (csrc/quant.h)
    "mxfp4": np.dtype([("e", "u1", (TGROUP,)), ("qs", "u1", (4, TGROUP, 4))]),
    # int6: int4's group, then the codes' high 2 bits: qh[pair][output][4] (csrc/quant.h)
    "int6": np.dtype([("d", "<u2", (TGROUP,)), ("qs", "u1", (4, TGROUP, 4)), ("qh", "u1", (2, TGROUP, 4))]),
}
LAYOUTS = tuple(LAYOUT_CODES)

# int6's high 2 bits: byte 4p + i of a block's qh holds, from bit 0 up, those of elements
# 4(2p) + i, 16 + 4(2p) + i, 4(2p + 1) + i and 16 + 4(2p + 1) + i (the interleaved group's qh[p][r][i],
# csrc/quant.h): INT6_HIGH_ORDER[b, k] is the element in bits 2k, 2k + 1 of byte b.
INT6_HIGH_ORDER = np.array([[16 * (k % 2) + 4 * (2 * (b // 4) + k // 2) + b % 4 for k in range(4)] for b in range(8)])

# nl4 (csrc/quant.h: cb_nl4_int, cb_igroup_nl4)
NL4_VALUES = np.array([-64, -52, -42, -32, -24, -18, -11, -5, 0, 6, 12, 19, 26, 34, 44, 56], np.float32)
NL4_BLOCK = np.dtype([("sc", "u1", (2,)), ("qs", "u1", (QBLOCK // 2,))])  # the rows form's block
NL4_GROUP = np.dtype([("sc", "u1", (12,)), ("qs", "u1", (4, TGROUP, 4))])  # cb_igroup_nl4: 140 bytes


def nl4_bytes(rows: int, cols: int) -> int:
    """Bytes of an interleaved nl4 matrix: its groups, then its f32 row scales."""
    return rows // TGROUP * (cols // QBLOCK) * NL4_GROUP.itemsize + 4 * rows


FLOAT16_FORMATS = ("f16", "bf16")  # 2-byte float storage (modeldir.to_storage), held by StoredMatrix too


def default_layout(dtype: str) -> str:
    """The faster layout of a weight matrix stored as `dtype`: interleaved for int8/int4 (8 outputs per activation
    load, in their own lanes: no horizontal sums, no repacking; decode and prefill faster than
    transposed, which was faster than rows), nl4 (its only layout) and bf16 (the same lanes: the
    prompt's products 4x those of rows widened, 9x with bf16 products; decode from the caches 4x),
    rows for f32/f16 (the axpy's stores make the transposed float kernels slower): interleaved where the
    format has it (colibri.formats), else rows."""
    return FORMATS[dtype].default_layout if dtype in FORMATS else "rows"


def row_bytes(dtype: str, cols: int) -> int:
    """Bytes of one row in the rows layout (nl4: its rows form, block scales and the row scale)."""
    if dtype == "nl4":
        return cols // QBLOCK * NL4_BLOCK.itemsize + 4
    return cols // QBLOCK * BLOCK_BYTES[dtype]


def _f16_scale(d: np.ndarray) -> np.ndarray:
    """float32 scales -> f16, rounded away from zero where nearest rounding would shrink them
    (a smaller scale would push the block's largest weight past the last level and clip it)."""
    d16 = d.astype(np.float16)
    short = np.abs(d16.astype(np.float32)) < np.abs(d)
    return np.where(short, np.nextafter(d16, np.copysign(np.float16(np.inf), d16)), d16).astype(np.float16)


def _blocks(w: np.ndarray) -> np.ndarray:
    w = np.asarray(w, np.float32)
    if w.ndim != 2 or w.shape[1] % QBLOCK:
        raise ValueError(f"block quantization needs a 2-D matrix with a multiple of {QBLOCK} columns, got {w.shape}")
    return w.reshape(w.shape[0], -1, QBLOCK)


# Scale candidates of the importance-weighted search (quantize(importance=)): the block's largest
# magnitude over each divisor, as llama.cpp's make_qx_quants tries them, each refitted by weighted
# least squares. int4 maps the signed extreme near -8 (its levels are -8 .. 7), int8 near 127.
SEARCH_DIVISORS = {
    "int4": tuple(8 + 0.15 * k for k in range(-5, 6)),
    "int8": tuple(127 - 3.0 * k for k in range(-2, 5)),
    "int6": tuple(32 + 0.5 * k for k in range(-6, 7)),
}
_SEARCH_ROWS = 128  # rows searched at a time: the temporaries stay in the caches
LEVELS = {"int4": (-8, 7), "int8": (-127, 127), "int6": (-32, 31)}
_SIGNED_EXTREME = ("int4", "int6")  # formats whose levels are asymmetric: the signed extreme maps to the lowest


def _weighted_scales(b: np.ndarray, imp: np.ndarray, dtype: str, d_rtn: np.ndarray) -> np.ndarray:
    """Per block of b [rows, nb, 32] the f16 scale of least importance-weighted error
    sum_c imp_c (b_c - d q_c)^2, q_c = clip(rint(b_c / d)) to the format's levels, among the
    round-to-nearest scale d_rtn [rows, nb] (f16) and the SEARCH_DIVISORS candidates refitted by
    weighted least squares; never worse than d_rtn on that error (ties keep it)."""
    if b.shape[0] > _SEARCH_ROWS:
        return np.concatenate(
            [
                _weighted_scales(b[r : r + _SEARCH_ROWS], imp, dtype, d_rtn[r : r + _SEARCH_ROWS])
                for r in range(0, b.shape[0], _SEARCH_ROWS)
            ]
        )
    lo, hi = LEVELS[dtype]
    x = b
    w = imp.astype(np.float32).reshape(1, -1, QBLOCK)

    def error(d16):
        d = d16.astype(np.float32)[..., None]
        q = np.clip(np.rint(np.divide(x, d, out=np.zeros_like(x), where=d != 0)), lo, hi)
        return (w * (x - d * q) ** 2).sum(axis=2)

    best, best_err = d_rtn, error(d_rtn)
    ref = (
        np.take_along_axis(b, np.abs(b).argmax(axis=2)[..., None], axis=2)[..., 0]
        if dtype in _SIGNED_EXTREME
        else np.abs(b).max(axis=2)
    )
    sign = np.float32(-1.0 if dtype in _SIGNED_EXTREME else 1.0)
    for div in SEARCH_DIVISORS[dtype]:
        d0 = ref / (sign * np.float32(div))
        q = np.clip(np.rint(np.divide(x, d0[..., None], out=np.zeros_like(x), where=d0[..., None] != 0)), lo, hi)
        den = (w * q * q).sum(axis=2)
        fit = np.divide((w * x * q).sum(axis=2), den, out=d0.copy(), where=den > 0)
        cand = fit.astype(np.float32).astype(np.float16)
        err = error(cand)
        better = (err < best_err) & np.isfinite(cand.astype(np.float32))
        best = np.where(better, cand, best)
        best_err = np.where(better, err, best_err)
    return best


def quantize(w: np.ndarray, dtype: str, importance: np.ndarray | None = None) -> np.ndarray:
    """float32 [rows, cols] -> uint8 [rows, row_bytes(dtype, cols)] of int8/int4/mxfp4 blocks (nl4:
    its rows form, _quantize_nl4).

    importance float [cols] or None: the weight of each input column's rounding error (the mean
    square of that input, colibri.calibrate); with it each int8/int4 block's scale is the one of
    least weighted error (_weighted_scales), else round to nearest from the largest magnitude
    (int4: q4_0's recipe, byte for byte). int6 always searches its scales: without importance every
    column weighs the same (the plain squared error), as it has no peer's bytes to reproduce.
    importance float [cols, cols] (int8/int4/int6/nl4): the input's whole second moment E[x x^T]
    (calibrate --second-moments): the columns are rounded in order, each one's error moved onto
    the columns not yet rounded (colibri.gptq), the scales chosen as with its diagonal."""
    b = _blocks(w)  # [rows, nblocks, 32]
    cols = b.shape[1] * QBLOCK
    if importance is not None:
        importance = np.asarray(importance)
        if (
            importance.shape not in ((cols,), (cols, cols))
            or not np.isfinite(importance).all()
            or (np.diagonal(importance) if importance.ndim == 2 else importance).min(initial=0) < 0
        ):
            raise ValueError(
                f"importance must be {cols} finite values >= 0 (or a [{cols}, {cols}] second moment), "
                f"got shape {importance.shape}"
            )
        if importance.ndim == 2:
            if dtype not in SECOND_MOMENT_FORMATS:
                raise ValueError(f"a second moment chooses {'/'.join(SECOND_MOMENT_FORMATS)} weights, not {dtype}")
            from .gptq import quantize_compensated

            return quantize_compensated(b.reshape(b.shape[0], cols), dtype, importance)
    if dtype == "nl4":
        return _quantize_nl4(b, importance)
    if dtype == "mxfp4":
        return _quantize_mxfp4(b)
    if dtype not in LEVELS:
        raise ValueError(f"unknown block format {dtype!r}")
    d = initial_scales(b, dtype)
    if importance is not None or dtype == "int6":
        d = _weighted_scales(b, importance if importance is not None else np.ones(cols, np.float32), dtype, d)
    return pack_blocks(dtype, d, levels_of(b, d, dtype))


SECOND_MOMENT_FORMATS = ("int8", "int4", "int6", "nl4")  # the formats colibri.gptq can write


def initial_scales(b: np.ndarray, dtype: str) -> np.ndarray:
    """The round-to-nearest f16 scale of each block of b [rows, nb, 32]: int8's largest magnitude
    over 127; int4's / int6's signed extreme over the lowest level (-8 / -32)."""
    if dtype == "int8":
        return _f16_scale((np.abs(b).max(axis=2) / np.float32(127)).astype(np.float32))
    extreme = np.take_along_axis(b, np.abs(b).argmax(axis=2)[..., None], axis=2)[..., 0]
    return _f16_scale((extreme / np.float32(LEVELS[dtype][0])).astype(np.float32))


def levels_of(b: np.ndarray, d: np.ndarray, dtype: str) -> np.ndarray:
    """int16 [rows, nb, 32]: the level of each weight of b under its block's f16 scale d [rows, nb]
    (rounded to nearest, clipped to the format's levels; 0 where the scale is 0)."""
    lo, hi = LEVELS[dtype]
    df = d.astype(np.float32)[..., None]
    q = np.where(df != 0, np.rint(b / np.where(df != 0, df, 1)), 0)
    return np.clip(q, lo, hi).astype(np.int16)


def pack_blocks(dtype: str, d: np.ndarray, q: np.ndarray) -> np.ndarray:
    """int8/int4/int6 blocks from their f16 scales d [rows, nb] and levels q [rows, nb, 32] (in the
    format's range) -> uint8 [rows, row_bytes]: the stored rows layout."""
    out = np.zeros(d.shape, BLOCK_DTYPES[dtype])
    if dtype == "int8":
        out["qs"] = q.astype(np.int8)
    elif dtype == "int4":
        u = (q + 8).astype(np.uint8)
        out["qs"] = u[..., : QBLOCK // 2] | (u[..., QBLOCK // 2 :] << 4)
    else:  # int6
        u = (q + 32).astype(np.uint8)  # [rows, nb, 32] in [0, 63]
        out["qs"] = (u[..., : QBLOCK // 2] & 0x0F) | ((u[..., QBLOCK // 2 :] & 0x0F) << 4)
        high = (u >> 4)[..., INT6_HIGH_ORDER]  # [rows, nb, 8, 4]
        out["qh"] = (high << (2 * np.arange(4, dtype=np.uint8))).sum(axis=-1, dtype=np.uint8)
    out["d"] = np.asarray(d, np.float16).view(np.uint16)
    return out.view(np.uint8).reshape(d.shape[0], -1)


def pack_nl4(sc: np.ndarray, codes: np.ndarray, row_scale: np.ndarray) -> np.ndarray:
    """nl4's rows form from its stored six-bit scales sc uint8 [rows, nb, 2] (sub + NL4_SCALE_BIAS),
    codes uint8 [rows, nb, 32] (indices of NL4_VALUES) and row scales float32 [rows]."""
    rows, nb = sc.shape[:2]
    blocks = np.zeros((rows, nb), NL4_BLOCK)
    blocks["sc"] = sc
    blocks["qs"] = codes[..., : QBLOCK // 2] | (codes[..., QBLOCK // 2 :] << 4)
    return np.concatenate(
        [blocks.view(np.uint8).reshape(rows, -1), np.asarray(row_scale, "<f4").reshape(rows, 1).view(np.uint8)], axis=1
    )


def _quantize_nl4(b: np.ndarray, importance) -> np.ndarray:
    """[rows, nb, 32] float32 -> the nl4 rows form: the scale and code search of
    csrc/quantize_nl4.h (per row an f32 scale; per half-block of 16 the six-bit scale and codes of
    least importance-weighted error, or squared-weight-weighted without importance)."""
    rows, nb, _ = b.shape
    return quantize_nl4(b.reshape(rows, nb * QBLOCK), importance)


def _nl4_parts(stored: np.ndarray, cols: int):
    """An nl4 rows form -> (blocks NL4_BLOCK [rows, nb], row scales float32 [rows])."""
    stored = np.ascontiguousarray(stored, np.uint8)
    rows, nb = stored.shape[0], cols // QBLOCK
    if stored.ndim != 2 or stored.shape[1] != row_bytes("nl4", cols):
        raise ValueError(f"nl4 rows of {cols} columns cannot be {list(stored.shape)} bytes")
    blocks = np.ascontiguousarray(stored[:, : nb * NL4_BLOCK.itemsize]).view(NL4_BLOCK).reshape(rows, nb)
    row_scale = np.ascontiguousarray(stored[:, nb * NL4_BLOCK.itemsize :]).view("<f4").reshape(rows)
    return blocks, row_scale


def _dequantize_nl4(stored: np.ndarray, cols: int) -> np.ndarray:
    blocks, row_scale = _nl4_parts(stored, cols)
    rows, nb = blocks.shape
    qs = blocks["qs"]
    v = NL4_VALUES[np.concatenate([qs & 0x0F, qs >> 4], axis=2)]  # [rows, nb, 32]
    sub = blocks["sc"].astype(np.float32) - NL4_SCALE_BIAS  # [rows, nb, 2]
    half = np.repeat(sub, QBLOCK // 2, axis=2)
    # the kernels' order: (sub * code) summed per half, then the row scale
    return (row_scale.astype(np.float32)[:, None, None] * (half * v)).astype(np.float32).reshape(rows, cols)


def _interleave_nl4(stored: np.ndarray, cols: int) -> np.ndarray:
    blocks, row_scale = _nl4_parts(stored, cols)
    rows, nb = blocks.shape
    if rows % TGROUP:
        raise ValueError(f"the interleaved nl4 layout needs a multiple of {TGROUP} rows, got {rows}")
    g = blocks.reshape(rows // TGROUP, TGROUP, nb)
    out = np.zeros((rows // TGROUP, nb), NL4_GROUP)
    sc = g["sc"].transpose(0, 2, 1, 3).astype(np.uint16)  # [groups, nb, 8, 2]
    lo, hi = sc[..., 0], sc[..., 1]
    out["sc"][..., :8] = (lo | ((hi & 3) << 6)).astype(np.uint8)
    high4 = (hi >> 2) & 15
    out["sc"][..., 8:] = (high4[..., 0::2] | (high4[..., 1::2] << 4)).astype(np.uint8)
    qs = g["qs"]  # [groups, 8, nb, 16]
    out["qs"] = qs.reshape(qs.shape[:3] + (4, 4)).transpose(0, 2, 3, 1, 4)
    flat = np.concatenate([out.view(np.uint8).ravel(), row_scale.astype("<f4").view(np.uint8)])
    return flat.reshape(rows // TGROUP, -1)


def _deinterleave_nl4(stored: np.ndarray, rows: int, cols: int) -> np.ndarray:
    nb = cols // QBLOCK
    flat = np.ascontiguousarray(stored, np.uint8).ravel()
    if flat.size != nl4_bytes(rows, cols):
        raise ValueError(
            f"an interleaved nl4 [{rows}, {cols}] matrix is {nl4_bytes(rows, cols)} bytes, got {flat.size}"
        )
    gbytes = rows // TGROUP * nb * NL4_GROUP.itemsize
    groups = flat[:gbytes].view(NL4_GROUP).reshape(rows // TGROUP, nb)
    row_scale = flat[gbytes:].view("<f4")
    sc = groups["sc"].astype(np.uint16)
    lo = sc[..., :8] & 63
    high4 = np.stack([sc[..., 8:] & 15, sc[..., 8:] >> 4], axis=-1).reshape(sc.shape[:2] + (8,))
    hi = (sc[..., :8] >> 6) | (high4 << 2)
    out = np.zeros((rows // TGROUP, TGROUP, nb), NL4_BLOCK)
    out["sc"] = np.stack([lo, hi], axis=-1).transpose(0, 2, 1, 3).astype(np.uint8)
    qs = groups["qs"].transpose(0, 3, 1, 2, 4)  # [groups, 8, nb, 4, 4]
    out["qs"] = qs.reshape(qs.shape[:3] + (-1,))
    return np.concatenate([out.view(np.uint8).reshape(rows, -1), row_scale.view(np.uint8).reshape(rows, 4)], axis=1)


def _quantize_mxfp4(b: np.ndarray) -> np.ndarray:
    """[rows, nb, 32] float32 -> stored mxfp4 rows: per block the smallest power-of-two scale that
    puts the largest magnitude at or below 6, each weight rounded to the nearest e2m1 value (ties
    to the smaller magnitude), as OCP's reference quantizer does."""
    amax = np.abs(b).max(axis=2)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.ceil(np.log2(np.where(amax > 0, amax, 1) / 6.0)), -127) + 127
    e = np.clip(e, 0, 254).astype(np.uint8)
    scaled = b / np.ldexp(np.float32(1), e.astype(np.int32) - 127)[..., None]
    mags = FP4_VALUES[:8]
    code = np.abs(np.abs(scaled)[..., None] - mags).argmin(axis=-1).astype(np.uint8)  # first of a tie: smaller
    code |= ((scaled < 0) & (code > 0)).astype(np.uint8) << 3
    out = np.zeros(b.shape[:2], BLOCK_DTYPES["mxfp4"])
    out["e"] = e
    out["qs"] = code[..., 0::2] | (code[..., 1::2] << 4)
    return out.view(np.uint8).reshape(b.shape[0], -1)


def from_mx(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """A checkpoint's mxfp4 matrix (blocks uint8 [rows, cols / 32, 16], scales uint8 [rows,
    cols / 32]) -> its stored rows layout uint8 [rows, cols / 32 * 17], every byte kept."""
    rows, nb = scales.shape
    if blocks.shape != (rows, nb, QBLOCK // 2):
        raise ValueError(f"mxfp4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)}")
    out = np.zeros((rows, nb), BLOCK_DTYPES["mxfp4"])
    out["e"] = scales
    out["qs"] = blocks
    return out.view(np.uint8).reshape(rows, -1)


def to_mx(stored: np.ndarray, cols: int) -> tuple:
    """The inverse of `from_mx`: (blocks [rows, cols / 32, 16], scales [rows, cols / 32])."""
    blocks = np.ascontiguousarray(stored).view(BLOCK_DTYPES["mxfp4"]).reshape(stored.shape[0], cols // QBLOCK)
    return blocks["qs"].copy(), blocks["e"].copy()


def dequantize(stored: np.ndarray, dtype: str, cols: int) -> np.ndarray:
    """uint8 [rows, row_bytes] of blocks -> float32 [rows, cols] (exactly what the kernels use)."""
    if dtype == "nl4":
        return _dequantize_nl4(stored, cols)
    rows = stored.shape[0]
    blocks = np.ascontiguousarray(stored).view(BLOCK_DTYPES[dtype]).reshape(rows, cols // QBLOCK)
    if dtype == "mxfp4":
        scale = np.ldexp(np.float32(1), blocks["e"].astype(np.int32) - 127).astype(np.float32)[..., None]
        qs = blocks["qs"]
        q = FP4_VALUES[np.stack([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1, QBLOCK)]
        return (scale * q).astype(np.float32).reshape(rows, cols)
    d = blocks["d"].view(np.float16).astype(np.float32)[..., None]
    if dtype == "int8":
        q = blocks["qs"].astype(np.float32)
    elif dtype == "int6":
        qs = blocks["qs"]
        u = np.concatenate([qs & 0x0F, qs >> 4], axis=2).astype(np.int16)  # the low 4 bits
        high = (blocks["qh"][..., None] >> (2 * np.arange(4, dtype=np.uint8))) & 3  # [rows, nb, 8, 4]
        u[..., INT6_HIGH_ORDER] |= high.astype(np.int16) << 4
        q = u.astype(np.float32) - 32
    else:
        qs = blocks["qs"]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).astype(np.float32) - 8
    return (d * q).reshape(rows, cols)


class StoredMatrix:
    """A matrix that arrives already in one of Colibri's storage formats, in its rows layout:
    uint8 [rows, row_bytes(dtype, cols)] of int8/int4/mxfp4 blocks (gpt-oss's mxfp4 experts via
    `from_mx`; a GGUF's Q8_0, Q4_0 and MXFP4 tensors), or uint16 [rows, cols] of f16/bf16 values
    (a GGUF's F16/BF16 matrices). Stored as it is when the target format is `dtype` (no pass
    through float32, no second rounding); `f32` gives exactly the values the kernels compute with."""

    def __init__(self, stored: np.ndarray, dtype: str, cols: int):
        width = cols * 2 if dtype in FLOAT16_FORMATS else row_bytes(dtype, cols) if dtype in BLOCK_DTYPES else -1
        if (dtype in BLOCK_DTYPES and cols % QBLOCK) or stored.ndim != 2 or stored.shape[1] * stored.itemsize != width:
            raise ValueError(f"{dtype} rows of {cols} columns cannot be {list(stored.shape)} x {stored.itemsize} bytes")
        self.dtype = dtype
        self._stored = np.ascontiguousarray(stored, "<u2" if dtype in FLOAT16_FORMATS else np.uint8)
        self.shape = (stored.shape[0], cols)

    def stored(self) -> np.ndarray:
        return self._stored

    def f32(self) -> np.ndarray:
        if self.dtype == "bf16":
            return (self._stored.astype(np.uint32) << 16).view(np.float32)
        if self.dtype == "f16":
            return self._stored.view(np.float16).astype(np.float32)
        return dequantize(self._stored, self.dtype, self.shape[1])

    def rows(self, order) -> "StoredMatrix":
        """The same matrix with its rows in `order` (whole rows move: blocks stay intact)."""
        return StoredMatrix(self._stored[order], self.dtype, self.shape[1])

    def not_finite(self) -> bool:
        """Does a value or a block scale hold NaN or infinity (mxfp4's e8m0 255, a non-finite f16
        scale, an all-ones f16/bf16 exponent)?"""
        if self.dtype in FLOAT16_FORMATS:
            exponent = 0x7F80 if self.dtype == "bf16" else 0x7C00
            return bool(((self._stored & exponent) == exponent).any())
        blocks = self._stored.view(BLOCK_DTYPES[self.dtype])
        if self.dtype == "mxfp4":
            return bool((blocks["e"] == E8M0_NAN).any())
        return not bool(np.isfinite(blocks["d"].view(np.float16)).all())


def transpose(stored: np.ndarray, dtype: str, cols: int) -> np.ndarray:
    """A matrix stored in the rows layout -> the same matrix in the transposed layout.

    f32/f16/bf16 (any numpy dtype): [rows, cols] -> [cols, rows]. int8/int4: uint8 [rows,
    row_bytes] of blocks -> uint8 [cols / 32, rows / 8 * group bytes], group (kb, g) holding the
    scales and weights of block kb of outputs 8g .. 8g+7 (rows must be a multiple of 8)."""
    check_layout(dtype, "transposed", "quant.transpose")
    if dtype not in BLOCK_DTYPES:
        return np.ascontiguousarray(np.asarray(stored).T)
    rows = stored.shape[0]
    if rows % TGROUP:
        raise ValueError(f"the transposed {dtype} layout needs a multiple of {TGROUP} rows, got {rows}")
    nb = cols // QBLOCK
    blocks = np.ascontiguousarray(stored).view(BLOCK_DTYPES[dtype]).reshape(rows // TGROUP, TGROUP, nb)
    blocks = blocks.transpose(2, 0, 1)  # [nb, groups, 8]
    out = np.zeros(blocks.shape[:2], GROUP_DTYPES[dtype])
    out["d"] = blocks["d"]
    out["qs"] = blocks["qs"]
    return out.view(np.uint8).reshape(nb, -1)


def _interleave_bf16(stored: np.ndarray, cols: int) -> np.ndarray:
    """bf16 bits [rows, cols] -> uint8 [rows / 8, cols * 16]: cb_igroup_bf16's order, a group's
    inputs 4 at a time for its 8 outputs ([groups, cols / 4, 8, 4] bf16 values)."""
    rows = stored.shape[0]
    if rows % TGROUP or cols % QBLOCK:
        raise ValueError(
            f"the interleaved bf16 layout needs a multiple of {TGROUP} rows and of {QBLOCK} columns, "
            f"got [{rows}, {cols}]"
        )
    w = np.ascontiguousarray(stored).view(np.uint16).reshape(rows // TGROUP, TGROUP, cols // 4, 4)
    return np.ascontiguousarray(w.transpose(0, 2, 1, 3)).view(np.uint8).reshape(rows // TGROUP, -1)


def _deinterleave_bf16(stored: np.ndarray, rows: int, cols: int) -> np.ndarray:
    groups = np.ascontiguousarray(stored).view(np.uint16).reshape(rows // TGROUP, cols // 4, TGROUP, 4)
    return np.ascontiguousarray(groups.transpose(0, 2, 1, 3)).reshape(rows, cols)


def interleave(stored: np.ndarray, dtype: str, cols: int) -> np.ndarray:
    """An int8/int4/mxfp4/nl4/int6/bf16 matrix stored in the rows layout -> the interleaved layout: uint8 [rows / 8,
    cols / 32 * group bytes], group (g, kb) holding block kb of outputs 8g .. 8g+7 (rows must be a
    multiple of 8). A block's bytes go 4 at a time: both formats keep a unit of 4 bytes whole
    (bf16: 4 values, 8 bytes; cols a multiple of 32)."""
    check_layout(dtype, "interleaved", "quant.interleave")
    if dtype == "nl4":
        return _interleave_nl4(stored, cols)
    if dtype == "bf16":
        return _interleave_bf16(stored, cols)
    rows = stored.shape[0]
    if rows % TGROUP:
        raise ValueError(f"the interleaved {dtype} layout needs a multiple of {TGROUP} rows, got {rows}")
    nb = cols // QBLOCK
    blocks = np.ascontiguousarray(stored).view(BLOCK_DTYPES[dtype]).reshape(rows // TGROUP, TGROUP, nb)
    out = np.zeros((rows // TGROUP, nb), IGROUP_DTYPES[dtype])
    if dtype == "mxfp4":  # codes in element order, then packed as int4's nibbles
        out["e"] = blocks["e"].transpose(0, 2, 1)
        qs = blocks["qs"]
        codes = np.stack([qs & 0x0F, qs >> 4], axis=-1).reshape(qs.shape[:3] + (QBLOCK,))
        packed = codes[..., :16] | (codes[..., 16:] << 4)  # [groups, 8, nb, 16]
        out["qs"] = packed.reshape(packed.shape[:3] + (4, 4)).transpose(0, 2, 3, 1, 4)
        return out.view(np.uint8).reshape(rows // TGROUP, -1)
    out["d"] = blocks["d"].transpose(0, 2, 1)  # [groups, nb, 8]
    for field in ("qs", "qh") if dtype == "int6" else ("qs",):
        qs = blocks[field]  # [groups, 8, nb, bytes]
        units = qs.reshape(qs.shape[:3] + (-1, 4))  # [groups, 8, nb, units, 4]
        out[field] = units.transpose(0, 2, 3, 1, 4)  # [groups, nb, units, 8, 4]
    return out.view(np.uint8).reshape(rows // TGROUP, -1)


def deinterleave(stored: np.ndarray, dtype: str, rows: int, cols: int) -> np.ndarray:
    """The inverse of `interleave`: the matrix in the rows layout."""
    if dtype == "nl4":
        return _deinterleave_nl4(stored, rows, cols)
    if dtype == "bf16":
        return _deinterleave_bf16(stored, rows, cols)
    nb = cols // QBLOCK
    groups = np.ascontiguousarray(stored).view(IGROUP_DTYPES[dtype]).reshape(rows // TGROUP, nb)
    out = np.zeros((rows // TGROUP, TGROUP, nb), BLOCK_DTYPES[dtype])
    if dtype == "mxfp4":
        out["e"] = groups["e"].transpose(0, 2, 1)
        packed = groups["qs"].transpose(0, 3, 1, 2, 4).reshape(rows // TGROUP, TGROUP, nb, 16)
        codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # element order
        out["qs"] = codes[..., 0::2] | (codes[..., 1::2] << 4)
        return out.view(np.uint8).reshape(rows, -1)
    out["d"] = groups["d"].transpose(0, 2, 1)
    for field in ("qs", "qh") if dtype == "int6" else ("qs",):
        qs = groups[field].transpose(0, 3, 1, 2, 4)  # [groups, 8, nb, units, 4]
        out[field] = qs.reshape(qs.shape[:3] + (-1,))
    return out.view(np.uint8).reshape(rows, -1)


def from_rows(stored: np.ndarray, dtype: str, cols: int, layout: str) -> np.ndarray:
    """A matrix stored in the rows layout (nl4/int6: their rows form) -> the same matrix in `layout`,
    one of the format's (colibri.formats)."""
    check_layout(dtype, layout, "quant.from_rows")
    if layout == "transposed":
        return transpose(stored, dtype, cols)
    if layout == "interleaved":
        return interleave(stored, dtype, cols)
    return stored


def to_rows(stored: np.ndarray, dtype: str, rows: int, cols: int, layout: str) -> np.ndarray:
    """A matrix stored in `layout`, one of the format's (colibri.formats) -> the same matrix in the rows
    layout (nl4/int6: their rows form)."""
    check_layout(dtype, layout, "quant.to_rows")
    if layout == "transposed":
        return untranspose(stored, dtype, rows, cols)
    if layout == "interleaved":
        return deinterleave(stored, dtype, rows, cols)
    return stored


def untranspose(stored: np.ndarray, dtype: str, rows: int, cols: int) -> np.ndarray:
    """The inverse of `transpose`: the matrix in the rows layout."""
    if dtype not in BLOCK_DTYPES:
        return np.ascontiguousarray(np.asarray(stored).T)
    nb = cols // QBLOCK
    groups = np.ascontiguousarray(stored).view(GROUP_DTYPES[dtype]).reshape(nb, rows // TGROUP)
    out = np.zeros((rows // TGROUP, TGROUP, nb), BLOCK_DTYPES[dtype])
    out["d"] = groups["d"].transpose(1, 2, 0)
    out["qs"] = groups["qs"].transpose(1, 2, 0, 3)
    return out.view(np.uint8).reshape(rows, -1)
