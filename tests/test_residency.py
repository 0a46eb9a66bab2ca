"""Residency: prefetch modes and the expert budget change memory behaviour, never results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import colibri
import colibri.modeldir
from colibri import _os
from conftest import reference
from conftest import big_checkpoint

ENV = dict(os.environ, PYTHONPATH=str(Path(colibri.__file__).parent.parent))


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    """~50 MB of f32 experts (2 layers x 16 experts of 1.5 MB): big enough for RSS to show."""
    from colibri.convert import convert

    root = tmp_path_factory.mktemp("big")
    convert(big_checkpoint(root / "hf"), root / "m", log=lambda *a: None)
    return root / "m"


@pytest.mark.parametrize("prefetch", ["none", "routed", "predict"])
def test_prefetch_modes_give_the_same_tokens(converted, prefetch):
    ref = reference("qwen2moe_b")
    m = colibri.load(converted("qwen2moe_b", "int8"), prefetch=prefetch)
    base = colibri.load(converted("qwen2moe_b", "int8"))
    kw = dict(max_new_tokens=10, stop_at_eos=False)
    assert list(m.generate(ref["input_ids"], **kw)) == list(base.generate(ref["input_ids"], **kw))
    st = m.memory_stats()
    if prefetch == "none":
        assert st["prefetch_calls"] == 0 and st["prediction_hit_rate"] is None
    else:
        assert st["prefetch_calls"] > 0 and st["prefetch_failures"] == 0 and st["prefetch_bytes"] > 0
    if prefetch == "predict":
        assert 0.0 <= st["prediction_hit_rate"] <= 1.0


def test_budget_keeps_tokens_and_bounds_resident_experts(big_model):
    ids = list(range(1, 40))
    free = list(colibri.load(big_model).generate(ids, max_new_tokens=24, stop_at_eos=False))
    expert_mb = 3 * 256 * 512 * 4 / (1 << 20)  # one expert: 1.5 MB
    budget = 6 * expert_mb  # room for 6 of the 32 experts
    m = colibri.load(big_model, expert_cache_mb=budget)
    resident = []
    tokens = []
    for tok in m.generate(
        ids, max_new_tokens=24, stop_at_eos=False, on_step=lambda model: resident.append(model._engine.cache_bytes[0])
    ):
        tokens.append(tok)
    assert tokens == free
    # the prompt streams its experts one at a time: the budget holds at every step, the prompt's too
    assert max(resident) <= budget * (1 << 20)
    st = m.memory_stats()
    assert st["experts_released"] > 0 and st["peak_resident_expert_bytes"] <= budget * (1 << 20)
    assert 0 < st["cache_hit_rate"] < 1 and st["over_budget"] == 0


def _decode_together(big_model, prompts, parallel, budget_experts):
    """(tokens per sequence, [(a step of decode tokens only?, prefetches in the step)], stats)."""
    from colibri.batching import Batch

    budget = budget_experts * 3 * 256 * 512 * 4 / (1 << 20)  # experts of 1.5 MB
    m = colibri.load(big_model, expert_cache_mb=budget, prefetch="none", parallel=parallel)
    got, steps = {i: [] for i in range(len(prompts))}, []
    with Batch(m, step_tokens=64) as b:
        seqs = [b.add(p, 12, stop_at_eos=False) for p in prompts]
        while b.running:
            decoding = all(s.fed == len(s.prompt) for s in seqs)
            before = m.memory_stats()["prefetches"]
            for seq, token, _, _ in b.step():
                got[seqs.index(seq)].append(token)
            steps.append((decoding, m.memory_stats()["prefetches"] - before))
    st = m.memory_stats()
    m.close()
    assert st["peak_resident_expert_bytes"] <= budget * (1 << 20) and st["over_budget"] == 0
    return [got[i] for i in range(len(prompts))], steps


def test_sequences_decoded_together_under_a_budget_use_decode_cache_policy(big_model):
    """Under an expert budget a prompt streams its experts (one a wave, the next one prefetched),
    but a step of at most one token per sequence (sequences decoded together) whose experts fit
    half the budget is decode: its experts used together, the recent kept, nothing prefetched with
    prefetch="none". Tokens as alone; the budget holds."""
    prompts = [list(range(1, 30)), list(range(40, 61))]
    alone = colibri.load(big_model)
    want = [list(alone.generate(p, max_new_tokens=12, stop_at_eos=False, reuse_prefix=False)) for p in prompts]
    got, steps = _decode_together(big_model, prompts, 2, 8)  # 2 x top-2: 4 experts, half of 8
    assert got == want
    assert any(n > 0 for decoding, n in steps if not decoding)  # the prompts streamed
    assert [n for decoding, n in steps if decoding] == [0] * sum(d for d, _ in steps)
    assert sum(d for d, _ in steps) >= 10


def test_sequences_decoded_together_whose_experts_outgrow_the_budget_stream(big_model):
    """Four sequences' steps may choose 8 experts a layer: past half of a 6-expert budget they
    stream (the cache never evicts the current layer's experts), so the budget still holds."""
    prompts = [list(range(1 + 7 * i, 20 + 7 * i)) for i in range(4)]
    alone = colibri.load(big_model)
    want = [list(alone.generate(p, max_new_tokens=12, stop_at_eos=False, reuse_prefix=False)) for p in prompts]
    got, steps = _decode_together(big_model, prompts, 4, 6)
    assert got == want
    assert any(n > 0 for decoding, n in steps if decoding)  # some decode steps streamed


def test_release_takes_expert_pages_out_of_rss(big_model):
    m = colibri.load(big_model)
    spans = list(m.residency.spans.values())
    total = sum(length for _, length in spans)
    m.residency.warmup()  # every expert paged in
    before = _os.rss_bytes()[0]
    assert _os.release(spans)
    after = _os.rss_bytes()[0]
    assert before - after >= 0.8 * total


def test_warmup_and_mlock_load(big_model):
    """warmup pages every expert in; mlock pins the dense weights (root, or a memlock limit that
    holds them); neither changes a logit."""
    import resource

    m = colibri.load(big_model, warmup=True, mlock=True)
    spans = list(m.residency.spans.values())
    assert sum(_os.resident_bytes(a, n) for a, n in spans) == sum(n for _, n in spans)
    assert m.memory_stats()["expert_bytes_in_memory"] == sum(n for _, n in spans)
    dense = sum(n for _, n in m.residency.dense_spans)
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if os.geteuid() == 0 or soft == resource.RLIM_INFINITY or soft >= dense:
        assert m.residency.locked is True
    np.testing.assert_array_equal(m.forward([1, 2, 3]), colibri.load(big_model).forward([1, 2, 3]))
    m.close()  # unlocked before the unmapping
    assert m.residency.locked is False


@pytest.mark.parametrize(
    "bad",
    [
        dict(prefetch="always"),
        dict(expert_cache_mb=-1),
        dict(expert_cache_mb="a"),
        dict(prefetch="routed", mmap=False),
        dict(eviction="mru"),
        dict(memory_limit_mb=0),
        dict(memory_limit_mb=float("inf")),
        dict(memory_limit_mb=True),
    ],
)
def test_bad_residency_options(converted, bad):
    with pytest.raises(colibri.ColibriError):
        colibri.load(converted("mixtral_a"), **bad)


def test_cli_stats(converted):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "colibri",
            "run",
            "--model-dir",
            str(converted("mixtral_a", "int8")),
            "--tokens",
            "1,2,3",
            "--max-new-tokens",
            "8",
            "--ids",
            "--prefetch",
            "predict",
            "--expert-cache-mb",
            "0.05",
            "--warmup",
            "--stats",
        ],
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    for key in (
        "experts used per layer",
        "resident experts",
        "prediction hit rate",
        "page faults",
        "expert cache: hit rate",
        "read from storage",
        "memory limit",
    ):
        assert key in r.stderr and key not in r.stdout  # stats never mix with the output


PEAK_CHILD = r"""
import json, sys, numpy as np, colibri
from colibri import _os
budget = json.loads(sys.argv[2])
m = colibri.load(sys.argv[1], threads=1, expert_cache_mb=budget, n_ctx=256)
base = _os.rss_bytes()[0]
for seed in range(3):
    ids = np.random.default_rng(seed).integers(1, 500, 40)
    list(m.generate(ids, max_new_tokens=40, stop_at_eos=False))
print(json.dumps({"base": base, "peak": _os.rss_bytes()[1], "resident": m._engine.cache_bytes}))
"""

# what a generation may add to RSS beyond weights and KV cache: scratch arenas, numpy temporaries
RSS_OVERHEAD = 24 << 20


def test_peak_rss_stays_within_dense_plus_budget_plus_kv(big_model):
    """Peak RSS - RSS after load <= dense weights + budget + KV cache + overhead; without a
    budget the same run touches all 48 MB of experts, more than that bound."""
    md = colibri.modeldir.ModelDir(big_model)
    dense = sum(f["size"] for rel, f in md.files.items() if "/expert_" not in rel)
    cfg = md.config
    kv = 2 * cfg.num_hidden_layers * 256 * cfg.num_key_value_heads * cfg.head_dim * 4
    expert_mb = 3 * 256 * 512 * 4 / (1 << 20)
    budget_mb = 6 * expert_mb
    runs = {}
    for budget in (budget_mb, None):
        r = subprocess.run(
            [sys.executable, "-c", PEAK_CHILD, str(big_model), json.dumps(budget)],
            env=ENV,
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
        runs[budget] = json.loads(r.stdout)
    bound = dense + budget_mb * (1 << 20) + kv + RSS_OVERHEAD
    with_budget = runs[budget_mb]["peak"] - runs[budget_mb]["base"]
    without = runs[None]["peak"] - runs[None]["base"]
    assert with_budget <= bound
    assert without > with_budget + 16 * (1 << 20)


def test_the_engines_advice_goes_through_the_functions_os_resolved(converted):
    """The expert cache's readers advise the OS only through colibri._os's functions: handed
    recording functions instead (madvise's shape for reads and drops, posix_fadvise's for the
    page cache), a prompt under a budget reads the experts it uses in pieces of their spans (the
    read code of CacheAdvice), drops the evicted ones (the release code) and tells the page cache
    about each drop through the expert file's descriptor."""
    import ctypes
    import dataclasses
    from colibri import _engine

    advice = _os.engine_advice()
    if _os.BACKEND != "windows":
        libc = ctypes.CDLL(None)
        assert advice.kind == "madvise"
        assert advice.will_need == advice.release == ctypes.cast(libc.madvise, ctypes.c_void_p).value
        assert _os.cache_advice().fadvise == ctypes.cast(libc.posix_fadvise, ctypes.c_void_p).value
    calls, fadvised = [], []
    recorder = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)(
        lambda address, length, code: calls.append((address, length, code)) or 0
    )
    fadvise = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int)(
        lambda fd, offset, length, code: fadvised.append((fd, offset, length, code)) or 0
    )
    address = ctypes.cast(recorder, ctypes.c_void_p).value
    m = colibri.load(converted("mixtral_a", "int8"), prefetch="routed", expert_cache_mb=0.05, threads=1)
    assert m.residency.fds  # a descriptor per expert under a budget
    spec = dataclasses.replace(
        m.engine_spec,
        advice=_os.EngineAdvice("madvise", address, address, 0, 102),
        cache_os=(ctypes.cast(fadvise, ctypes.c_void_p).value, 4, 101),
    )
    engine = _engine.Engine(spec)
    ids = np.arange(1, 9, dtype=np.int32)
    out = np.empty((1, m.config.vocab_size), np.float32)
    assert engine.run(ids, 0, out, False)[0] == 0  # a prompt: each used expert streamed
    engine.cache_drain()
    owner = {}
    for key, (start, length) in m.residency.spans.items():
        owner[start] = key

    def expert_of(a):
        start = max(s for s in owner if s <= a)
        assert a < start + m.residency.spans[owner[start]][1]  # inside the span
        return owner[start]

    used = {(l, int(e)) for l in range(m.config.num_hidden_layers) for e in np.flatnonzero(engine.expert_counts[l])}
    read = {expert_of(a) for a, n, code in calls if code == 101}
    dropped = [expert_of(a) for a, n, code in calls if code == 102]
    assert read and read <= used and set(dropped) <= used
    assert {code for _, _, code in calls} <= {101, 102}
    stats = dict(zip(_engine.CACHE_STATS, engine.cache_stats))
    assert len(dropped) == stats["drops"] > 0 and stats["evictions"] >= stats["drops"]
    assert sorted(fd for fd, _, _, _ in fadvised) == sorted(m.residency.fds[k] for k in dropped)
    assert all(code == 4 and offset == 0 and length == 0 for _, offset, length, code in fadvised)
    assert stats["advice_failures"] == 0
    engine.close()
