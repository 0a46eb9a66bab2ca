"""Reading a Hugging Face checkpoint directory: config.json and safetensors, tensor by tensor.

safetensors is a JSON header plus raw little-endian data, so this reads it directly with a
memory map: the `safetensors` package's numpy loader cannot return bfloat16 (numpy has no such
dtype), and hub MoE checkpoints are mostly bf16. A tensor is read only when asked for, so a
conversion never holds more than one tensor in memory.

Single files (`model.safetensors`), sharded checkpoints (`model.safetensors.index.json` with its
`weight_map`) and directories of several `*.safetensors` without an index are all accepted.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np

from . import _os
from .config import parse_json, read_json, shown
from .errors import ColibriError

# safetensors dtype -> (numpy dtype of the stored elements, our name of the values)
# (U8: the bytes of quantized weights, gpt-oss's mxfp4 *_blocks / *_scales; never read as values)
_DTYPES = {
    "F32": ("<f4", "f32"),
    "F16": ("<f2", "f16"),
    "BF16": ("<u2", "bf16"),
    "F64": ("<f8", "f64"),
    "U8": ("u1", "u8"),
}
MAX_HEADER_BYTES = 100 << 20  # a safetensors header (JSON) larger than this is refused
MAX_HF_CONFIG_BYTES = 16 << 20  # config.json (a few KB in practice)
MAX_INDEX_BYTES = 64 << 20  # model.safetensors.index.json (a few MB for the largest models)
MAX_NDIM = 16  # dimensions of one tensor (checkpoints have at most 4 or 5)
MAX_DIM = 1 << 40  # one dimension (bounds even a tensor with no elements)


class SafetensorsFile:
    """The header of one .safetensors file and lazy, memory-mapped access to its tensors.

    The header is checked against the format before anything is mapped: an object of tensors, each
    with a supported dtype, a shape of non-negative integers and data_offsets [begin, end] inside
    the data area (after the header, before the end of the file) holding exactly the shape's bytes,
    no two tensors sharing a byte; an optional __metadata__ object of strings."""

    def __init__(self, path: Path):
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ColibriError(f"{path}: too short to be a safetensors file ({size} bytes)")
                (n,) = struct.unpack("<Q", head)
                if n > MAX_HEADER_BYTES or 8 + n > size:
                    raise ColibriError(
                        f"{path}: invalid safetensors header length {n} (file of {size} bytes, "
                        f"at most {MAX_HEADER_BYTES >> 20} MB of header)"
                    )
                raw = f.read(n)
        except OSError as e:
            raise ColibriError(f"{path}: cannot read: {e.strerror or e}") from None
        header = parse_json(raw, path, "the safetensors header")
        if not isinstance(header, dict):
            raise ColibriError(f"{path}: the safetensors header must be a JSON object, got {shown(header)}")
        meta = header.pop("__metadata__", None)
        if meta is not None and not (isinstance(meta, dict) and all(type(v) is str for v in meta.values())):
            raise ColibriError(f"{path}: __metadata__ must be an object of strings, got {shown(meta)}")
        self.data_start = 8 + n
        data_size = size - self.data_start
        self.entries = {}
        spans = []
        for name, e in header.items():
            ctx = f"{path}: tensor {shown(name, 80)}"
            if not isinstance(e, dict):
                raise ColibriError(f"{ctx} must be an object with dtype, shape and data_offsets, got {shown(e)}")
            dtype = e.get("dtype")
            if type(dtype) is not str or dtype not in _DTYPES:
                raise ColibriError(f"{ctx} has dtype {shown(dtype)}; supported: {', '.join(_DTYPES)}")
            shape = e.get("shape")
            if (
                type(shape) is not list
                or len(shape) > MAX_NDIM
                or not all(type(d) is int and 0 <= d <= MAX_DIM for d in shape)
            ):
                raise ColibriError(
                    f"{ctx}: 'shape' must be a list of at most {MAX_NDIM} integers in 0..{MAX_DIM}, got {shown(shape)}"
                )
            offsets = e.get("data_offsets")
            if type(offsets) is not list or len(offsets) != 2 or not all(type(o) is int for o in offsets):
                raise ColibriError(f"{ctx}: 'data_offsets' must be [begin, end] (two integers), got {shown(offsets)}")
            begin, end = offsets
            if not 0 <= begin <= end <= data_size:
                raise ColibriError(
                    f"{ctx}: data_offsets {shown(offsets)} lie outside the data area of "
                    f"{data_size} bytes after the header (truncated file?)"
                )
            nbytes = math.prod(shape) * np.dtype(_DTYPES[dtype][0]).itemsize
            if end - begin != nbytes:
                raise ColibriError(
                    f"{ctx}: data_offsets {shown(offsets)} hold {end - begin} bytes, but "
                    f"{dtype} {shape} needs {nbytes} (inconsistent header)"
                )
            if nbytes:
                spans.append((begin, end, name))
            self.entries[name] = (dtype, tuple(shape), begin)
        spans.sort()
        for (_, end, first), (begin, _end, second) in zip(spans, spans[1:]):
            if begin < end:
                raise ColibriError(
                    f"{path}: tensors {shown(first, 80)} and {shown(second, 80)} share bytes "
                    f"{begin}..{min(end, _end)} of the data area"
                )
        self._mm = None

    def raw(self, name: str) -> tuple:
        """(stored elements as a read-only numpy array, value dtype name 'f32'|'f16'|'bf16'|'f64')."""
        st_dtype, shape, begin = self.entries[name]
        np_dtype, kind = _DTYPES[st_dtype]
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        count = math.prod(shape)
        start = self.data_start + begin
        arr = self._mm[start : start + count * np.dtype(np_dtype).itemsize].view(np_dtype).reshape(shape)
        return arr, kind


class HFCheckpoint:
    """A Hugging Face model directory: `config` (dict) and its tensors by name."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        if not self.root.is_dir():
            raise ColibriError(f"Hugging Face directory {self.root} does not exist or is not a directory")
        cfg_path = self.root / "config.json"
        if not cfg_path.is_file():
            raise ColibriError(f"{cfg_path} is missing: not a Hugging Face model directory")
        self.config = read_json(cfg_path, "a Hugging Face config", MAX_HF_CONFIG_BYTES)
        if not isinstance(self.config, dict):
            raise ColibriError(f"{cfg_path} must hold a JSON object, got {shown(self.config)}")
        self._files = {}  # file name -> SafetensorsFile
        self._where = {}  # tensor name -> file name
        index = self.root / "model.safetensors.index.json"
        if index.is_file():
            doc = read_json(index, "a safetensors index", MAX_INDEX_BYTES)
            weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
            if not isinstance(weight_map, dict):
                raise ColibriError(
                    f"{index}: 'weight_map' must be an object of tensor name -> shard file, "
                    f"got {shown(weight_map if isinstance(doc, dict) else doc)}"
                )
            for tname, fname in weight_map.items():
                if type(fname) is not str:
                    raise ColibriError(
                        f"{index}: weight_map[{shown(tname, 80)}] must be a file name, got {shown(fname)}"
                    )
            names = sorted(set(weight_map.values()))
        else:
            names = sorted(p.name for p in self.root.glob("*.safetensors"))
            weight_map = None
        if not names:
            raise ColibriError(f"{self.root} has no *.safetensors files (only safetensors checkpoints are supported)")
        for fname in names:
            if not fname or "/" in fname or "\\" in fname or "\x00" in fname or fname.startswith(".."):
                raise ColibriError(f"{index}: invalid shard name {shown(fname)} (a file name in {self.root})")
            path = self.root / fname
            try:
                present = path.is_file()
            except OSError as e:  # e.g. a name too long for the file system
                raise ColibriError(f"{index}: shard {shown(fname)}: {e.strerror or e}") from None
            if not present:
                raise ColibriError(f"{path} is missing (named by {index.name})")
            st = SafetensorsFile(path)
            self._files[fname] = st
            for tname in st.entries:
                if tname in self._where:
                    raise ColibriError(f"tensor {shown(tname, 120)} appears in both {self._where[tname]} and {fname}")
                self._where[tname] = fname
        if weight_map is not None:
            for tname, fname in weight_map.items():
                if self._where.get(tname) != fname:
                    raise ColibriError(
                        f"{index}: {shown(tname, 120)} is mapped to {shown(fname, 120)} but not found there"
                    )

    def names(self) -> list:
        return sorted(self._where)

    def shape(self, name: str) -> tuple:
        return self._files[self._where[name]].entries[name][1]

    def raw(self, name: str) -> tuple:
        return self._files[self._where[name]].raw(name)

    def f32(self, name: str) -> np.ndarray:
        """The tensor's values as float32 (exact for f32/f16/bf16 sources), a copy: the mapped
        pages it was read from are released (see `to_f32`)."""
        arr, kind = self.raw(name)
        if kind == "u8":
            raise ColibriError(
                f"{self.root}: tensor {shown(name, 120)} holds bytes (U8), not weights: a quantized "
                f"checkpoint whose format is not understood here (mxfp4 is)"
            )
        return to_f32(arr, kind)


def to_f32(stored: np.ndarray, kind: str) -> np.ndarray:
    """A float32 copy of `stored` (a view of a mapped checkpoint), whose pages are then released
    from this process: converting a 50 GB checkpoint otherwise leaves its whole mapping resident
    (clean file pages, but counted in RSS and in a container's memory)."""
    if kind == "u8":
        raise ColibriError("bytes of a quantized tensor cannot be read as weights")
    if kind == "bf16":
        out = (stored.astype(np.uint32) << 16).view(np.float32)
    else:
        out = stored.astype(np.float32)
    if stored.size:
        _os.release([(stored.ctypes.data, stored.nbytes)])
    return out
