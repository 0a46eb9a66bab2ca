"""Which experts hold memory: the memory limit, the expert budget it leaves, and the counters.

Design
------
Every expert of every MoE layer is one file, mapped once (modeldir.MappedModelDir). The work per
expert — admitting it under a byte budget, evicting the coldest, reading ahead the ones the
routers chose or will choose, dropping an evicted one from the page cache — runs in the compiled
expert cache and its reader thread (csrc/expert_cache.h), inside the layer loop. This module
decides, once at load, whether there is a budget and how large:

    limit   --memory-limit-mb, else what the OS enforces (_os.memory_limit: the cgroup's
            memory.max / memory.limit_in_bytes, which count the page cache of the model's files;
            a Windows job's limit), else the RAM available now (_os.available_memory) plus what
            this process already holds.
    fixed   dense weights (every file that is not an expert) + KV cache at n_ctx + the engine's
            scratch + this process's resident memory after load (interpreter, libraries,
            tokenizer) + a margin (MARGIN_FRACTION of the limit, at least MIN_MARGIN and
            at least the largest expert: page tables, allocator slack, the kernel's own
            accounting, and an expert the loop faults in before the readers dropped its victim)
    budget  limit - fixed, for the experts. Where fixed + two layers' choices do not fit and the
            caller chose no prefill chunk, the chunk (hence the scratch) is halved until they do,
            down to model.MIN_PLANNED_CHUNK. If the whole model fits (fixed + every expert <= limit)
            there is no budget and nothing per expert runs. Below fixed + two layers' choices of
            experts (the current layer's top-k and the next one's prediction) the model cannot run
            under the limit: a clear error before anything is read.

`expert_cache_mb` gives the expert budget directly instead (the smaller one wins when both are
given). `prefetch` without a budget runs the same cache with no limit (reads, no evictions).
`mlock=True` pins the dense weights; `warmup=True` reads every expert once at load.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass

import numpy as np

from . import _os
from ._engine import EVICTION_CODES, PREFETCH_CODES
from .errors import ColibriError
from .modeldir import tensor_file

PREFETCH_MODES = PREFETCH_CODES  # name -> the layer loop's code (defined once, in _engine.pyx)
EVICTION_POLICIES = tuple(EVICTION_CODES)

MAX_BUDGET_MB = 1e12  # a budget beyond any machine's memory is a typo (or inf)
MIN_MARGIN = 32 << 20  # bytes the plan keeps free under the limit at least ...
MARGIN_FRACTION = 1 / 64  # ... or this fraction of it
MB = 1 << 20


def _megabytes(value, name: str):
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < MAX_BUDGET_MB
    ):
        raise ColibriError(
            f"{name} must be a positive finite number of megabytes (below {MAX_BUDGET_MB:.0e}), got {value!r}"
        )
    return None if value is None else int(float(value) * MB)


@dataclass(frozen=True)
class MemoryPlan:
    limit: int | None  # bytes the process must stay under (None: no limit known)
    source: str  # what set it: "--memory-limit-mb", a cgroup file, "available RAM", ...
    fixed: int  # dense + KV + scratch + runtime + margin
    experts: int  # bytes of every expert
    budget: int | None  # the expert budget (None: everything fits, or no limit)
    minimum: int  # the smallest limit this model runs under
    lowered_chunk: int | None = None  # the prefill chunk the plan lowered the default to, if it did

    def describe(self) -> str:
        if self.limit is None:
            return "no memory limit"
        what = "the whole model fits" if self.budget is None else f"expert budget {self.budget / MB:.0f} MB"
        lowered = f", prefill chunk lowered to {self.lowered_chunk} to fit" if self.lowered_chunk else ""
        return f"memory limit {self.limit / MB:.0f} MB ({self.source}): {what}{lowered}"


def plan(
    limit: int | None,
    source: str,
    *,
    dense: int,
    experts: int,
    kv: int,
    scratch: int,
    runtime: int,
    working_set: int,
    n_ctx: int,
    path: str,
    largest_expert: int = 0,
    n_seq: int = 1,
) -> MemoryPlan:
    """The expert budget under `limit` bytes (see the module's design block). Raises ColibriError
    when the limit is below what the model needs at the least (n_seq: the sequences the KV cache
    holds, load(parallel=), which multiply its bytes)."""
    if limit is None:
        return MemoryPlan(None, "", 0, experts, None, 0)
    margin = max(MIN_MARGIN, int(limit * MARGIN_FRACTION), largest_expert)
    fixed = dense + kv + scratch + runtime + margin
    minimum = fixed + working_set
    if fixed + experts <= limit:
        return MemoryPlan(limit, source, fixed, experts, None, minimum)
    if limit < minimum:
        kv_what, lower = (
            (f"n_ctx {n_ctx} x {n_seq} sequences", "--n-ctx or --parallel")
            if n_seq > 1
            else (f"n_ctx {n_ctx}", "--n-ctx")
        )
        raise ColibriError(
            f"memory limit {limit / MB:.0f} MB ({source}) is below the {minimum / MB:.0f} MB {path} needs at "
            f"least: dense weights {dense / MB:.0f} MB + KV cache {kv / MB:.0f} MB ({kv_what}) + scratch "
            f"{scratch / MB:.0f} MB + this process {runtime / MB:.0f} MB + margin {margin / MB:.0f} MB + two "
            f"layers' experts {working_set / MB:.0f} MB; raise --memory-limit-mb or lower {lower}"
        )
    return MemoryPlan(limit, source, fixed, experts, limit - fixed, minimum)


def os_limit() -> tuple:
    """(bytes, source) of the limit to plan for when the caller gives none: the cgroup / job
    limit, else the RAM available now plus what this process holds; (None, "") if unknown."""
    limit, source = _os.memory_limit()
    if limit is not None:
        return limit, source
    available = _os.available_memory()
    if available is None:
        return None, ""
    return available + _os.rss_bytes()[0], "available RAM"


def check_unmapped(md, limit: int | None, path: str) -> None:
    """With mmap=False every weight is read into anonymous memory, which no budget can evict:
    before reading, the files must fit the limit (given, else the OS's) with the margin."""
    source = "memory_limit_mb"
    if limit is None:
        limit, source = os_limit()
    if limit is None:
        return
    total = sum(entry["size"] for entry in md.files.values())
    need = total + max(MIN_MARGIN, int(limit * MARGIN_FRACTION)) + _os.rss_bytes()[0]
    if need > limit:
        raise ColibriError(
            f"{path} ({total / MB:.0f} MB of files) cannot be read into memory under the memory "
            f"limit of {limit / MB:.0f} MB ({source}); map it instead (drop --no-mmap / mmap=False): "
            f"mapped experts are kept under the limit"
        )


class Residency:
    """The experts' spans and files, the memory plan, and the statistics of the expert cache."""

    def __init__(self, maps, config, mlock: bool = False, warmup: bool = False):
        self.config = config
        self.spans = {}  # (layer, expert) -> (address, page-rounded length) of its file
        self.paths = {}  # (layer, expert) -> its file
        for layer, is_moe in enumerate(config.moe_layers):
            if is_moe:
                for e in range(config.num_experts):
                    rel = tensor_file(f"layers.{layer}.experts.{e}.gate")
                    self.spans[(layer, e)] = maps.file_span(rel)
                    self.paths[(layer, e)] = maps.md.root / rel
        expert_files = {tensor_file(f"layers.{l}.experts.{e}.gate") for (l, e) in self.spans}
        self.dense_spans = [maps.file_span(rel) for rel in maps.mapped_files() if rel not in expert_files]
        self.dense_bytes = sum(n for _, n in self.dense_spans)
        self.expert_bytes = sum(n for _, n in self.spans.values())
        self.fds = {}  # (layer, expert) -> descriptor, while a budget holds
        self.plan = MemoryPlan(None, "", 0, self.expert_bytes, None, 0)
        self.io_at_load = _os.read_io_bytes()
        self.locked = _os.lock(self.dense_spans) if mlock else False
        if warmup:
            self.warmup()

    @property
    def largest_expert(self) -> int:
        return max((n for _, n in self.spans.values()), default=0)

    @property
    def working_set(self) -> int:
        """Bytes of two layers' choices of experts: what the cache must hold at least."""
        biggest = max((n for _, n in self.spans.values()), default=0)
        return 2 * max(self.config.num_experts_per_tok, 1) * biggest

    def open_files(self) -> None:
        """A descriptor per expert file, so that a dropped expert leaves the page cache too
        (posix_fadvise). Raises the soft open-file limit towards the hard one when needed; where
        that is not enough the remaining experts are dropped from the process only."""
        if _os.cache_advice().fadvise == 0:
            return
        try:
            import resource

            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            want = len(self.spans) + 256
            if soft != resource.RLIM_INFINITY and soft < want:
                resource.setrlimit(
                    resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard)
                )
        except (ImportError, ValueError, OSError):
            pass
        for key, path in self.paths.items():
            try:
                self.fds[key] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                break

    def warm_experts(self, threshold: float = 0.9) -> list:
        """The experts (layer, expert) whose pages are in memory already (at least `threshold`
        of them), hottest first is unknown: in index order."""
        return [
            key
            for key, (address, length) in self.spans.items()
            if length and _os.resident_bytes(address, length) >= threshold * length
        ]

    def drop(self, keys) -> None:
        """Take these experts out of the process and the page cache (at load: what the budget does
        not hold)."""
        _os.release([self.spans[k] for k in keys])
        for k in keys:
            _os.evict_file_cache(self.paths[k])

    def warmup(self) -> None:
        """Read every expert once (first requests are otherwise slow on a cold page cache)."""
        spans = list(self.spans.values())
        _os.prefetch(spans)
        page = _os.page_size()
        for addr, length in spans:
            view = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * length).from_address(addr))
            int(view[::page].sum())  # one byte a page
            del view

    def in_memory(self) -> int:
        """Bytes of the expert files in memory now, as the OS reports them (_os.resident_bytes:
        on Linux the page cache, whether or not this process touched the pages) — the figure a
        memory cap counts."""
        return sum(_os.resident_bytes(address, length) for address, length in self.spans.values())

    def close(self) -> None:
        """Undo mlock and close the descriptors, before the mappings go."""
        if self.locked:
            _os.unlock(self.dense_spans)
            self.locked = False
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = {}
