#!/usr/bin/env python3
"""What constrained decoding (colibri.constraint) costs: the mask per token, and decode tok/s.

Part 1, the mask at Qwen3's vocabulary (tests/fixtures/text/vocab/qwen3/tokenizer.json.xz,
151,665 ids, padded to --vocab 151,936): a Constraint (mask inline) is walked along a document
its grammar accepts (the document tokenized by the Qwen3 tokenizer), several times, each token's
steps timed on their own. Two walks: in one the pick is the document's token, which the grammar
allows (a trained model's usual case): `allows` (llguidance's check of that one token) and
`consume` (advancing the matcher) are the whole cost. In the other the pick is refused first (a
random-weight model's usual case): `allows`, then `mask` (llguidance's bitmask: what the worker
thread computes while the engine runs, where one does), `apply` (the float32 [vocab] copy with
the forbidden ids at -inf) and `consume`. Median and p99 over every token of every walk.

Part 2, decode on a converted model (--model-dir; by default the random-weight Qwen3-MoE-4l int4
with the Qwen3 tokenizer, 151,936 ids, made so:
    python tools/bench/make_models.py qwen3-moe-4l --no-tokenizer --out /work/bench_cache/hf
    H=/work/bench_cache/hf/qwen3-moe-4l; xz -dc tests/fixtures/text/vocab/qwen3/tokenizer.json.xz > $H/tokenizer.json
    cp tests/fixtures/text/vocab/qwen3/tokenizer_config.json $H/    # and eos_token_id [151645, 151643]
                                                                    # in $H/generation_config.json
    python -m colibri convert --hf-dir $H --output-dir /work/bench_cache/colibri/qwen3-moe-4l-int4 --quantize int4
): the same
prompt decoded greedily without a constraint, with the JSON schema (the mask on the worker
thread) and with the mask computed inline (background off), interleaved,
--reps rounds, for each --threads count. A run's ms/token is the median of the gaps between its
consecutive tokens (a pick and a forward each: the prefill is left out; the median, not the
mean, because a shared host's other work lands in a few gaps); the medians over the rounds per
variant and the overhead of the schema against the plain run are reported. Target: the schema
costs <= 3 % of decode time.

    python tools/bench_constraint.py [--model-dir D] [--reps 9] [--gen 64] [--threads N [N ...]]
                                     [--vocab 151936] [--walks 5] [--out tools/bench/results/...json]

The result JSON (command, host, date, git commit and every figure) goes to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import lzma
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools" / "bench"))

import colibri  # noqa: E402
from colibri import constraint as C  # noqa: E402
from colibri.tokenizer import HFTokenizer  # noqa: E402
from run_bench import cpu_name, git_rev  # noqa: E402  (tools/bench/run_bench.py)

QWEN3 = REPO / "tests" / "fixtures" / "text" / "vocab" / "qwen3"
DEFAULT_MODEL = Path(os.environ.get("BENCH_CACHE", "/work/bench_cache")) / "colibri" / "qwen3-moe-4l-int4"
TARGET = 0.03  # the schema's share of decode time at most

# a function-calling-sized schema: nested objects, arrays, enums, bounded integers, a pattern
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest", "bot"]}, "minItems": 1, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "orders": {
            "type": "array",
            "maxItems": 8,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1},
                    "total": {"type": "number"},
                    "status": {"enum": ["open", "paid", "shipped"]},
                },
                "required": ["id", "total", "status"],
                "additionalProperties": False,
            },
        },
        "note": {"anyOf": [{"type": "null"}, {"type": "string"}]},
    },
    "required": ["name", "age", "email", "tags", "address", "orders", "note"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["admin", "user"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "01815"},
    "orders": [
        {"id": 1, "total": 12.5, "status": "paid"},
        {"id": 2, "total": 3.25, "status": "open"},
        {"id": 17, "total": 1024.0, "status": "shipped"},
    ],
    "note": "Notes on the Analytical Engine, with a table of Bernoulli numbers.",
}
GRAMMAR = r"""
start: call+
call: NAME "(" args? ")" ";" WS?
args: arg ("," WS? arg)*
arg: NUMBER | STRING | NAME
NAME: /[a-z_][a-z0-9_]*/
NUMBER: /-?[0-9]+(\.[0-9]+)?/
STRING: /"[^"\n]*"/
WS: /[ \n]+/
"""
CASES = [  # name, constraint keywords, a text the constraint accepts
    ("json_schema", dict(json_schema=SCHEMA), json.dumps(DOCUMENT, indent=2)),
    ("json_object", dict(json_object=True), json.dumps(DOCUMENT)),
    (
        "regex",
        dict(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}( [A-Za-z ,.]{1,80})?"),
        "1843-10-05 Notes on the Engine, by A. A. L.",
    ),
    ("grammar (Lark)", dict(grammar=GRAMMAR), 'move(12, "north"); say("hello world", x); stop();'),
]


def stats(seconds) -> dict:
    us = np.asarray(seconds) * 1e6
    return {
        "median_us": round(float(np.median(us)), 1),
        "p99_us": round(float(np.percentile(us, 99)), 1),
        "n": int(us.size),
    }


def qwen3_vocabulary(n_vocab: int):
    tmp = Path(tempfile.mkdtemp()) / "tokenizer.json"
    tmp.write_bytes(lzma.decompress((QWEN3 / "tokenizer.json.xz").read_bytes()))
    tok = HFTokenizer(tmp, json.loads((QWEN3 / "tokenizer_config.json").read_text()))
    t0 = time.perf_counter()
    vocab = C.Vocabulary(tok, n_vocab, [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")])
    return tok, vocab, time.perf_counter() - t0


def bench_masks(n_vocab: int, walks: int) -> dict:
    tok, vocab, build = qwen3_vocabulary(n_vocab)
    out = {"vocab": n_vocab, "tokenizer_ids": tok.vocab_size, "vocabulary_build_s": round(build, 3), "cases": {}}
    logits = np.random.default_rng(0).standard_normal(n_vocab).astype(np.float32)  # [vocab]
    buf = np.empty_like(logits)  # [vocab]
    stop = vocab.stop_ids[0]
    for name, kw, text in CASES:
        ids = tok.encode(text, add_special_tokens=False) + [stop]
        t0 = time.perf_counter()
        c = C.Constraint(vocab, background=False, **kw)
        compile_s = time.perf_counter() - t0
        # walk A, a model whose pick the grammar allows (a trained one, mostly): allows + consume
        # walk B, a pick the grammar refuses (a random-weight model, mostly): allows, the mask,
        # apply, then consume -- the mask timed alone: the worker's job when one runs it
        check, mask, apply, consume, allowed_path, refused_path, allowed = [], [], [], [], [], [], []
        refused_token = vocab.n_vocab - 1  # a padding id: never allowed
        for _ in range(walks):
            c.reset()
            for token in ids:
                t0 = time.perf_counter()
                ok = c.allows(token)
                t1 = time.perf_counter()
                c.consume(token)
                t2 = time.perf_counter()
                assert ok, (name, token)
                check.append(t1 - t0)
                allowed_path.append(t2 - t0)
            assert c.finished, name
            c.reset()
            for token in ids:
                t0 = time.perf_counter()
                ok = c.allows(refused_token)
                t1 = time.perf_counter()
                c._mask()
                t2 = time.perf_counter()
                c.apply(logits, buf)
                t3 = time.perf_counter()
                c.consume(token)
                t4 = time.perf_counter()
                assert not ok
                mask.append(t2 - t1)
                apply.append(t3 - t2)
                consume.append(t4 - t3)
                refused_path.append(t4 - t0)
                allowed.append(int(c.allowed().sum()) if c._known else 0)
            assert c.finished, name
        out["cases"][name] = {
            "tokens": len(ids),
            "compile_ms": round(compile_s * 1e3, 2),
            "allows (one token)": stats(check),
            "mask": stats(mask),
            "apply": stats(apply),
            "consume": stats(consume),
            "critical_path, pick allowed (allows + consume)": stats(allowed_path),
            "critical_path, pick refused (allows + mask + apply + consume)": stats(refused_path),
            "allowed_tokens_median": int(np.median(allowed)),
        }
        print(
            f"  {name:16s} {len(ids):4d} tokens  compile {compile_s * 1e3:6.1f} ms  allows {stats(check)['median_us']:5.1f}"
            f"  mask {stats(mask)['median_us']:6.1f} / {stats(mask)['p99_us']:6.1f} us  apply "
            f"{stats(apply)['median_us']:5.1f} / {stats(apply)['p99_us']:5.1f}  consume "
            f"{stats(consume)['median_us']:5.1f} / {stats(consume)['p99_us']:5.1f}  (median / p99); critical path: "
            f"pick allowed {stats(allowed_path)['median_us']:5.1f}, refused {stats(refused_path)['median_us']:6.1f} us",
            flush=True,
        )
    return out


MASKS = [0]  # masks computed (bench instrumentation of Constraint._compute)
_compute = C.Constraint._compute


def _counted_compute(self):
    MASKS[0] += 1
    return _compute(self)


C.Constraint._compute = _counted_compute


def timed_run(m, prompt, gen, **kw) -> tuple:
    """(median ms between consecutive tokens, ms per token outside the engine's forwards, tokens)."""
    times = []
    for _ in m.generate(prompt, max_new_tokens=gen, reuse_prefix=False, **kw):
        times.append(time.perf_counter())
    outside = ((times[-1] - times[0]) - m.stats["decode_seconds"]) / (len(times) - 1)  # picks, Python
    return float(np.median(np.diff(times))) * 1e3, outside * 1e3, len(times)


def bench_decode(model_dir: Path, reps: int, gen: int, threads) -> dict:
    m = colibri.load(model_dir, threads=threads)
    ask = "Describe Ada Lovelace as a JSON record with her name, age, email, tags, address, orders and a note."
    try:
        prompt = m.apply_chat_template([{"role": "user", "content": ask}])
    except colibri.ColibriError:  # no template: the ChatML text Qwen3's would give
        prompt = m.encode(f"<|im_start|>user\n{ask}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    variants = {
        "plain": dict(stop_at_eos=False),
        "json_schema": dict(json_schema=SCHEMA),
        "json_schema, mask inline": dict(json_schema=SCHEMA),
    }
    m._constraint(json_schema=SCHEMA)  # the vocabulary once, outside the timings
    timed_run(m, prompt, 8, stop_at_eos=False)  # warm the pages
    runs = {k: [] for k in variants}
    outside = {k: [] for k in variants}
    counts = {k: [] for k in variants}
    masks = {k: [] for k in variants}
    for rep in range(reps):
        for name, kw in variants.items():
            C.BACKGROUND = "inline" not in name
            MASKS[0] = 0
            ms, out, n = timed_run(m, prompt, gen, **kw)
            runs[name].append(ms)
            outside[name].append(out)
            counts[name].append(n)
            masks[name].append(MASKS[0])
        print(
            f"  round {rep + 1}: "
            + "  ".join(
                f"{k} {v[-1]:.2f} ms ({outside[k][-1]:.3f} outside the forward, "
                f"{counts[k][-1]} tok, {masks[k][-1]} masks)"
                for k, v in runs.items()
            ),
            flush=True,
        )
    C.BACKGROUND = True
    med = {k: statistics.median(v) for k, v in runs.items()}
    med_out = {k: statistics.median(v) for k, v in outside.items()}
    res = {
        "model_dir": str(model_dir),
        "model": repr(m),
        "vocab": m.config.vocab_size,
        "threads": m.threads,
        "prompt_tokens": len(prompt),
        "max_new_tokens": gen,
        "reps": reps,
        "ms_per_token": {k: [round(x, 3) for x in v] for k, v in runs.items()},
        "tokens": counts,
        # positions where the model's pick was refused and the mask computed (with the
        # worker: every position, computed ahead)
        "masks_computed": masks,
        "median_ms_per_token": {k: round(v, 3) for k, v in med.items()},
        "median_tok_per_s": {k: round(1e3 / v, 2) for k, v in med.items()},
        "overhead_json_schema": round(med["json_schema"] / med["plain"] - 1, 4),
        "overhead_json_schema_inline": round(med["json_schema, mask inline"] / med["plain"] - 1, 4),
        # the forward's time taken out: what the constraint adds to the critical path (it
        # misses a forward slowed by the mask worker taking a core the engine's threads use)
        "outside_forward_ms_per_token": {k: [round(x, 4) for x in v] for k, v in outside.items()},
        "median_outside_forward_ms_per_token": {k: round(v, 4) for k, v in med_out.items()},
        "critical_path_share_json_schema": round((med_out["json_schema"] - med_out["plain"]) / med["plain"], 4),
        "critical_path_share_json_schema_inline": round(
            (med_out["json_schema, mask inline"] - med_out["plain"]) / med["plain"], 4
        ),
    }
    m.close()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--walks", type=int, default=5)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--threads", type=int, nargs="*", default=[None], help="engine threads (default: all cores)")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument(
        "--out", type=Path, default=REPO / "tools" / "bench" / "results" / f"{datetime.date.today()}-constraint.json"
    )
    a = ap.parse_args(argv)
    import llguidance

    result = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "host": {"cpu": cpu_name(), "cores": os.cpu_count(), "platform": platform.platform()},
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "git_commit": git_rev(),
        "llguidance": llguidance.__version__,
        "target": f"json_schema costs <= {TARGET:.0%} of decode time",
    }
    print(f"mask per token, vocabulary {a.vocab} (Qwen3 tokenizer):", flush=True)
    result["mask"] = bench_masks(a.vocab, a.walks)
    if not a.skip_decode:
        result["decode"] = []
        for threads in a.threads:
            print(f"decode, {a.model_dir}, threads {threads or 'all cores'}:", flush=True)
            d = bench_decode(a.model_dir, a.reps, a.gen, threads)
            d["target_met"] = d["overhead_json_schema"] <= TARGET
            result["decode"].append(d)
            print(
                "  median ms/token: "
                + ", ".join(f"{k} {v}" for k, v in d["median_ms_per_token"].items())
                + f"; json_schema overhead {d['overhead_json_schema']:+.2%} (inline mask "
                f"{d['overhead_json_schema_inline']:+.2%}); target <= {TARGET:.0%}: "
                f"{'met' if d['target_met'] else 'NOT met'}",
                flush=True,
            )
            print(
                "  median ms/token outside the forward: "
                + ", ".join(f"{k} {v}" for k, v in d["median_outside_forward_ms_per_token"].items())
                + f"; json_schema adds {d['critical_path_share_json_schema']:+.2%} of a plain token "
                f"(inline mask {d['critical_path_share_json_schema_inline']:+.2%})",
                flush=True,
            )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
