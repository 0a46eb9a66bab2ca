#!/usr/bin/env python3
"""A digest of every fixture's logits on every kernel tier: the bit-identity check of a refactor.

For each transformers fixture case (tests/fixtures/<case>/hf) and the bundled demo, in every
storage format and every layout the converter can write, on every ISA tier this CPU has, with 1
and 2 threads, the sha256 of the float32 logits of
  - `all`:   the whole prompt in one call, every position's logits (prefill, default chunk);
  - `chunk`: the same with 5-token prefill chunks (the sliding-window rings, chunk boundaries);
  - `last`:  the prompt with only the last logits (the head skipped for the others);
  - `step`:  one token per call (decode), every position's logits.
Run it before and after a change and compare:

    python tools/logits_digest.py --out /tmp/before.json
    ... change, rebuild ...
    python tools/logits_digest.py --out /tmp/after.json --compare /tmp/before.json

Exit status 1 if --compare finds a digest that differs (each difference is printed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"


def model_dirs(root: Path):
    """(name, model directory) of every fixture case in every format and layout, converted into root."""
    from colibri.convert import convert

    cases = sorted(p.name for p in FIXTURES.iterdir() if (p / "hf" / "config.json").is_file())
    for case in cases:
        for dtype in ("f32", "f16", "bf16", "int8", "int4"):
            layouts = [None, "rows", "transposed", "interleaved"] if dtype in ("int8", "int4") else [None, "transposed"]
            for layout in layouts:
                out = root / f"{case}-{dtype}-{layout or 'default'}"
                convert(
                    FIXTURES / case / "hf",
                    out,
                    quantize=dtype,
                    log=lambda *a: None,
                    expert_layout=layout,
                    layout=layout,
                )
                yield out.name, out


def prompt(cfg, n: int = 23) -> np.ndarray:
    rng = np.random.default_rng(7)
    return rng.integers(0, cfg.vocab_size, n).astype(np.int32)


def digests(model, ids: np.ndarray) -> dict:
    h = {}
    h["all"] = model.forward(ids)
    engine = model._live()
    vocab = model.config.vocab_size
    last = np.empty((1, vocab), np.float32)
    engine.reset()
    engine.run(ids, 0, last, False)
    h["last"] = last
    step = np.empty((len(ids), vocab), np.float32)
    engine.reset()
    for t in range(len(ids)):
        engine.run(ids[t : t + 1], t, step[t : t + 1], False)
    h["step"] = step
    return {k: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()[:16] for k, v in h.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="write the digests (JSON) here")
    ap.add_argument("--compare", help="digests written earlier: report every difference")
    a = ap.parse_args(argv)
    import colibri
    from colibri import _kernels

    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = list(model_dirs(Path(tmp)))
        dirs.append(("demo", Path(colibri.__file__).parent / "data" / "demo"))
        for isa in _kernels.available_isas():
            _kernels.select_isa(isa)
            for name, d in dirs:
                for threads in (1, 2):
                    for chunk in (None, 5):
                        model = colibri.load(d, threads=threads, n_ctx=64, prefill_chunk=chunk)
                        ids = prompt(model.config)
                        for k, v in digests(model, ids).items():
                            result[f"{isa}/{name}/t{threads}/c{chunk or 'default'}/{k}"] = v
                        model.close()
    Path(a.out).write_text(json.dumps(result, indent=0, sort_keys=True))
    print(f"{len(result)} digests -> {a.out}")
    if a.compare:
        before = json.loads(Path(a.compare).read_text())
        diff = [k for k in sorted(set(before) | set(result)) if before.get(k) != result.get(k)]
        for k in diff:
            print(f"DIFFERS {k}: {before.get(k)} -> {result.get(k)}")
        print(f"{len(diff)} of {len(before)} differ")
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
