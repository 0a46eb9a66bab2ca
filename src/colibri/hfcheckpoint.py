"""Reading a Hugging Face checkpoint directory: config.json and safetensors, tensor by tensor.

safetensors is a JSON header plus raw little-endian data, so this reads it directly with a
memory map: the `safetensors` package's numpy loader cannot return bfloat16 (numpy has no such
dtype), and hub MoE checkpoints are mostly bf16. A tensor is read only when asked for, so a
conversion never holds more than one tensor in memory.

Single files (`model.safetensors`), sharded checkpoints (`model.safetensors.index.json` with its
`weight_map`) and directories of several `*.safetensors` without an index are all accepted.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from . import _os
from .errors import ColibriError

# safetensors dtype -> (numpy dtype of the stored elements, our name of the values)
_DTYPES = {"F32": ("<f4", "f32"), "F16": ("<f2", "f16"), "BF16": ("<u2", "bf16"), "F64": ("<f8", "f64")}
MAX_HEADER_BYTES = 100 << 20


class SafetensorsFile:
    """The header of one .safetensors file and lazy, memory-mapped access to its tensors."""

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ColibriError(f"{path}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise ColibriError(f"{path}: invalid safetensors header length {n}")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ColibriError(f"{path}: invalid safetensors header ({e})") from None
        header.pop("__metadata__", None)
        self.data_start = 8 + n
        self.entries = {}
        for name, e in header.items():
            if e.get("dtype") not in _DTYPES:
                raise ColibriError(f"{path}: tensor {name} has dtype {e.get('dtype')!r}; "
                                   f"supported: {', '.join(_DTYPES)}")
            np_dtype = np.dtype(_DTYPES[e["dtype"]][0])
            begin, end = e["data_offsets"]
            count = int(np.prod(e["shape"])) if e["shape"] else 1
            if end - begin != count * np_dtype.itemsize or self.data_start + end > size:
                raise ColibriError(f"{path}: tensor {name} has inconsistent offsets (truncated file?)")
            self.entries[name] = (e["dtype"], tuple(e["shape"]), begin)
        self._mm = None

    def raw(self, name: str) -> tuple:
        """(stored elements as a read-only numpy array, value dtype name 'f32'|'f16'|'bf16'|'f64')."""
        st_dtype, shape, begin = self.entries[name]
        np_dtype, kind = _DTYPES[st_dtype]
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        count = int(np.prod(shape)) if shape else 1
        start = self.data_start + begin
        arr = self._mm[start:start + count * np.dtype(np_dtype).itemsize].view(np_dtype).reshape(shape)
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
        try:
            self.config = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ColibriError(f"{cfg_path} is not valid JSON ({e})") from None
        if not isinstance(self.config, dict):
            raise ColibriError(f"{cfg_path} must hold a JSON object")
        self._files = {}       # file name -> SafetensorsFile
        self._where = {}       # tensor name -> file name
        index = self.root / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ColibriError(f"{index} is not a valid safetensors index ({e})") from None
            names = sorted(set(weight_map.values()))
        else:
            names = sorted(p.name for p in self.root.glob("*.safetensors"))
            weight_map = None
        if not names:
            raise ColibriError(f"{self.root} has no *.safetensors files (only safetensors checkpoints are supported)")
        for fname in names:
            if "/" in fname or "\\" in fname or fname.startswith(".."):
                raise ColibriError(f"{index}: invalid shard name {fname!r}")
            path = self.root / fname
            if not path.is_file():
                raise ColibriError(f"{path} is missing (named by {index.name})")
            st = SafetensorsFile(path)
            self._files[fname] = st
            for tname in st.entries:
                if tname in self._where:
                    raise ColibriError(f"tensor {tname} appears in both {self._where[tname]} and {fname}")
                self._where[tname] = fname
        if weight_map is not None:
            for tname, fname in weight_map.items():
                if self._where.get(tname) != fname:
                    raise ColibriError(f"{index}: {tname} is mapped to {fname} but not found there")

    def names(self) -> list:
        return sorted(self._where)

    def shape(self, name: str) -> tuple:
        return self._files[self._where[name]].entries[name][1]

    def raw(self, name: str) -> tuple:
        return self._files[self._where[name]].raw(name)

    def f32(self, name: str) -> np.ndarray:
        """The tensor's values as float32 (exact for f32/f16/bf16 sources), a copy: the mapped
        pages it was read from are released (see `to_f32`)."""
        return to_f32(*self.raw(name))


def to_f32(stored: np.ndarray, kind: str) -> np.ndarray:
    """A float32 copy of `stored` (a view of a mapped checkpoint), whose pages are then released
    from this process: converting a 50 GB checkpoint otherwise leaves its whole mapping resident
    (clean file pages, but counted in RSS and in a container's memory)."""
    if kind == "bf16":
        out = (stored.astype(np.uint32) << 16).view(np.float32)
    else:
        out = stored.astype(np.float32)
    if stored.size:
        _os.release([(stored.ctypes.data, stored.nbytes)])
    return out
