"""`python -m colibri serve`: an OpenAI-compatible HTTP server over one Model.

Design
------
Starlette (routing, request/response, server-sent events) under uvicorn, prometheus_client for
/metrics: the optional extra `colibri[serve]`. One Model holds one KV cache, so one generation
runs at a time (the design): requests wait in a FIFO (asyncio.Lock wakes its waiters in order)
bounded by `max_queue` — beyond it, and after `queue_timeout` seconds of waiting, the answer is
503 with Retry-After. The engine runs on one worker thread; the event loop only parses, queues
and writes. A stream advances one token per hop to that thread, so a client that disconnects
stops its generation after the token being computed (the generator is closed on the same
thread, then the next request starts). Repeated prefixes (multi-turn chat, a shared system
prompt) reuse the KV cache through Model.generate's prefix reuse.

Endpoints, in OpenAI's shapes: POST /v1/chat/completions, POST /v1/completions (whole, or
streamed as `data: {...}` chunks and `data: [DONE]`; `stream_options.include_usage`), GET
/v1/models, GET /health (503 while the model loads, 200 when ready), GET /metrics (Prometheus
text). Errors are `{"error": {"message", "type", "param", "code"}}` with the status OpenAI uses.
Parameters: messages / prompt, max_tokens (max_completion_tokens), temperature, top_p, top_k,
min_p, repetition_penalty, presence_penalty, frequency_penalty, stop, seed, logprobs /
top_logprobs, n = 1, stream, chat_template_kwargs, ignore_eos. Unset sampling values take the checkpoint's
generation_config.json defaults (as `run` does), then greedy.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import math
import signal
import threading
import time
import uuid

from .errors import ColibriError

MAX_STOP_STRINGS = 4                   # OpenAI's limit
MAX_BODY_BYTES = 16 << 20              # a request body larger than this is refused (413)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16    # OpenAI's legacy completions default
RETRY_AFTER_SECONDS = 1


def _need_stack():
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ColibriError(f"serve needs the server extra ({e.name} is missing): pip install \"colibri[serve]\"") from None


class APIError(Exception):
    """An OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ---- request bodies --------------------------------------------------------------------------------

_NUMBER = (int, float)


def _field(body: dict, name: str, kinds, default=None, check=None, what: str = ""):
    """body[name] if it is one of `kinds` (JSON true/false is not a number) and passes `check`;
    the default when absent or null; else a 400 naming the field."""
    if name not in body or body[name] is None:
        return default
    v = body[name]
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    ok = (bool in kinds) if isinstance(v, bool) else isinstance(v, kinds)
    if ok and isinstance(v, float) and not math.isfinite(v):
        ok = False
    if not ok or (check is not None and not check(v)):
        raise APIError(400, f"'{name}' must be {what}, got {json.dumps(v)[:80]}", param=name)
    return v


def _stop_list(body: dict) -> list:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings", param="stop")
    return [s for s in stops if s]


def _text_of(content):
    """A message's content for a text-only model: a string, or the text parts joined."""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, "only text content parts ({'type': 'text', 'text': ...}) are supported",
                               param="messages")
            parts.append(part["text"])
        return "".join(parts)
    return content


def sampling_options(body: dict) -> dict:
    """The Model.generate keywords a request asks for."""
    out = dict(
        temperature=_field(body, "temperature", _NUMBER, None, lambda v: 0 <= v <= 2, "a number in [0, 2]"),
        top_p=_field(body, "top_p", _NUMBER, None, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        top_k=_field(body, "top_k", int, None, lambda v: v >= 0, "an integer >= 0"),
        min_p=_field(body, "min_p", _NUMBER, None, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        repetition_penalty=_field(body, "repetition_penalty", _NUMBER, None, lambda v: v > 0, "a number > 0"),
        presence_penalty=_field(body, "presence_penalty", _NUMBER, 0.0, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
        frequency_penalty=_field(body, "frequency_penalty", _NUMBER, 0.0, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
        seed=_field(body, "seed", int, 0, lambda v: v >= 0, "a non-negative integer"),
        stop_at_eos=not _field(body, "ignore_eos", bool, False, what="true or false"),   # vLLM's, llama-server's
    )
    n = _field(body, "n", int, 1, lambda v: v >= 1, "a positive integer")
    if n != 1:
        raise APIError(400, "only n = 1 is supported (one generation per request)", param="n")
    return out


# ---- the served model ----------------------------------------------------------------------------------

class Served:
    """The model, its worker thread, the FIFO in front of it and the metrics."""

    def __init__(self, load, name: str, api_key: str | None, max_queue: int, queue_timeout: float):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.load, self.name, self.api_key = load, name, api_key
        self.max_queue, self.queue_timeout = max_queue, queue_timeout
        self.model = None
        self.load_error = None
        self.created = int(time.time())
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="colibri-engine")
        self.lock = None                       # asyncio.Lock, made on the server's loop
        self.waiting = 0
        r = self.registry = CollectorRegistry()
        self.requests = Counter("colibri_requests", "requests by endpoint and outcome", ["endpoint", "outcome"], registry=r)
        self.queue_depth = Gauge("colibri_queue_depth", "requests waiting for the engine", registry=r)
        self.ttft = Histogram("colibri_time_to_first_token_seconds", "request arrival to first token", registry=r,
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.itl = Histogram("colibri_inter_token_latency_seconds", "time between tokens of a stream", registry=r,
                             buckets=(.002, .005, .01, .02, .05, .1, .2, .5, 1, 2))
        self.tokens_in = Counter("colibri_prompt_tokens", "prompt tokens received", registry=r)
        self.tokens_out = Counter("colibri_generated_tokens", "tokens generated", registry=r)
        self.reused = Counter("colibri_prefix_reused_tokens", "prompt tokens the KV cache already held", registry=r)
        self.reuse_hits = Counter("colibri_prefix_reuse_hits", "requests that reused part of the KV cache", registry=r)
        self.resident = Gauge("colibri_resident_expert_bytes", "expert weights resident", registry=r)
        self.faults = Gauge("colibri_major_page_faults", "major page faults of the process", registry=r)
        self.cache_uses = Gauge("colibri_expert_cache_uses", "expert uses since load, by whether the expert "
                                "cache held it", ["result"], registry=r)
        self.evictions = Gauge("colibri_expert_evictions", "experts evicted under the budget since load", registry=r)
        self.storage_read = Gauge("colibri_storage_read_bytes", "bytes read from storage since load", registry=r)
        self.budget = Gauge("colibri_expert_budget_bytes", "the expert budget (0: none)", registry=r)
        self.cgroup_usage = Gauge("colibri_cgroup_usage_bytes", "the enforcing cgroup's usage, page cache "
                                  "included (0: unknown)", registry=r)

    def start_loading(self) -> None:
        def run():
            try:
                self.model = self.load()
            except Exception as e:          # noqa: BLE001 - reported by /health and each request
                self.load_error = str(e)
        threading.Thread(target=run, name="colibri-load", daemon=True).start()

    def ready(self):
        if self.model is None:
            if self.load_error:
                raise APIError(500, f"the model failed to load: {self.load_error}", kind="server_error")
            raise APIError(503, "the model is still loading", kind="server_error", code="loading")
        return self.model

    async def acquire(self) -> None:
        if self.lock is None:
            self.lock = asyncio.Lock()
        if self.waiting >= self.max_queue and self.lock.locked():
            raise APIError(503, f"the queue is full ({self.max_queue} waiting); retry later", kind="server_error",
                           code="queue_full")
        self.waiting += 1
        self.queue_depth.set(self.waiting)
        try:
            await asyncio.wait_for(self.lock.acquire(), self.queue_timeout)
        except asyncio.TimeoutError:
            raise APIError(503, f"waited {self.queue_timeout:g} s for the engine; retry later", kind="server_error",
                           code="queue_timeout") from None
        finally:
            self.waiting -= 1
            self.queue_depth.set(self.waiting)

    def finish(self, g) -> None:
        """End a generation without awaiting (it may run in a cancelled task): close its generator
        on the engine thread — after the step in flight, the executor being FIFO — then free the
        engine for the next request."""
        loop = asyncio.get_running_loop()
        done = self.executor.submit(g.events.close)
        done.add_done_callback(lambda _: loop.call_soon_threadsafe(self.lock.release))

    async def on_engine(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def observe_memory(self) -> None:
        if self.model is not None:
            try:
                st = self.model.memory_stats()
            except ColibriError:
                return
            self.resident.set(st.get("resident_expert_bytes") or 0)
            self.faults.set(st.get("major_page_faults") or 0)
            self.cache_uses.labels("hit").set(st["cache_hits"])
            self.cache_uses.labels("miss").set(st["cache_misses"])
            self.evictions.set(st["experts_released"])
            self.storage_read.set(st["bytes_read_from_storage"] or 0)
            self.budget.set(st["expert_budget_bytes"] or 0)
            self.cgroup_usage.set(st["cgroup_usage_bytes"] or 0)


# ---- one generation ----------------------------------------------------------------------------------

def _prepare(served: Served, body, chat: bool):
    """(model, prompt ids, generate keywords, stop strings, logprobs n or None, stream, include_usage)."""
    m = served.ready()
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    name = body.get("model")
    if name is not None and name != served.name:
        raise APIError(404, f"the model '{str(name)[:100]}' does not exist; this server serves '{served.name}'",
                       param="model", code="model_not_found")
    stream = _field(body, "stream", bool, False, what="true or false")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise APIError(400, "'stream_options' must be an object", param="stream_options")
    include_usage = bool(opts.get("include_usage", False))
    gen = sampling_options(body)
    stops = _stop_list(body)
    try:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise APIError(400, "'messages' must be a non-empty list of messages", param="messages")
            msgs = []
            for i, msg in enumerate(messages):
                if not isinstance(msg, dict):
                    raise APIError(400, f"messages[{i}] must be an object", param="messages")
                msgs.append({**msg, "content": _text_of(msg.get("content"))})
            kwargs = body.get("chat_template_kwargs") or {}
            if not isinstance(kwargs, dict):
                raise APIError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs")
            tools = body.get("tools")
            ids = m.apply_chat_template(msgs, add_generation_prompt=True, tools=tools, **kwargs)
            want = _field(body, "max_completion_tokens", int, None, lambda v: v >= 1, "a positive integer")
            want = _field(body, "max_tokens", int, want, lambda v: v >= 1, "a positive integer")
            if body.get("logprobs") not in (None, False, True):
                raise APIError(400, "'logprobs' must be true or false", param="logprobs")
            top = _field(body, "top_logprobs", int, 0, lambda v: 0 <= v <= 20, "an integer in [0, 20]")
            logprobs = top if body.get("logprobs") else None
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = m.encode(prompt)
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                ids = prompt
            else:
                raise APIError(400, "'prompt' must be a string, or a list of token ids (one prompt per request)",
                               param="prompt")
            if body.get("echo"):
                raise APIError(400, "'echo' is not supported", param="echo")
            want = _field(body, "max_tokens", int, COMPLETIONS_DEFAULT_MAX_TOKENS, lambda v: v >= 1, "a positive integer")
            logprobs = _field(body, "logprobs", int, None, lambda v: 0 <= v <= 20, "an integer in [0, 20]")
    except ColibriError as e:
        raise APIError(400, str(e)) from None
    room = m.n_ctx - len(ids)
    if room < 1:
        raise APIError(400, f"the prompt has {len(ids)} tokens; the context is {m.n_ctx}", param="messages" if chat else "prompt",
                       code="context_length_exceeded")
    if want is None:
        want = room
    elif want > room:
        raise APIError(400, f"max_tokens {want} + the prompt's {len(ids)} tokens exceed the context of {m.n_ctx}",
                       param="max_tokens", code="context_length_exceeded")
    return m, ids, dict(gen, max_new_tokens=want, logprobs=logprobs), stops, logprobs, stream, include_usage


def _token_text(m, token: int) -> str:
    return m.tokenizer.decode([token])


def _chat_logprob(m, pick, top: int) -> dict:
    text = _token_text(m, pick.token)
    return {"token": text, "logprob": pick.logprob, "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": (t := _token_text(m, i)), "logprob": lp, "bytes": list(t.encode("utf-8"))}
                             for i, lp in pick.top[:top]]}


class Generation:
    """Drives one Model.stream_tokens on the engine thread; collects text, logprobs and timings."""

    def __init__(self, served: Served, m, ids, gen: dict, stops):
        self.served, self.m = served, m
        self.t0 = time.perf_counter()
        self.events = m.stream_tokens(ids, stop=stops, **gen)     # checks run here
        self.record = m.last_generation
        self.prompt_tokens = len(ids)
        self.last_token_at = None

    def step(self):
        """The next event, or None at the end (runs on the engine thread)."""
        try:
            return next(self.events)
        except StopIteration:
            return None

    def note_token(self) -> None:
        now = time.perf_counter()
        if self.last_token_at is None:
            self.served.ttft.observe(now - self.t0)
        else:
            self.served.itl.observe(now - self.last_token_at)
        self.last_token_at = now

    def usage(self) -> dict:
        n = len(self.record.tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}

    def account(self) -> None:
        s = self.served
        s.tokens_in.inc(self.prompt_tokens)
        s.tokens_out.inc(len(self.record.tokens))
        if self.record.reused_tokens:
            s.reuse_hits.inc()
            s.reused.inc(self.record.reused_tokens)


# ---- the app ------------------------------------------------------------------------------------------

def create_app(served: Served):
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    def error_response(e: APIError, endpoint: str):
        served.requests.labels(endpoint, str(e.status)).inc()
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if e.status == 503 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    def check_key(request: Request) -> None:
        if served.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        if auth != f"Bearer {served.api_key}":
            raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY)", kind="authentication_error",
                           code="invalid_api_key")

    async def read_body(request: Request):
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES >> 20} MB")
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as e:
            raise APIError(400, f"the request body is not valid JSON ({str(e)[:100]})") from None

    async def health(request: Request):
        if served.model is not None:
            return JSONResponse({"status": "ok"})
        if served.load_error:
            return JSONResponse({"status": "error", "error": served.load_error}, status_code=500)
        return JSONResponse({"status": "loading"}, status_code=503)

    async def models(request: Request):
        try:
            check_key(request)
        except APIError as e:
            return error_response(e, "models")
        return JSONResponse({"object": "list", "data": [{"id": served.name, "object": "model",
                                                         "created": served.created, "owned_by": "colibri"}]})

    async def metrics(request: Request):
        served.observe_memory()
        return Response(generate_latest(served.registry), media_type=CONTENT_TYPE_LATEST)

    async def completion(request: Request, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            check_key(request)
            body = await read_body(request)
            m, ids, gen, stops, logprobs, stream, include_usage = _prepare(served, body, chat)
        except APIError as e:
            return error_response(e, endpoint)
        try:
            await served.acquire()
        except APIError as e:
            return error_response(e, endpoint)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"
        try:
            g = await served.on_engine(Generation, served, m, ids, gen, stops)
        except ColibriError as e:
            served.lock.release()
            return error_response(APIError(400, str(e)), endpoint)
        if not stream:
            return await whole(g, rid, obj, chat, logprobs, endpoint)
        return StreamingResponse(streamed(g, rid, obj, chat, logprobs, include_usage, endpoint),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def whole(g: Generation, rid, obj, chat, logprobs, endpoint):
        text, picks = [], []
        try:
            while (ev := await served.on_engine(g.step)) is not None:
                piece, pick = ev
                text.append(piece)
                if pick is not None:
                    g.note_token()
                    picks.append(pick)
        except ColibriError as e:
            return error_response(APIError(500, str(e), kind="server_error"), endpoint)
        finally:
            served.finish(g)
        g.account()
        served.requests.labels(endpoint, "200").inc()
        content = "".join(text)
        choice = {"index": 0, "finish_reason": g.record.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": content}
            choice["logprobs"] = None if logprobs is None else {"content": [_chat_logprob(g.m, p, logprobs) for p in picks]}
        else:
            choice["text"] = content
            choice["logprobs"] = None if logprobs is None else _completion_logprobs(g.m, picks, logprobs)
        return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": served.name,
                             "choices": [choice], "usage": g.usage()})

    async def streamed(g: Generation, rid, obj, chat, logprobs, include_usage, endpoint):
        created = int(time.time())
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choice, usage=None):
            doc = {"id": rid, "object": chunk_obj, "created": created, "model": served.name,
                   "choices": [choice] if choice is not None else []}
            if include_usage:
                doc["usage"] = usage
            return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n"

        finished = False
        try:
            if chat:
                yield event({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
            while (ev := await served.on_engine(g.step)) is not None:
                piece, pick = ev
                if pick is not None:
                    g.note_token()
                if not piece and (logprobs is None or pick is None):
                    continue
                lp = None
                if logprobs is not None and pick is not None:
                    lp = {"content": [_chat_logprob(g.m, pick, logprobs)]} if chat else \
                        _completion_logprobs(g.m, [pick], logprobs)
                choice = ({"index": 0, "delta": {"content": piece}, "logprobs": lp, "finish_reason": None} if chat
                          else {"index": 0, "text": piece, "logprobs": lp, "finish_reason": None})
                yield event(choice)
            last = ({"index": 0, "delta": {}, "logprobs": None, "finish_reason": g.record.finish_reason} if chat
                    else {"index": 0, "text": "", "logprobs": None, "finish_reason": g.record.finish_reason})
            yield event(last)
            if include_usage:
                yield event(None, g.usage())
            yield "data: [DONE]\n\n"
            finished = True
        except ColibriError as e:
            yield f"data: {json.dumps(APIError(500, str(e), kind='server_error').body())}\n\n"
        finally:
            # a client that went away cancels this task (no await works any more): the generator
            # is closed on the engine thread after the token being computed, then the next
            # request may start
            served.finish(g)
            g.account()
            served.requests.labels(endpoint, "200" if finished else "disconnected").inc()

    async def chat_completions(request: Request):
        return await completion(request, chat=True)

    async def completions(request: Request):
        return await completion(request, chat=False)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        served.start_loading()              # /health says 503 until the model is ready
        yield
        served.executor.shutdown(wait=True, cancel_futures=True)

    app = Starlette(routes=[
        Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ], lifespan=lifespan)
    return app


def _completion_logprobs(m, picks, top: int) -> dict:
    tokens = [_token_text(m, p.token) for p in picks]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [p.logprob for p in picks],
            "top_logprobs": [{_token_text(m, i): lp for i, lp in p.top[:top]} for p in picks], "text_offset": offsets}


def serve(load, name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_queue: int = 16, queue_timeout: float = 600.0, log=print) -> None:
    """Run the server until SIGINT/SIGTERM (uvicorn stops accepting, lets the running request
    finish or be cancelled, and returns). `load()` -> Model, called once in the background."""
    _need_stack()
    import uvicorn

    served = Served(load, name, api_key, max_queue, queue_timeout)
    app = create_app(served)
    log(f"[INFO] Serving '{name}' on http://{host}:{port}/v1 (health: /health, metrics: /metrics); "
        f"one generation at a time, up to {max_queue} waiting")
    # uvicorn stops gracefully on SIGTERM and then re-raises the signal under the handler it found:
    # a handler that returns makes that re-raise a no-op, so SIGTERM ends with status 0
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30)
    finally:
        signal.signal(signal.SIGTERM, previous)
