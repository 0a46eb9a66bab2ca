"""The on-disk model directory, format version 1: reading, validating, mapping, writing.

A model directory is plain headerless binary files plus `config.json`, the blueprint of their
bytes (docs/format.md is the full description):

    config.json                  format, byte order, model hyperparameters, tensor table, file table
    embedding.bin, lm_head.bin, final_norm.bin
    layers/LL/attn.bin           norms, q/k/v/o (+ biases, q/k norms) of layer LL
    layers/LL/router.bin         the router of a MoE layer
    layers/LL/expert_EEE.bin     gate, up, down of expert EEE of layer LL, nothing else
    layers/LL/shared_expert.bin  the shared expert and its gate (Qwen2-MoE)
    layers/LL/mlp.bin            the dense MLP of a non-MoE layer

Everything in config.json is validated before a byte of weights is mapped: a damaged directory is
a `ColibriError` naming the file, never a crash later. This module owns the format; the converter
writes through `ModelDirWriter`, the model maps through `MappedModelDir`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import _os, quant
from ._kernels import BLOCK_FORMATS, DTYPE_CODES
from .config import ModelConfig, read_json, shown
from .errors import ColibriError
from .formats import FORMATS, check_layout

FORMAT_NAME = "colibri"
FORMAT_VERSION = 1
ALIGNMENT = 64  # every tensor starts on a 64-byte boundary in its file
CONFIG_NAME = "config.json"
NEXTN_DIR = "nextn"  # a multi-token-prediction block: a model directory of its own inside the model's
MAX_CONFIG_BYTES = 64 << 20  # a config.json larger than this is refused
MAX_OTHER_FILES = 256  # files in the table beyond one per tensor (text files)
# storage dtype -> numpy dtype of the stored elements: the formats' (colibri.formats: bf16 is kept as its
# raw 16 bits; the block formats are stored as bytes, [rows, cols / 32 * block bytes]), and int16 norm weights
STORAGE_DTYPES = {**{name: fmt.element for name, fmt in FORMATS.items()}, "int16": np.dtype("<i2")}
NORM_DTYPES = ("f32", "int16")
ABSORBED_DTYPES = (
    "f32",
    "f16",
)  # MLA's absorbed up-projections (config.expected_tensors "absorbed")       # int16 norm weights carry a float "scale": w = scale * q
WEIGHT_DTYPES = tuple(DTYPE_CODES)  # the kernels' storage formats (colibri._kernels)


def storage_nbytes(dtype: str, shape) -> int:
    """Bytes of a tensor of logical `shape` stored as `dtype`: its format's (formats.Format.nbytes)."""
    if dtype in FORMATS:
        return FORMATS[dtype].nbytes(shape)
    return math.prod(shape) * STORAGE_DTYPES[dtype].itemsize


LAYOUTS = quant.LAYOUTS  # rows: [out, in]; transposed: [in, out] (block-wise for int8/int4);
# interleaved: groups of 8 outputs, 4 inputs at a time (quant.py);
# which a format has: colibri.formats


def check_stored_layout(dtype: str, layout: str, shape, kind: str, ctx: str) -> None:
    """A tensor table entry's layout against its format (formats.check_layout), its kind (only weight
    matrices leave rows) and its rows (a grouped layout holds whole groups of quant.TGROUP)."""
    if layout != "rows" and (kind != "matrix" or len(shape) != 2):
        raise ColibriError(f"{ctx}: only weight matrices can be stored {layout}")
    check_layout(dtype, layout, ctx)
    if dtype in FORMATS and FORMATS[dtype].grouped(layout) and shape[0] % quant.TGROUP:
        raise ColibriError(f"{ctx}: {layout} {dtype} needs a multiple of {quant.TGROUP} rows, got {list(shape)}")


def tensor_file(name: str) -> str:
    """The file (relative to the model directory) that holds tensor `name`."""
    parts = name.split(".")
    if parts[0] != "layers":
        return f"{name}.bin"
    layer = f"layers/{int(parts[1]):02d}"
    kind = parts[2]
    if kind == "experts":
        return f"{layer}/expert_{int(parts[3]):03d}.bin"
    if kind in ("router", "router_scale", "expert_scale", "router_bias", "router_logit_bias"):
        return f"{layer}/router.bin"
    if kind in ("shared", "shared_gate"):
        return f"{layer}/shared_expert.bin"
    if kind == "mlp":
        return f"{layer}/mlp.bin"
    return f"{layer}/attn.bin"


def safe_path(root: Path, rel: object) -> Path:
    """`root / rel`, refusing absolute paths, `..`, and symlinks that lead outside `root`."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\x00" in rel:
        raise ColibriError(f"{root / CONFIG_NAME}: invalid file name {rel!r}")
    p = Path(rel)
    if p.is_absolute() or rel.startswith("/") or ".." in p.parts or (len(rel) > 1 and rel[1] == ":"):
        raise ColibriError(f"{root / CONFIG_NAME}: file name {rel!r} points outside the model directory")
    full = root / p
    try:
        resolved = full.resolve(strict=False)
        inside = resolved.is_relative_to(root.resolve())
    except (OSError, RuntimeError):
        inside = False
    if not inside:
        raise ColibriError(f"{full}: resolves outside the model directory {root} (symlink?)")
    return full


def read_config_json(root: Path) -> dict:
    path = root / CONFIG_NAME
    if not root.exists():
        raise ColibriError(f"model directory {root} does not exist")
    if not root.is_dir():
        if root.suffix.lower() == ".gguf":
            raise ColibriError(
                f"{root} is a GGUF file; convert it into a model directory first: "
                f"python -m colibri convert --gguf {root} --output-dir {root.with_suffix('')}"
            )
        raise ColibriError(f"{root} is not a directory (expected a converted model directory)")
    if not path.is_file():
        raise ColibriError(
            f"{path} is missing: not a Colibri model directory "
            f"(convert one with: python -m colibri convert --hf-dir H --output-dir {root})"
        )
    cfg = read_json(path, "a model configuration", MAX_CONFIG_BYTES)
    if not isinstance(cfg, dict):
        raise ColibriError(f"{path} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


_HEX = frozenset("0123456789abcdefABCDEF")


# What a weight matrix does in the model, by its name: the unit of convert's --role FORMAT and of
# the bytes a decoded token reads (ModelDir.bytes_per_token).
ROLES = ("experts", "shared", "dense", "attention", "head", "embedding")  # the matrices' roles
_ATTENTION_PARTS = ("wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "wkb", "wvb")


def tensor_role(name: str) -> str:
    """One of ROLES for a weight matrix; "router" for the router's tensors, "other" for norms,
    biases, sinks and scalars."""
    parts = name.split(".")
    if parts[0] != "layers":
        return {"lm_head": "head", "embedding": "embedding"}.get(name, "other")
    kind = parts[2]
    if kind == "experts":
        return "experts" if parts[-1] in ("gate", "up", "down") else "other"
    if kind in ("router", "router_scale", "expert_scale", "router_bias", "router_logit_bias"):
        return "router"
    if kind == "shared":
        return "shared"
    if kind == "mlp":
        return "dense"
    return "attention" if kind in _ATTENTION_PARTS else "other"


class ModelDir:
    """A validated model directory: its config, tensor table and file table (nothing mapped)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        raw = read_config_json(self.root)
        where = str(self.root / CONFIG_NAME)
        fmt, version = raw.get("format"), raw.get("format_version")
        if fmt != FORMAT_NAME:
            raise ColibriError(
                f"{where}: 'format' is {shown(fmt)}, expected {FORMAT_NAME!r} "
                f"(is this a Hugging Face directory? convert it first)"
            )
        if type(version) is not int or version != FORMAT_VERSION:
            raise ColibriError(
                f"{where}: unknown format_version {shown(version)}; this Colibri reads "
                f"version {FORMAT_VERSION} (upgrade Colibri or re-convert)"
            )
        if raw.get("byte_order", "little") != "little":
            raise ColibriError(f"{where}: byte_order {shown(raw.get('byte_order'))} is not supported (only 'little')")
        if "alignment" in raw and (type(raw["alignment"]) is not int or raw["alignment"] != ALIGNMENT):
            raise ColibriError(
                f"{where}: 'alignment' must be {ALIGNMENT} in format version {FORMAT_VERSION}, "
                f"got {shown(raw['alignment'])}"
            )
        if "ln_gamma_quant_bits" in raw and (
            type(raw["ln_gamma_quant_bits"]) is not int or raw["ln_gamma_quant_bits"] not in (16, 32)
        ):
            raise ColibriError(
                f"{where}: 'ln_gamma_quant_bits' must be 16 or 32, got {shown(raw['ln_gamma_quant_bits'])}"
            )
        if "source" in raw and not isinstance(raw["source"], dict):
            raise ColibriError(f"{where}: 'source' must be a JSON object, got {shown(raw['source'])}")
        self.raw = raw
        self.config = ModelConfig.from_dict(raw.get("model"), where)
        self.weight_dtype = raw.get("weight_dtype")
        if type(self.weight_dtype) is not str or self.weight_dtype not in WEIGHT_DTYPES:
            raise ColibriError(
                f"{where}: weight_dtype {shown(self.weight_dtype)} is not one of {', '.join(WEIGHT_DTYPES)}"
            )
        tensors = raw.get("tensors")
        expected = self._check_names(tensors, where)  # before a file is looked at
        self.files = self._check_files(raw.get("files"), where, len(expected))
        self.tensors = self._check_tensors(tensors, expected, where)

    def _check_names(self, tensors, where) -> dict:
        """The tensor table's names against the config's (returns config.expected_tensors())."""
        if not isinstance(tensors, dict):
            raise ColibriError(f"{where}: 'tensors' must be an object, got {shown(tensors)}")
        cfg = self.config
        least = cfg.expert_tensor_count()
        if len(tensors) < least:  # before the expected table is built: it may be large
            raise ColibriError(
                f"{where}: the tensor table has {len(tensors)} entries, but the model section's "
                f"{sum(cfg.moe_layers)} MoE layers x {cfg.num_experts} experts need {least} "
                f"expert tensors alone (is 'model' or 'tensors' damaged?)"
            )
        expected = cfg.expected_tensors()
        missing = [n for n in expected if n not in tensors]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ColibriError(f"{where}: tensor table lacks {', '.join(missing[:5])}{more}")
        if len(tensors) != len(expected):
            extra = [n for n in tensors if n not in expected]
            raise ColibriError(
                f"{where}: unexpected tensor(s) {', '.join(shown(n, 60) for n in extra[:5])} for this architecture"
            )
        return expected

    def _check_files(self, files, where, n_tensors) -> dict:
        if not isinstance(files, dict) or not files:
            raise ColibriError(f"{where}: 'files' must be a non-empty object, got {shown(files)}")
        if len(files) > n_tensors + MAX_OTHER_FILES:  # bounds the stat() calls below
            raise ColibriError(
                f"{where}: the file table lists {len(files)} files for {n_tensors} tensors; at most "
                f"{MAX_OTHER_FILES} files may hold no tensors (tokenizer, chat template, ...)"
            )
        out = {}
        for rel, entry in files.items():
            path = safe_path(self.root, rel)
            ctx = f"{where}: files[{shown(rel)}]"
            if not isinstance(entry, dict):
                raise ColibriError(f"{ctx} must be an object with 'size' and 'sha256', got {shown(entry)}")
            if type(entry.get("size")) is not int or entry["size"] < 0:
                raise ColibriError(f"{ctx} needs an integer 'size' >= 0, got {shown(entry.get('size'))}")
            sha = entry.get("sha256")
            if type(sha) is not str or len(sha) != 64 or not _HEX.issuperset(sha):
                raise ColibriError(f"{ctx} needs a 'sha256' of 64 hex digits, got {shown(sha)}")
            try:
                st = os.stat(path)
            except (FileNotFoundError, NotADirectoryError):
                st = None
            except OSError as e:  # a name too long, a loop of links, no permission
                raise ColibriError(f"{ctx}: cannot stat {path}: {e.strerror or e}") from None
            if st is None or not stat.S_ISREG(st.st_mode):
                raise ColibriError(
                    f"{path} is missing (listed in config.json); the directory is incomplete: re-copy or re-convert it"
                )
            actual = st.st_size
            if actual != entry["size"]:
                what = "truncated" if actual < entry["size"] else "larger than expected"
                raise ColibriError(
                    f"{path} is {what}: config.json says {entry['size']} bytes, found {actual} "
                    f"(corrupted or incomplete copy: re-copy or re-convert)"
                )
            out[rel] = entry
        return out

    def _check_tensors(self, tensors, expected, where) -> dict:
        """Each entry of the tensor table (whose names _check_names checked) against the config and
        the file table, in time linear in its size (sorting aside): types, dtypes, shapes, byte
        counts, alignment, bounds within each file, and no two tensors sharing a byte."""
        spans = {}  # file -> [(offset, end, name)]
        for name, (shape, kind) in expected.items():
            t = tensors[name]
            ctx = f"{where}: tensor {name}"
            if not isinstance(t, dict):
                raise ColibriError(f"{ctx} must be an object, got {shown(t)}")
            for key, typ in (("file", str), ("offset", int), ("nbytes", int), ("dtype", str), ("shape", list)):
                if type(t.get(key)) is not typ:
                    raise ColibriError(
                        f"{ctx}: field {key!r} is missing or not a {typ.__name__}, got {shown(t.get(key))}"
                    )
            if t["file"] not in self.files:
                raise ColibriError(f"{ctx}: file {shown(t['file'])} is not in the file table")
            if t["dtype"] not in STORAGE_DTYPES:
                raise ColibriError(f"{ctx}: unknown dtype {shown(t['dtype'])}")
            allowed = (
                WEIGHT_DTYPES
                if kind == "matrix"
                else NORM_DTYPES
                if kind == "norm"
                else ABSORBED_DTYPES
                if kind == "absorbed"
                else ("f32",)
            )
            if t["dtype"] not in allowed:
                raise ColibriError(f"{ctx}: expected dtype {' or '.join(allowed)}, got {t['dtype']}")
            if t["dtype"] == "int16":
                sc = t.get("scale")
                if type(sc) not in (int, float) or not 0 < sc < 1e30:
                    raise ColibriError(f"{ctx}: an int16 tensor needs a positive finite 'scale', got {shown(sc)}")
            if not all(type(n) is int for n in t["shape"]) or tuple(t["shape"]) != shape:
                raise ColibriError(f"{ctx}: expected shape {list(shape)}, got {shown(t['shape'])}")
            layout = t.get("layout", "rows")
            if type(layout) is not str or layout not in LAYOUTS:
                raise ColibriError(f"{ctx}: unsupported layout {shown(layout)} (supported: {', '.join(LAYOUTS)})")
            check_stored_layout(t["dtype"], layout, shape, kind, ctx)
            if (t["dtype"] in BLOCK_FORMATS or layout == "interleaved") and (
                len(shape) != 2 or shape[1] % quant.QBLOCK
            ):
                raise ColibriError(
                    f"{ctx}: {t['dtype']} needs a matrix with a multiple of {quant.QBLOCK} columns, got {list(shape)}"
                )
            nbytes = storage_nbytes(t["dtype"], shape)
            if t["nbytes"] != nbytes:
                raise ColibriError(
                    f"{ctx}: expected {nbytes} bytes for {t['dtype']} {list(shape)}, table says {shown(t['nbytes'])}"
                )
            if t["offset"] < 0 or t["offset"] % ALIGNMENT:
                raise ColibriError(f"{ctx}: offset {shown(t['offset'])} is not a non-negative multiple of {ALIGNMENT}")
            if t["offset"] + nbytes > self.files[t["file"]]["size"]:
                raise ColibriError(
                    f"{ctx}: bytes {t['offset']}..{t['offset'] + nbytes} lie past the end "
                    f"of {t['file']} ({self.files[t['file']]['size']} bytes)"
                )
            if nbytes:
                spans.setdefault(t["file"], []).append((t["offset"], t["offset"] + nbytes, name))
        for rel, items in spans.items():
            items.sort()
            for (_, end, first), (begin, end2, second) in zip(items, items[1:]):
                if begin < end:
                    raise ColibriError(
                        f"{where}: tensors {first} and {second} share bytes {begin}..{min(end, end2)} "
                        f"of {rel} (two tensors must not overlap in a file)"
                    )
        return tensors

    def bytes_per_token(self) -> dict:
        """{role: bytes of weights one decoded token reads}: every tensor once, except a routed
        expert's (top-k of num_experts of them run in each MoE layer: counted k / E) and an untied
        embedding table (one row of it is read); a tied one is the output head too."""
        c = self.config
        out = {}
        for name, t in self.tensors.items():
            role = tensor_role(name)
            n = t["nbytes"]
            if role == "experts":
                n = n * c.num_experts_per_tok / c.num_experts
            elif role == "embedding":
                role, n = ("head", n) if c.tie_word_embeddings else (role, n / t["shape"][0])
            out[role] = out.get(role, 0.0) + n
        return out

    def verify(self, progress=None, files=None) -> list:
        """sha256 of every file (or of `files`) against the table: a list of (file, problem), empty
        when all match."""
        bad = []
        names = sorted(self.files) if files is None else list(files)
        for i, rel in enumerate(names):
            entry = self.files[rel]
            if progress:
                progress(i, len(names), rel)
            h = hashlib.sha256()
            with open(self.root / rel, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            if h.hexdigest() != entry["sha256"]:
                bad.append((rel, f"sha256 mismatch: expected {entry['sha256'][:16]}..., got {h.hexdigest()[:16]}..."))
        return bad


@dataclass(frozen=True)
class TensorRef:
    """A tensor in place in a mapping: its address, storage dtype, logical shape, layout."""

    address: int
    dtype: str  # a _kernels.DTYPE_CODES name
    shape: tuple
    layout: str = "rows"  # a _kernels.LAYOUT_CODES name
    input_stats: object = None  # float64 [cols + 1] or None: what the engine adds each input's squares to
    input_gram: object = None  # float64 [cols, cols] or None: what it adds x x^T to (upper triangle)


class MappedModelDir:
    """Every file of a validated ModelDir, mapped read-only through colibri._os (or read into
    memory _os allocated, with use_mmap=False, for filesystems where mapping is unsafe or slow);
    weights are used in place.

    `address(name)` is the address of a tensor's first byte, valid until close().
    """

    def __init__(self, md: ModelDir, use_mmap: bool = True):
        self.md = md
        self._maps = {}  # rel -> (_os.Mapping or _os.AlignedBuffer, its uint8 view [size], page-aligned)
        self._dequantized = {}  # int16 norm name -> float32 [n]
        try:
            in_use = {t["file"] for t in md.tensors.values()}  # once: files x tensors was quadratic
            for rel, entry in md.files.items():
                if entry["size"] == 0 or rel not in in_use:
                    continue
                self._maps[rel] = (self._map if use_mmap else self._read)(md.root / rel, entry["size"])
        except (OSError, MemoryError) as e:
            self.close()
            what = getattr(e, "filename", None) or md.root
            raise ColibriError(
                f"cannot {'map' if use_mmap else 'read'} {what}: {getattr(e, 'strerror', None) or e}"
            ) from None

    @staticmethod
    def _map(path: Path, size: int) -> tuple:
        mapping = _os.map_file(path)
        if mapping.size != size:  # changed since validation
            mapping.close()
            raise ColibriError(f"{path} changed size while loading")
        return mapping, mapping.as_numpy()

    @staticmethod
    def _read(path: Path, size: int) -> tuple:
        _, buffer = _os.alloc_aligned(size, ALIGNMENT)
        view = buffer.as_numpy()
        with open(path, "rb") as f:
            got = f.readinto(memoryview(view))
        if got != size:
            buffer.close()
            raise ColibriError(f"{path} changed size while loading (read {got} of {size} bytes)")
        view.flags.writeable = False
        return buffer, view

    def address(self, name: str) -> int:
        t = self.md.tensors[name]
        return self._maps[t["file"]][1].ctypes.data + t["offset"]

    def array(self, name: str) -> np.ndarray:
        """A read-only numpy view of a tensor in its storage dtype and layout (no copy): rows
        layout [rows, cols] (int8/int4: [rows, row bytes]); transposed [cols, rows] (int8/int4:
        [cols / 32, rows / 8 * group bytes], quant.transpose); interleaved (int8/int4/bf16...) [rows / 8,
        cols / 32 * group bytes] (quant.interleave)."""
        t = self.md.tensors[name]
        view = self._maps[t["file"]][1][t["offset"] : t["offset"] + t["nbytes"]]
        layout = t.get("layout", "rows")
        transposed = layout == "transposed"
        if t["dtype"] in BLOCK_FORMATS or layout == "interleaved":
            first = {"transposed": t["shape"][1] // quant.QBLOCK, "interleaved": t["shape"][0] // quant.TGROUP}
            return view.reshape(first.get(layout, t["shape"][0]), -1)
        shape = t["shape"][::-1] if transposed else t["shape"]
        return view.view(STORAGE_DTYPES[t["dtype"]]).reshape(shape)

    def rows_array(self, name: str) -> np.ndarray:
        """The tensor in its storage dtype and the rows layout (a copy where it is stored otherwise)."""
        t = self.md.tensors[name]
        a = self.array(name)
        if t.get("layout", "rows") == "rows":
            return a
        return quant.to_rows(a, t["dtype"], t["shape"][0], t["shape"][1], t["layout"])

    def mapped_files(self) -> list:
        return list(self._maps)

    def file_span(self, rel: str) -> tuple:
        """(address, length) of a whole file in memory, the length rounded up to whole pages."""
        page = _os.page_size()
        addr = self._maps[rel][1].ctypes.data
        return addr, (self.md.files[rel]["size"] + page - 1) // page * page

    def tensor_refs(self) -> dict:
        """name -> TensorRef of every tensor in place (what colibri.spec hands the engine). int16
        norms are dequantized here into float32 arrays (kept alive by this object: a few KB)."""
        table = {}
        for n, t in self.md.tensors.items():
            if t["dtype"] == "int16":
                f32 = (self.array(n).astype(np.float32) * np.float32(t["scale"])).astype(np.float32)
                self._dequantized[n] = f32
                table[n] = TensorRef(f32.ctypes.data, "f32", tuple(t["shape"]))
            else:
                table[n] = TensorRef(self.address(n), t["dtype"], tuple(t["shape"]), t.get("layout", "rows"))
        return table

    def close(self):
        """Drop the mappings: each is unmapped (freed) as soon as no numpy view of it is left (a
        view handed out by array() keeps its own mapping alive; raw addresses do not)."""
        self._maps = {}


# ---- writing ---------------------------------------------------------------------------------


def to_storage(array: np.ndarray, dtype: str, importance=None) -> np.ndarray:
    """float32 (or float16/float64) values -> the stored elements of `dtype`, little-endian.

    bf16 rounds to nearest even, as torch's .to(torch.bfloat16) does; NaN stays NaN. importance
    [cols] (int8/int4): each input column's weight in the scale search (quant.quantize).
    """
    a = np.asarray(array, dtype=np.float32)
    if dtype == "f32":
        return a.astype("<f4", copy=False)
    if dtype == "f16":
        return a.astype("<f2")
    if dtype == "bf16":
        bits = a.view(np.uint32)
        rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
        nan = np.isnan(a)
        if nan.any():
            rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
        return rounded.astype("<u2", copy=False)
    if dtype in BLOCK_FORMATS:
        return quant.quantize(a, dtype, importance if dtype in IMPORTANCE_FORMATS else None)
    raise ColibriError(f"unknown storage dtype {dtype!r}")


IMPORTANCE_FORMATS = ("int8", "int4", "nl4", "int6")  # the formats whose scales an importance vector chooses


def from_storage(stored: np.ndarray, dtype: str, cols: int | None = None) -> np.ndarray:
    """Stored elements -> float32 values (exact: block formats give what the kernels use)."""
    if dtype in BLOCK_FORMATS:
        return quant.dequantize(stored, dtype, cols)
    if dtype == "bf16":
        return (np.asarray(stored, np.uint32) << 16).view(np.float32)
    return np.asarray(stored, np.float32)


class ModelDirWriter:
    """Writes a model directory file by file; `finish()` writes config.json with both tables."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.tensors = {}
        self.files = {}

    def write_file(self, rel: str, items) -> None:
        """items: iterable of (name, stored array, dtype, logical shape, extra table fields), in
        order, each 64-byte aligned."""
        path = safe_path(self.root, rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256()
        offset = 0
        with open(path, "wb") as f:
            for name, stored, dtype, shape, extra in items:
                pad = (-offset) % ALIGNMENT
                if pad:
                    f.write(b"\0" * pad)
                    h.update(b"\0" * pad)
                    offset += pad
                data = np.ascontiguousarray(stored).tobytes()
                f.write(data)
                h.update(data)
                self.tensors[name] = {
                    "file": rel,
                    "offset": offset,
                    "nbytes": len(data),
                    "dtype": dtype,
                    "shape": list(shape),
                    "layout": "rows",
                    **extra,
                }
                offset += len(data)
        self.files[rel] = {"size": offset, "sha256": h.hexdigest()}

    def add_file(self, rel: str, source: Path) -> None:
        """Copy a file that holds no tensors (tokenizer.model) into the directory and the file table."""
        path = safe_path(self.root, rel)
        data = Path(source).read_bytes()
        path.write_bytes(data)
        self.files[rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def finish(self, config: ModelConfig, weight_dtype: str, source: dict, ln_bits: int = 32) -> None:
        doc = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "byte_order": "little",
            "alignment": ALIGNMENT,
            "weight_dtype": weight_dtype,
            "ln_gamma_quant_bits": ln_bits,
            "model": config.to_dict(omit_default_extensions=True),
            "source": source,
            "tensors": self.tensors,
            "files": dict(sorted(self.files.items())),
        }
        (self.root / CONFIG_NAME).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
