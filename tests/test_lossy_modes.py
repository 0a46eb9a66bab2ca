"""The lossy modes that read fewer bytes under an expert budget, each opt-in:
load(skip_missed=F), a decoded token leaves out light chosen experts the cache does not hold;
load(cache_routing=lambda), a decoded token's router favours the experts the cache holds.
Off by default; with one, deterministic for a fixed cap, text and seed; no effect without a budget;
the chosen experts keep the router's own weights (a vanishing lambda gives the exact tokens on
every router: softmax, softmax over the chosen, sigmoid with groups, logit bias, per-expert scale)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import colibri
from conftest import ENV

DEMO = str(Path(__file__).resolve().parents[1] / "colibri" / "data" / "demo")
BUDGET_MB = 3  # the demo's experts take ~9 MB: a third of them fit


@pytest.fixture(scope="module")
def prompt():
    m = colibri.load(DEMO)
    ids = m.encode("And God said, Let there be light")
    plain = list(m.generate(ids, 32))
    m.close()
    return ids, plain


def _run(ids, n=32, **kw):
    m = colibri.load(DEMO, **kw)
    try:
        tokens = list(m.generate(ids, n))
        return tokens, m.memory_stats(), m
    finally:
        m.close()


def test_off_by_default_and_exact_under_the_same_budget(prompt):
    ids, plain = prompt
    tokens, stats, m = _run(ids, expert_cache_mb=BUDGET_MB)
    assert m.skip_missed is None and stats["experts_skipped"] == 0 and tokens == plain


@pytest.mark.parametrize("F", [0.25, 0.6, 1.0])
def test_the_same_cap_text_and_seed_skip_the_same_experts(prompt, F):
    ids, _ = prompt
    a, stats_a, m = _run(ids, expert_cache_mb=BUDGET_MB, skip_missed=F)
    b, stats_b, _ = _run(ids, expert_cache_mb=BUDGET_MB, skip_missed=F)
    assert a == b and stats_a["experts_skipped"] == stats_b["experts_skipped"]
    k, layers = m.config.num_experts_per_tok, sum(m.config.moe_layers)
    assert stats_a["experts_skipped"] <= (k - 1) * layers * 32  # never a token's heaviest expert


def test_every_missed_light_expert_goes_at_F_1_on_top_2(prompt):
    """top-2: the lighter expert weighs under half of the two, below 1 / 2 at F = 1, so skipping
    leaves out some uses, more than at a small F (where few weigh that little)."""
    ids, _ = prompt
    _, few, _ = _run(ids, expert_cache_mb=BUDGET_MB, skip_missed=0.1)
    _, many, _ = _run(ids, expert_cache_mb=BUDGET_MB, skip_missed=1.0)
    assert many["experts_skipped"] > few["experts_skipped"] >= 0 and many["experts_skipped"] > 0


def test_no_budget_no_skips(prompt):
    ids, plain = prompt
    tokens, stats, _ = _run(ids, skip_missed=1.0)
    assert stats["experts_skipped"] == 0 and tokens == plain


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, True, "0.5", float("nan")])
def test_bad_values_are_one_clear_error(bad):
    with pytest.raises(colibri.ColibriError, match="skip_missed must be a number in"):
        colibri.load(DEMO, skip_missed=bad)


def test_one_token_steps_give_the_chunked_logits_bit_for_bit(prompt):
    ids, _ = prompt
    m = colibri.load(DEMO)
    assert np.array_equal(m.forward(ids), m.forward(ids, one_token_steps=True))
    m.close()


def test_the_command_line_counts_the_skipped_uses():
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "run", "--model-dir", DEMO, "--prompt", "And God said",
         "--max-new-tokens", "16", "--expert-cache-mb", str(BUDGET_MB), "--skip-missed", "1", "--stats"],
        env=ENV, capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "--skip-missed 1.0:" in r.stderr and "expert uses left out (lossy)" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "run", "--model-dir", DEMO, "--prompt", "And God said",
         "--max-new-tokens", "16", "--expert-cache-mb", str(BUDGET_MB), "--cache-routing", "0.5", "--stats"],
        env=ENV, capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "--cache-routing 0.5:" in r.stderr and "expert choices changed (lossy)" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "run", "--model-dir", DEMO, "--prompt", "x", "--skip-missed", "2"],
        env=ENV, capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode != 0 and "skip_missed must be a number in (0, 1], got 2.0" in r.stderr
    assert "Traceback" not in r.stderr


# every router kind among the fixtures: softmax over all (olmoe), over the chosen (qwen3moe),
# sigmoid with groups and a correction bias (deepseekv3, glm4moe), a logit bias (gpt_oss), a
# per-expert scale (gemma4)
ROUTERS = ("olmoe_a", "qwen3moe_a", "deepseekv3_a", "glm4moe_a", "gpt_oss_a", "gemma4_a")
FIXTURE_BUDGET_MB = 0.15  # a handful of the fixtures' f32 experts


@pytest.mark.parametrize("case", ROUTERS)
def test_cache_routing_keeps_the_router_s_weights(converted, case):
    """A vanishing lambda changes no choice, and the weights recomputed for the chosen experts are
    the router's: the tokens are the exact run's. lambda 1 then changes choices toward the cache."""
    path = converted(case)
    ids = [1, 5, 9, 20, 33]
    m = colibri.load(path)
    exact = list(m.generate(ids, 20, stop_at_eos=False))
    m.close()
    m = colibri.load(path, expert_cache_mb=FIXTURE_BUDGET_MB, cache_routing=1e-7)
    assert list(m.generate(ids, 20, stop_at_eos=False)) == exact
    assert m.memory_stats()["experts_rerouted"] == 0
    m.close()
    m = colibri.load(path, expert_cache_mb=FIXTURE_BUDGET_MB, cache_routing=1.0)
    list(m.generate(ids, 20, stop_at_eos=False))
    assert m.memory_stats()["experts_rerouted"] > 0
    m.close()


def test_cache_routing_reads_fewer_experts_deterministically(prompt):
    ids, plain = prompt
    _, exact, _ = _run(ids, expert_cache_mb=BUDGET_MB)
    a, stats_a, _ = _run(ids, expert_cache_mb=BUDGET_MB, cache_routing=0.5)
    b, stats_b, _ = _run(ids, expert_cache_mb=BUDGET_MB, cache_routing=0.5)
    assert a == b and stats_a["experts_rerouted"] == stats_b["experts_rerouted"] > 0
    assert stats_a["cache_misses"] < exact["cache_misses"]
    tokens, stats, _ = _run(ids, cache_routing=1.0)  # no budget: every expert is held, nothing changes
    assert tokens == plain and stats["experts_rerouted"] == 0


@pytest.mark.parametrize("bad", [0, -1, 1.01, False, "0.5"])
def test_bad_cache_routing_values_are_one_clear_error(bad):
    with pytest.raises(colibri.ColibriError, match="cache_routing must be a number in"):
        colibri.load(DEMO, cache_routing=bad)
