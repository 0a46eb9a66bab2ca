"""Which experts are resident: prefetching, an LRU under a byte budget, and the counters.

Design
------
Every expert of every MoE layer is one file, mapped once (modeldir.MappedModelDir); its pages
come into the process when a router first chooses it. Two mechanisms act on that:

- Prefetch (inside the compiled layer loop, csrc/os_hints.h): `routed` advises the OS of a
  layer's chosen experts the moment they are chosen; `predict` also applies the next MoE layer's
  router to the current hidden state and advises its likely experts one layer early, and counts
  how often that guess was right. Useful when expert pages are not yet in the page cache (cold
  start, a budget smaller than the experts); with a warm cache it is an extra syscall per expert.
- A budget (`expert_cache_mb`, here, between tokens): an LRU of the experts used, most recent
  last; when their bytes exceed the budget the coldest are released (_os.release: MADV_DONTNEED
  / working-set trim), which takes their pages out of this process's RSS. The page cache may
  keep them, so a released expert that comes back costs a minor fault, not a disk read. A prompt
  routes to most experts at once, so under a budget the prefill releases each expert right after
  its matrix product (inside the layer loop): peak RSS stays near dense weights + budget + KV
  cache + one expert, not the whole checkpoint.

With prefetch "none" and no budget, nothing here runs per token. `mlock=True` pins the dense
weights (attention, embeddings, norms, routers); `warmup=True` reads every expert once at load.
"""
from __future__ import annotations

import numbers

from collections import OrderedDict

import numpy as np

from . import _os
from ._engine import PREFETCH_CODES
from .errors import ColibriError
from .modeldir import tensor_file

PREFETCH_MODES = PREFETCH_CODES     # name -> the layer loop's code (defined once, in _engine.pyx)


MAX_BUDGET_MB = 1e12         # a budget beyond any machine's memory is a typo (or inf)


class Residency:
    def __init__(self, maps, config, budget_mb: float | None = None, mlock: bool = False, warmup: bool = False):
        if budget_mb is not None and (isinstance(budget_mb, bool) or not isinstance(budget_mb, numbers.Real)
                                      or not 0 < budget_mb < MAX_BUDGET_MB):
            raise ColibriError(f"expert_cache_mb must be a positive finite number of megabytes "
                               f"(below {MAX_BUDGET_MB:.0e}), got {budget_mb!r}")
        self.budget = None if budget_mb is None else int(float(budget_mb) * (1 << 20))
        self.config = config
        # (layer, expert) -> (address, page-rounded length) of its file
        self.spans = {}
        for layer, is_moe in enumerate(config.moe_layers):
            if is_moe:
                for e in range(config.num_experts):
                    self.spans[(layer, e)] = maps.file_span(tensor_file(f"layers.{layer}.experts.{e}.gate"))
        expert_files = {tensor_file(f"layers.{l}.experts.{e}.gate") for (l, e) in self.spans}
        self.dense_spans = [maps.file_span(rel) for rel in maps.mapped_files() if rel not in expert_files]
        self.lru = OrderedDict()             # (layer, expert) -> bytes, least recently used first
        self.resident = 0                    # bytes of the experts in the LRU
        self.peak_resident = 0
        self.released = 0                    # experts released to stay under the budget
        self.used_bytes = 0                  # bytes of the experts used, summed over steps
        self.locked = _os.lock(self.dense_spans) if mlock else False
        if warmup:
            self.warmup()
        self._last = np.zeros((config.num_hidden_layers, config.num_experts), np.int64)

    def warmup(self) -> None:
        """Read every expert once (first requests are otherwise slow on a cold page cache)."""
        spans = list(self.spans.values())
        _os.prefetch(spans)
        page = _os.page_size()
        for addr, length in spans:
            view = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * length).from_address(addr))
            int(view[::page].sum())          # one byte a page
            del view

    def after_step(self, counts: np.ndarray, released: bool = False) -> None:
        """Called between engine steps with the cumulative expert counts [n_layers, n_experts].
        released: the step (a prefill under a budget) already released every expert it used."""
        changed = np.argwhere(counts != self._last)
        self._last[...] = counts
        if released:
            for layer, e in changed:
                self.used_bytes += self.spans[(int(layer), int(e))][1]
                if self.lru.pop((int(layer), int(e)), None) is not None:
                    self.resident -= self.spans[(int(layer), int(e))][1]
            return
        used = set()
        for layer, e in changed:
            key = (int(layer), int(e))
            used.add(key)
            size = self.spans[key][1]
            self.used_bytes += size
            if key in self.lru:
                self.lru.move_to_end(key)
            else:
                self.lru[key] = size
                self.resident += size
        self.peak_resident = max(self.peak_resident, self.resident)
        if self.budget is None:
            return
        victims = []
        for key in self.lru:                 # coldest first; never what this step used
            if self.resident <= self.budget:
                break
            if key in used:
                continue
            victims.append(key)
            self.resident -= self.lru[key]
        for key in victims:
            del self.lru[key]
        if victims:
            _os.release([self.spans[k] for k in victims])
            self.released += len(victims)

    def reset(self, counts: np.ndarray) -> None:
        self._last[...] = counts

    def stats(self) -> dict:
        return {"resident_expert_bytes": self.resident, "peak_resident_expert_bytes": self.peak_resident,
                "expert_budget_bytes": self.budget, "experts_released": self.released,
                "expert_bytes_used": self.used_bytes, "dense_locked": bool(self.locked),
                "expert_bytes_in_memory": self.in_memory()}

    def in_memory(self) -> int:
        """Bytes of the expert files in memory now, as the OS reports them (_os.resident_bytes:
        on Linux the page cache, whether or not this process touched the pages) — the figure a
        memory cap counts, beside the bookkeeping of `resident`."""
        return sum(_os.resident_bytes(address, length) for address, length in self.spans.values())

    def close(self) -> None:
        """Undo mlock before the mappings go (they are about to be unmapped)."""
        if self.locked:
            _os.unlock(self.dense_spans)
            self.locked = False
