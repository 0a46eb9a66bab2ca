"""Error-compensating quantization (GPTQ: Frantar et al., 2022) into int8, int4, int6 and nl4.

Design
------
With a diagonal importance (quant.quantize(importance=[cols])) each block's scale minimises
sum_c imp_c (w_c - q_c)^2: the input columns are taken as uncorrelated. A matrix's real output
error over its inputs x is, per row, (w - q)^T H (w - q) with H = E[x x^T], the input's whole
second moment (calibrate --second-moments), and hidden states are strongly correlated. Rounding
the columns one at a time, in order, and moving each column's rounding error onto the columns
not yet rounded (the update that is optimal for that H) lowers it further. Rows are independent;
all of a matrix's rows go together, as vectors.

    H += DAMP x mean(diag H) x I          positive definite (columns never seen, tiny ones)
    U  = the upper Cholesky factor of H^-1
    for each column j (the updates lazy: a column's error reaches the rest of its scale block at
    once, the rest of its BLOCK of columns after the scale block, the later columns after the
    BLOCK, each of the last two as one matrix product):
        at a scale block's first column: its scales from its current values, chosen as the
            diagonal path chooses them (diag H as the importance)
        q_j = the nearest level of w_j under that scale;  e = (w_j - q_j) / U[j, j]
        w[:, j+1:] -= e U[j, j+1:]

Scale blocks: 32 columns (int8/int4/int6, one f16 scale; quant._weighted_scales) or 16 (nl4, a
six-bit scale under the row's f32 scale, which comes from the row's largest magnitude as it does
without compensation; _kernels.nl4_search_halves). The bytes are the format's own
(quant.pack_blocks, quant.pack_nl4): every kernel reads them unchanged.
"""

from __future__ import annotations

import numpy as np

from . import quant
from ._kernels import NL4_SCALE_BIAS, nl4_row_scales, nl4_search_halves

DAMP = 0.01  # GPTQ's dampening: 1 % of the mean diagonal
BLOCK = 128  # columns updated together (a multiple of both scale blocks)
NL4_HALF = quant.QBLOCK // 2


def upper_inverse_factor(h: np.ndarray, damp: float = DAMP) -> np.ndarray:
    """float64 [cols, cols] U, upper triangular, with U^T U = (h + damping)^-1 (LinAlgError where
    h + damping is not positive definite)."""
    h = np.array(h, np.float64)
    diag = np.diagonal(h).copy()
    mean = float(diag.mean()) if diag.size else 0.0
    h[np.diag_indices_from(h)] += damp * mean if mean > 0 else 1.0
    dead = np.diagonal(h) <= 0  # a column never seen: no error moves through it
    if dead.any():
        h[dead, :] = 0
        h[:, dead] = 0
        h[dead, dead] = 1.0
    inv = np.linalg.inv(h)
    return np.linalg.cholesky((inv + inv.T) / 2).T


def _factor_or_none(h: np.ndarray):
    """upper_inverse_factor at DAMP, else at 10 and 100 times it (a second moment that float32
    rounding left slightly indefinite); None if none is positive definite."""
    for damp in (DAMP, 10 * DAMP, 100 * DAMP):
        try:
            u = upper_inverse_factor(h, damp)
        except np.linalg.LinAlgError:
            continue
        if np.isfinite(u).all():
            return u
    return None


def quantize_compensated(w: np.ndarray, dtype: str, second_moment: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] -> the stored rows layout of `dtype` (quant.quantize's bytes), its
    columns rounded in order with their errors compensated under second_moment [cols, cols]."""
    w = np.asarray(w, np.float32)
    rows, cols = w.shape
    h = np.asarray(second_moment, np.float64)
    imp = np.ascontiguousarray(np.diagonal(h), np.float32)
    u = _factor_or_none(h)
    if u is None:  # nothing to compensate with: the diagonal path
        return quant.quantize(w, dtype, imp)
    group = NL4_HALF if dtype == "nl4" else quant.QBLOCK
    n_groups = cols // group
    if dtype == "nl4":
        row_scale = nl4_row_scales(w)  # [rows] from the original weights
        sc = np.zeros((rows, n_groups), np.uint8)  # per half-block, stored (sub + bias)
    else:
        d16 = np.zeros((rows, n_groups), np.float16)
    codes = np.zeros((rows, cols), np.int16)  # int: levels; nl4: NL4_VALUES indices
    work = w.astype(np.float64)
    for b0 in range(0, cols, BLOCK):
        b1 = min(b0 + BLOCK, cols)
        blk = work[:, b0:b1].copy()  # [rows, b1 - b0], updated as its columns round
        err = np.zeros_like(blk)  # the scaled errors e, by column
        for c0 in range(b0, b1, group):  # a scale block: its scales, then its columns
            c1, g = c0 + group, c0 // group
            x = blk[:, c0 - b0 : c1 - b0].astype(np.float32)
            if dtype == "nl4":
                sc[:, g], _ = nl4_search_halves(x, imp[c0:c1], row_scale)
                sub = sc[:, g].astype(np.float32) - NL4_SCALE_BIAS  # [rows]
                step = row_scale * sub
            else:
                xb = x[:, None, :]
                d16[:, g] = quant._weighted_scales(xb, imp[c0:c1], dtype, quant.initial_scales(xb, dtype))[:, 0]
                step = d16[:, g].astype(np.float32)
            for c in range(c0, c1):
                j = c - b0
                col = blk[:, j]
                if dtype == "nl4":
                    ratio = np.divide(col, step, out=np.zeros_like(col), where=step != 0)
                    idx = np.where(step != 0, np.abs(ratio[:, None] - quant.NL4_VALUES).argmin(axis=1), 8)
                    q = (row_scale * (sub * quant.NL4_VALUES[idx])).astype(np.float64)  # the kernels' order
                else:
                    idx = quant.levels_of(col.astype(np.float32)[:, None, None], step[:, None], dtype)[:, 0, 0]
                    q = step.astype(np.float64) * idx
                codes[:, c] = idx
                e = (col - q) / u[c, c]
                blk[:, j + 1 : c1 - b0] -= np.outer(e, u[c, c + 1 : c1])  # within the scale block
                err[:, j] = e
            blk[:, c1 - b0 :] -= err[:, c0 - b0 : c1 - b0] @ u[c0:c1, c1:b1]  # the rest of the block
        work[:, b1:] -= err @ u[b0:b1, b1:]  # the later blocks
    if dtype == "nl4":
        nb = cols // quant.QBLOCK
        return quant.pack_nl4(
            sc.reshape(rows, nb, 2), codes.reshape(rows, nb, quant.QBLOCK).astype(np.uint8), row_scale
        )
    return quant.pack_blocks(dtype, d16, codes.reshape(rows, n_groups, quant.QBLOCK))
