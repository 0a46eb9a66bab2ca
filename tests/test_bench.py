"""Smoke tests of the benchmarks: `python -m colibri bench` and the comparison harness on a tiny
model (Colibri only: llama.cpp is built by hand for the real runs)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import colibri

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(Path(colibri.__file__).parent.parent))


def test_colibri_bench_json(converted):
    r = subprocess.run([sys.executable, "-m", "colibri", "bench", "--model-dir", str(converted("mixtral_a", "int8")),
                        "--prompt-len", "16", "--gen", "8", "--repeat", "2", "--threads", "1", "--json"],
                       env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("prefill_tok_s", "decode_tok_s", "ttft_ms"):
        assert out[key]["min"] <= out[key]["median"] <= out[key]["max"] and out[key]["median"] > 0
    assert out["peak_rss_bytes"] > 0 and out["load_seconds"] > 0
    for p50, p99, ratio in zip(*(out[k]["values"] for k in ("decode_p50_ms", "decode_p99_ms", "decode_p99_over_p50"))):
        assert ratio >= 1 and abs(ratio - p99 / p50) <= 1e-9 * ratio       # the smoothness figure


def test_colibri_bench_table_and_errors(converted):
    r = subprocess.run([sys.executable, "-m", "colibri", "bench", "--model-dir", str(converted("mixtral_a")),
                        "--prompt-len", "8", "--gen", "4", "--repeat", "1"], env=ENV, capture_output=True, text=True)
    assert r.returncode == 0 and "decode" in r.stdout and "prefill" in r.stdout
    r = subprocess.run([sys.executable, "-m", "colibri", "bench", "--model-dir", "/nonexistent"],
                       env=ENV, capture_output=True, text=True)
    assert r.returncode == 2 and "/nonexistent" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(shutil.which("gcc") is None, reason="the bandwidth probe is compiled with gcc")
def test_harness_runs_and_writes_the_table(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "tools" / "bench" / "run_bench.py"), "--tiny", "--reps", "1",
                        "--prompt-len", "16", "--gen", "8", "--bw-mib", "64", "--threads", "1",
                        "--results-dir", str(tmp_path)], env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    tables = list(tmp_path.glob("*.md"))
    assert len(tables) == 1
    text = tables[0].read_text()
    assert "| engine | format |" in text and "colibri" in text and "GB/s" in text
    assert list(tmp_path.glob("*.json"))


def test_make_models_writes_the_frozen_shapes_without_transformers(monkeypatch):
    """The lent device machine has no transformers: make_models.py takes the shape from its frozen
    config.json (the files transformers wrote, written back verbatim: md5-compared with the
    transformers-written checkpoints when they were frozen, BENCHMARKS.md) and lists the tensors of
    the shape MODELS names — a frozen file and MODELS that drift apart fail here."""
    monkeypatch.setitem(sys.modules, "transformers", None)        # import transformers -> ImportError
    monkeypatch.syspath_prepend(str(REPO / "tools" / "bench"))
    import make_models
    for name, experts, width in (("mixtral-mini", 8, 3584), ("qwen3-moe-4l", 128, 768), ("olmoe-1b-7b-8l", 64, 1024)):
        cfg = make_models.config_for(name)
        text = (REPO / "tools" / "bench" / "configs" / f"{name}.json").read_text()
        assert cfg.num_experts == experts
        want = make_models.MODELS[name][2]
        assert all(getattr(cfg, k) == v for k, v in want.items() if k not in ("rope_parameters",)), name
        tensors = make_models.tensor_list(cfg)
        layers = want["num_hidden_layers"]
        gates = [s for n, s, _ in tensors if n.endswith((".w1.weight", ".gate_proj.weight"))]
        assert len(gates) == layers * experts and set(gates) == {(width, want["hidden_size"])}
        assert tensors[-1][0] == "lm_head.weight"
        # the two frozen files agree with each other (the verbatim write itself is not a test)
        assert json.loads(make_models.generation_config_json(cfg)).get("eos_token_id") == json.loads(text)["eos_token_id"]
    with pytest.raises(SystemExit, match="needs transformers"):
        make_models.config_for("gpt-oss-20b-4l")
