"""The table of formats (colibri.formats) and the layers that ask it: for every (format, layout)
pair, convert's layout flags, modeldir's check of a tensor table entry and quant's packing accept
exactly the pairs the table has, refuse the others with its one message, and store the bytes it
counts."""

from __future__ import annotations

import re

import numpy as np
import pytest

from colibri import _kernels, names, quant
from colibri.convert import MXFP4_DENSE_DTYPE, _layout_for, check_layout_flags
from colibri.errors import ColibriError
from colibri.formats import FORMATS, check_layout, layouts_of
from colibri.modeldir import check_stored_layout, storage_nbytes, to_storage

PAIRS = [(fmt, layout) for fmt in names.FORMATS for layout in names.LAYOUTS]
SHAPE = (16, 64)  # two groups of 8 outputs, two blocks of 32 inputs

# the rule as it stood before the table, written out: the table must reproduce it
EXPECTED = {
    "f32": ("rows", "transposed"),
    "f16": ("rows", "transposed"),
    "bf16": ("rows", "transposed", "interleaved"),
    "int8": ("rows", "transposed", "interleaved"),
    "int4": ("rows", "transposed", "interleaved"),
    "mxfp4": ("rows", "interleaved"),
    "nl4": ("interleaved",),
    "int6": ("interleaved",),
}


def _refusal(where, fmt, layout):
    """The one message of formats.check_layout, as a regex."""
    allowed = FORMATS[fmt].layouts
    either = allowed[0] if len(allowed) == 1 else f"{', '.join(allowed[:-1])} or {allowed[-1]}"
    return re.escape(f"{where}: {fmt} has no {layout} layout, only {either}")


def test_the_table_holds_every_format_and_the_kernels_sets():
    assert tuple(FORMATS) == names.FORMATS
    assert {f: FORMATS[f].layouts for f in FORMATS} == EXPECTED
    assert tuple(f for f in FORMATS if FORMATS[f].block) == _kernels.BLOCK_FORMATS
    assert {f: FORMATS[f].code for f in FORMATS} == _kernels.DTYPE_CODES
    assert tuple(f for f in FORMATS if FORMATS[f].layouts == ("interleaved",)) == _kernels.INTERLEAVED_ONLY_FORMATS
    assert layouts_of("int16") == ("rows",)
    for fmt in FORMATS:
        assert quant.default_layout(fmt) == FORMATS[fmt].default_layout in FORMATS[fmt].layouts


@pytest.mark.parametrize("fmt, layout", PAIRS)
def test_check_layout_names_where_the_format_and_the_layouts(fmt, layout):
    if layout in FORMATS[fmt].layouts:
        check_layout(fmt, layout, "here")
    else:
        with pytest.raises(ColibriError, match=_refusal("here", fmt, layout)):
            check_layout(fmt, layout, "here")


@pytest.mark.parametrize("fmt, layout", PAIRS)
def test_convert_flags_agree_with_the_table(fmt, layout):
    """--expert-layout asks the format's table; --layout too, but mxfp4's other matrices are bf16."""
    if layout in FORMATS[fmt].layouts:
        check_layout_flags(fmt, layout, None)
    else:
        with pytest.raises(ColibriError, match=_refusal(f"--expert-layout (--quantize {fmt})", fmt, layout)):
            check_layout_flags(fmt, layout, None)
    dense = MXFP4_DENSE_DTYPE if fmt == "mxfp4" else fmt
    if layout in FORMATS[dense].layouts:
        check_layout_flags(fmt, None, layout)
    else:
        with pytest.raises(ColibriError, match=_refusal(f"--layout (--quantize {fmt})", dense, layout)):
            check_layout_flags(fmt, None, layout)
    # the layout convert chooses for a matrix is always one the table has
    for name in ("layers.0.experts.1.up", "layers.0.wq", "embedding"):
        for shape in (SHAPE, (12, 64), (16, 40)):
            assert _layout_for(name, shape, "matrix", fmt, layout, layout, tied=True) in FORMATS[fmt].layouts


@pytest.mark.parametrize("fmt, layout", PAIRS)
def test_modeldir_agrees_with_the_table(fmt, layout):
    ctx = "m/config.json: tensor layers.0.wq"
    if layout in FORMATS[fmt].layouts:
        check_stored_layout(fmt, layout, SHAPE, "matrix", ctx)
    else:
        with pytest.raises(ColibriError, match=_refusal(ctx, fmt, layout)):
            check_stored_layout(fmt, layout, SHAPE, "matrix", ctx)


@pytest.mark.parametrize("fmt, layout", PAIRS)
def test_quant_packs_exactly_the_tables_pairs_in_its_bytes(fmt, layout):
    w = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    stored = to_storage(w, fmt)  # the rows layout (nl4/int6: their rows form)
    if layout not in FORMATS[fmt].layouts:
        with pytest.raises(ColibriError, match=_refusal("quant.from_rows", fmt, layout)):
            quant.from_rows(stored, fmt, SHAPE[1], layout)
        return
    packed = quant.from_rows(stored, fmt, SHAPE[1], layout)
    assert packed.nbytes == FORMATS[fmt].nbytes(SHAPE) == storage_nbytes(fmt, SHAPE)
    np.testing.assert_array_equal(quant.to_rows(packed, fmt, *SHAPE, layout), stored)


def test_the_format_page_lists_the_table():
    """docs/format.md's table of layouts per format is the table's own (no drift)."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "format.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `(\w+)` \| ((?:`\w+`(?:, )?)+) \|$", page, re.M))
    listed = {name: tuple(re.findall(r"`(\w+)`", layouts)) for name, layouts in rows.items() if name in FORMATS}
    assert listed == {name: fmt.layouts for name, fmt in FORMATS.items()}
