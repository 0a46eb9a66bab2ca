"""The model-directory loader against damaged directories, and the storage dtype round trips.

Contract (colibri/modeldir.py, colibri/config.py): whatever is wrong with a directory,
`colibri.load` raises `colibri.ColibriError` naming the file or tensor at fault, before a byte of
weights is used; it never crashes with another exception type.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import colibri
from colibri.errors import ColibriError
from colibri.modeldir import ModelDir, from_storage, to_storage


@pytest.fixture(scope="module")
def pristine(converted):
    return converted("mixtral_a", "f32")


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def read_cfg(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def write_cfg(d: Path, cfg: dict) -> None:
    (d / "config.json").write_text(json.dumps(cfg))


def edit_cfg(fn):
    """A damage that edits config.json with fn(cfg, d)."""

    def damage(d: Path, tmp: Path):
        cfg = read_cfg(d)
        fn(cfg, d, tmp)
        write_cfg(d, cfg)

    return damage


# ---- damage: each returns nothing; `expected` are substrings of the message -----------------------


def _truncate(d, tmp):
    f = d / "layers" / "00" / "expert_002.bin"
    os.truncate(f, f.stat().st_size - 1)


def _extend(d, tmp):
    with open(d / "lm_head.bin", "ab") as f:
        f.write(b"\0")


def _remove(d, tmp):
    (d / "layers" / "01" / "router.bin").unlink()


def _relocate(cfg, d, tmp, new_rel, copy_to=None):
    """Rename embedding.bin to new_rel in both tables and put its real bytes at copy_to, outside the
    directory: the file exists and matches, only its location is wrong."""
    if copy_to is not None:
        shutil.copyfile(d / "embedding.bin", copy_to)
    cfg["files"][new_rel] = cfg["files"].pop("embedding.bin")
    for t in cfg["tensors"].values():
        if t["file"] == "embedding.bin":
            t["file"] = new_rel


def _dotdot(cfg, d, tmp):
    _relocate(cfg, d, tmp, "../outside.bin", copy_to=d.parent / "outside.bin")


def _absolute(cfg, d, tmp):
    target = tmp / "elsewhere" / "embedding.bin"
    target.parent.mkdir()
    _relocate(cfg, d, tmp, str(target), copy_to=target)


def _symlink_out(d, tmp):
    f = d / "layers" / "00" / "expert_003.bin"
    outside = tmp / "outside_expert.bin"
    shutil.copyfile(f, outside)
    f.unlink()
    f.symlink_to(outside)


def _tensor(name, **fields):
    def fn(cfg, d, tmp):
        cfg["tensors"][name].update(fields)

    return fn


def _tensor_rel(name, field, delta):
    def fn(cfg, d, tmp):
        cfg["tensors"][name][field] += delta

    return fn


def _norm_f16(cfg, d, tmp):
    t = cfg["tensors"]["layers.0.attn_norm"]
    t["dtype"] = "f16"
    t["nbytes"] //= 2


def _del_tensor(cfg, d, tmp):
    del cfg["tensors"]["layers.1.router"]


def _extra_tensor(cfg, d, tmp):
    cfg["tensors"]["layers.0.bogus_proj"] = dict(cfg["tensors"]["layers.0.attn_norm"])


def _top(**kv):
    def fn(cfg, d, tmp):
        cfg.update(kv)

    return fn


def _model(**kv):
    def fn(cfg, d, tmp):
        cfg["model"].update(kv)

    return fn


def _huge_config(d, tmp):
    os.truncate(d / "config.json", (64 << 20) + 1)  # sparse: costs no disk


def _json_array(d, tmp):
    (d / "config.json").write_text(json.dumps([read_cfg(d)]))


DAMAGE = [
    ("truncated", _truncate, ["layers/00/expert_002.bin", "truncated"]),
    ("extended", _extend, ["lm_head.bin", "larger than expected"]),
    ("missing_file", _remove, ["layers/01/router.bin", "missing"]),
    ("dotdot", edit_cfg(_dotdot), ["../outside.bin", "outside the model directory"]),
    ("absolute", edit_cfg(_absolute), ["elsewhere/embedding.bin", "outside the model directory"]),
    ("symlink_outside", _symlink_out, ["layers/00/expert_003.bin", "outside the model directory"]),
    ("offset_unaligned", edit_cfg(_tensor_rel("layers.0.wk", "offset", 4)), ["layers.0.wk", "multiple of 64"]),
    ("past_end", edit_cfg(_tensor("final_norm", offset=64)), ["final_norm", "past the end", "final_norm.bin"]),
    ("nbytes", edit_cfg(_tensor_rel("embedding", "nbytes", -4)), ["embedding", "32764"]),
    ("shape", edit_cfg(_tensor("embedding", shape=[64, 128])), ["embedding", "expected shape [128, 64]"]),
    ("dtype_unknown", edit_cfg(_tensor("layers.1.wo", dtype="f8")), ["layers.1.wo", "'f8'"]),
    ("norm_f16", edit_cfg(_norm_f16), ["layers.0.attn_norm", "f32"]),
    ("missing_tensor", edit_cfg(_del_tensor), ["layers.1.router", "lacks"]),
    ("extra_tensor", edit_cfg(_extra_tensor), ["layers.0.bogus_proj"]),
    ("format_version", edit_cfg(_top(format_version=2)), ["format_version", "2"]),
    ("format_version_float", edit_cfg(_top(format_version=1.0)), ["format_version", "1.0"]),
    ("shape_floats", edit_cfg(_tensor("embedding", shape=[128.0, 64.0])), ["embedding", "expected shape"]),
    ("format_name", edit_cfg(_top(format="gguf")), ["'gguf'"]),
    ("topk_gt_experts", edit_cfg(_model(num_experts_per_tok=5)), ["num_experts_per_tok", "5"]),
    ("heads_kv", edit_cfg(_model(num_key_value_heads=3)), ["num_attention_heads", "num_key_value_heads"]),
    ("negative_hidden", edit_cfg(_model(hidden_size=-64)), ["hidden_size", "-64"]),
    ("moe_layers_len", edit_cfg(_model(moe_layers=[True])), ["moe_layers", "2"]),
    ("config_64mb", _huge_config, ["config.json", "64 MB"]),
    ("config_array", _json_array, ["config.json", "JSON object"]),
]


@pytest.mark.parametrize("damage, expected", [pytest.param(f, e, id=i) for i, f, e in DAMAGE])
def test_damaged_directory(pristine, tmp_path, damage, expected):
    d = copy_model(pristine, tmp_path / "m")
    damage(d, tmp_path)
    with pytest.raises(colibri.ColibriError) as info:
        colibri.load(d)
    msg = str(info.value)
    for text in expected:
        assert text in msg, f"{text!r} not in {msg!r}"
    assert "\n" not in msg


def test_pristine_copy_loads(pristine, tmp_path):
    """The damage tests start from a copy that loads: they fail for the damage, not the copy."""
    d = copy_model(pristine, tmp_path / "m")
    write_cfg(d, read_cfg(d))  # rewritten compactly, as the damage tests do
    with colibri.load(d) as m:
        logits = m.forward([1, 2, 3])
    assert logits.shape == (3, 128) and np.isfinite(logits).all()


# Values of a wrong JSON type in the "model" section: each must be a ColibriError naming the field,
# not a TypeError / OverflowError / KeyError from deeper down.
WRONG_TYPES = [
    ({"moe_layers": None}, "moe_layers"),
    ({"moe_layers": 5}, "moe_layers"),
    ({"layer_types": None}, "layer_types"),
    ({"eos_token_id": None}, "eos_token_id"),
    ({"eos_token_id": 2}, "eos_token_id"),
    ({"qk_norm": []}, "qk_norm"),
    ({"qk_norm": {}}, "qk_norm"),
    ({"rms_norm_eps": 10**400}, "rms_norm_eps"),
    ({"rope_theta": 10**400}, "rope_theta"),
    ({"clip_qkv": 10**400}, "clip_qkv"),
    ({"layer_types": {"full_attention": 0, "sliding_attention": 1}, "sliding_window": 4}, "layer_types"),
]


@pytest.mark.parametrize("fields, named", WRONG_TYPES, ids=[repr(f)[:40] for f, _ in WRONG_TYPES])
def test_model_field_of_wrong_type(pristine, tmp_path, fields, named):
    d = copy_model(pristine, tmp_path / "m")
    cfg = read_cfg(d)
    cfg["model"].update(fields)
    write_cfg(d, cfg)
    with pytest.raises(colibri.ColibriError, match=named):
        colibri.load(d)


@pytest.mark.parametrize("theta", [5e-324, 1e-60])
def test_rope_theta_accepted_only_if_usable(pristine, tmp_path, theta):
    """A rope_theta the loader accepts must give a working model (not a 'damaged weights' error)."""
    d = copy_model(pristine, tmp_path / "m")
    cfg = read_cfg(d)
    cfg["model"]["rope_theta"] = theta
    write_cfg(d, cfg)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            m = colibri.load(d)
    except colibri.ColibriError as e:
        assert "rope_theta" in str(e)
        return
    with m:
        logits = m.forward([1, 2, 3])
    assert np.isfinite(logits).all()


# ---- property: random mutations of config.json --------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from([10**400, -(10**400), 2**63, -1, 0, 1, 64])
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


@st.composite
def mutations(draw, cfg):
    """(kind, path, value): what to do to config.json."""
    tensors = sorted(cfg["tensors"])
    files = sorted(cfg["files"])
    kind = draw(st.sampled_from(["tensor_field", "delete_model", "delete_tensor_key", "delete_top", "model_field"]))
    if kind == "tensor_field":
        name = draw(st.sampled_from(tensors))
        field = draw(st.sampled_from(["offset", "nbytes", "shape", "dtype", "file"]))
        plausible = {
            "offset": st.integers(-128, 40000).map(lambda v: v - v % 64) | st.integers(-128, 40000),
            "nbytes": st.integers(0, 40000),
            "shape": st.lists(st.integers(-1, 130), min_size=0, max_size=3),
            "dtype": st.sampled_from(["f32", "f16", "bf16", "int8", "int4", "F32", "q8", ""]),
            "file": st.sampled_from(files + ["../x.bin", "/etc/passwd", "nope.bin", "layers/00"]),
        }[field]
        return kind, (name, field), draw(plausible | json_values)
    if kind == "delete_model":
        return kind, draw(st.sampled_from(sorted(cfg["model"]))), None
    if kind == "delete_tensor_key":
        name = draw(st.sampled_from(tensors))
        return kind, (name, draw(st.sampled_from(sorted(cfg["tensors"][name])))), None
    if kind == "delete_top":
        return kind, draw(st.sampled_from(sorted(cfg))), None
    field = draw(st.sampled_from(sorted(cfg["model"])))
    return kind, field, draw(json_values | st.integers(-2, 300) | st.floats(-10, 1e6))


def apply_mutation(cfg, mutation):
    kind, path, value = mutation
    cfg = copy.deepcopy(cfg)
    if kind == "tensor_field":
        cfg["tensors"][path[0]][path[1]] = value
    elif kind == "delete_model":
        del cfg["model"][path]
    elif kind == "delete_tensor_key":
        del cfg["tensors"][path[0]][path[1]]
    elif kind == "delete_top":
        del cfg[path]
    else:
        cfg["model"][path] = value
    return cfg


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_config_mutation_never_crashes(pristine, data):
    pristine_cfg = read_cfg(pristine)
    mutation = data.draw(mutations(pristine_cfg), label="mutation")
    cfg = apply_mutation(pristine_cfg, mutation)
    work = Path(tempfile.mkdtemp(prefix="colibri-mut-"))
    try:
        d = copy_model(pristine, work / "m")
        (d / "config.json").write_text(json.dumps(cfg))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                m = colibri.load(d, threads=1)
        except colibri.ColibriError:
            return
        with m:
            if m.n_ctx < 3:
                with pytest.raises(colibri.ColibriError, match="context length"):
                    m.forward([1, 2, 3])
                return
            weights_moved = mutation[0] == "tensor_field" and mutation[1][1] in ("file", "offset")
            try:
                logits = m.forward([1, 2, 3])
            except colibri.ColibriError as e:
                # only bytes that are not the tensor's own (moved file/offset) may be garbage
                assert weights_moved and "damaged" in str(e), (mutation, str(e))
                return
            assert logits.shape == (3, m.config.vocab_size)
            assert np.isfinite(logits).all(), mutation
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---- storage dtypes: round trips ---------------------------------------------------------------

float32_bits = st.integers(0, 2**32 - 1)
ties_bits = st.integers(0, 2**16 - 1).map(lambda hi: (hi << 16) | 0x8000)  # exactly half-way (bf16)
bits_arrays = hnp.arrays(
    np.uint32,
    hnp.array_shapes(max_dims=2, max_side=16),
    elements=float32_bits
    | ties_bits
    | st.sampled_from(
        [
            0x7F800000,
            0xFF800000,
            0x7F800001,
            0xFF800001,
            0x7FC00000,
            0x7F7FFFFF,
            0x7F7F8000,
            0x7F7F7FFF,
            0x00000001,
            0x80000000,
            0x00008000,
            0x3F808000,
        ]
    ),
)
float_arrays = hnp.arrays(
    np.float32,
    hnp.array_shapes(max_dims=2, max_side=16),
    elements=st.floats(width=32, allow_nan=True, allow_infinity=True),
)


def as_f32(bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.uint32).view(np.float32)


@settings(max_examples=150, deadline=None)
@given(float_arrays)
def test_f32_round_trip_exact(a):
    stored = to_storage(a, "f32")
    assert stored.dtype == np.dtype("<f4")
    back = from_storage(stored, "f32")
    assert back.dtype == np.float32 and back.shape == a.shape
    np.testing.assert_array_equal(back.view(np.uint32), a.view(np.uint32))


@settings(max_examples=150, deadline=None)
@given(float_arrays | bits_arrays.map(as_f32))
def test_f16_matches_numpy_rounding(a):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        want = a.astype(np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # overflow to +-inf is the rounding
        stored = to_storage(a, "f16")
    assert stored.dtype == np.dtype("<f2") and stored.shape == a.shape
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(stored), nan)
    np.testing.assert_array_equal(stored.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
    back = from_storage(stored, "f16")
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back[~nan], want.astype(np.float32)[~nan])


def bf16_reference(x: float) -> float:
    """Round a float32 value to bfloat16, nearest-even, by float64 arithmetic (not bit tricks).

    bfloat16 has 8 significant bits and float32's exponent range: a normal value m * 2**e
    (0.5 <= m < 1, e >= -125) is a multiple of 2**(e - 8); below 2**-126 the spacing is 2**-133.
    Python's round() on a float rounds half to even.
    """
    if math.isnan(x) or math.isinf(x) or x == 0.0:
        return x
    mag = abs(x)
    _, e = math.frexp(mag)
    quantum = 2.0 ** (max(e, -125) - 8)
    r = round(mag / quantum) * quantum  # mag / quantum is exact (power of two)
    if r >= 2.0**128:  # beyond the largest bf16 after rounding
        r = math.inf
    return math.copysign(r, x)


@settings(max_examples=200, deadline=None)
@given(bits_arrays)
@example(
    np.array(
        [0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x7F7F7FFF, 0x7F800001, 0xFFC00001, 0x00008000, 0x00018000, 0x80000000],
        np.uint32,
    )
)
def test_bf16_round_to_nearest_even(bits):
    a = as_f32(bits)
    stored = to_storage(a, "bf16")
    assert stored.dtype == np.dtype("<u2") and stored.shape == a.shape
    back = from_storage(stored, "bf16")
    assert back.dtype == np.float32 and back.shape == a.shape
    for x, got_stored, got in zip(a.ravel().tolist(), stored.ravel().tolist(), back.ravel().tolist()):
        if math.isnan(x):
            assert math.isnan(got), f"NaN {x!r} became {got!r}"
            continue
        want = bf16_reference(x)
        assert got == want and math.copysign(1.0, got) == math.copysign(1.0, want), (
            f"{x!r} (bits {np.float32(x).view(np.uint32):#010x}) -> {got!r} (stored {got_stored:#06x}), expected {want!r}"
        )


@settings(max_examples=100, deadline=None)
@given(bits_arrays)
def test_bf16_storage_is_idempotent(bits):
    """Values already representable in bf16 survive a second round trip bit for bit."""
    once = from_storage(to_storage(as_f32(bits), "bf16"), "bf16")
    twice = from_storage(to_storage(once, "bf16"), "bf16")
    nan = np.isnan(once)
    np.testing.assert_array_equal(np.isnan(twice), nan)
    np.testing.assert_array_equal(twice.view(np.uint32)[~nan], once.view(np.uint32)[~nan])


def test_storage_infinities_and_unknown_dtype():
    a = np.array([np.inf, -np.inf, np.nan, -0.0, 0.0], np.float32)
    for dtype in ("f32", "f16", "bf16"):
        back = from_storage(to_storage(a, dtype), dtype)
        assert back[0] == np.inf and back[1] == -np.inf and np.isnan(back[2])
        assert np.signbit(back[3]) and not np.signbit(back[4])
    with pytest.raises(colibri.ColibriError):
        to_storage(a, "f8")


# ---- every field of config.json: removed, wrong type, out of range ----------------------------

from dataclasses import MISSING, fields as dc_fields  # noqa: E402

from colibri.config import ModelConfig  # noqa: E402

MODEL_FIELDS = [f.name for f in dc_fields(ModelConfig)]
REQUIRED_FIELDS = [f.name for f in dc_fields(ModelConfig) if f.default is MISSING and f.default_factory is MISSING]


def _load_after(pristine, tmp_path, edit):
    d = copy_model(pristine, tmp_path / "m")
    cfg = read_cfg(d)
    edit(cfg)
    write_cfg(d, cfg)
    return colibri.load(d)


@pytest.mark.parametrize("field", MODEL_FIELDS)
def test_each_model_field_removed(pristine, tmp_path, field):
    def edit(cfg):
        cfg["model"].pop(field, None)  # the Gemma 4 extensions are absent where default

    if field in REQUIRED_FIELDS:
        with pytest.raises(colibri.ColibriError, match=field):
            _load_after(pristine, tmp_path, edit)
    else:
        try:  # a defaulted field: loads, or is refused clearly
            _load_after(pristine, tmp_path, edit)
        except colibri.ColibriError:
            pass


@pytest.mark.parametrize("field", MODEL_FIELDS)
def test_each_model_field_with_a_wrong_type(pristine, tmp_path, field):
    def edit(cfg):
        cfg["model"][field] = {"nested": [1]}

    with pytest.raises(colibri.ColibriError, match=field):
        _load_after(pristine, tmp_path, edit)


@pytest.mark.parametrize(
    "field",
    [
        f
        for f in MODEL_FIELDS
        if f
        not in (
            "architecture",
            "hidden_act",
            "qk_norm",
            "norm_topk_prob",
            "tie_word_embeddings",
            "attention_bias",
            "attention_out_bias",
        )
    ],
)
def test_each_model_field_out_of_range(pristine, tmp_path, field):
    def edit(cfg):
        v = cfg["model"].get(field, getattr(ModelConfig, field, []))  # absent: its default
        cfg["model"][field] = [-1] * max(len(v), 1) if isinstance(v, list) else -1  # an empty list: [-1]

    with pytest.raises(colibri.ColibriError, match=field):
        _load_after(pristine, tmp_path, edit)


@pytest.mark.parametrize("key", ["format", "format_version", "weight_dtype", "model", "tensors", "files"])
def test_each_top_level_key_removed(pristine, tmp_path, key):
    def edit(cfg):
        del cfg[key]

    with pytest.raises(colibri.ColibriError):
        _load_after(pristine, tmp_path, edit)


def test_modeldir_refuses_a_transposed_vector(converted, tmp_path):
    src = converted("mixtral_a", "int8")
    for name, layout, problem in (
        ("layers.0.attn_norm", "transposed", "only weight matrices"),
        ("layers.0.router", "transposed", "only weight matrices"),
        ("layers.0.router", "interleaved", "only weight matrices"),
        ("embedding", "interleaved", "embedding: f32 has no interleaved layout, only rows or transposed"),
    ):
        d = tmp_path / f"{name}-{layout}"
        if name == "embedding":  # an f32 matrix marked interleaved
            shutil.copytree(converted("mixtral_a", "f32"), d)
        else:
            shutil.copytree(src, d)
        cfg = json.loads((d / "config.json").read_text())
        cfg["tensors"][name]["layout"] = layout
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ColibriError, match=problem):
            ModelDir(d)
