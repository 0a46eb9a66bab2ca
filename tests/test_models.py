"""Every architecture, end to end: converted fixtures against transformers' own outputs.

References come from tools/make_fixtures.py (transformers 5.24, eager attention, float32). The
bf16/f16 references were computed by transformers with the matrices rounded exactly as our
converter stores them, so every dtype is held to the same float-rounding tolerance.
"""

from __future__ import annotations

import json
import shutil
import threading

import numpy as np
import pytest

import colibri
from colibri import _kernels
from conftest import CASES, reference

# max |ours - reference| <= REL_TOL * max |reference logit| (float32 rounding, different summation order)
REL_TOL = 1e-4
DTYPES = ("f32", "bf16", "f16")


@pytest.fixture(scope="module")
def models(converted):
    cache = {}

    def get(case, dtype="f32"):
        if (case, dtype) not in cache:  # bf16 as transformers multiplies it: exact f32 products
            cache[(case, dtype)] = colibri.load(converted(case, dtype), threads=2, bf16_products="f32")
        return cache[(case, dtype)]

    return get


def test_every_architecture_is_covered():
    archs = {json.load(open(f"tests/fixtures/{c}/hf/config.json"))["architectures"][0] for c in CASES}
    assert archs == {
        "MixtralForCausalLM",
        "Qwen3MoeForCausalLM",
        "OlmoeForCausalLM",
        "Qwen2MoeForCausalLM",
        "Gemma4ForCausalLM",
        "Gemma4ForConditionalGeneration",
        "Glm4MoeForCausalLM",
        "GptOssForCausalLM",
        "DeepseekV3ForCausalLM",
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_transformers(models, case, dtype):
    ref = reference(case)
    logits = models(case, dtype).forward(ref["input_ids"])
    expected = ref[f"logits_{dtype}"]
    assert logits.shape == expected.shape and logits.dtype == np.float32
    err = np.abs(logits - expected).max()
    assert err <= REL_TOL * np.abs(expected).max(), f"{case} {dtype}: max abs error {err}"


@pytest.mark.parametrize("case", CASES)
def test_greedy_generation_reproduces_transformers(models, case):
    ref = reference(case)
    out = list(models(case).generate(ref["input_ids"], max_new_tokens=len(ref["greedy_ids"]), stop_at_eos=False))
    assert out == ref["greedy_ids"].tolist()


@pytest.mark.parametrize("case", CASES)
def test_cached_decoding_equals_full_forward(models, case):
    """Each decode step (one token against the KV cache) gives the logits of a full fresh forward."""
    ref = reference(case)
    m = models(case)
    steps = []
    gen = m.generate(
        ref["input_ids"], max_new_tokens=6, stop_at_eos=False, on_step=lambda model: steps.append(model.last_logits)
    )
    new = list(gen)
    full = m.forward(np.concatenate([ref["input_ids"], new]))
    T = len(ref["input_ids"])
    assert len(steps) == len(new)  # prefill + 5 decode steps
    for i, step_logits in enumerate(steps):
        np.testing.assert_allclose(step_logits, full[T - 1 + i], rtol=0, atol=1e-5 * np.abs(full).max())


def test_thread_count_does_not_change_results(tmp_path):
    """Rows are split between threads, never a dot product: one or two threads, same bits. The
    model is large enough (256 wide, 512-wide experts) for the matrix products to use threads."""
    from colibri.convert import convert
    from conftest import big_checkpoint

    for dtype in ("f32", "int8"):
        out = tmp_path / dtype
        convert(big_checkpoint(tmp_path / f"hf_{dtype}"), out, quantize=dtype, log=lambda *a: None)
        ids = list(range(1, 30))
        one = colibri.load(out, threads=1)
        two = colibri.load(out, threads=2)
        np.testing.assert_array_equal(one.forward(ids), two.forward(ids))
        kw = dict(max_new_tokens=8, stop_at_eos=False)
        assert list(one.generate(ids, **kw)) == list(two.generate(ids, **kw))


@pytest.mark.parametrize("case", CASES)
def test_per_token_work_split_over_threads_keeps_the_bits(converted, case):
    """From 16 tokens a block's per-token work between the products (norms, rotary embedding, cache
    stores, the experts' weighted sums) is split over the threads: every architecture gives the
    same logits, bit for bit, on one thread and on two, for a prompt above and below that size."""
    one = colibri.load(converted(case), threads=1)
    two = colibri.load(converted(case), threads=2)
    for length in (40, 9):
        ids = (np.arange(length) * 7 + 3) % one.config.vocab_size
        np.testing.assert_array_equal(one.forward(ids), two.forward(ids), err_msg=f"{case}, {length} tokens")


def test_sliding_window_is_honoured(converted, tmp_path):
    """mixtral_b has sliding_window 8 < T. Without the window, positions < 8 are unchanged and
    later ones differ from transformers: so the match above really exercises the window."""
    ref = reference("mixtral_b")
    d = tmp_path / "m"
    shutil.copytree(converted("mixtral_b"), d)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model"]["sliding_window"] == 8 and len(ref["input_ids"]) > 8
    cfg["model"]["layer_types"] = ["full_attention"] * cfg["model"]["num_hidden_layers"]
    (d / "config.json").write_text(json.dumps(cfg))
    logits = colibri.load(d).forward(ref["input_ids"])
    scale = np.abs(ref["logits_f32"]).max()
    assert np.abs(logits[:8] - ref["logits_f32"][:8]).max() <= REL_TOL * scale
    assert np.abs(logits[8:] - ref["logits_f32"][8:]).max() > 100 * REL_TOL * scale


def test_sampling_is_seeded(models):
    m = models("mixtral_a")
    ids = reference("mixtral_a")["input_ids"][:10]
    kw = dict(max_new_tokens=10, temperature=1.5, top_k=20, top_p=0.95, stop_at_eos=False)
    a = list(m.generate(ids, seed=7, **kw))
    b = list(m.generate(ids, seed=7, **kw))
    c = list(m.generate(ids, seed=8, **kw))
    d = list(m.generate(ids, seed=9, **kw))
    assert a == b
    assert a != c or a != d
    assert all(0 <= t < m.config.vocab_size for t in a + c + d)


def test_top_k_one_is_greedy(models):
    m = models("olmoe_b")
    ids = reference("olmoe_b")["input_ids"]
    sampled = list(m.generate(ids, max_new_tokens=8, temperature=0.8, top_k=1, seed=3, stop_at_eos=False))
    assert sampled == reference("olmoe_b")["greedy_ids"][:8].tolist()


def test_generation_stops_at_eos(converted, tmp_path):
    ref = reference("qwen3moe_b")
    d = tmp_path / "m"
    shutil.copytree(converted("qwen3moe_b"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model"]["eos_token_id"] = [int(ref["greedy_ids"][3])]
    (d / "config.json").write_text(json.dumps(cfg))
    m = colibri.load(d)
    out = list(m.generate(ref["input_ids"], max_new_tokens=12))
    first = ref["greedy_ids"].tolist().index(int(ref["greedy_ids"][3]))
    assert out == ref["greedy_ids"][: first + 1].tolist()
    assert len(list(m.generate(ref["input_ids"], max_new_tokens=12, stop_at_eos=False))) == 12


def test_complete_uses_the_tokenizer(models):
    m = models("mixtral_a")
    text = m.complete("We hold these truths", max_new_tokens=5)
    assert isinstance(text, str)
    ids = m.tokenizer.encode("We hold these truths")  # a sentencepiece model adds BOS by default
    assert ids[0] == m.config.bos_token_id
    expected = m.tokenizer.decode(list(m.generate(ids, max_new_tokens=5)), skip_special_tokens=True)
    assert text == expected


@pytest.mark.parametrize("bad", [[], [[1, 2]], [1, 128], [-1], [1.5, 2.0], "abc"])
def test_bad_token_ids_are_clear_errors(models, bad):
    with pytest.raises(colibri.ColibriError):
        models("mixtral_a").forward(bad)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_new_tokens=0),
        dict(max_new_tokens=-3),
        dict(temperature=float("nan")),
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(top_p=float("inf")),
        dict(top_k=-1),
        dict(seed=-5),
        dict(max_new_tokens=10_000),
    ],
)
def test_bad_generation_parameters_are_clear_errors(models, kwargs):
    with pytest.raises(colibri.ColibriError):
        list(models("mixtral_a").generate([1, 2, 3], **{"max_new_tokens": 4, **kwargs}))


def test_context_length_is_enforced(converted):
    m = colibri.load(converted("mixtral_a"), n_ctx=16)
    assert m.forward(list(range(16))).shape == (16, 128)
    with pytest.raises(colibri.ColibriError, match="context"):
        m.forward(list(range(17)))
    with pytest.raises(colibri.ColibriError, match="context"):
        list(m.generate([1, 2, 3], max_new_tokens=14))
    with pytest.raises(colibri.ColibriError, match="n_ctx"):
        colibri.load(converted("mixtral_a"), n_ctx=10**9)


def test_one_generation_at_a_time(models):
    m = models("mixtral_a")
    first = m.generate([1, 2, 3], max_new_tokens=5, stop_at_eos=False)
    next(first)
    with pytest.raises(colibri.ColibriError, match="already generating"):
        m.forward([1, 2])
    errors = []
    t = threading.Thread(target=lambda: errors.append(_try(lambda: list(m.generate([4], max_new_tokens=2)))))
    t.start()
    t.join()
    assert isinstance(errors[0], colibri.ColibriError)
    assert len(list(first)) == 4  # the first generation is intact and finishes
    assert m.forward([1, 2]).shape == (2, 128)  # and the model is free again


def _try(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - returned for the assertion
        return e
    return None


def test_routing_and_counts_are_reported(models):
    m = models("qwen2moe_a")
    m.forward(reference("qwen2moe_a")["input_ids"][:5])
    counts = m.expert_counts
    k = m.config.num_experts_per_tok
    for layer, is_moe in enumerate(m.config.moe_layers):
        assert counts[layer].sum() == (5 * k if is_moe else 0)
    experts, weights = m.routing
    assert experts.shape == (m.config.num_hidden_layers, k)
    moe = [i for i, b in enumerate(m.config.moe_layers) if b]
    assert all(len(set(experts[i])) == k for i in moe)
    assert all(0 < w <= 1 for i in moe for w in weights[i])


@pytest.mark.parametrize("chunk", [None, 5, 1])
@pytest.mark.parametrize("dtype", ["f32", "bf16", "int8", "int4", "nl4"])
@pytest.mark.parametrize("case", CASES)
def test_batched_prefill_equals_token_by_token(converted, case, dtype, chunk):
    """A prompt in chunks (tokens grouped by expert, weights read once per chunk) computes every
    element with the same dot products and summation order as decoding it one token per call:
    identical logits."""
    ids = np.ascontiguousarray(reference(case)["input_ids"], np.int32)
    m = colibri.load(converted(case, dtype), prefill_chunk=chunk)
    batched = np.empty((len(ids), m.config.vocab_size), np.float32)
    stepped = np.empty_like(batched)
    assert m._engine.run(ids, 0, batched, True)[0] == 0
    for t in range(len(ids)):
        assert m._engine.run(ids[t : t + 1], t, stepped[t : t + 1], True)[0] == 0
    np.testing.assert_array_equal(batched, stepped)


@pytest.mark.parametrize("case", ["mixtral_a", "gemma4_a"])
def test_an_inner_chunk_without_logits_leaves_the_same_cache(converted, case):
    """Engine.run(..., None, ...) runs a prompt piece without the lm_head (what generate does for
    every chunk but the last): the next piece's logits are those of the whole prompt."""
    ids = np.ascontiguousarray(reference(case)["input_ids"], np.int32)
    m = colibri.load(converted(case, "int8"), prefill_chunk=4)
    whole = m.forward(ids)
    m._engine.reset()
    assert m._engine.run(ids[:9], 0, None, False)[0] == 0
    last = np.empty((1, m.config.vocab_size), np.float32)
    assert m._engine.run(ids[9:], 9, last, False)[0] == 0
    np.testing.assert_array_equal(last[0], whole[-1])


def test_without_a_simd_tier_no_reordered_input_is_allocated(converted, monkeypatch):
    """The bf16 tiles' reordered input (acts.xp: the AVX-512 rows tile's lanes, the AVX2
    interleaved prompt tile's pairs) is allocated only where a tier that reads it can run; without
    it the engine's scratch has none, and the AVX2 prompt tile shuffles the activation instead —
    the same logits bit for bit (a multi-token forward: the prompt tiles)."""
    before = _kernels.isa()
    ids = reference("mixtral_a")["input_ids"]
    assert len(ids) > 1
    try:
        _kernels.select_isa("avx2" if "avx2" in _kernels.available_isas() else "scalar")
        expected = colibri.load(converted("mixtral_a", "bf16")).forward(ids)
        monkeypatch.setattr(_kernels, "available_isas", lambda: ["scalar"])
        assert _kernels.act_arrays(4, 64)[_kernels.ACT_ARRAYS.index("xp")] is None
        np.testing.assert_array_equal(colibri.load(converted("mixtral_a", "bf16")).forward(ids), expected)
    finally:
        _kernels.select_isa(before)


# ---- the f16 KV cache (load(kv_cache="f16")) -------------------------------------------------

F16_KV_REL = 2e-2  # |Δlogit| / max|logit| against transformers (measured 5e-4 .. 8e-3 on these cases)


@pytest.mark.parametrize("case", ["mixtral_a", "qwen3moe_a", "gemma4_a", "gpt_oss_a", "deepseekv3_a"])
def test_an_f16_kv_cache_halves_it_and_stays_close(converted, case):
    """Keys and values rounded to f16 as they are stored (attention itself in f32): the cache's
    bytes halve, the logits stay within F16_KV_REL of transformers' with the same top-1 tokens
    (sliding windows, sinks, MLA's latent cache alike), and a prompt still equals decoding it."""
    ref = reference(case)
    ids = np.ascontiguousarray(ref["input_ids"], np.int32)
    full, half = colibri.load(converted(case, "f32")), colibri.load(converted(case, "f32"), kv_cache="f16")
    assert half.kv_cache_bytes * 2 == full.kv_cache_bytes
    logits = half.forward(ids)
    want = ref["logits_f32"]
    assert np.abs(logits - want).max() <= F16_KV_REL * np.abs(want).max()
    assert (logits.argmax(-1) == want.argmax(-1)).mean() >= 0.95
    batched = np.empty((len(ids), half.config.vocab_size), np.float32)
    stepped = np.empty_like(batched)
    half._engine.reset()
    assert half._engine.run(ids, 0, batched, True)[0] == 0
    half._engine.reset()
    for t in range(len(ids)):
        assert half._engine.run(ids[t : t + 1], t, stepped[t : t + 1], True)[0] == 0
    np.testing.assert_array_equal(batched, stepped)


@pytest.mark.parametrize("case", ["mixtral_a", "qwen3moe_a", "gemma4_a", "gpt_oss_a", "deepseekv3_a"])
def test_a_q8_kv_cache_is_a_quarter_and_a_prompt_still_equals_decoding_it(converted, case):
    """Keys and values stored as int8 codes with one f32 scale a row (a KV head at a position):
    every cache array is (head_dim + 4) bytes a row where f32's is 4 head_dim (MLA's latent rows
    alike), and a prompt still equals decoding it. (Its closeness is checked on the trained demo,
    tests/test_demo.py: these random-weight fixtures route on near-ties, so q8's 1 % logit error
    flips experts and says nothing; the kernels are held bit for bit to attention over the
    dequantized cache, tests/test_kernels.py.)"""
    ref = reference(case)
    ids = np.ascontiguousarray(ref["input_ids"], np.int32)
    full, q8 = colibri.load(converted(case, "f32")), colibri.load(converted(case, "f32"), kv_cache="q8")
    for f32_rows, q8_rows in zip(full._engine._kv_arrays(), q8._engine._kv_arrays(), strict=True):
        assert q8_rows.dtype == np.uint8 and q8_rows.shape == f32_rows.shape[:-1] + (f32_rows.shape[-1] + 4,)
    batched = np.empty((len(ids), q8.config.vocab_size), np.float32)
    stepped = np.empty_like(batched)
    q8._engine.reset()
    assert q8._engine.run(ids, 0, batched, True)[0] == 0
    assert np.isfinite(batched).all()
    q8._engine.reset()
    for t in range(len(ids)):
        assert q8._engine.run(ids[t : t + 1], t, stepped[t : t + 1], True)[0] == 0
    np.testing.assert_array_equal(batched, stepped)


def test_an_unknown_kv_cache_type_is_refused(converted):
    with pytest.raises(colibri.ColibriError, match="kv_cache must be one of f32, f16, q8"):
        colibri.load(converted("mixtral_a", "f32"), kv_cache="int8")


# ---- bf16 products (load(bf16_products=)) ----------------------------------------------------

# KL(transformers' bf16-weight logits || ours) with the activations rounded to bf16 at every bf16
# product: a bound with room over what every fixture gives (the rounding of the activations
# is the only difference from f32 products)
BF16_PRODUCTS_KL = 5e-3
HAS_BF16_PRODUCTS = _kernels.has_bf16_products()  # the tier the models load with (COLIBRI_ISA's, if set)


def _kl(want, got):
    def log_softmax(z):
        z = z.astype(np.float64) - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    lw, lg = log_softmax(want), log_softmax(got)
    return float((np.exp(lw) * (lw - lg)).sum(-1).mean())


def test_auto_bf16_products_follow_the_tier(converted):
    """ "auto" takes bf16 products exactly where the tier has vdpbf16ps; "f32" never; "bf16" where it
    has none is one clear error naming the choice."""
    before = _kernels.isa()
    try:
        for name in _kernels.available_isas():
            _kernels.select_isa(name)
            native = _kernels.has_bf16_products()
            assert colibri.load(converted("mixtral_a", "bf16")).bf16_products is native
            assert colibri.load(converted("mixtral_a", "bf16"), bf16_products="f32").bf16_products is False
            if not native:
                with pytest.raises(colibri.ColibriError, match="bf16_products='bf16' needs AVX512_BF16"):
                    colibri.load(converted("mixtral_a", "bf16"), bf16_products="bf16")
    finally:
        _kernels.select_isa(before)
    with pytest.raises(colibri.ColibriError, match="bf16_products must be one of auto, bf16, f32"):
        colibri.load(converted("mixtral_a", "bf16"), bf16_products="fast")


@pytest.mark.skipif(
    not HAS_BF16_PRODUCTS, reason="the tier in use has no AVX512_BF16: bf16 products run only where it does"
)
@pytest.mark.parametrize("case", CASES)
def test_bf16_products_stay_close_to_transformers(converted, case):
    """With the activations rounded to bf16 (vdpbf16ps) the logits move off the exact ones, within
    BF16_PRODUCTS_KL of transformers' (same bf16 weights), and a prompt still equals decoding it."""
    ref = reference(case)
    ids = np.ascontiguousarray(ref["input_ids"], np.int32)
    m = colibri.load(converted(case, "bf16"), bf16_products="bf16")
    logits = m.forward(ids)
    exact = colibri.load(converted(case, "bf16"), bf16_products="f32").forward(ids)
    assert np.abs(logits - exact).max() > 0  # they did take the other path
    assert _kl(ref["logits_bf16"], logits) <= BF16_PRODUCTS_KL
    m._engine.reset()
    stepped = np.empty_like(logits)
    for t in range(len(ids)):
        assert m._engine.run(ids[t : t + 1], t, stepped[t : t + 1], True)[0] == 0
    np.testing.assert_array_equal(stepped, logits)
