"""GGUF import (`convert --gguf`, colibri/gguf_import.py) against GGUF files made by llama.cpp's
own convert_hf_to_gguf.py and llama-quantize from the HF test fixtures (tools/make_gguf_fixtures.py,
tests/fixtures/gguf/).

- Float GGUFs import to the very model the safetensors conversion gives: logits equal, and
  equal to transformers' within the usual tolerance (so names, the q/k un-permutation, the
  config from metadata are right).
- Q8_0 / Q4_0 blocks are carried into int8 / int4 byte for byte; the model is as close to
  transformers' logits as Colibri's own int8 / int4 conversion of the checkpoint.
- Types with no Colibri format (Q4_K_M's Q5_0 fallbacks here) are dequantized and requantized,
  with the error reported; imported at int8 they stay as close to the file's values as int8 is.
- Unsupported architectures and tensor types, and damaged files (hypothesis on the header and
  metadata bytes), are one clear ColibriError naming the file.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import colibri
from colibri.convert import convert
from colibri.errors import ColibriError
from colibri.modeldir import MappedModelDir, ModelDir

gguf = pytest.importorskip("gguf", reason="the gguf package (pip install 'colibri-moe[gguf]')")
from colibri.gguf_import import GGUFCheckpoint, _unpermuted_rows  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
GGUF_DIR = FIXTURES / "gguf"
SILENT = {"log": lambda *a: None}
REL_TOL = 1e-4  # |Δlogit| / max|logit| against transformers, as in test_models.py


def logits(model_dir, case):
    ref = np.load(FIXTURES / case / "reference.npz")
    m = colibri.load(model_dir)
    try:
        return m.forward(ref["input_ids"].tolist()), ref
    finally:
        m.close()


def rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """{(gguf name, quantize, layout): model dir}, each import made once."""
    made = {}
    root = tmp_path_factory.mktemp("gguf")

    def get(name, quantize=None, layout=None):
        key = (name, quantize, layout)
        if key not in made:
            out = root / f"{name}-{quantize}-{layout}"
            convert(
                None,
                out,
                quantize=quantize,
                gguf=GGUF_DIR / f"{name}.gguf",
                expert_layout=layout,
                layout=layout,
                **SILENT,
            )
            made[key] = out
        return made[key]

    return get


@pytest.fixture(scope="module")
def from_hf(tmp_path_factory):
    made = {}
    root = tmp_path_factory.mktemp("hf")

    def get(case, quantize):
        if (case, quantize) not in made:
            out = root / f"{case}-{quantize}"
            convert(FIXTURES / case / "hf", out, quantize=quantize, **SILENT)
            made[case, quantize] = out
        return made[case, quantize]

    return get


@pytest.mark.parametrize(
    "name, case, fmt",
    [
        ("mixtral_a-F32", "mixtral_a", "f32"),
        ("qwen3moe_c-F16", "qwen3moe_c", "f16"),
        ("olmoe_a-F16", "olmoe_a", "f16"),
        ("gemma4_a-F16", "gemma4_a", "f16"),
        ("gemma4_b-F16", "gemma4_b", "f16"),
    ],
)
def test_a_float_gguf_is_the_safetensors_model(imported, from_hf, name, case, fmt):
    ours, ref = logits(imported(name), case)
    theirs, _ = logits(from_hf(case, fmt), case)
    np.testing.assert_array_equal(ours, theirs)
    assert rel(ours, ref[f"logits_{fmt}"]) <= REL_TOL
    a, b = ModelDir(imported(name)).config, ModelDir(from_hf(case, fmt)).config
    for field in (
        "architecture",
        "num_experts",
        "num_experts_per_tok",
        "norm_topk_prob",
        "head_dim",
        "num_key_value_heads",
        "moe_layers",
        "qk_norm",
        "tie_word_embeddings",
        "rope_theta",
    ):
        assert getattr(a, field) == getattr(b, field), field


def test_a_qwen2_moe_gguf_with_its_shared_expert_is_the_safetensors_model(imported, tmp_path):
    """Qwen2-MoE's shared expert and its sigmoid gate (ffn_*_shexp, ffn_gate_inp_shexp) and the
    q/k/v biases: the GGUF import equals the conversion of the checkpoint it was made from
    (tests/fixtures/gguf/qwen2moe_g/, f16: both sides hold the same numbers)."""
    convert(GGUF_DIR / "qwen2moe_g", tmp_path / "hf", quantize="f16", **SILENT)
    ids = list(range(1, 60))
    a, b = colibri.load(imported("qwen2moe_g-F16")), colibri.load(tmp_path / "hf")
    try:
        np.testing.assert_array_equal(a.forward(ids), b.forward(ids))
        assert a.config.shared_expert_intermediate_size == 64 and a.config.attention_bias
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("qtype, fmt", [("Q8_0", "int8"), ("Q4_0", "int4")])
def test_q8_0_and_q4_0_blocks_are_carried_byte_for_byte(imported, qtype, fmt):
    src = GGUF_DIR / f"mixtral_a-{qtype}.gguf"
    out = imported(f"mixtral_a-{qtype}", layout="rows")
    reader = gguf.GGUFReader(src)
    ckpt = GGUFCheckpoint(src)
    md = ModelDir(out)
    maps = MappedModelDir(md)
    heads, kv_heads = md.config.num_attention_heads, md.config.num_key_value_heads
    carried = 0
    try:
        for t in reader.tensors:
            if t.tensor_type.name != qtype:
                continue
            blocks = np.asarray(t.data, np.uint8)
            name = _ours(t.name)
            if t.name.endswith(("attn_q.weight", "attn_k.weight")):  # llama's RoPE permutation, undone
                blocks = blocks[
                    _unpermuted_rows(blocks.shape[0], heads if "attn_q" in t.name else kv_heads, src, t.name)
                ]
            if "_exps" in t.name:
                for e in range(blocks.shape[0]):
                    stored = maps.rows_array(name.format(e=e))
                    assert md.tensors[name.format(e=e)]["dtype"] == fmt
                    np.testing.assert_array_equal(stored, blocks[e].reshape(stored.shape))
                    carried += 1
            else:
                stored = maps.rows_array(name)
                assert md.tensors[name]["dtype"] == fmt
                np.testing.assert_array_equal(stored, blocks.reshape(stored.shape))
                carried += 1
    finally:
        maps.close()
    assert carried >= 10 and ckpt.default_format() == fmt


@pytest.mark.parametrize(
    "name, fmt", [("mixtral_a-Q8_0", "int8"), ("mixtral_a-Q4_0", "int4"), ("deepseekv3_a-Q8_0", "int8")]
)
def test_every_carried_matrix_holds_the_file_s_own_values(imported, name, fmt):
    """Whatever the mapping does to a tensor (llama's q/k rows, DeepSeek's per-head [rope, nope]
    query rows and [rope, latent] kv_a rows), an int8/int4 matrix of the import holds exactly the
    values of the same import at f32, which are the GGUF's dequantized values: no requantization."""
    from colibri.quant import dequantize

    qtype = name.split("-")[1]
    # a tensor of another quantized type (Q4_0 files keep one in Q8_0) is requantized: not carried
    others = {
        _ours(t.name)
        for t in gguf.GGUFReader(GGUF_DIR / f"{name}.gguf").tensors
        if t.tensor_type.name not in (qtype, "F32", "F16", "BF16")
    }
    a, b = ModelDir(imported(name, layout="rows")), ModelDir(imported(name, "f32"))
    ma, mb = MappedModelDir(a), MappedModelDir(b)
    checked = 0
    try:
        for n, t in a.tensors.items():
            if t["dtype"] != fmt or n in others:
                continue
            rows, cols = t["shape"]
            np.testing.assert_array_equal(dequantize(ma.rows_array(n), fmt, cols), mb.rows_array(n).reshape(rows, cols))
            checked += 1
    finally:
        ma.close()
        mb.close()
    assert checked >= 10


def test_a_deepseek_v3_gguf_is_the_safetensors_model(imported, from_hf):
    """llama.cpp's deepseek2: kv_b_proj comes back from attn_k_b / attn_v_b, the router, groups,
    shared experts, YaRN's mscale from yarn_log_multiplier."""
    ours, ref = logits(imported("deepseekv3_a-F32"), "deepseekv3_a")
    theirs, _ = logits(from_hf("deepseekv3_a", "f32"), "deepseekv3_a")
    np.testing.assert_array_equal(ours, theirs)
    assert rel(ours, ref["logits_f32"]) <= REL_TOL
    a, b = ModelDir(imported("deepseekv3_a-F32")).config, ModelDir(from_hf("deepseekv3_a", "f32")).config
    for field in (
        "kv_lora_rank",
        "q_lora_rank",
        "qk_nope_head_dim",
        "v_head_dim",
        "rotary_dim",
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "moe_layers",
        "norm_topk_prob",
        "attention_scale",
        "shared_expert_intermediate_size",
    ):
        assert getattr(a, field) == pytest.approx(getattr(b, field), rel=1e-6), field


def _ours(gguf_name: str) -> str:
    """Our tensor name of a GGUF one (`{e}` for the expert of a merged tensor)."""
    table = {"token_embd.weight": "embedding", "output.weight": "lm_head", "output_norm.weight": "final_norm"}
    if gguf_name in table:
        return table[gguf_name]
    _, layer, rest = gguf_name.split(".", 2)
    part = {
        "attn_q.weight": "wq",
        "attn_k.weight": "wk",
        "attn_v.weight": "wv",
        "attn_output.weight": "wo",
        "ffn_gate_inp.weight": "router",
        "attn_norm.weight": "attn_norm",
        "ffn_norm.weight": "ffn_norm",
    }.get(rest)
    if part is not None:
        return f"layers.{layer}.{part}"
    proj = rest.split("_")[1]
    return f"layers.{layer}.experts.{{e}}.{proj}"


@pytest.mark.parametrize("qtype, fmt", [("Q8_0", "int8"), ("Q4_0", "int4")])
def test_a_quantized_gguf_is_as_close_to_transformers_as_our_own_conversion(imported, from_hf, qtype, fmt):
    ours, ref = logits(imported(f"mixtral_a-{qtype}"), "mixtral_a")
    theirs, _ = logits(from_hf("mixtral_a", fmt), "mixtral_a")
    ours_err, theirs_err = rel(ours, ref["logits_f32"]), rel(theirs, ref["logits_f32"])
    # the same recipe (blocks of 32, an f16 scale); llama.cpp rounds its scale to nearest, Colibri
    # away from zero: the two differ by a rounding, not by a mistake (measured ratio 1.02, 1.01)
    assert ours_err <= 1.1 * theirs_err
    assert rel(ours, theirs) <= 0.5 * theirs_err
    # every layout holds the same numbers (the kernels sum in their own orders: float rounding)
    assert rel(ours, logits(imported(f"mixtral_a-{qtype}", layout="rows"), "mixtral_a")[0]) <= REL_TOL


def test_types_without_a_colibri_format_are_requantized_and_the_error_reported(tmp_path, imported):
    said = []
    convert(None, tmp_path / "m", gguf=GGUF_DIR / "mixtral_a-Q4_K_M.gguf", quantize="int4", log=said.append)
    report = [line for line in said if "dequantized" in line]
    assert len(report) == 1 and "Q5_0" in report[0], said
    error = float(report[0].split("Q5_0 ")[1].split()[0])
    assert 0 < error < 0.2  # two 4-bit roundings of the same weights
    assert ModelDir(tmp_path / "m").weight_dtype == "int4"
    # at int8 the file's own values are kept far more closely than any 4-bit format could
    exact, _ = logits(imported("mixtral_a-Q4_K_M", "f32"), "mixtral_a")
    at_int8, _ = logits(imported("mixtral_a-Q4_K_M", "int8"), "mixtral_a")
    at_int4, _ = logits(tmp_path / "m", "mixtral_a")
    assert rel(at_int8, exact) < rel(at_int4, exact) / 4


def test_a_gguf_s_finer_tensors_keep_their_precision_without_quantize(tmp_path, imported):
    """No --quantize: the file's type (Q4_K_M -> nl4) for most matrices, but its Q8_0 ones carried
    as int8 and its 5/6-bit ones (here Q5_0: llama-quantize's fallback for rows narrower than
    256) as int6, which holds a 5-bit block's values (its scale found by the search): the logits
    stay far closer to the file's own values than with --quantize int4; the log says so."""
    import gguf

    said = []
    convert(None, tmp_path / "m", gguf=GGUF_DIR / "mixtral_a-Q4_K_M.gguf", log=said.append)
    md = ModelDir(tmp_path / "m")
    assert md.weight_dtype == "nl4"  # general.file_type Q4_K_M -> nl4
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(GGUF_DIR / "mixtral_a-Q4_K_M.gguf").tensors}
    assert types["output.weight"] == "Q8_0" and types["blk.0.attn_q.weight"] == "Q5_0"
    assert md.tensors["lm_head"]["dtype"] == "int8" and md.tensors["layers.0.wq"]["dtype"] == "int6"
    assert md.tensors["embedding"]["dtype"] == "int6" and md.tensors["embedding"]["layout"] == "interleaved"
    (kept,) = [line for line in said if "finer precision" in line]
    assert "in int6" in kept and "in int8" in kept, kept
    (report,) = [line for line in said if "dequantized" in line]
    assert float(report.split("Q5_0 ")[1].split()[0]) < 2e-3, report  # within f16 rounding of the scales
    exact, _ = logits(imported("mixtral_a-Q4_K_M", "f32"), "mixtral_a")
    default, _ = logits(tmp_path / "m", "mixtral_a")
    at_int4, _ = logits(imported("mixtral_a-Q4_K_M", "int4"), "mixtral_a")
    assert rel(default, exact) < rel(at_int4, exact) / 4


def test_a_gpt_oss_mxfp4_gguf_is_the_checkpoint_as_llama_cpp_runs_it(tmp_path, imported):
    """gpt-oss: GGML's MXFP4 blocks (element j low, j + 16 high) reordered into Colibri's mxfp4
    losslessly, so the import equals the mxfp4 conversion of the same checkpoint run with
    llama.cpp's settings, which the GGUF does not carry: even layers sliding, the SwiGLU clamp 7."""
    import json

    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / "gpt_oss_b" / "hf", hf)
    cfg = json.loads((hf / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    cfg.update(
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)], swiglu_limit=7.0
    )
    (hf / "config.json").write_text(json.dumps(cfg))
    convert(hf, tmp_path / "hf-mxfp4", quantize="mxfp4", **SILENT)
    ours, _ = logits(imported("gpt_oss_b-BF16"), "gpt_oss_b")
    theirs, _ = logits(tmp_path / "hf-mxfp4", "gpt_oss_b")
    np.testing.assert_array_equal(ours, theirs)
    md = ModelDir(imported("gpt_oss_b-BF16"))
    assert md.weight_dtype == "mxfp4" and md.config.swiglu_limit == 7.0
    assert md.config.layer_types == cfg["layer_types"]


@pytest.fixture(scope="module")
def two_tokenizers(imported, from_hf):
    """(the tokenizer made from mixtral_a-Q8_0.gguf's metadata, the checkpoint's tokenizer.model)."""
    a, b = colibri.load(imported("mixtral_a-Q8_0")), colibri.load(from_hf("mixtral_a", "int8"))
    yield a.tokenizer, b.tokenizer
    a.close()
    b.close()


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.text(alphabet=st.characters(codec="utf-8", categories=("L", "N", "P", "Zs", "Cc")), max_size=12),
            st.sampled_from(["<s>", "</s>", "<unk>", " ", "\n", "  "]),
        ),
        max_size=6,
    ).map("".join)
)
def test_the_imported_tokenizer_gives_the_checkpoint_s_ids(two_tokenizers, text):
    """convert_hf_to_gguf.py wrote the fixture's sentencepiece vocabulary (128 pieces: most
    characters are unknown to it) into the GGUF; the tokenizer.json made from it gives the ids
    sentencepiece gives, with and without BOS, and decodes them alike."""
    ours, theirs = two_tokenizers
    for special in (True, False):
        ids = theirs.encode(text, add_special_tokens=special)
        assert ours.encode(text, add_special_tokens=special) == ids
    assert ours.decode(ids) == theirs.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)


def test_generation_stops_at_the_end_of_a_turn_too(tmp_path):
    """generation_config.json's eos_token_id: the file's eos, then its eot / eom tokens (a chat
    model's end of turn), as llama.cpp stops at every end-of-generation token."""
    import json

    ckpt = GGUFCheckpoint(GGUF_DIR / "mixtral_a-Q8_0.gguf")
    ckpt.write_text_files(tmp_path, 128)
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}
    ckpt.meta.update({"tokenizer.ggml.eot_token_id": 5, "tokenizer.ggml.eom_token_id": 2})
    ckpt.write_text_files(tmp_path, 128)
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == [2, 5]
    ckpt.meta["tokenizer.ggml.eot_token_id"] = 500  # outside the vocabulary: dropped
    ckpt.write_text_files(tmp_path, 128)
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == 2


@pytest.mark.parametrize("name, types", [("wide-Q4_K_M", {"Q4_K", "Q6_K"}), ("wide-IQ4_XS", {"IQ4_XS", "Q6_K"})])
def test_k_quants_and_iq4_xs_are_dequantized_and_requantized(tmp_path, imported, name, types):
    """Real Q4_K / Q6_K / IQ4_XS blocks (256-wide rows: tools/make_gguf_fixtures.py, "wide"):
    gguf's reference dequantization, the target format's quantization, each type's error in the
    log; at int8 the model stays far closer to the file's own values than at the default nl4, and
    nl4 closer than int4."""
    said = []
    convert(None, tmp_path / "m", gguf=GGUF_DIR / f"{name}.gguf", log=said.append)
    (report,) = [line for line in said if "dequantized" in line]
    for t in types:
        error = float(report.split(f"{t} ")[1].split()[0])
        assert 0 < error < 0.2, report
    assert ModelDir(tmp_path / "m").weight_dtype == "nl4"  # general.file_type Q4_K_M / IQ4_XS
    ids = list(range(1, 48))

    def run(d):
        m = colibri.load(d)
        try:
            return m.forward(ids)
        finally:
            m.close()

    exact = run(imported(name, "f32"))
    at_int8, default, at_int4 = run(imported(name, "int8")), run(tmp_path / "m"), run(imported(name, "int4"))
    assert rel(at_int8, exact) < 0.05 and rel(at_int8, exact) < rel(default, exact) / 3
    assert rel(default, exact) < rel(at_int4, exact)  # nl4, the default, errs less than int4


def test_a_gguf_without_a_vocabulary_converts_to_raw_ids(imported):
    md = ModelDir(imported("olmoe_a-F16"))
    assert not any(n.startswith("tokenizer") for n in md.files)


# ---- errors -------------------------------------------------------------------------------------


def _write_gguf(path: Path, arch="llama", kv=None, tensors=None):
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (kv or {}).items():
        w.add_key_value(key, value[0], value[1])
    for name, data, raw_type in tensors or []:
        w.add_tensor(name, data, raw_dtype=raw_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_an_unsupported_architecture_is_named(tmp_path):
    path = _write_gguf(
        tmp_path / "bert.gguf", arch="bert", tensors=[("token_embd.weight", np.zeros((8, 32), np.float32), None)]
    )
    with pytest.raises(ColibriError, match=r"bert\.gguf: architecture 'bert' is not supported.*llama, qwen2moe"):
        GGUFCheckpoint(path)


def test_a_dense_llama_is_refused(tmp_path):
    GT = gguf.GGUFValueType
    path = _write_gguf(
        tmp_path / "dense.gguf",
        kv={
            "llama.block_count": (1, GT.UINT32),
            "llama.embedding_length": (32, GT.UINT32),
            "llama.attention.head_count": (4, GT.UINT32),
        },
        tensors=[("token_embd.weight", np.zeros((8, 32), np.float32), None)],
    )
    with pytest.raises(ColibriError, match=r"dense\.gguf: llama\.expert_count is absent or 0"):
        GGUFCheckpoint(path)


def test_an_unknown_tensor_or_tensor_type_is_named(tmp_path):
    src = GGUF_DIR / "mixtral_a-F32.gguf"
    reader = gguf.GGUFReader(src)
    kv = {}
    for name, field in reader.fields.items():
        if name.startswith(("GGUF.", "general.architecture")) or not name.startswith("llama."):
            continue
        kv[name] = (field.contents(), field.types[0])
    tensors = [(t.name, np.asarray(t.data), None) for t in reader.tensors]
    odd = _write_gguf(
        tmp_path / "odd.gguf", kv=kv, tensors=tensors + [("blk.0.mystery.weight", np.zeros(4, np.float32), None)]
    )
    with pytest.raises(ColibriError, match=r"odd\.gguf: tensor 'blk\.0\.mystery\.weight' is not understood"):
        GGUFCheckpoint(odd)
    # a type gguf cannot decode (Q8_1: llama.cpp's activation type, 40-byte blocks of 32)
    q81 = [
        (n, np.zeros((d.shape[0], d.shape[1] // 32 * 40), np.uint8), gguf.GGMLQuantizationType.Q8_1)
        if n == "token_embd.weight"
        else (n, d, None)
        for n, d, _ in tensors
    ]
    typed = _write_gguf(tmp_path / "q81.gguf", kv=kv, tensors=q81)
    out = tmp_path / "out"
    with pytest.raises(ColibriError, match=r"q81\.gguf: tensor token_embd\.weight \(Q8_1\) cannot be read"):
        convert(None, out, gguf=typed, **SILENT)
    assert not out.exists()


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b[:10], "not a GGUF file"),
        (lambda b: b"GGUF" + struct.pack("<I", 7) + b[8:], "GGUF version 7 is not supported"),
        (lambda b: b[:8] + struct.pack("<Q", 1 << 60) + b[16:], "more than a file of"),
        (lambda b: b[:16] + struct.pack("<Q", 1 << 58) + b[24:], "more than a file of"),
        (lambda b: b[: len(b) // 3], "truncated or damaged"),
    ],
)
def test_a_damaged_header_is_one_clear_error(tmp_path, damage, message):
    data = (GGUF_DIR / "mixtral_a-Q8_0.gguf").read_bytes()
    path = tmp_path / "bad.gguf"
    path.write_bytes(damage(data))
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "convert", "--gguf", str(path), "--output-dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    (line,) = r.stderr.strip().splitlines()[-1:]
    assert line.startswith("error: ") and str(path) in line
    import re

    assert re.search(message, line), line
    assert not (tmp_path / "out").exists()


_ORIGINAL = None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(st.tuples(st.integers(0, 4095), st.integers(0, 255)), min_size=1, max_size=6),
    st.one_of(st.none(), st.integers(24, 200_000)),
)
def test_random_damage_to_the_header_and_metadata_is_a_colibri_error(tmp_path, edits, cut):
    """Bytes of the header, the metadata and the tensor table changed (or the file cut short):
    reading it is a ColibriError or a checkpoint whose every tensor can be planned -- never
    another exception, a hang or a crash."""
    global _ORIGINAL
    if _ORIGINAL is None:
        _ORIGINAL = (GGUF_DIR / "mixtral_a-Q8_0.gguf").read_bytes()
    data = bytearray(_ORIGINAL)
    for at, value in edits:
        data[at] = value
    if cut is not None:
        data = data[:cut]
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(bytes(data))
    try:
        ckpt = GGUFCheckpoint(path)
        from colibri.convert import hf_model_config, plan_tensors

        _, cfg = hf_model_config(ckpt)
        plan_tensors(ckpt, cfg, ckpt.config["architectures"][0])
    except ColibriError as e:
        assert str(path) in str(e) or "config" in str(e) or "tensor" in str(e), str(e)


@pytest.mark.parametrize(
    "name, qtype, bad",
    [
        ("olmoe_a-F16", "F16", b"\x00\x7e"),  # an f16 NaN
        ("mixtral_a-Q8_0", "Q8_0", b"\x00\x7c"),
    ],
)  # an f16 block scale inf
def test_a_non_finite_value_carried_from_the_file_is_refused(tmp_path, name, qtype, bad):
    src = GGUF_DIR / f"{name}.gguf"
    t = next(t for t in gguf.GGUFReader(src).tensors if t.tensor_type.name == qtype and len(t.shape) == 2)
    data = bytearray(src.read_bytes())
    data[t.data_offset : t.data_offset + 2] = bad
    path = tmp_path / "nan.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ColibriError, match="hold NaN or infinity"):
        convert(None, tmp_path / "out", gguf=path, **SILENT)
    assert not (tmp_path / "out").exists()


def test_the_output_may_not_replace_the_gguf_s_directory(tmp_path):
    src = tmp_path / "models" / "m.gguf"
    src.parent.mkdir()
    shutil.copyfile(GGUF_DIR / "olmoe_a-F16.gguf", src)
    with pytest.raises(ColibriError, match="--gguf"):
        convert(None, src.parent, gguf=src, force=True, **SILENT)
    assert src.exists()


def test_a_gguf_given_as_a_model_directory_says_how_to_convert_it():
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "run", "--model-dir", str(GGUF_DIR / "olmoe_a-F16.gguf"), "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "is a GGUF file; convert it" in r.stderr and "--gguf" in r.stderr


def test_without_the_gguf_package_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    with pytest.raises(ColibriError, match=r"pip install 'colibri-moe\[gguf\]'"):
        GGUFCheckpoint(GGUF_DIR / "olmoe_a-F16.gguf")
