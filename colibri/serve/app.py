"""The HTTP app: routes, authentication, bodies, whole and streamed answers; `serve()` runs it.

Design
------
FastAPI (its routers and the schema at /openapi.json, from serve/protocol.py's models) under
uvicorn, prometheus_client for /metrics: the optional extra `colibri-moe[serve]`. Each route is an
Endpoint: an ASGI handler that sends its own response, so that a stream's headers go out only
once its first generation has started (a 503 stays a 503) and a client's disconnect is seen
between tokens. Endpoints, in OpenAI's shapes: POST /v1/chat/completions, POST /v1/completions
(whole, or streamed as `data: {...}` chunks and `data: [DONE]`; `stream_options.include_usage`;
SSE comment lines while a long prompt runs), GET /v1/models and /v1/models/{id}, POST /tokenize
and /detokenize (llama-server's shapes, vLLM's accepted), GET /health (503 while the model loads
and warms up, 200 when ready), GET /metrics (Prometheus text).

Errors are `{"error": {"message", "type", "param", "code"}}`: 400 for a body that is not JSON, a
field of the wrong type or range, an unknown field or one Colibri does not implement (no field
is silently ignored), 401 for a wrong or missing key (compared in constant time), 404 for another
model's name, 408 for a body that trickles (limits.BODY_SECONDS, and a second per
limits.BODY_BYTES_PER_SECOND of it), 413 for a body over limits.MAX_BODY_BYTES (by
Content-Length before reading, else as soon as the streamed body passes it), 422 for a well-formed request the model cannot process
(the chat template refuses, fails or outlasts limits.PREPARE_SECONDS, the model has no chat
template, prompt token ids outside the vocabulary), 503 (loading, queue full, queue timeout) with
Retry-After, and 500 for anything unexpected — logged with its traceback on the server, never
sent to the client.

A chat reply goes through the reply parser of the model's format (chat.ChatTemplate.reply_stream,
colibri/replies.py): `reasoning_content`, `content` and `tool_calls`, whole and as deltas, and
finish_reason "tool_calls" (serve/openai.py turns the request into that work).

Anthropic's Messages (POST /v1/messages, /v1/messages/count_tokens; serve/anthropic.py) and
OpenAI's Responses (POST /v1/responses; serve/responses.py) are translations onto chat
completions: each turns its request into a chat-completions body prepared by openai.prepare (the
same Job), and the same loop (run_parsed: the engine's events through the reply parser) feeds
every API's formatter, whole (document) or streamed (typed `event:` lines, `translated_stream`).
So a request and seed give the same tokens through all three. Errors on /v1/messages are in
Anthropic's shape ({"type": "error", "error": {"type", "message"}}); the key is accepted as
`x-api-key` too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import signal
import time
import uuid

from .. import __version__
from ..errors import ColibriError
from ..names import DISTRIBUTION, MAX_PARALLEL
from ..sampling import SEED_BITS
from . import anthropic, limits, openai, protocol, responses
from .engine import Served, _Watch
from .errors import APIError, Disconnected, internal_error
from .openai import Job

logger = logging.getLogger("colibri.serve")


# the request bodies documented at /openapi.json (each validates its route's body)
BODIES = (
    protocol.ChatCompletionRequest,
    protocol.CompletionRequest,
    protocol.TokenizeRequest,
    protocol.DetokenizeRequest,
    anthropic.MessagesRequest,
    anthropic.CountTokensRequest,
    responses.ResponsesRequest,
)


@dataclasses.dataclass
class Run:
    """One finished generation of a job: its Generation, reply parser (or None), text, picks and
    the parser's last deltas."""

    g: object
    parser: object
    text: str
    picks: list
    tail: list


def _need_stack():
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ColibriError(
            f'serve needs the server extra ({e.name} is missing): pip install "{DISTRIBUTION}[serve]"'
        ) from None


def create_app(served: Served):
    from fastapi import FastAPI
    from fastapi.openapi.utils import get_openapi
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from pydantic.json_schema import models_json_schema
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response

    def error_response(e: APIError, shape=APIError.body):
        return JSONResponse(shape(e), status_code=e.status, headers=e.headers or None)

    class Endpoint:
        """One route as an ASGI app around `handler(request, send)`, which sends its own
        response. An APIError is answered in OpenAI's shape; any other exception is logged here
        with its traceback and answered with a 500 in the same shape (never the traceback);
        a client that went away gets nothing more. Whatever it held is released by the
        handler's own finally blocks. Every request is counted here, once
        (colibri_requests_total{endpoint, outcome}): the status it was sent, the outcome the
        handler returns (a stream that ended with an error event: that error's status), or
        "disconnected" / "cancelled"."""

        def __init__(self, endpoint: str, handler, shape=APIError.body):
            self.endpoint, self.handler, self.shape = endpoint, handler, shape  # shape(APIError) -> body

        async def __call__(self, scope, receive, send):
            status = None

            async def tracked(message):
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            outcome = None
            try:
                outcome = await self.handler(Request(scope, receive), tracked)
            except Disconnected:
                outcome = "disconnected"
            except asyncio.CancelledError:
                # the ASGI server cancels what outlasts its graceful shutdown: the handler's
                # finally blocks have freed the engine; ending here, not re-raising, keeps a
                # traceback out of the log (uvicorn then closes the connection)
                outcome = "cancelled"
                logger.warning("%s %s cancelled (the server is stopping)", scope.get("method"), scope.get("path"))
            except APIError as e:
                if status is None:
                    await error_response(e, self.shape)(scope, receive, tracked)
            except Exception as e:  # noqa: BLE001 - the catch-all: a 500, the traceback in the log
                logger.error("%s %s failed", scope.get("method"), scope.get("path"), exc_info=e)
                outcome = "500"
                if status is None:
                    await error_response(internal_error(e), self.shape)(scope, receive, tracked)
            finally:
                served.requests.labels(self.endpoint, outcome or str(status)).inc()

    def check_key(request: Request) -> None:
        if served.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
        if "x-api-key" in request.headers and "authorization" not in request.headers:
            scheme, token = "bearer", request.headers["x-api-key"]  # Anthropic's header
        # headers arrive decoded as latin-1: back to the bytes the client sent; the comparison
        # takes the same time wherever the bytes differ
        same = hmac.compare_digest(token.strip().encode("latin-1"), served.api_key.encode("utf-8"))
        if not (same and scheme.lower() == "bearer"):
            raise APIError(
                401,
                "invalid or missing API key (Authorization: Bearer KEY, or x-api-key: KEY)",
                kind="authentication_error",
                code="invalid_api_key",
            )

    async def read_body(request: Request) -> bytes:
        """The body's bytes (parse_body, on a preparation thread, reads them)."""
        limit = limits.MAX_BODY_BYTES
        too_large = APIError(
            413,
            f"the request body is larger than {limit} bytes",
            code="request_too_large",
            headers={"Connection": "close"},
        )
        length = request.headers.get("content-length", "").strip()
        if length.isdigit() and int(length) > limit:
            raise too_large  # refused before a byte of the body is read
        loop = asyncio.get_running_loop()
        start, parts, size, more = loop.time(), [], 0, True
        while more:
            # a body that trickles (slowloris) is cut: BODY_SECONDS, and a second per
            # BODY_BYTES_PER_SECOND of what has come
            left = start + limits.BODY_SECONDS + size / limits.BODY_BYTES_PER_SECOND - loop.time()
            try:
                message = await asyncio.wait_for(request.receive(), max(left, 0))
            except asyncio.TimeoutError:
                raise APIError(
                    408,
                    f"the request body did not arrive in time ({size} bytes in "
                    f"{loop.time() - start:.0f} s; at least {limits.BODY_BYTES_PER_SECOND} bytes/s "
                    f"after the first {limits.BODY_SECONDS} s)",
                    code="request_timeout",
                    headers={"Connection": "close"},
                ) from None
            if message["type"] == "http.disconnect":
                raise Disconnected()
            part, more = message.get("body", b""), message.get("more_body", False)
            size += len(part)
            if size > limit:
                raise too_large  # a chunked (or lying) body: read no further
            parts.append(part)
        return b"".join(parts)

    async def reply(request: Request, send, response) -> None:
        await response(request.scope, request.receive, send)

    async def health(request: Request, send):
        if served.stepper is not None and served.stepper.failed is not None:  # restart me
            return await reply(
                request,
                send,
                JSONResponse({"status": "error", "error": "the batch's engine thread has stopped"}, status_code=500),
            )
        if served.model is not None:
            return await reply(request, send, JSONResponse({"status": "ok"}))
        if served.load_error:
            return await reply(
                request, send, JSONResponse({"status": "error", "error": served.load_error}, status_code=500)
            )
        await reply(
            request,
            send,
            JSONResponse(
                {"status": "loading"}, status_code=503, headers={"Retry-After": str(limits.RETRY_AFTER_SECONDS)}
            ),
        )

    async def models(request: Request, send):
        check_key(request)
        await reply(
            request,
            send,
            JSONResponse(
                {
                    "object": "list",
                    "data": [{"id": served.name, "object": "model", "created": served.created, "owned_by": "colibri"}],
                }
            ),
        )

    async def model_by_id(request: Request, send):
        check_key(request)
        wanted = request.path_params["model_id"]
        if wanted != served.name:
            raise APIError(
                404,
                f"the model '{wanted[:100]}' does not exist; this server serves '{served.name}'",
                param="model",
                code="model_not_found",
                kind="not_found_error",
            )
        await reply(
            request,
            send,
            JSONResponse({"id": served.name, "object": "model", "created": served.created, "owned_by": "colibri"}),
        )

    def text_tool(fn):
        """A route answering fn(served, body) -> doc, run off the event loop: /tokenize (llama-server's
        {"content", "add_special", "with_pieces"}, vLLM's {"prompt", "add_special_tokens"} or
        {"messages", "add_generation_prompt"} -> {"tokens", "count", "max_model_len"}) and
        /detokenize ({"tokens"} -> {"content"}, and vLLM's "prompt")."""

        async def route(request: Request, send):
            check_key(request)
            raw = await read_body(request)
            text = await served.off_loop(lambda: render_json(fn(served, parse_body(raw))))
            await reply(request, send, Response(text, media_type="application/json"))

        return route

    async def metrics(request: Request, send):
        served.observe_memory()
        await reply(request, send, Response(generate_latest(served.registry), media_type=CONTENT_TYPE_LATEST))

    async def completion(request: Request, send, chat: bool):
        arrived = time.perf_counter()
        endpoint = "chat" if chat else "completions"
        check_key(request)
        raw = await read_body(request)
        job = await served.off_loop(lambda: openai.prepare(served, parse_body(raw), chat))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        watch = _Watch(request.receive)
        try:
            if job.stream:
                return await streamed(job, send, watch.gone, rid, endpoint, arrived)
            doc = await whole(job, watch.gone, rid, arrived)
        finally:
            watch.stop()
        await reply(request, send, JSONResponse(doc, headers={limits.SEED_HEADER: str(job.gen["seed"])}))

    async def run_choice(job: Job, index: int, gone, arrived: float, on_event, wait=None):
        """Generation `index` of the job (its seed: the job's + index) on a place of the engine:
        `await on_event(piece, pick)` for each event; returns the Generation, finished. `wait`
        (streams) replaces the plain wait for the next event (to send keep-alives meanwhile)."""
        gen = dict(job.gen, seed=(job.gen["seed"] + index) % (1 << SEED_BITS))
        await served.acquire(gone)
        g = served.generation(job.m, job.ids, gen, job.stops, arrived)
        try:  # from here the place is this request's until finish()
            try:
                await g.begin(gone)
            except ColibriError as e:
                raise APIError(400, str(e)) from None
            while (ev := await (wait or served.next_event)(g, gone)) is not None:
                piece, pick = ev
                if pick is not None:
                    g.note_token()
                await on_event(piece, pick)
        finally:
            served.finish(g)
            g.account()
        return g

    def reply_parser(job: Job):
        """The reply stream of a chat job's model format, or None (text is content as it is)."""
        if not job.chat or job.gen.get("skip_special_tokens", True):
            return None
        return job.m.chat_template.reply_stream(**job.reply)

    def usage(job: Job, runs: list) -> dict:
        done = sum(len(g.record.tokens) for g in runs if g.record is not None)
        cached = runs[0].record.reused_tokens if runs and runs[0].record is not None else 0
        out = {
            "prompt_tokens": len(job.ids),
            "completion_tokens": done,
            "total_tokens": len(job.ids) + done,
            "prompt_tokens_details": {"cached_tokens": int(cached or 0)},
        }
        if "prediction" in job.gen:  # OpenAI's counts: the predicted tokens drafted and kept, or refused
            spec = [g.record.speculation for g in runs if g.record is not None and g.record.speculation]
            accepted = sum(s.accepted for s in spec)
            out["completion_tokens_details"] = {
                "accepted_prediction_tokens": accepted,
                "rejected_prediction_tokens": sum(s.drafted for s in spec) - accepted,
            }
        return out

    def finish_reason(g, parser) -> str:
        reason = g.record.finish_reason if g.record is not None else "stop"
        if parser is not None and parser.has_tool_calls and reason == "stop":
            return "tool_calls"
        return reason

    async def run_parsed(job: Job, index: int, gone, arrived: float, on_deltas=None, wait=None) -> Run:
        """Generation `index` of the job through its reply parser: `await on_deltas(deltas, piece,
        pick)` for each event (the parser's deltas, or the piece as content where there is no
        parser); the parser's last deltas are the Run's `tail`, not passed to on_deltas. The one
        loop over a job that every API's answer, whole or streamed, is made from."""
        parser = reply_parser(job)
        text, picks = [], []

        async def on_event(piece, pick):
            text.append(piece)
            if pick is not None:
                picks.append(pick)
            if parser is not None:
                deltas = parser.push(piece) if piece else []
            else:
                deltas = [{"content": piece}] if piece else []
            if on_deltas is not None:
                await on_deltas(deltas, piece, pick)

        g = await run_choice(job, index, gone, arrived, on_event, wait)
        tail = parser.finish() if parser is not None else []
        return Run(g, parser, "".join(text), picks, tail)

    def outcome(job: Job, run: Run) -> openai.Outcome:
        """A chat Run as the other APIs' formatters read it."""
        u = usage(job, [run.g])
        return openai.Outcome(
            _message(run.parser.message if run.parser is not None else None, run.text),
            finish_reason(run.g, run.parser),
            run.g.record.stop if run.g.record is not None else None,
            u["prompt_tokens"],
            u["prompt_tokens_details"]["cached_tokens"],
            u["completion_tokens"],
        )

    async def whole(job: Job, gone, rid, arrived: float) -> dict:
        choices, runs = [], []
        for index in range(job.n):
            run = await whole_run(job, index, gone, arrived)
            g, parser, text, picks = run.g, run.parser, run.text, run.picks
            runs.append(g)
            choice = {"index": index, "finish_reason": finish_reason(g, parser)}
            if job.chat:
                choice["message"] = _message(parser.message if parser is not None else None, text)
                choice["logprobs"] = (
                    None
                    if job.logprobs is None
                    else {"content": [_chat_logprob(job.m, p, job.logprobs) for p in picks]}
                )
            else:
                choice["text"] = text
                choice["logprobs"] = None if job.logprobs is None else _completion_logprobs(job.m, picks, job.logprobs)
            choices.append(choice)
        return {
            "id": rid,
            "object": "chat.completion" if job.chat else "text_completion",
            "created": int(time.time()),
            "model": served.name,
            "choices": choices,
            "usage": usage(job, runs),
            "seed": job.gen["seed"],
        }

    async def whole_run(job: Job, index: int, gone, arrived: float) -> Run:
        try:
            return await run_parsed(job, index, gone, arrived)
        except ColibriError as e:
            raise generation_error(job, e) from None

    class EventStream:
        """A response of server-sent events. The headers go out with the first write: until then
        (the queue, the checks of the first generation) an error is still a plain HTTP error
        response."""

        def __init__(self, send, job: Job):
            self.send, self.job, self.started = send, job, False

        async def start(self) -> None:
            if not self.started:
                self.started = True
                await self.send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [
                            (b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache"),
                            (limits.SEED_HEADER.encode(), str(self.job.gen["seed"]).encode()),
                        ],
                    }
                )

        async def write(self, text: str) -> None:
            await self.start()
            await self.send({"type": "http.response.body", "body": text.encode("utf-8"), "more_body": True})

        async def events(self, events) -> None:
            """Typed events: `event: NAME` and `data: {...}` lines."""
            for name, doc in events:
                await self.write(f"event: {name}\ndata: {json.dumps(doc, ensure_ascii=False)}\n\n")

        async def close(self) -> None:
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    def waiting(on_idle):
        """A `wait` for run_choice that calls `await on_idle(g)` every limits.KEEPALIVE_SECONDS
        while no event comes (a long prompt), to keep proxies and clients from timing out."""

        async def wait(g, gone):
            step = asyncio.ensure_future(served.next_event(g, gone))
            while True:
                done, _ = await asyncio.wait((step,), timeout=limits.KEEPALIVE_SECONDS)
                if done:
                    return step.result()
                await on_idle(g)

        return wait

    def stream_error(e: Exception, endpoint: str, job: Job) -> APIError:
        """An error once the headers are out, as the stream's last event."""
        if isinstance(e, APIError):
            return e
        if isinstance(e, ColibriError):
            return generation_error(job, e)
        logger.error("%s failed mid-stream", endpoint, exc_info=e)
        return internal_error(e)

    async def streamed(job: Job, send, gone, rid, endpoint, arrived: float) -> str:
        """Server-sent events, one or more per token; the client's disconnect ends the loop before
        the engine is asked for another token (run_choice's finally then frees the engine).
        While no event comes (a long prompt), a comment line every limits.KEEPALIVE_SECONDS keeps
        proxies and clients from timing the connection out. Returns the outcome the metrics
        count: "200", or the status of the error that ended the stream."""
        created = int(time.time())
        chat = job.chat
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        out = EventStream(send, job)

        async def emit(doc) -> None:
            await out.write("data: [DONE]\n\n" if doc is None else f"data: {json.dumps(doc, ensure_ascii=False)}\n\n")

        def event(choice, usage_doc=None):
            doc = {
                "id": rid,
                "object": chunk_obj,
                "created": created,
                "model": served.name,
                "choices": [choice] if choice is not None else [],
            }
            if job.include_usage:
                doc["usage"] = usage_doc
            return doc

        async def keep_alive(g):
            await out.write(": keep-alive\n\n")

        outcome_, runs = "200", []
        try:
            for index in range(job.n):
                opened = []  # the choice's first chunk (its role) is out

                async def open_choice(index=index, opened=opened):
                    if chat and not opened:
                        opened.append(True)
                        await emit(
                            event(
                                {
                                    "index": index,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            )
                        )

                async def on_deltas(deltas, piece, pick, index=index, open_choice=open_choice):
                    await open_choice()
                    lp = None
                    if job.logprobs is not None and pick is not None:
                        lp = (
                            {"content": [_chat_logprob(job.m, pick, job.logprobs)]}
                            if chat
                            else _completion_logprobs(job.m, [pick], job.logprobs)
                        )
                    if not chat:
                        if piece or lp is not None:
                            await emit(event({"index": index, "text": piece, "logprobs": lp, "finish_reason": None}))
                        return
                    if not deltas and lp is not None:
                        deltas = [{}]
                    for delta in deltas:
                        await emit(event({"index": index, "delta": delta, "logprobs": lp, "finish_reason": None}))
                        lp = None

                run = await run_parsed(job, index, gone, arrived, on_deltas, waiting(keep_alive))
                runs.append(run.g)
                await open_choice()
                for delta in run.tail:
                    await emit(event({"index": index, "delta": delta, "logprobs": None, "finish_reason": None}))
                reason = finish_reason(run.g, run.parser)
                await emit(
                    event(
                        {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}
                        if chat
                        else {"index": index, "text": "", "logprobs": None, "finish_reason": reason}
                    )
                )
            if job.include_usage:
                await emit(event(None, usage(job, runs)))
        except Disconnected:
            raise
        except Exception as e:  # noqa: BLE001 - the headers are out: the error is the last event
            if not out.started:  # still a plain HTTP error (the Endpoint answers it)
                if isinstance(e, ColibriError):
                    raise generation_error(job, e) from None
                raise
            error = stream_error(e, endpoint, job)
            outcome_ = str(error.status)
            await emit(error.body())
        await emit(None)
        await out.close()
        return outcome_

    # ---- the translated APIs (Anthropic's Messages, OpenAI's Responses) ----------------------------

    def translated(api, endpoint: str):
        """A route for an API translated onto chat completions: `api` (serve/anthropic.py,
        serve/responses.py) has prepare(served, body) -> Job, new_id(), document(outcome, rid,
        model, job) -> the whole answer, and Stream(rid, model, job) -> its typed events."""

        async def route(request: Request, send):
            arrived = time.perf_counter()
            check_key(request)
            raw = await read_body(request)
            job = await served.off_loop(lambda: api.prepare(served, parse_body(raw)))
            rid = api.new_id()
            watch = _Watch(request.receive)
            try:
                if job.stream:
                    return await translated_stream(api, job, send, watch.gone, rid, endpoint, arrived)
                run = await whole_run(job, 0, watch.gone, arrived)
            finally:
                watch.stop()
            doc = api.document(outcome(job, run), rid, served.name, job)
            await reply(request, send, JSONResponse(doc, headers={limits.SEED_HEADER: str(job.gen["seed"])}))

        return route

    async def translated_stream(api, job: Job, send, gone, rid, endpoint: str, arrived: float) -> str:
        """The API's typed events from the same run: its start once the generation has begun (or
        at the first keep-alive), its events for the parser's deltas, its end; an error after the
        headers is its error event. Returns the outcome, as streamed()."""
        out = EventStream(send, job)
        stream = api.Stream(rid, served.name, job)
        begun = []

        async def begin(g) -> None:
            if not begun:
                begun.append(True)
                record = g.record
                cached = int(record.reused_tokens or 0) if record is not None else 0
                await out.events(stream.start(openai.Outcome({}, "", None, len(job.ids), cached, 0)))

        async def on_idle(g) -> None:
            await begin(g)
            pings = stream.ping()
            await (out.events(pings) if pings else out.write(": keep-alive\n\n"))

        current = []  # the generation (run_choice passes it to each wait)

        async def wait(g, gone):
            current[:] = [g]
            return await keep_alive(g, gone)

        keep_alive = waiting(on_idle)

        async def on_deltas(deltas, piece, pick):
            await begin(current[0])
            await out.events(stream.deltas(deltas))

        outcome_ = "200"
        try:
            run = await run_parsed(job, 0, gone, arrived, on_deltas, wait)
            await begin(run.g)
            await out.events(stream.deltas(run.tail))
            await out.events(stream.end(outcome(job, run)))
        except Disconnected:
            raise
        except Exception as e:  # noqa: BLE001 - the headers are out: the error is the last event
            if not out.started:
                if isinstance(e, ColibriError):
                    raise generation_error(job, e) from None
                raise
            error = stream_error(e, endpoint, job)
            outcome_ = str(error.status)
            await out.events(stream.error(error))
        await out.close()
        return outcome_

    async def chat_completions(request: Request, send):
        return await completion(request, send, chat=True)

    async def completions(request: Request, send):
        return await completion(request, send, chat=False)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        served.start_loading()  # /health says 503 until the model is ready
        yield
        served.executor.shutdown(wait=True)  # the closes of cancelled generations run first
        if served.stepper is not None:
            served.stepper.stop()
        if served.model is not None:
            served.model.close()  # the prefix store's files queued for --kv-store are written

    async def http_error(request: Request, exc: HTTPException):
        # routing's own errors (an unknown path: 404, a wrong method: 405) in OpenAI's shape too,
        # in Anthropic's under /v1/messages
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        e = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind=kind)
        shape = anthropic.error_body if request.url.path.startswith("/v1/messages") else APIError.body
        served.requests.labels("unrouted", str(exc.status_code)).inc()
        return JSONResponse(shape(e), status_code=exc.status_code, headers=exc.headers)

    async def server_error(request: Request, exc: Exception):
        return JSONResponse(internal_error(exc).body(), status_code=500)  # uvicorn logs the traceback

    class Sent(Response):
        """What a route returns to FastAPI: its Endpoint, which sends the response itself."""

        def __init__(self, endpoint):
            self.endpoint, self.background = endpoint, None

        async def __call__(self, scope, receive, send):
            await self.endpoint(scope, receive, send)

    app = FastAPI(
        title="Colibri",
        version=__version__,
        lifespan=lifespan,
        redoc_url=None,
        description="OpenAI-compatible serving of a Mixture-of-Experts model on CPUs (docs/serve.md).",
    )
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, server_error)

    def route(path: str, method: str, name: str, handler, summary: str, body=None, shape=APIError.body) -> None:
        endpoint = Endpoint(name, handler, shape)

        async def answer(request):
            return Sent(endpoint)

        answer.__annotations__ = {"request": Request}  # FastAPI injects it (the name is local here)
        schema = {"$ref": f"#/components/schemas/{body.__name__}"} if body is not None else None
        extra = (
            {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}} if body else None
        )
        app.add_api_route(
            path, answer, methods=[method], name=f"{name} {method} {path}", summary=summary, openapi_extra=extra
        )

    route("/health", "GET", "health", health, "200 once the model is loaded and warmed up, else 503")
    route("/v1/models", "GET", "models", models, "the served model")
    route("/v1/models/{model_id:path}", "GET", "models", model_by_id, "the served model by its name")
    route(
        "/tokenize",
        "POST",
        "tokenize",
        text_tool(openai.tokenize),
        "text or a conversation -> token ids",
        protocol.TokenizeRequest,
    )
    route(
        "/detokenize",
        "POST",
        "detokenize",
        text_tool(openai.detokenize),
        "token ids -> text",
        protocol.DetokenizeRequest,
    )
    route("/metrics", "GET", "metrics", metrics, "Prometheus text")
    route(
        "/v1/chat/completions",
        "POST",
        "chat",
        chat_completions,
        "a chat reply (OpenAI's chat completions)",
        protocol.ChatCompletionRequest,
    )
    route(
        "/v1/completions",
        "POST",
        "completions",
        completions,
        "a text completion (OpenAI's completions)",
        protocol.CompletionRequest,
    )
    route(
        "/v1/messages",
        "POST",
        "messages",
        translated(anthropic, "messages"),
        "a reply (Anthropic's Messages API)",
        anthropic.MessagesRequest,
        anthropic.error_body,
    )
    route(
        "/v1/responses",
        "POST",
        "responses",
        translated(responses, "responses"),
        "a reply (OpenAI's Responses API, stateless)",
        responses.ResponsesRequest,
    )
    route(
        "/v1/messages/count_tokens",
        "POST",
        "count_tokens",
        text_tool(anthropic.count_tokens),
        "a Messages request's prompt tokens (Anthropic's count_tokens)",
        anthropic.CountTokensRequest,
        anthropic.error_body,
    )

    def openapi() -> dict:
        """FastAPI's document of the routes, with the request bodies' schemas as components."""
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _, defs = models_json_schema(
                [(m, "validation") for m in BODIES], ref_template="#/components/schemas/{model}"
            )
            doc.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
    return app


def parse_body(raw: bytes):
    """A request's JSON, checked for strings that are not Unicode text. It runs on a preparation
    thread with the rest of the request's own work (Served.off_loop): parsing 16 MiB holds the
    GIL for tens of milliseconds."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as e:
        raise APIError(400, f"the request body is not valid JSON ({str(e)[:100]})") from None
    _check_unicode(doc)
    return doc


RENDER_SLICE = 1 << 16  # items of a long list written per json.dumps call (some 10 ms of the GIL)


def render_json(doc: dict) -> bytes:
    """doc as the compact JSON starlette's JSONResponse writes, on a preparation thread: a long
    list in it (the token ids of a 16 MiB prompt: millions) is written a slice at a time, since
    one json.dumps call over it holds the GIL, and so stalls the event loop, for most of a
    second."""

    def dumps(value) -> str:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))

    parts = []
    for key, value in doc.items():
        if isinstance(value, list) and len(value) > RENDER_SLICE:
            items = ",".join(dumps(value[i : i + RENDER_SLICE])[1:-1] for i in range(0, len(value), RENDER_SLICE))
            parts.append(f"{dumps(key)}:[{items}]")
        else:
            parts.append(f"{dumps(key)}:{dumps(value)}")
    return ("{" + ",".join(parts) + "}").encode("utf-8")


def _check_unicode(doc) -> None:
    """400 for a string that is not Unicode text: JSON's escapes can spell a lone surrogate
    ("\\ud800"), which no tokenizer, template or UTF-8 response can take."""
    stack = [(doc, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            values = [value]
        elif isinstance(value, dict):
            values = list(value)
            stack.extend((v, f"{where}.{k}" if where else str(k)) for k, v in value.items())
        elif isinstance(value, list):
            values = []
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(value))
        else:
            continue
        for text in values:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                name = where or "the body"
                raise APIError(
                    400,
                    f"{name[:80]} holds a string that is not valid Unicode (a lone surrogate)",
                    param=where.split(".")[0].split("[")[0] or None,
                ) from None


CONSTRAINT_KEYWORDS = ("json_schema", "json_object", "grammar", "regex")  # Model.generate's


def generation_error(job: Job, e: ColibriError) -> APIError:
    """A ColibriError raised while a job generates. Under a constraint (response_format, a tool
    call's grammar) it is the constraint's: the model cannot write what the schema demands (a
    vocabulary without `"`), or the grammar outgrew llguidance's limits at a token: a 422 for a
    request this model cannot satisfy. Without one it is the server's: a 500."""
    if any(job.gen.get(k) for k in CONSTRAINT_KEYWORDS):
        return APIError(422, str(e), code="constraint_failed")
    return APIError(500, str(e), kind="server_error")


def _message(parsed: dict | None, text: str) -> dict:
    """The assistant message of a whole reply: the parser's (content, reasoning_content,
    tool_calls), or the text as content."""
    if parsed is None:
        return {"role": "assistant", "content": text}
    out = {"role": "assistant", "content": parsed.get("content")}
    if parsed.get("reasoning_content"):
        out["reasoning_content"] = parsed["reasoning_content"]
    if parsed.get("tool_calls"):
        out["tool_calls"] = parsed["tool_calls"]
    elif out["content"] is None:
        out["content"] = ""
    return out


def _token_text(m, token: int) -> str:
    return m.tokenizer.decode([token])


def _chat_logprob(m, pick, top: int) -> dict:
    text = _token_text(m, pick.token)
    return {
        "token": text,
        "logprob": pick.logprob,
        "bytes": list(text.encode("utf-8")),
        "top_logprobs": [
            {"token": (t := _token_text(m, i)), "logprob": lp, "bytes": list(t.encode("utf-8"))}
            for i, lp in pick.top[:top]
        ],
    }


def _completion_logprobs(m, picks, top: int) -> dict:
    tokens = [_token_text(m, p.token) for p in picks]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [p.logprob for p in picks],
        "top_logprobs": [{_token_text(m, i): lp for i, lp in p.top[:top]} for p in picks],
        "text_offset": offsets,
    }


def uvicorn_options(host: str, port: int) -> dict:
    """uvicorn.run's keywords: the server's own connections (serve/connection.py) and limits."""
    from .connection import Connection

    return dict(
        host=host,
        port=port,
        log_level="warning",
        http=Connection,
        h11_max_incomplete_event_size=limits.MAX_HEAD_BYTES,
        timeout_keep_alive=limits.IDLE_SECONDS,
        timeout_graceful_shutdown=limits.GRACEFUL_SHUTDOWN_SECONDS,
    )


def serve(
    load,
    name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_queue: int = 16,
    queue_timeout: float = 600.0,
    log=print,
    parallel: int = 1,
    step_tokens: int | None = None,
    draft: dict | None = None,
) -> None:
    """Run the server until SIGINT/SIGTERM/SIGHUP (uvicorn stops accepting, gives the running requests
    limits.GRACEFUL_SHUTDOWN_SECONDS to finish, then cancels them, and returns). `load()` -> Model
    (loaded with this `parallel`), called once in the background."""
    _need_stack()
    import uvicorn

    if api_key is not None and not api_key.strip():
        raise ColibriError("--api-key is empty: give a key, or leave the option out to serve without one")
    if isinstance(parallel, bool) or not isinstance(parallel, int) or not 1 <= parallel <= MAX_PARALLEL:
        raise ColibriError(f"--parallel must be in 1..{MAX_PARALLEL}, got {parallel!r}")
    served = Served(load, name, api_key, max_queue, queue_timeout, parallel, step_tokens, draft)
    app = create_app(served)
    at_once = "one generation at a time" if parallel == 1 else f"{parallel} generations at a time, decoded together"
    log(
        f"[INFO] Serving '{name}' on http://{host}:{port}/v1 (health: /health, metrics: /metrics); "
        f"{at_once}, up to {max_queue} waiting"
    )
    # uvicorn stops gracefully on SIGTERM and then re-raises the signal under the handler it found:
    # a handler that returns makes that re-raise a no-op, so SIGTERM ends with status 0
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    # SIGHUP (the terminal hung up; `kill -HUP`): uvicorn leaves it to its default, which ends the
    # process at once, cutting the running requests and the KV store's queued files. There is no
    # configuration to reload: it stops the server as SIGTERM does.
    hangup = getattr(signal, "SIGHUP", None)
    previous_hup = signal.signal(hangup, lambda *_: signal.raise_signal(signal.SIGTERM)) if hangup else None
    try:
        uvicorn.run(app, **uvicorn_options(host, port))
    finally:
        signal.signal(signal.SIGTERM, previous)
        if hangup:
            signal.signal(hangup, previous_hup)
