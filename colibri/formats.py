"""The table of storage formats: per format, the layouts it may be stored in, whether it is a block
format, and its bytes. Every layer asks this table — convert's flags and its choice of layout,
modeldir's check of a directory's tensor table, quant's packing — and `check_layout` words every
refusal the same way.

The table is built from the sets colibri._kernels exports, which come from the C kernel table (the
authority on which kernels exist): the block formats have a kernel per layout of GROUP_FORMATS
(transposed) and INTERLEAVED_FORMATS (interleaved); INTERLEAVED_ONLY_FORMATS have no rows kernels
(csrc/quant.h). Nothing here is defined twice.

    f32, f16        rows, transposed
    bf16            rows, transposed, interleaved
    int8, int4      rows, transposed, interleaved     (block)
    mxfp4           rows, interleaved                 (block)
    nl4, int6       interleaved                       (block)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import names
from ._kernels import BLOCK_FORMATS, DTYPE_CODES, GROUP_FORMATS, INTERLEAVED_FORMATS, INTERLEAVED_ONLY_FORMATS
from .errors import ColibriError

# numpy dtype of the stored elements of the float formats (bf16: its raw 16 bits); the block formats are bytes
_FLOAT_ELEMENTS = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "bf16": np.dtype("<u2")}


@dataclass(frozen=True)
class Format:
    """One storage format of weight matrices."""

    name: str  # names.FORMATS
    code: int  # _kernels.DTYPE_CODES: the C enum the kernels dispatch on
    layouts: tuple  # the names.LAYOUTS it may be stored in (in that order): those with kernels
    block: bool  # blocks of QBLOCK weights with a scale, multiplied against quantized activations
    element: np.dtype  # numpy dtype of the stored elements (block formats: bytes)

    @property
    def default_layout(self) -> str:
        """The faster of its layouts (quant.default_layout says why): interleaved where it has it, else rows."""
        return "interleaved" if "interleaved" in self.layouts else "rows"

    def grouped(self, layout: str) -> bool:
        """Does `layout` store this format in groups of TGROUP outputs (so a matrix needs a multiple of
        TGROUP rows)? Interleaved always; transposed for the block formats (their groups of blocks)."""
        return layout == "interleaved" or (layout == "transposed" and self.block)

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of `cols` weights in the rows layout (nl4: its rows form, quant.row_bytes)."""
        if not self.block:
            return cols * self.element.itemsize
        from . import quant  # the blocks' byte layouts (quant.py's structured dtypes); quant asks this table

        return quant.row_bytes(self.name, cols)

    def nbytes(self, shape) -> int:
        """Bytes of a tensor of logical `shape` as stored (the same in each of its layouts: they permute
        the bytes; nl4, stored interleaved only, has its groups and row scales: quant.nl4_bytes)."""
        rows = math.prod(shape[:-1])  # exact integers: np.prod wraps around past 2**63
        if self.name == "nl4":
            from . import quant

            return quant.nl4_bytes(rows, shape[-1])
        return rows * self.row_bytes(shape[-1])


def _layouts(name: str) -> tuple:
    allowed = {
        "rows": name not in INTERLEAVED_ONLY_FORMATS,
        "transposed": name not in INTERLEAVED_ONLY_FORMATS and (name not in BLOCK_FORMATS or name in GROUP_FORMATS),
        "interleaved": name in INTERLEAVED_FORMATS,
    }
    return tuple(layout for layout in names.LAYOUTS if allowed[layout])


FORMATS = {
    name: Format(name, code, _layouts(name), name in BLOCK_FORMATS, _FLOAT_ELEMENTS.get(name, np.dtype("u1")))
    for name, code in DTYPE_CODES.items()
}


def layouts_of(dtype: str) -> tuple:
    """The layouts a tensor stored as `dtype` may have: its format's, or rows for the other stored
    dtypes (f32 vectors, int16 norm weights)."""
    fmt = FORMATS.get(dtype)
    return fmt.layouts if fmt is not None else ("rows",)


def _either(items) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def check_layout(dtype: str, layout: str, where: str) -> None:
    """Refuse `layout` for a tensor stored as `dtype` unless the table has it; `where`: the tensor
    (with its file) or the flag asking. One message for every layer."""
    allowed = layouts_of(dtype)
    if layout not in allowed:
        raise ColibriError(f"{where}: {dtype} has no {layout} layout, only {_either(allowed)}")
