"""Every JSON file Colibri reads, against its schema: the model directory's config.json, a Hugging
Face config.json, a safetensors header, a shard index (model.safetensors.index.json).

Contract (docs: DESIGN.md, colibri/config.py's MAX_* bounds): whatever a file holds — a wrong JSON
type, a missing field, a negative or overflowing shape, offsets outside the data, two tensors
sharing bytes, dimensions whose product is absurd, a 4300-digit integer, 100000-deep nesting —
reading it either succeeds or raises one `ColibriError` naming the file and the field, within a
fraction of a second and without a large allocation. Every call that could try a huge allocation
runs in a worker process under an address-space limit (RLIMIT_AS 2 GiB), so an attempt fails the
test instead of swapping the machine; the worker also times each call.
"""

from __future__ import annotations

import copy
import json
import os
import select
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import colibri
from colibri.config import (
    MAX_EMBEDDING,
    MAX_EXPERT_INSTANCES,
    MAX_EXPERT_WEIGHTS,
    MAX_Q_DIM,
    MAX_ROPE_TABLE,
    ModelConfig,
)
from colibri.modeldir import MappedModelDir, ModelDir, ModelDirWriter, tensor_file, to_storage
from conftest import AS_LIMIT, FIXTURES, as_limit

QUICK = 2.0  # seconds: the slowest a refusal (or a small load) may take
ENV = dict(
    os.environ,
    PYTHONPATH=str(Path(colibri.__file__).parent.parent),
    OMP_NUM_THREADS="1",
    OPENBLAS_NUM_THREADS="1",
    MKL_NUM_THREADS="1",
)
FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- the worker: the calls under test, in a process with an address-space limit -----------------

WORKER = r"""
import json, resource, shutil, sys, time, traceback
from pathlib import Path
resource.setrlimit(resource.RLIMIT_AS, (%d, %d))
import colibri
from colibri.convert import convert
from colibri.hfcheckpoint import HFCheckpoint, SafetensorsFile
from colibri.modeldir import ModelDir


def modeldir(a):
    ModelDir(a["path"])


def safetensors(a):
    f = SafetensorsFile(Path(a["path"]))
    for name, (_, shape, _) in f.entries.items():       # what the header promises can be read
        arr, kind = f.raw(name)
        assert arr.shape == shape, (name, arr.shape, shape)


def checkpoint(a):
    ck = HFCheckpoint(a["path"])
    for name in ck.names():
        assert ck.raw(name)[0].shape == ck.shape(name)


def hf_convert(a):
    shutil.rmtree(a["out"], ignore_errors=True)
    convert(a["hf"], a["out"], log=lambda *x: None)


OPS = {"modeldir": modeldir, "safetensors": safetensors, "checkpoint": checkpoint, "convert": hf_convert}
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    t = time.perf_counter()
    try:
        OPS[req["op"]](req)
        res = {"result": "ok"}
    except colibri.ColibriError as e:
        res = {"result": "error", "message": str(e)}
    except BaseException as e:
        res = {"result": "crash", "message": traceback.format_exc()[-3000:]}
    res["seconds"] = time.perf_counter() - t
    print(json.dumps(res), flush=True)
""" % (AS_LIMIT, AS_LIMIT)


class Worker:
    def __init__(self):
        self.proc = None

    def _start(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER],
            env=ENV,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert json.loads(self._line(60)) == {"ready": True}

    def _line(self, timeout):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.close()
            pytest.fail(f"the call did not return within {timeout} s (a hang or a huge amount of work)")
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            self.proc = None
            pytest.fail(f"the worker died (exit status {code}: a signal or an abort)")
        return line

    def __call__(self, op, **args) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(json.dumps({"op": op, **{k: str(v) for k, v in args.items()}}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line(30))

    def close(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


def ok_or_clear_error(res: dict, what="") -> dict:
    """The property: success, or one ColibriError of one line; never another exception; quick."""
    assert res["result"] != "crash", f"{what}\n{res['message']}"
    if res["result"] == "error":
        assert "\n" not in res["message"] and res["message"], res["message"]
    assert res["seconds"] < QUICK, f"{what}: took {res['seconds']:.2f} s ({res.get('message', 'ok')[:200]})"
    return res


def refused(res: dict, *named, within=QUICK) -> str:
    assert res["result"] == "error", res
    msg = res["message"]
    assert "\n" not in msg
    for text in named:
        assert text in msg, f"{text!r} not in {msg!r}"
    assert res["seconds"] < within, f"took {res['seconds']:.2f} s: {msg}"
    return msg


# ---- random JSON and random edits of a document ------------------------------------------------

huge_ints = st.sampled_from(
    [2**31, 2**32 + 1, 2**63 - 1, 2**63, 2**64, 10**18, 10**100, -(2**63), -1, 0, 1, 1 << 24, 10**6, 4096, 65536]
)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | huge_ints
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=10)
    | st.sampled_from(["", "f32", "F32", "rows", "64", "-1", "null", "1e9"])
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


def paths(doc, prefix=()):
    """Every path (a tuple of keys and indices) to a value inside doc, doc itself excluded."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        yield prefix + (k,)
        yield from paths(v, prefix + (k,))


def near(value):
    """Values close to a valid one: they get past the type checks and reach the deeper ones."""
    if type(value) is int:
        return st.sampled_from(
            [value + 64, value - 64, value * 2, value // 2, -value, value + 1, value * 10**6, 0, 1 << 40]
        )
    if type(value) is list and value and all(type(x) is int for x in value):
        return st.sampled_from(
            [
                value[::-1],
                value + [1],
                value[:-1],
                [x * 2 for x in value],
                [x * -1 for x in value],
                [2**32] * len(value),
                [0] + value[1:],
            ]
        )
    if type(value) is list:
        return st.sampled_from([value[:-1], value + value[-1:], value * 1000, []])
    if type(value) is float:
        return st.sampled_from([value * 1e300, -value, float("nan"), 0.0])
    return json_values


@st.composite
def edits(draw, doc, sections=None):
    """1-3 edits of doc: (kind, path, value) with kind replace, delete or add. sections: the top-level
    keys to edit inside, one drawn first (so that a big tensor table does not drown the rest)."""
    out = []
    for _ in range(draw(st.integers(1, 3))):
        if sections:
            top = draw(st.sampled_from(sections))
            inside = [(top,) + p for p in paths(doc.get(top, {}))] if isinstance(doc.get(top), (dict, list)) else []
            candidates = [(top,)] + inside
        else:
            candidates = list(paths(doc))
        path = draw(st.sampled_from(candidates))
        kind = draw(st.sampled_from(["replace", "replace", "near", "delete", "add"]))
        value = None
        if kind == "near":
            current = lookup(doc, path)
            value = draw(near(current)) if current is not MISSING else draw(json_values)
            kind = "replace"
        elif kind in ("replace", "add"):
            value = draw(json_values)
        key = draw(st.text(max_size=6)) if kind == "add" else None
        out.append((kind, path, value, key))
    return out


MISSING = object()


def lookup(doc, path):
    for k in path:
        try:
            doc = doc[k]
        except (KeyError, IndexError, TypeError):
            return MISSING
    return doc


def apply_edits(doc, edit_list):
    doc = copy.deepcopy(doc)
    for kind, path, value, key in edit_list:
        parent = lookup(doc, path[:-1])
        last = path[-1]
        if parent is MISSING or not isinstance(parent, (dict, list)):
            continue
        if isinstance(parent, list) and (not isinstance(last, int) or last >= len(parent)):
            continue
        if kind == "replace":
            parent[last] = value
        elif kind == "delete":
            if isinstance(parent, dict):
                parent.pop(last, None)
            else:
                del parent[last]
        else:  # add: a new key or item inside the value
            target = parent.get(last) if isinstance(parent, dict) else parent[last]
            if isinstance(target, dict):
                target[key] = value
            elif isinstance(target, list):
                target.append(value)
            else:
                parent[last] = value
    return doc


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst


# ---- the model directory's config.json ----------------------------------------------------------

MODEL_CASES = ["mixtral_a", "gemma4_a"]


@pytest.fixture(scope="module")
def model_dirs(converted, tmp_path_factory):
    """case -> (pristine config, a working copy whose config.json the tests rewrite)."""
    root = tmp_path_factory.mktemp("schema_models")
    out = {}
    for case in MODEL_CASES:
        d = copy_dir(converted(case), root / case)
        out[case] = (json.loads((d / "config.json").read_text()), d)
    return out


def write_json(path: Path, doc) -> None:
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("case", MODEL_CASES)
def test_pristine_model_config_loads(model_dirs, worker, case):
    doc, d = model_dirs[case]
    write_json(d / "config.json", doc)
    assert ok_or_clear_error(worker("modeldir", path=d))["result"] == "ok"


@pytest.mark.parametrize("case", MODEL_CASES)
@settings(FAST, max_examples=200)
@given(data=st.data())
def test_model_config_edits_load_or_fail_clearly(model_dirs, worker, case, data):
    doc, d = model_dirs[case]
    edit_list = data.draw(
        edits(
            doc,
            sections=[
                "model",
                "model",
                "tensors",
                "files",
                "format",
                "format_version",
                "weight_dtype",
                "alignment",
                "source",
                "byte_order",
            ],
        ),
        label="edits",
    )
    write_json(d / "config.json", apply_edits(doc, edit_list))
    ok_or_clear_error(worker("modeldir", path=d), edit_list)


def _resized(model: dict, n: int) -> dict:
    """The model section with n layers (every per-layer list resized)."""
    m = dict(model, num_hidden_layers=n, moe_layers=[True] * n)
    m["layer_types"] = (model["layer_types"] * n)[:n]
    m["layer_types"][-1] = "full_attention"
    for key in ("layer_head_dims", "layer_kv_heads", "layer_rope_theta", "layer_rope_fraction"):
        if model.get(key):
            m[key] = (model[key] * n)[:n]
    return m


# (model section edits, fields the message names): each product above its bound, each factor within its own
DIMENSIONS = [
    ("layers x experts", lambda m: dict(_resized(m, 4096), num_experts=64), ["num_experts", str(MAX_EXPERT_INSTANCES)]),
    ("layers x experts 2^24 x 4096", lambda m: dict(_resized(m, 4096), num_experts=1 << 24), ["num_experts"]),
    ("experts 10^6", lambda m: dict(m, num_experts=10**6), ["num_experts", "1000000"]),
    (
        "heads x head_dim",
        lambda m: dict(m, num_attention_heads=64, head_dim=4096, layer_head_dims=[]),
        ["num_attention_heads", "head_dim", str(MAX_Q_DIM)],
    ),
    (
        "positions x head_dim",
        lambda m: dict(m, max_position_embeddings=1 << 30, head_dim=4096, layer_head_dims=[]),
        ["max_position_embeddings", "head_dim", str(MAX_ROPE_TABLE)],
    ),
    (
        "RoPE tables of 2^27 positions",
        lambda m: dict(m, max_position_embeddings=1 << 27),  # 2^31 values and more
        ["max_position_embeddings (134217728)", "RoPE tables", str(MAX_ROPE_TABLE)],
    ),
    (
        "vocab x hidden",
        lambda m: dict(m, vocab_size=1 << 22, hidden_size=1 << 17),
        ["vocab_size", "hidden_size", str(MAX_EMBEDDING)],
    ),
    (
        "experts x ff x hidden",
        lambda m: dict(m, num_experts=1 << 14, moe_intermediate_size=1 << 18),
        ["num_experts", "moe_intermediate_size", str(MAX_EXPERT_WEIGHTS)],
    ),
    ("table shorter than the experts", lambda m: dict(m, num_experts=20000), ["tensor table has", "20000 experts"]),
    ("4096 layers, small table", lambda m: dict(_resized(m, 4096), num_experts=16), ["tensor table has", "4096 MoE"]),
    ("eos ids 10^6", lambda m: dict(m, eos_token_id=[1] * 10**6), ["eos_token_id"]),
]


@pytest.mark.parametrize("case", MODEL_CASES)
@pytest.mark.parametrize("label, edit, named", DIMENSIONS, ids=[d[0] for d in DIMENSIONS])
def test_absurd_dimensions_are_refused_at_once(model_dirs, worker, case, label, edit, named):
    doc, d = model_dirs[case]
    bad = dict(doc, model=edit(dict(doc["model"])))
    write_json(d / "config.json", bad)
    refused(worker("modeldir", path=d), str(d / "config.json"), *named, within=1.0)


def test_overlapping_tensors_are_refused(model_dirs, worker):
    doc, d = model_dirs["mixtral_a"]
    bad = copy.deepcopy(doc)
    bad["tensors"]["layers.0.wk"]["offset"] = bad["tensors"]["layers.0.wq"]["offset"]
    write_json(d / "config.json", bad)
    refused(worker("modeldir", path=d), "layers.0.wq", "layers.0.wk", "layers/00/attn.bin", "share bytes")


@pytest.mark.parametrize(
    "where, value, named",
    [
        ("tensor offset", ("tensors", "embedding", "offset", True), ["embedding", "offset"]),
        ("tensor shape", ("tensors", "embedding", "shape", [128, True]), ["embedding", "shape"]),
        ("file size", ("files", "embedding.bin", "size", "32768"), ["embedding.bin", "size"]),
        ("file size bool", ("files", "embedding.bin", "size", True), ["embedding.bin", "size"]),
        ("sha256 not hex", ("files", "embedding.bin", "sha256", "z" * 64), ["embedding.bin", "sha256"]),
        ("layout list", ("tensors", "layers.0.wq", "layout", ["rows"]), ["layers.0.wq", "layout"]),
        ("alignment", ("alignment", 32), ["alignment", "32"]),
        ("source", ("source", [1]), ["source"]),
        ("eos bool", ("model", "eos_token_id", [True]), ["eos_token_id", "True"]),
        ("bos string", ("model", "bos_token_id", "1"), ["bos_token_id", "'1'"]),
    ],
)
def test_wrong_types_in_the_tables_name_the_field(model_dirs, worker, where, value, named):
    doc, d = model_dirs["mixtral_a"]
    bad = copy.deepcopy(doc)
    *path, last, v = value
    lookup(bad, tuple(path))[last] = v
    write_json(d / "config.json", bad)
    refused(worker("modeldir", path=d), *named)


def huge_int_json(doc: dict, key_path: tuple) -> str:
    """doc as JSON text with a 5000-digit integer at key_path (json.dumps cannot write one)."""
    doc = copy.deepcopy(doc)
    lookup(doc, key_path[:-1])[key_path[-1]] = "@HUGE@"
    return json.dumps(doc).replace('"@HUGE@"', "9" * 5000)


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("kind", ["huge_int", "deep"])
def test_json_bombs_in_the_model_config(model_dirs, worker, kind):
    doc, d = model_dirs["mixtral_a"]
    text = (
        huge_int_json(doc, ("model", "num_experts"))
        if kind == "huge_int"
        else json.dumps(dict(doc, source="@DEEP@")).replace('"@DEEP@"', DEEP)
    )
    (d / "config.json").write_text(text)
    refused(worker("modeldir", path=d), str(d / "config.json"))


# ---- the CLI: a few examples end to end ---------------------------------------------------------


@pytest.mark.parametrize("damage", ["none", "layers x experts", "deep", "tensor shape"])
def test_cli_info_is_one_line(model_dirs, tmp_path, damage):
    doc, _ = model_dirs["gemma4_a"]
    d = copy_dir(model_dirs["gemma4_a"][1], tmp_path / "m")
    if damage == "none":
        write_json(d / "config.json", doc)
    elif damage == "layers x experts":
        write_json(d / "config.json", dict(doc, model=dict(_resized(doc["model"], 4096), num_experts=1 << 16)))
    elif damage == "deep":
        (d / "config.json").write_text(json.dumps(dict(doc, source="@")).replace('"@"', DEEP))
    else:
        bad = copy.deepcopy(doc)
        bad["tensors"]["layers.0.experts.1.up"]["shape"] = [2**62, 2**62]
        write_json(d / "config.json", bad)
    t = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "info", "--model-dir", str(d)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
        **as_limit(),
    )
    assert time.perf_counter() - t < 30
    if damage == "none":
        assert r.returncode == 0 and "gemma4" in r.stdout, r.stderr
        return
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(d / "config.json") in lines[0], r.stderr


# ---- a big table is checked in linear time -------------------------------------------------------


def test_a_48_layer_128_expert_table_loads_in_linear_time(tmp_path):
    n, E = 48, 128
    cfg = ModelConfig(
        architecture="mixtral",
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=n,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=1e4,
        max_position_embeddings=64,
        num_experts=E,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_layers=[True] * n,
        layer_types=["full_attention"] * n,
    )
    cfg.validate()
    writer = ModelDirWriter(tmp_path / "big")
    by_file = {}
    for name, (shape, _) in cfg.expected_tensors().items():
        by_file.setdefault(tensor_file(name), []).append((name, shape))
    for rel, items in by_file.items():
        writer.write_file(
            rel, ((name, to_storage(np.zeros(shape, np.float32), "f32"), "f32", shape, {}) for name, shape in items)
        )
    writer.finish(cfg, "f32", {})
    t = time.perf_counter()
    md = ModelDir(tmp_path / "big")
    checked = time.perf_counter() - t
    t = time.perf_counter()
    maps = MappedModelDir(md)
    mapped = time.perf_counter() - t
    maps.close()
    assert len(md.tensors) > 3 * n * E
    assert checked < 3 and mapped < 2, (checked, mapped)  # 0.5 s and 0.2 s here; files x tensors took 5 s


# ---- safetensors headers ------------------------------------------------------------------------


def safetensors_file(path: Path, header: dict | str, data: bytes, length: int | None = None) -> Path:
    raw = (header if isinstance(header, str) else json.dumps(header)).encode()
    raw += b" " * ((-len(raw)) % 8)
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def small_header() -> tuple:
    """A valid header and its data: F32 [2, 3], F16 [4], BF16 [2, 2], a scalar, an empty tensor."""
    parts = [
        ("a", "F32", [2, 3], np.arange(6, dtype="<f4").tobytes()),
        ("b", "F16", [4], np.ones(4, "<f2").tobytes()),
        ("c", "BF16", [2, 2], np.full(4, 0x3F80, "<u2").tobytes()),
        ("s", "F32", [], np.float32(7).tobytes()),
        ("e", "F32", [0, 5], b""),
    ]
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for name, dtype, shape, blob in parts:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    return header, data


@pytest.fixture(scope="module")
def st_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("safetensors")


def test_pristine_safetensors_reads(worker, st_dir):
    header, data = small_header()
    assert (
        ok_or_clear_error(worker("safetensors", path=safetensors_file(st_dir / "p.safetensors", header, data)))[
            "result"
        ]
        == "ok"
    )


@settings(FAST, max_examples=300)
@given(data=st.data())
def test_safetensors_header_edits_read_or_fail_clearly(worker, st_dir, data):
    header, blob = small_header()
    edit_list = data.draw(edits(header), label="edits")
    length = data.draw(
        st.none() | st.none() | st.sampled_from([0, 1, 7, 2**63, 2**64 - 1]) | st.integers(0, 2000),
        label="header length",
    )
    cut = data.draw(st.none() | st.none() | st.integers(0, len(blob) - 1), label="data kept")
    path = safetensors_file(
        st_dir / "m.safetensors", apply_edits(header, edit_list), blob if cut is None else blob[:cut], length
    )
    ok_or_clear_error(worker("safetensors", path=path), (edit_list, length, cut))


def _header_with(**entry):
    header, data = small_header()
    header["a"] = dict(header["a"], **entry)
    for k in [k for k, v in entry.items() if v is None]:
        del header["a"][k]
    return header, data


SAFETENSORS_DAMAGE = [
    ("no data_offsets", _header_with(data_offsets=None), ["tensor 'a'", "data_offsets"]),
    ("negative offset", _header_with(data_offsets=[-8, 16]), ["tensor 'a'", "data_offsets", "-8"]),
    ("offsets past the end", _header_with(data_offsets=[0, 10**6]), ["tensor 'a'", "data_offsets"]),
    ("offsets reversed", _header_with(data_offsets=[24, 0]), ["tensor 'a'", "data_offsets"]),
    ("negative dimension", _header_with(shape=[-2, -3]), ["tensor 'a'", "shape"]),
    ("overflowing shape", _header_with(shape=[2**32, 2**32]), ["tensor 'a'", "4294967296", "needs"]),
    ("shape with zero elements far too big", _header_with(shape=[2**62, 0]), ["tensor 'a'", "shape"]),
    ("bool dimension", _header_with(shape=[True, 3]), ["tensor 'a'", "shape"]),
    ("string dimension", _header_with(shape=["2", 3]), ["tensor 'a'", "shape"]),
    ("shape null", _header_with(shape=None), ["tensor 'a'", "shape"]),
    ("dtype list", _header_with(dtype=["F32"]), ["tensor 'a'", "dtype"]),
    ("dtype I8", _header_with(dtype="I8"), ["tensor 'a'", "'I8'"]),
    ("entry is a list", ({"a": [1, 2]}, b""), ["tensor 'a'"]),
    ("overlap", _header_with(data_offsets=[8, 32]), ["'a'", "'b'", "share bytes"]),
    ("metadata a list", ({"__metadata__": ["x"]}, b""), ["__metadata__"]),
    ("header a list", ([1], b""), ["header", "object"]),
]


@pytest.mark.parametrize("header, named", [pytest.param(h, n, id=i) for i, h, n in SAFETENSORS_DAMAGE])
def test_safetensors_damage_names_the_tensor_and_field(worker, st_dir, header, named):
    head, data = header
    path = safetensors_file(st_dir / "d.safetensors", json.dumps(head), data)
    refused(worker("safetensors", path=path), str(path), *named)


@pytest.mark.parametrize("kind", ["huge_int", "deep", "length_too_big", "not_utf8"])
def test_json_bombs_in_a_safetensors_header(worker, st_dir, kind):
    header, data = small_header()
    path = st_dir / "bomb.safetensors"
    if kind == "huge_int":
        safetensors_file(path, huge_int_json(header, ("a", "data_offsets", 1)), data)
    elif kind == "deep":
        safetensors_file(path, DEEP, data)
    elif kind == "length_too_big":
        safetensors_file(path, header, data, length=2**64 - 1)
    else:
        path.write_bytes(struct.pack("<Q", 8) + b"\xff\xfe{}    " + data)
    refused(worker("safetensors", path=path), str(path))


# ---- the shard index --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    d = copy_dir(FIXTURES / "mixtral_b" / "hf", tmp_path_factory.mktemp("sharded") / "hf")
    return json.loads((d / "model.safetensors.index.json").read_text()), d


@settings(FAST, max_examples=100)
@given(data=st.data())
def test_shard_index_edits_read_or_fail_clearly(worker, sharded, data):
    doc, d = sharded
    edit_list = data.draw(edits(doc, sections=["weight_map", "weight_map", "metadata"]), label="edits")
    write_json(d / "model.safetensors.index.json", apply_edits(doc, edit_list))
    try:
        ok_or_clear_error(worker("checkpoint", path=d), edit_list)
    finally:
        write_json(d / "model.safetensors.index.json", doc)


@pytest.mark.parametrize(
    "text, named",
    [
        ('{"weight_map": [1, 2]}', "weight_map"),
        ('{"weight_map": {"model.embed_tokens.weight": 5}}', "model.embed_tokens.weight"),
        ('{"weight_map": {"model.embed_tokens.weight": "../../etc/passwd"}}', "shard name"),
        ('{"weight_map": {"model.embed_tokens.weight": "a\\u0000b"}}', "shard name"),
        ('{"weight_map": {"x": "' + "a" * 5000 + '"}}', "index.json"),
        ("[1]", "weight_map"),
        ('{"weight_map": {"x": ' + "9" * 5000 + "}}", "index.json"),
        (DEEP, "index.json"),
    ],
)
def test_damaged_shard_index_is_named(worker, sharded, text, named):
    doc, d = sharded
    (d / "model.safetensors.index.json").write_text(text)
    try:
        refused(worker("checkpoint", path=d), str(d / "model.safetensors.index.json"), named)
    finally:
        write_json(d / "model.safetensors.index.json", doc)


# ---- the Hugging Face config.json, fed to convert ------------------------------------------------

HF_CASES = ["mixtral_a", "gemma4_a", "gemma4_b", "qwen2moe_a", "qwen3moe_a", "olmoe_a"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("schema_hf")
    return {
        case: (
            json.loads((FIXTURES / case / "hf" / "config.json").read_text()),
            copy_dir(FIXTURES / case / "hf", root / case),
            root / f"{case}_out",
        )
        for case in HF_CASES
    }


@pytest.mark.parametrize("case", HF_CASES)
@settings(FAST, max_examples=60)
@given(data=st.data())
def test_hf_config_edits_convert_or_fail_clearly(hf_dirs, worker, case, data):
    doc, d, out = hf_dirs[case]
    sections = sorted(doc)
    if "text_config" in doc:
        sections += ["text_config"] * len(sections)  # the model's fields live there
    edit_list = data.draw(edits(doc, sections=sections), label="edits")
    write_json(d / "config.json", apply_edits(doc, edit_list))
    ok_or_clear_error(worker("convert", hf=d, out=out), edit_list)


def _hf_edit(case, **fields):
    def edit(doc):
        target = doc["text_config"] if "text_config" in doc else doc
        target.update(fields)
        return doc

    return case, edit


HF_DAMAGE = [
    (_hf_edit("mixtral_a", num_local_experts=10**7), ["num_local_experts", "10000000"]),
    (_hf_edit("mixtral_a", num_local_experts=30000), ["30000 experts"]),
    (_hf_edit("mixtral_a", num_hidden_layers=4096, num_local_experts=64), ["num_experts", "4096"]),
    (_hf_edit("olmoe_a", num_experts=1 << 16, intermediate_size=1 << 18), ["num_experts", "moe_intermediate_size"]),
    (_hf_edit("mixtral_a", vocab_size=1 << 22, hidden_size=1 << 17, head_dim=64), ["vocab_size", "hidden_size"]),
    (_hf_edit("mixtral_a", max_position_embeddings=1 << 30, head_dim=4096), ["max_position_embeddings", "head_dim"]),
    (
        _hf_edit("mixtral_a", num_attention_heads=64, num_key_value_heads=64, head_dim=4096),
        ["num_attention_heads", "head_dim"],
    ),
    (_hf_edit("mixtral_a", eos_token_id="2"), ["eos_token_id", "'2'"]),
    (_hf_edit("mixtral_a", eos_token_id=[2, "3"]), ["eos_token_id[1]", "'3'"]),
    (_hf_edit("mixtral_a", eos_token_id=[True]), ["eos_token_id[0]"]),
    (_hf_edit("mixtral_a", bos_token_id="1"), ["bos_token_id", "'1'"]),
    (_hf_edit("mixtral_a", bos_token_id=[1]), ["bos_token_id"]),
    (_hf_edit("gemma4_b", eos_token_id=["<eos>"]), ["eos_token_id[0]"]),
    (_hf_edit("mixtral_a", num_attention_heads=0), ["num_attention_heads", "0"]),
    (_hf_edit("mixtral_a", hidden_size="64"), ["hidden_size", "'64'"]),
    (_hf_edit("mixtral_a", num_hidden_layers=10**12), ["num_hidden_layers"]),
    (_hf_edit("mixtral_a", rope_parameters=[1]), ["rope_parameters"]),
    (_hf_edit("mixtral_a", rms_norm_eps="1e-5"), ["rms_norm_eps"]),
    (_hf_edit("mixtral_a", tie_word_embeddings="false"), ["tie_word_embeddings"]),
    (_hf_edit("mixtral_a", architectures="MixtralForCausalLM"), ["architectures"]),
    (_hf_edit("qwen2moe_a", mlp_only_layers=[[0]]), ["mlp_only_layers[0]"]),
    (_hf_edit("qwen2moe_a", decoder_sparse_step="2"), ["decoder_sparse_step"]),
    (_hf_edit("gemma4_a", per_layer_config={"x": {}}), ["per_layer_config"]),
    (_hf_edit("gemma4_a", per_layer_config={"2": {"head_dim": [32]}}), ["per_layer_config.2.head_dim"]),
    (_hf_edit("gemma4_a", layer_types=[["full_attention"]] * 5), ["layer_types[0]"]),
    (_hf_edit("gemma4_a", rope_parameters={"full_attention": [1]}), ["rope_parameters.full_attention"]),
    (_hf_edit("gemma4_b", num_experts="8"), ["text_config.num_experts"]),
    (("gemma4_b", lambda doc: dict(doc, text_config=None)), ["text_config"]),
    (("gemma4_b", lambda doc: dict(doc, text_config=[1])), ["text_config"]),
]


@pytest.mark.parametrize("case_edit, named", HF_DAMAGE, ids=[f"{c}-{i}" for i, ((c, _), _) in enumerate(HF_DAMAGE)])
def test_damaged_hf_config_is_refused_by_field(hf_dirs, worker, case_edit, named):
    case, edit = case_edit
    doc, d, out = hf_dirs[case]
    write_json(d / "config.json", edit(copy.deepcopy(doc)))
    try:
        refused(worker("convert", hf=d, out=out), str(d), *named, within=1.0)
    finally:
        write_json(d / "config.json", doc)


@pytest.mark.parametrize("kind", ["huge_int", "deep"])
def test_json_bombs_in_the_hf_config(hf_dirs, worker, kind):
    doc, d, out = hf_dirs["mixtral_a"]
    text = huge_int_json(doc, ("vocab_size",)) if kind == "huge_int" else DEEP
    (d / "config.json").write_text(text)
    try:
        refused(worker("convert", hf=d, out=out), str(d / "config.json"))
    finally:
        write_json(d / "config.json", doc)


def test_hf_tensor_for_a_layer_the_config_lacks_is_refused_before_reading(tmp_path, worker):
    """A stacked expert tensor with no elements may name any number of experts: refused by its
    shape, not expanded into a plan."""
    from test_convert import hf_copy

    hf = hf_copy("mixtral_a", tmp_path / "hf")
    raw = (FIXTURES / "mixtral_a" / "hf" / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    src = json.loads(raw[8 : 8 + n])
    end = max(v["data_offsets"][1] for k, v in src.items() if k != "__metadata__")
    src["model.layers.0.mlp.experts.gate_up_proj"] = {
        "dtype": "F32",
        "shape": [10**12, 0, 64],
        "data_offsets": [end, end],
    }
    safetensors_file(hf / "model.safetensors", src, raw[8 + n :])
    refused(worker("convert", hf=hf, out=tmp_path / "out"), "gate_up_proj", "[1000000000000, 0, 64]", within=1.0)
