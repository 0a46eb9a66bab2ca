"""Smoke tests of the benchmarks: `python -m colibri bench` and the comparison harness on a tiny
model (Colibri only: llama.cpp is built by hand for the real runs)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import colibri
from colibri import _kernels

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(Path(colibri.__file__).parent.parent))
# the tier and int step a fresh process chooses at import (as the subprocesses below), taken before
# any test selects another
IMPORT_CHOICE = (_kernels.isa(), _kernels.int_step())


def test_colibri_bench_json(converted):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "colibri",
            "bench",
            "--model-dir",
            str(converted("mixtral_a", "int8")),
            "--prompt-len",
            "16",
            "--gen",
            "8",
            "--repeat",
            "2",
            "--threads",
            "1",
            "--json",
            "--prefill-chunk",
            "5",
        ],
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    # what ran: the chunk asked for, the kernel tier and int step the import chose
    assert (out["prefill_chunk"], out["isa"], out["int_step"]) == (5, *IMPORT_CHOICE)
    for key in ("prefill_tok_s", "decode_tok_s", "ttft_ms"):
        assert out[key]["min"] <= out[key]["median"] <= out[key]["max"] and out[key]["median"] > 0
    assert out["peak_rss_bytes"] > 0 and out["load_seconds"] > 0
    for p50, p99, ratio in zip(*(out[k]["values"] for k in ("decode_p50_ms", "decode_p99_ms", "decode_p99_over_p50"))):
        assert ratio >= 1 and abs(ratio - p99 / p50) <= 1e-9 * ratio  # the smoothness figure
    # decode's memory read: tokens a second x the bytes a decoded token reads, averaged over the
    # decode passes' positions 16..22 (the f32 cache's rows grow by one position a token)
    with colibri.load(converted("mixtral_a", "int8"), threads=1) as m:
        per_position = [m.decode_bytes(p) for p in range(16, 16 + 8 - 1)]
    assert out["decode_bytes"]["weights"] == per_position[0]["weights"]
    assert out["decode_bytes"]["kv_cache"] == pytest.approx(np.mean([b["kv_cache"] for b in per_position]), rel=1e-12)
    per_token = sum(out["decode_bytes"].values())
    for tok_s, gb_s in zip(out["decode_tok_s"]["values"], out["decode_read_gb_s"]["values"]):
        assert gb_s == pytest.approx(tok_s * per_token / 1e9, rel=1e-12)
    assert out["read_loop_gb_s"] is None  # not asked for


@pytest.fixture(scope="module")
def loaded(converted):
    """One model per (fixture case, options) for the tests below (hypothesis reruns a test's body),
    closed with the module."""
    models = {}

    def get(case, **options):
        key = (case, tuple(sorted(options.items())))
        if key not in models:
            models[key] = colibri.load(converted(case), threads=1, **options)
        return models[key]

    yield get
    for m in models.values():
        m.close()


@pytest.mark.parametrize("kv_cache, element", [("f32", 4), ("f16", 2)])
@settings(max_examples=25, deadline=None)
@given(position=st.integers(0, 254))
def test_a_decoded_token_reads_every_weight_and_the_kv_rows_its_attention_sees(
    converted, loaded, kv_cache, element, position
):
    """Gemma 4's sliding layers read at most their window, its full layers every earlier position;
    the weights are ModelDir.bytes_per_token's (a routed expert's k / E of theirs)."""
    from colibri.modeldir import ModelDir

    m = loaded("gemma4_a", n_ctx=256, kv_cache=kv_cache)
    c = m.config
    layers = range(c.num_hidden_layers)
    row = [2 * element * c.layer_kv_heads_of(i) * c.layer_head_dim(i) for i in layers]  # a position's keys and values
    seen = [min(position + 1, c.layer_window(i) or position + 1) for i in layers]
    got = m.decode_bytes(position)
    assert got == {
        "weights": sum(ModelDir(converted("gemma4_a")).bytes_per_token().values()),
        "kv_cache": sum(r * n for r, n in zip(row, seen)),
    }
    # one position more: each layer whose window is not yet full reads one row more, the rest none
    growing = sum(r for i, r in zip(layers, row) if not c.layer_window(i) or position + 1 < c.layer_window(i))
    assert m.decode_bytes(position + 1)["kv_cache"] - got["kv_cache"] == growing


@pytest.mark.parametrize(
    "case, options",
    [
        ("mixtral_a", {"kv_cache": "q8"}),
        ("mixtral_a", {"kv_cache": "f16", "parallel": 2}),
        ("qwen3moe_a", {"kv_cache": "q8", "parallel": 3}),
        ("deepseekv3_a", {}),
        ("deepseekv3_a", {"kv_cache": "f16"}),
    ],
)
def test_the_last_position_reads_a_sequences_whole_cache(loaded, case, options):
    """Models without sliding layers: at the context's last position every layer reads all its rows —
    one sequence's share of the cache as allocated, whatever the rows' format (q8: codes and a
    scale) and however many arrays a layer has (MLA: one latent array for keys and values)."""
    m = loaded(case, n_ctx=48, **options)
    assert not any(m.config.layer_window(i) for i in range(m.config.num_hidden_layers))
    assert m.decode_bytes(47)["kv_cache"] * options.get("parallel", 1) == m.kv_cache_bytes
    assert m.decode_bytes(0)["kv_cache"] * 48 == m.decode_bytes(47)["kv_cache"]
    for bad in (-1, 48, True, 1.5):
        with pytest.raises(colibri.ColibriError, match="position must be in 0..47"):
            m.decode_bytes(bad)


def test_the_read_loop_runs_apart_and_the_table_sets_decode_against_it():
    from colibri.bench import format_table, read_bandwidth_apart

    assert read_bandwidth_apart(1, 4 << 20) > 0  # a child process, 4 MiB
    rate = {"median": 30.0, "min": 29.0, "max": 31.0, "values": [29.0, 30.0, 31.0]}
    none = {"median": None, "min": None, "max": None, "values": []}
    r = {
        "model_dir": "D",
        "architecture": "mixtral",
        "weight_dtype": "int4",
        "threads": 2,
        "prompt_len": 8,
        "gen": 64,
        "repeat": 3,
        "isa": "avx2",
        "int_step": "avx2",
        "prefill_chunk": 128,
        "load_seconds": 0.1,
        "peak_rss_bytes": None,
        "decode_bytes": {"weights": 240.9e6, "kv_cache": 0.8e6},
        "read_loop_gb_s": [36.0, 44.0],
        "memory": {"expert_budget_bytes": None, "cgroup_peak_bytes": None},
        **{
            key: none
            for key in (
                "prefill_tok_s",
                "decode_tok_s",
                "ttft_ms",
                "decode_p50_ms",
                "decode_p99_ms",
                "decode_p99_over_p50",
            )
        },
        "decode_read_gb_s": rate,
    }
    rows = {line[:22].strip(): line[22:].split() for line in format_table(r).splitlines()}
    assert rows["decode reads a token"] == ["241.7", "weights", "240.9,", "KV", "0.8", "MB"]
    assert rows["read loop"] == ["40.0", "36.0", "then", "44.0", "GB/s"]
    assert rows["decode / read loop"] == ["75", "%"]  # 30 of the loops' mean, 40
    assert rows["decode memory read"] == ["30.0", "29.0", "–", "31.0", "GB/s"]


def test_colibri_bench_table_and_errors(converted):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "colibri",
            "bench",
            "--model-dir",
            str(converted("mixtral_a")),
            "--prompt-len",
            "8",
            "--gen",
            "4",
            "--repeat",
            "1",
            "--read-bandwidth",
        ],
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and "decode" in r.stdout and "prefill" in r.stdout
    assert f"kernels {IMPORT_CHOICE[0]} (int step {IMPORT_CHOICE[1]}), prefill chunk 128" in r.stdout, r.stdout
    rows = {line[:22].strip(): line[22:].split() for line in r.stdout.splitlines()}
    assert rows["read loop"][2] == "then" and rows["read loop"][4] == "GB/s", r.stdout  # before, after the runs
    assert float(rows["read loop"][1]) > 0 and float(rows["read loop"][3]) > 0
    assert rows["decode / read loop"][-1] == "%" and "cgroup peak" not in rows  # the loop's buffer is in it
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "bench", "--model-dir", "/nonexistent"],
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "/nonexistent" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(shutil.which("gcc") is None, reason="the bandwidth probe is compiled with gcc")
def test_harness_runs_and_writes_the_table(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "bench" / "run_bench.py"),
            "--tiny",
            "--reps",
            "1",
            "--prompt-len",
            "16",
            "--gen",
            "8",
            "--bw-mib",
            "64",
            "--threads",
            "1",
            "--results-dir",
            str(tmp_path),
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    tables = list(tmp_path.glob("*.md"))
    assert len(tables) == 1
    text = tables[0].read_text()
    assert "| engine | format |" in text and "colibri" in text and "GB/s" in text
    assert list(tmp_path.glob("*.json"))


def test_make_models_writes_the_frozen_shapes_without_transformers(monkeypatch):
    """The lent device machine has no transformers: make_models.py takes the shape from its frozen
    config.json (the files transformers wrote, written back verbatim: md5-compared with the
    transformers-written checkpoints when they were frozen) and lists the tensors of
    the shape MODELS names — a frozen file and MODELS that drift apart fail here."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
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
        assert (
            json.loads(make_models.generation_config_json(cfg)).get("eos_token_id") == json.loads(text)["eos_token_id"]
        )
    with pytest.raises(SystemExit, match="needs transformers"):
        make_models.config_for("gpt-oss-20b-4l")


@pytest.mark.skipif(os.uname().machine != "x86_64" or shutil.which("gcc") is None, reason="x86-64 with gcc only")
def test_the_bf16_rounding_probe_finds_the_order_of_the_cpus_products(tmp_path):
    """tools/bench/amx_bf16_probe.c (run by amx_engine.py on an AMX machine, to learn TDPBF16PS's
    order of roundings): where the CPU has AVX512_BF16, VDPBF16PS must match exactly the candidates
    that add the odd product of a pair first — the order of the engine's bf16 products spec
    (kernels_scalar.h, cb_itile_bf16_lanes) — and the other orders must differ somewhere (the probe
    tells them apart); elsewhere it says which instructions the CPU lacks."""
    from colibri import _kernels

    exe = tmp_path / "probe"
    subprocess.run(
        ["gcc", "-O2", "-ffp-contract=off", str(REPO / "tools/bench/amx_bf16_probe.c"), "-o", str(exe)], check=True
    )
    r = subprocess.run([str(exe), "32"], capture_output=True, text=True)
    lines = r.stdout.splitlines()
    f = _kernels.cpu_features()
    if not f["avx512_bf16"] or not f["os_avx512"]:
        assert "vdpbf16ps: this CPU has no AVX512_BF16" in lines
    else:
        assert r.returncode in (0, 1), r.stderr
        assert "vdpbf16ps K=16 matches: seq-odd-first split:(c+o)+e" in lines, r.stdout
        counts = next(line for line in lines if line.startswith("vdpbf16ps K=16: "))
        differ = dict(zip(counts.split()[4::2], map(int, counts.split()[5::2])))
        assert differ["seq-odd-first"] == 0 and min(differ["seq-even-first"], differ["pair-fused"]) > 0, counts
        assert "vdpbf16ps subnormal input x 2^100: 0 (DAZ)" in lines and "vdpbf16ps 2^-70 x 2^-70: 0 (FTZ)" in lines
    if not f["amx_bf16"]:
        assert "tdpbf16ps: this CPU has no AMX-BF16" in lines
    elif r.returncode == 0:  # the tile state lent: every K reports its matching candidates
        assert sum(line.startswith("tdpbf16ps K=") and "matches:" in line for line in lines) == 5


def _tool(name):
    """tools/bench/NAME.py as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _amx_engine():
    """tools/bench/amx_engine.py as a module (its variants and their flags, its peers' runs)."""
    return _tool("amx_engine")


@pytest.mark.skipif(shutil.which("gcc") is None, reason="amx_check.c is compiled with gcc")
def test_every_amx_kernel_variant_compiles_and_the_knobs_keep_the_bits(tmp_path):
    """amx_engine.py times compile-time variants of the AMX tiles (kernels_amx.h's knobs: the int
    tile's pipeline and chunk, the bf16 tile's group pairs a pass and chunk) on a lent AMX machine.
    Each must be a build kernels_amx.h accepts (a schedule it refuses is refused); and a build with
    every knob away from its default — a 1-step store delay with a 2-step lookahead, 5 blocks a
    chunk, one bf16 group pair a pass, 3 chunks — gives the AVX-512 steps' bits through the emulated
    tile ops (amx_check --emulated: the tiles' shapes and the kernel table's products)."""
    variants = _amx_engine().KERNEL_VARIANTS
    assert "default" in variants and variants["default"][0] == []
    syntax = [
        "gcc",
        "-fsyntax-only",
        "-fopenmp",
        f"-I{REPO / 'colibri' / 'csrc'}",
        str(REPO / "tools/bench/amx_check.c"),
    ]
    for name, (flags, formats) in variants.items():
        r = subprocess.run(syntax + flags, capture_output=True, text=True)
        assert r.returncode == 0, f"{name}: {r.stderr[-1500:]}"
        assert set(formats.split(",")) <= {"int8", "int4", "int6", "mxfp4", "bf16"}, name
    for knobs, named in (
        (["-DCB_AMX_STORE_DELAY=2", "-DCB_AMX_LOOKAHEAD=1"], "CB_AMX_STORE_DELAY"),
        (["-DCB_AMX_BF16_PAIRS=3"], "CB_AMX_BF16_PAIRS"),
        (["-DCB_AMX_KBLOCKS=0"], "CB_AMX_KBLOCKS"),
    ):
        refused = subprocess.run(syntax + knobs, capture_output=True, text=True)
        assert refused.returncode != 0 and named in refused.stderr, knobs
    if "amx-emulated" not in _kernels.available_int_steps():
        pytest.skip("the emulated AMX step needs AVX512-VNNI")
    exe = tmp_path / "amx_check"
    knobs = [
        "-DCB_AMX_STORE_DELAY=1",
        "-DCB_AMX_LOOKAHEAD=2",
        "-DCB_AMX_KBLOCKS=5",
        "-DCB_AMX_BF16_PAIRS=1",
        "-DCB_AMX_BF16_CHUNKS=3",
    ]
    subprocess.run(
        [
            "gcc",
            "-O1",
            "-fopenmp",
            *knobs,
            f"-I{REPO / 'colibri' / 'csrc'}",
            str(REPO / "tools/bench/amx_check.c"),
            "-o",
            str(exe),
            "-lm",
        ],
        check=True,
    )
    r = subprocess.run([str(exe), "--emulated"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "store delay 1, lookahead 2, 5 blocks a chunk; bf16: 1 group pair a pass, 3 chunks" in r.stdout
    bits = [
        line.split(": ")[1].split(" cases")[0].split(" of ")
        for line in r.stdout.splitlines()
        if line.startswith("bits amx-emulated:")
    ]
    # the int formats' cases, then bf16's (none where the CPU has no AVX512_BF16 to compare with)
    assert len(bits) == 2 and all(same == total for same, total in bits), r.stdout
    assert int(bits[0][1]) > 0 and (int(bits[1][1]) > 0) == bool(_kernels.cpu_features()["avx512_bf16"]), r.stdout
    assert "dispatch amx-emulated: self-test passed (code 0)" in r.stdout


@pytest.mark.parametrize("kind", ["f32", "q8_0", "q4_0"])
def test_write_gguf_writes_the_tensors_llama_cpps_tools_write(tmp_path, kind):
    """tools/bench/write_gguf.py (the peers' GGUFs on the lent machine, which has no torch) against
    the files llama.cpp's convert_hf_to_gguf.py and llama-quantize made from the same checkpoint
    (tests/fixtures/gguf/mixtral_a-*): names, merged experts, the q/k rows permuted per head, types,
    ggml's rounding, the f16 fallback of rows that are not whole blocks, and the model's metadata.
    The Q4_0 fixture was made with llama-quantize's default recipe, which keeps the output head in
    Q8_0 (write_gguf follows --pure): there every tensor the fixture holds in Q4_0, F16 or F32 is
    compared."""
    gguf = pytest.importorskip("gguf", reason="the gguf package (pip install 'colibri-moe[gguf]')")
    write_gguf = _tool("write_gguf")
    out = tmp_path / f"{kind}.gguf"
    write_gguf.write(REPO / "tests/fixtures/mixtral_a/hf", out, kind)
    ref = REPO / f"tests/fixtures/gguf/mixtral_a-{kind.upper()}.gguf"
    if kind != "q4_0":
        assert write_gguf.check(out, ref) == 0
        return
    ours = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    compared = 0
    for t in gguf.GGUFReader(str(ref)).tensors:
        if t.tensor_type.name == "Q8_0":
            assert t.name == "output.weight" and ours[t.name].tensor_type.name == "Q4_0"
            continue
        assert ours[t.name].tensor_type == t.tensor_type and list(ours[t.name].shape) == list(t.shape), t.name
        assert np.array_equal(np.asarray(ours[t.name].data).view(np.uint8), np.asarray(t.data).view(np.uint8)), t.name
        compared += t.tensor_type.name == "Q4_0"
    assert compared == 2 * 6 + 1  # attention and gate/up experts of both layers, the embedding


def test_amx_engine_runs_a_peers_llama_bench_and_sets_the_engine_against_the_best(tmp_path, capsys):
    """amx_engine.py --llama-bench / --ik-bench: one run of a peer is llama-bench's JSON read for its
    prompt and decode tests (a stand-in llama-bench here, which also shows the libraries beside it
    are on LD_LIBRARY_PATH and the flags it got); a run without them, or whose JSON lacks them, fails
    with the command named; the table sets the engine's best chunk against the best peer."""
    amx = _amx_engine()
    bench = tmp_path / "bin" / "llama-bench"
    bench.parent.mkdir()
    bench.write_text(
        "#!/bin/sh\n"
        'case "$LD_LIBRARY_PATH" in "$(dirname "$0")"*) ;; *) echo no libs >&2; exit 3;; esac\n'
        'case "$*" in *-rtr*) pp=300.5;; *) pp=150.25;; esac\n'
        'echo "[{\\"n_prompt\\": 512, \\"n_gen\\": 0, \\"avg_ts\\": $pp},'
        ' {\\"n_prompt\\": 0, \\"n_gen\\": 8, \\"avg_ts\\": 40.0}]"\n'
    )
    bench.chmod(0o755)
    assert amx.run_peer(bench, tmp_path / "m.gguf", 512, 16, [], timeout=60) == (150.25, 40.0)
    assert amx.run_peer(bench, tmp_path / "m.gguf", 512, 16, ["-rtr", "1"], timeout=60) == (300.5, 40.0)
    empty = tmp_path / "bin" / "empty-bench"
    empty.write_text("#!/bin/sh\necho '[]'\n")
    empty.chmod(0o755)
    with pytest.raises(amx.RunFailed, match="no prefill and decode test"):
        amx.run_peer(empty, tmp_path / "m.gguf", 512, 16, [], timeout=60)
    runs = [
        {
            "format": "int8",
            "threads": 16,
            "engine": "colibri",
            "chunk": c,
            "step": "amx",
            "prefill_tok_s": pp,
            "decode_tok_s": 50.0,
        }
        for c, pp in ((128, 900.0), (512, 1200.0), (512, 1000.0))
    ]
    runs += [
        {
            "format": "int8",
            "threads": 16,
            "engine": e,
            "chunk": None,
            "step": None,
            "prefill_tok_s": pp,
            "decode_tok_s": 40.0,
        }
        for e, pp in (("llama.cpp", 150.0), ("ik_llama.cpp -rtr", 300.0), ("ik_llama.cpp -rtr", 500.0))
    ]
    amx.peer_table(runs, ["int8"], ["amx", "avx512-vnni"])
    row = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| int8 |")]
    # the engine's chunk 512 (median 1100) against ik -rtr's median 400: 2.75x; decode 50 / 40
    assert row == ["| int8 | 16 | 1100.0, 50.0 | 150.0, 40.0 | 400.0, 40.0 | 2.75, 1.25 |"]


def test_write_gguf_check_sees_each_kind_of_difference(tmp_path, monkeypatch):
    """write_gguf --check fails on a type, on bytes of the same type and shape (the q/k rows left
    unpermuted), and on the model's metadata (another rms_norm_eps)."""
    pytest.importorskip("gguf", reason="the gguf package (pip install 'colibri-moe[gguf]')")
    write_gguf = _tool("write_gguf")
    hf, ref = REPO / "tests/fixtures/mixtral_a/hf", REPO / "tests/fixtures/gguf/mixtral_a-Q8_0.gguf"
    write_gguf.write(hf, tmp_path / "f32.gguf", "f32")
    assert write_gguf.check(tmp_path / "f32.gguf", ref) == 1
    with monkeypatch.context() as m:
        m.setattr(write_gguf, "permute_heads", lambda w, heads: w)
        write_gguf.write(hf, tmp_path / "unpermuted.gguf", "q8_0")
    assert write_gguf.check(tmp_path / "unpermuted.gguf", ref) == 1
    other = tmp_path / "hf"
    shutil.copytree(hf, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-6
    (other / "config.json").write_text(json.dumps(cfg))
    write_gguf.write(other, tmp_path / "eps.gguf", "q8_0")
    assert write_gguf.check(tmp_path / "eps.gguf", ref) == 1
    write_gguf.write(hf, tmp_path / "same.gguf", "q8_0")
    assert write_gguf.check(tmp_path / "same.gguf", ref) == 0


def test_amx_engine_writes_the_peers_ggufs_and_records_the_ones_it_could_not(tmp_path):
    """amx_engine.py's GGUFs for the peers, written in the background: a Mixtral checkpoint's int8 as
    q8_0 (what write_gguf.py writes), a format the peers have no type for left out, a checkpoint
    write_gguf cannot write recorded as a failure; no writer outlives the wait."""
    import argparse

    amx = _amx_engine()
    a = argparse.Namespace(peers={"llama.cpp": (Path("/bin/true"), [])}, gguf_path=None, work=tmp_path, model="m")
    started = amx.start_ggufs(a, REPO / "tests/fixtures/mixtral_a/hf", ["int8", "int6"])
    assert set(started) == {"int8"}
    a.model = "q"
    started.update({"bf16": amx.start_ggufs(a, REPO / "tests/fixtures/qwen3moe_a/hf", ["bf16"])["bf16"]})
    try:
        done, failed = amx.finish_ggufs(started, time.monotonic() + 120)
    finally:
        amx.stop_ggufs(started)
    assert done == {"int8": tmp_path / "m-q8_0.gguf"} and done["int8"].stat().st_size > 0
    assert [f["format"] for f in failed] == ["bf16"] and "only mixtral checkpoints" in failed[0]["error"]
    assert all(proc.poll() is not None for _, proc in started.values())
    a.peers = {}
    assert amx.start_ggufs(a, REPO / "tests/fixtures/mixtral_a/hf", ["int8"]) == {}
