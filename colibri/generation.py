"""generation_config.json: the checkpoint's stop tokens and sampling defaults.

Design
------
transformers' `generate` reads the checkpoint's generation_config.json: `eos_token_id` (an int or
a list: any of them ends the generation) and, when `do_sample` is true, its `temperature`,
`top_k`, `top_p`, `min_p` (transformers' defaults for the ones it omits: 1.0, 50, 1.0, off);
`repetition_penalty` applies whether or not it samples. Colibri does the same, per field: a
value the caller passes wins, then the checkpoint's, then Colibri's own default (greedy, no
penalty). `resolve()` also says which values came from the file, so `run`/`chat` can print them.
"""

from __future__ import annotations

import math
from pathlib import Path

from .errors import ColibriError
from .config import read_json
from .tokenizer import MAX_TEXT_FILE_BYTES

GENERATION_CONFIG = "generation_config.json"
# Colibri's defaults when neither the caller nor the checkpoint sets a value
ENGINE_DEFAULTS = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
# transformers' GenerationConfig defaults for a sampling checkpoint that omits a field
HF_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": 0.0}
SAMPLING_FIELDS = tuple(ENGINE_DEFAULTS)


class GenerationDefaults:
    """The parsed generation_config.json (or nothing: `GenerationDefaults.empty()`)."""

    def __init__(self, eos_token_id=(), sampling=None, source: str | None = None):
        self.eos_token_id = tuple(eos_token_id)  # stop tokens the file lists
        self.sampling = dict(sampling or {})  # field -> value the file sets
        self.source = source  # the file, for messages; None: no file

    @classmethod
    def empty(cls) -> "GenerationDefaults":
        return cls()

    @classmethod
    def from_file(cls, path: Path, vocab_size: int) -> "GenerationDefaults":
        path = Path(path)
        doc = read_json(path, "generation_config.json", MAX_TEXT_FILE_BYTES)
        if not isinstance(doc, dict):
            raise ColibriError(f"{path} must hold a JSON object")
        eos = doc.get("eos_token_id")
        eos = [] if eos is None else [eos] if isinstance(eos, int) and not isinstance(eos, bool) else eos
        if not isinstance(eos, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in eos):
            raise ColibriError(
                f"{path}: eos_token_id must be an integer or a list of integers, got {doc['eos_token_id']!r}"
            )
        bad = [t for t in eos if not 0 <= t < vocab_size]
        if bad:
            raise ColibriError(f"{path}: eos_token_id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        sampling = {}
        fields = ("temperature", "top_k", "top_p", "min_p") if doc.get("do_sample") is True else ()
        for name in fields:
            value = doc.get(name, HF_SAMPLING_DEFAULTS[name])
            sampling[name] = HF_SAMPLING_DEFAULTS[name] if value is None else value
        if doc.get("repetition_penalty") is not None:
            sampling["repetition_penalty"] = doc["repetition_penalty"]
        for name, value in sampling.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ColibriError(f"{path}: {name} must be a finite number, got {value!r}")
        if "top_k" in sampling and (not isinstance(sampling["top_k"], int) or sampling["top_k"] < 0):
            raise ColibriError(f"{path}: top_k must be an integer >= 0, got {sampling['top_k']!r}")
        return cls(eos, sampling, str(path))

    def resolve(self, **given) -> tuple:
        """(settings for every sampling field, [names taken from the file]). `given`: the caller's
        values, None meaning "not set"."""
        out, taken = {}, []
        for name in SAMPLING_FIELDS:
            if given.get(name) is not None:
                out[name] = given[name]
            elif name in self.sampling:
                out[name] = self.sampling[name]
                taken.append(name)
            else:
                out[name] = ENGINE_DEFAULTS[name]
        return out, taken

    def describe(self) -> str:
        """One line for `info`."""
        if self.source is None:
            return "none (greedy unless asked)"
        parts = [f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in self.sampling.items()]
        return ", ".join(parts) or "greedy"
