"""relayout: a model directory rewritten in other layouts without the checkpoint — byte for byte
the directly converted files, the same logits, and the refusals that keep a user's data safe.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import colibri
from colibri.errors import ColibriError
from colibri.modeldir import ModelDir
from conftest import reference


def test_relayout_rewrites_a_directory_without_the_checkpoint(converted, tmp_path):
    """relayout: rows -> default layouts gives the directly converted directory's tensor files,
    byte for byte; back to rows gives the original ones; the result loads and verifies."""
    from colibri.convert import relayout

    rows, default = ModelDir(converted("qwen2moe_a", "int8", "rows")), ModelDir(converted("qwen2moe_a", "int8"))
    lines = []
    out = tmp_path / "t"
    relayout(rows.root, out, log=lines.append)
    assert any(line.startswith(f"[INFO] Wrote {out}: experts ") for line in lines)
    got = ModelDir(out)
    assert got.verify() == []
    for rel, entry in default.files.items():
        assert got.files[rel]["sha256"] == entry["sha256"], rel
    assert {n: t["layout"] for n, t in got.tensors.items()} == {n: t["layout"] for n, t in default.tensors.items()}
    back = tmp_path / "r"
    relayout(out, back, expert_layout="rows", layout="rows", log=lines.append)
    for rel, entry in rows.files.items():
        assert ModelDir(back).files[rel]["sha256"] == entry["sha256"], rel
    ids = reference("qwen2moe_a")["input_ids"]
    np.testing.assert_array_equal(colibri.load(out).forward(ids), colibri.load(default.root).forward(ids))


def test_relayout_refuses_its_own_directory_and_a_full_output(converted, tmp_path):
    from colibri.convert import relayout

    src = converted("mixtral_a", "int8")
    with pytest.raises(ColibriError, match="is the model directory itself"):
        relayout(src, src)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    with pytest.raises(ColibriError, match="not empty"):
        relayout(src, tmp_path / "full")
    assert (tmp_path / "full" / "x").read_text() == "keep"
    with pytest.raises(ColibriError, match="--layout 'cols'"):
        relayout(src, tmp_path / "new", layout="cols")
    assert not (tmp_path / "new").exists()


def test_relayout_refuses_a_damaged_source(converted, tmp_path):
    """A flipped byte in the source is reported, not copied under a fresh checksum."""
    from colibri.convert import relayout

    src = tmp_path / "src"
    shutil.copytree(converted("mixtral_a", "int8", "rows"), src)
    victim = src / "layers" / "01" / "expert_002.bin"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(ColibriError, match="expert_002.bin: sha256 mismatch"):
        relayout(src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
