"""`python -m colibri serve`: an OpenAI-compatible HTTP server over one Model.

Design
------
Starlette (routing, request/response) under uvicorn, prometheus_client for /metrics: the
optional extra `colibri[serve]`. A Model loaded with `parallel=N` (`--parallel N`, default 1)
runs N generations at once; further requests wait in a FIFO (Served.acquire hands a free place
to the first waiter) bounded by `max_queue` — beyond it, and after `queue_timeout` seconds of
waiting, the answer is 503 with Retry-After. The engine runs on one thread (a worker, or the
Batch's Stepper); the event loop only parses, queues and writes. With N = 1 a generation advances one token per hop to that
thread (Generation); with N > 1 that thread runs a colibri.batching.Batch (Stepper): each step
is one engine pass over a token of every decoding request and pieces of the new prompts, up to
`--step-tokens` in all, every weight read once for all of them — the tokens of each are those it
gets alone (BatchedGeneration). Each request watches its connection: a client
that disconnects (streamed or not, or while it waits in the queue) stops its generation after the
token being computed — its generator is closed (its sequence cancelled) on the engine thread,
the next request's work queuing behind that. Repeated prefixes (multi-turn chat, a shared system
prompt) reuse the KV cache through Model.generate's prefix reuse (with N > 1: the place in the
cache that holds the longest prefix).

Endpoints, in OpenAI's shapes: POST /v1/chat/completions, POST /v1/completions (whole, or
streamed as `data: {...}` chunks and `data: [DONE]`; `stream_options.include_usage`; SSE comment
lines while a long prompt runs), GET /v1/models and /v1/models/{id}, POST /tokenize and
/detokenize (llama-server's shapes, vLLM's accepted), GET /health (503 while the model loads and
warms up, 200 when ready), GET /metrics (Prometheus text). Errors are `{"error": {"message",
"type", "param", "code"}}`: 400 for a body that is not JSON, a parameter of the wrong type or
range, an unknown field or one Colibri does not implement (openai_request.py: no field is
silently ignored), 401 for a wrong or missing key (compared in constant time), 404 for another
model's name, 413 for a body over MAX_BODY_BYTES (by Content-Length before reading, else as soon
as the streamed body passes it), 422 for a well-formed request the model cannot process (the chat
template refuses, fails or outlasts PREPARE_SECONDS on the conversation, the model has no chat
template, prompt token ids outside the vocabulary), 503 (loading, queue full, queue timeout)
with Retry-After, and 500 for anything unexpected — logged with its traceback on the server,
never sent to the client.

A chat reply goes through the reply parser of the model's format (chat.ChatTemplate.reply_stream,
colibri/replies.py): `reasoning_content`, `content` and `tool_calls`, whole and as deltas, and
finish_reason "tool_calls". `tool_choice` required / named constrains the reply to a call in the
family's syntax, auto constrains a call once its opener appears, and `response_format` to JSON
(colibri/constraint.py, llguidance). A request without a seed gets a fresh one, reported in the
X-Colibri-Seed header and the body's `seed`. Unset sampling values take the checkpoint's
generation_config.json defaults (as `run` does), then greedy. Rendering templates and tokenizing
run on worker threads (PREP_WORKERS), never on the event loop.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import hmac
import importlib.util
import json
import logging
import math
import queue
import signal
import threading
import time
import uuid

from . import openai_request
from .apierror import RETRY_AFTER_SECONDS, APIError, Disconnected
from .errors import ColibriError
from .names import MAX_PARALLEL
from .sampling import REPETITION_PENALTY_RANGE, SEED_BITS

MAX_STOP_STRINGS = 4                   # OpenAI's limit
MAX_BODY_BYTES = 16 << 20              # a request body larger than this is refused (413)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16    # OpenAI's legacy completions default
GRACEFUL_SHUTDOWN_SECONDS = 30         # SIGTERM: the running request's time to finish before it is cancelled
MAX_CHOICES = 8                        # n: generations of one request, run one after another
KEEPALIVE_SECONDS = 10                 # a stream with no event for this long gets an SSE comment line
SEED_HEADER = "X-Colibri-Seed"         # the seed a request ran with (its own, or the fresh one drawn for it)
PREPARE_SECONDS = 30                   # rendering the template and tokenizing a request: its bound
WARM_UP_TOKENS = 16                    # the warm-up's prompt: one prefill chunk, then a decoded token
PREP_WORKERS = 4                       # threads that prepare requests (a looping template holds one)
# apply_chat_template's own keywords: chat_template_kwargs cannot set them (the request's fields do)
RESERVED_TEMPLATE_KEYWORDS = frozenset({"messages", "add_generation_prompt", "tokenize", "tools", "documents",
                                        "continue_final_message"})

logger = logging.getLogger("colibri.server")


def _need_stack():
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ColibriError(f"serve needs the server extra ({e.name} is missing): pip install \"colibri[serve]\"") from None


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


ROLES = ("system", "developer", "user", "assistant", "tool")


def _text_of(content, where: str):
    """A message's content for a text-only model: a string, or the text parts joined."""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "refusal") or \
                    not isinstance(part.get(part.get("type")), str):
                raise APIError(400, f"{where}: only text content parts ({{'type': 'text', 'text': ...}}) are supported",
                               param="messages")
            parts.append(part[part["type"]])
        return "".join(parts)
    return content


def _tool_calls_of(calls, where: str) -> list:
    """An assistant turn's tool_calls, checked for OpenAI's shape; `arguments` is passed on as
    sent (a JSON string or an object): the chat template's own normalisation turns it into
    what the template expects."""
    if not isinstance(calls, list):
        raise APIError(400, f"{where}.tool_calls must be a list", param="messages")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                not isinstance(fn.get("arguments", "{}"), (str, dict)):
            raise APIError(400, f"{where}.tool_calls[{j}] must be {{'id', 'type': 'function', 'function': "
                                f"{{'name', 'arguments'}}}}", param="messages")
    return calls


def _messages(body: dict) -> list:
    """The conversation, checked for its shape (400s); what the template makes of it is its own."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list of messages", param="messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise APIError(400, f"{where} must be an object with a string 'role'", param="messages")
        if msg["role"] not in ROLES:
            raise APIError(400, f"{where}['role'] must be one of {', '.join(ROLES)}, got {msg['role'][:40]!r}",
                           param="messages")
        content = msg.get("content")
        calls = msg.get("tool_calls")
        if calls is not None and msg["role"] != "assistant":
            raise APIError(400, f"{where}: only assistant messages carry tool_calls", param="messages")
        if content is None and not calls:
            raise APIError(400, f"{where} has no 'content'", param="messages")
        if content is not None and not isinstance(content, (str, list)):
            raise APIError(400, f"{where}['content'] must be a string or a list of text parts, got "
                                f"{json.dumps(content)[:80]}", param="messages")
        turn = {**msg, "content": _text_of(content, where)}
        if calls is not None:
            turn["tool_calls"] = _tool_calls_of(calls, where)
        out.append(turn)
    return out


def _template_kwargs(body: dict) -> dict:
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise APIError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    reserved = sorted(RESERVED_TEMPLATE_KEYWORDS & kwargs.keys())
    if reserved:
        raise APIError(400, f"'chat_template_kwargs' cannot set '{reserved[0]}' (a field of the request or of the "
                            f"server)", param="chat_template_kwargs")
    return dict(kwargs)


def _template_reacts(m, name: str, values: tuple) -> bool:
    """Whether the model's chat template renders a one-turn conversation differently for these
    values of keyword `name` (cached on the template: rendering is the only reliable test of what a
    template reads)."""
    template = m.chat_template
    cache = template.__dict__.setdefault("_colibri_reacts", {})
    if name not in cache:
        probe = [{"role": "user", "content": "hi"}]
        try:
            texts = {template.render(probe, add_generation_prompt=True, **{name: v}) for v in values}
        except ColibriError:
            texts = set()
        cache[name] = len(texts) > 1
    return cache[name]


def _chat_prompt(m, body: dict, tools, kwargs: dict) -> tuple:
    """(the prompt's text, its token ids) of a chat request's conversation; the template's
    refusal is a 422."""
    msgs = _messages(body)
    if m.chat_template is None:
        raise APIError(422, f"the model has no chat template; use /v1/completions, or add one with: python -m colibri "
                            f"tokenizer --model-dir DIR --from HF_DIR", param="messages", code="chat_template_error")
    try:
        text = m.apply_chat_template(msgs, add_generation_prompt=True, tools=tools, tokenize=False, **kwargs)
        return text, m.encode(text, add_special_tokens=False)
    except ColibriError as e:
        raise APIError(422, str(e), param="messages", code="chat_template_error") from None


def _completion_prompt(m, body: dict) -> list:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        try:
            ids = m.encode(prompt)
        except ColibriError as e:
            raise APIError(400, str(e), param="prompt") from None
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = prompt
        vocab = m.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(422, f"token id {str(bad)[:30]} is outside the model's vocabulary [0, {vocab})",
                           param="prompt", code="token_out_of_vocabulary")
    else:
        raise APIError(400, "'prompt' must be a string, or a list of token ids (one prompt per request)",
                       param="prompt")
    if not ids:
        raise APIError(400, "the prompt is empty (it encodes to no tokens)", param="prompt")
    return ids


def sampling_options(body: dict) -> dict:
    """The Model.generate keywords a request asks for (the seed: the request's, or a fresh one)."""
    return dict(
        temperature=_field(body, "temperature", _NUMBER, None, lambda v: 0 <= v <= 2, "a number in [0, 2]"),
        top_p=_field(body, "top_p", _NUMBER, None, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        top_k=_field(body, "top_k", int, None, lambda v: v >= 0, "an integer >= 0"),
        min_p=_field(body, "min_p", _NUMBER, None, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        # bounded so that logits divided or multiplied by it stay finite (else the sampler fails mid-generation)
        repetition_penalty=_field(body, "repetition_penalty", _NUMBER, None,
                                  lambda v: REPETITION_PENALTY_RANGE[0] <= v <= REPETITION_PENALTY_RANGE[1],
                                  f"a number in [{REPETITION_PENALTY_RANGE[0]:g}, {REPETITION_PENALTY_RANGE[1]:g}]"),
        presence_penalty=_field(body, "presence_penalty", _NUMBER, 0.0, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
        frequency_penalty=_field(body, "frequency_penalty", _NUMBER, 0.0, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
        seed=openai_request.seed_of(body),
        stop_at_eos=not _field(body, "ignore_eos", bool, False, what="true or false"),   # vLLM's, llama-server's
    )


# ---- the served model ----------------------------------------------------------------------------------

class Served:
    """The model, its worker thread, the FIFO in front of it and the metrics."""

    def __init__(self, load, name: str, api_key: str | None, max_queue: int, queue_timeout: float,
                 parallel: int = 1, step_tokens: int | None = None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.load, self.name, self.api_key = load, name, api_key
        self.max_queue, self.queue_timeout = max_queue, queue_timeout
        self.parallel = parallel               # generations at once (the Model's load(parallel=))
        self.step_tokens = step_tokens         # the Batch's tokens per step (None: its default)
        self.model = None
        self.stepper = None                    # the Batch's engine thread (parallel > 1), once loaded
        self.load_error = None
        self.created = int(time.time())
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="colibri-engine")
        self.prep_slots = asyncio.Semaphore(PREP_WORKERS)     # requests being prepared off the event loop
        self.active = 0                        # requests holding a place (at most `parallel`)
        self.waiters = collections.deque()     # futures of the requests waiting for it, in arrival order
        r = self.registry = CollectorRegistry()
        self.requests = Counter("colibri_requests", "requests by endpoint and outcome", ["endpoint", "outcome"], registry=r)
        self.queue_depth = Gauge("colibri_queue_depth", "requests waiting for the engine", registry=r)
        self.running = Gauge("colibri_running_requests", "requests holding one of the --parallel places", registry=r)
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
            m = None
            try:
                m = self.load()
                if m.parallel < self.parallel:
                    raise ColibriError(f"the model was loaded with parallel={m.parallel}; the server was asked for "
                                       f"{self.parallel} places")
                _warm_up(m)
                if self.parallel > 1:
                    self.stepper = Stepper(m, self.step_tokens)
                self.model = m
            except Exception as e:          # noqa: BLE001 - reported by /health and each request
                self.load_error = str(e) or type(e).__name__
                if m is not None:
                    m.close()
                if not isinstance(e, ColibriError):
                    logger.error("loading the model failed", exc_info=e)
                return
            if self.parallel > 1:
                _warn_parallel_under_budget(m, self.parallel)
        threading.Thread(target=run, name="colibri-load", daemon=True).start()

    def ready(self):
        if self.model is None:
            if self.load_error:
                raise APIError(500, f"the model failed to load: {self.load_error}", kind="server_error")
            raise APIError(503, "the model is still loading", kind="server_error", code="loading")
        return self.model

    # -- the FIFO in front of the engine: ownership passes from one request to the next --

    async def acquire(self, gone: asyncio.Event) -> None:
        """Wait for a place (one of `parallel`), first come first served. 503 when `max_queue`
        requests already wait or after `queue_timeout` seconds; Disconnected when `gone` is set
        meanwhile. Every return is paired with one finish() or release()."""
        if self.active < self.parallel and not self.waiters:
            self.active += 1
            self.running.set(self.active)
            return
        if len(self.waiters) >= self.max_queue:
            raise APIError(503, f"the queue is full ({self.max_queue} waiting); retry later", kind="server_error",
                           code="queue_full")
        turn = asyncio.get_running_loop().create_future()
        self.waiters.append(turn)
        self.queue_depth.set(len(self.waiters))
        left = asyncio.ensure_future(gone.wait())
        owned = False
        try:
            await asyncio.wait((turn, left), timeout=self.queue_timeout, return_when=asyncio.FIRST_COMPLETED)
            owned = turn.done() and not gone.is_set()
        finally:                            # also when this task is cancelled
            left.cancel()
            if not owned:
                self._give_up(turn)
            self.queue_depth.set(len(self.waiters))
        if not owned:
            if gone.is_set():
                raise Disconnected()
            raise APIError(503, f"waited {self.queue_timeout:g} s for the engine; retry later", kind="server_error",
                           code="queue_timeout")

    def _give_up(self, turn) -> None:
        if turn.done() and not turn.cancelled():
            self.release()                  # the engine was handed to this request: pass it on
        else:
            turn.cancel()
            with contextlib.suppress(ValueError):
                self.waiters.remove(turn)

    def release(self) -> None:
        """Hand a place to the first request still waiting, or free it."""
        while self.waiters:
            turn = self.waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                self.queue_depth.set(len(self.waiters))
                return
        self.active -= 1
        self.running.set(self.active)
        self.queue_depth.set(0)

    def finish(self, g) -> None:
        """End a generation and hand its place on, without awaiting (this may run in a
        cancelled task): its generator is closed on the engine thread after the step in flight
        (its sequence cancelled by the Batch's thread), and the next request's work, submitted
        later to the same FIFO (the executor, the Stepper's jobs), runs after that. Idempotent."""
        if g.finished:
            return
        g.finished = True
        if isinstance(g, BatchedGeneration):
            g.close()                       # queued to the Batch's thread before the place is handed on
        else:
            try:
                self.executor.submit(g.close)
            except RuntimeError:            # the executor is shut down: the process is exiting
                pass
        self.release()

    async def prepare(self, body, chat: bool) -> Job:
        """_prepare off the event loop, bounded by PREPARE_SECONDS (see off_loop)."""
        return await self.off_loop(_prepare, self, body, chat)

    async def off_loop(self, fn, *args):
        """fn(*args) on a daemon thread of its own, at most PREP_WORKERS at once, answered within
        PREPARE_SECONDS: a chat template or tokenizer that loops costs that thread (left behind,
        and killed with the process), never the event loop (/health, the other requests, SIGTERM)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle(result, error) -> None:
            if not done.done():
                done.set_exception(error) if error is not None else done.set_result(result)

        def work() -> None:
            try:
                result, error = _contained(fn, *args), None
            except Exception as e:          # noqa: BLE001 - handed to the request's task
                result, error = None, e
            with contextlib.suppress(RuntimeError):          # the loop is closed: nobody waits
                loop.call_soon_threadsafe(settle, result, error)

        async with self.prep_slots:
            threading.Thread(target=work, name="colibri-prepare", daemon=True).start()
            try:
                return await asyncio.wait_for(asyncio.shield(done), PREPARE_SECONDS)
            except asyncio.TimeoutError:
                logger.warning("a request's preparation (chat template, tokenizer) outlasted %s s; its thread is "
                               "left running", PREPARE_SECONDS)
                raise APIError(422, f"the request's chat template and tokenizing did not finish within "
                                    f"{PREPARE_SECONDS} s", code="prepare_timeout") from None

    async def on_engine(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, _contained, fn, *args)

    async def next_event(self, g, gone: asyncio.Event):
        """The next (text, pick) event of `g`, or None at its end; Disconnected, without asking
        the engine for another token, once the client has gone."""
        if gone.is_set():
            raise Disconnected()
        if isinstance(g, BatchedGeneration):
            return await g.next_event(gone)
        return await self.on_engine(g.step)

    def generation(self, m, ids, gen: dict, stops, arrived: float):
        """The request's Generation: stepped alone, or in the Batch (parallel > 1)."""
        if self.stepper is not None:
            return BatchedGeneration(self, m, ids, gen, stops, arrived)
        return Generation(self, m, ids, gen, stops, arrived)

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


class _Watch:
    """Sets `gone` when the connection says http.disconnect (once the request body is read,
    an ASGI server's receive() answers nothing else)."""

    def __init__(self, receive):
        self.gone = asyncio.Event()
        self.task = asyncio.ensure_future(self._run(receive))

    async def _run(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone.set()

    def stop(self) -> None:
        self.task.cancel()


# ---- one generation ----------------------------------------------------------------------------------

@dataclasses.dataclass
class Job:
    """A request, checked and turned into engine work (made off the event loop: rendering a
    template and tokenizing are the request's own code and time)."""
    m: object                          # the Model
    ids: list                          # the prompt's token ids
    gen: dict                          # Model.generate keywords (sampling, constraint, max_new_tokens, ...)
    stops: list                        # stop strings
    logprobs: int | None               # top logprobs per token, None: off
    stream: bool
    include_usage: bool
    n: int                             # choices, each its own generation
    chat: bool
    reply: dict | None = None          # chat: how to parse the reply (reply_stream keywords)


def _prepare(served: Served, body, chat: bool) -> Job:
    """The request's Job, or an APIError naming the field at fault."""
    m = served.ready()
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    openai_request.check_fields(body, chat)
    name = _field(body, "model", str, None, what="a string")
    if name is not None and name != served.name:
        raise APIError(404, f"the model '{str(name)[:100]}' does not exist; this server serves '{served.name}'",
                       param="model", code="model_not_found")
    stream = _field(body, "stream", bool, False, what="true or false")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise APIError(400, "'stream_options' must be an object", param="stream_options")
    include_usage = bool(opts.get("include_usage", False))
    gen = sampling_options(body)
    bias = openai_request.logit_bias_of(body, m.config.vocab_size)
    if bias:
        gen["logit_bias"] = bias
    stops = _stop_list(body)
    n = _field(body, "n", int, 1, lambda v: 1 <= v <= MAX_CHOICES, f"an integer in [1, {MAX_CHOICES}]")
    reply = None
    if chat:
        tools, choice, parallel = openai_request.tools_of(body)
        constraint = openai_request.response_constraint(body)
        if constraint and choice != "none":
            raise APIError(400, "'response_format' cannot be combined with tool calls: set tool_choice 'none' or "
                                "leave out 'tools'", param="response_format")
        kwargs = _template_kwargs(body)
        for key, value in openai_request.reasoning_keywords(
                body, lambda key, values: m.chat_template is not None and _template_reacts(m, key, values)).items():
            kwargs.setdefault(key, value)          # chat_template_kwargs, the more specific, wins
        prompt, ids = _chat_prompt(m, body, tools, kwargs)
        template = m.chat_template
        thinking = kwargs.get("enable_thinking")
        reply = {"tools": tools if choice != "none" else None, "enable_thinking": thinking,
                 "parallel_tool_calls": parallel, "prompt": prompt}
        if choice != "none":
            grammar = _tool_grammar(m, tools, choice, parallel, thinking, prompt)
            if grammar is not None:
                constraint = {"grammar": grammar}
        gen.update(constraint)
        # the reply parser reads the family's markers, which are special tokens in most vocabularies
        gen["skip_special_tokens"] = _plain_replies(template)
        want = _field(body, "max_completion_tokens", int, None, lambda v: v >= 1, "a positive integer")
        want = _field(body, "max_tokens", int, want, lambda v: v >= 1, "a positive integer")
        if body.get("logprobs") not in (None, False, True):
            raise APIError(400, "'logprobs' must be true or false", param="logprobs")
        top = _field(body, "top_logprobs", int, 0, lambda v: 0 <= v <= 20, "an integer in [0, 20]")
        logprobs = top if body.get("logprobs") else None
    else:
        ids = _completion_prompt(m, body)
        if body.get("echo"):
            raise APIError(400, "'echo' is not supported", param="echo", code="unsupported_parameter")
        best_of = _field(body, "best_of", int, None, lambda v: v >= 1, "a positive integer")
        if best_of is not None and best_of != n:
            raise APIError(400, "'best_of' other than n is not supported (no ranking of candidates)", param="best_of",
                           code="unsupported_parameter")
        want = _field(body, "max_tokens", int, COMPLETIONS_DEFAULT_MAX_TOKENS, lambda v: v >= 1, "a positive integer")
        logprobs = _field(body, "logprobs", int, None, lambda v: 0 <= v <= 20, "an integer in [0, 20]")
    room = m.n_ctx - len(ids)
    if room < 1:
        raise APIError(400, f"the prompt has {len(ids)} tokens; the context is {m.n_ctx}", param="messages" if chat else "prompt",
                       code="context_length_exceeded")
    if want is None:
        want = room
    elif want > room:
        raise APIError(400, f"max_tokens {want} + the prompt's {len(ids)} tokens exceed the context of {m.n_ctx}",
                       param="max_tokens", code="context_length_exceeded")
    return Job(m, ids, dict(gen, max_new_tokens=want, logprobs=logprobs), stops, logprobs, stream, include_usage, n,
               chat, reply)


def _plain_replies(template) -> bool:
    """True when the template's replies carry no reasoning or tool markers to parse."""
    fmt = getattr(template, "reply_format", None)
    return fmt is None or getattr(fmt, "name", "plain") == "plain"


def _tool_grammar(m, tools, choice, parallel: bool, thinking, prompt: str):
    """The constraint on a reply for tool_choice (required / named: a call in the family's syntax;
    auto: free text, the call constrained once its opener appears), or None where the family
    has no known call syntax (auto) — for required / named that is a 400."""
    if choice == "auto" and importlib.util.find_spec("llguidance") is None:
        return None                     # auto works without the constraint: the reply is still parsed
    grammar = m.chat_template.tool_call_grammar(tools, choice, parallel_tool_calls=parallel,
                                                added_tokens=m.tokenizer.added_tokens, enable_thinking=thinking,
                                                prompt=prompt)
    if grammar is None and choice != "auto":
        raise APIError(400, "this model's chat template has no known tool-call syntax: tool_choice "
                            f"{json.dumps(choice)} cannot be enforced (use 'auto')", param="tool_choice",
                       code="unsupported_parameter")
    return grammar


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
                raise APIError(400, f"{name[:80]} holds a string that is not valid Unicode (a lone surrogate)",
                               param=where.split(".")[0].split("[")[0] or None) from None


def _contained(fn, *args, **kwargs):
    """fn(*args), with what native libraries raise outside Exception (the Rust `tokenizers`'
    PanicException derives from BaseException) turned into an ordinary error: a 500 for this
    request, never a dead worker or server."""
    try:
        return fn(*args, **kwargs)
    except (Exception, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:          # noqa: BLE001 - see above
        raise RuntimeError(f"{type(e).__name__}: {e}") from None


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
    return {"token": text, "logprob": pick.logprob, "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": (t := _token_text(m, i)), "logprob": lp, "bytes": list(t.encode("utf-8"))}
                             for i, lp in pick.top[:top]]}


class Generation:
    """One Model.stream_tokens, driven on the engine thread one event at a time; collects text,
    logprobs and timings. Made on the event loop (no model work), started on the engine."""

    def __init__(self, served: Served, m, ids, gen: dict, stops, arrived: float):
        self.served, self.m, self.ids, self.gen, self.stops = served, m, ids, gen, stops
        self.t0 = arrived
        self.events = self.record = None
        self.prompt_tokens = len(ids)
        self.last_token_at = None
        self.finished = False

    async def begin(self, gone: asyncio.Event) -> None:
        """Start it on the engine thread; Model.stream_tokens' checks raise ColibriError here."""
        await self.served.on_engine(self.start)

    def start(self) -> None:
        """Runs on the engine thread; Model.stream_tokens' checks raise here."""
        self.events = self.m.stream_tokens(self.ids, stop=self.stops, **self.gen)
        self.record = self.m.last_generation

    def step(self):
        """The next event, or None at the end (runs on the engine thread)."""
        if self.events is None:
            return None
        try:
            return next(self.events)
        except StopIteration:
            return None

    def close(self) -> None:
        """Runs on the engine thread: the generator's cleanup frees the Model for the next one."""
        if self.events is not None:
            self.events.close()

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
        if self.record is None:
            return
        s = self.served
        s.tokens_in.inc(self.prompt_tokens)
        s.tokens_out.inc(len(self.record.tokens))
        if self.record.reused_tokens:
            s.reuse_hits.inc()
            s.reused.inc(self.record.reused_tokens)


def _warm_up(m) -> None:
    """One short prompt and a decoded token before /health says ready: the first request would
    otherwise pay for the first touches of the weights, the thread pool's start and the
    kernels' first calls (as llama-server warms up before it listens)."""
    ids = [(i * 7919) % m.config.vocab_size for i in range(1, WARM_UP_TOKENS + 1)]
    for _ in m.generate(ids, max_new_tokens=2, reuse_prefix=False, stop_at_eos=False):
        pass


def _warn_parallel_under_budget(m, parallel: int) -> None:
    """Sequences decoded together use the union of their experts each step. Under an expert budget
    that cannot hold all the experts, the ones it cannot hold are read again from storage step
    after step: on mixtral-mini int8, 4 sequences gave fewer tokens a second in all than one below
    ~90 % of the experts (BENCHMARKS.md, "serve --parallel under an expert budget")."""
    experts = m.residency.expert_bytes
    if m.expert_budget is not None and m.expert_budget < experts:
        logger.warning("--parallel %d under an expert budget of %d MB (the experts: %d MB): sequences decoded "
                       "together use more experts a step than one does, and what the budget cannot hold is read "
                       "again from storage; if colibri_expert_cache_uses shows misses growing, --parallel 1 may "
                       "give more tokens a second", parallel, m.expert_budget >> 20, experts >> 20)


def _for_one_request(e: Exception) -> Exception:
    """A new exception for one request from `e`, which several share (a failed step, the Batch's
    thread gone): each raise then has its own traceback (re-raising one object grows its
    traceback by every request's frames). A ColibriError keeps its kind and message (a 500 with
    the message, as in the serial path); anything else becomes a RuntimeError caused by it."""
    fresh = ColibriError(str(e)) if isinstance(e, ColibriError) else \
        RuntimeError(f"{type(e).__name__} in the batch's engine thread")
    fresh.__cause__ = e
    return fresh


class BatchedGeneration(Generation):
    """One request's sequence in the Stepper's Batch (parallel > 1): the Batch's thread puts its
    events, (kind, value) pairs, into `inbox` — ("ok", None) once added, ("event", (text, pick))
    a token, ("end", None), ("error", exception) — and the request's task reads them."""

    def __init__(self, served: Served, m, ids, gen: dict, stops, arrived: float):
        super().__init__(served, m, ids, gen, stops, arrived)
        self.loop = asyncio.get_running_loop()
        self.inbox = asyncio.Queue()
        self.seq = None                  # its batching.Sequence, set on the Batch's thread

    def deliver(self, kind: str, value=None) -> None:
        """Runs on the Batch's thread."""
        self.loop.call_soon_threadsafe(self.inbox.put_nowait, (kind, value))

    async def begin(self, gone: asyncio.Event) -> None:
        self.served.stepper.submit("add", self)
        kind, value = await self._next(gone)
        if kind == "error":
            raise value

    async def next_event(self, gone: asyncio.Event):
        kind, value = await self._next(gone)
        if kind == "error":
            raise value
        return value if kind == "event" else None

    async def _next(self, gone: asyncio.Event) -> tuple:
        """The next (kind, value) from the Batch's thread; Disconnected once the client has gone."""
        got = asyncio.ensure_future(self.inbox.get())
        left = asyncio.ensure_future(gone.wait())
        try:
            await asyncio.wait((got, left), return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            if not got.done():
                got.cancel()
        if not got.done() or got.cancelled():
            raise Disconnected()
        return got.result()

    def close(self) -> None:
        """Cancel its sequence (on the Batch's thread, before any later request's add)."""
        self.served.stepper.submit("cancel", self)


class Stepper:
    """The engine thread of a server with parallel > 1: it owns a colibri.batching.Batch over the
    Model and steps it while any request runs, handing each token to its request. Jobs ("add",
    g), ("cancel", g), ("stop", None) arrive in one FIFO, so a place freed by a cancel is free
    for the add that follows it."""

    def __init__(self, model, step_tokens: int | None = None):
        from .batching import Batch

        self.batch = Batch(model, step_tokens)
        self.jobs = queue.SimpleQueue()
        self.owners = {}                 # id(sequence) -> its BatchedGeneration
        self.failed = None               # the exception that ended the thread, if one did
        self.lock = threading.Lock()     # orders submit() against the thread's end
        self.thread = threading.Thread(target=self._run, name="colibri-batch", daemon=True)
        self.thread.start()

    def submit(self, kind: str, g=None) -> None:
        with self.lock:
            if self.failed is None:
                self.jobs.put((kind, g))
            elif kind == "add":                  # nothing will step it: fail at once, not hang
                g.deliver("error", _for_one_request(self.failed))

    def stop(self) -> None:
        self.submit("stop")
        self.thread.join()               # (a thread that failed has ended already; adds from here on fail at once)

    def _run(self) -> None:
        batch = self.batch
        jobs = []                        # taken from the FIFO, not yet done
        try:
            while True:
                if not jobs and not batch.running:
                    jobs.append(self.jobs.get())
                while True:
                    try:
                        jobs.append(self.jobs.get_nowait())
                    except queue.Empty:
                        break
                while jobs:
                    kind, g = jobs.pop(0)
                    if kind == "stop":
                        jobs.insert(0, (kind, g))
                        return
                    if kind == "add":
                        self._add(g)
                    elif g.seq is not None:
                        batch.cancel(g.seq)
                        self.owners.pop(id(g.seq), None)
                if batch.running:
                    self._step()
        except Exception as e:          # noqa: BLE001 - a bug here must not leave requests waiting forever
            logger.error("the batch's engine thread failed", exc_info=e)
            with self.lock:
                self.failed = e
            self._fail_all(e)
        finally:
            with self.lock:              # the adds taken or queued before the end: answered, not left waiting
                self.failed = self.failed or RuntimeError("the server is stopping")
                while True:
                    try:
                        jobs.append(self.jobs.get_nowait())
                    except queue.Empty:
                        break
            for kind, g in jobs:
                if kind == "add":
                    g.deliver("error", _for_one_request(self.failed))
            batch.close()

    def _fail_all(self, e: Exception) -> None:
        """End every running request with `e` (a 500) and free their places."""
        for seq in self.batch.running:
            self.batch.cancel(seq)
        for g in self.owners.values():
            g.deliver("error", _for_one_request(e))
        self.owners.clear()

    def _add(self, g: BatchedGeneration) -> None:
        try:
            g.seq = _contained(self.batch.add, g.ids, stop=g.stops, **g.gen)
        except Exception as e:          # noqa: BLE001 - the request reports it (ColibriError: 400)
            g.deliver("error", e)
            return
        g.record = g.seq.record
        self.owners[id(g.seq)] = g
        g.deliver("ok")

    def _step(self) -> None:
        try:
            events = _contained(self.batch.step)
        except Exception as e:          # noqa: BLE001 - every running request ends with it
            self._fail_all(e)
            return
        for seq, token, pick, text in events:
            g = self.owners.get(id(seq))
            if g is None:
                continue
            if token is None:            # this sequence alone failed (its sampler): it ends with a 500
                g.deliver("error", _for_one_request(seq.error))
                del self.owners[id(seq)]
                continue
            g.deliver("event", (text, pick))
            if seq.done:
                g.deliver("end")
                del self.owners[id(seq)]


# ---- the app ------------------------------------------------------------------------------------------

def create_app(served: Served):
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    def error_response(e: APIError, endpoint: str):
        served.requests.labels(endpoint, str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers or None)

    class Endpoint:
        """One route as an ASGI app around `handler(request, send)`, which sends its own
        response. An APIError is answered in OpenAI's shape; any other exception is logged here
        with its traceback and answered with a 500 in the same shape (never the traceback);
        a client that went away gets nothing more. Whatever it held is released by the
        handler's own finally blocks."""

        def __init__(self, endpoint: str, handler):
            self.endpoint, self.handler = endpoint, handler

        async def __call__(self, scope, receive, send):
            started = False

            async def tracked(message):
                nonlocal started
                started = started or message["type"] == "http.response.start"
                await send(message)

            try:
                await self.handler(Request(scope, receive), tracked)
            except Disconnected:
                served.requests.labels(self.endpoint, "disconnected").inc()
            except asyncio.CancelledError:
                # the ASGI server cancels what outlasts its graceful shutdown: the handler's
                # finally blocks have freed the engine; ending here, not re-raising, keeps a
                # traceback out of the log (uvicorn then closes the connection)
                served.requests.labels(self.endpoint, "cancelled").inc()
                logger.warning("%s %s cancelled (the server is stopping)", scope.get("method"), scope.get("path"))
            except APIError as e:
                if not started:
                    await error_response(e, self.endpoint)(scope, receive, send)
            except Exception as e:       # noqa: BLE001 - the catch-all: a 500, the traceback in the log
                logger.error("%s %s failed", scope.get("method"), scope.get("path"), exc_info=e)
                if not started:
                    await error_response(_internal(e), self.endpoint)(scope, receive, send)

    def check_key(request: Request) -> None:
        if served.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
        # headers arrive decoded as latin-1: back to the bytes the client sent; the comparison
        # takes the same time wherever the bytes differ
        same = hmac.compare_digest(token.strip().encode("latin-1"), served.api_key.encode("utf-8"))
        if not (same and scheme.lower() == "bearer"):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY)", kind="authentication_error",
                           code="invalid_api_key")

    async def read_body(request: Request):
        limit = MAX_BODY_BYTES
        too_large = APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large",
                             headers={"Connection": "close"})
        length = request.headers.get("content-length", "").strip()
        if length.isdigit() and int(length) > limit:
            raise too_large                  # refused before a byte of the body is read
        parts, size = [], 0
        try:
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise too_large          # a chunked (or lying) body: read no further
                parts.append(part)
        except ClientDisconnect:
            raise Disconnected() from None
        try:
            doc = json.loads(b"".join(parts))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as e:
            raise APIError(400, f"the request body is not valid JSON ({str(e)[:100]})") from None
        _check_unicode(doc)
        return doc

    async def reply(request: Request, send, response) -> None:
        await response(request.scope, request.receive, send)

    async def health(request: Request, send):
        if served.stepper is not None and served.stepper.failed is not None:     # restart me
            return await reply(request, send, JSONResponse(
                {"status": "error", "error": "the batch's engine thread has stopped"}, status_code=500))
        if served.model is not None:
            return await reply(request, send, JSONResponse({"status": "ok"}))
        if served.load_error:
            return await reply(request, send, JSONResponse({"status": "error", "error": served.load_error},
                                                           status_code=500))
        await reply(request, send, JSONResponse({"status": "loading"}, status_code=503,
                                                headers={"Retry-After": str(RETRY_AFTER_SECONDS)}))

    async def models(request: Request, send):
        check_key(request)
        await reply(request, send, JSONResponse({"object": "list", "data": [
            {"id": served.name, "object": "model", "created": served.created, "owned_by": "colibri"}]}))

    async def model_by_id(request: Request, send):
        check_key(request)
        wanted = request.path_params["model_id"]
        if wanted != served.name:
            raise APIError(404, f"the model '{wanted[:100]}' does not exist; this server serves '{served.name}'",
                           param="model", code="model_not_found", kind="not_found_error")
        await reply(request, send, JSONResponse(
            {"id": served.name, "object": "model", "created": served.created, "owned_by": "colibri"}))

    def text_tool(fn):
        """A route answering fn(model, body) -> doc, run off the event loop: /tokenize (llama-server's
        {"content", "add_special", "with_pieces"}, vLLM's {"prompt", "add_special_tokens"} or
        {"messages", "add_generation_prompt"} -> {"tokens", "count", "max_model_len"}) and
        /detokenize ({"tokens"} -> {"content"}, and vLLM's "prompt")."""
        async def route(request: Request, send):
            check_key(request)
            body = await read_body(request)
            doc = await served.off_loop(fn, served.ready(), body)
            await reply(request, send, JSONResponse(doc))
        return route

    async def metrics(request: Request, send):
        served.observe_memory()
        await reply(request, send, Response(generate_latest(served.registry), media_type=CONTENT_TYPE_LATEST))

    async def completion(request: Request, send, chat: bool):
        arrived = time.perf_counter()
        endpoint = "chat" if chat else "completions"
        check_key(request)
        body = await read_body(request)
        job = await served.prepare(body, chat)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        watch = _Watch(request.receive)
        try:
            if job.stream:
                return await streamed(job, send, watch.gone, rid, endpoint, arrived)
            doc = await whole(job, watch.gone, rid, arrived)
        finally:
            watch.stop()
        await reply(request, send, JSONResponse(doc, headers={SEED_HEADER: str(job.gen["seed"])}))
        served.requests.labels(endpoint, "200").inc()

    async def run_choice(job: Job, index: int, gone, arrived: float, on_event, wait=None):
        """Generation `index` of the job (its seed: the job's + index) on a place of the engine:
        `await on_event(piece, pick)` for each event; returns the Generation, finished. `wait`
        (streams) replaces the plain wait for the next event (to send keep-alives meanwhile)."""
        gen = dict(job.gen, seed=(job.gen["seed"] + index) % (1 << SEED_BITS))
        await served.acquire(gone)
        g = served.generation(job.m, job.ids, gen, job.stops, arrived)
        try:                             # from here the place is this request's until finish()
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
        return {"prompt_tokens": len(job.ids), "completion_tokens": done, "total_tokens": len(job.ids) + done,
                "prompt_tokens_details": {"cached_tokens": int(cached or 0)}}

    def finish_reason(g, parser) -> str:
        reason = g.record.finish_reason if g.record is not None else "stop"
        if parser is not None and parser.has_tool_calls and reason == "stop":
            return "tool_calls"
        return reason

    async def whole(job: Job, gone, rid, arrived: float) -> dict:
        choices, runs = [], []
        for index in range(job.n):
            text, picks = [], []
            parser = reply_parser(job)

            async def on_event(piece, pick):
                text.append(piece)
                if parser is not None and piece:
                    parser.push(piece)
                if pick is not None:
                    picks.append(pick)
            try:
                g = await run_choice(job, index, gone, arrived, on_event)
                if parser is not None:
                    parser.finish()
            except ColibriError as e:
                raise APIError(500, str(e), kind="server_error") from None
            runs.append(g)
            choice = {"index": index, "finish_reason": finish_reason(g, parser)}
            if job.chat:
                choice["message"] = _message(parser.message if parser is not None else None, "".join(text))
                choice["logprobs"] = None if job.logprobs is None else \
                    {"content": [_chat_logprob(job.m, p, job.logprobs) for p in picks]}
            else:
                choice["text"] = "".join(text)
                choice["logprobs"] = None if job.logprobs is None else _completion_logprobs(job.m, picks, job.logprobs)
            choices.append(choice)
        return {"id": rid, "object": "chat.completion" if job.chat else "text_completion", "created": int(time.time()),
                "model": served.name, "choices": choices, "usage": usage(job, runs), "seed": job.gen["seed"]}

    async def streamed(job: Job, send, gone, rid, endpoint, arrived: float) -> None:
        """Server-sent events, one or more per token; the client's disconnect ends the loop before
        the engine is asked for another token (run_choice's finally then frees the engine).
        While no event comes (a long prompt), a comment line every KEEPALIVE_SECONDS keeps
        proxies and clients from timing the connection out."""
        created = int(time.time())
        chat = job.chat
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        started = False

        async def start() -> None:
            """The headers go out with the first event: until then (the queue, the checks of the
            first generation) an error is still a plain HTTP error response."""
            nonlocal started
            if not started:
                started = True
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                        (b"cache-control", b"no-cache"),
                                        (SEED_HEADER.encode(), str(job.gen["seed"]).encode())]})

        async def emit(doc) -> None:
            await start()
            text = "data: [DONE]\n\n" if doc is None else f"data: {json.dumps(doc, ensure_ascii=False)}\n\n"
            await send({"type": "http.response.body", "body": text.encode("utf-8"), "more_body": True})

        def event(choice, usage_doc=None):
            doc = {"id": rid, "object": chunk_obj, "created": created, "model": served.name,
                   "choices": [choice] if choice is not None else []}
            if job.include_usage:
                doc["usage"] = usage_doc
            return doc

        async def wait(g, gone):
            step = asyncio.ensure_future(served.next_event(g, gone))
            while True:
                done, _ = await asyncio.wait((step,), timeout=KEEPALIVE_SECONDS)
                if done:
                    return step.result()
                await start()
                await send({"type": "http.response.body", "body": b": keep-alive\n\n", "more_body": True})

        outcome, runs = "200", []
        try:
            for index in range(job.n):
                parser = reply_parser(job)
                opened = []              # the choice's first chunk (its role) is out

                async def open_choice(index=index, opened=opened):
                    if chat and not opened:
                        opened.append(True)
                        await emit(event({"index": index, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}))

                async def on_event(piece, pick, index=index, parser=parser, open_choice=open_choice):
                    await open_choice()
                    lp = None
                    if job.logprobs is not None and pick is not None:
                        lp = {"content": [_chat_logprob(job.m, pick, job.logprobs)]} if chat else \
                            _completion_logprobs(job.m, [pick], job.logprobs)
                    if not chat:
                        if piece or lp is not None:
                            await emit(event({"index": index, "text": piece, "logprobs": lp, "finish_reason": None}))
                        return
                    deltas = (parser.push(piece) if piece else []) if parser is not None else \
                        ([{"content": piece}] if piece else [])
                    if not deltas and lp is not None:
                        deltas = [{}]
                    for delta in deltas:
                        await emit(event({"index": index, "delta": delta, "logprobs": lp, "finish_reason": None}))
                        lp = None
                g = await run_choice(job, index, gone, arrived, on_event, wait)
                runs.append(g)
                await open_choice()
                if parser is not None:
                    for delta in parser.finish():
                        await emit(event({"index": index, "delta": delta, "logprobs": None, "finish_reason": None}))
                reason = finish_reason(g, parser)
                await emit(event({"index": index, "delta": {}, "logprobs": None, "finish_reason": reason} if chat
                                 else {"index": index, "text": "", "logprobs": None, "finish_reason": reason}))
            if job.include_usage:
                await emit(event(None, usage(job, runs)))
        except Disconnected:
            raise
        except Exception as e:           # noqa: BLE001 - the headers are out: the error is the last event
            if not started:
                raise                    # still a plain HTTP error (the Endpoint answers it)
            outcome = "500"
            if isinstance(e, (ColibriError, APIError)):
                err = e if isinstance(e, APIError) else APIError(500, str(e), kind="server_error")
            else:
                logger.error("%s failed mid-stream", endpoint, exc_info=e)
                err = _internal(e)
            await emit(err.body())
        await emit(None)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        served.requests.labels(endpoint, outcome).inc()

    async def chat_completions(request: Request, send):
        await completion(request, send, chat=True)

    async def completions(request: Request, send):
        await completion(request, send, chat=False)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        served.start_loading()              # /health says 503 until the model is ready
        yield
        served.executor.shutdown(wait=True)     # the closes of cancelled generations run first
        if served.stepper is not None:
            served.stepper.stop()

    async def http_error(request: Request, exc: HTTPException):
        # routing's own errors (an unknown path: 404, a wrong method: 405) in OpenAI's shape too
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                     kind=kind).body(), status_code=exc.status_code, headers=exc.headers)

    async def server_error(request: Request, exc: Exception):
        return JSONResponse(_internal(exc).body(), status_code=500)      # uvicorn logs the traceback

    app = Starlette(routes=[
        Route("/health", Endpoint("health", health), methods=["GET"]),
        Route("/v1/models", Endpoint("models", models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", Endpoint("models", model_by_id), methods=["GET"]),
        Route("/tokenize", Endpoint("tokenize", text_tool(_tokenize)), methods=["POST"]),
        Route("/detokenize", Endpoint("detokenize", text_tool(_detokenize)), methods=["POST"]),
        Route("/metrics", Endpoint("metrics", metrics), methods=["GET"]),
        Route("/v1/chat/completions", Endpoint("chat", chat_completions), methods=["POST"]),
        Route("/v1/completions", Endpoint("completions", completions), methods=["POST"]),
    ], lifespan=lifespan, exception_handlers={HTTPException: http_error, Exception: server_error})
    return app


TOKENIZE_FIELDS = frozenset({"content", "prompt", "messages", "add_special", "add_special_tokens", "with_pieces",
                             "add_generation_prompt", "model", "tools", "chat_template_kwargs"})


def _tokenize(m, body) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - TOKENIZE_FIELDS)
    if unknown:
        raise APIError(400, f"unknown field '{unknown[0][:64]}'", param=unknown[0][:64], code="unknown_parameter")
    given = [k for k in ("content", "prompt", "messages") if body.get(k) is not None]
    if len(given) != 1:
        raise APIError(400, "give exactly one of 'content' (text), 'prompt' (text) or 'messages' (a conversation)")
    with_pieces = _field(body, "with_pieces", bool, False, what="true or false")
    if given[0] == "messages":
        tools = openai_request.tools_of({"tools": body.get("tools")})[0]
        add = _field(body, "add_generation_prompt", bool, True, what="true or false")
        if m.chat_template is None:
            raise APIError(422, "the model has no chat template", param="messages", code="chat_template_error")
        try:
            ids = m.apply_chat_template(_messages(body), add_generation_prompt=add, tools=tools, **_template_kwargs(body))
        except ColibriError as e:
            raise APIError(422, str(e), param="messages", code="chat_template_error") from None
    else:
        text = body[given[0]]
        if not isinstance(text, str):
            raise APIError(400, f"'{given[0]}' must be a string", param=given[0])
        # llama-server adds no special tokens unless asked; vLLM adds them unless told not to
        add = _field(body, "add_special", bool, given[0] == "prompt", what="true or false")
        add = _field(body, "add_special_tokens", bool, add, what="true or false")
        try:
            ids = m.encode(text, add_special_tokens=add)
        except ColibriError as e:
            raise APIError(400, str(e), param=given[0]) from None
    tokens = [{"id": t, "piece": _token_text(m, t)} for t in ids] if with_pieces else list(ids)
    return {"tokens": tokens, "count": len(ids), "max_model_len": m.n_ctx}


def _detokenize(m, body) -> dict:
    if not isinstance(body, dict) or set(body) - {"tokens", "model"}:
        raise APIError(400, "the body must be {'tokens': [token ids]}", param="tokens")
    ids = body.get("tokens")
    vocab = m.config.vocab_size
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise APIError(400, "'tokens' must be a list of token ids", param="tokens")
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {str(bad)[:30]} is outside the model's vocabulary [0, {vocab})", param="tokens")
    if m.tokenizer is None:
        raise APIError(422, "the model has no tokenizer", param="tokens")
    text = m.tokenizer.decode(ids)
    return {"content": text, "prompt": text}


def _internal(e: Exception) -> APIError:
    return APIError(500, f"internal server error ({type(e).__name__}); the server's log has the details",
                    kind="server_error", code="internal_error")


def _completion_logprobs(m, picks, top: int) -> dict:
    tokens = [_token_text(m, p.token) for p in picks]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [p.logprob for p in picks],
            "top_logprobs": [{_token_text(m, i): lp for i, lp in p.top[:top]} for p in picks], "text_offset": offsets}


def serve(load, name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_queue: int = 16, queue_timeout: float = 600.0, log=print, parallel: int = 1,
          step_tokens: int | None = None) -> None:
    """Run the server until SIGINT/SIGTERM (uvicorn stops accepting, gives the running requests
    GRACEFUL_SHUTDOWN_SECONDS to finish, then cancels them, and returns). `load()` -> Model
    (loaded with this `parallel`), called once in the background."""
    _need_stack()
    import uvicorn

    if api_key is not None and not api_key.strip():
        raise ColibriError("--api-key is empty: give a key, or leave the option out to serve without one")
    if isinstance(parallel, bool) or not isinstance(parallel, int) or not 1 <= parallel <= MAX_PARALLEL:
        raise ColibriError(f"--parallel must be in 1..{MAX_PARALLEL}, got {parallel!r}")
    served = Served(load, name, api_key, max_queue, queue_timeout, parallel, step_tokens)
    app = create_app(served)
    at_once = "one generation at a time" if parallel == 1 else f"{parallel} generations at a time, decoded together"
    log(f"[INFO] Serving '{name}' on http://{host}:{port}/v1 (health: /health, metrics: /metrics); "
        f"{at_once}, up to {max_queue} waiting")
    # uvicorn stops gracefully on SIGTERM and then re-raises the signal under the handler it found:
    # a handler that returns makes that re-raise a no-op, so SIGTERM ends with status 0
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS)
    finally:
        signal.signal(signal.SIGTERM, previous)
