#!/usr/bin/env python3
"""Prompts computed once: time to first token of prompts the prefix store holds, against a cold
prefill of the same length, on Colibri and (optionally) llama-server, same machine, same threads.

Scenarios (each request is `POST /v1/completions` with a prompt of random token ids, max_tokens 1,
temperature 0: its wall time is its time to first token; every repetition draws new ids, so no
figure comes from an earlier repetition's cache):
  returning  one place (--parallel 1 / -np 1): a conversation of --conversation tokens, then
             three others of --others tokens that take the place, then the first one again with
             --turn new tokens. TTFT of that return over TTFT of a cold prompt of the same length
             (new ids, same server). Colibri: --cache-ram auto; llama-server: --cache-ram MB.
  restart    (Colibri, --kv-store) the conversation served, the server stopped and started again,
             then the return: TTFT over a cold prompt's on the restarted server.
  shared     --places places (--parallel N / -np N): --requests requests sent at once, each a
             --system-token system prompt (the same ids) plus --unique tokens of its own; the
             wall time until all are answered, and (Colibri) the prompt tokens the engine ran,
             from /metrics (colibri_prompt_tokens - colibri_prefix_reused_tokens), against the
             tokens of one system prompt plus the unique parts.

    python tools/bench/prefix_store.py --model-dir D --threads 2 --reps 3 \\
        [--llama-server BIN --gguf G] --out tools/bench/results/DATE-prefix-store-HOST.json

Needs httpx (the test extra). Raw results: one JSON file (command, host, date, commit, every
repetition); the summary (medians) is printed and stored beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "bench"))
from provenance import write_results  # noqa: E402
from servers import Server  # noqa: E402


def colibri(args, parallel: int, extra=()) -> Server:
    return Server(
        lambda port: [
            sys.executable, "-m", "colibri", "serve", "--model-dir", args.model_dir, "--port", str(port),
            "--threads", str(args.threads), "--parallel", str(parallel), "--n-ctx", str(args.n_ctx),
            "--max-queue", "1000", "--queue-timeout", "10000", "--quiet", "--model-name", "m", *extra,
        ],
        "colibri",
    )  # fmt: skip


def llama(args, parallel: int) -> Server:
    return Server(
        lambda port: [
            args.llama_server, "-m", args.gguf, "--port", str(port), "-t", str(args.threads), "-tb",
            str(args.threads), "-np", str(parallel), "-c", str(args.n_ctx * parallel), "--cache-ram",
            str(args.llama_cache_ram), "--metrics", "--no-warmup",
        ],
        "llama-server",
    )  # fmt: skip


def ttft(server: Server, prompt: list) -> float:
    import httpx

    body = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    t = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=None)
    if r.status_code != 200:
        raise SystemExit(f"{server.name}: {r.status_code} {r.text[:300]}")
    return time.perf_counter() - t


def ids(rng, n: int, vocab: int) -> list:
    return rng.integers(10, vocab - 10, n).tolist()


def returning(server: Server, args, rng, vocab: int) -> dict:
    conv = ids(rng, args.conversation, vocab)
    first = ttft(server, conv)
    for _ in range(3):
        ttft(server, ids(rng, args.others, vocab))
    back = ttft(server, conv + ids(rng, args.turn, vocab))
    cold = ttft(server, ids(rng, args.conversation + args.turn, vocab))
    return {"first": first, "returning": back, "cold": cold, "ratio": back / cold}


def restart(args, rng, vocab: int, store: str) -> dict:
    conv = ids(rng, args.conversation, vocab)
    s = colibri(args, 1, ("--kv-store", store))
    first = ttft(s, conv)
    s.stop()
    s = colibri(args, 1, ("--kv-store", store))
    back = ttft(s, conv + ids(rng, args.turn, vocab))
    cold = ttft(s, ids(rng, args.conversation + args.turn, vocab))
    s.stop()
    return {"first": first, "returning": back, "cold": cold, "ratio": back / cold}


def metric(server: Server, name: str) -> float:
    import httpx

    text = httpx.get(server.url + "/metrics", timeout=30).text
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$")
    return sum(float(m.group(1)) for line in text.splitlines() if (m := pattern.match(line)))


def shared(server: Server, args, rng, vocab: int, engine: str) -> dict:
    import httpx

    system = ids(rng, args.system, vocab)
    prompts = [system + ids(rng, args.unique, vocab) for _ in range(args.requests)]
    counters = ("colibri_prompt_tokens_total", "colibri_prefix_reused_tokens_total")
    before = [metric(server, c) for c in counters] if engine == "colibri" else None

    async def all_at_once():
        async with httpx.AsyncClient(timeout=None) as client:
            body = {"model": "m", "max_tokens": 1, "temperature": 0}
            rs = await asyncio.gather(
                *[client.post(server.url + "/v1/completions", json={**body, "prompt": p}) for p in prompts]
            )
        bad = [r for r in rs if r.status_code != 200]
        if bad:
            raise SystemExit(f"{server.name}: {bad[0].status_code} {bad[0].text[:300]}")

    t = time.perf_counter()
    asyncio.run(all_at_once())
    out = {"wall": time.perf_counter() - t, "ideal_tokens": args.system + args.requests * args.unique}
    if before is not None:
        after = [metric(server, c) for c in counters]
        out["computed_tokens"] = (after[0] - before[0]) - (after[1] - before[1])
    return out


def median(runs: list, key: str) -> float:
    return float(np.median([r[key] for r in runs]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--llama-server", help="llama-server binary (with --gguf): run it side by side")
    p.add_argument("--gguf")
    p.add_argument("--llama-cache-ram", type=int, default=8192, help="llama-server --cache-ram MB (default 8192)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--conversation", type=int, default=2000)
    p.add_argument("--others", type=int, default=500)
    p.add_argument("--turn", type=int, default=32)
    p.add_argument("--system", type=int, default=1500)
    p.add_argument("--unique", type=int, default=64)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--places", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="results JSON")
    args = p.parse_args()
    if bool(args.llama_server) != bool(args.gguf):
        p.error("--llama-server and --gguf go together")
    sys.path.insert(0, str(REPO))
    from colibri.modeldir import ModelDir

    vocab = ModelDir(args.model_dir).config.vocab_size
    rng = np.random.default_rng(args.seed)
    engines = ["colibri"] + (["llama-server"] if args.llama_server else [])
    runs = {f"{e} {s}": [] for e in engines for s in ("returning", "shared")}
    runs["colibri restart"] = []
    for rep in range(args.reps):  # engines interleaved within each repetition
        for engine in engines:
            s = colibri(args, 1) if engine == "colibri" else llama(args, 1)
            runs[f"{engine} returning"].append(returning(s, args, rng, vocab))
            s.stop()
            s = colibri(args, args.places) if engine == "colibri" else llama(args, args.places)
            runs[f"{engine} shared"].append(shared(s, args, rng, vocab, engine))
            s.stop()
        store = tempfile.mkdtemp(prefix="colibri-kv-store-")
        try:
            runs["colibri restart"].append(restart(args, rng, vocab, store))
        finally:
            shutil.rmtree(store, ignore_errors=True)
        print(f"[prefix_store] repetition {rep + 1}/{args.reps} done", file=sys.stderr)
    summary = {}
    for name, rs in runs.items():
        if not rs:
            continue
        if "shared" in name:
            summary[name] = {"wall_s": median(rs, "wall"), "ideal_tokens": rs[0]["ideal_tokens"]}
            if "computed_tokens" in rs[0]:
                summary[name]["computed_tokens"] = median(rs, "computed_tokens")
        else:
            summary[name] = {k: median(rs, k) for k in ("returning", "cold", "ratio")}
    write_results(args.out, args, summary=summary, runs=runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
