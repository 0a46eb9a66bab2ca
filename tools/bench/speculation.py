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

With --peer NAME=LLAMA_SERVER (repeatable: llama.cpp's, ik_llama.cpp's) and --gguf (the same
weights), the quote scenario also runs on each peer's llama-server, the same prompt ids, greedy,
with and without its n-gram speculation (--peer-spec, default `ngram-simple`: the prompt-lookup
kind), interleaved with Colibri's runs: its decode tok/s from the server's own timings
(predicted_per_second), its drafted and accepted counts; Colibri's n-gram rate over each peer's.

    python tools/bench/speculation.py [--model-dir D] --threads 2 --reps 5 --out FILE.json \\
        [--gguf G --peer llama.cpp=BIN --peer ik_llama.cpp=BIN]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "bench"))
from provenance import write_results  # noqa: E402
from servers import Server  # noqa: E402

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


def peer_server(binary: str, name: str, args, spec: str | None) -> Server:
    extra = ["--spec-type", spec] if spec else []
    return Server(
        lambda port: [
            binary, "-m", args.gguf, "--port", str(port), "-t", str(args.threads), "-tb", str(args.threads),
            "-np", "1", "-c", "4096", "--no-warmup", *extra,
        ],
        name,
    )  # fmt: skip


def peer_rate(server: Server, ids: list, gen: int) -> dict:
    """One greedy completion of `gen` tokens from the prompt ids: the server's decode tok/s and its
    draft counters."""
    import httpx

    body = {
        "prompt": ids, "n_predict": gen, "temperature": 0, "top_k": 1, "cache_prompt": False,
        "ignore_eos": True, "samplers": ["top_k"],
    }  # fmt: skip
    r = httpx.post(server.url + "/completion", json=body, timeout=None)
    if r.status_code != 200:
        raise SystemExit(f"{server.name}: {r.status_code} {r.text[:300]}")
    t = r.json()["timings"]
    return {
        "tok_s": t["predicted_per_second"],
        "drafted_tokens": t.get("draft_n", 0),
        "accepted_tokens": t.get("draft_n_accepted", 0),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=str(REPO / "colibri" / "data" / "demo"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--draft-max", type=int, default=None)
    p.add_argument("--edit-every", type=int, default=20, help="edit: one predicted token in this many changed")
    p.add_argument("--gguf", help="the model's GGUF, for --peer")
    p.add_argument("--peer", action="append", default=[], metavar="NAME=LLAMA_SERVER")
    p.add_argument("--peer-spec", default="ngram-simple", help="the peers' --spec-type (default ngram-simple)")
    p.add_argument("--out")
    args = p.parse_args()
    peers = dict(item.split("=", 1) for item in args.peer)
    if peers and not args.gguf:
        p.error("--peer needs --gguf")
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
    servers = {
        (name, spec): peer_server(binary, name, args, spec)
        for name, binary in peers.items()
        for spec in (None, args.peer_spec)
    }
    peer_runs = {name: [] for name in peers}
    for rep in range(args.reps):
        for name in peers:  # the quote scenario on each peer, between Colibri's runs
            plain = peer_rate(servers[name, None], scenarios["quote"], args.gen)
            drafted = peer_rate(servers[name, args.peer_spec], scenarios["quote"], args.gen)
            counts = {k: v for k, v in drafted.items() if k != "tok_s"}
            peer_runs[name].append({"plain_tok_s": plain["tok_s"], "drafted_tok_s": drafted["tok_s"], **counts})
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
    for name, rs in peer_runs.items():
        quote = runs["quote"]
        summary[f"quote on {name} ({args.peer_spec})"] = {
            "plain_tok_s": statistics.median(r["plain_tok_s"] for r in rs),
            "drafted_tok_s": statistics.median(r["drafted_tok_s"] for r in rs),
            "ratio": statistics.median(r["drafted_tok_s"] / r["plain_tok_s"] for r in rs),
            "acceptance": statistics.median(
                r["accepted_tokens"] / r["drafted_tokens"] if r["drafted_tokens"] else 0.0 for r in rs
            ),
            # Colibri's n-gram decode over the peer's, repetition by repetition (interleaved)
            "colibri_over_peer": statistics.median(c["drafted_tok_s"] / r["drafted_tok_s"] for c, r in zip(quote, rs)),
        }
    for server in servers.values():
        server.stop()
    write_results(args.out, args, speculation=runs, peers=peer_runs, summary=summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
