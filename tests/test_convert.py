"""The converter: input layouts (single, sharded, per-expert, stacked, bf16/f16), output format,
and its refusals (unknown tensors, missing tensors, occupied output directory)."""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

import colibri
from colibri import quant
from colibri.convert import convert
from colibri.errors import ColibriError
from colibri.hfcheckpoint import HFCheckpoint
from colibri.modeldir import ALIGNMENT, BLOCK_FORMATS as BLOCK, ModelDir
from conftest import FIXTURES, reference, write_safetensors

SILENT = dict(log=lambda *a: None)


def checkpoint_tensors(case: str) -> dict:
    ck = HFCheckpoint(FIXTURES / case / "hf")
    return {n: ck.f32(n) for n in ck.names()}


def hf_copy(case: str, dest: Path, tensors: dict | None = None, config_edit=None) -> Path:
    """A copy of a fixture HF directory, optionally with other tensors or config fields."""
    src = FIXTURES / case / "hf"
    dest.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(cfg)
    (dest / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        if f.name != "config.json" and (tensors is None or "safetensors" not in f.name):
            shutil.copy(f, dest / f.name)
    if tensors is not None:
        write_safetensors(dest / "model.safetensors", tensors)
    return dest


def test_sharded_checkpoint_converts(converted):
    assert (FIXTURES / "mixtral_b" / "hf" / "model.safetensors.index.json").is_file()
    md = ModelDir(converted("mixtral_b"))
    assert md.config.tie_word_embeddings and "lm_head" not in md.tensors


def test_stacked_and_per_expert_experts_convert_to_the_same_bytes(tmp_path):
    """Rewrite mixtral_a with transformers' in-memory stacked layout; the output must be identical."""
    t = checkpoint_tensors("mixtral_a")
    cfg = json.loads((FIXTURES / "mixtral_a" / "hf" / "config.json").read_text())
    stacked = {}
    for name, arr in t.items():
        if ".experts." not in name:
            stacked[name.replace("block_sparse_moe.gate", "mlp.gate")] = arr
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.block_sparse_moe.experts."
        E = cfg["num_local_experts"]
        stacked[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([t[f"{p}{e}.w1.weight"], t[f"{p}{e}.w3.weight"]]) for e in range(E)]
        )
        stacked[f"model.layers.{layer}.mlp.experts.down_proj"] = np.stack([t[f"{p}{e}.w2.weight"] for e in range(E)])
    convert(hf_copy("mixtral_a", tmp_path / "stacked_hf", stacked), tmp_path / "stacked", **SILENT)
    convert(FIXTURES / "mixtral_a" / "hf", tmp_path / "per_expert", **SILENT)
    a, b = ModelDir(tmp_path / "stacked"), ModelDir(tmp_path / "per_expert")
    assert a.files.keys() == b.files.keys()
    for rel in a.files:
        assert (tmp_path / "stacked" / rel).read_bytes() == (tmp_path / "per_expert" / rel).read_bytes(), rel


def test_stacked_fixture_matches_reference(converted):
    ref = reference("qwen3moe_b")
    logits = colibri.load(converted("qwen3moe_b")).forward(ref["input_ids"])
    assert np.abs(logits - ref["logits_f32"]).max() <= 1e-4 * np.abs(ref["logits_f32"]).max()


def test_bf16_checkpoint_keeps_its_exact_bits(converted):
    ck = HFCheckpoint(FIXTURES / "olmoe_b" / "hf")
    raw, kind = ck.raw("model.layers.0.mlp.experts.3.up_proj.weight")
    assert kind == "bf16"
    m = colibri.load(converted("olmoe_b", "bf16"))
    from colibri.modeldir import MappedModelDir

    stored = MappedModelDir(m._dir).rows_array("layers.0.experts.3.up")  # in whatever layout it is stored
    assert np.array_equal(stored, raw)


def test_layout_one_expert_per_file_and_alignment(converted):
    md = ModelDir(converted("qwen2moe_a", "bf16"))
    for name, t in md.tensors.items():
        assert t["offset"] % ALIGNMENT == 0
        if ".experts." in name:
            layer, expert = int(name.split(".")[1]), int(name.split(".")[3])
            assert t["file"] == f"layers/{layer:02d}/expert_{expert:03d}.bin"
            assert t["dtype"] == "bf16"
        if name.endswith(("norm", "router", "shared_gate")) or name.split(".")[-1] in ("bq", "bk", "bv"):
            assert t["dtype"] == "f32", name
    per_file = {}
    for name, t in md.tensors.items():
        per_file.setdefault(t["file"], []).append(name.rsplit(".", 1)[-1])
    experts = [f for f in per_file if "/expert_" in f]
    assert experts and all(sorted(per_file[f]) == ["down", "gate", "up"] for f in experts)
    assert (md.root / "layers" / "01" / "shared_expert.bin").is_file()
    assert (md.root / "layers" / "00" / "mlp.bin").is_file()  # decoder_sparse_step 2: layer 0 is dense


def test_tokenizer_is_copied_and_hashed(converted):
    md = ModelDir(converted("mixtral_a"))
    assert "tokenizer.model" in md.files
    assert (md.root / "tokenizer.model").read_bytes() == (
        FIXTURES / "mixtral_a" / "hf" / "tokenizer.model"
    ).read_bytes()
    assert md.verify() == []


def test_unconsumed_tensor_is_an_error_naming_it(tmp_path):
    t = checkpoint_tensors("olmoe_a")
    t["model.layers.0.mlp.mystery.weight"] = np.zeros((4, 4), np.float32)
    with pytest.raises(colibri.ColibriError, match="model.layers.0.mlp.mystery.weight"):
        convert(hf_copy("olmoe_a", tmp_path / "hf", t), tmp_path / "out", **SILENT)
    assert not (tmp_path / "out").exists()


def test_missing_tensor_is_an_error(tmp_path):
    t = checkpoint_tensors("olmoe_a")
    del t["model.layers.1.mlp.experts.5.down_proj.weight"]
    with pytest.raises(colibri.ColibriError, match="layers.1.experts.5.down"):
        convert(hf_copy("olmoe_a", tmp_path / "hf", t), tmp_path / "out", **SILENT)


def test_shape_mismatch_leaves_no_output(tmp_path):
    t = checkpoint_tensors("olmoe_a")
    t["model.layers.1.mlp.experts.7.up_proj.weight"] = np.zeros((3, 64), np.float32)
    with pytest.raises(colibri.ColibriError, match="layers.1.experts.7.up"):
        convert(hf_copy("olmoe_a", tmp_path / "hf", t), tmp_path / "out", **SILENT)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no output, no temporary directory


def test_unknown_architecture_is_named(tmp_path):
    def edit(cfg):
        cfg["architectures"] = ["LlamaForCausalLM"]

    with pytest.raises(colibri.ColibriError, match="LlamaForCausalLM"):
        convert(hf_copy("olmoe_a", tmp_path / "hf", config_edit=edit), tmp_path / "out", **SILENT)


def test_unsupported_rope_scaling_is_refused(tmp_path):
    def edit(cfg):
        cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0}

    with pytest.raises(colibri.ColibriError, match="longrope.* not supported"):
        convert(hf_copy("olmoe_a", tmp_path / "hf", config_edit=edit), tmp_path / "out", **SILENT)


def test_yarn_without_its_original_length_is_refused(tmp_path):
    def edit(cfg):
        cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}

    with pytest.raises(colibri.ColibriError, match="missing field 'rope_parameters.original_max_position_embeddings'"):
        convert(hf_copy("olmoe_a", tmp_path / "hf", config_edit=edit), tmp_path / "out", **SILENT)


def test_existing_output_needs_force_and_is_replaced_whole(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    for force in (False, True):  # --force replaces only a Colibri model directory
        with pytest.raises(colibri.ColibriError, match="--force"):
            convert(FIXTURES / "olmoe_a" / "hf", out, force=force, **SILENT)
        assert (out / "keep.txt").read_text() == "precious"
    (out / "keep.txt").unlink()
    convert(FIXTURES / "mixtral_a" / "hf", out, **SILENT)
    (out / "keep.txt").write_text("stray")
    with pytest.raises(colibri.ColibriError, match="--force"):
        convert(FIXTURES / "olmoe_a" / "hf", out, **SILENT)
    convert(FIXTURES / "olmoe_a" / "hf", out, force=True, **SILENT)
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_truncated_safetensors_is_refused(tmp_path):
    hf = hf_copy("olmoe_a", tmp_path / "hf")
    st = hf / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[:-100])
    with pytest.raises(colibri.ColibriError, match="model.safetensors"):
        convert(hf, tmp_path / "out", **SILENT)


def test_values_beyond_f16_are_refused_not_written_as_inf(tmp_path):
    t = checkpoint_tensors("olmoe_a")
    t["model.layers.0.self_attn.q_proj.weight"][3, 5] = 1e6
    hf = hf_copy("olmoe_a", tmp_path / "hf", t)
    with pytest.raises(colibri.ColibriError, match=r"layers.0.wq.*f16"):
        convert(hf, tmp_path / "out", quantize="f16", **SILENT)
    convert(hf, tmp_path / "out", quantize="bf16", **SILENT)  # bf16 has the range


def test_non_finite_weights_are_refused(tmp_path):
    t = checkpoint_tensors("olmoe_a")
    t["model.layers.1.mlp.experts.2.gate_proj.weight"][0, 0] = np.nan
    with pytest.raises(colibri.ColibriError, match="layers.1.experts.2.gate.*NaN"):
        convert(hf_copy("olmoe_a", tmp_path / "hf", t), tmp_path / "out", **SILENT)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_block_formats_fall_back_where_rows_are_not_whole_blocks(converted, dtype):
    """qwen3moe_b has hidden 48: matrices with 48 columns stay f16, the rest are blocks."""
    md = ModelDir(converted("qwen3moe_b", dtype))
    for name, t in md.tensors.items():
        if len(t["shape"]) == 2 and name not in {n for n in md.tensors if n.endswith("router")}:
            assert t["dtype"] == (dtype if t["shape"][1] % 32 == 0 else "f16"), name


# --ln-quant int16: each norm weight errs by at most half a step, amax / 32767 / 2 (relative 1.5e-5),
# which moves the fixtures' logits by about 1e-4 of their scale (measured 7e-5 on qwen3moe_a)
LN_INT16_RTOL = 3e-4


@pytest.mark.parametrize("case", ["qwen3moe_a", "olmoe_b", "mixtral_b"])
def test_int16_norms(tmp_path, case):
    out = tmp_path / "m"
    convert(FIXTURES / case / "hf", out, ln_quant="int16", **SILENT)
    md = ModelDir(out)
    assert md.raw["ln_gamma_quant_bits"] == 16
    norms = [n for n in md.tensors if n.endswith("norm")]
    assert norms and all(md.tensors[n]["dtype"] == "int16" and md.tensors[n]["scale"] > 0 for n in norms)
    assert all(md.tensors[n]["dtype"] == "f32" for n in md.tensors if n.split(".")[-1] in ("bq", "bk", "bv", "router"))
    ref = reference(case)
    logits = colibri.load(out).forward(ref["input_ids"])
    assert np.abs(logits - ref["logits_f32"]).max() <= LN_INT16_RTOL * np.abs(ref["logits_f32"]).max()


def test_int16_norm_needs_a_scale(tmp_path):
    out = tmp_path / "m"
    convert(FIXTURES / "olmoe_a" / "hf", out, ln_quant="int16", **SILENT)
    cfg = json.loads((out / "config.json").read_text())
    cfg["tensors"]["layers.0.attn_norm"]["scale"] = float("nan")
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(colibri.ColibriError, match="layers.0.attn_norm.*scale"):
        colibri.load(out)


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="RSS from /proc")
def test_reading_a_tensor_releases_its_mapped_pages(tmp_path):
    """The converter copies each tensor out of the mapped checkpoint and releases the pages it
    read: RSS grows by the copy only, not by copy + mapping (which made converting a 50 GB
    checkpoint show a 21 GB RSS)."""
    from colibri import _os
    from colibri.hfcheckpoint import SafetensorsFile, to_f32

    data = np.random.default_rng(0).standard_normal((2048, 4096), np.float32)  # 32 MiB
    head = json.dumps({"w": {"dtype": "F32", "shape": list(data.shape), "data_offsets": [0, data.nbytes]}}).encode()
    head += b" " * (-len(head) % 8)
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(head)) + head + data.tobytes())
    stored, kind = SafetensorsFile(path).raw("w")
    int(stored[:, ::1024].sum())  # touch every page of the mapping
    touched = _os.rss_bytes()[0]
    values = to_f32(stored, kind)  # + the copy, - the mapped pages
    assert _os.rss_bytes()[0] - touched <= 0.5 * data.nbytes
    np.testing.assert_array_equal(values, data)


def test_models_without_the_gemma_fields_stay_readable_by_earlier_versions(converted):
    """The fields added for Gemma 4 are written only where they differ from their defaults: a
    Mixtral directory has exactly the model fields of the first release (which refused unknown
    fields), a Gemma directory has them."""
    from colibri.config import EXTENSION_FIELDS

    mixtral = json.loads((converted("mixtral_a") / "config.json").read_text())["model"]
    assert not set(EXTENSION_FIELDS) & set(mixtral)
    gemma = json.loads((converted("gemma4_a") / "config.json").read_text())["model"]
    assert {"moe_block", "sandwich_norms", "layer_head_dims", "embedding_scale"} <= set(gemma)


# ---- layouts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["f32", "bf16", "int8", "int4"])
def test_converter_layouts(converted, dtype):
    """Default: the format's faster layout for every matrix but the embedding; the router, norms
    and vectors are always rows. Interleaved exists for int8/int4 and bf16 (whole groups of 8 rows;
    bf16 also whole blocks of 32 inputs): asked of f32, a clear error and no directory."""
    for layout in (None, "rows", "transposed") + (("interleaved",) if dtype in BLOCK + ("bf16",) else ()):
        md = ModelDir(converted("mixtral_a", dtype, layout))
        for name, t in md.tensors.items():
            matrix = len(t["shape"]) == 2 and name != "embedding" and not name.endswith("router")  # untied
            want = layout or quant.default_layout(t["dtype"])  # int8/int4 models keep odd matrices f16,
            if want == "interleaved" and (
                t["dtype"] not in BLOCK + ("bf16",) or t["shape"][0] % 8 or t["shape"][-1] % 32
            ):  # which cannot be interleaved
                want = "rows"
            assert t["layout"] == (want if matrix else "rows"), (layout, name)


def test_layout_choice_per_tensor():
    """--expert-layout for the routed experts, --layout for the other matrices, the format's
    faster layout by default; an int8/int4 matrix whose row count is not a multiple of 8 cannot
    be grouped and stays rows; the embedding, routers, norms and vectors are always rows."""
    from colibri.convert import _layout_for

    assert _layout_for("layers.3.experts.5.up", (48, 64), "matrix", "int8") == "interleaved"
    assert _layout_for("layers.3.experts.5.up", (48, 64), "matrix", "bf16") == "interleaved"
    assert _layout_for("layers.3.experts.5.up", (48, 40), "matrix", "bf16") == "rows"  # not whole blocks
    assert _layout_for("layers.3.experts.5.up", (44, 64), "matrix", "bf16") == "rows"  # not whole groups
    assert _layout_for("layers.3.experts.5.up", (48, 64), "matrix", "f32") == "rows"
    assert _layout_for("layers.3.experts.5.up", (48, 64), "matrix", "bf16", "transposed") == "transposed"
    assert _layout_for("layers.3.experts.5.up", (48, 64), "matrix", "int8", "rows", "transposed") == "rows"
    assert _layout_for("layers.3.wq", (64, 64), "matrix", "int8", "rows", "transposed") == "transposed"
    assert _layout_for("layers.3.wq", (64, 64), "matrix", "int8", "transposed", "rows") == "rows"
    assert _layout_for("layers.3.experts.5.down", (44, 64), "matrix", "int8") == "rows"
    assert _layout_for("layers.3.experts.5.down", (44, 64), "matrix", "f16", "transposed") == "transposed"
    assert _layout_for("embedding", (64, 64), "matrix", "int8", "transposed", "transposed") == "rows"
    assert _layout_for("embedding", (64, 64), "matrix", "int8", tied=True) == "interleaved"  # the head
    assert _layout_for("embedding", (64, 64), "matrix", "bf16", "rows", "transposed", tied=True) == "transposed"
    assert _layout_for("layers.3.router", (8, 64), "router", "f32", "transposed", "transposed") == "rows"
    assert _layout_for("layers.3.experts.5.up", (48, 64), "matrix", "int4", "interleaved") == "interleaved"
    assert _layout_for("layers.3.wq", (64, 64), "matrix", "int8", None, "interleaved") == "interleaved"
    assert _layout_for("layers.3.experts.5.down", (44, 64), "matrix", "int8", "interleaved") == "rows"
    assert _layout_for("layers.3.experts.5.down", (48, 40), "matrix", "f16", "interleaved") == "rows"  # kept f16
    assert _layout_for("embedding", (64, 64), "matrix", "int8", "interleaved", "interleaved") == "rows"
    assert _layout_for("embedding", (64, 64), "matrix", "int4", None, "interleaved", tied=True) == "interleaved"


def test_unknown_layout_is_refused(tmp_path):
    with pytest.raises(
        ColibriError,
        match=re.escape("--expert-layout (--quantize f16): f16 has no interleaved layout, only rows or transposed"),
    ):
        convert(FIXTURES / "mixtral_a" / "hf", tmp_path / "m", quantize="f16", expert_layout="interleaved")
    with pytest.raises(
        ColibriError,
        match=re.escape("--layout (--quantize f32): f32 has no interleaved layout, only rows or transposed"),
    ):
        convert(FIXTURES / "mixtral_a" / "hf", tmp_path / "m", layout="interleaved")
    with pytest.raises(ColibriError, match="--expert-layout 'columns'"):
        convert(FIXTURES / "mixtral_a" / "hf", tmp_path / "m", quantize="int8", expert_layout="columns")
    with pytest.raises(ColibriError, match="--layout 'cols'"):
        convert(FIXTURES / "mixtral_a" / "hf", tmp_path / "m", quantize="int8", layout="cols")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("case, arch", [("glm4moe_a", "glm4_moe"), ("deepseekv3_a", "deepseek_v3")])
def test_multi_token_prediction_layers_are_skipped(tmp_path, case, arch):
    """GLM-4.5 and DeepSeek-V3 checkpoints store num_nextn_predict_layers extra layers after the
    decoder's (eh_proj, enorm, hnorm, a full MoE layer): transformers does not run them, so the
    model converts without them; an incomplete one is not kept as a drafter (tests/test_nextn.py
    has complete ones); a layer past those is still refused."""
    from colibri.hfcheckpoint import HFCheckpoint
    from conftest import write_safetensors

    src = Path(__file__).parent / "fixtures" / case / "hf"
    hf = tmp_path / "hf"
    shutil.copytree(src, hf)
    ckpt = HFCheckpoint(hf)
    tensors = {name: ckpt.f32(name) for name in ckpt.names()}
    cfg = json.loads((hf / "config.json").read_text())
    n, d = cfg["num_hidden_layers"], cfg["hidden_size"]
    tensors[f"model.layers.{n}.eh_proj.weight"] = np.zeros((d, 2 * d), np.float32)
    tensors[f"model.layers.{n}.enorm.weight"] = np.ones(d, np.float32)
    write_safetensors(hf / "model.safetensors", tensors)
    cfg["num_nextn_predict_layers"] = 1
    (hf / "config.json").write_text(json.dumps(cfg))
    lines = []
    convert(hf, tmp_path / "m", log=lines.append)
    assert any(
        "2 tensors of the multi-token-prediction layer(s) 3..3 are not part of the model" in line for line in lines
    )
    assert any("layer 3 is not kept (the checkpoint lacks model.layers.3.hnorm.weight" in line for line in lines)
    ref = np.load(Path(__file__).parent / "fixtures" / case / "reference.npz")
    logits = colibri.load(tmp_path / "m").forward(ref["input_ids"])
    assert np.abs(logits - ref["logits_f32"]).max() <= 1e-4 * np.abs(ref["logits_f32"]).max()
    cfg["num_nextn_predict_layers"] = 0
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(colibri.ColibriError, match=rf"not understood for {arch}: model\.layers\.3\.eh_proj"):
        convert(hf, tmp_path / "m2", log=lambda *a: None)


# ---- formats by role (--role ROLE=FORMAT) and the bytes a decoded token reads -----------------


def test_roles_choose_the_format_of_their_matrices(tmp_path):
    from colibri.modeldir import tensor_role

    said = []
    convert(
        FIXTURES / "deepseekv3_a" / "hf",
        tmp_path / "m",
        quantize="int4",
        log=said.append,
        roles={"attention": "int8", "head": "int8", "shared": "bf16", "dense": "f16"},
    )
    md = ModelDir(tmp_path / "m")
    formats = {}
    for n, t in md.tensors.items():
        formats.setdefault(tensor_role(n), set()).add(t["dtype"])
    assert formats["experts"] == {"int4"} and md.weight_dtype == "int4"
    assert formats["attention"] <= {"int8", "f16"}  # wkb/wvb: f16 (ABSORBED_DTYPE); 48-wide q_b: f16
    assert "int8" in formats["attention"]
    assert formats["head"] == {"int8"} and formats["shared"] == {"bf16"} and formats["dense"] == {"f16"}
    assert formats["router"] == {"f32"}  # never quantized
    (line,) = [s for s in said if s.startswith("[INFO] Bytes read per decoded token")]
    assert "attention" in line and "in int8" in line and "shared" in line and "in bf16" in line


def test_bytes_per_token_counts_top_k_experts_and_one_embedding_row(converted):
    md = ModelDir(converted("mixtral_a", "int8"))
    c = md.config
    per = md.bytes_per_token()
    experts = sum(t["nbytes"] for n, t in md.tensors.items() if ".experts." in n)
    assert per["experts"] == pytest.approx(experts * c.num_experts_per_tok / c.num_experts)
    emb = md.tensors["embedding"]
    assert per["embedding"] == pytest.approx(emb["nbytes"] / emb["shape"][0])  # untied: one row
    assert per["head"] == md.tensors["lm_head"]["nbytes"]
    total = sum(t["nbytes"] for t in md.tensors.values())
    assert sum(per.values()) == pytest.approx(total - experts - emb["nbytes"] + per["experts"] + per["embedding"])


@pytest.mark.parametrize(
    "roles, message",
    [
        ({"brains": "int8"}, "unknown role 'brains'"),
        ({"attention": "int3"}, "'int3' is not a format"),
        ({"router": "int8"}, "unknown role 'router'"),
    ],
)
def test_a_bad_role_is_refused_before_any_work(tmp_path, roles, message):
    with pytest.raises(ColibriError, match=message):
        convert(FIXTURES / "mixtral_a" / "hf", tmp_path / "m", quantize="int4", roles=roles, **SILENT)
    assert not (tmp_path / "m").exists()


def test_role_on_the_command_line(tmp_path):
    import subprocess
    import sys

    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "colibri",
            "convert",
            "--hf-dir",
            str(FIXTURES / "mixtral_a" / "hf"),
            "--output-dir",
            str(tmp_path / "m"),
            "--quantize",
            "int4",
            "--role",
            "attention=int8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr
    assert ModelDir(tmp_path / "m").tensors["layers.0.wq"]["dtype"] == "int8"
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "colibri",
            "convert",
            "--hf-dir",
            str(FIXTURES / "mixtral_a" / "hf"),
            "--output-dir",
            str(tmp_path / "n"),
            "--role",
            "attention",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "expected ROLE=FORMAT" in bad.stderr


def test_a_tied_embedding_takes_the_head_s_format(tmp_path):
    """mixtral_b ties its embedding to the output head: --role head sets the one matrix both use."""
    convert(FIXTURES / "mixtral_b" / "hf", tmp_path / "m", quantize="int4", roles={"head": "int8"}, **SILENT)
    md = ModelDir(tmp_path / "m")
    assert md.config.tie_word_embeddings and md.tensors["embedding"]["dtype"] == "int8"
    assert "lm_head" not in md.tensors
