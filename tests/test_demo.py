"""The bundled demo model (int8, colibri/data/demo) against the transformers reference
recorded at training time, and `run` / `eval` out of the box."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import colibri
import colibri.modeldir
from colibri.cli import DEMO_DIR
from colibri.evaluate import evaluate, log_softmax

FIXTURE = Path(__file__).parent / "fixtures" / "demo"
ENV = dict(os.environ, PYTHONPATH=str(Path(colibri.__file__).parent.parent))
# int8 against f32, per position: KL of the next-token distribution (llama.cpp's q8_0 is about
# 1e-3 on real models; measured here: mean 1.3e-4, max 5.6e-4)
KL_MEAN_MAX = 1e-3
KL_POS_MAX = 5e-3
# perplexity of the int8 demo on tests/fixtures/demo/heldout_head.txt, ctx 256: measured 23.14
PERPLEXITY_MAX = 25.0


@pytest.fixture(scope="module")
def demo():
    return colibri.load(DEMO_DIR)


@pytest.fixture(scope="module")
def ref():
    with np.load(FIXTURE / "reference.npz") as z:
        return {k: z[k] for k in z.files}


def test_demo_is_bundled_small_and_int8():
    md = colibri.modeldir.ModelDir(DEMO_DIR)
    assert md.weight_dtype == "int8" and "tokenizer.model" in md.files
    assert sum(f["size"] for f in md.files.values()) <= 20e6
    assert md.verify() == []


def test_demo_logits_match_transformers(demo, ref):
    kl_all = []
    for i, ids in enumerate(ref["input_ids"]):
        logits = demo.forward(ids)
        p = log_softmax(ref["logits_f32_as_f16"][i].astype(np.float32))
        q = log_softmax(logits)
        kl = (np.exp(p) * (p - q)).sum(-1)
        kl_all.append(kl)
        assert (logits.argmax(-1) == ref["logits_f32_as_f16"][i].argmax(-1)).all()
        # the exact f32 logits at two positions
        for j, pos in enumerate(ref["positions"]):
            exact = ref["logits_f32_at"][i, j]
            assert np.abs(logits[pos] - exact).max() <= 0.05 * np.abs(exact).max()
    kl_all = np.concatenate(kl_all)
    assert kl_all.mean() <= KL_MEAN_MAX and kl_all.max() <= KL_POS_MAX


def test_demo_greedy_follows_transformers(demo, ref):
    """int8 follows the f32 greedy path until the first near-tie (the smallest top-2 gap on these
    paths is 0.017): two of the three sequences all the way, all of them for 6 tokens."""
    full = 0
    for ids, expected in zip(ref["input_ids"], ref["greedy_ids"]):
        out = list(demo.generate(ids, max_new_tokens=16, stop_at_eos=False))
        assert out[:6] == expected[:6].tolist()
        full += out == expected.tolist()
    assert full >= 2


def test_demo_perplexity_on_heldout_text(demo):
    r = evaluate(demo, (FIXTURE / "heldout_head.txt").read_text(), ctx=256)
    assert r["scored"] > 4000 and r["perplexity"] <= PERPLEXITY_MAX


def test_a_q8_kv_cache_keeps_the_demos_distributions(demo, ref):
    """kv_cache="q8" (int8 keys and values, a scale a row; attention on the codes: the query
    quantized alike, int16 value weights) against the f32 cache on trained routing and real text:
    per-position KL within the bars the int8 weights meet (measured: mean 1.25e-4, max 6.4e-4),
    held-out perplexity within 1 % (measured 23.130 against 23.143)."""
    q8 = colibri.load(DEMO_DIR, kv_cache="q8")
    kl_all = []
    for ids in ref["input_ids"]:
        p, q = log_softmax(demo.forward(ids)), log_softmax(q8.forward(ids))
        kl_all.append((np.exp(p) * (p - q)).sum(-1))
    kl_all = np.concatenate(kl_all)
    assert kl_all.mean() <= KL_MEAN_MAX and kl_all.max() <= KL_POS_MAX
    text = (FIXTURE / "heldout_head.txt").read_text()
    full, quarter = evaluate(demo, text, ctx=256), evaluate(q8, text, ctx=256)
    assert abs(quarter["perplexity"] / full["perplexity"] - 1) <= 0.01


def test_run_without_model_dir_uses_the_demo_and_prints_english(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "run", "--prompt", "And the LORD said unto Moses", "--max-new-tokens", "24"],
        env=ENV,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "the bundled demo model" in r.stderr
    assert "[INFO]" not in r.stdout  # the text alone on stdout
    text = r.stdout
    words = text.split()
    assert len(words) >= 10
    common = {"the", "and", "of", "unto", "LORD", "to", "that", "in", "shall"}
    assert sum(w.strip(",.;:") in common for w in words) >= 3


def test_eval_against_itself(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text((FIXTURE / "heldout_head.txt").read_text()[:3000])
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "colibri",
            "eval",
            "--model-dir",
            str(DEMO_DIR),
            "--text",
            str(text),
            "--reference-dir",
            str(DEMO_DIR),
            "--ctx",
            "128",
        ],
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "mean 0.000000" in r.stdout and "100.00 %" in r.stdout


# ---- the demo chats ----------------------------------------------------------------------------

COMMON = {"the", "and", "of", "unto", "LORD", "to", "that", "in", "shall", "I", "he", "said", "is", "thou", "me"}


def _english(text: str, at_least: int = 3) -> bool:
    words = [w.strip(",.;:?!") for w in text.split()]
    return len(words) >= 8 and sum(w in COMMON for w in words) >= at_least


def test_demo_template_is_train_demos():
    """tools/train_demo.py writes the template into the checkpoint it saves (so a rebuild keeps it):
    the bundled file is that text, and the file table lists it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "train_demo", Path(__file__).parent.parent / "tools" / "train_demo.py"
    )
    train_demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_demo)
    assert (DEMO_DIR / "chat_template.jinja").read_text(encoding="utf-8") == train_demo.CHAT_TEMPLATE
    assert "chat_template.jinja" in colibri.modeldir.ModelDir(DEMO_DIR).files


def test_demo_template_frames_a_conversation_as_its_text(demo):
    """Every role renders (developer as a passage, tool as a plain line, list content by its text
    parts) and the generation prompt is the Bible's "And he answered and said,"."""
    messages = [
        {"role": "system", "content": "In the beginning God created the heaven and the earth"},
        {"role": "developer", "content": "Speak plainly."},
        {"role": "user", "content": "Who made the sea"},
        {"role": "assistant", "content": "The LORD made it."},
        {"role": "tool", "content": "a result"},
        {"role": "user", "content": [{"type": "text", "text": "And the dry land?"}, {"type": "image"}]},
    ]
    text = demo.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<s>In the beginning God created the heaven and the earth.\n"
        "Speak plainly.\n"
        "And one came and asked him, saying, Who made the sea.\n"
        "And he answered and said, The LORD made it.\n"
        "a result.\n"
        "And he asked him again, saying, And the dry land?\n"
        "And he answered and said,"
    )
    assert (
        demo.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        == text[: -len("\nAnd he answered and said,")]
    )
    ids = demo.apply_chat_template(messages[2:3])
    assert ids[0] == 1 and 3 not in ids  # BOS, then pieces it knows (3: <unk>, tools/train_demo.py)
    assert (
        demo.tokenizer.decode(ids, skip_special_tokens=True)
        == "And one came and asked him, saying, Who made the sea. And he answered and said,"
    )


def test_demo_replies_are_its_text(demo):
    reply = demo.chat([{"role": "user", "content": "Who made the heaven and the earth?"}], max_new_tokens=32)
    assert _english(reply), reply


def test_chat_on_the_demo_without_model_dir(tmp_path):
    """`python -m colibri chat` with no --model-dir, two turns piped in: two replies of English."""
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "chat", "--max-new-tokens", "24"],
        env=ENV,
        cwd=tmp_path,
        input="Who made the heaven and the earth?\nWhat shall I do?\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "error" not in r.stderr and "Traceback" not in r.stderr
    assert "Loaded the bundled demo model" in r.stderr
    replies = r.stdout.splitlines()
    assert len(replies) == 2 and all(_english(t, 2) for t in replies), r.stdout


def test_run_chat_on_the_demo(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "colibri",
            "run",
            "--chat",
            "--system",
            "In the beginning God created the heaven and the earth.",
            "--prompt",
            "Who made the heaven and the earth?",
            "--max-new-tokens",
            "24",
        ],
        env=ENV,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert _english(r.stdout, 2), r.stdout
