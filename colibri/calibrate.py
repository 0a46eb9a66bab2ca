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

import json
import os
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


def load_importance(path) -> dict:
    """{tensor name: importance} of a calibrate file: the second moment float32 [cols, cols] where it
    holds one, else the mean squares float32 [cols] (tensors no token reached left out);
    ColibriError naming the file for anything else."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            files = set(z.files)
            meta = json.loads(str(z["meta"])) if "meta" in files else {}
            if meta.get("format") != FORMAT:
                raise ColibriError(f"{path}: not a Colibri importance file (python -m colibri calibrate writes them)")
            out = {}
            for key in sorted(files):
                if not key.startswith("mean_sq/"):
                    continue
                name = key[len("mean_sq/") :]
                v, count = z[key], z.get(f"count/{name}")
                if count is None or v.ndim != 1 or v.dtype != np.float32 or not np.isfinite(v).all() or (v < 0).any():
                    raise ColibriError(
                        f"{path}: the statistics of {name} are damaged (need float32 [cols], finite, "
                        ">= 0, and its count)"
                    )
                if int(count) <= 0:
                    continue
                out[name] = v
                owner = input_owner(name)
                if f"gram/{owner}" in files:
                    g = z[f"gram/{owner}"]
                    if (
                        g.dtype != np.float32
                        or g.shape != (v.size, v.size)
                        or not np.isfinite(g).all()
                        or (np.diagonal(g) < 0).any()
                        or not np.array_equal(g, g.T)
                    ):
                        raise ColibriError(
                            f"{path}: the second moment of {name} is damaged (need float32 "
                            f"[{v.size}, {v.size}], finite, symmetric, a diagonal >= 0)"
                        )
                    out[name] = g
            return out
    except ColibriError:
        raise
    except (OSError, ValueError, KeyError, EOFError) as e:
        raise ColibriError(f"{path}: cannot read it as an importance file ({' '.join(str(e).split())[:200]})") from None
