#!/usr/bin/env python3
"""Speculative decoding: decode tokens/s with drafts over without, same model, interleaved.

Scenarios (a trained model: the bundled demo by default; greedy, --gen tokens each):
  edit      a reply the user predicted almost exactly (OpenAI's Predicted Outputs on an edited
            file): the prediction is the model's own plain reply with every --edit-every-th token
            changed, as an edit that keeps most of the text; drafts from the prediction.
  quote     a prompt holding a passage twice over and the start of a third copy: the reply quotes
            and repeats it; n-gram drafts from the prompt and the reply.
  free      a short prompt, free generation; n-gram drafts (auto, the default): what a user who
            never asked for speculation gets.
Each repetition runs plain decoding (draft "none") and the drafted run back to back; the tokens
are checked to be the same. Decode tok/s is the Model's own count (tokens after the first over
the engine's time), the ratio drafted / plain per repetition, medians over --reps.

    python tools/bench/speculation.py [--model-dir D] --threads 2 --reps 5 --out FILE.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "bench"))
from provenance import write_results  # noqa: E402

PASSAGE = (
    "And God said, Let there be light: and there was light. And God saw the light, that it was good: "
    "and God divided the light from the darkness. And God called the light Day, and the darkness he "
    "called Night. And the evening and the morning were the first day."
)


def decode_rate(m, ids, gen: int, **kw) -> tuple:
    """(tokens, decode tok/s, speculation counters or None) of one greedy generation."""
    tokens = list(m.generate(ids, gen, stop_at_eos=False, reuse_prefix=False, **kw))
    s = m.stats
    spec = m.last_generation.speculation
    return tokens, s["decode_tokens"] / s["decode_seconds"], spec.as_dict() if spec else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=str(REPO / "colibri" / "data" / "demo"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--draft-max", type=int, default=None)
    p.add_argument("--edit-every", type=int, default=20, help="edit: one predicted token in this many changed")
    p.add_argument("--out")
    args = p.parse_args()
    sys.path.insert(0, str(REPO))
    import colibri

    m = colibri.load(args.model_dir, threads=args.threads)
    enc = m.encode
    scenarios = {
        "edit": enc("And the LORD said unto Moses,"),
        "quote": enc(PASSAGE + "\n\n" + PASSAGE + "\n\n" + PASSAGE[:60]),
        "free": enc("And the LORD said unto Moses,"),
    }
    runs = {name: [] for name in scenarios}
    extra = {} if args.draft_max is None else {"draft_max": args.draft_max}
    for rep in range(args.reps):
        for name, ids in scenarios.items():
            plain, plain_rate, _ = decode_rate(m, ids, args.gen, draft="none")
            if name == "edit":
                predicted = [
                    t if (i + 1) % args.edit_every else (t + 1) % m.config.vocab_size for i, t in enumerate(plain)
                ]
                kw = {"prediction": predicted}
            else:
                kw = {"draft": "ngram" if name == "quote" else "auto"}
            drafted, rate, spec = decode_rate(m, ids, args.gen, **kw, **extra)
            if drafted != plain:
                raise SystemExit(f"{name}: the drafted run's tokens differ from plain decoding's")
            runs[name].append(
                {"plain_tok_s": plain_rate, "drafted_tok_s": rate, "ratio": rate / plain_rate, **(spec or {})}
            )
        print(f"[speculation] repetition {rep + 1}/{args.reps} done", file=sys.stderr)
    summary = {
        name: {
            "plain_tok_s": statistics.median(r["plain_tok_s"] for r in rs),
            "drafted_tok_s": statistics.median(r["drafted_tok_s"] for r in rs),
            "ratio": statistics.median(r["ratio"] for r in rs),
            "acceptance": statistics.median(
                (r.get("accepted_tokens", 0) / r["drafted_tokens"]) if r.get("drafted_tokens") else 0.0 for r in rs
            ),
        }
        for name, rs in runs.items()
    }
    write_results(args.out, args, speculation=runs, summary=summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
