"""`python -m colibri eval`: perplexity of a text, and divergence from a reference model.

Design
------
The text is tokenized once and cut into non-overlapping chunks of `ctx` tokens; each chunk is a
fresh context that starts with BOS (when the model has one) in place of its first token, as
llama.cpp's `llama-perplexity` does, and every position after the first is scored:

    perplexity = exp(mean over scored positions of -log p(next token))

With a reference directory (the same model in another format, e.g. f32 against int8) the same
chunks run through both, and per scored position:

    KL      = sum_v p_ref(v) * (log p_ref(v) - log p(v))      (mean, median, p99 reported)
    top-1   = argmax p == argmax p_ref
    delta p = p(correct token) - p_ref(correct token)        (RMS reported)

These are the statistics `llama-perplexity --kl-divergence` reports, so figures compare.

The command (`run_eval`) prints its results on stdout and the chunks done, with their rate and the
time left, on stderr (colibri.progress); evaluate() itself only calls its `progress` callback.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from .errors import ColibriError

MIN_CTX = 2


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities of float32 logits [T, vocab]."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def chunks_of(ids: list, ctx: int, bos: int | None) -> list:
    """Non-overlapping chunks of ctx tokens; BOS replaces each chunk's first token."""
    out = []
    for start in range(0, len(ids) - 1, ctx):
        chunk = list(ids[start : start + ctx])
        if len(chunk) < MIN_CTX:
            break
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


def evaluate(model, text: str, ctx: int = 256, reference=None, progress=None, one_token_steps: bool = False) -> dict:
    """Perplexity of `text` under `model` (and divergence from `reference`, a second Model).
    one_token_steps: `model` runs one engine call a token, as decoding does (Model.forward)."""
    if model.tokenizer is None:
        raise ColibriError(
            f"{model.path} has no tokenizer (tokenizer.json or tokenizer.model): eval needs one to tokenize the text"
        )
    if not isinstance(ctx, int) or not MIN_CTX <= ctx <= model.n_ctx:
        raise ColibriError(f"--ctx must be in {MIN_CTX}..{model.n_ctx}, got {ctx!r}")
    if reference is not None and reference.config.vocab_size != model.config.vocab_size:
        raise ColibriError(
            f"reference {reference.path} has vocab_size {reference.config.vocab_size}, "
            f"the model {model.config.vocab_size}: not the same model"
        )
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    chunks = chunks_of(ids, ctx, model.config.bos_token_id)
    if not chunks:
        raise ColibriError(f"the text is too short to evaluate ({len(ids)} tokens)")
    nll, kl, top1, dp = [], [], [], []
    for i, chunk in enumerate(chunks):
        if progress:
            progress(i, len(chunks))
        target = np.asarray(chunk[1:])
        lp = log_softmax(model.forward(chunk, one_token_steps))[:-1]  # [T-1, vocab], predicts chunk[1:]
        rows = np.arange(len(target))
        nll.append(-lp[rows, target])
        if reference is not None:
            lr = log_softmax(reference.forward(chunk))[:-1]
            pr = np.exp(lr)
            kl.append((pr * (lr - lp)).sum(axis=-1))
            top1.append(lp.argmax(-1) == lr.argmax(-1))
            dp.append(np.exp(lp[rows, target]) - pr[rows, target])
    if progress:
        progress(len(chunks), len(chunks))
    nll = np.concatenate(nll)
    result = {
        "model": str(model.path),
        "tokens": len(ids),
        "chunks": len(chunks),
        "ctx": ctx,
        "scored": int(nll.size),
        "perplexity": float(math.exp(nll.mean())),
        "nll_mean": float(nll.mean()),
        "one_token_steps": bool(one_token_steps),
    }
    if model.expert_budget is not None:  # what the expert cache read, and what a lossy mode changed
        stats = model.memory_stats()
        result.update(
            {k: stats[k] for k in ("cache_misses", "cache_hits", "experts_skipped", "experts_rerouted")},
            expert_bytes_read=stats["prefetch_bytes"],
        )
    if reference is not None:
        kl, top1, dp = np.concatenate(kl), np.concatenate(top1), np.concatenate(dp)
        result.update(
            {
                "reference": str(reference.path),
                "kl_mean": float(kl.mean()),
                "kl_median": float(np.median(kl)),
                "kl_p99": float(np.percentile(kl, 99)),
                "top1_agreement": float(top1.mean()),
                "rms_delta_p": float(np.sqrt((dp**2).mean())),
            }
        )
    return result


def read_text(path) -> str:
    """The UTF-8 text of --text `path`; ColibriError naming it otherwise (eval, calibrate)."""
    path = Path(path)
    if not path.is_file():
        raise ColibriError(f"--text {path}: no such file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ColibriError(f"--text {path} is not UTF-8 text ({e})") from None


def run_eval(args) -> int:
    from contextlib import ExitStack

    from .model import load
    from .progress import progress

    text = read_text(args.text)
    model = load(
        args.model_dir,
        threads=args.threads,
        memory_limit_mb=args.memory_limit_mb,
        expert_cache_mb=args.expert_cache_mb,
        skip_missed=args.skip_missed,
        cache_routing=args.cache_routing,
    )
    reference = load(args.reference_dir, threads=args.threads) if args.reference_dir else None

    with ExitStack() as stack:
        bar = []  # on stderr (colibri.progress), opened when the chunks are known

        def chunk(i, n):
            if not bar:
                bar.append(stack.enter_context(progress(n, "eval", unit="chunk")))
            bar[0].at(i)

        r = evaluate(
            model, text, ctx=args.ctx, reference=reference, progress=chunk, one_token_steps=args.one_token_steps
        )
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"[INFO] {r['tokens']} tokens in {r['chunks']} chunks of {r['ctx']}, {r['scored']} scored")
    print(f"perplexity:      {r['perplexity']:.4f}")
    if "cache_misses" in r:
        print(
            f"expert cache:    {r['cache_misses']} misses, {r['cache_hits']} hits, {r['expert_bytes_read'] / 1e6:.1f} MB read"
        )
    if args.skip_missed is not None or args.cache_routing is not None:
        print(
            f"lossy modes:     {r['experts_skipped']} expert uses skipped (--skip-missed {args.skip_missed}), "
            f"{r['experts_rerouted']} choices changed (--cache-routing {args.cache_routing})"
        )
    if reference is not None:
        print(f"reference:       {r['reference']}")
        print(f"KL divergence:   mean {r['kl_mean']:.6f}, median {r['kl_median']:.6f}, p99 {r['kl_p99']:.6f}")
        print(f"top-1 agreement: {100 * r['top1_agreement']:.2f} %")
        print(f"RMS delta p:     {100 * r['rms_delta_p']:.3f} %")
    return 0
