"""GGUF import: a llama.cpp model file read as if it were a Hugging Face checkpoint.

Design
------
`GGUFCheckpoint` presents one .gguf file through HFCheckpoint's interface (`config`, `names`,
`shape`, `f32`, `root`): a config.json built from the GGUF metadata and transformers' tensor
names, so that convert's registry (`hf_model_config`) and tensor plan (`plan_tensors`) do the
rest unchanged, with the same checks. The header, metadata and tensor table are read by
`GGUFFile`, as llama.cpp's gguf.cpp reads them and refusing what it refuses, with every count,
length, dimension and offset checked against the bytes left before anything is read or allocated
from it: a file that lies about a size is one ColibriError naming the file and the value, at once
(llama.cpp's Python reader, the `gguf` package, trusts them: a count of 10^9 had it loop for
minutes into gigabytes, and it takes seconds over an honest vocabulary of 150,000 tokens). The
`gguf` package (an extra: `pip install colibri-moe[gguf]`) gives the tensor types and the
dequantization of the types Colibri has no format for.

Architectures, as llama.cpp names them: `llama` with experts (Mixtral), `qwen2moe`, `qwen3moe`,
`olmoe`, `gpt-oss`, `deepseek2` (DeepSeek-V3, Kimi K2), `gemma4` (with its MoE block). Where the GGUF carries no setting that transformers' config has, llama.cpp's
graph decides, since that is how every GGUF user runs the file: qwen3moe renormalizes the top-k
routing weights, qwen2moe and olmoe do not (`norm_topk_prob`); gpt-oss's SwiGLU clamp is 7.0 with
alpha 1.702, and its even layers slide (`load_swa_pattern`, period 2).

Tensors, by GGUF type:
- F32, F16, BF16: the values as they are.
- Q8_0 and Q4_0: the blocks of Colibri's int8 and int4 exactly (34 bytes: an f16 scale and 32
  int8; 18 bytes: an f16 scale and 16 bytes, element j in the low nibble of byte j and element
  j + 16 in the high one, value d * (q - 8)): a `quant.StoredMatrix`, written byte for byte
  when the target format is the same, dequantized otherwise. MXFP4 likewise into mxfp4, with
  its nibbles reordered (`_mxfp4_from_ggml`): the same values, no requantization.
- every other type (the K-quants, IQ4_XS, Q5_0, ...): dequantized by gguf's reference code
  (`gguf.quants.dequantize`), then stored in the target format; the error that costs is reported
  (`requantization_error`).
- llama's q and k projections are stored by convert_hf_to_gguf.py with each head's rows
  permuted for GGML's adjacent-pair RoPE; they are permuted back (whole rows, so quantized
  blocks stay intact).
Merged experts (`blk.N.ffn_gate_exps`, [E, ff, d]) are cut into transformers' per-expert names;
the per-expert names of older Mixtral GGUFs (`blk.N.ffn_gate.E.weight`) are read as well.

The text side (tokenizer.json, tokenizer_config.json, the chat template, generation_config.json)
is made from the tokenizer metadata by `gguf_vocab.tokenizer_files`; `write_text_files` puts them
where convert validates and copies them.
"""

from __future__ import annotations

import json
import math
import mmap
import re
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np

from . import _os, quant
from .config import shown
from .errors import ColibriError
from .hfcheckpoint import to_f32
from .names import DISTRIBUTION

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length, name, n_dims, one dim, type, offset
MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length, key, value type, a one-byte value
# GGUF metadata value types (llama.cpp's gguf_type) -> numpy dtype; 8 is a string (a u64 byte
# count, then UTF-8), 9 an array (a u32 item type, a u64 count, then the items)
VALUE_DTYPES = {
    0: "u1",
    1: "i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
GGUF_UINT32, GGUF_STRING, GGUF_ARRAY, GGUF_UINT64 = 4, 8, 9, 10
GGML_MAX_DIMS, GGML_MAX_NAME = 4, 64  # llama.cpp's bounds on a tensor's dimensions and name (bytes, with its NUL)
DEFAULT_ALIGNMENT = 32  # of the data section and of each tensor in it, unless general.alignment says
# GGML tensor types read as typed elements, as gguf's reader does (the block types: bytes)
ELEMENT_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}

# general.architecture -> the transformers class its config is built as
ARCHITECTURES = {
    "llama": "MixtralForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "deepseek2": "DeepseekV3ForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
}
# llama.cpp's MoE graph per architecture: renormalize the top-k weights? (build_moe_ffn's norm_w)
NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False, "gpt-oss": True}
GATING_SOFTMAX, GATING_SIGMOID = 1, 2  # {arch}.expert_gating_func (llama_expert_gating_func_type)
_KV_B = "kv_b"  # DeepSeek's kv_b_proj, put back together from attn_k_b / attn_v_b
# gpt-oss in llama.cpp (llama-graph.cpp, ggml_swiglu_oai): constants, not metadata; YaRN without
# truncation (the published config's rope_parameters.truncate)
GPT_OSS_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
# GGUF tensor types carried without requantization -> our format
CARRIED = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "int8", "Q4_0": "int4", "MXFP4": "mxfp4"}
# general.file_type (llama_ftype) -> the Colibri format a conversion defaults to: a Q4_0 file's
# blocks are int4's, carried; the files of other 4-bit-or-less types (Q4_1, Q2_K..Q4_K_M, IQ4_NL,
# IQ4_XS) are requantized, into nl4, whose error from the file's values is below int4's (the
# Q4_K_M fixture: 0.067 against 0.104); 5- and 6-bit files into int8
FILE_TYPE_FORMAT = {
    0: "f32",
    1: "f16",
    32: "bf16",
    7: "int8",
    2: "int4",
    3: "nl4",
    8: "int8",
    9: "int8",
    10: "nl4",
    11: "nl4",
    12: "nl4",
    13: "nl4",
    14: "nl4",
    15: "nl4",
    16: "int8",
    17: "int8",
    18: "int8",
    25: "nl4",
    30: "nl4",
    38: "mxfp4",
}
DEFAULT_FORMAT = "int8"
# a tensor whose GGUF type holds more than the file's 4 bits -> the Colibri format that keeps it,
# where convert is given no --quantize (a Q4_K_M file keeps its output, attn_v and half its
# ffn_down in Q6_K: they stay 6-bit, int6, instead of falling to the file's int4; Q8_0 is carried)
KEPT_PRECISION = {"Q8_0": "int8", "Q6_K": "int6", "Q5_K": "int6", "Q5_0": "int6", "Q5_1": "int6"}
ERROR_SAMPLE_ROWS = 256  # rows of each requantized tensor the reported error is measured on

_L = r"blk\.(\d+)\."
_LAYER = re.compile(_L)
_EXPERTS = "experts"
_GATE_UP = "gate_up"  # Gemma 4's merged [E, 2 * ff, d]: gate the first half of each expert's rows
# Gemma 4 first: llama.cpp's names of its sandwich norms, router and layer scalar
_GEMMA4_NAMES = [
    (re.compile(p), t)
    for p, t in [
        (_L + r"ffn_norm\.weight", "model.layers.{0}.pre_feedforward_layernorm.weight"),
        (_L + r"post_ffw_norm\.weight", "model.layers.{0}.post_feedforward_layernorm.weight"),
        (_L + r"post_ffw_norm_(1|2)\.weight", "model.layers.{0}.post_feedforward_layernorm_{1}.weight"),
        (_L + r"pre_ffw_norm_2\.weight", "model.layers.{0}.pre_feedforward_layernorm_2.weight"),
        (_L + r"layer_output_scale\.weight", "model.layers.{0}.layer_scalar"),
        (_L + r"ffn_gate_inp\.weight", "model.layers.{0}.router.proj.weight"),
        (_L + r"ffn_gate_inp\.scale", "model.layers.{0}.router.scale"),
        (_L + r"ffn_down_exps\.scale", "model.layers.{0}.router.per_expert_scale"),
        (_L + r"ffn_gate_up_exps\.weight", _GATE_UP),
        (r"rope_freqs\.weight", None),  # proportional RoPE's frequency factors: in the config instead
    ]
]
# GGUF tensor name -> transformers' (a template with the match's groups), or _EXPERTS (merged)
_NAMES = [
    (re.compile(p), t)
    for p, t in [
        (r"token_embd\.weight", "model.embed_tokens.weight"),
        (r"output_norm\.weight", "model.norm.weight"),
        (r"output\.weight", "lm_head.weight"),
        (_L + r"attn_norm\.weight", "model.layers.{0}.input_layernorm.weight"),
        (_L + r"ffn_norm\.weight", "model.layers.{0}.post_attention_layernorm.weight"),
        (_L + r"attn_(q|k|v)\.(weight|bias)", "model.layers.{0}.self_attn.{1}_proj.{2}"),
        (_L + r"attn_output\.(weight|bias)", "model.layers.{0}.self_attn.o_proj.{1}"),
        (_L + r"attn_(q|k)_norm\.weight", "model.layers.{0}.self_attn.{1}_norm.weight"),
        (_L + r"ffn_gate_inp\.(weight|bias)", "model.layers.{0}.mlp.gate.{1}"),
        (_L + r"post_attention_norm\.weight", "model.layers.{0}.post_attention_layernorm.weight"),
        (_L + r"attn_sinks\.weight", "model.layers.{0}.self_attn.sinks"),
        # DeepSeek-V3's latent attention (llama.cpp's deepseek2)
        (_L + r"attn_q_a\.weight", "model.layers.{0}.self_attn.q_a_proj.weight"),
        (_L + r"attn_q_b\.weight", "model.layers.{0}.self_attn.q_b_proj.weight"),
        (_L + r"attn_q_a_norm\.weight", "model.layers.{0}.self_attn.q_a_layernorm.weight"),
        (_L + r"attn_kv_a_mqa\.weight", "model.layers.{0}.self_attn.kv_a_proj_with_mqa.weight"),
        (_L + r"attn_kv_a_norm\.weight", "model.layers.{0}.self_attn.kv_a_layernorm.weight"),
        (_L + r"attn_kv_b\.weight", "model.layers.{0}.self_attn.kv_b_proj.weight"),
        (_L + r"attn_(k|v)_b\.weight", _KV_B),
        (_L + r"exp_probs_b\.bias", "model.layers.{0}.mlp.gate.e_score_correction_bias"),
        (_L + r"ffn_gate_inp_shexp\.weight", "model.layers.{0}.mlp.shared_expert_gate.weight"),
        (_L + r"ffn_(gate|up|down)_shexp\.weight", "model.layers.{0}.mlp.shared_expert.{1}_proj.weight"),
        (_L + r"nextn\..*", None),  # DeepSeek's multi-token-prediction head: not run
        (_L + r"ffn_(gate|up|down)_exps\.(weight|bias)", _EXPERTS),
        (_L + r"ffn_(gate|up|down)\.(\d+)\.weight", "model.layers.{0}.mlp.experts.{2}.{1}_proj.weight"),
        (_L + r"ffn_(gate|up|down)\.weight", "model.layers.{0}.mlp.{1}_proj.weight"),
    ]
]


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ColibriError(
            f"reading GGUF files needs the gguf package: pip install '{DISTRIBUTION}[gguf]' (or pip install gguf)"
        ) from None
    return gguf


def check_header(path: Path) -> tuple:
    """(version, tensor count, metadata count) of a GGUF file, each checked against the file's
    size before the rest is read (a count of 2^60 would have it loop or allocate)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(24)
    except OSError as e:
        raise ColibriError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(head) < 24 or head[:4] != GGUF_MAGIC:
        raise ColibriError(f"{path}: not a GGUF file (it does not start with the GGUF magic and header)")
    version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
    if version not in GGUF_VERSIONS:
        raise ColibriError(f"{path}: GGUF version {version} is not supported (versions {GGUF_VERSIONS})")
    if n_tensors > (size - 24) // MIN_TENSOR_INFO_BYTES or n_kv > (size - 24) // MIN_KV_BYTES:
        raise ColibriError(
            f"{path}: the header counts {n_tensors} tensors and {n_kv} metadata entries, more than "
            f"a file of {size} bytes can hold (truncated or damaged)"
        )
    return version, n_tensors, n_kv


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple  # GGUF's order, innermost first: [in, out] for a matrix
    data: np.ndarray  # a view of the file: elements [*reversed(shape)] (F32, F16, ...), else bytes [..., row bytes]


class _Array(NamedTuple):  # a metadata array not read yet
    item_type: int
    count: int
    at: int  # its first item's byte


class GGUFFile:
    """A GGUF file's metadata and tensor table, read as llama.cpp's gguf.cpp reads them and refused
    where it refuses them; every length, count, dimension and offset is checked against the bytes
    left before anything is read or allocated from it, so a lying file is one error, at once.

    meta: {key: value}: str, int, float, bool, or a list for an array -- after `read_arrays`;
    before, an array is an _Array and `count(key)` its length, so that a million-token vocabulary
    can be refused by its count. tensors: {name: GGUFTensor}, views of the file's mapping."""

    def __init__(self, path: Path, gguf):
        self.root = path
        try:
            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise ColibriError(f"{path}: cannot map the file: {getattr(e, 'strerror', None) or e}") from None
        self.size, self.at = len(self._map), 24
        _, n_tensors, n_kv = struct.unpack_from("<IQQ", self._map, 4)  # checked by check_header
        self.meta = {}
        for i in range(n_kv):
            key = self._string(f"metadata key {i}")
            if key in self.meta:
                self._fail(f"metadata key {shown(key, 80)} appears twice (llama.cpp refuses such a file too)")
            self.meta[key] = self._value(key, self._scalar(GGUF_UINT32, f"metadata {shown(key, 80)}"))
        alignment = self.meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if alignment <= 0 or alignment & (alignment - 1):
            self._fail(f"metadata general.alignment is {alignment}, not a power of 2")
        table = [self._tensor_info(i, gguf) for i in range(n_tensors)]
        start = -self.at % alignment + self.at  # the data section: aligned after the table
        base = np.frombuffer(self._map, np.uint8)
        self.tensors, end = {}, 0
        for name, qtype, dims, offset, nbytes in table:
            if name in self.tensors:
                self._fail(f"tensor {shown(name)} appears twice (llama.cpp refuses such a file too)")
            if offset != end:
                self._fail(
                    f"tensor {shown(name)} is at byte {offset} of the data section, but the tensors before it "
                    f"end at {end} (llama.cpp expects them packed in order and refuses such a file too)"
                )
            if nbytes > self.size - start - offset:
                self._fail(
                    f"tensor {shown(name)} ({qtype.name}, {list(dims)}) cannot be read: it claims {nbytes} bytes at byte "
                    f"{start + offset} but {max(0, self.size - start - offset)} bytes are left (truncated or damaged)"
                )
            end = offset + -nbytes % alignment + nbytes
            self.tensors[name] = GGUFTensor(name, qtype, dims, _view(base, start + offset, nbytes, qtype, dims, gguf))

    def _fail(self, what: str):
        raise ColibriError(f"{self.root}: {what}")

    def _take(self, n: int, what: str) -> int:
        """The offset of the next n bytes, which `what` claims; the cursor moves past them."""
        at = self.at
        if n > self.size - at:
            self._fail(f"{what} claims {n} bytes at byte {at} but {self.size - at} are left (truncated or damaged)")
        self.at = at + n
        return at

    def _scalar(self, value_type: int, what: str):
        dtype = np.dtype(VALUE_DTYPES[value_type])
        return np.frombuffer(self._map, dtype, 1, self._take(dtype.itemsize, what)).tolist()[0]

    def _string(self, what: str, limit: int | None = None) -> str:
        n = self._scalar(GGUF_UINT64, what)
        if limit is not None and n >= limit:
            self._fail(f"{what} is {n} bytes long, llama.cpp's limit is {limit - 1}")
        at = self._take(n, what)
        try:
            return self._map[at : at + n].decode("utf-8")
        except UnicodeDecodeError as e:
            self._fail(f"{what} is not valid UTF-8 (byte {at + e.start})")

    def _value(self, key: str, value_type: int):
        what = f"metadata {shown(key, 80)}"
        if key == "general.alignment" and value_type != GGUF_UINT32:
            self._fail(f"metadata general.alignment has value type {value_type}; llama.cpp reads it as a uint32 (4)")
        if value_type == GGUF_STRING:
            return self._string(what)
        if value_type in VALUE_DTYPES:
            return self._scalar(value_type, what)
        if value_type != GGUF_ARRAY:
            self._fail(f"{what} has value type {value_type}, not a GGUF type (0 to 12)")
        item_type, count = self._scalar(GGUF_UINT32, what), self._scalar(GGUF_UINT64, what)
        if item_type not in VALUE_DTYPES and item_type != GGUF_STRING:
            self._fail(
                f"{what} is an array of value type {item_type}, "
                + (
                    "arrays of arrays are not read (llama.cpp refuses them too)"
                    if item_type == GGUF_ARRAY
                    else "not a GGUF type"
                )
            )
        least = 8 if item_type == GGUF_STRING else np.dtype(VALUE_DTYPES[item_type]).itemsize
        left = self.size - self.at
        if count > left // least:
            self._fail(
                f"metadata array {shown(key, 80)} claims {count} elements "
                f"({'at least 8' if item_type == GGUF_STRING else least} bytes each) but {left} bytes are left "
                f"(truncated or damaged)"
            )
        array = _Array(item_type, count, self.at)
        if item_type != GGUF_STRING:
            self.at += count * least
            return array
        buf, at, size = self._map, self.at, self.size  # strings: each length checked, nothing read yet
        for i in range(count):
            if 8 > size - at:
                self._fail(f"{what}[{i}] claims 8 bytes at byte {at} but {size - at} are left (truncated or damaged)")
            (n,) = struct.unpack_from("<Q", buf, at)
            if n > size - at - 8:
                self._fail(
                    f"{what}[{i}] claims {n} bytes at byte {at + 8} but {size - at - 8} are left (truncated or damaged)"
                )
            at += 8 + n
        self.at = at
        return array

    def _tensor_info(self, i: int, gguf) -> tuple:
        name = self._string(f"the name of tensor {i}", GGML_MAX_NAME)
        what = f"tensor {shown(name)}"
        n_dims = self._scalar(GGUF_UINT32, what)
        if n_dims > GGML_MAX_DIMS:
            self._fail(f"{what} claims {n_dims} dimensions; a GGUF tensor has at most {GGML_MAX_DIMS}")
        dims = struct.unpack_from(f"<{n_dims}Q", self._map, self._take(8 * n_dims, what))
        code, offset = self._scalar(GGUF_UINT32, what), self._scalar(GGUF_UINT64, what)
        try:
            qtype = gguf.GGMLQuantizationType(code)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            self._fail(f"{what} has type {code}, not a GGML tensor type the gguf package knows")
        if not all(dims):
            self._fail(f"{what} has shape {list(dims)}: no elements")
        row = dims[0] if dims else 1
        if row % block:
            self._fail(f"{what} ({qtype.name}) has rows of {row} elements, not a multiple of its blocks of {block}")
        return name, qtype, dims, offset, math.prod(dims) // block * type_size

    def count(self, key: str):
        """The number of elements of a metadata array (None: no such array)."""
        v = self.meta.get(key)
        return v.count if type(v) is _Array else len(v) if type(v) is list else None

    def read_arrays(self) -> None:
        """The metadata arrays as lists (strings checked to be UTF-8)."""
        for key, v in self.meta.items():
            if type(v) is not _Array:
                continue
            if v.item_type != GGUF_STRING:
                self.meta[key] = np.frombuffer(self._map, VALUE_DTYPES[v.item_type], v.count, v.at).tolist()
                continue
            out, buf, at = [], self._map, v.at
            for i in range(v.count):
                (n,) = struct.unpack_from("<Q", buf, at)
                try:
                    out.append(buf[at + 8 : at + 8 + n].decode("utf-8"))
                except UnicodeDecodeError as e:
                    self._fail(f"metadata {shown(key, 80)}[{i}] is not valid UTF-8 (byte {at + 8 + e.start})")
                at += 8 + n
            self.meta[key] = out


def _view(base: np.ndarray, at: int, nbytes: int, qtype, dims: tuple, gguf) -> np.ndarray:
    """A tensor's bytes as gguf's reader presents them: elements [*reversed(dims)] for the float
    and integer types, [..., row bytes] for the block types."""
    raw = base[at : at + nbytes]
    shape = tuple(reversed(dims))
    if qtype.name in ELEMENT_DTYPES:
        return raw.view(ELEMENT_DTYPES[qtype.name]).reshape(shape)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    shape = shape or (1,)
    return raw.reshape(shape[:-1] + (shape[-1] // block * type_size,))


def _check_vocabulary_count(parsed: GGUFFile) -> None:
    """More tokens than the embedding has rows: ids the model cannot embed (llama.cpp wants the two
    equal). Checked from the array's count, before its strings are read."""
    n = parsed.count("tokenizer.ggml.tokens")
    embedding = parsed.tensors.get("token_embd.weight")
    if n is not None and embedding is not None and len(embedding.shape) == 2 and n > embedding.shape[1]:
        raise ColibriError(
            f"{parsed.root}: tokenizer.ggml.tokens has {n} tokens but token_embd.weight has "
            f"{embedding.shape[1]} rows (the model's vocabulary): the file is inconsistent"
        )


class GGUFCheckpoint:
    """A .gguf model file with HFCheckpoint's interface (module docstring)."""

    def __init__(self, path):
        self.root = Path(path)
        self.config_source = f"{self.root} (GGUF metadata)"
        if not self.root.is_file():
            raise ColibriError(f"GGUF file {self.root} does not exist or is not a file")
        check_header(self.root)
        parsed = GGUFFile(self.root, _gguf())
        tensors = parsed.tensors
        _check_vocabulary_count(parsed)  # before a million tokens are read
        parsed.read_arrays()
        self.meta = parsed.meta
        self.last_read_type = None
        self.arch = self._meta_str("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ColibriError(
                f"{self.root}: architecture {shown(self.arch)} is not supported for GGUF import; "
                f"supported: {', '.join(ARCHITECTURES)} (llama with experts: Mixtral)"
            )
        self._tensors = {}  # our HF name -> (GGUF tensor, expert index or None, row order or None)
        self._kv_b = {}  # layer -> {"k": attn_k_b, "v": attn_v_b}
        self._map_names(tensors)
        for layer, parts in self._kv_b.items():
            if set(parts) != {"k", "v"}:
                raise ColibriError(
                    f"{self.root}: blk.{layer} has attn_{'k' if 'k' in parts else 'v'}_b without "
                    f"attn_{'v' if 'k' in parts else 'k'}_b"
                )
        self.config = self._hf_config(tensors)

    # -- metadata --
    def _meta_str(self, key):
        v = self.meta.get(key)
        if type(v) is not str:
            raise ColibriError(f"{self.root}: metadata {key} must be a string, got {shown(v)}")
        return v

    def _arch_key(self, key, default=None, kind=(int,)):
        full = f"{self.arch}.{key}"
        v = self.meta.get(full, default)
        if v is default:
            return v
        if type(v) not in kind:
            raise ColibriError(
                f"{self.root}: metadata {full} must be {'a number' if float in kind else 'an integer'}, got {shown(v)}"
            )
        return v

    def _kv_heads(self, heads):
        """attention.head_count_kv: one count, or one per layer (Gemma 4): the first here."""
        kv = self.meta.get(f"{self.arch}.attention.head_count_kv", heads)
        if type(kv) is list and kv and all(type(k) is int for k in kv):
            return kv[0]
        if type(kv) is not int:
            raise ColibriError(
                f"{self.root}: metadata {self.arch}.attention.head_count_kv must be an integer or a "
                f"list of them, got {shown(kv)}"
            )
        return kv

    def _hf_config(self, tensors) -> dict:
        heads = self._arch_key("attention.head_count")
        blocks = self._arch_key("block_count")
        if heads is None or blocks is None or self._arch_key("embedding_length") is None:
            raise ColibriError(
                f"{self.root}: metadata lacks {self.arch}.block_count / embedding_length / "
                f"attention.head_count (not a model file: a vocabulary-only GGUF?)"
            )
        embedding = tensors.get("token_embd.weight")
        if embedding is None:
            raise ColibriError(f"{self.root}: no token_embd.weight tensor")
        experts = self._arch_key("expert_count", 0)
        if not experts:
            raise ColibriError(
                f"{self.root}: {self.arch}.expert_count is absent or 0: a dense model; Colibri runs "
                f"mixture-of-experts models"
            )
        # a layer count beyond the file's blk.N would be looped over (10^9: minutes, gigabytes); DeepSeek's
        # multi-token-prediction layers are counted whether their tensors were kept or left out
        layers = len({int(m[1]) for m in map(_LAYER.match, tensors) if m})
        nextn = self._arch_key("nextn_predict_layers", 0) if self.arch == "deepseek2" else 0
        if type(blocks) is int and blocks > layers + (nextn if 0 <= nextn <= layers else 0):
            raise ColibriError(
                f"{self.root}: metadata {self.arch}.block_count is {blocks} but the file has tensors for "
                f"{layers} layers (blk.N); the metadata is damaged"
            )
        num = (int, float)
        cfg = {
            "architectures": [ARCHITECTURES[self.arch]],
            "hidden_size": self._arch_key("embedding_length"),
            "num_hidden_layers": blocks,
            "num_attention_heads": heads,
            "num_key_value_heads": self._kv_heads(heads),
            "rms_norm_eps": self._arch_key("attention.layer_norm_rms_epsilon", 1e-6, num),
            "rope_theta": self._arch_key("rope.freq_base", 10000.0, num),
            "max_position_embeddings": self._arch_key("context_length", 4096),
            "vocab_size": int(embedding.shape[1]) if len(embedding.shape) == 2 else 0,
            "tie_word_embeddings": "output.weight" not in tensors,
            "num_experts_per_tok": self._arch_key("expert_used_count"),
            "norm_topk_prob": NORM_TOPK.get(self.arch),  # deepseek2: from its metadata
            "bos_token_id": self.meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.meta.get("tokenizer.ggml.eos_token_id"),
        }
        head_dim = self._arch_key("attention.key_length")
        if head_dim is not None:
            cfg["head_dim"] = head_dim
        rotary = self._arch_key("rope.dimension_count")
        width = head_dim or (cfg["hidden_size"] // heads if heads else 0)
        if rotary is not None and width and rotary != width:
            cfg["partial_rotary_factor"] = rotary / width
        scaling = self.meta.get(f"{self.arch}.rope.scaling.type")
        if scaling not in (None, "none"):
            cfg["rope_scaling"] = {"rope_type": scaling, "factor": self._arch_key("rope.scaling.factor", None, num)}
            if scaling == "yarn":
                cfg["rope_scaling"]["original_max_position_embeddings"] = self._arch_key(
                    "rope.scaling.original_context_length"
                )
        ffn = self._arch_key("feed_forward_length", 0)
        expert_ffn = self._arch_key("expert_feed_forward_length", 0) or ffn
        dense = [
            i for i in range(blocks if type(blocks) is int else 0) if f"blk.{i}.ffn_gate_inp.weight" not in tensors
        ]
        if self.arch == "deepseek2":
            self._deepseek(cfg, tensors, heads, experts, ffn, expert_ffn, rotary)
        elif self.arch == "gemma4":
            self._gemma4(cfg, tensors, blocks, experts, ffn, expert_ffn)
        elif self.arch == "llama":
            cfg.update(num_local_experts=experts, intermediate_size=expert_ffn)
        elif self.arch == "gpt-oss":
            cfg.pop("rope_scaling", None)
            cfg.update(
                num_local_experts=experts,
                intermediate_size=expert_ffn,
                attention_bias=True,
                sliding_window=self._arch_key("attention.sliding_window"),
                layer_types=self._layer_types(blocks),
                **GPT_OSS_SWIGLU,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": cfg.pop("rope_theta"),
                    "truncate": False,
                    "factor": self._arch_key("rope.scaling.factor", 32.0, num),
                    "original_max_position_embeddings": self._arch_key("rope.scaling.original_context_length", 4096),
                    "beta_fast": self._arch_key("rope.scaling.yarn_beta_fast", 32.0, num),
                    "beta_slow": self._arch_key("rope.scaling.yarn_beta_slow", 1.0, num),
                },
            )
        elif self.arch == "olmoe":
            cfg.update(
                num_experts=experts,
                intermediate_size=expert_ffn,
                clip_qkv=self._arch_key("attention.clamp_kqv", None, num),
            )
        else:  # qwen2moe, qwen3moe
            cfg.update(
                num_experts=experts, moe_intermediate_size=expert_ffn, intermediate_size=ffn, mlp_only_layers=dense
            )
            if self.arch == "qwen2moe":
                cfg.update(
                    shared_expert_intermediate_size=self._arch_key("expert_shared_feed_forward_length", 0),
                    qkv_bias="blk.0.attn_q.bias" in tensors,
                )
            else:
                cfg["attention_bias"] = "blk.0.attn_q.bias" in tensors
        return {k: v for k, v in cfg.items() if v is not None}

    def _deepseek(self, cfg, tensors, heads, experts, ffn, expert_ffn, rope) -> None:
        """DeepSeek-V3 / Kimi K2 (llama.cpp's deepseek2): transformers' DeepseekV3Config from the
        MLA dimensions (key_length_mla / value_length_mla, or key_length / value_length in files
        before them), the grouped sigmoid router, YaRN with mscale from yarn_log_multiplier
        (= 0.1 * mscale_all_dim). Its RoPE pairs are the checkpoint's interleaved ones: llama.cpp
        rotates adjacent pairs and stores the rows as they came."""
        num = (int, float)
        gating = self._arch_key("expert_gating_func")
        has_bias = any(n.endswith("exp_probs_b.bias") for n in tensors)
        if gating == GATING_SOFTMAX or (gating is None and not has_bias):
            raise ColibriError(
                f"{self.root}: softmax expert gating (DeepSeek-V2 / V2.5) is not supported; "
                f"DeepSeek-V3's sigmoid router with its correction bias is"
            )
        if gating not in (None, GATING_SIGMOID):
            raise ColibriError(f"{self.root}: metadata {self.arch}.expert_gating_func {shown(gating)} is not supported")
        key = self._arch_key("attention.key_length_mla") or self._arch_key("attention.key_length")
        value = self._arch_key("attention.value_length_mla") or self._arch_key("attention.value_length")
        if key is None or value is None or rope is None:
            raise ColibriError(
                f"{self.root}: metadata lacks {self.arch}.attention.key_length(_mla) / value_length(_mla) "
                f"/ rope.dimension_count"
            )
        for k in ("head_dim", "partial_rotary_factor"):
            cfg.pop(k, None)
        nextn = self._arch_key("nextn_predict_layers", 0)
        cfg.update(
            num_hidden_layers=cfg["num_hidden_layers"] - nextn,
            num_nextn_predict_layers=nextn,
            num_key_value_heads=heads,
            n_routed_experts=experts,
            moe_intermediate_size=expert_ffn,
            intermediate_size=ffn,
            n_shared_experts=self._arch_key("expert_shared_count", 0),
            routed_scaling_factor=self._arch_key("expert_weights_scale", 1.0, num),
            norm_topk_prob=self.meta.get(f"{self.arch}.expert_weights_norm", False) is True,
            n_group=self._arch_key("expert_group_count", 1),
            topk_group=self._arch_key("expert_group_used_count", 1),
            first_k_dense_replace=self._arch_key("leading_dense_block_count", 0),
            q_lora_rank=self._arch_key("attention.q_lora_rank", 0) or None,
            kv_lora_rank=self._arch_key("attention.kv_lora_rank"),
            qk_rope_head_dim=rope,
            qk_nope_head_dim=key - rope,
            v_head_dim=value,
            rope_interleave=True,
        )
        scaling = cfg.get("rope_scaling")
        if scaling is not None and scaling.get("rope_type") == "yarn":
            multiplier = self._arch_key("rope.scaling.yarn_log_multiplier", None, num)
            scaling.update(
                beta_fast=self._arch_key("rope.scaling.yarn_beta_fast", 32.0, num),
                beta_slow=self._arch_key("rope.scaling.yarn_beta_slow", 1.0, num),
            )
            if multiplier:
                scaling.update(mscale=round(multiplier / 0.1, 6), mscale_all_dim=round(multiplier / 0.1, 6))

    def _gemma4(self, cfg, tensors, blocks, experts, ffn, expert_ffn) -> None:
        """Gemma 4 with its MoE block: transformers' Gemma4TextConfig from llama.cpp's keys. The
        sliding layers' head size is key_length_swa, the full layers' key_length (per_layer_config);
        key/value heads per layer from head_count_kv (an array); the full layers' proportional RoPE
        fraction from rope_freqs (llama.cpp's factors: 1 for the rotated pairs, 1e30 for the rest),
        else from rope.dimension_count."""
        types = self._layer_types(blocks)
        kv = self.meta.get(f"{self.arch}.attention.head_count_kv")
        kv = kv if type(kv) is list and len(kv) == blocks else [cfg["num_key_value_heads"]] * blocks
        swa_dim = self._arch_key("attention.key_length_swa") or cfg.get("head_dim")
        full_dim = self._arch_key("attention.key_length") or swa_dim
        if swa_dim is None or any(type(k) is not int for k in kv):
            raise ColibriError(f"{self.root}: metadata lacks {self.arch}.attention.key_length_swa / head_count_kv")
        base = next((i for i, t in enumerate(types) if t == "sliding_attention"), 0)
        per_layer = {
            str(i): {"head_dim": full_dim if t == "full_attention" else swa_dim, "num_key_value_heads": kv[i]}
            for i, t in enumerate(types)
            if (full_dim if t == "full_attention" else swa_dim, kv[i]) != (swa_dim, kv[base])
        }
        freqs = tensors.get("rope_freqs.weight")
        rotary = self._arch_key("rope.dimension_count") or full_dim
        if freqs is not None:
            factors = np.asarray(freqs.data, np.float32).reshape(-1)
            fraction = float(np.count_nonzero(factors == 1.0)) / max(1, factors.size)
        else:
            fraction = rotary / full_dim
        for k in ("head_dim", "partial_rotary_factor", "rope_scaling", "num_experts_per_tok", "norm_topk_prob"):
            cfg.pop(k, None)
        full_v = [f"blk.{i}.attn_v.weight" in tensors for i, t in enumerate(types) if t == "full_attention"]
        cfg.update(
            head_dim=swa_dim,
            num_key_value_heads=kv[base],
            per_layer_config=per_layer,
            layer_types=types,
            sliding_window=self._arch_key("attention.sliding_window"),
            enable_moe_block=True,
            num_experts=experts,
            top_k_experts=self._arch_key("expert_used_count"),
            moe_intermediate_size=expert_ffn,
            intermediate_size=ffn,
            attention_k_eq_v=bool(full_v) and not any(full_v),
            final_logit_softcapping=self._arch_key("final_logit_softcapping", None, (int, float)),
            hidden_size_per_layer_input=self._arch_key("embedding_length_per_layer_input", 0),
            num_kv_shared_layers=self._arch_key("attention.shared_kv_layers", 0),
            rope_parameters={
                "sliding_attention": {
                    "rope_type": "default",
                    "rope_theta": self._arch_key("rope.freq_base_swa", 10000.0, (int, float)),
                },
                "full_attention": {
                    "rope_type": "proportional",
                    "partial_rotary_factor": fraction,
                    "rope_theta": cfg.pop("rope_theta"),
                },
            },
        )

    def _layer_types(self, blocks) -> list:
        """Sliding or full attention per layer, as llama.cpp's load_swa_pattern reads them: the
        {arch}.attention.sliding_window_pattern array (true: sliding), or its period (default 2:
        every layer but the last of each period slides, so layer 0 does)."""
        pattern = self.meta.get(f"{self.arch}.attention.sliding_window_pattern", 2)
        n = blocks if type(blocks) is int else 0
        if type(pattern) is list and len(pattern) == n and all(type(x) is bool for x in pattern):
            sliding = pattern
        elif type(pattern) is int and pattern >= 1:
            sliding = [i % pattern < pattern - 1 for i in range(n)]
        else:
            raise ColibriError(
                f"{self.root}: metadata {self.arch}.attention.sliding_window_pattern must be a period "
                f"or {n} booleans, got {shown(pattern)}"
            )
        return ["sliding_attention" if s else "full_attention" for s in sliding]

    # -- tensors --
    def _map_names(self, tensors) -> None:
        heads = self._arch_key("attention.head_count")
        kv_heads = self._arch_key("attention.head_count_kv", heads) if self.arch == "llama" else None
        names = (_GEMMA4_NAMES if self.arch == "gemma4" else []) + _NAMES
        for name, t in tensors.items():
            for pattern, template in names:
                m = pattern.fullmatch(name)
                if m is None:
                    continue
                if template is None:
                    break
                if template is _KV_B:
                    self._kv_b.setdefault(int(m[1]), {})[m[2]] = t
                    self._tensors[f"model.layers.{m[1]}.self_attn.kv_b_proj.weight"] = (None, int(m[1]), _KV_B)
                    break
                if template is _GATE_UP:
                    shape = tuple(reversed([int(d) for d in t.shape]))  # [E, 2 * ff, d]
                    if len(shape) != 3 or shape[1] % 2:
                        raise ColibriError(
                            f"{self.root}: tensor {name} has shape {list(shape)}; merged gate/up "
                            f"experts are [experts, 2 x ff, in]"
                        )
                    ff = shape[1] // 2
                    for e in range(shape[0]):
                        for part, rows in (("gate", np.arange(ff)), ("up", np.arange(ff, 2 * ff))):
                            self._tensors[f"model.layers.{m[1]}.mlp.experts.{e}.{part}_proj.weight"] = (t, e, rows)
                    break
                if template is _EXPERTS:
                    shape = tuple(reversed([int(d) for d in t.shape]))  # [E, out, in] / [E, out]
                    if len(shape) != (3 if m[3] == "weight" else 2):
                        raise ColibriError(
                            f"{self.root}: tensor {name} has shape {list(shape)}; merged experts are "
                            f"[experts, out, in] (biases [experts, out])"
                        )
                    for e in range(shape[0]):
                        self._tensors[f"model.layers.{m[1]}.mlp.experts.{e}.{m[2]}_proj.{m[3]}"] = (t, e, None)
                else:
                    hf = template.format(*m.groups())
                    if self.arch == "gpt-oss":
                        hf = hf.replace(".mlp.gate.", ".mlp.router.")
                    order = None
                    if (
                        self.arch == "llama"
                        and m.groups()[1:2] in (("q",), ("k",))
                        and "attn_" in name
                        and not name.endswith("_norm.weight")
                    ):
                        order = _unpermuted_rows(int(t.shape[-1]), heads if m[2] == "q" else kv_heads, self.root, name)
                    self._tensors[hf] = (t, None, order)
                break
            else:
                raise ColibriError(
                    f"{self.root}: tensor {shown(name, 120)} is not understood for GGUF architecture {self.arch}"
                )

    def names(self) -> list:
        return sorted(self._tensors)

    def shape(self, name: str) -> tuple:
        t, expert, order = self._tensors[name]
        if order is _KV_B:  # [H * (nope + v), R]
            k, v = (
                tuple(reversed([int(d) for d in p.shape])) for p in (self._kv_b[expert]["k"], self._kv_b[expert]["v"])
            )
            return (k[0] * (k[2] + v[1]), k[1]) if len(k) == len(v) == 3 else k + v
        shape = tuple(reversed([int(d) for d in t.shape]))
        shape = shape[1:] if expert is not None else shape
        return (len(order),) + shape[1:] if order is not None else shape

    def gguf_type(self, name: str) -> str:
        t, expert, order = self._tensors[name]
        return (self._kv_b[expert]["k"] if order is _KV_B else t).tensor_type.name

    def _kv_b_proj(self, layer: int) -> np.ndarray:
        """transformers' kv_b_proj [H * (nope + v), R] from llama.cpp's attn_k_b [H, R, nope] (each
        head's key rows transposed) and attn_v_b [H, v, R]."""
        k = self._read(self._kv_b[layer]["k"], None)
        v = self._read(self._kv_b[layer]["v"], None)
        k = k.f32() if isinstance(k, quant.StoredMatrix) else k
        v = v.f32() if isinstance(v, quant.StoredMatrix) else v
        if k.ndim != 3 or v.ndim != 3 or k.shape[0] != v.shape[0] or k.shape[1] != v.shape[2]:
            raise ColibriError(
                f"{self.root}: blk.{layer}.attn_k_b {list(k.shape)} and attn_v_b {list(v.shape)} do not "
                f"fit together ([heads, rank, nope] and [heads, v, rank])"
            )
        H, R = k.shape[:2]
        return np.concatenate([k.transpose(0, 2, 1), v], axis=1).reshape(-1, R)

    def f32(self, name: str):
        """float32 values, or a quant.StoredMatrix for a Q8_0/Q4_0/MXFP4/F16/BF16 matrix (kept as it is)."""
        t, expert, order = self._tensors[name]
        if order is _KV_B:
            self.last_read_type = self.gguf_type(name)
            return self._kv_b_proj(expert)
        self.last_read_type = t.tensor_type.name  # for convert's requantization report
        return self._read(t, expert, order)

    def _read(self, t, expert, order=None):
        """Tensor t (expert `expert` of a merged one), its rows in `order` (a selection or a
        permutation of them; None: all, as stored)."""
        kind = t.tensor_type.name
        data = t.data if expert is None else t.data[expert]
        shape = tuple(reversed([int(d) for d in t.shape]))[1 if expert is not None else 0 :]
        try:
            if kind in ("Q8_0", "Q4_0", "MXFP4") and len(shape) == 2:
                fmt = CARRIED[kind]
                rows = _copied(data).reshape(shape[0], -1)  # [rows, row bytes]
                if kind == "MXFP4":
                    rows = _mxfp4_from_ggml(rows)
                return quant.StoredMatrix(rows if order is None else rows[order], fmt, shape[1])
            if kind in ("F16", "BF16") and len(shape) == 2:
                rows = _copied(data).view("<u2").reshape(shape)
                return quant.StoredMatrix(rows if order is None else rows[order], CARRIED[kind], shape[1])
            if kind == "F32":
                values = _copied(data)
            elif kind == "F16":
                values = to_f32(np.asarray(data), "f16")
            elif kind == "BF16":
                values = to_f32(np.asarray(data).view("<u2"), "bf16")
            else:
                values = _gguf().quants.dequantize(_copied(data), t.tensor_type).astype(np.float32)
            values = values.reshape(shape)
        except ColibriError:
            raise
        except Exception as e:  # noqa: BLE001 - gguf's dequantizer on an unknown or damaged type
            raise ColibriError(
                f"{self.root}: tensor {t.name} ({kind}) cannot be read: {type(e).__name__}: {str(e)[:200]}"
            ) from None
        return values if order is None else values[order]

    # -- what convert needs besides --
    def default_format(self) -> str:
        """The Colibri format closest to what the file holds (general.file_type), else int8."""
        return FILE_TYPE_FORMAT.get(self.meta.get("general.file_type"), DEFAULT_FORMAT)

    def kept_formats(self, sources: dict, default: str) -> dict:
        """{our tensor: format} for the matrices whose GGUF type holds more than `default` keeps
        (KEPT_PRECISION, where it is not `default` itself); sources: our name -> the name this
        checkpoint reads it by (convert.plan_tensors)."""
        out = {}
        for name, src in sources.items():
            fmt = KEPT_PRECISION.get(self.gguf_type(src))
            if fmt is not None and fmt != default and len(self.shape(src)) == 2 and (fmt, default) != ("int6", "int8"):
                out[name] = fmt
        return out

    @staticmethod
    def requantized(gguf_type: str | None, dtype: str) -> bool:
        """Is a tensor quantized in the file as `gguf_type` stored as `dtype` at a loss: a type
        Colibri has no format for, or another quantized format than its own?"""
        return gguf_type not in (None, "F32", "F16", "BF16") and CARRIED.get(gguf_type) != dtype

    def write_text_files(self, where: Path, vocab_size: int) -> list:
        """The tokenizer, chat template and generation config from the metadata, as files in
        `where`; returns their names."""
        tokenizer_meta = {k: v for k, v in self.meta.items() if k.startswith("tokenizer.")}
        tokenizer_meta["general.architecture"] = self.arch
        if "tokenizer.ggml.model" not in tokenizer_meta:
            return []  # no vocabulary: raw token ids
        from .gguf_vocab import tokenizer_files

        files = tokenizer_files(tokenizer_meta, str(self.root))

        def token(key):
            v = self.meta.get(f"tokenizer.ggml.{key}")
            return v if type(v) is int and 0 <= v < vocab_size else None

        # generation stops where llama.cpp's does: at end of text, and at the end of a turn or a
        # message where the file names those tokens (eot / eom: a chat model's <|im_end|>, <|eot_id|>)
        stops = list(
            dict.fromkeys(t for t in map(token, ("eos_token_id", "eot_token_id", "eom_token_id")) if t is not None)
        )
        generation = {
            k: v
            for k, v in (
                ("bos_token_id", token("bos_token_id")),
                ("eos_token_id", stops[0] if len(stops) == 1 else stops or None),
            )
            if v is not None
        }
        if generation:
            files["generation_config.json"] = json.dumps(generation, indent=1) + "\n"
        for name, text in files.items():
            (Path(where) / name).write_text(text, encoding="utf-8")
        return sorted(files)


def _copied(data: np.ndarray) -> np.ndarray:
    """A copy of a tensor's bytes in the file mapping, whose pages then leave this process (as
    hfcheckpoint.to_f32 does): importing a GGUF larger than the RAM keeps one tensor resident."""
    out = np.array(data)
    if data.size:
        _os.release([(data.ctypes.data, data.nbytes)])
    return out


def _mxfp4_from_ggml(rows: np.ndarray) -> np.ndarray:
    """GGML's MXFP4 blocks -> Colibri's, losslessly: the same e8m0 byte and codes (GGML's
    kvalues_mxfp4 are the doubled e2m1 values with the scale halved: the same numbers), but GGML
    keeps element j in the low nibble of byte j and element j + 16 in its high one, where Colibri
    (gpt-oss's checkpoints) keeps elements 2j and 2j + 1."""
    blocks = np.ascontiguousarray(rows).view(quant.BLOCK_DTYPES["mxfp4"]).copy()  # [rows, nb]
    qs = blocks["qs"]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # element order
    blocks["qs"] = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.view(np.uint8).reshape(rows.shape)


def _unpermuted_rows(rows: int, heads, root, name) -> np.ndarray:
    """The row order that undoes convert_hf_to_gguf.py's LlamaModel.permute on a q/k projection
    of `rows` rows ([heads, 2, head_dim / 2] -> [heads, head_dim / 2, 2])."""
    if type(heads) is not int or heads <= 0 or rows % (2 * heads):
        raise ColibriError(
            f"{root}: tensor {name} has {rows} rows, not a whole number of {shown(heads)} heads of even size"
        )
    permuted = np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(rows)
    return np.argsort(permuted)


def requantization_error(values: np.ndarray, dtype: str) -> float:
    """The relative RMS error of storing `values` (a GGUF tensor's dequantized values) as
    `dtype`: ||stored - values|| / ||values||, over its first ERROR_SAMPLE_ROWS rows."""
    from .modeldir import from_storage, to_storage

    if isinstance(values, quant.StoredMatrix):
        values = values.rows(slice(0, ERROR_SAMPLE_ROWS)).f32()
    v = np.asarray(values, np.float32)[:ERROR_SAMPLE_ROWS]
    if (dtype in quant.BLOCK_DTYPES or dtype == "nl4") and v.ndim == 2 and v.shape[1] % quant.QBLOCK == 0:
        back = quant.dequantize(quant.quantize(v, dtype), dtype, v.shape[1])
    elif dtype in ("f16", "bf16"):
        back = from_storage(to_storage(v, dtype), dtype)
    else:
        return 0.0
    norm = float(np.linalg.norm(v))
    return float(np.linalg.norm(back - v)) / norm if norm else 0.0
