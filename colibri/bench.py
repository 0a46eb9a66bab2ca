"""`python -m colibri bench`: load time, prefill and decode speed, per-token latency, peak RSS.

Design
------
Only the public API is used: `load`, `Model.generate(..., stop_at_eos=False, reuse_prefix=False)` and `Model.stats`.
The prompt is `prompt_len` token ids drawn uniformly from the vocabulary with a fixed seed, so
every run and every engine sees the same work; decoding is greedy and never stops early.

One repetition = one `generate` of `gen` tokens in a fresh context:
  prefill tok/s   stats prefill_tokens / prefill_seconds (the prompt's forward pass)
  decode tok/s    stats decode_tokens / decode_seconds (the gen - 1 single-token forward passes;
                  the last token needs none), engine time without sampling, like llama-bench's tg
  TTFT            wall time from the call to the first yielded token (prefill + first sample)
  P50/P99         of the wall time between consecutive yielded tokens (decode step + sample)
  P99 / P50       their ratio: how smooth decoding is (the original design's "no spikes"; 1.15 or
                  less is the target)
One warm-up repetition runs first and is discarded; each figure is reported as the median and
min–max over the `repeat` measured repetitions. Load time is the one `colibri.load` call (with a
cold page cache it is mostly disk reading). Peak RSS is the process's high-water mark
(getrusage ru_maxrss: KB on Linux, bytes on macOS; None where `resource` is missing, Windows):
it counts the mapped weight pages the runs touched.

Under a memory limit (the load options of `run`: memory_limit_mb, expert_cache_mb, prefetch,
eviction) `memory` reports what the expert cache did over the measured repetitions: bytes read
from storage per token (prompt and generated), its hit rate, prefetch hit rate and evictions,
and the enforcing cgroup's peak usage (page cache included) where the OS says.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from .errors import ColibriError

PROMPT_SEED = 1234
METRICS = (  # key, label, unit, format
    ("prefill_tok_s", "prefill", "tok/s", "{:.1f}"),
    ("decode_tok_s", "decode", "tok/s", "{:.2f}"),
    ("ttft_ms", "time to first token", "ms", "{:.1f}"),
    ("decode_p50_ms", "decode latency P50", "ms/token", "{:.2f}"),
    ("decode_p99_ms", "decode latency P99", "ms/token", "{:.2f}"),
    ("decode_p99_over_p50", "decode P99 / P50", "", "{:.2f}"),
)


def peak_rss_bytes():
    try:
        import resource
    except ImportError:          # Windows
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss) if sys.platform == "darwin" else int(rss) * 1024


def one_repetition(model, prompt, gen: int) -> dict:
    """Generate `gen` tokens after `prompt`, timing each yielded token."""
    gaps = []
    last = time.perf_counter()
    for _ in model.generate(prompt, max_new_tokens=gen, stop_at_eos=False, reuse_prefix=False):
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    s = model.stats
    decode = [g * 1000 for g in gaps[1:]]
    return {
        "prefill_tok_s": s["prefill_tokens"] / s["prefill_seconds"] if s["prefill_seconds"] > 0 else None,
        "decode_tok_s": s["decode_tokens"] / s["decode_seconds"] if s["decode_seconds"] > 0 else None,
        "ttft_ms": gaps[0] * 1000,
        "decode_p50_ms": float(np.percentile(decode, 50)) if decode else None,
        "decode_p99_ms": float(np.percentile(decode, 99)) if decode else None,
        "decode_p99_over_p50": (float(np.percentile(decode, 99) / np.percentile(decode, 50))
                                if decode and np.percentile(decode, 50) > 0 else None),
    }


def summarize(values: list) -> dict:
    """median, min, max and the values themselves (None when a figure does not exist)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "values": values}
    return {"median": float(np.median(vals)), "min": min(vals), "max": max(vals), "values": values}


def bench(model_dir, prompt_len: int = 128, gen: int = 64, repeat: int = 5, threads=None, n_ctx=None,
          **load_options) -> dict:
    """Run the benchmark; return the result as a JSON-ready dict. load_options: colibri.load's
    memory_limit_mb, expert_cache_mb, prefetch, eviction, kv_cache, bf16_products, prefill_chunk."""
    from . import _kernels, _os
    from .model import DEFAULT_MAX_CONTEXT, load
    from .modeldir import ModelDir

    max_pos = ModelDir(model_dir).config.max_position_embeddings        # validates the directory
    need = prompt_len + gen
    if need > max_pos:
        raise ColibriError(f"--prompt-len {prompt_len} + --gen {gen} exceeds the model's "
                           f"max_position_embeddings {max_pos}")
    t0 = time.perf_counter()
    model = load(model_dir, threads=threads, n_ctx=n_ctx or max(need, min(max_pos, DEFAULT_MAX_CONTEXT)),
                 **load_options)
    load_s = time.perf_counter() - t0
    with model:
        prompt = np.random.default_rng(PROMPT_SEED).integers(0, model.config.vocab_size, prompt_len)
        one_repetition(model, prompt, gen)                                  # warm-up, discarded
        before = model.memory_stats()
        runs = [one_repetition(model, prompt, gen) for _ in range(repeat)]
        after = model.memory_stats()
        c = model.config
        tokens = repeat * (prompt_len + gen)
        read = (None if after["bytes_read_from_storage"] is None
                else after["bytes_read_from_storage"] - before["bytes_read_from_storage"])
        uses = (after["cache_hits"] + after["cache_misses"]) - (before["cache_hits"] + before["cache_misses"])
        prefetches = after["prefetches"] - before["prefetches"]
        memory = {
            "memory_limit_bytes": after["memory_limit_bytes"], "memory_limit_source": after["memory_limit_source"],
            "expert_budget_bytes": after["expert_budget_bytes"], "prefetch": model.prefetch,
            "bytes_read_per_token": None if read is None else read / tokens,
            "cache_hit_rate": (after["cache_hits"] - before["cache_hits"]) / uses if uses else None,
            "prefetch_hit_rate": (after["prefetch_hits"] - before["prefetch_hits"]) / prefetches if prefetches else None,
            "evictions": after["experts_released"] - before["experts_released"],
            "major_page_faults": after["major_page_faults"] - before["major_page_faults"],
            "cgroup_peak_bytes": _os.memory_usage()[1],
        }
        return {
            "engine": "colibri", "model_dir": str(model_dir), "architecture": c.architecture,
            "weight_dtype": model.weight_dtype, "kv_cache": load_options.get("kv_cache", "f32"),
            "bf16_products": model.bf16_products, "threads": model.threads, "prefill_chunk": model.prefill_chunk,
            "isa": _kernels.isa(), "int_step": _kernels.int_step(),
            "prompt_len": prompt_len, "gen": gen, "repeat": repeat,
            "load_seconds": load_s, "peak_rss_bytes": peak_rss_bytes(), "memory": memory,
            **{key: summarize([r[key] for r in runs]) for key, *_ in METRICS},
        }


def format_table(r: dict) -> str:
    def fmt(fmtstr, v):
        return "n/a" if v is None else fmtstr.format(v)

    lines = [f"colibri bench: {r['model_dir']} ({r['architecture']}, {r['weight_dtype']}), "
             f"{r['threads']} threads, prompt {r['prompt_len']} tokens, {r['gen']} generated, "
             f"{r['repeat']} repetitions after 1 warm-up; kernels {r['isa']} (int step {r['int_step']}), "
             f"prefill chunk {r['prefill_chunk']}",
             f"{'':<22}{'median':>12}  {'min – max':<22}"]
    for key, label, unit, f in METRICS:
        s = r[key]
        span = "" if s["min"] is None else f"{fmt(f, s['min'])} – {fmt(f, s['max'])}"
        lines.append(f"{label:<22}{fmt(f, s['median']):>12}  {span:<22}{unit}")
    lines.append(f"{'load':<22}{r['load_seconds'] * 1000:>12.0f}  {'':<22}ms")
    rss = r["peak_rss_bytes"]
    lines.append(f"{'peak RSS':<22}{'n/a' if rss is None else f'{rss / 2**20:.0f}':>12}  {'':<22}MiB")
    mem = r["memory"]
    if mem["expert_budget_bytes"] is not None:
        per = mem["bytes_read_per_token"]
        hit = mem["cache_hit_rate"]
        lines.append(f"{'expert budget':<22}{mem['expert_budget_bytes'] / 2**20:>12.0f}  {'':<22}MiB")
        lines.append(f"{'read per token':<22}{'n/a' if per is None else f'{per / 2**20:.2f}':>12}  {'':<22}MiB")
        lines.append(f"{'expert hit rate':<22}{'n/a' if hit is None else f'{100 * hit:.1f}':>12}  {'':<22}%")
    if mem["cgroup_peak_bytes"] is not None:
        lines.append(f"{'cgroup peak':<22}{mem['cgroup_peak_bytes'] / 2**20:>12.0f}  {'':<22}MiB")
    return "\n".join(lines)


def run_bench(args) -> int:
    r = bench(args.model_dir, prompt_len=args.prompt_len, gen=args.gen, repeat=args.repeat, threads=args.threads,
              n_ctx=args.n_ctx, memory_limit_mb=args.memory_limit_mb, expert_cache_mb=args.expert_cache_mb,
              prefetch=args.prefetch, eviction=args.eviction, kv_cache=args.kv_cache,
              bf16_products=args.bf16_products, prefill_chunk=args.prefill_chunk)
    print(json.dumps(r) if args.json else format_table(r))
    return 0
