#!/usr/bin/env python3
"""Soak: `python -m colibri serve --parallel N` under a saturating mix of everything a server meets,
for a given time, then stopped with a signal while requests run.

Closed-loop clients (--clients, more than the places: the engine never idles) each pick a scenario
at random (weights in SCENARIOS) and send it as soon as the last one ended:
  valid    chat completions, completions, Anthropic Messages, OpenAI Responses, whole and streamed,
           some with tools, some with a JSON schema (response_format, output_config.format,
           text.format; the bundled demo model cannot write JSON: a 422 constraint_failed),
           /tokenize, count_tokens, /v1/models, /health;
  rude     a stream dropped after a few events, a request dropped as soon as it is sent (its
           prompt not yet computed), a reader that takes its events slowly;
  invalid  a body that is not JSON, an unknown field, a prompt past the context, a body over
           16 MiB by its Content-Length, bytes that are not HTTP.
Recorded: requests by scenario and outcome (the status; a stream's error event counts as its
error's status; "dropped" where the client dropped it), the 5xx among valid requests (the target
is 0), the server's RSS, open file descriptors and threads over time (/proc/PID, every
--sample-every s), latency percentiles (P50, P99, end to end, valid requests answered 2xx, less
the slow readers, whose pace is their own) by minute, and /metrics against the requests sent: every request that reached the app counted
once by colibri_requests_total (not the bytes that are not HTTP: the connection refuses them),
nothing left queued, running or being prepared. At the end, --drain streams are started and
the server is sent --stop-signal (SIGTERM by default; SIGHUP stops it the same way): each stream
should finish, new connections be refused, and the server exit 0.

    python tools/bench/soak.py --parallel 2 --minutes 30 --out tools/bench/results/DATE-soak-HOST.json
    python tools/bench/soak.py --seconds 5 --clients 4     # a smoke run

The model is the bundled demo (what `serve` loads without --model-dir) unless --model-dir is
given. Needs httpx (the test extra). Linux (/proc) for the RSS and descriptor samples.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "bench"))
from provenance import write_results  # noqa: E402
from servers import Server  # noqa: E402

NAME = "soak"  # --model-name: the name every body gives
TIMEOUT = 300  # seconds a client waits for one request (far beyond any answer under this load)
WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing in the old tree".split()
TOOLS = [
    {"name": "get_weather", "description": "the weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"name": "add", "description": "a + b", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}},
]  # fmt: skip
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}, "required": ["name"]}
OVER = 17 << 20  # a Content-Length over the server's 16 MiB


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Soak:
    def __init__(self, args, server: Server):
        self.args, self.server = args, server
        self.rng = random.Random(args.seed)
        self.t0 = time.monotonic()
        self.counts = Counter()  # (scenario, outcome) -> requests
        self.latencies = defaultdict(list)  # minute -> end-to-end seconds of valid 2xx requests
        self.per_minute = defaultdict(Counter)  # minute -> outcome class -> requests
        self.server_errors = []  # (scenario, outcome, detail) of every 5xx
        self.reached = Counter()  # requests that reached the app (the metrics' side), by endpoint
        self.samples = []  # (seconds, rss MB, fds, threads)
        self.baseline = Counter()  # what /metrics counted before the load (the start's /health polls)
        self.client = None

    # -- bookkeeping --

    def record(self, scenario: str, outcome: str, started: float, valid: bool, detail: str = "") -> None:
        self.counts[(scenario, outcome)] += 1
        minute = int((started - self.t0) // 60)
        kind = outcome if outcome in ("dropped", "transport") else outcome[0] + "xx"
        self.per_minute[minute][kind] += 1
        if outcome[0] == "2" and valid and scenario != "slow_reader":  # (whose pace is its own)
            self.latencies[minute].append(time.monotonic() - started)
        if outcome[0] == "5":
            self.server_errors.append((scenario, outcome, detail[:300]))

    def sample(self) -> None:
        pid = self.server.proc.pid
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            return
        field = {ln.split(":")[0]: ln.split(":")[1].split() for ln in status.splitlines() if ":" in ln}
        rss = int(field["VmRSS"][0]) / 1024
        self.samples.append((round(time.monotonic() - self.t0, 1), round(rss, 1), fds, int(field["Threads"][0])))

    async def sampler(self, until: float) -> None:
        while time.monotonic() < until:
            self.sample()
            await asyncio.sleep(self.args.sample_every)

    # -- HTTP --

    async def post(self, path: str, body, endpoint: str, scenario: str, valid: bool = True, stream: bool = False):
        started = time.monotonic()
        self.reached[endpoint] += 1
        try:
            if not stream:
                r = await self.client.post(path, json=body)
                self.record(scenario, str(r.status_code), started, valid, r.text)
                return
            async with self.client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    self.record(scenario, str(r.status_code), started, valid, r.text)
                    return
                outcome, detail = await self.read_stream(r, scenario)
                self.record(scenario, outcome, started, valid, detail)
        except Exception as e:  # noqa: BLE001 - a transport failure is an outcome of its own
            self.record(scenario, "transport", started, valid, repr(e))

    async def read_stream(self, r, scenario: str) -> tuple:
        """("200", "") for a stream that ended as its API ends one; ("dropped", "") where this
        client dropped it; the error event's status; ("truncated", last lines) otherwise."""
        slow = scenario == "slow_reader"
        drop_after = 3 if scenario == "drop_stream" else None
        seen, last, event = 0, [], None
        async for line in r.aiter_lines():
            if not line:
                continue
            seen += 1
            last = (last + [line])[-3:]
            if drop_after is not None and seen >= drop_after:
                return "dropped", ""  # leaving the block closes the connection mid-stream
            if slow and seen < 40:
                await asyncio.sleep(0.05)
            if line.startswith("event: "):
                event = line[len("event: ") :]
                continue
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]" or event in ("message_stop", "response.completed", "response.incomplete"):
                return "200", ""
            if event == "error" or data.startswith('{"error"'):
                return stream_error_status(json.loads(data)), data
        return "truncated", " | ".join(last)

    async def raw(self, data: bytes, scenario: str, read: bool = True, app: str | None = None) -> None:
        """Bytes on a fresh connection; the status of the answer (read=False: closed at once)."""
        started = time.monotonic()
        if app is not None:
            self.reached[app] += 1
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.server.port)
            writer.write(data)
            await writer.drain()
            if not read:
                writer.close()
                self.record(scenario, "dropped", started, True)
                return
            answer = await asyncio.wait_for(reader.read(), TIMEOUT)
            writer.close()
            status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/1.1 ") else "none"
            self.record(scenario, status, started, False, answer[-300:].decode("latin-1"))
        except Exception as e:  # noqa: BLE001
            self.record(scenario, "transport", started, False, repr(e))

    # -- the scenarios --

    def chat_body(self, **extra) -> dict:
        rng = self.rng
        body = {
            "model": NAME,
            "messages": [{"role": "user", "content": words(rng, rng.randint(3, 40))}],
            "max_tokens": rng.randint(4, self.args.max_tokens),
            "temperature": rng.choice([0, 0.7, 1.0]),
            "seed": rng.randint(0, 1 << 30),
        }
        body.update(extra)
        return body

    async def run_one(self, name: str) -> None:
        rng = self.rng
        stream = rng.random() < 0.5
        if name == "chat":
            extra = {}
            if rng.random() < 0.3:
                extra["tools"] = [{"type": "function", "function": t} for t in TOOLS]
            await self.post("/v1/chat/completions", self.chat_body(stream=stream, **extra), "chat", name, stream=stream)
        elif name == "chat_json":
            fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
            body = self.chat_body(stream=stream, response_format=fmt)
            await self.post("/v1/chat/completions", body, "chat", name, stream=stream)
        elif name == "completions":
            body = {"model": NAME, "prompt": words(rng, rng.randint(3, 60)), "max_tokens": rng.randint(4, 48)}
            await self.post("/v1/completions", dict(body, stream=stream), "completions", name, stream=stream)
        elif name == "messages":
            body = self.chat_body(stream=stream)
            body["temperature"] = min(body["temperature"], 1.0)
            if rng.random() < 0.3:
                body["tools"] = [{"name": t["name"], "input_schema": t["parameters"]} for t in TOOLS]
            elif rng.random() < 0.2:
                body["output_config"] = {"format": {"type": "json_schema", "schema": SCHEMA}}
            await self.post("/v1/messages", body, "messages", name, stream=stream)
        elif name == "responses":
            body = {"model": NAME, "input": words(rng, rng.randint(3, 40)), "max_output_tokens": rng.randint(4, 48)}
            if rng.random() < 0.3:
                body["tools"] = [{"type": "function", **t} for t in TOOLS]
            elif rng.random() < 0.2:
                body["text"] = {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}}
            await self.post("/v1/responses", dict(body, stream=stream), "responses", name, stream=stream)
        elif name == "tokenize":
            await self.post("/tokenize", {"content": words(rng, 50)}, "tokenize", name)
        elif name == "count_tokens":
            body = {"model": NAME, "messages": [{"role": "user", "content": words(rng, 20)}]}
            await self.post("/v1/messages/count_tokens", body, "count_tokens", name)
        elif name == "models":
            started = time.monotonic()
            self.reached["models"] += 1
            r = await self.client.get("/v1/models")
            self.record(name, str(r.status_code), started, True, r.text)
        elif name in ("drop_stream", "slow_reader"):
            body = self.chat_body(stream=True, max_tokens=self.args.max_tokens, ignore_eos=True)
            await self.post("/v1/chat/completions", body, "chat", name, stream=True)
        elif name == "drop_prefill":  # sent whole, dropped before its prompt is computed
            body = json.dumps(self.chat_body(messages=[{"role": "user", "content": words(rng, 300)}])).encode()
            head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
            await self.raw(head.encode() + body, name, read=False, app="chat")
        elif name == "bad_json":
            started = time.monotonic()
            self.reached["chat"] += 1
            r = await self.client.post(
                "/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"}
            )
            self.record(name, str(r.status_code), started, False, r.text)
        elif name == "unknown_field":
            await self.post("/v1/chat/completions", self.chat_body(max_token=5), "chat", name, valid=False)
        elif name == "over_context":
            body = {"model": NAME, "prompt": words(rng, 2000), "max_tokens": 4}
            await self.post("/v1/completions", body, "completions", name, valid=False)
        elif name == "oversized":  # refused by its Content-Length before a byte is read
            head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {OVER}\r\n\r\n"
            await self.raw(head.encode(), name, app="chat")
        elif name == "not_http":
            await self.raw(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 hello\r\n\r\n", name)
        elif name == "health":
            started = time.monotonic()
            self.reached["health"] += 1
            r = await self.client.get("/health")
            self.record(name, str(r.status_code), started, True, r.text)
        else:
            raise AssertionError(name)

    async def worker(self, until: float) -> None:
        names = list(SCENARIOS)
        weights = [SCENARIOS[n] for n in names]
        while time.monotonic() < until:
            await self.run_one(self.rng.choices(names, weights)[0])

    # -- /metrics --

    async def metrics(self) -> str:
        self.reached["metrics"] += 1
        return (await self.client.get("/metrics")).text

    async def counted(self) -> tuple:
        """(requests counted by colibri_requests_total by endpoint, since the baseline, the
        gauges of what is queued, running, being prepared)."""
        text = await self.metrics()
        gauges = {
            name: sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name))
            for name in ("colibri_queue_depth", "colibri_running_requests", "colibri_preparing_requests")
        }
        counted = Counter()
        for ln in text.splitlines():
            if ln.startswith("colibri_requests_total{"):
                endpoint = ln.split('endpoint="', 1)[1].split('"', 1)[0]
                counted[endpoint] += float(ln.split()[-1])
        counted.subtract(self.baseline)
        return +counted, gauges

    async def settled_metrics(self) -> dict:
        """/metrics once nothing runs, waits or is prepared (a dropped request may still be
        ending on the server): the counted requests by endpoint and the gauges."""
        for _ in range(100):
            counted, gauges = await self.counted()
            # every request sent has been counted (the scrape itself is counted after it is sent)
            if not any(gauges.values()) and sum(counted.values()) >= sum(self.reached.values()) - 1:
                break
            await asyncio.sleep(0.1)
        return {"counted": counted, "gauges": gauges}

    # -- the stop --

    async def drain(self) -> dict:
        """--drain streams started, the signal sent once each has its first event: each should
        end as its API ends a stream, a new connection be refused, the server exit 0."""
        import httpx

        firsts = [asyncio.Event() for _ in range(self.args.drain)]

        async def one(i: int) -> str:
            body = self.chat_body(stream=True, max_tokens=self.args.drain_tokens, ignore_eos=True)
            try:
                async with self.client.stream("POST", "/v1/chat/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        firsts[i].set()
                        if line == "data: [DONE]":
                            return "completed"
                return "truncated"
            except Exception as e:  # noqa: BLE001
                firsts[i].set()
                return f"transport {type(e).__name__}"

        tasks = [asyncio.ensure_future(one(i)) for i in range(self.args.drain)]
        for f in firsts:
            await f.wait()
        sig = {"term": signal.SIGTERM, "hup": signal.SIGHUP}[self.args.stop_signal]
        sent = time.monotonic()
        self.server.proc.send_signal(sig)
        await asyncio.sleep(0.5)
        try:
            async with httpx.AsyncClient(base_url=self.server.url, timeout=5) as fresh:
                await fresh.get("/health")
            refused = False
        except httpx.TransportError:
            refused = True
        outcomes = Counter(await asyncio.gather(*tasks))
        code = await asyncio.get_running_loop().run_in_executor(None, self.server.proc.wait, 120)
        return {
            "signal": self.args.stop_signal,
            "streams": dict(outcomes),
            "new_connection_refused": refused,
            "exit_code": code,
            "seconds_to_exit": round(time.monotonic() - sent, 2),
        }


# scenario -> weight (a request's chance to be that scenario, relative)
SCENARIOS = {
    "chat": 20,
    "chat_json": 4,
    "completions": 10,
    "messages": 12,
    "responses": 12,
    "tokenize": 3,
    "count_tokens": 3,
    "models": 2,
    "health": 2,
    "drop_stream": 4,
    "drop_prefill": 3,
    "slow_reader": 3,
    "bad_json": 2,
    "unknown_field": 2,
    "over_context": 2,
    "oversized": 2,
    "not_http": 2,
}
VALID = {"chat", "chat_json", "completions", "messages", "responses", "tokenize", "count_tokens", "models", "health"}
VALID |= {"drop_stream", "drop_prefill", "slow_reader"}


def stream_error_status(doc: dict) -> str:
    """The status an error event stands for: OpenAI's {"error": {type, code}}, Anthropic's
    {"type": "error", "error": {type}}, the Responses API's {"type": "error", "code"}."""
    err = doc["error"] if isinstance(doc.get("error"), dict) else doc
    if err.get("code") == "constraint_failed":
        return "422"
    if err.get("type") == "invalid_request_error":
        return "400"
    return "500"


def percentile(values: list, q: float):
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 4)


def summarize(soak: Soak, seconds: float, metrics: dict, drain: dict, log: str) -> dict:
    by_outcome = Counter()
    for (_, outcome), n in soak.counts.items():
        by_outcome[outcome] += n
    valid_5xx = sum(n for (s, o), n in soak.counts.items() if s in VALID and o[0] == "5")
    none = (None,) * 4
    first, last = (soak.samples[0], soak.samples[-1]) if soak.samples else (none, none)
    warm = next((x for x in soak.samples if x[0] >= 60), last)  # after a minute: caches and pools filled
    at_minute = {int(t // 60): {"rss_mb": rss, "fds": fds} for t, rss, fds, _ in soak.samples}
    counted = metrics["counted"]
    sent = soak.reached
    endpoints = sorted(set(sent) | set(counted))
    return {
        "seconds": round(seconds, 1),
        "requests": sum(soak.counts.values()),
        "by_outcome": dict(sorted(by_outcome.items())),
        "five_xx_valid": valid_5xx,
        "five_xx_all": sum(n for o, n in by_outcome.items() if o[0] == "5"),
        "rss_mb": {
            "first": first[1],
            "after_1_min": warm[1],
            "last": last[1],
            "max": max((s[1] for s in soak.samples), default=None),
        },
        "fds": {
            "first": first[2],
            "after_1_min": warm[2],
            "last": last[2],
            "max": max((s[2] for s in soak.samples), default=None),
        },
        "threads": {
            "first": first[3],
            "after_1_min": warm[3],
            "last": last[3],
            "max": max((s[3] for s in soak.samples), default=None),
        },
        "metrics": {
            "sent": sum(sent.values()),
            "counted": int(sum(counted.values())),
            # the settling scrape that read them is counted only after it was sent
            "equal": sum(sent.values()) - 1 == int(sum(counted.values())),
            "by_endpoint": {e: [sent.get(e, 0), int(counted.get(e, 0))] for e in endpoints},
            "left": metrics["gauges"],
        },
        # by minute of the load: P50 / P99 seconds of its valid 2xx requests, and the server's RSS
        # (MB) and descriptors at the minute's last sample
        "latency_by_minute": {
            m: {"n": len(v), "p50": percentile(v, 0.5), "p99": percentile(v, 0.99), **at_minute.get(m, {})}
            for m, v in sorted(soak.latencies.items())
        },
        "drain": drain,
        "log": {"tracebacks": log.count("Traceback"), "error_lines": sum("ERROR" in ln for ln in log.splitlines())},
    }


async def main_async(args, server: Server) -> tuple:
    import httpx

    soak = Soak(args, server)
    seconds = args.seconds if args.seconds is not None else args.minutes * 60
    limits = httpx.Limits(max_connections=args.clients * 2, max_keepalive_connections=args.clients * 2)
    async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT, limits=limits) as client:
        soak.client = client
        soak.baseline, _ = await soak.counted()  # this scrape is counted from here on
        soak.t0 = time.monotonic()
        until = soak.t0 + seconds
        sampler = asyncio.ensure_future(soak.sampler(until + 3600))
        await asyncio.gather(*(soak.worker(until) for _ in range(args.clients)))
        elapsed = time.monotonic() - soak.t0
        metrics = await soak.settled_metrics()
        soak.sample()
        sampler.cancel()
        drain = await soak.drain()
    return soak, elapsed, metrics, drain


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="default: the bundled demo model")
    p.add_argument("--parallel", type=int, default=2, help="serve --parallel (default 2)")
    p.add_argument("--threads", type=int, default=1, help="serve --threads (default 1)")
    p.add_argument("--minutes", type=float, default=30, help="how long the load runs (default 30)")
    p.add_argument("--seconds", type=float, help="how long the load runs, in seconds (instead of --minutes)")
    p.add_argument("--clients", type=int, help="clients sending at once (default 4 x --parallel + 2: saturating)")
    p.add_argument("--max-tokens", type=int, default=48, help="the most tokens a valid request asks for")
    p.add_argument("--max-queue", type=int, default=64, help="serve --max-queue (default 64: no 503 for the clients)")
    p.add_argument("--cache-ram", default="64", help="serve --cache-ram MB (default 64: the prefix store fills early)")
    p.add_argument("--sample-every", type=float, default=10, help="seconds between RSS / fd samples")
    p.add_argument("--drain", type=int, default=3, help="streams running when the stop signal comes")
    p.add_argument("--drain-tokens", type=int, default=200, help="tokens of each of those streams")
    p.add_argument("--stop-signal", choices=("term", "hup"), default="term")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="results JSON (tools/bench/results/DATE-soak-HOST.json)")
    args = p.parse_args()
    if args.clients is None:
        args.clients = 4 * args.parallel + 2
    model = ["--model-dir", args.model_dir] if args.model_dir else []
    server = Server(
        lambda port: [
            sys.executable, "-m", "colibri", "serve", *model, "--port", str(port), "--parallel", str(args.parallel),
            "--threads", str(args.threads), "--max-queue", str(args.max_queue), "--model-name", NAME, "--quiet", "--cache-ram", args.cache_ram,
        ],
        "colibri",
    )  # fmt: skip
    soak, elapsed, metrics, drain = asyncio.run(main_async(args, server))
    log = _whole_log(server)
    summary = summarize(soak, elapsed, metrics, drain, log)
    per_minute = {m: dict(c) for m, c in sorted(soak.per_minute.items())}
    outcomes = {f"{s} {o}": n for (s, o), n in sorted(soak.counts.items())}
    write_results(
        args.out,
        args,
        summary=summary,
        outcomes=outcomes,
        per_minute=per_minute,
        samples=[{"s": s, "rss_mb": r, "fds": f, "threads": t} for s, r, f, t in soak.samples],
        server_errors=soak.server_errors[:50],
        log_tail=log[-3000:],
    )
    ok = summary["five_xx_valid"] == 0 and summary["metrics"]["equal"] and drain["exit_code"] == 0
    return 0 if ok else 1


def _whole_log(server: Server) -> str:
    server.log.seek(0)
    return server.log.read()


if __name__ == "__main__":
    sys.exit(main())
