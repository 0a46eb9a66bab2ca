"""Model: a loaded model directory — mapped weights, the compiled engine, generation.

Design
------
`load()` validates the directory (modeldir.ModelDir), maps every file read-only
(modeldir.MappedModelDir) and hands raw addresses to `_engine.Engine`, which owns the KV cache
and the scratch arena. Weights are used in place in the mappings, never copied. The Python layer
here does what is not per-layer work: checking inputs, sampling, stop tokens, timings and stats.

One Model has one KV cache, so one generation at a time: a second concurrent call is refused
with a clear error rather than interleaved into the same cache. A Model loaded with `parallel=N`
holds N sequences side by side in that cache; a colibri.batching.Batch decodes them together,
one engine step (every weight read once) for a token of each.

Constrained decoding (generate(json_schema= | json_object= | grammar= | regex=), colibri.constraint)
masks the logits of each pick; its vocabulary is built once per Model, at the first such call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import numbers
import os
import threading
import time

import numpy as np

from . import constraint as _constraint
from . import kvstore
from . import nextn
from . import speculate
from .errors import ColibriError
from .names import BF16_PRODUCTS, DEFAULT_EVICTION, KV_CACHE_TYPES, MAX_PARALLEL
from . import _os
from . import spec
from .modeldir import MappedModelDir, ModelDir
from . import residency
from .residency import EVICTION_POLICIES, PREFETCH_MODES, Residency
from .sampling import Sampler
from .streaming import GenerationText, StopStrings
from .textfiles import TextSide, unlisted

from . import _engine, _kernels

MAX_THREADS = 1024  # beyond it a thread that cannot be created would abort mid-output
DEFAULT_MAX_CONTEXT = 4096  # context when the caller does not choose one (KV pages are lazy)
MIN_PLANNED_CHUNK = 16  # the smallest prefill chunk the memory plan lowers the default to
_STATUS_MESSAGES = {
    _engine.STATUS_BAD_ROUTER: "router logits of layer {layer} are NaN or infinite",
    _engine.STATUS_BAD_LOGITS: "the output logits are NaN or infinite",
    _engine.STATUS_BAD_HIDDEN: "the hidden state became NaN or infinite",
}


# load(bf16_products=) (names.BF16_PRODUCTS): how bf16 matrices multiply. "f32": the weights
# widened to f32, the activations as they are (exact: the products of transformers in float32);
# "bf16": the activations rounded to bf16 and multiplied by AVX512_BF16's vdpbf16ps (f32 sums, as
# llama.cpp and ik_llama.cpp do); "auto": bf16 where the CPU has it.


@dataclasses.dataclass(frozen=True)
class _LoadOptions:
    """load()'s options, each checked once against the model's config (one clear error naming the
    value at fault) and normalised: what the memory plan and the engine's spec are made from."""

    threads: int
    n_ctx: int
    prefill_chunk: int | None  # as the caller asked (None: the default)
    chunk: int  # the engine's tokens per call (the rings are sized for it)
    parallel: int
    prefetch: str | None
    kv_cache: str
    bf16_products: bool
    eviction: str | None
    cache_budget: int | None  # expert_cache_mb in bytes
    limit: int | None  # memory_limit_mb in bytes
    cache_ram: int | str | None  # cache_ram_mb: the prefix store's bytes, "auto" or None (no store)
    kv_store: str | None  # the directory the prefix store is mirrored in
    skip_missed: float | None  # F in (0, 1]: decoded tokens skip light missed experts (lossy), or None
    cache_routing: float | None  # lambda in (0, 1]: decoded tokens favour resident experts (lossy), or None

    @classmethod
    def checked(
        cls,
        cfg,
        *,
        threads,
        n_ctx,
        mmap,
        prefill_chunk,
        prefetch,
        expert_cache_mb,
        memory_limit_mb,
        eviction,
        kv_cache,
        bf16_products,
        parallel,
        cache_ram_mb=None,
        kv_store=None,
        skip_missed=None,
        cache_routing=None,
    ) -> "_LoadOptions":
        if threads is None:
            threads = _os.compute_cores()
        if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or not 1 <= threads <= MAX_THREADS:
            raise ColibriError(f"threads must be an integer in 1..{MAX_THREADS}, got {threads!r}")
        threads = int(threads)
        _check_threads_start(threads)
        if n_ctx is None:
            n_ctx = min(cfg.max_position_embeddings, DEFAULT_MAX_CONTEXT)
        if (
            isinstance(n_ctx, bool)
            or not isinstance(n_ctx, numbers.Integral)
            or not 1 <= n_ctx <= cfg.max_position_embeddings
        ):
            raise ColibriError(
                f"n_ctx must be in 1..{cfg.max_position_embeddings} "
                f"(the model's max_position_embeddings), got {n_ctx!r}"
            )
        n_ctx = int(n_ctx)
        if prefetch is not None and prefetch not in PREFETCH_MODES:
            raise ColibriError(f"prefetch must be one of {', '.join(PREFETCH_MODES)}, got {prefetch!r}")
        if prefetch not in (None, "none") and not mmap:
            raise ColibriError("prefetch needs mapped weights (mmap=True)")
        if kv_cache not in KV_CACHE_TYPES:
            raise ColibriError(f"kv_cache must be one of {', '.join(KV_CACHE_TYPES)}, got {kv_cache!r}")
        bf16 = _bf16_products(bf16_products)
        if eviction is not None and eviction not in EVICTION_POLICIES:
            raise ColibriError(f"eviction must be one of {', '.join(EVICTION_POLICIES)}, got {eviction!r}")
        cache_budget = residency._megabytes(expert_cache_mb, "expert_cache_mb")
        limit = residency._megabytes(memory_limit_mb, "memory_limit_mb")
        if prefill_chunk is not None and (
            isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, numbers.Integral) or prefill_chunk < 1
        ):
            raise ColibriError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
        prefill_chunk = None if prefill_chunk is None else int(prefill_chunk)
        chunk = spec.prefill_chunk(prefill_chunk, n_ctx)
        if (
            isinstance(parallel, bool)
            or not isinstance(parallel, numbers.Integral)
            or not 1 <= parallel <= MAX_PARALLEL
        ):
            raise ColibriError(f"parallel must be an integer in 1..{MAX_PARALLEL}, got {parallel!r}")
        if parallel > chunk:
            raise ColibriError(f"parallel {parallel} exceeds the prefill chunk {chunk} (a step's tokens)")
        for name, value in (("skip_missed", skip_missed), ("cache_routing", cache_routing)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1
            ):
                raise ColibriError(f"{name} must be a number in (0, 1], got {value!r}")
        cache_ram = kvstore.checked_budget(cache_ram_mb)
        if kv_store is not None:
            if not isinstance(kv_store, (str, os.PathLike)) or not os.fspath(kv_store):
                raise ColibriError(f"kv_store must be a directory path, got {kv_store!r}")
            kv_store = os.fspath(kv_store)
            if os.path.exists(kv_store) and not os.path.isdir(kv_store):
                raise ColibriError(f"kv_store {kv_store} is not a directory")
            if cache_ram is None and cache_ram_mb is None:
                cache_ram = "auto"  # a directory asks for a store
            elif cache_ram is None:
                raise ColibriError(f"kv_store {kv_store} needs a prefix store: cache_ram_mb is 0")
        return cls(
            threads,
            n_ctx,
            prefill_chunk,
            chunk,
            int(parallel),
            prefetch,
            kv_cache,
            bf16,
            eviction,
            cache_budget,
            limit,
            cache_ram,
            kv_store,
            None if skip_missed is None else float(skip_missed),
            None if cache_routing is None else float(cache_routing),
        )


class Model:
    """A Colibri model ready to run. Create with `colibri.load(path)`."""

    def __init__(
        self,
        path,
        threads: int | None = None,
        n_ctx: int | None = None,
        mmap: bool = True,
        exact_softmax: bool = True,
        prefill_chunk: int | None = None,
        prefetch: str | None = None,
        expert_cache_mb: float | None = None,
        mlock: bool = False,
        warmup: bool = False,
        memory_limit_mb: float | None = None,
        eviction: str | None = None,
        kv_cache: str = "f32",
        bf16_products: str = "auto",
        capture_inputs: bool = False,
        second_moments=None,
        parallel: int = 1,
        cache_ram_mb=None,
        kv_store=None,
        skip_missed=None,
        cache_routing=None,
    ):
        """parallel: sequences the KV cache holds side by side (colibri.batching); cache_ram_mb
        and kv_store: the prefix store (load()); capture_inputs: every matrix product adds its inputs' squares per column into
        self.input_stats[tensor name] (float64 [cols + 1], the token count last): what
        colibri.calibrate collects; it costs a pass over each input. second_moments (with
        capture_inputs): {tensor: shape} of those matrices -> the names that also add x x^T into
        self.input_grams[name] (float64 [cols, cols], the upper triangle: cols^2 / 2 more
        multiply-adds a token)."""
        t0 = time.perf_counter()
        if _kernels.ISA_ERROR:
            raise ColibriError(_kernels.ISA_ERROR)
        self.path = os.fspath(path)
        self._dir = ModelDir(path)  # 1. the directory and its config, validated once
        self.config = cfg = self._dir.config
        self.weight_dtype = self._dir.weight_dtype
        o = _LoadOptions.checked(
            cfg,
            threads=threads,
            n_ctx=n_ctx,
            mmap=mmap,
            prefill_chunk=prefill_chunk,
            prefetch=prefetch,
            expert_cache_mb=expert_cache_mb,
            memory_limit_mb=memory_limit_mb,
            eviction=eviction,
            kv_cache=kv_cache,
            bf16_products=bf16_products,
            parallel=parallel,
            cache_ram_mb=cache_ram_mb,
            kv_store=kv_store,
            skip_missed=skip_missed,
            cache_routing=cache_routing,
        )
        self.threads, self.n_ctx, self.parallel = o.threads, o.n_ctx, o.parallel
        self.bf16_products = o.bf16_products
        self._chunk = o.chunk
        self._weight_bytes_per_token = None  # decode_bytes' weights, counted on first use
        if not mmap:  # read into memory: nothing can be evicted, so all of it must fit
            residency.check_unmapped(self._dir, o.limit, self.path)
        self._maps = MappedModelDir(self._dir, use_mmap=mmap)  # 2. the mappings
        try:
            self.residency = Residency(self._maps, cfg, mlock=mlock, warmup=warmup)
            text = TextSide.load(self._dir.root, self._dir.files, cfg.vocab_size)
            build = dict(
                n_ctx=o.n_ctx,
                chunk=o.chunk,
                threads=o.threads,
                n_seq=o.parallel,
                exact_softmax=bool(exact_softmax),
                kv_cache=o.kv_cache,
                bf16_products=o.bf16_products,
                expert_pages=self.residency.spans,
                prefetch_chunk_bytes=(
                    _os.prefetch_chunk(self._dir.root / "config.json") if self.residency.spans else 0
                ),
            )
            tensors = self._capture_inputs(self._maps.tensor_refs(), capture_inputs, second_moments)
            if mmap and self.residency.spans:  # 3. the memory plan: only mapped experts can be evicted
                self._plan_memory(o, tensors, build)
            budget = self.residency.plan.budget
            if o.cache_budget is not None and mmap:
                budget = o.cache_budget if budget is None else min(budget, o.cache_budget)
            prefetch = o.prefetch
            if prefetch is None:  # under a budget the readers fetch a missing expert in parallel pieces
                prefetch = "routed" if budget is not None else "none"
            if budget is not None:
                self.residency.open_files()
            engine = _engine.Engine(
                spec.build(
                    cfg,
                    tensors,
                    prefetch=prefetch,
                    expert_budget=budget,  # 4. built once
                    eviction=o.eviction or DEFAULT_EVICTION,
                    expert_fds=self.residency.fds,
                    skip_missed=o.skip_missed,
                    cache_routing=o.cache_routing,
                    **build,
                )
            )
            if budget is not None:
                self._hold_warm_experts(engine)
            # which position each row of the sliding layers' rings holds, per sequence
            self._rings = kvstore.RingRows(
                {f.kv_ring: f.sliding_window for f in engine.spec.layers if f.sliding_window and f.kv_ring < o.n_ctx},
                o.parallel,
            )
            self.prefix_store = self._open_prefix_store(o, engine, bool(exact_softmax))
        except BaseException:
            getattr(self, "residency", None) and self.residency.close()
            self._maps.close()
            raise
        self.prefetch = prefetch
        self.skip_missed = o.skip_missed  # load(skip_missed=): lossy, None when off
        self.cache_routing = o.cache_routing  # load(cache_routing=): lossy, None when off
        self.expert_budget = budget  # bytes of experts the cache admits at most, or None
        self.engine_spec = engine.spec  # what the engine was built from (colibri.spec.EngineSpec)
        self._engine = engine
        # keys + values as allocated: sliding-window layers keep window + one prefill chunk; made
        # resident as positions are written, in base pages (with transparent huge pages, the first
        # position of each KV head's region would make a whole huge page resident)
        self.kv_cache_bytes = self._engine.kv_cache_bytes
        _os.small_pages(self._engine.kv_cache_ranges())
        self.tokenizer = text.tokenizer  # Tokenizer or None (raw ids only)
        self.chat_template = text.template  # ChatTemplate or None
        self.generation_defaults = text.generation  # generation_config.json's defaults
        self.stop_token_ids = text.stop_token_ids(cfg.eos_token_id)
        self.unlisted_text_files = unlisted(self._dir.root, self._dir.files)  # present but not in the table
        self.last_generation = None
        self.has_nextn = nextn.has_block(self.path)  # a multi-token-prediction block to draft with
        self._nextn = None  # nextn.NextnBlock, built at the first generation that drafts with it
        self._constraint_vocab = None  # constraint.Vocabulary, built at the first constrained call
        self._constraint_vocab_lock = threading.Lock()
        # the KV cache: per sequence, the ids whose keys and values it holds at positions 0.. (for
        # prefix reuse); sliding-window rings allow a rewind of at most ring - window positions (None: any)
        self._kv_tokens = [[] for _ in range(self.parallel)]
        self._busy = threading.Lock()  # one request at a time (refused, not queued)
        self._engine_lock = threading.Lock()  # held while the engine runs; close() takes it
        self.stats = {
            "load_seconds": time.perf_counter() - t0,
            "prefill_tokens": 0,
            "prefill_seconds": 0.0,
            "decode_tokens": 0,
            "decode_seconds": 0.0,
            "reused_tokens": 0,
        }

    def _capture_inputs(self, tensors: dict, capture: bool, second_moments) -> dict:
        """The tensors as the engine takes them; with `capture`, every matrix a product reads
        (the embedding only where it is also the head) gets its input statistics' arrays
        (self.input_stats, self.input_grams: see __init__)."""
        self.input_stats = {}
        self.input_grams = {}
        if not capture:
            return tensors
        read = {
            name: t.shape
            for name, t in tensors.items()
            if len(t.shape) == 2 and (name != "embedding" or "lm_head" not in tensors)
        }
        full = second_moments(read) if second_moments is not None else ()
        for name, shape in read.items():
            self.input_stats[name] = np.zeros(shape[1] + 1, np.float64)
            if name in full:
                self.input_grams[name] = np.zeros((shape[1], shape[1]), np.float64)
            tensors[name] = dataclasses.replace(
                tensors[name], input_stats=self.input_stats[name], input_gram=self.input_grams.get(name)
            )
        return tensors

    def _plan_memory(self, o: "_LoadOptions", tensors: dict, build: dict) -> None:
        """self.residency.plan for the limit (the caller's, else the OS's), from the bytes the
        engine would allocate (_engine.planned_bytes). The scratch grows with the prefill chunk:
        unless the caller chose one, a smaller chunk may fit the limit (a long prompt then streams
        its experts once per chunk), so the default is halved while it does not (build["chunk"],
        self._chunk)."""
        limit, source = o.limit, "memory_limit_mb"
        if limit is None:
            limit, source = residency.os_limit()
        while True:
            kv_bytes, scratch_bytes = _engine.planned_bytes(spec.build(self.config, tensors, prefetch="none", **build))
            if isinstance(o.cache_ram, int):  # a prefix store of a size the caller chose is planned like the KV cache
                kv_bytes += o.cache_ram
            try:
                self.residency.plan = residency.plan(
                    limit,
                    source,
                    dense=self.residency.dense_bytes,
                    experts=self.residency.expert_bytes,
                    kv=kv_bytes,
                    scratch=scratch_bytes,
                    runtime=_os.rss_bytes()[0],
                    working_set=self.residency.working_set,
                    n_ctx=o.n_ctx,
                    path=self.path,
                    largest_expert=self.residency.largest_expert,
                    n_seq=o.parallel,
                )
                break
            except ColibriError as e:
                floor = max(MIN_PLANNED_CHUNK, o.parallel)
                if build["chunk"] <= floor:
                    raise
                if o.prefill_chunk is not None:
                    raise ColibriError(
                        f"{e} (or a smaller prefill chunk than the {o.prefill_chunk} asked for: "
                        f"its scratch grows with it)"
                    ) from None
                build["chunk"] = self._chunk = max(floor, build["chunk"] // 2)
        if build["chunk"] < o.chunk:
            self.residency.plan = dataclasses.replace(self.residency.plan, lowered_chunk=build["chunk"])

    # -- the public API --------------------------------------------------------------------------

    def forward(self, ids, one_token_steps: bool = False) -> np.ndarray:
        """Logits float32 [T, vocab] of every position of `ids`, in a fresh context. The same
        logits either way; one_token_steps runs one engine call a token, as decoding does (where
        a decode-only mode, load(skip_missed=), acts)."""
        tokens = self._check_ids(ids, "ids")
        if len(tokens) > self.n_ctx:
            raise ColibriError(f"{len(tokens)} tokens exceed the context length {self.n_ctx}")
        out = np.empty((len(tokens), self.config.vocab_size), np.float32)
        with self._exclusive():
            self._begin()
            if one_token_steps:
                for pos in range(len(tokens)):
                    self._run(tokens[pos : pos + 1], pos, out[pos : pos + 1], all_logits=True)
            else:
                self._run(tokens, 0, out, all_logits=True)
        return out

    def generate(
        self,
        ids,
        max_new_tokens: int = 64,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = 0,
        stop_at_eos: bool = True,
        on_step=None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logprobs: int | None = None,
        reuse_prefix: bool = True,
        *,
        json_schema=None,
        grammar: str | None = None,
        regex: str | None = None,
        json_object: bool = False,
        logit_bias: dict | None = None,
        draft: str | None = None,
        draft_max: int | None = None,
        prediction=None,
    ):
        """Yield up to `max_new_tokens` new token ids after the prompt `ids`.

        Sampling settings left None take the checkpoint's generation_config.json defaults, then
        greedy (colibri.generation); `self.last_generation` says which were used and, with
        `logprobs` (0..20), holds each token's log-probability and the top alternatives.
        seed=None draws a random seed, kept in `self.last_generation.sampler.seed` (passing it
        back gives the same tokens). Stops early at the model's EOS token(s) (config.json's and
        generation_config.json's) unless stop_at_eos is False (the EOS token itself is yielded).
        With reuse_prefix the KV cache keeps what it holds of the longest common prefix with the
        previous call and only the rest of the prompt is run. `on_step(model)` is called after
        each engine step (used by --verbose to read the routing decisions).

        At most one constraint (colibri.constraint; needs `pip install llguidance` and a
        tokenizer): json_schema (a dict or its JSON text), json_object=True (any JSON object),
        grammar (a Lark grammar, llguidance's dialect) or regex. Each token is picked among those
        the constraint allows; once it is complete only the EOS tokens are, and the EOS that
        follows ends the generation even with stop_at_eos=False. A schema or grammar llguidance
        refuses is a ColibriError here, before any token. logit_bias {token id: bias in
        [-100, 100]} is added to those logits before sampling (OpenAI's logit_bias).

        Speculative decoding (colibri.speculate): draft "auto" (the default; "none" under an
        expert budget, where verifying widens the experts read from storage), "ngram" or "none"
        chooses where drafted tokens come from, draft_max (1..64, default 8) how many one engine
        call verifies; prediction (text or token ids: the reply expected, such as a file being
        edited) is searched first. The tokens are those of plain decoding, greedy or sampled;
        `self.last_generation.speculation` counts what was drafted and accepted.
        """
        tokens, sampler, eos, record = self._prepare_generation(
            ids,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop_at_eos=stop_at_eos,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            logprobs=logprobs,
            json_schema=json_schema,
            grammar=grammar,
            regex=regex,
            json_object=json_object,
            logit_bias=logit_bias,
        )
        # on_step (--verbose) reads each token's routing: it decodes token by token
        drafter = self._drafter(tokens, draft if on_step is None else "none", draft_max, prediction, record)
        self.last_generation = record
        return self._generate(tokens, int(max_new_tokens), sampler, eos, on_step, record, bool(reuse_prefix), drafter)

    def _drafter(self, tokens, draft, draft_max, prediction, record, batched=False):
        """generate()'s speculation options checked: a speculate.Drafter, or None for plain decoding.
        batched (colibri.batching): the multi-token-prediction block, whose KV cache holds one
        sequence, drafts for none ("mtp" is refused, "auto" drafts without it)."""
        if draft is not None and draft not in speculate.DRAFT_SOURCES:
            raise ColibriError(f"draft must be one of {', '.join(speculate.DRAFT_SOURCES)}, got {draft!r}")
        if draft_max is not None and (
            isinstance(draft_max, bool)
            or not isinstance(draft_max, (int, np.integer))
            or not 1 <= draft_max <= speculate.MAX_DRAFT_MAX
        ):
            raise ColibriError(f"draft_max must be an integer in 1..{speculate.MAX_DRAFT_MAX}, got {draft_max!r}")
        if prediction is not None:
            if isinstance(prediction, str):
                prediction = self._need_tokenizer().encode(prediction, add_special_tokens=False)
            prediction = [int(t) for t in self._check_ids(prediction, "prediction")] if len(prediction) else None
        source = draft or ("none" if self.expert_budget is not None else speculate.DEFAULT_DRAFT)
        if source == "none":
            return None
        if prediction is not None and source in ("ngram", "mtp"):
            raise ColibriError(f'prediction needs draft "auto" (its tokens are the first drafts), not "{source}"')
        if source == "mtp" and not self.has_nextn:
            raise ColibriError(
                f"draft mtp needs a multi-token-prediction block, and {self.path} has none (convert keeps a "
                f"DeepSeek-V3 or GLM-4.5 checkpoint's in {nextn.NEXTN_DIR}/); use draft ngram or auto"
            )
        if source == "mtp" and batched:
            raise ColibriError("draft mtp drafts for one sequence at a time: use parallel 1, or draft ngram / auto")
        d = speculate.Drafter(
            [int(t) for t in tokens],
            source,
            int(draft_max or speculate.DEFAULT_DRAFT_MAX),
            prediction if source == "auto" else None,
            block=self._nextn_block() if self.has_nextn and not batched and source in ("mtp", "auto") else None,
        )
        record.speculation = d.stats
        return d

    def _prepare_generation(
        self,
        ids,
        max_new_tokens,
        *,
        temperature,
        top_k,
        top_p,
        seed,
        stop_at_eos,
        min_p,
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
        logprobs,
        json_schema=None,
        grammar=None,
        regex=None,
        json_object=False,
        logit_bias=None,
    ) -> tuple:
        """generate()'s checks and settings: (prompt int32 [T], Sampler, EOS ids, GenerationRecord)."""
        tokens = self._check_ids(ids, "prompt")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise ColibriError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if len(tokens) + max_new_tokens > self.n_ctx:
            raise ColibriError(
                f"prompt ({len(tokens)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"context length {self.n_ctx}"
            )
        settings, taken = self.generation_defaults.resolve(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty
        )
        sampler = Sampler(
            **settings,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            seed=seed,
            logprobs=logprobs,
            logit_bias=logit_bias,
        )
        # the sampling settings are checked first (cheap); then the constraint is compiled and attached
        sampler.constraint = self._constraint(
            json_schema=json_schema, json_object=json_object, grammar=grammar, regex=regex
        )
        eos = set(self.stop_token_ids) if stop_at_eos else set()
        record = GenerationRecord(prompt_tokens=len(tokens), sampler=sampler, from_generation_config=taken)
        return tokens, sampler, eos, record

    def _constraint(self, **given):
        """A constraint.Constraint for generate()'s json_schema / json_object / grammar / regex, or
        None when none is given; the vocabulary is built once per Model."""
        spec = _constraint.requested(**given)
        if spec is None:
            return None
        with self._constraint_vocab_lock:
            if self._constraint_vocab is None:
                self._constraint_vocab = _constraint.Vocabulary(
                    self._need_tokenizer(), self.config.vocab_size, self.stop_token_ids
                )
        # the next mask on a worker thread overlaps the forward only where a core is free for it:
        # where the engine's threads take every core, the worker would stall one of them
        spare_core = self.threads < _logical_cpus()
        return _constraint.Constraint(self._constraint_vocab, **spec, background=None if spare_core else False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        """Token ids of `text` (transformers' semantics: BOS/EOS where the tokenizer adds them)."""
        return self._need_tokenizer().encode(text, add_special_tokens=add_special_tokens)

    def stream(
        self,
        prompt,
        max_new_tokens: int = 64,
        stop=None,
        skip_special_tokens: bool = True,
        add_special_tokens: bool = True,
        **generate_kwargs,
    ):
        """An iterator of the generated text in pieces that never split a character; their
        concatenation is the decode of the generated ids (cut before the first of the `stop`
        strings, if any). `prompt`: text, or a list of token ids. Other keywords as for
        generate() (json_schema, grammar, regex, json_object, seed=None included); its checks
        run here, before the first piece is asked for."""
        events = self.stream_tokens(
            prompt,
            max_new_tokens,
            stop=stop,
            skip_special_tokens=skip_special_tokens,
            add_special_tokens=add_special_tokens,
            **generate_kwargs,
        )
        return (text for text, _ in events if text)

    def stream_tokens(
        self,
        prompt,
        max_new_tokens: int = 64,
        stop=None,
        skip_special_tokens: bool = True,
        add_special_tokens: bool = True,
        **generate_kwargs,
    ):
        """As stream(), one event per generated token: (new text, possibly "", sampling.Pick).
        After a stop string the text ends; a last event (held-back text, None) may follow."""
        tok = self._need_tokenizer()
        ids = tok.encode(prompt, add_special_tokens=add_special_tokens) if isinstance(prompt, str) else prompt
        stops = self._stop_strings(stop)
        tokens = self.generate(ids, max_new_tokens, **generate_kwargs)
        record = self.last_generation
        return self._events(tokens, GenerationText(tok, skip_special_tokens, stops, record), record)

    @staticmethod
    def _stop_strings(stop) -> StopStrings:
        """stream_tokens()' (and a Batch's) `stop`, checked: None, a string or a list of strings."""
        stops = StopStrings(stop)
        if not all(isinstance(s, str) for s in stops.stops):
            raise ColibriError(f"stop must be a string or a list of strings, got {stop!r}")
        return stops

    @staticmethod
    def _events(tokens, text, record):
        try:
            for t in tokens:
                shown, stopped = text.push(t)
                yield shown, record.picks[-1]
                if stopped:
                    return
            shown = text.finish()
            if shown:
                yield shown, None
        finally:
            tokens.close()

    def complete(self, text, max_new_tokens: int = 64, stream: bool = False, **kwargs):
        """The continuation of `text` (a str, or token ids) as text; with stream=True an iterator
        of text pieces (see stream()). Keywords as for generate(): e.g. json_schema=SCHEMA gives
        text that json.loads and the schema accept (unless max_new_tokens cuts it short:
        `last_generation.finish_reason` is then "length")."""
        pieces = self.stream(text, max_new_tokens, **kwargs)
        return pieces if stream else "".join(pieces)

    def apply_chat_template(
        self,
        messages,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        tools=None,
        documents=None,
        continue_final_message: bool = False,
        **template_kwargs,
    ):
        """The prompt of a conversation as transformers' apply_chat_template gives it: token ids
        (tokenize=True; the rendered text tokenized without added special tokens) or the text.
        Template keywords (enable_thinking, ...) are passed through to the template."""
        if self.chat_template is None:
            raise ColibriError(
                f"{self.path} has no chat template (chat_template.jinja, chat_template.json or "
                f"tokenizer_config.json's chat_template); add one with: python -m colibri "
                f"tokenizer --model-dir {self.path} --from HF_DIR"
            )
        tok = self._need_tokenizer()
        text = self.chat_template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            continue_final_message=continue_final_message,
            **template_kwargs,
        )
        return tok.encode(text, add_special_tokens=False) if tokenize else text

    def chat(self, messages, max_new_tokens: int = 256, stream: bool = False, chat_template_kwargs=None, **kwargs):
        """The assistant's reply to a conversation (a str; with stream=True an iterator of text
        pieces). The conversation's tokens that the KV cache already holds (the earlier turns)
        are not run again. Keywords as for generate() (json_schema, grammar, regex, json_object,
        seed, ...)."""
        ids = self.apply_chat_template(messages, add_generation_prompt=True, **(chat_template_kwargs or {}))
        return self.complete(ids, max_new_tokens, stream=stream, **kwargs)

    def decode_bytes(self, position: int) -> dict:
        """{"weights", "kv_cache"}: the bytes one sequence's decoded token at `position` (0 ..
        n_ctx - 1) reads alone — every weight once (a routed expert's k of num_experts: on
        average; one row of an untied embedding table), and the KV cache's rows its attention
        sees. Decode is memory-bound, so tokens a second x their sum is the read rate to set
        against the machine's bandwidth. (A batched step, Batch or serve --parallel, reads the
        weights once for all its sequences and each sequence's own rows.)"""
        if isinstance(position, bool) or not isinstance(position, numbers.Integral) or not 0 <= position < self.n_ctx:
            raise ColibriError(f"position must be in 0..{self.n_ctx - 1} (the context), got {position!r}")
        engine = self._live()
        if self._weight_bytes_per_token is None:
            self._weight_bytes_per_token = float(sum(self._dir.bytes_per_token().values()))
        return {"weights": self._weight_bytes_per_token, "kv_cache": engine.kv_bytes_read(int(position))}

    def memory_stats(self) -> dict:
        """Residency counters: experts used per layer, the memory limit and the expert budget,
        the expert cache's hits, misses, prefetches and evictions (cumulative since load), bytes
        read from storage since load, prediction hit rate, page faults, RSS and the cgroup's
        usage and peak. Cheap enough to call after every request."""
        engine = self._live()
        engine.cache_drain()  # the readers' queued work counts (a few ms at most)
        pf, cs = engine.prefetch_stats, engine.cache_stats
        c = {name: int(cs[code]) for name, code in _engine.CACHE_STATS.items()}
        minor, major = _os.page_faults()
        rss, peak = _os.rss_bytes()
        counts = engine.expert_counts
        spans = self.residency.spans
        # bytes of expert weights the routers asked for: each (token, chosen expert) counts once
        used_bytes = sum(int(counts[l, e]) * spans[(l, e)][1] for l, e in np.argwhere(counts > 0))
        touched = sum(spans[(l, e)][1] for l, e in np.argwhere(counts > 0))
        held = engine.cache_bytes
        io = _os.read_io_bytes()
        usage, usage_peak = _os.memory_usage()
        plan = self.residency.plan
        uses = c["hits"] + c["misses"]
        return {
            "experts_used_per_layer": [int((row > 0).sum()) for row in counts],
            "memory_limit_bytes": plan.limit,
            "memory_limit_source": plan.source,
            "expert_budget_bytes": self.expert_budget,
            "resident_expert_bytes": held[0] if held is not None else touched,
            "peak_resident_expert_bytes": held[1] if held is not None else touched,
            "expert_bytes_used": used_bytes,
            "cache_hits": c["hits"],
            "cache_misses": c["misses"],
            "cache_hit_rate": c["hits"] / uses if uses else None,
            "prefetches": c["prefetches"],
            "prefetch_hits": c["prefetch_hits"],
            "prefetch_hit_rate": c["prefetch_hits"] / c["prefetches"] if c["prefetches"] else None,
            "experts_released": c["evictions"],
            "wasted_prefetches": c["wasted_prefetches"],
            "over_budget": c["over_budget"],
            "experts_dropped": c["drops"],
            "prefetch_calls": c["read_calls"],
            "prefetch_bytes": c["read_bytes"],
            "prefetch_failures": c["advice_failures"],
            "prediction_hit_rate": (
                float(pf[_engine.PF_PREDICT_HITS] / pf[_engine.PF_PREDICTED]) if pf[_engine.PF_PREDICTED] else None
            ),
            "experts_skipped": int(pf[_engine.PF_SKIPPED]),  # expert uses skip_missed left out (lossy)
            "experts_rerouted": int(pf[_engine.PF_REROUTED]),  # uses cache_routing chose instead (lossy)
            "prefetched_per_used_byte": float(c["read_bytes"] / used_bytes) if used_bytes else None,
            "bytes_read_from_storage": (
                io - self.residency.io_at_load if io is not None and self.residency.io_at_load is not None else None
            ),
            "minor_page_faults": minor,
            "major_page_faults": major,
            "rss_bytes": rss,
            "peak_rss_bytes": peak,
            "cgroup_usage_bytes": usage,
            "cgroup_peak_bytes": usage_peak,
            "dense_locked": bool(self.residency.locked),
            "expert_bytes_in_memory": self.residency.in_memory(),
            **self.prefix_store_stats(),
        }

    def prefix_store_stats(self) -> dict:
        """The prefix store's counters (load(cache_ram_mb=)): its budget and bytes held, requests that
        restored a stored prefix (hits) or found none longer than their place held (misses), tokens
        restored, blocks stored and evicted since load; all 0 without a store."""
        st = self.prefix_store
        if st is None:
            return {f"prefix_store_{k}": 0 for k in kvstore.STAT_NAMES}
        return {
            "prefix_store_budget_bytes": st.budget,
            "prefix_store_bytes": st.bytes,
            **{f"prefix_store_{k}": v for k, v in st.stats.items()},
        }

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens the engine runs together: load's prefill_chunk as given, or its default
        (names.DEFAULT_PREFILL_CHUNK), which the memory plan lowers where a cap asks for it."""
        return self._chunk

    @property
    def routing(self) -> tuple:
        """(experts int32 [n_layers, top_k], weights float32 [n_layers, top_k]) of the last step.

        Rows of dense (non-MoE) layers are meaningless."""
        engine = self._live()
        return engine.chosen.copy(), engine.chosen_weights.copy()

    @property
    def last_logits(self) -> np.ndarray:
        """float32 [vocab]: the logits of the last position run (e.g. inside a generate() step)."""
        return self._live().logits.copy()

    @property
    def expert_counts(self) -> np.ndarray:
        """int64 [n_layers, num_experts]: how often each expert was chosen since the last reset."""
        return self._live().expert_counts.copy()

    def close(self) -> None:
        """Release the engine and the mappings. A call running in another thread finishes its
        engine step first (close waits for it); afterwards every use of the Model, a suspended
        generator included, is a ColibriError saying it was closed."""
        with self._engine_lock:  # no engine step is running while the weights go away
            engine, self._engine = self._engine, None
            if engine is not None:
                engine.close()  # the expert cache's reader stops before the unmapping
            if self._nextn is not None:
                self._nextn.close()
                self._nextn = None
            if self.prefix_store is not None:
                self.prefix_store.close()  # its queued files are written
            self.residency.close()
            self._maps.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        c = self.config
        return (
            f"<colibri.Model {self.path!r} {c.architecture}, {c.num_hidden_layers} layers, "
            f"{c.num_experts} experts, top-{c.num_experts_per_tok}, {self.weight_dtype}>"
        )

    # -- internals -------------------------------------------------------------------------------

    def _hold_warm_experts(self, engine) -> None:
        """Under a budget at load: the experts already in memory (a warm page cache) are admitted
        while they fit; the rest of what is in memory is dropped, so the cache's bytes are what
        the cgroup counts."""
        res = self.residency
        index = {key: key[0] * engine.spec.n_experts + key[1] for key in res.spans}
        warm = res.warm_experts()
        held = set()
        for key in warm:
            if engine.cache_hold([index[key]]):
                held.add(key)
        res.drop([k for k, (a, n) in res.spans.items() if k not in held and _os.resident_bytes(a, n)])

    def _check_ids(self, ids, what) -> np.ndarray:
        try:
            arr = np.asarray(ids)
        except Exception:
            raise ColibriError(f"{what} must be a sequence of integer token ids") from None
        if arr.ndim != 1 or arr.size == 0:
            raise ColibriError(f"{what} must be a non-empty 1-D sequence of token ids, got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise ColibriError(f"{what} must hold integers, got {arr.dtype}")
        vocab = self.config.vocab_size
        bad = arr[(arr < 0) | (arr >= vocab)]
        if bad.size:
            raise ColibriError(f"token id {int(bad[0])} is outside the vocabulary [0, {vocab})")
        return np.ascontiguousarray(arr, dtype=np.int32)

    @contextlib.contextmanager
    def _exclusive(self):
        if not self._busy.acquire(blocking=False):
            raise ColibriError(
                "this Model is already generating in another thread or generator; "
                "use one Model per concurrent request or finish the other generation first"
            )
        try:
            yield
        finally:
            self._busy.release()

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ColibriError(
                f"{self.path} has no tokenizer (tokenizer.json or tokenizer.model): pass token ids "
                f"instead, or add one with: python -m colibri tokenizer --model-dir {self.path} "
                f"--from HF_DIR"
            )
        return self.tokenizer

    def _nextn_block(self):
        """The multi-token-prediction block (nextn.NextnBlock), built on first use."""
        with self._engine_lock:
            self._live()
            if self._nextn is None:
                self._nextn = nextn.NextnBlock(self)
            return self._nextn

    def _live(self):
        """The engine, or a clear error once close() has run."""
        engine = self._engine
        if engine is None:
            raise ColibriError(f"this Model ({self.path}) has been closed; load it again to use it")
        return engine

    def _begin(self) -> None:
        """A new request: the per-request counters start again (the KV cache is kept)."""
        with self._engine_lock:
            engine = self._live()
            engine.reset()

    def _open_prefix_store(self, o: "_LoadOptions", engine, exact_softmax: bool):
        """The prefix store load(cache_ram_mb=, kv_store=) asks for, or None. Its identity names
        everything that decides the cache's bits: a restart with another model, KV format, kernel
        tier or product rule finds none of its blocks."""
        budget = o.cache_ram
        if budget == "auto":
            budget = kvstore.auto_budget(self.residency.plan, _os.available_memory())
            if not budget and o.kv_store is not None:
                raise ColibriError(
                    f"kv_store {o.kv_store}: the memory plan leaves no room for a prefix store "
                    f"({self.residency.plan.describe()}); give cache_ram_mb (--cache-ram MB) for one"
                )
        if not budget:
            return None
        config_digest = hashlib.sha256((self._dir.root / "config.json").read_bytes()).hexdigest()
        identity = (
            f"config {config_digest}; kv {o.kv_cache}; isa {_kernels.isa()}; int step {_kernels.int_step()}; "
            f"bf16 products {o.bf16_products}; exact softmax {exact_softmax}"
            + (f"; skip missed {o.skip_missed}" if o.skip_missed else "")  # a lossy run's KV is its own
            + (f"; cache routing {o.cache_routing}" if o.cache_routing else "")
        )
        arrays = [
            kvstore.CacheArray(a, f.kv_ring, f.sliding_window)
            if f.sliding_window and f.kv_ring < o.n_ctx
            else kvstore.CacheArray(a, None)
            for f, layer in zip(engine.spec.layers, engine.kv_layer_arrays())
            for a in layer
        ]
        return kvstore.PrefixStore(arrays, self._rings, budget, identity, o.kv_store)

    def _restore_prefix(self, tokens: np.ndarray, seq: int, have: int) -> int:
        """Sequence seq's cache made to hold the longest prefix of `tokens` the prefix store has,
        where that is more than the `have` tokens it holds; the tokens it holds now."""
        store = self.prefix_store
        if store is None:
            return have
        with self._engine_lock:
            self._live()
            n = store.restore(seq, tokens, have)
            if n > have:
                del self._kv_tokens[seq][have:]
                self._kv_tokens[seq].extend(int(t) for t in tokens[have:n])
        return n

    def _save_prefix(self, seq: int) -> None:
        """What sequence seq's cache holds, into the prefix store (the blocks it lacks)."""
        if self.prefix_store is not None:
            with self._engine_lock:
                if self._engine is not None:
                    self.prefix_store.save(seq, self._kv_tokens[seq])

    def _reusable_prefix(self, tokens: np.ndarray, seq: int = 0) -> int:
        """How many leading tokens of `tokens` sequence seq's KV cache already holds at their
        positions (at most all but the last: its logits are needed). Sliding-window layers keep a
        ring of window + chunk rows, so the cache is reusable only while the positions the first
        new token attends to have not been overwritten by later ones."""
        held = self._kv_tokens[seq]
        n = min(len(held), len(tokens) - 1)
        if n <= 0:
            return 0
        same = np.asarray(held[:n], np.int64) == tokens[:n]
        common = n if same.all() else int(np.argmin(same))
        if common and not self._rings.resumable(seq, common):
            return 0
        return common

    def _run(
        self, tokens: np.ndarray, pos: int, out: np.ndarray, all_logits: bool, seq: int = 0, hidden=None, on_hidden=None
    ) -> None:
        """Run `tokens` at positions pos.. (logits into `out`), one prefill chunk per engine call:
        the engine splits a prompt at the same chunk boundaries, so the results are the same,
        and Ctrl-C (or close()) takes effect between chunks instead of after the whole prompt.
        hidden [>= a chunk's rows, d_model] or None: each chunk's last hidden states (Engine.run's
        hidden_out), handed to on_hidden(position, rows) after the chunk where it is given."""
        for start in range(0, len(tokens), self._chunk):
            piece = tokens[start : start + self._chunk]
            last = start + len(piece) == len(tokens)
            rows = None if hidden is None else hidden[: len(piece)]
            if not all_logits and not last:
                self._run_chunk(piece, pos + start, None, False, seq, rows)  # an inner chunk: no lm_head
            else:
                self._run_chunk(piece, pos + start, out[start:] if all_logits else out, all_logits, seq, rows)
            if on_hidden is not None:
                on_hidden(pos + start, rows)

    def _run_chunk(
        self, tokens: np.ndarray, pos: int, out: np.ndarray, all_logits: bool, seq: int = 0, hidden=None
    ) -> None:
        with self._engine_lock:
            engine = self._live()
            del self._kv_tokens[seq][pos:]  # positions >= pos are about to be overwritten
            status, index, layer = engine.run(tokens, pos, out, all_logits, seq, None, hidden)
            if self._rings.rows:  # a model with sliding-window layers
                self._rings.wrote(seq, np.arange(pos, pos + len(tokens)))
        if status != _engine.STATUS_OK:
            self._damaged(status, f"at position {pos + index}", layer)
        self._kv_tokens[seq].extend(int(t) for t in tokens)

    def _step(
        self,
        tokens: np.ndarray,
        seqs: np.ndarray,
        positions: np.ndarray,
        out: np.ndarray,
        want: np.ndarray | None = None,
    ) -> None:
        """Tokens of several sequences in one engine pass (int32 [B] each: token b of sequence
        seqs[b] at positions[b], a sequence's tokens side by side), the logits of those `want`
        (uint8 [B]; None: all) into out [wanted, vocab] (Engine.step)."""
        with self._engine_lock:
            engine = self._live()
            for seq, pos in zip(seqs, positions):
                del self._kv_tokens[seq][pos:]
            status, _, layer = engine.step(tokens, seqs, positions, out, want)
            if self._rings.rows:
                self._rings.wrote(seqs, positions)
        if status != _engine.STATUS_OK:
            self._damaged(
                status,
                f"in a step of {len(tokens)} tokens (positions {int(positions.min())}..{int(positions.max())})",
                layer,
            )
        for token, seq in zip(tokens, seqs):
            self._kv_tokens[seq].append(int(token))

    def _damaged(self, status: int, where: str, layer: int):
        raise ColibriError(
            f"{where}: "
            + _STATUS_MESSAGES[status].format(layer=layer)
            + f" — the weights in {self.path} look damaged (run: python -m colibri verify)"
        )

    def _generate(self, tokens, max_new_tokens, sampler, eos, on_step, record, reuse, drafter=None):
        with self._exclusive():
            self._begin()
            common = self._restore_prefix(tokens, 0, self._reusable_prefix(tokens)) if reuse else 0
            sampler.reset(tokens)
            logits = np.empty((1, self.config.vocab_size), np.float32)
            block = drafter.start_block(common) if drafter is not None else None  # nextn.NextnDrafter or None
            hidden = block.main_rows if block is not None else None  # [chunk, d]: a call's last hidden states
            t0 = time.perf_counter()
            self._run(tokens[common:], common, logits, False, 0, hidden, block and block.feed)
            t1 = time.perf_counter()
            record.reused_tokens = common
            self.stats["prefill_tokens"] = len(tokens) - common
            self.stats["reused_tokens"] = common
            self.stats["prefill_seconds"] = t1 - t0
            self.stats["decode_tokens"] = 0
            self.stats["decode_seconds"] = 0.0
            if on_step:
                on_step(self)
            pos = len(tokens)  # where the next token to run goes
            row = logits[0]  # the logits the next token is picked from
            ahead = []  # [(drafted token, the logits after it)] of the last chunk, not yet checked
            # one engine call's logits [1 + drafts, vocab], allocated once: a row is picked from
            # (and `ahead` emptied) before the next call overwrites it
            most = 1 + (min(drafter.draft_max, self._chunk - 1) if drafter is not None else 0)
            calls = np.empty((most, self.config.vocab_size), np.float32)
            chunk_drafted = chunk_accepted = 0
            called = None  # the position of the last decode call, whose kept hidden states the block awaits
            record.finish_reason = "length"
            try:
                for i in range(max_new_tokens):
                    pick = sampler.pick(row)
                    token = pick.token
                    record.tokens.append(token)
                    record.picks.append(pick)
                    ended = token in eos or sampler.finished  # finished: the constraint's EOS
                    if ended:
                        record.finish_reason = "stop"
                    yield token
                    if i == 0:  # the prompt, for the other places, once its first token is out
                        self._save_prefix(0)
                    if ended or i == max_new_tokens - 1:
                        chunk_accepted += bool(ahead) and ahead[0][0] == token  # the last token was drafted
                        break
                    if drafter is not None:
                        drafter.push(token)
                    if ahead and ahead[0][0] == token:  # a drafted token picked: its keys and values are in
                        _, row = ahead.pop(0)
                        pos += 1
                        chunk_accepted += 1
                        self.stats["decode_tokens"] += 1
                        continue
                    if drafter is not None:
                        drafter.verified(chunk_drafted, chunk_accepted)
                    if block is not None and called is not None:  # the positions the last call kept
                        block.feed(called, hidden[: pos - called])
                    # room: tokens still to generate after this one, the context, a prefill chunk
                    room = min(max_new_tokens - i - 2, self.n_ctx - pos - 1, self._chunk - 1)
                    draft = drafter.propose(room) if drafter is not None else []
                    run = np.array([token, *draft], np.int32)
                    out = calls[: len(run)]
                    t = time.perf_counter()
                    self._run(run, pos, out, len(run) > 1, 0, hidden)  # drafts after pos: overwritten if refused
                    called = pos
                    self.stats["decode_seconds"] += time.perf_counter() - t
                    self.stats["decode_tokens"] += 1
                    row, ahead = out[0], list(zip(draft, out[1:]))
                    chunk_drafted, chunk_accepted = len(draft), 0
                    pos += 1
                    if on_step:
                        on_step(self)
                if drafter is not None:
                    drafter.verified(chunk_drafted, chunk_accepted)
            finally:
                self._save_prefix(0)  # the prompt and the reply (also of a generation stopped early)


def _logical_cpus() -> int:
    """The logical CPUs this process may run on (its affinity mask, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _check_threads_start(threads: int) -> None:
    """ColibriError unless `threads` threads can exist at once. The OpenMP runtime creates the
    engine's threads at its first parallel region with the default stack size, and ends the process
    (status 1) where one cannot be created (an address-space limit, a thread limit): so the same
    number is tried here first, with Python threads of that stack size, and released."""
    if threads <= 1:
        return
    room, stack = _os.address_space_room()
    if room is not None and stack and (threads - 1) * stack > room:
        # decided before trying: a thread whose stack fits but whose first allocation does not
        # dies inside CPython's start-up and its start() waits forever
        raise ColibriError(
            f"cannot start {threads} threads (threads / --threads): their stacks need "
            f"{(threads - 1) * stack >> 20} MiB of address space and the limit (ulimit -v) "
            f"leaves {room >> 20} MiB (this machine has {_os.compute_cores()} cores)"
        )
    release = threading.Event()
    started = []
    try:
        for _ in range(threads - 1):
            t = threading.Thread(target=release.wait, daemon=True)
            t.start()
            started.append(t)
    except RuntimeError as e:
        raise ColibriError(
            f"cannot start {threads} threads (threads / --threads): {e}; only {len(started) + 1} "
            f"could run at once here (this machine has {_os.compute_cores()} cores)"
        ) from None
    finally:
        release.set()
        for t in started:
            t.join()


def _bf16_products(choice) -> bool:
    """Whether a model loaded with load(bf16_products=choice) takes bf16 products on this CPU's
    tier; ColibriError for an unknown choice, or "bf16" where the tier has no vdpbf16ps."""
    if choice not in BF16_PRODUCTS:
        raise ColibriError(f"bf16_products must be one of {', '.join(BF16_PRODUCTS)}, got {choice!r}")
    if choice == "bf16" and not _kernels.has_bf16_products():
        raise ColibriError(
            f"bf16_products='bf16' needs AVX512_BF16 (vdpbf16ps), which tier {_kernels.isa()} "
            "of this CPU lacks; use 'auto' or 'f32'"
        )
    return choice == "bf16" or (choice == "auto" and _kernels.has_bf16_products())


class GenerationRecord:
    """What the last generate() did: for the caller (logprobs, finish reason) and the CLI's notes."""

    def __init__(self, prompt_tokens: int, sampler, from_generation_config):
        self.prompt_tokens = prompt_tokens
        self.reused_tokens = 0  # prompt tokens the KV cache already held
        self.tokens = []  # generated ids
        self.picks = []  # sampling.Pick of each (logprob, top alternatives)
        self.sampler = sampler
        self.from_generation_config = list(from_generation_config)  # settings taken from the checkpoint
        self.finish_reason = None  # "stop" (EOS or a stop string) | "length"
        self.stop = None  # the stop string that ended it, if one did
        self.speculation = None  # speculate.SpeculationStats when drafts were verified


def load(
    path,
    threads: int | None = None,
    n_ctx: int | None = None,
    mmap: bool = True,
    exact_softmax: bool = True,
    prefill_chunk: int | None = None,
    prefetch: str | None = None,
    expert_cache_mb: float | None = None,
    mlock: bool = False,
    warmup: bool = False,
    memory_limit_mb: float | None = None,
    eviction: str | None = None,
    kv_cache: str = "f32",
    bf16_products: str = "auto",
    capture_inputs: bool = False,
    second_moments=None,
    parallel: int = 1,
    cache_ram_mb: float | str | None = None,
    kv_store=None,
    skip_missed: float | None = None,
    cache_routing: float | None = None,
) -> Model:
    """Load a Colibri model directory.

    threads=None uses every core; n_ctx=None the model's context up to 4096 positions;
    mmap=False reads the weights into memory instead of mapping the files (network shares);
    exact_softmax=False takes the routing weights from the uint8 softmax lookup table of the
    original design instead of expf (exact is the default: the table's weights differ from transformers');
    prefill_chunk: prompt tokens processed together (default names.DEFAULT_PREFILL_CHUNK, 128; bounds the prefill scratch);
    prefetch "none" | "routed" | "predict" (default: "routed" under an expert budget, else "none"),
    memory_limit_mb (default: the cgroup's / job's limit, else the available RAM), expert_cache_mb,
    eviction "lru" | "lfu", mlock, warmup: see colibri.residency;
    kv_cache "f32" | "f16" | "q8": the KV cache's elements (f16: half its bytes; keys and values
    rounded to f16 as they are stored, attention computed in f32;
    q8: (head_dim + 4) / (4 head_dim) of f32's bytes, each KV head's row at a position int8 codes
    and one f32 scale, read back as code x scale);
    bf16_products "auto" | "bf16" | "f32": how bf16 weights multiply (BF16_PRODUCTS: "f32" is exact,
    "bf16" rounds the activations to bf16 for AVX512_BF16's vdpbf16ps, "auto" is "bf16" where the
    CPU has that instruction); capture_inputs: collect each matrix's input statistics
    (Model.input_stats; colibri.calibrate), and with second_moments ({tensor: shape} -> names)
    those matrices' whole input second moments (Model.input_grams); parallel: sequences decoded
    together (1..MAX_PARALLEL, at most the prefill chunk; colibri.batching.Batch), each with its own
    n_ctx positions of KV cache (resident only as they are filled);
    cache_ram_mb: the prefix store (colibri.kvstore), megabytes of KV cache blocks of earlier
    prompts and replies kept in RAM, restored into whichever sequence a later prompt sharing their
    exact tokens runs in ("auto": a quarter of the memory the plan leaves free, at most 8 GiB; a
    number is planned like the KV cache; None or 0: no store); kv_store: a directory the store is
    kept in across restarts (implies cache_ram_mb="auto" unless given).

    skip_missed F (0 < F <= 1; None: off, the default) trades exactness for bytes under an expert
    budget: a decoded token leaves out a chosen expert that the cache does not hold, that is not
    its heaviest and that weighs less than F / top_k of its chosen experts' weights (the others
    scaled back to their sum); memory_stats()["experts_skipped"] counts them. Meant for top-k >= 6;
    no effect without a budget (every expert is held). cache_routing lambda (0 < lambda <= 1; None:
    off) favours the experts the cache holds: a decoded token's router logits of those are raised
    by lambda times the logits' range before its top-k is chosen, and each chosen expert keeps the
    router's own weight (memory_stats()["experts_rerouted"] counts the changed choices)."""
    return Model(
        path,
        threads=threads,
        n_ctx=n_ctx,
        mmap=mmap,
        exact_softmax=exact_softmax,
        prefill_chunk=prefill_chunk,
        prefetch=prefetch,
        expert_cache_mb=expert_cache_mb,
        mlock=mlock,
        warmup=warmup,
        memory_limit_mb=memory_limit_mb,
        eviction=eviction,
        kv_cache=kv_cache,
        bf16_products=bf16_products,
        capture_inputs=capture_inputs,
        second_moments=second_moments,
        parallel=parallel,
        cache_ram_mb=cache_ram_mb,
        kv_store=kv_store,
        skip_missed=skip_missed,
        cache_routing=cache_routing,
    )
