"""GGUF test fixtures made by llama.cpp's own tools from the HF test fixtures (tests/test_gguf.py).

    python tools/make_gguf_fixtures.py --sdist /path/to/llama_cpp_python-0.3.36 \
        --quantize-bin /path/to/llama-quantize [--out tests/fixtures/gguf]

For each case: llama.cpp's convert_hf_to_gguf.py (from the sdist's vendor/llama.cpp, run in this
process) writes the checkpoint as an F32 or F16 GGUF, and llama-quantize makes the quantized ones.
Needs torch (convert_hf_to_gguf imports it) and what that script needs; the tests need neither.

  mixtral_a  (llama + experts, its sentencepiece tokenizer.model: 128 pieces)
             F32, Q8_0, Q4_0, Q4_K_M (the 64- and 48-wide rows leave Q4_K to its fallbacks,
             Q5_0 and Q8_0: the requantization path)
  qwen3moe_c, olmoe_a  F16, with no vocabulary: these fixtures have no tokenizer, and the
             script's vocabulary step is skipped (set_vocab replaced by a no-op) -- every tensor
             and every other metadata key is the script's own. (llama.cpp's qwen2moe/qwen3moe
             graphs have no dense layers: the fixtures with mlp_only_layers or a sparse step
             cannot be converted; qwen3moe_c and olmoe_a route as llama.cpp's graphs do.)
  gpt_oss_b  BF16 with its MXFP4 experts as the script repacks them (GGML's nibble order), no
             vocabulary.
  deepseekv3_a  F32 and Q8_0 (llama.cpp's deepseek2: kv_b_proj split into attn_k_b / attn_v_b, the
             multi-token-prediction layer left out), no vocabulary.
  gemma4_a, gemma4_b  F16, no vocabulary (the script reads tokenizer.json for the embedding's
             row count: a placeholder with vocab_size tokens stands in for it).
  wide       Q4_K_M and IQ4_XS of a one-layer Mixtral with 256-wide rows (WIDE, made here from a
             seed): real Q4_K, Q6_K and IQ4_XS blocks for the requantization path.
  qwen2moe_g  F16 of a Qwen2-MoE without dense layers (QWEN2MOE, made here from a seed, its
             safetensors kept in tests/fixtures/gguf/qwen2moe_g/): the shared expert and its gate.

Deterministic for the same sdist, torch and checkpoint (the GGUF writer has no timestamps).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"

CASES = {  # case: (outtype of the script, quantized types, keep the vocabulary)
    "mixtral_a": ("f32", ("Q8_0", "Q4_0", "Q4_K_M"), True),
    "qwen3moe_c": ("f16", (), False),
    "olmoe_a": ("f16", (), False),
    "gpt_oss_b": ("bf16", (), False),
    "deepseekv3_a": ("f32", ("Q8_0",), False),
    "gemma4_a": ("f16", (), False),
    "gemma4_b": ("f16", (), False),
    "wide": ("f32", ("Q4_K_M", "IQ4_XS"), True),
    "qwen2moe_g": ("f16", (), False),
}
NOT_KEPT = {"wide-F32.gguf"}  # the wide checkpoint's float file: only its quantized ones are fixtures


# A checkpoint with 256-wide rows, so that llama-quantize's K-quants and IQ4_XS get their own
# blocks (the test fixtures' 32- to 96-wide rows fall back to Q5_0/Q8_0): one Mixtral layer, made
# here with transformers from a seed, with mixtral_a's 128-piece tokenizer.model.
WIDE = {
    "vocab_size": 128,
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
WIDE_SEED = 4096


def make_wide_checkpoint(out: Path) -> Path:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(WIDE_SEED)
    model = MixtralForCausalLM(MixtralConfig(**WIDE))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05) if p.ndim > 1 else p.fill_(1.0)
    model.save_pretrained(out)
    shutil.copyfile(FIXTURES / "mixtral_a" / "hf" / "tokenizer.model", out / "tokenizer.model")
    return out


# Qwen2-MoE as llama.cpp's graph runs it (no dense layers: every layer sparse), with its shared
# expert and that expert's sigmoid gate and the q/k/v biases. The test fixtures' Qwen2-MoE cases
# have dense layers, which llama.cpp's qwen2moe cannot hold; this checkpoint (f16, committed beside
# its GGUF: tests/fixtures/gguf/qwen2moe_g/) is the safetensors side of the comparison.
QWEN2MOE = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": False,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
QWEN2MOE_SEED = 2048


def make_qwen2moe_checkpoint(out: Path) -> Path:
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(QWEN2MOE_SEED)
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**QWEN2MOE))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15) if p.ndim > 1 else p.normal_(
                0.0, 0.3
            ) if p.numel() != model.config.hidden_size else p.uniform_(0.5, 1.5)
    model.to(torch.float16).save_pretrained(out)
    return out


def convert_case(llama_cpp: Path, case: str, outtype: str, keep_vocab: bool, out: Path) -> None:
    src = (
        FIXTURES / case / "hf"
        if case not in ("wide", "qwen2moe_g")
        else make_wide_checkpoint(Path(tempfile.mkdtemp()) / "hf")
        if case == "wide"
        else make_qwen2moe_checkpoint(FIXTURES / "gguf" / "qwen2moe_g")
    )
    if not keep_vocab and case.startswith("gemma4"):
        # the script's Gemma branch counts the vocabulary in tokenizer.json to trim the embedding
        # (even with the vocabulary step skipped): a copy of the checkpoint with a placeholder
        staged = Path(tempfile.mkdtemp(prefix="colibri-gguf-fixture-"))
        shutil.copytree(src, staged / "hf")
        cfg = json.loads((src / "config.json").read_text())
        n = cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]  # gemma4_b: the multimodal wrapper
        (staged / "hf" / "tokenizer.json").write_text(
            json.dumps({"model": {"vocab": {f"t{i}": i for i in range(n)}}, "added_tokens": []})
        )
        src = staged / "hf"
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    sys.path.insert(0, str(llama_cpp))
    import convert_hf_to_gguf as script

    original = script.get_model_class

    def model_class(name, mmproj=False):  # the classes are imported lazily, by name
        cls = original(name, mmproj)
        if not keep_vocab and not mmproj:
            cls.set_vocab = lambda self: None
        return cls

    script.get_model_class = model_class
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", str(src), "--outtype", outtype, "--outfile", str(out)]
    try:
        script.main()
    finally:
        sys.argv = argv
        script.get_model_class = original


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sdist", required=True, type=Path, help="an unpacked llama-cpp-python sdist")
    ap.add_argument("--quantize-bin", required=True, type=Path, help="llama.cpp's llama-quantize")
    ap.add_argument("--out", type=Path, default=FIXTURES / "gguf")
    args = ap.parse_args()
    llama_cpp = args.sdist / "vendor" / "llama.cpp"
    args.out.mkdir(parents=True, exist_ok=True)
    for case, (outtype, quantized, keep_vocab) in CASES.items():
        base_file = args.out / f"{case}-{outtype.upper()}.gguf"
        # one case per process: the script's model registry and patches are per process
        code = (
            f"import sys; sys.path.insert(0, {str(ROOT / 'tools')!r}); import make_gguf_fixtures as m; "
            f"from pathlib import Path; m.convert_case(Path({str(llama_cpp)!r}), {case!r}, {outtype!r}, "
            f"{keep_vocab!r}, Path({str(base_file)!r}))"
        )
        subprocess.run([sys.executable, "-c", code], check=True)
        for qtype in quantized:
            subprocess.run(
                [str(args.quantize_bin), str(base_file), str(args.out / f"{case}-{qtype}.gguf"), qtype],
                check=True,
                stdout=subprocess.DEVNULL,
            )
        if base_file.name in NOT_KEPT:
            base_file.unlink()
        print(f"{case}: {outtype.upper()}{''.join(', ' + q for q in quantized)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
