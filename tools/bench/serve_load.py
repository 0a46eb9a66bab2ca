#!/usr/bin/env python3
"""Open-loop load against OpenAI-compatible servers: P50/P99 latency and throughput per arrival rate.

Requests arrive as a Poisson process (exponential gaps, fixed seed) at each rate, whether or not
earlier ones have finished — the load an SLA is written against, unlike a closed loop whose
clients wait for each other. Each request is `POST /v1/completions`, streamed, with a prompt of
`--prompt-tokens` random token ids (the same ids for every target) and `max_tokens` =
`--gen-tokens` with `ignore_eos` (Colibri and llama-server both honour it), so every request
costs the same; every rate gets new prompts (no server can answer from a cache of earlier ones).
A token whose text is not yet a whole character arrives with the next one: latencies are per
streamed piece of text. Per rate and target: P50/P99 of time to first token (TTFT), inter-token latency
(ITL) and end-to-end latency (E2E), and the generated tokens per second over the rate's run.
Targets alternate within each rate (A, B, A, B ... by rate), on the same machine.

    python tools/bench/serve_load.py --target colibri=http://127.0.0.1:8000 \\
        --target llama=http://127.0.0.1:8080 --rates 0.25,0.5,1,2 --requests 24 [--out results.md]
    python tools/bench/serve_load.py --model-dir D --threads 2 --rates 0.5,1   # starts Colibri itself
    python tools/bench/serve_load.py --model-dir D --parallel 1,4 ...   # two Colibri servers: colibri-p1, -p4

Needs httpx (the test extra). Start llama-server with the same threads and a context that holds a
request (`-c 512 -np 1`); Colibri with `colibri serve --model-dir D --threads N --max-queue 1000`
(a saturating rate must queue, not be refused); `--parallel N` gives it N places decoded together,
as llama-server's `-np N` slots (each then needs `-c` of N requests' context).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np


def percentile(values, q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def one_request(client, url: str, model: str, prompt: list, gen: int, start_at: float, t0: float) -> dict:
    """Wait until `start_at` (seconds after t0), send one streamed completion, time its tokens."""
    await asyncio.sleep(max(0.0, t0 + start_at - time.perf_counter()))
    sent = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": gen, "temperature": 0, "stream": True, "ignore_eos": True}
    stamps = []
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=None) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code} {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if any(c.get("text") for c in chunk.get("choices", [])):
                stamps.append(time.perf_counter())
    done = time.perf_counter()
    if not stamps:
        return {"error": "no tokens"}
    return {
        "ttft": stamps[0] - sent,
        "itl": [b - a for a, b in zip(stamps, stamps[1:])],
        "e2e": done - sent,
        "tokens": len(stamps),
        "queued_at": sent - t0,
    }


async def run_rate(url: str, model: str, rate: float, n: int, prompts: list, gen: int, seed: int) -> dict:
    import httpx

    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    arrivals = np.cumsum(gaps) - gaps[0]
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *[one_request(client, url, model, prompts[i], gen, float(arrivals[i]), t0) for i in range(n)]
        )
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    itl = [x for r in ok for x in r["itl"]]
    return {
        "rate": rate,
        "requests": n,
        "ok": len(ok),
        "errors": errors[:3],
        "n_errors": len(errors),
        "ttft_p50": percentile([r["ttft"] for r in ok], 50),
        "ttft_p99": percentile([r["ttft"] for r in ok], 99),
        "itl_p50": percentile(itl, 50),
        "itl_p99": percentile(itl, 99),
        "e2e_p50": percentile([r["e2e"] for r in ok], 50),
        "e2e_p99": percentile([r["e2e"] for r in ok], 99),
        "throughput": sum(r["tokens"] for r in ok) / wall,
        "wall": wall,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_colibri(model_dir: str, threads: int, parallel: int = 1, extra=()) -> tuple:
    """A Colibri server on a free loopback port, healthy; (process, url)."""
    import httpx

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "colibri",
            "serve",
            "--model-dir",
            model_dir,
            "--port",
            str(port),
            "--threads",
            str(threads),
            "--max-queue",
            "100000",
            "--queue-timeout",
            "100000",
            "--parallel",
            str(parallel),
            "--n-ctx",
            "1024",
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"colibri serve exited: {proc.stderr.read()[-500:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit("colibri serve did not become healthy in 600 s")


def model_id(url: str) -> str:
    """The first model id the server lists."""
    import httpx

    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="a running OpenAI-compatible server (repeat for several; they alternate)",
    )
    ap.add_argument("--model-dir", help="start `colibri serve` on this directory as target 'colibri'")
    ap.add_argument("--threads", type=int, default=2, help="threads of the Colibri server started here")
    ap.add_argument(
        "--parallel",
        default="1",
        help="its places (serve --parallel); a list (1,4) starts one server per value, colibri-pN",
    )
    ap.add_argument(
        "--step-tokens",
        default="",
        help="serve --step-tokens; a list (32,128) starts one server per value (with one --parallel), colibri-sN",
    )
    ap.add_argument("--rates", default="0.25,0.5,1,2", help="arrival rates, requests per second")
    ap.add_argument("--requests", type=int, default=24, help="requests per rate and target")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1000, help="prompt ids are drawn from 10 .. vocab - 1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the table (markdown) and the raw results (JSON) here")
    a = ap.parse_args(argv)
    targets = [t.split("=", 1) for t in a.target]
    if any(len(t) != 2 for t in targets):
        ap.error("--target takes NAME=URL")
    procs = []
    if a.model_dir:
        parallels = [int(v) for v in a.parallel.split(",")]
        steps = [int(v) for v in a.step_tokens.split(",")] if a.step_tokens else [None]
        if len(parallels) > 1 and len(steps) > 1:
            ap.error("give a list to --parallel or to --step-tokens, not both")
        configs = [(n, st) for n in parallels for st in steps]
        for k, (n, st) in enumerate(configs):
            proc, url = start_colibri(a.model_dir, a.threads, n, () if st is None else ("--step-tokens", str(st)))
            procs.append(proc)
            name = "colibri" if len(configs) == 1 else f"colibri-p{n}" if len(parallels) > 1 else f"colibri-s{st}"
            targets.insert(k, [name, url])
    if not targets:
        ap.error("give --target NAME=URL or --model-dir D")
    rates = [float(r) for r in a.rates.split(",")]
    # new prompts for every rate (the same for every target): llama-server keeps a cache of earlier
    # prompts in host memory, and a prompt seen at an earlier rate would skip its prefill there
    prompts = [
        [
            np.random.default_rng((a.seed, k, i)).integers(10, a.vocab, a.prompt_tokens).tolist()
            for i in range(a.requests)
        ]
        for k in range(len(rates) + 1)
    ]
    rows = []
    try:
        models = {name: model_id(url) for name, url in targets}
        for name, url in targets:  # warm: page in the weights, compile nothing
            asyncio.run(run_rate(url, models[name], 100.0, 1, prompts[-1], 4, a.seed))
        for k, rate in enumerate(rates):
            for name, url in targets:
                r = asyncio.run(run_rate(url, models[name], rate, a.requests, prompts[k], a.gen_tokens, a.seed))
                r["target"] = name
                rows.append(r)
                print(
                    f"[serve_load] {name} at {rate} req/s: TTFT P99 {r['ttft_p99'] * 1e3:.0f} ms, "
                    f"E2E P99 {r['e2e_p99']:.2f} s, {r['throughput']:.1f} tok/s, {r['n_errors']} errors",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=60)
    head = (
        "| target | rate req/s | ok | TTFT P50 / P99 ms | ITL P50 / P99 ms | E2E P50 / P99 s | tok/s |\n"
        "|---|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head] + [
        f"| {r['target']} | {r['rate']:g} | {r['ok']}/{r['requests']} | "
        f"{r['ttft_p50'] * 1e3:.0f} / {r['ttft_p99'] * 1e3:.0f} | {r['itl_p50'] * 1e3:.1f} / "
        f"{r['itl_p99'] * 1e3:.1f} | {r['e2e_p50']:.2f} / {r['e2e_p99']:.2f} | {r['throughput']:.1f} |"
        for r in rows
    ]
    table = "\n".join(lines)
    print(table)
    if a.out:
        with open(a.out, "w") as f:
            f.write(f"`{' '.join(['python', 'tools/bench/serve_load.py'] + (argv or sys.argv[1:]))}`\n\n{table}\n")
        with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
