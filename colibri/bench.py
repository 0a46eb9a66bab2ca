"""`python -m colibri bench`: load time, prefill and decode speed, per-token latency, peak RSS.

Design
------
The model is driven through its public API only: `load`, `Model.generate(..., stop_at_eos=False,
reuse_prefix=False)`, `Model.stats`, `Model.decode_bytes` and `Model.memory_stats` (the read loop
below is `_probes.bench_read`, in a child process).
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
  decode read     decode tok/s x the bytes a decoded token reads (Model.decode_bytes: the weights,
                  routed experts k / E of theirs, and the KV cache rows, averaged over the run's
                  positions), GB/s: decode is memory-bound, so this is the figure to set against
                  the machine's bandwidth. With read_bandwidth, a plain read by the same threads of
                  a buffer past the last-level cache (512 MiB, 4 x LLC where that is more), median
                  of 5 passes, before the load and after the repetitions (hosts' bandwidth moves),
                  says how close it is. The loop runs in a child process, so its buffer is not in
                  the peak RSS; it is in a cgroup's peak, which is then not reported.
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
    ("decode_read_gb_s", "decode memory read", "GB/s", "{:.1f}"),
)
READ_LOOP_MIN_BYTES = 512 << 20  # the read loop's buffer: at least this, and 4 x the last-level cache
DECODE_BYTES_WIDTH = 22  # the table's middle column
READ_LOOP_PASSES = 5


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache the OS reports (Linux sysfs: cpu0's highest index), or None."""
    from pathlib import Path

    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * mult)
        except (OSError, ValueError):  # an unreadable or odd entry: that size unknown
            pass
    return max(sizes) if sizes else None


def read_bandwidth_apart(threads: int, nbytes: int | None = None) -> float:
    """read_bandwidth in a child process (this interpreter, this package), so that its buffer
    stays out of this one's peak RSS."""
    import subprocess
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)  # where this colibri is imported from
    code = (
        f"import sys; sys.path.insert(0, {root!r}); from colibri.bench import read_bandwidth; "
        f"print(read_bandwidth({int(threads)}, {nbytes!r}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        why = (
            f"killed by signal {-done.returncode} (out of memory?)"
            if done.returncode < 0
            else (done.stderr.strip().splitlines() or [f"exit status {done.returncode}, no message"])[-1]
        )
        raise ColibriError(f"the read-bandwidth loop (--read-bandwidth) failed: {why}")
    return float(lines[-1])


def read_bandwidth(threads: int, nbytes: int | None = None) -> float:
    """GB/s of `threads` threads reading a buffer (nbytes; default past the last-level cache:
    READ_LOOP_MIN_BYTES, 4 x the LLC where that is more) once, the median of READ_LOOP_PASSES
    passes after a warm one that pages it in."""
    from . import _probes

    if nbytes is None:
        nbytes = max(READ_LOOP_MIN_BYTES, 4 * (last_level_cache_bytes() or 0))
    nbytes = max(64, nbytes // 64 * 64)
    buf = np.ones(nbytes // 8, np.uint64)
    _probes.bench_read(buf, threads)
    times = []
    for _ in range(READ_LOOP_PASSES):
        t0 = time.perf_counter()
        _probes.bench_read(buf, threads)
        times.append(time.perf_counter() - t0)
    return nbytes / float(np.median(times)) / 1e9


def peak_rss_bytes():
    try:
        import resource
    except ImportError:  # Windows
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss) if sys.platform == "darwin" else int(rss) * 1024


def one_repetition(model, prompt, gen: int, decode_bytes: float, draft: dict | None = None) -> dict:
    """Generate `gen` tokens after `prompt`, timing each yielded token; decode_bytes: what a decoded
    token reads on average (for the decode read rate); draft: generate()'s speculation keywords
    (default: none, plain decoding)."""
    gaps = []
    last = time.perf_counter()
    draft = draft or {"draft": "none"}
    for _ in model.generate(prompt, max_new_tokens=gen, stop_at_eos=False, reuse_prefix=False, **draft):
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    s = model.stats
    decode = [g * 1000 for g in gaps[1:]]
    decode_tok_s = s["decode_tokens"] / s["decode_seconds"] if s["decode_seconds"] > 0 else None
    return {
        "prefill_tok_s": s["prefill_tokens"] / s["prefill_seconds"] if s["prefill_seconds"] > 0 else None,
        "decode_tok_s": decode_tok_s,
        "decode_read_gb_s": None if decode_tok_s is None else decode_tok_s * decode_bytes / 1e9,
        "ttft_ms": gaps[0] * 1000,
        "decode_p50_ms": float(np.percentile(decode, 50)) if decode else None,
        "decode_p99_ms": float(np.percentile(decode, 99)) if decode else None,
        "decode_p99_over_p50": (
            float(np.percentile(decode, 99) / np.percentile(decode, 50))
            if decode and np.percentile(decode, 50) > 0
            else None
        ),
        **(model.last_generation.speculation.as_dict() if model.last_generation.speculation else {}),
    }


def summarize(values: list) -> dict:
    """median, min, max and the values themselves (None when a figure does not exist)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "values": values}
    return {"median": float(np.median(vals)), "min": min(vals), "max": max(vals), "values": values}


def bench(
    model_dir,
    prompt_len: int = 128,
    gen: int = 64,
    repeat: int = 5,
    threads=None,
    n_ctx=None,
    read_bandwidth_too: bool = False,
    draft: dict | None = None,
    **load_options,
) -> dict:
    """Run the benchmark; return the result as a JSON-ready dict. read_bandwidth_too: time the read
    loop before and after the repetitions; draft: generate()'s speculation keywords (draft,
    draft_max; default plain decoding). load_options: colibri.load's memory_limit_mb,
    expert_cache_mb, prefetch, eviction, kv_cache, bf16_products, prefill_chunk, skip_missed,
    cache_routing."""
    from . import _kernels, _os
    from .model import DEFAULT_MAX_CONTEXT, load
    from .modeldir import ModelDir

    max_pos = ModelDir(model_dir).config.max_position_embeddings  # validates the directory
    need = prompt_len + gen
    if need > max_pos:
        raise ColibriError(
            f"--prompt-len {prompt_len} + --gen {gen} exceeds the model's max_position_embeddings {max_pos}"
        )
    read_loop = []  # before the load: its buffer would push the model out of the caches
    if read_bandwidth_too:
        read_loop.append(read_bandwidth_apart(_os.compute_cores() if threads is None else threads))
    t0 = time.perf_counter()
    model = load(
        model_dir, threads=threads, n_ctx=n_ctx or max(need, min(max_pos, DEFAULT_MAX_CONTEXT)), **load_options
    )
    load_s = time.perf_counter() - t0
    with model:
        prompt = np.random.default_rng(PROMPT_SEED).integers(0, model.config.vocab_size, prompt_len)
        # the decode passes run the tokens at positions prompt_len .. prompt_len + gen - 2
        per_position = [model.decode_bytes(p) for p in range(prompt_len, min(prompt_len + gen - 1, model.n_ctx))] or [
            model.decode_bytes(min(prompt_len, model.n_ctx - 1))
        ]
        decode_bytes = {part: float(np.mean([b[part] for b in per_position])) for part in ("weights", "kv_cache")}
        per_token = sum(decode_bytes.values())
        one_repetition(model, prompt, gen, per_token, draft)  # warm-up, discarded
        before = model.memory_stats()
        runs = [one_repetition(model, prompt, gen, per_token, draft) for _ in range(repeat)]
        after = model.memory_stats()
        if read_bandwidth_too:
            read_loop.append(read_bandwidth_apart(model.threads))
        c = model.config
        tokens = repeat * (prompt_len + gen)
        read = (
            None
            if after["bytes_read_from_storage"] is None
            else after["bytes_read_from_storage"] - before["bytes_read_from_storage"]
        )
        uses = (after["cache_hits"] + after["cache_misses"]) - (before["cache_hits"] + before["cache_misses"])
        prefetches = after["prefetches"] - before["prefetches"]
        memory = {
            "memory_limit_bytes": after["memory_limit_bytes"],
            "memory_limit_source": after["memory_limit_source"],
            "expert_budget_bytes": after["expert_budget_bytes"],
            "prefetch": model.prefetch,
            "bytes_read_per_token": None if read is None else read / tokens,
            "cache_hit_rate": (after["cache_hits"] - before["cache_hits"]) / uses if uses else None,
            "prefetch_hit_rate": (after["prefetch_hits"] - before["prefetch_hits"]) / prefetches
            if prefetches
            else None,
            "evictions": after["experts_released"] - before["experts_released"],
            "experts_skipped": after["experts_skipped"] - before["experts_skipped"],  # --skip-missed (lossy)
            "experts_rerouted": after["experts_rerouted"] - before["experts_rerouted"],  # --cache-routing (lossy)
            "major_page_faults": after["major_page_faults"] - before["major_page_faults"],
            "cgroup_peak_bytes": None if read_bandwidth_too else _os.memory_usage()[1],  # the loop's buffer is in it
        }
        return {
            "engine": "colibri",
            "model_dir": str(model_dir),
            "architecture": c.architecture,
            "weight_dtype": model.weight_dtype,
            "kv_cache": load_options.get("kv_cache", "f32"),
            "bf16_products": model.bf16_products,
            "threads": model.threads,
            "prefill_chunk": model.prefill_chunk,
            "isa": _kernels.isa(),
            "int_step": _kernels.int_step(),
            "prompt_len": prompt_len,
            "gen": gen,
            "repeat": repeat,
            "load_seconds": load_s,
            "peak_rss_bytes": peak_rss_bytes(),
            "memory": memory,
            "decode_bytes": decode_bytes,
            "read_loop_gb_s": read_loop if read_bandwidth_too else None,
            **{key: summarize([r[key] for r in runs]) for key, *_ in METRICS},
        }


def format_table(r: dict) -> str:
    def fmt(fmtstr, v):
        return "n/a" if v is None else fmtstr.format(v)

    lines = [
        f"colibri bench: {r['model_dir']} ({r['architecture']}, {r['weight_dtype']}), "
        f"{r['threads']} threads, prompt {r['prompt_len']} tokens, {r['gen']} generated, "
        f"{r['repeat']} repetitions after 1 warm-up; kernels {r['isa']} (int step {r['int_step']}), "
        f"prefill chunk {r['prefill_chunk']}",
        f"{'':<22}{'median':>12}  {'min – max':<22}",
    ]
    for key, label, unit, f in METRICS:
        s = r[key]
        span = "" if s["min"] is None else f"{fmt(f, s['min'])} – {fmt(f, s['max'])}"
        lines.append(f"{label:<22}{fmt(f, s['median']):>12}  {span:<22}{unit}")
    b = r["decode_bytes"]
    parts = f"weights {b['weights'] / 1e6:.1f}, KV {b['kv_cache'] / 1e6:.1f} "
    lines.append(f"{'decode reads a token':<22}{sum(b.values()) / 1e6:>12.1f}  {parts:<{DECODE_BYTES_WIDTH}}MB")
    loop, rate = r["read_loop_gb_s"], r["decode_read_gb_s"]["median"]
    if loop:
        lines.append(
            f"{'read loop':<22}{float(np.median(loop)):>12.1f}  {' then '.join(f'{v:.1f}' for v in loop):<22}GB/s"
        )
        if rate:
            lines.append(f"{'decode / read loop':<22}{100 * rate / float(np.median(loop)):>12.0f}  {'':<22}%")
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
    r = bench(
        args.model_dir,
        prompt_len=args.prompt_len,
        gen=args.gen,
        repeat=args.repeat,
        threads=args.threads,
        n_ctx=args.n_ctx,
        memory_limit_mb=args.memory_limit_mb,
        expert_cache_mb=args.expert_cache_mb,
        prefetch=args.prefetch,
        eviction=args.eviction,
        kv_cache=args.kv_cache,
        bf16_products=args.bf16_products,
        prefill_chunk=args.prefill_chunk,
        skip_missed=args.skip_missed,
        cache_routing=args.cache_routing,
        read_bandwidth_too=args.read_bandwidth,
        draft={"draft": args.draft, "draft_max": args.draft_max},
    )
    print(json.dumps(r) if args.json else format_table(r))
    return 0
