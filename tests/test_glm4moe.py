"""GLM-4.5 (and the sigmoid router it shares with DeepSeek-V3): what test_models.py does not cover.

test_models.py holds both GLM-4.5 cases (tools/make_fixtures.py) to transformers' f32, bf16 and
f16 logits, greedy tokens and decode == forward: partial rotary embeddings, q/k norms, attention
biases, shared experts, a dense first layer, the grouped sigmoid router with its correction bias.
Here: the int8 / int4 paths against transformers on the very weights those formats store, and
that the correction bias of the GLM and DeepSeek fixtures really changes expert choices while
never weighing them (the expert budget and the memory limit: test_memcap.py).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import colibri
from colibri.modeldir import ModelDir
from conftest import FIXTURES, kl_mean, reference

REL_TOL = 1e-4  # float32 rounding only (as test_models.py)
# against transformers on exactly the weights the format stores: what is left is the per-block
# int8 rounding of the activations (test_gpt_oss.py's and test_gemma4.py's bound). glm4moe_a
# measures int8 4.6e-4, int4 4.8e-4; glm4moe_b int8 7.4e-5, int4 8.5e-5. glm4moe_a was drawn
# (tools/make_fixtures.py, no_activation_flips) so that rounding the input of every matrix product
# but the router's as Colibri rounds it (blocks of 32, d = amax / 127; the routed experts' too)
# flips no expert choice: transformers so rounded matches Colibri to KL 5e-14 / 6e-14.
KL_SAME_WEIGHTS_MAX = 1e-3


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("case", ["glm4moe_a", "glm4moe_b"])
def test_quantized_paths_against_transformers_on_the_same_weights(converted, case, dtype):
    ref = reference(case)
    logits = colibri.load(converted(case, dtype)).forward(ref["input_ids"])
    assert kl_mean(ref[f"logits_{dtype}w"], logits) <= KL_SAME_WEIGHTS_MAX


# ---- the correction bias: it chooses, it never weighs -------------------------------------------


def _routing_per_token(model_dir, ids):
    """The engine's choice and weights for every token of `ids` and every layer, one token a
    step: (experts int [T, layers, k], weights float [T, layers, k]), and the model's logits."""
    m = colibri.load(model_dir)
    x = np.ascontiguousarray(ids, np.int32)
    logits = np.empty((len(x), m.config.vocab_size), np.float32)
    experts, weights = [], []
    for t in range(len(x)):
        assert m._engine.run(x[t : t + 1], t, logits[t : t + 1], True)[0] == 0
        e, w = m.routing
        experts.append(e)
        weights.append(w)
    m.close()
    return np.stack(experts), np.stack(weights), logits


def _unbiased_weights(router_logits, experts, hf):
    """transformers' Glm4MoeTopkRouter / DeepseekV3TopkRouter weights of the chosen experts:
    sigmoid scores without the bias, renormalised (norm_topk_prob), times routed_scaling_factor."""
    s = 1.0 / (1.0 + np.exp(-router_logits.astype(np.float64)))
    w = np.take_along_axis(s, experts.astype(np.int64), axis=-1)
    if hf["norm_topk_prob"]:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * hf["routed_scaling_factor"]


@pytest.mark.parametrize("case", ["glm4moe_a", "glm4moe_b", "deepseekv3_a", "deepseekv3_b"])
def test_the_correction_bias_changes_choices_and_never_weighs(converted, tmp_path, case):
    """The fixture's model, and a copy with every router_bias zeroed. In the first MoE layer
    (the same router input in both: only the bias differs) the chosen experts differ for at
    least one token; in both models every weight is transformers' unbiased sigmoid score of
    the chosen expert (router logits recorded by make_fixtures.py); in the fixture's model that
    holds in every MoE layer; and without the bias the logits are no longer transformers'."""
    hf = json.loads((FIXTURES / case / "hf" / "config.json").read_text())
    ref = reference(case)
    d = tmp_path / "m"
    shutil.copytree(converted(case), d)
    md = ModelDir(d)
    moe = [layer for layer, is_moe in enumerate(md.config.moe_layers) if is_moe]
    assert moe == ref["moe_layers"].tolist()
    biased_experts, biased_weights, biased_logits = _routing_per_token(d, ref["input_ids"])
    for layer in moe:
        t = md.tensors[f"layers.{layer}.router_bias"]
        assert t["dtype"] == "f32" and t["shape"] == [hf["n_routed_experts"]]
        with open(d / t["file"], "r+b") as f:
            f.seek(t["offset"])
            assert np.abs(np.frombuffer(f.read(t["nbytes"]), np.float32)).max() > 0  # the fixture's bias
            f.seek(t["offset"])
            f.write(np.zeros(t["shape"], np.float32).tobytes())
    plain_experts, plain_weights, plain_logits = _routing_per_token(d, ref["input_ids"])

    first = moe[0]
    changed = [
        tok for tok in range(len(ref["input_ids"])) if set(biased_experts[tok, first]) != set(plain_experts[tok, first])
    ]
    assert changed, f"{case}: the correction bias changes no expert choice of layer {first}"
    for experts, weights, layers in ((biased_experts, biased_weights, moe), (plain_experts, plain_weights, [first])):
        for layer in layers:
            want = _unbiased_weights(ref["router_logits_f32"][moe.index(layer)], experts[:, layer], hf)
            np.testing.assert_allclose(weights[:, layer], want, rtol=REL_TOL, atol=REL_TOL * np.abs(want).max())
    scale = np.abs(ref["logits_f32"]).max()
    assert np.abs(biased_logits - ref["logits_f32"]).max() <= REL_TOL * scale
    assert np.abs(plain_logits - ref["logits_f32"]).max() > 100 * REL_TOL * scale
