"""The served model and the thread that runs it: the FIFO of places, one generation stepped alone
or several decoded together, and the warm-up.

Design
------
A Model loaded with `parallel=N` (`--parallel N`, default 1) runs N generations at once; further
requests wait in a FIFO (Served.acquire hands a free place to the first waiter) bounded by
`max_queue` — beyond it, and after `queue_timeout` seconds of waiting, the answer is 503 with
Retry-After. The engine runs on one thread (a worker, or the Batch's Stepper); the event loop
only parses, queues and writes. With N = 1 a generation advances one token per hop to that
thread (Generation); with N > 1 that thread runs a colibri.batching.Batch (Stepper): each step
is one engine pass over a token of every decoding request and pieces of the new prompts, up to
`--step-tokens` in all, every weight read once for all of them — the tokens of each are those it
gets alone (BatchedGeneration). A client that disconnects stops its generation after the token
being computed: its generator is closed (its sequence cancelled) on the engine thread, the next
request's work queuing behind that. Repeated prefixes (multi-turn chat, a shared system prompt)
reuse the KV cache through Model.generate's prefix reuse (with N > 1: the place in the cache that
holds the longest prefix), and the prefix store (--cache-ram, --kv-store; colibri.kvstore) keeps
finished and evicted conversations for whichever place their next turn lands in.

A request's own preparation (parsing its JSON, its chat template, tokenizing, and writing a long
answer such as /tokenize's) runs on a daemon thread of its own (Served.off_loop), bounded in
time: a template that loops costs that thread, never the event loop. Requests are prepared
limits.PREP_WORKERS at a time (one), in their order of arrival, so they reach the FIFO of places
in that order; a thread that holds the GIL holds the event loop too, and every preparation more
at once is one more such thread. What native libraries raise outside Exception (the Rust tokenizers' PanicException) is
turned into an ordinary error for the one request (_contained); the engine thread goes on.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time

from ..errors import ColibriError
from . import limits
from .errors import APIError, Disconnected

logger = logging.getLogger("colibri.serve")


class Served:
    """The model, its worker thread, the FIFO in front of it and the metrics."""

    def __init__(
        self,
        load,
        name: str,
        api_key: str | None,
        max_queue: int,
        queue_timeout: float,
        parallel: int = 1,
        step_tokens: int | None = None,
        draft: dict | None = None,
    ):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.load, self.name, self.api_key = load, name, api_key
        self.max_queue, self.queue_timeout = max_queue, queue_timeout
        self.parallel = parallel  # generations at once (the Model's load(parallel=))
        self.step_tokens = step_tokens  # the Batch's tokens per step (None: its default)
        self.draft = dict(draft or {})  # --draft, --draft-max: the speculation a request gets unless it asks
        self.model = None
        self.stepper = None  # the Batch's engine thread (parallel > 1), once loaded
        self.load_error = None
        self.created = int(time.time())
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="colibri-engine")
        self.prep_slots = None  # asyncio.Semaphore(PREP_WORKERS), made on the serving loop at first use
        self.active = 0  # requests holding a place (at most `parallel`)
        self.waiters = collections.deque()  # futures of the requests waiting for it, in arrival order
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "colibri_requests", "requests by endpoint and outcome", ["endpoint", "outcome"], registry=r
        )
        self.queue_depth = Gauge("colibri_queue_depth", "requests waiting for the engine", registry=r)
        self.prep = {"running": 0, "waiting": 0}  # requests in off_loop, by state
        self.preparing = Gauge(
            "colibri_preparing_requests",
            "requests whose own work (JSON, chat template, tokenizing) runs, or waits its turn",
            ["state"],
            registry=r,
        )
        self.running = Gauge("colibri_running_requests", "requests holding one of the --parallel places", registry=r)
        self.ttft = Histogram(
            "colibri_time_to_first_token_seconds",
            "request arrival to first token",
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.itl = Histogram(
            "colibri_inter_token_latency_seconds",
            "time between tokens of a stream",
            registry=r,
            buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2),
        )
        self.tokens_in = Counter("colibri_prompt_tokens", "prompt tokens received", registry=r)
        self.tokens_out = Counter("colibri_generated_tokens", "tokens generated", registry=r)
        self.reused = Counter("colibri_prefix_reused_tokens", "prompt tokens the KV cache already held", registry=r)
        self.reuse_hits = Counter("colibri_prefix_reuse_hits", "requests that reused part of the KV cache", registry=r)
        self.drafts = Counter(
            "colibri_draft_tokens",
            "speculative decoding's drafted tokens, by whether the model's pick kept them",
            ["result"],
            registry=r,
        )
        self.resident = Gauge("colibri_resident_expert_bytes", "expert weights resident", registry=r)
        self.faults = Gauge("colibri_major_page_faults", "major page faults of the process", registry=r)
        self.cache_uses = Gauge(
            "colibri_expert_cache_uses",
            "expert uses since load, by whether the expert cache held it",
            ["result"],
            registry=r,
        )
        self.evictions = Gauge("colibri_expert_evictions", "experts evicted under the budget since load", registry=r)
        self.storage_read = Gauge("colibri_storage_read_bytes", "bytes read from storage since load", registry=r)
        self.budget = Gauge("colibri_expert_budget_bytes", "the expert budget (0: none)", registry=r)
        self.cgroup_usage = Gauge(
            "colibri_cgroup_usage_bytes", "the enforcing cgroup's usage, page cache included (0: unknown)", registry=r
        )
        # the prefix store (colibri.kvstore): cumulative since load, read from the Model like the cache's
        self.store_bytes = Gauge("colibri_prefix_store_bytes", "KV cache bytes the prefix store holds", registry=r)
        self.store_budget = Gauge(
            "colibri_prefix_store_budget_bytes", "the prefix store's budget (0: none)", registry=r
        )
        self.store_lookups = Gauge(
            "colibri_prefix_store_lookups",
            "prompts since load by whether the prefix store restored a longer prefix than their place held",
            ["result"],
            registry=r,
        )
        self.store_restored = Gauge(
            "colibri_prefix_store_restored_tokens",
            "prompt tokens restored from the prefix store since load",
            registry=r,
        )
        self.store_evicted = Gauge(
            "colibri_prefix_store_evicted_blocks",
            "blocks the prefix store dropped for its budget since load",
            registry=r,
        )
        self.store_write_errors = Gauge(
            "colibri_prefix_store_write_errors",
            "blocks the --kv-store directory did not take (full, read-only) since load",
            registry=r,
        )

    def start_loading(self) -> None:
        def run():
            m = None
            try:
                m = self.load()
                if m.parallel < self.parallel:
                    raise ColibriError(
                        f"the model was loaded with parallel={m.parallel}; the server was asked for "
                        f"{self.parallel} places"
                    )
                _warm_up(m)
                if self.parallel > 1:
                    self.stepper = Stepper(m, self.step_tokens)
                self.model = m
            except Exception as e:  # noqa: BLE001 - reported by /health and each request
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
            raise APIError(
                503,
                f"the queue is full ({self.max_queue} waiting); retry later",
                kind="server_error",
                code="queue_full",
            )
        turn = asyncio.get_running_loop().create_future()
        self.waiters.append(turn)
        self.queue_depth.set(len(self.waiters))
        left = asyncio.ensure_future(gone.wait())
        owned = False
        try:
            await asyncio.wait((turn, left), timeout=self.queue_timeout, return_when=asyncio.FIRST_COMPLETED)
            owned = turn.done() and not gone.is_set()
        finally:  # also when this task is cancelled
            left.cancel()
            if not owned:
                self._give_up(turn)
            self.queue_depth.set(len(self.waiters))
        if not owned:
            if gone.is_set():
                raise Disconnected()
            raise APIError(
                503,
                f"waited {self.queue_timeout:g} s for the engine; retry later",
                kind="server_error",
                code="queue_timeout",
            )

    def _give_up(self, turn) -> None:
        if turn.done() and not turn.cancelled():
            self.release()  # the engine was handed to this request: pass it on
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
            g.close()  # queued to the Batch's thread before the place is handed on
        else:
            try:
                self.executor.submit(g.close)
            except RuntimeError:  # the executor is shut down: the process is exiting
                pass
        self.release()

    async def off_loop(self, fn, *args):
        """fn(*args) on a daemon thread of its own, at most limits.PREP_WORKERS at once (in the order
        the calls came: asyncio.Semaphore wakes its waiters first come, first served), answered within
        limits.PREPARE_SECONDS: a chat template or tokenizer that loops costs that thread (left behind,
        and killed with the process), never the event loop (/health, the other requests, SIGTERM)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle(result, error) -> None:
            if not done.done():
                done.set_exception(error) if error is not None else done.set_result(result)

        def work() -> None:
            try:
                result, error = _contained(fn, *args), None
            except Exception as e:  # noqa: BLE001 - handed to the request's task
                result, error = None, e
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(settle, result, error)

        if self.prep_slots is None:
            self.prep_slots = asyncio.Semaphore(limits.PREP_WORKERS)
        self._count_prep("waiting", 1)
        try:
            await self.prep_slots.acquire()
        finally:
            self._count_prep("waiting", -1)
        self._count_prep("running", 1)
        try:
            threading.Thread(target=work, name="colibri-prepare", daemon=True).start()
            try:
                return await asyncio.wait_for(asyncio.shield(done), limits.PREPARE_SECONDS)
            except asyncio.TimeoutError:
                logger.warning(
                    "a request's preparation (chat template, tokenizer) outlasted %s s; its thread is left running",
                    limits.PREPARE_SECONDS,
                )
                raise APIError(
                    422,
                    f"the request's chat template and tokenizing did not finish within {limits.PREPARE_SECONDS} s",
                    code="prepare_timeout",
                ) from None
        finally:
            self._count_prep("running", -1)
            self.prep_slots.release()

    def _count_prep(self, state: str, step: int) -> None:
        self.prep[state] += step
        self.preparing.labels(state).set(self.prep[state])

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
            self.store_bytes.set(st["prefix_store_bytes"])
            self.store_budget.set(st["prefix_store_budget_bytes"])
            self.store_lookups.labels("hit").set(st["prefix_store_hits"])
            self.store_lookups.labels("miss").set(st["prefix_store_misses"])
            self.store_restored.set(st["prefix_store_restored_tokens"])
            self.store_evicted.set(st["prefix_store_evicted_blocks"])
            self.store_write_errors.set(st["prefix_store_write_errors"])


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


def _contained(fn, *args, **kwargs):
    """fn(*args), with what native libraries raise outside Exception (the Rust `tokenizers`'
    PanicException derives from BaseException) turned into an ordinary error: a 500 for this
    request, never a dead worker or server."""
    try:
        return fn(*args, **kwargs)
    except (Exception, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001 - see above
        raise RuntimeError(f"{type(e).__name__}: {e}") from None


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
        spec = self.record.speculation
        if spec is not None and spec.drafted:
            s.drafts.labels("accepted").inc(spec.accepted)
            s.drafts.labels("rejected").inc(spec.drafted - spec.accepted)


class BatchedGeneration(Generation):
    """One request's sequence in the Stepper's Batch (parallel > 1): the Batch's thread puts its
    events, (kind, value) pairs, into `inbox` — ("ok", None) once added, ("event", (text, pick))
    a token, ("end", None), ("error", exception) — and the request's task reads them."""

    def __init__(self, served: Served, m, ids, gen: dict, stops, arrived: float):
        super().__init__(served, m, ids, gen, stops, arrived)
        self.loop = asyncio.get_running_loop()
        self.inbox = asyncio.Queue()
        self.seq = None  # its batching.Sequence, set on the Batch's thread

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
        from ..batching import Batch

        self.batch = Batch(model, step_tokens)
        self.jobs = queue.SimpleQueue()
        self.owners = {}  # id(sequence) -> its BatchedGeneration
        self.failed = None  # the exception that ended the thread, if one did
        self.lock = threading.Lock()  # orders submit() against the thread's end
        self.thread = threading.Thread(target=self._run, name="colibri-batch", daemon=True)
        self.thread.start()

    def submit(self, kind: str, g=None) -> None:
        with self.lock:
            if self.failed is None:
                self.jobs.put((kind, g))
            elif kind == "add":  # nothing will step it: fail at once, not hang
                g.deliver("error", _for_one_request(self.failed))

    def stop(self) -> None:
        self.submit("stop")
        self.thread.join()  # (a thread that failed has ended already; adds from here on fail at once)

    def _run(self) -> None:
        batch = self.batch
        jobs = []  # taken from the FIFO, not yet done
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
        except Exception as e:  # noqa: BLE001 - a bug here must not leave requests waiting forever
            logger.error("the batch's engine thread failed", exc_info=e)
            with self.lock:
                self.failed = e
            self._fail_all(e)
        finally:
            with self.lock:  # the adds taken or queued before the end: answered, not left waiting
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
        except Exception as e:  # noqa: BLE001 - the request reports it (ColibriError: 400)
            g.deliver("error", e)
            return
        g.record = g.seq.record
        self.owners[id(g.seq)] = g
        g.deliver("ok")

    def _step(self) -> None:
        try:
            events = _contained(self.batch.step)
        except Exception as e:  # noqa: BLE001 - every running request ends with it
            self._fail_all(e)
            return
        last = {id(seq): i for i, (seq, *_) in enumerate(events)}  # a sequence's drafts give it several
        for i, (seq, token, pick, text) in enumerate(events):
            g = self.owners.get(id(seq))
            if g is None:
                continue
            if token is None:  # this sequence alone failed (its sampler): it ends with a 500
                g.deliver("error", _for_one_request(seq.error))
                del self.owners[id(seq)]
                continue
            g.deliver("event", (text, pick))
            if seq.done and last[id(seq)] == i:
                g.deliver("end")
                del self.owners[id(seq)]


def _warm_up(m) -> None:
    """One short prompt and a decoded token before /health says ready: the first request would
    otherwise pay for the first touches of the weights, the thread pool's start and the
    kernels' first calls (as llama-server warms up before it listens)."""
    ids = [(i * 7919) % m.config.vocab_size for i in range(1, limits.WARM_UP_TOKENS + 1)]
    for _ in m.generate(ids, max_new_tokens=2, reuse_prefix=False, stop_at_eos=False):
        pass


def _warn_parallel_under_budget(m, parallel: int) -> None:
    """Sequences decoded together use the union of their experts each step. Under an expert budget
    that cannot hold all the experts, the ones it cannot hold are read again from storage step
    after step, so several sequences can give fewer tokens a second in all than one."""
    experts = m.residency.expert_bytes
    if m.expert_budget is not None and m.expert_budget < experts:
        logger.warning(
            "--parallel %d under an expert budget of %d MB (the experts: %d MB): sequences decoded "
            "together use more experts a step than one does, and what the budget cannot hold is read "
            "again from storage; if colibri_expert_cache_uses shows misses growing, --parallel 1 may "
            "give more tokens a second",
            parallel,
            m.expert_budget >> 20,
            experts >> 20,
        )


def _for_one_request(e: Exception) -> Exception:
    """A new exception for one request from `e`, which several share (a failed step, the Batch's
    thread gone): each raise then has its own traceback (re-raising one object grows its
    traceback by every request's frames). A ColibriError keeps its kind and message (a 500 with
    the message, as in the serial path); anything else becomes a RuntimeError caused by it."""
    fresh = (
        ColibriError(str(e))
        if isinstance(e, ColibriError)
        else RuntimeError(f"{type(e).__name__} in the batch's engine thread")
    )
    fresh.__cause__ = e
    return fresh
