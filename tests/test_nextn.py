"""Multi-token-prediction (MTP) blocks: DeepSeek-V3's and GLM-4.5's next-token layer kept by convert,
run against transformers' own layer classes (tools/make_mtp_fixtures.py), and drafting for
speculative decoding without changing a token."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import colibri
from colibri import nextn
from colibri.convert import convert

FIXTURES = Path(__file__).parent / "fixtures"
MTP_CASES = ("deepseekv3_mtp", "glm4moe_mtp")
# the block's logits against transformers' (f32 weights): the main model's own tolerance
LOGITS_RTOL = 1e-4


@pytest.fixture(scope="module", params=MTP_CASES)
def mtp_model(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "m"
    lines = []
    convert(FIXTURES / request.param / "hf", out, log=lines.append)
    m = colibri.load(out)
    yield request.param, m, lines
    m.close()


def _reference(case):
    return np.load(FIXTURES / case / "mtp_reference.npz")


def test_convert_keeps_the_block_as_a_one_layer_directory(mtp_model):
    case, m, lines = mtp_model
    assert any(f"multi-token-prediction layer 3 kept in {nextn.NEXTN_DIR}/" in line for line in lines)
    block = json.loads((Path(m.path) / nextn.NEXTN_DIR / "config.json").read_text())["model"]
    assert block["nextn_block"] is True and block["num_hidden_layers"] == 1 and block["moe_layers"] == [True]
    assert m.has_nextn
    assert not (Path(m.path) / nextn.NEXTN_DIR / "embedding.bin").exists()  # the main model's serves it


def test_the_block_computes_what_transformers_layers_compute(mtp_model):
    case, m, _ = mtp_model
    ref = _reference(case)
    ids = ref["input_ids"].astype(np.int32)
    T, d, V = len(ids), m.config.hidden_size, m.config.vocab_size
    hidden, logits = np.empty((T, d), np.float32), np.empty((T, V), np.float32)
    assert m._engine.run(ids, 0, logits, True, 0, None, hidden)[0] == 0
    scale = np.abs(ref["hidden_f32"]).max()
    assert np.abs(hidden - ref["hidden_f32"]).max() <= LOGITS_RTOL * scale
    block = m._nextn_block()
    drafts = np.empty((T - 1, V), np.float32)
    assert block.engine.run(ids[1:], 0, drafts, True, 0, hidden[:-1].copy(), None)[0] == 0
    want = ref["mtp_logits_f32"]
    assert np.abs(drafts - want).max() <= LOGITS_RTOL * np.abs(want).max()


def test_hidden_states_leave_the_logits_unchanged(mtp_model):
    case, m, _ = mtp_model
    ids = _reference(case)["input_ids"].astype(np.int32)
    T, d, V = len(ids), m.config.hidden_size, m.config.vocab_size
    for all_logits in (True, False):
        plain, with_hidden = np.empty((T, V), np.float32), np.empty((T, V), np.float32)
        m._engine.run(ids, 0, plain, all_logits, 0)
        m._engine.run(ids, 0, with_hidden, all_logits, 0, None, np.empty((T, d), np.float32))
        rows = T if all_logits else 1
        assert np.array_equal(plain[:rows], with_hidden[:rows])


@pytest.mark.parametrize("draft, draft_max", [("mtp", 1), ("mtp", 3), ("mtp", 8), ("auto", 4)])
def test_greedy_tokens_with_block_drafts_are_plain_decodings(mtp_model, draft, draft_max):
    case, m, _ = mtp_model
    ids = _reference(case)["input_ids"].astype(np.int32)
    plain = list(m.generate(ids, max_new_tokens=30, draft="none"))
    assert list(m.generate(ids, max_new_tokens=30, draft=draft, draft_max=draft_max)) == plain
    assert m.last_generation.speculation.drafted > 0


@pytest.mark.parametrize("seed", range(4))
def test_sampled_tokens_with_block_drafts_are_plain_decodings(mtp_model, seed):
    case, m, _ = mtp_model
    ids = _reference(case)["input_ids"].astype(np.int32)
    kw = dict(max_new_tokens=24, temperature=0.8, top_p=0.95, seed=seed)
    assert list(m.generate(ids, draft="mtp", draft_max=4, **kw)) == list(m.generate(ids, draft="none", **kw))


def test_accepted_drafts_and_rollbacks_keep_the_block_exact(mtp_model):
    """A prediction that is right for 12 tokens, then wrong, then right again: drafts accepted in
    runs and refused, the block fed several positions a call and rolled back; the tokens stay
    plain decoding's and the block's last logits are those of one run over the whole sequence."""
    case, m, _ = mtp_model
    ids = _reference(case)["input_ids"].astype(np.int32)
    plain = list(m.generate(ids, max_new_tokens=30, draft="none"))
    prediction = plain[:12] + [(t + 1) % m.config.vocab_size for t in plain[12:16]] + plain[16:]
    assert list(m.generate(ids, max_new_tokens=30, draft="auto", prediction=prediction)) == plain
    stats = m.last_generation.speculation
    assert 0 < stats.accepted < stats.drafted


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(1, 9), min_size=1, max_size=8), chains=st.lists(st.integers(0, 4), max_size=8))
def test_the_block_fed_in_any_pieces_gives_one_runs_logits(mtp_model, cuts, chains):
    """NextnDrafter fed the main model's hidden states in pieces, with proposals between them (which
    run the block on its own guesses past the main model's positions: overwritten by the next
    feed), has after each piece the logits of one run of the block over every position, bit for bit."""
    case, m, _ = mtp_model
    ids = [int(t) for t in _reference(case)["input_ids"]]
    T, d, V = len(ids), m.config.hidden_size, m.config.vocab_size
    hidden = np.empty((T, d), np.float32)
    m._engine.run(np.array(ids, np.int32), 0, np.empty((1, V), np.float32), False, 0, None, hidden)
    block = m._nextn_block()
    want = np.empty((T - 1, V), np.float32)
    block.engine.run(np.array(ids[1:], np.int32), 0, want, True, 0, hidden[:-1].copy(), None)
    context = ids[:1]
    drafter = nextn.NextnDrafter(block, context, 0)
    pos = 0
    for i, cut in enumerate(cuts):
        end = min(T - 1, pos + cut)
        context[:] = ids[: end + 1]
        drafter.feed(pos, hidden[pos:end])
        pos = end
        assert drafter.done == pos
        assert np.array_equal(drafter.logits[0], want[pos - 1])
        draft = drafter.propose(chains[i] if i < len(chains) else 1)
        assert draft[:1] == ([int(np.argmax(want[pos - 1]))] if draft else [])
        if pos == T - 1:
            break


def test_draft_mtp_needs_a_block_and_one_sequence(mtp_model, converted):
    case, m, _ = mtp_model
    with pytest.raises(colibri.ColibriError, match="parallel 1"):
        m._drafter([1, 2], "mtp", None, None, type("R", (), {})(), batched=True)
    other = colibri.load(converted("mixtral_a"))
    with pytest.raises(colibri.ColibriError, match="has none"):
        list(other.generate([1, 2, 3], max_new_tokens=2, draft="mtp"))
    other.close()


def test_an_incomplete_or_foreign_block_is_not_kept(tmp_path):
    """A layer whose head is not the main model's lm_head is left out with a note: the model
    converts without it."""
    from colibri.hfcheckpoint import HFCheckpoint
    from conftest import write_safetensors

    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / "deepseekv3_mtp" / "hf", hf)
    ckpt = HFCheckpoint(hf)
    tensors = {name: ckpt.f32(name) for name in ckpt.names()}
    tensors["model.layers.3.shared_head.head.weight"] = tensors["model.layers.3.shared_head.head.weight"] * 2
    write_safetensors(hf / "model.safetensors", tensors)
    lines = []
    convert(hf, tmp_path / "m", log=lines.append)
    assert any("is not kept (its shared_head.head is not the main model's lm_head)" in line for line in lines)
    assert not nextn.has_block(tmp_path / "m")


def test_serve_refuses_mtp_drafts_for_several_sequences_at_start():
    import subprocess
    import sys

    from conftest import ENV

    r = subprocess.run(
        [sys.executable, "-m", "colibri", "serve", "--draft", "mtp", "--parallel", "2"],
        env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: --draft mtp drafts for one sequence at a time")
