"""`python -m colibri calibrate`: activation statistics for importance-weighted quantization.

Design
------
The model runs a text (cut into chunks of `ctx` tokens as `eval` cuts them) with
Model(capture_inputs=True): every matrix product adds the squares of its input's columns to that
matrix's statistics (_engine.pyx, add_input_stats), so a routed expert sees only the tokens
routed to it, a dense matrix every token. What is kept per matrix is the mean square of each
input column, E[x_c^2], and the number of tokens it saw: the diagonal of the input's second
moment, which is what the output error of a rounded weight row costs,

    E[(w - w_q) . x]^2  ~  sum_c (w_c - w_q,c)^2 E[x_c^2]      (columns taken as uncorrelated),

the quantity llama.cpp's importance matrix (imatrix) holds too. `convert --importance FILE` hands
each matrix's vector to quant.quantize, which picks every block's scale to minimise that weighted
error (quant.py).

Second moments. The diagonal ignores that hidden states are strongly correlated. With
--second-moments, chosen matrices also collect their input's whole second moment H = E[x x^T]
(the engine adds the upper triangle of x x^T, cols^2 / 2 multiply-adds a token), and convert
rounds their columns in order, each one's error moved onto the columns not yet rounded
(colibri.gptq), which minimises the real output error E[((w - w_q) . x)^2] = (w - w_q)^T H (w - w_q).
Which matrices: "dense" every one outside the routed experts (attention, the head, shared experts,
dense layers: read for every token, and most of a small model's error), "all" the routed experts
too (an [cols, cols] per expert: for small models), "diag" none; "auto" (the default) is "dense"
as far as the float64 sums fit SECOND_MOMENT_BUDGET_MB (the head first, then the narrowest
inputs), the rest left to their diagonals, said in the log. Matrices that multiply the same input
(a layer's wq/wk/wv, an FFN's gate/up: SAME_INPUT) share one second moment, collected once.

The file is an .npz: "mean_sq/<tensor>" float32 [cols], "count/<tensor>" int64 [], "gram/<tensor>"
float32 [cols, cols] (the mean of x x^T, symmetric; only where collected, and only for the owner of
an input several matrices multiply: input_owner) and "meta" (JSON: the
model directory, its architecture, tokens, ctx, second_moments). Tensor names are Colibri's, the
names `convert` writes for the same architecture, whatever the format of the calibrated directory.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import zipfile
import zlib
from pathlib import Path

import numpy as np

from .errors import ColibriError

FORMAT = "colibri-importance-1"
MIN_TOKENS = 16  # fewer tokens than this give no statistics worth the name
SECOND_MOMENTS = ("auto", "diag", "dense", "all")
SECOND_MOMENT_BUDGET_MB = 4096  # "auto": the most float64 accumulators it collects before "diag"


def is_routed_expert(name: str) -> bool:
    """Is tensor `name` one routed expert's matrix (Colibri's names: layers.L.experts.E.part)?"""
    return ".experts." in name


# matrices that multiply the same input as another (every supported family): one second moment
# serves them all, collected on the owner's products only
SAME_INPUT = ((".wk", ".wq"), (".wv", ".wq"), (".up", ".gate"))
HEAD_NAMES = ("lm_head", "embedding")


def input_owner(name: str) -> str:
    """The tensor whose second moment stands for `name`'s (itself, or its layer's wq / its FFN's gate)."""
    for suffix, owner in SAME_INPUT:
        if name.endswith(suffix):
            return name[: -len(suffix)] + owner
    return name


def second_moment_names(shapes: dict, mode: str, log=None) -> tuple:
    """(the tensors that collect their whole second moment under `mode`, the mode it resolved to),
    from {tensor: shape} of the matrices a product reads. Only owners collect (input_owner). "auto"
    takes the matrices outside the routed experts, the head first and then the narrowest, while
    their float64 sums fit SECOND_MOMENT_BUDGET_MB, and says how many it left to their diagonals."""
    if mode not in SECOND_MOMENTS:
        raise ColibriError(f"--second-moments must be one of {', '.join(SECOND_MOMENTS)}, got {mode!r}")
    if mode == "diag":
        return frozenset(), mode
    owners = [
        n
        for n in shapes
        if (mode == "all" or not is_routed_expert(n)) and (input_owner(n) == n or input_owner(n) not in shapes)
    ]
    if mode != "auto":
        return frozenset(owners), mode
    owners.sort(key=lambda n: (n not in HEAD_NAMES, shapes[n][1], n))
    chosen, mb = [], 0.0
    for n in owners:
        size = shapes[n][1] ** 2 * 8 / 2**20
        if mb + size > SECOND_MOMENT_BUDGET_MB:
            break
        chosen.append(n)
        mb += size
    if len(chosen) < len(owners) and log:
        log(
            f"[INFO] whole second moments for {len(chosen)} of the {len(owners)} inputs outside the experts "
            f"({mb:.0f} MB of sums; the rest would pass {SECOND_MOMENT_BUDGET_MB} MB and keep their mean squares: "
            "--second-moments dense collects them all)"
        )
    return frozenset(chosen), "dense" if chosen else "diag"


def calibrate(
    model_dir,
    text: str,
    ctx: int = 512,
    max_tokens: int | None = None,
    threads: int | None = None,
    progress=None,
    second_moments: str = "auto",
    log=None,
) -> dict:
    """{"tensors": {tensor name: (mean_sq float32 [cols], tokens seen)}, "grams": {tensor name: mean
    of x x^T float32 [cols, cols]}, "meta": {...}} over `text` run through `model_dir`."""
    from .evaluate import MIN_CTX, chunks_of
    from .model import load

    if second_moments not in SECOND_MOMENTS:
        raise ColibriError(f"--second-moments must be one of {', '.join(SECOND_MOMENTS)}, got {second_moments!r}")
    resolved = [second_moments]

    def choose(shapes):
        names, resolved[0] = second_moment_names(shapes, second_moments, log)
        return names

    model = load(model_dir, threads=threads, capture_inputs=True, second_moments=choose)
    try:
        if model.tokenizer is None:
            raise ColibriError(
                f"{model.path} has no tokenizer (tokenizer.json or tokenizer.model): calibrate needs "
                "one to tokenize the text"
            )
        if not isinstance(ctx, int) or isinstance(ctx, bool) or not MIN_CTX <= ctx <= model.n_ctx:
            raise ColibriError(f"--ctx must be in {MIN_CTX}..{model.n_ctx}, got {ctx!r}")
        ids = model.tokenizer.encode(text, add_special_tokens=False)
        if max_tokens is not None:
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < MIN_TOKENS:
                raise ColibriError(f"--max-tokens must be an integer >= {MIN_TOKENS}, got {max_tokens!r}")
            ids = ids[:max_tokens]
        chunks = chunks_of(ids, ctx, model.config.bos_token_id)
        if sum(len(c) for c in chunks) < MIN_TOKENS:
            raise ColibriError(f"the text is too short to calibrate on ({len(ids)} tokens; at least {MIN_TOKENS})")
        for i, chunk in enumerate(chunks):
            model.forward(chunk)
            if progress:
                progress(i + 1, len(chunks))
        return {
            "tensors": summarize(model.input_stats),
            "grams": summarize_grams(model.input_grams, model.input_stats),
            "meta": {
                "model_dir": str(model.path),
                "architecture": model.config.architecture,
                "tokens": sum(len(c) for c in chunks),
                "ctx": ctx,
                "second_moments": resolved[0],
            },
        }
    finally:
        model.close()


def summarize(input_stats: dict) -> dict:
    """Model.input_stats (float64 [cols + 1]: sums of squares, then the token count) -> {tensor:
    (mean_sq float32 [cols], tokens seen)}; a matrix no token reached has zeros."""
    out = {}
    for name, s in input_stats.items():
        count = int(s[-1])
        out[name] = ((s[:-1] / count if count else np.zeros(s.size - 1)).astype(np.float32), count)
    return out


def summarize_grams(input_grams: dict, input_stats: dict) -> dict:
    """Model.input_grams (float64 [cols, cols], sums of x x^T on and above the diagonal) -> {tensor:
    the mean of x x^T, float32 [cols, cols], symmetric}, for the matrices a token reached (owners
    only: load_importance hands an owner's to the matrices that share its input)."""
    out = {}
    for name, g in input_grams.items():
        count = int(input_stats[name][-1])
        if count:
            upper = np.triu(g)
            out[name] = ((upper + np.triu(g, 1).T) / count).astype(np.float32)
    return out


def save(result: dict, path) -> None:
    """Write calibrate()'s result to `path` (.npz), whole or not at all."""
    path = Path(path)
    arrays = {"meta": np.array(json.dumps({"format": FORMAT, **result["meta"]}))}
    for name, (mean_sq, count) in result["tensors"].items():
        arrays[f"mean_sq/{name}"] = mean_sq
        arrays[f"count/{name}"] = np.array(count, np.int64)
    for name, gram in result.get("grams", {}).items():
        arrays[f"gram/{name}"] = gram
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# What load_importance accepts before it reads a byte of data: a file's members are read lazily,
# each one's declared size checked against its header's shape, so that a small file declaring huge
# arrays (a zip bomb) is refused, and an array is read only when convert quantizes its matrix (whose
# shape it must have: convert checks the shapes first).
MAX_META_BYTES = 1 << 16  # the "meta" member (a JSON object of a few fields)
MAX_COUNT_BYTES = 1 << 10  # a "count/" member (one int64 and its header)
MAX_COLS = 1 << 20  # the columns of a matrix an importance file may describe


class ImportanceArray:
    """One array of a calibrate file, read (and checked) each time it is used as an array
    (np.asarray): its shape and dtype come from its header, which load_importance checked against
    the member's declared size. Other array attributes (min, sum, ...) read it too."""

    def __init__(self, path: Path, member: str, name: str, shape: tuple):
        self.path, self.member, self.name, self.shape = path, member, name, shape
        self.ndim, self.size, self.dtype = len(shape), math.prod(shape), np.dtype(np.float32)

    def __repr__(self) -> str:
        return f"ImportanceArray({str(self.path)!r}, {self.member!r}, shape={self.shape})"

    def __array__(self, dtype=None, copy=None):
        with _importance_errors(self.path, self.member), zipfile.ZipFile(self.path) as z:
            a = _read_member(z, z.getinfo(self.member))
        if a.shape != self.shape or a.dtype != np.float32 or not np.isfinite(a).all():
            bad = True
        elif a.ndim == 1:
            bad = (a < 0).any()
        else:
            bad = (np.diagonal(a) < 0).any() or not np.array_equal(a, a.T)
        if bad:
            need = f"float32 {list(self.shape)}, finite, " + (">= 0" if a.ndim == 1 else "symmetric, a diagonal >= 0")
            raise ColibriError(f"{self.path}: the statistics of {self.name} ({self.member}) are damaged (need {need})")
        return a if dtype is None else a.astype(dtype)

    def __getattr__(self, attr):
        if attr.startswith("_"):  # numpy's protocol probes (__array_interface__, ...) are not the array's
            raise AttributeError(attr)
        return getattr(np.asarray(self), attr)


@contextlib.contextmanager
def _importance_errors(path, member=None):
    """What reading a damaged file raises, as a ColibriError naming it (and the member)."""
    where = f"{path}" + (f" ({member})" if member else "")
    try:
        yield
    except ColibriError:
        raise
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error, NotImplementedError) as e:
        raise ColibriError(
            f"{where}: cannot read it as an importance file ({' '.join(str(e).split())[:200]})"
        ) from None


def _header(z, info) -> tuple:
    """(shape, dtype, bytes of header) of an .npy member, from its first bytes only."""
    with z.open(info) as f:
        version = np.lib.format.read_magic(f)
        if version not in ((1, 0), (2, 0)):  # what np.savez writes (3.0: only for unicode field names)
            raise ValueError(f"an .npy header of version {version[0]}.{version[1]}")
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(f)
        return tuple(shape), dtype, f.tell()


def _read_member(z, info) -> np.ndarray:
    with z.open(info) as f:
        a = np.lib.format.read_array(f, allow_pickle=False)
        if f.read(1):  # also reaches the member's end, where zipfile checks its CRC
            raise ValueError("bytes after the array")
    return a


def load_importance(path) -> dict:
    """{tensor name: importance} of a calibrate file: its second moment float32 [cols, cols] where
    it holds one, else its mean squares float32 [cols] (tensors no token reached left out), each an
    ImportanceArray read when used. Only the headers, the counts and "meta" are read here; every
    member's declared size must match its header. ColibriError naming the file for anything else."""
    path = Path(path)
    with _importance_errors(path):
        if not zipfile.is_zipfile(path):
            raise ColibriError(
                f"{path}: not a Colibri importance file (an .npz that python -m colibri calibrate writes; "
                "this is not a zip archive, or it is cut short)"
            )
        with zipfile.ZipFile(path) as z:
            members = {i.filename[: -len(".npy")]: i for i in z.infolist() if i.filename.endswith(".npy")}
            meta = _meta(path, z, members.get("meta"))
            if meta.get("format") != FORMAT:
                raise ColibriError(f"{path}: not a Colibri importance file (python -m colibri calibrate writes them)")
            shapes = {}
            for key, info in members.items():
                kind, _, name = key.partition("/")
                if kind in ("mean_sq", "gram", "count") and name:
                    shapes[key] = _checked_header(path, z, key, info)
            out = {}
            for key in sorted(shapes):
                if not key.startswith("mean_sq/"):
                    continue
                name = key[len("mean_sq/") :]
                (cols,) = shapes[key]
                if f"count/{name}" not in shapes:
                    raise ColibriError(f"{path}: the statistics of {name} have no count (count/{name})")
                with _importance_errors(path, f"count/{name}"):
                    count = int(_read_member(z, members[f"count/{name}"]))
                if count <= 0:
                    continue
                gram = f"gram/{input_owner(name)}"
                if gram in shapes and shapes[gram] != (cols, cols):
                    raise ColibriError(
                        f"{path}: the second moment of {name} ({gram}) has shape {list(shapes[gram])}, its mean "
                        f"squares {cols} columns (need [{cols}, {cols}])"
                    )
                key = gram if gram in shapes else key
                out[name] = ImportanceArray(path, members[key].filename, name, shapes[key])
            return out


def _meta(path, z, info) -> dict:
    """The "meta" member: a JSON object in a 0-d string array."""
    if info is None or info.file_size > MAX_META_BYTES:
        return {}
    with _importance_errors(path, info.filename):
        meta = _read_member(z, info)
    if meta.shape != () or meta.dtype.kind != "U":
        return {}
    try:
        meta = json.loads(str(meta))
    except (ValueError, RecursionError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _checked_header(path, z, key, info) -> tuple:
    """The shape of member `key` (mean_sq/, gram/ or count/), its header and declared size checked."""
    kind = key.partition("/")[0]
    with _importance_errors(path, info.filename):
        shape, dtype, header = _header(z, info)
    want = {"mean_sq": "float32 [cols]", "gram": "float32 [cols, cols]", "count": "an int64 []"}[kind]
    ok = {
        "mean_sq": dtype == np.float32 and len(shape) == 1 and 0 < shape[0] <= MAX_COLS,
        "gram": dtype == np.float32 and len(shape) == 2 and shape[0] == shape[1] and 0 < shape[0] <= MAX_COLS,
        "count": dtype.kind in "iu" and shape == () and info.file_size <= MAX_COUNT_BYTES,
    }[kind]
    if not ok:
        raise ColibriError(f"{path}: member {info.filename} is {dtype} {list(shape)}, need {want}")
    if info.file_size != header + math.prod(shape) * dtype.itemsize:
        raise ColibriError(
            f"{path}: member {info.filename} declares {info.file_size} bytes, its header "
            f"{header + math.prod(shape) * dtype.itemsize}: damaged or not written by calibrate"
        )
    return shape
