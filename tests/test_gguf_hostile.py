"""GGUF files that lie (colibri/gguf_import.py's GGUFFile, issue 70): a size, count, offset, string
length or type code the file cannot hold is one ColibriError naming the file and the value, raised
before anything is allocated or looped over from it.

- Each lie, made by patching bytes of a real fixture (mixtral_a-Q8_0.gguf, the 153 kB file of the
  issue's probe): metadata arrays of 10^9 elements, strings and keys of 2^40 bytes, unknown value
  and tensor type codes, arrays of arrays, counts of tensors and metadata entries that run past
  their sections, tensor offsets, dimensions and sizes past the file, block_count 10^9, a vocabulary
  of a million tokens more than the embedding has rows. Before, these ran for 20 to 60 s into
  gigabytes (or forever), or ended in MemoryError and a line about config.json.
- Memory is bounded: each refusal is measured with tracemalloc (PEAK_BYTES), far below what the
  claimed counts would take.
- Hypothesis: every count and length field of the fixture set to random values, and the file cut
  at random points: the import succeeds or is a ColibriError naming the file, within PEAK_BYTES.
- The parser reads exactly what llama.cpp's Python reader (the gguf package) reads from every
  fixture: the same metadata, tensor types, shapes and bytes.
- The CLI: exit status 2, one line on stderr, no traceback, no output directory.
"""

from __future__ import annotations

import math
import re
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colibri.errors import ColibriError

gguf = pytest.importorskip("gguf", reason="the gguf package (pip install 'colibri-moe[gguf]')")
from colibri.gguf_import import GGUFCheckpoint, GGUFFile  # noqa: E402
from colibri.gguf_vocab import tokenizer_files  # noqa: E402

GGUF_DIR = Path(__file__).parent / "fixtures" / "gguf"
SOURCE = GGUF_DIR / "mixtral_a-Q8_0.gguf"
PEAK_BYTES = 32 << 20  # what a refusal (or the whole read of the 153 kB fixture) may allocate
MILLION = 1_000_000


class Fixture:
    """The source file's bytes and where its structural fields are, found with gguf's reader."""

    def __init__(self):
        self.data = SOURCE.read_bytes()
        r = gguf.GGUFReader(SOURCE)
        self.reader = r
        base = r.data.ctypes.data

        def at(part) -> int:
            return part.ctypes.data - base

        self.value = {}  # key -> offset of its value type code
        self.fields = []  # (offset, struct format, what): every length, count and type code
        for name, f in r.fields.items():
            if name.startswith("GGUF."):
                continue
            klen, _, vtype = f.parts[:3]
            self.value[name] = at(vtype)
            self.fields += [(at(klen), "<Q", f"key length of {name}"), (at(vtype), "<I", f"type of {name}")]
            if f.types[0] == gguf.GGUFValueType.STRING:
                self.fields.append((at(f.parts[3]), "<Q", f"length of {name}"))
            if f.types[0] == gguf.GGUFValueType.ARRAY:
                self.fields += [
                    (at(f.parts[3]), "<I", f"item type of {name}"),
                    (at(f.parts[4]), "<Q", f"count of {name}"),
                ]
                if f.types[-1] == gguf.GGUFValueType.STRING:
                    self.fields += [(at(f.parts[i]), "<Q", f"length of {name}[{i}]") for i in (5, 7, 63, 253)]
        self.tensor = {}  # name -> {"n_dims", "dims", "type", "offset"}: offsets of its fields
        for t in r.tensors:
            name_len, _, n_dims, dims, ttype, offset = t.field.parts
            self.tensor[t.name] = {"n_dims": at(n_dims), "dims": at(dims), "type": at(ttype), "offset": at(offset)}
            self.fields += [
                (at(name_len), "<Q", f"name length of {t.name}"),
                (at(n_dims), "<I", f"n_dims of {t.name}"),
                *((at(dims) + 8 * j, "<Q", f"dim {j} of {t.name}") for j in range(len(t.shape))),
                (at(ttype), "<I", f"type of {t.name}"),
                (at(offset), "<Q", f"offset of {t.name}"),
            ]

    def patched(self, *edits) -> bytes:
        """The file with (offset, struct format, value) written over it."""
        out = bytearray(self.data)
        for offset, fmt, value in edits:
            struct.pack_into(fmt, out, offset, value)
        return bytes(out)


_FIXTURE = None


def fixture() -> Fixture:
    global _FIXTURE
    if _FIXTURE is None:
        _FIXTURE = Fixture()
    return _FIXTURE


def refused(path: Path, peak_bytes: int | None = PEAK_BYTES) -> str:
    """The ColibriError message of importing `path`, which must name it; what it allocates is
    measured (tracemalloc) and bounded by peak_bytes (None: not measured)."""
    if peak_bytes is not None:
        tracemalloc.start()
    try:
        with pytest.raises(ColibriError) as e:
            GGUFCheckpoint(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak_bytes is None or peak < peak_bytes, f"{peak} bytes allocated before the refusal"
    message = str(e.value)
    assert str(path) in message and "\n" not in message, message
    return message


def _lies():
    """(name, patch: Fixture -> bytes, the message's pattern)."""
    f = lambda: fixture()  # noqa: E731
    v = lambda key: f().value[key]  # noqa: E731 -- the value type code of a key
    t = lambda name, field: f().tensor[name][field]  # noqa: E731
    return [
        (
            "tokens count 10^9",
            lambda: f().patched((v("tokenizer.ggml.tokens") + 8, "<Q", 10**9)),
            r"metadata array 'tokenizer\.ggml\.tokens' claims 1000000000 elements \(at least 8 bytes each\) "
            r"but \d+ bytes are left",
        ),
        (
            "a u8 array of 10^9",  # the probe: gguf's reader looped for 25-35 s into 4 GB
            lambda: f().patched(
                (v("tokenizer.ggml.scores") + 4, "<I", 0), (v("tokenizer.ggml.scores") + 8, "<Q", 10**9)
            ),
            r"'tokenizer\.ggml\.scores' claims 1000000000 elements \(1 bytes each\)",
        ),
        (
            "a string of 2^40 bytes",
            lambda: f().patched((v("general.name") + 4, "<Q", 1 << 40)),
            r"metadata 'general\.name' claims 1099511627776 bytes at byte \d+ but \d+ are left",
        ),
        (
            "a key of 2^40 bytes",
            lambda: f().patched((f().reader.fields["general.name"].offset, "<Q", 1 << 40)),
            r"metadata key 2 claims 1099511627776 bytes",
        ),
        (
            "a token of 2^40 bytes",
            lambda: f().patched((v("tokenizer.ggml.tokens") + 16, "<Q", 1 << 40)),
            r"metadata 'tokenizer\.ggml\.tokens'\[0\] claims 1099511627776 bytes",
        ),
        (
            "a token not UTF-8",
            lambda: f().patched((v("tokenizer.ggml.tokens") + 24, "<B", 0xFF)),
            r"'tokenizer\.ggml\.tokens'\[0\] is not valid UTF-8",
        ),
        (
            "value type 99",
            lambda: f().patched((v("general.name"), "<I", 99)),
            r"metadata 'general\.name' has value type 99, not a GGUF type",
        ),
        (
            "array item type 99",
            lambda: f().patched((v("tokenizer.ggml.scores") + 4, "<I", 99)),
            r"'tokenizer\.ggml\.scores' is an array of value type 99",
        ),
        (
            "an array of arrays",
            lambda: f().patched((v("tokenizer.ggml.scores") + 4, "<I", 9)),
            r"arrays of arrays are not read",
        ),
        (
            "a key twice",  # general.type renamed general.name (the same length)
            lambda: f().patched(
                *((f().reader.fields["general.type"].offset + 8 + i, "<B", c) for i, c in enumerate(b"general.name"))
            ),
            r"metadata key 'general\.name' appears twice",
        ),
        (
            "alignment 7",  # general.file_type (7, a uint32) renamed general.alignment
            lambda: f().patched(
                *(
                    (f().reader.fields["general.file_type"].offset + 8 + i, "<B", c)
                    for i, c in enumerate(b"general.alignment")
                )
            ),
            r"general\.alignment is 7, not a power of 2",
        ),
        ("50 metadata entries more", lambda: f().patched((16, "<Q", len(f().value) + 50)), r"metadata key \d+ claims"),
        ("4000 tensors", lambda: f().patched((8, "<Q", 4000)), r"tensor"),
        (
            "a tensor offset of 10^12",
            lambda: f().patched((t("token_embd.weight", "offset"), "<Q", 10**12)),
            r"tensor 'token_embd\.weight' is at byte 1000000000000 of the data section, but the tensors before it end at \d+",
        ),
        (
            "a tensor of 10^6 rows",
            lambda: f().patched((t("token_embd.weight", "dims") + 8, "<Q", MILLION)),
            r"tensor 'token_embd\.weight' \(Q8_0, \[64, 1000000\]\) cannot be read: it claims 68000000 bytes",
        ),
        (
            "tensor dimensions whose product overflows 64 bits",
            lambda: f().patched(
                (t("token_embd.weight", "dims"), "<Q", 1 << 40), (t("token_embd.weight", "dims") + 8, "<Q", 1 << 40)
            ),
            r"\[1099511627776, 1099511627776\]\) cannot be read: it claims \d{20,} bytes",
        ),
        (
            "a dimension of 0 beside one of 10^9",
            lambda: f().patched(
                (t("blk.0.ffn_gate_exps.weight", "dims"), "<Q", 0),
                (t("blk.0.ffn_gate_exps.weight", "dims") + 16, "<Q", 10**9),
            ),
            r"'blk\.0\.ffn_gate_exps\.weight' has shape \[0, 48, 1000000000\]: no elements",
        ),
        (
            "10^9 dimensions",
            lambda: f().patched((t("token_embd.weight", "n_dims"), "<I", 10**9)),
            r"'token_embd\.weight' claims 1000000000 dimensions; a GGUF tensor has at most 4",
        ),
        (
            "tensor type 200",
            lambda: f().patched((t("token_embd.weight", "type"), "<I", 200)),
            r"'token_embd\.weight' has type 200, not a GGML tensor type",
        ),
        (
            "a Q8_0 tensor said to be F32 (4x its bytes)",
            lambda: f().patched((t("token_embd.weight", "type"), "<I", 0)),
            r"the tensors before it end at",
        ),
        (
            "a tensor name of 100 bytes",
            lambda: f().patched((f().reader.tensors[0].field.offset, "<Q", 100)),
            r"the name of tensor 0 is 100 bytes long, llama\.cpp's limit is 63",
        ),
        (
            "block_count 10^9",  # was 12-35 s into gigabytes, then "check the sizes in config.json"
            lambda: f().patched((v("llama.block_count") + 4, "<I", 10**9)),
            r"metadata llama\.block_count is 1000000000 but the file has tensors for 2 layers",
        ),
    ]


LIES = _lies()


@pytest.mark.parametrize("name, patch, message", LIES, ids=[c[0] for c in LIES])
def test_each_lie_is_one_error_naming_the_file_and_the_value(tmp_path, name, patch, message):
    path = tmp_path / "lie.gguf"
    path.write_bytes(patch())
    found = refused(path)
    assert re.search(message, found), found


def test_rows_not_a_whole_number_of_blocks_are_named(tmp_path):
    # output_norm [64] F32 said to be Q8_0 with 33 elements: not whole 32-element blocks
    f = fixture()
    at = f.tensor["output_norm.weight"]
    path = tmp_path / "rows.gguf"
    path.write_bytes(f.patched((at["type"], "<I", 8), (at["dims"], "<Q", 33)))
    assert "'output_norm.weight' (Q8_0) has rows of 33 elements, not a multiple of its blocks of 32" in refused(path)


def _with_extra_tokens(data: bytes, value_at: int, extra: int) -> bytes:
    """The file with `extra` tokens "x0000000".. appended to tokenizer.ggml.tokens (an honest array:
    every length right), the rest of the file moved along (the insert is a multiple of 32 bytes)."""
    count_at = value_at + 8
    (count,) = struct.unpack_from("<Q", data, count_at)
    end = count_at + 8
    for _ in range(count):
        (n,) = struct.unpack_from("<Q", data, end)
        end += 8 + n
    items = np.zeros(extra, dtype=[("n", "<u8"), ("s", "S8")])
    items["n"] = 8
    items["s"] = np.char.mod("x%07d", np.arange(extra)).astype("S8")
    insert = items.tobytes()
    assert len(insert) % 32 == 0
    return data[:count_at] + struct.pack("<Q", count + extra) + data[count_at + 8 : end] + insert + data[end:]


@pytest.mark.parametrize("extra, peak_bytes", [(MILLION, None), (100_000, 2 << 20)])
def test_a_vocabulary_larger_than_the_embedding_is_refused_by_its_count(tmp_path, extra, peak_bytes):
    """The issue's probe, a million tokens more, took 53 s to reach its error: now the array's
    count is checked against token_embd.weight before a token is read. With 10^5 more, measured:
    no strings made (they would take megabytes); a million is not measured, as tracemalloc slows
    the walk over their lengths fifty times."""
    f = fixture()
    path = tmp_path / "vocab.gguf"
    path.write_bytes(_with_extra_tokens(f.data, f.value["tokenizer.ggml.tokens"], extra))
    message = refused(path, peak_bytes)
    assert f"tokenizer.ggml.tokens has {extra + 128} tokens but token_embd.weight has 128 rows" in message


def test_the_padded_copy_with_no_extra_tokens_still_imports(tmp_path):
    """The helper above keeps a valid file valid (so what the test before refuses is the count)."""
    f = fixture()
    path = tmp_path / "same.gguf"
    path.write_bytes(_with_extra_tokens(f.data, f.value["tokenizer.ggml.tokens"], 0))
    assert (
        GGUFCheckpoint(path).meta["tokenizer.ggml.tokens"]
        == gguf.GGUFReader(SOURCE).fields["tokenizer.ggml.tokens"].contents()
    )


def _outcome(path: Path):
    """Import `path`: a checkpoint whose tensors plan, or a ColibriError (naming the file when the
    file itself is refused); never another exception. Allocation bounded by PEAK_BYTES."""
    from colibri.convert import hf_model_config, plan_tensors

    tracemalloc.start()
    try:
        try:
            ckpt = GGUFCheckpoint(path)
        except ColibriError as e:
            assert str(path) in str(e), str(e)
            return
        try:
            _, cfg = hf_model_config(ckpt)
            plan_tensors(ckpt, cfg, ckpt.config["architectures"][0], lambda *a: None)
        except ColibriError:
            pass  # the checks after the file's: a config or tensor plan that does not add up
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            assert peak < PEAK_BYTES, f"{peak} bytes"
    finally:
        tracemalloc.stop()


def _field_values(field):
    """A field of Fixture.fields with a value drawn for it: a special one, any, or near the original."""
    offset, fmt, _ = field
    bits = 8 * struct.calcsize(fmt)
    (original,) = struct.unpack_from(fmt, fixture().data, offset)
    return st.one_of(
        st.sampled_from([0, 1, 4, 63, 64, 2**31, 10**9, 2**32 - 1, 2**63, 2**64 - 1]).map(lambda x: x % (1 << bits)),
        st.integers(0, (1 << bits) - 1),
        st.integers(-64, 64).map(lambda d: (original + d) % (1 << bits)),
    ).map(lambda value: (offset, fmt, value))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_any_count_or_length_field_set_to_anything_is_an_error_or_a_model(tmp_path, data):
    f = fixture()
    edits = data.draw(st.lists(st.sampled_from(f.fields).flatmap(_field_values), min_size=1, max_size=3))
    path = tmp_path / "field.gguf"
    path.write_bytes(f.patched(*edits))
    _outcome(path)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.integers(0, 5000), st.integers(0, SOURCE.stat().st_size)))
def test_a_file_cut_anywhere_is_an_error_or_a_model(tmp_path, cut):
    path = tmp_path / "cut.gguf"
    path.write_bytes(fixture().data[:cut])
    _outcome(path)


@pytest.mark.parametrize("cut", [0, 23, 30, 800, 2500, 3400, 3600, 4000, 4961, 10_000, 153_183])
def test_a_cut_file_says_where_it_ends(tmp_path, cut):
    path = tmp_path / "cut.gguf"
    path.write_bytes(fixture().data[:cut])
    message = refused(path)
    assert re.search(r"truncated|not a GGUF file", message), message


@pytest.mark.parametrize("path", sorted(GGUF_DIR.glob("*.gguf")), ids=lambda p: p.name)
def test_the_parser_reads_what_gguf_s_reader_reads(path):
    ours = GGUFFile(path, gguf)
    ours.read_arrays()
    r = gguf.GGUFReader(path)
    meta = {name: field.contents() for name, field in r.fields.items() if not name.startswith("GGUF.")}
    assert list(ours.meta) == list(meta) and ours.meta == meta
    assert [type(x) for x in ours.meta.values()] == [type(x) for x in meta.values()]
    assert list(ours.tensors) == [t.name for t in r.tensors]
    for t in r.tensors:
        mine = ours.tensors[t.name]
        assert mine.tensor_type == t.tensor_type and mine.shape == tuple(int(d) for d in t.shape)
        assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape
        assert np.array_equal(mine.data.view(np.uint8), np.asarray(t.data).view(np.uint8))


def test_a_token_of_a_million_characters_costs_no_million_slices():
    """The merges a "llama" vocabulary implies were found by trying every split of every piece:
    a piece of 10^6 characters (a 1 MB file) took about 100 s. Only the lengths pieces have are tried."""
    tokens = ["<unk>", "<s>", "</s>", *"abcdefghijklmnopqrstuvwxyz", "ab", "a" * MILLION]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * len(tokens),
        "tokenizer.ggml.token_type": [1] * len(tokens),
    }
    files = tokenizer_files(meta, "long.gguf")
    assert '"merges":[["a","b"]]' in files["tokenizer.json"]


def test_the_cli_refuses_a_lying_file_in_one_line_and_writes_nothing(tmp_path):
    f = fixture()
    path = tmp_path / "lie.gguf"
    scores = f.value["tokenizer.ggml.scores"]
    path.write_bytes(f.patched((scores + 4, "<I", 0), (scores + 8, "<Q", 10**9)))
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "convert", "--gguf", str(path), "--output-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"error: {path}: metadata array 'tokenizer.ggml.scores' claims 1000000000 elements"), line
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lie.gguf"]  # no output, no staging left behind


def test_an_honest_file_still_imports_with_its_vocabulary():
    ckpt = GGUFCheckpoint(SOURCE)
    assert len(ckpt.meta["tokenizer.ggml.tokens"]) == 128 and ckpt.config["num_hidden_layers"] == 2
    assert math.prod(ckpt.shape("model.embed_tokens.weight")) == 128 * 64
