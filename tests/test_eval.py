"""`eval`: perplexity and divergence statistics, through the API and the CLI."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import colibri
from colibri.evaluate import chunks_of, evaluate, log_softmax

ENV = dict(os.environ, PYTHONPATH=str(Path(colibri.__file__).parent.parent))
TEXT = (
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, "
    "conceived in Liberty, and dedicated to the proposition that all men are created equal. "
) * 4


def test_chunks_replace_the_first_token_with_bos():
    assert chunks_of(list(range(10, 20)), 4, 1) == [[1, 11, 12, 13], [1, 15, 16, 17], [1, 19]]
    assert chunks_of(list(range(10, 15)), 4, None) == [[10, 11, 12, 13]]  # a 1-token tail is dropped


def test_perplexity_is_exp_of_the_mean_nll(converted):
    m = colibri.load(converted("mixtral_a"))
    r = evaluate(m, TEXT, ctx=32)
    ids = m.tokenizer.encode(TEXT, add_special_tokens=False)
    nll = []
    for chunk in chunks_of(ids, 32, m.config.bos_token_id):
        lp = log_softmax(m.forward(chunk))
        nll += [-lp[i, chunk[i + 1]] for i in range(len(chunk) - 1)]
    assert r["scored"] == len(nll)
    assert math.isclose(r["perplexity"], math.exp(np.mean(nll)), rel_tol=1e-9)


def test_against_itself_kl_is_zero_and_quantized_is_not(converted):
    f32 = colibri.load(converted("mixtral_a"))
    same = evaluate(f32, TEXT, ctx=64, reference=colibri.load(converted("mixtral_a")))
    assert same["kl_mean"] == 0 and same["top1_agreement"] == 1 and same["rms_delta_p"] == 0
    q = evaluate(colibri.load(converted("mixtral_a", "int4")), TEXT, ctx=64, reference=f32)
    assert q["kl_mean"] > 0 and q["kl_p99"] >= q["kl_median"] >= 0 and 0 < q["top1_agreement"] <= 1


def test_eval_cli(converted, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    d = str(converted("mixtral_a"))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "colibri",
            "eval",
            "--model-dir",
            d,
            "--text",
            str(text),
            "--reference-dir",
            d,
            "--ctx",
            "64",
            "--json",
        ],
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["kl_mean"] == 0 and out["perplexity"] > 1
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "eval", "--model-dir", d, "--text", str(text)],
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and "perplexity:" in r.stdout


@pytest.mark.parametrize(
    "args, named",
    [
        (["--text", "/nonexistent.txt"], "/nonexistent.txt"),
        (["--ctx", "1"], "--ctx"),
    ],
)
def test_eval_errors_are_one_line(converted, tmp_path, args, named):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    full = ["--model-dir", str(converted("mixtral_a")), "--text", str(text)] + args
    r = subprocess.run([sys.executable, "-m", "colibri", "eval", *full], env=ENV, capture_output=True, text=True)
    assert r.returncode == 2 and named in r.stderr and r.stderr.strip().count("\n") == 0


def test_eval_needs_a_tokenizer(converted, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "eval", "--model-dir", str(converted("olmoe_a")), "--text", str(text)],
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "tokenizer" in r.stderr


@pytest.mark.parametrize("case, dtype", [("gpt_oss_b", "mxfp4"), ("deepseekv3_b", "int8")])
def test_eval_takes_the_new_families(tmp_path, case, dtype):
    """gpt-oss (mxfp4) and DeepSeek-V3 (MLA) through eval, against their f32 conversion: the
    checkpoint with a small BPE tokenizer.json beside it, converted twice."""
    import shutil
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from colibri.convert import convert

    hf = tmp_path / "hf"
    shutil.copytree(Path(__file__).parent / "fixtures" / case / "hf", hf)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    tok.save(str(hf / "tokenizer.json"))
    for fmt in ("f32", dtype):
        convert(hf, tmp_path / fmt, quantize=fmt, log=lambda *a: None)
    r = evaluate(colibri.load(tmp_path / dtype), TEXT, ctx=32, reference=colibri.load(tmp_path / "f32"))
    assert r["scored"] > 50 and math.isfinite(r["perplexity"]) and r["perplexity"] > 1
    assert 0 < r["kl_mean"] < 0.05 and r["top1_agreement"] >= 0.8
