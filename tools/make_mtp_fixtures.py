#!/usr/bin/env python3
"""Multi-token-prediction (MTP) fixtures: DeepSeek-V3 and GLM-4.5 checkpoints with their next-token
layer, and the layer's logits computed by transformers' own decoder-layer classes.

Design
------
transformers runs no MTP layer (DeepseekV3ForCausalLM and Glm4MoeForCausalLM skip the
num_nextn_predict_layers layers stored after the decoder's), so the reference is assembled here
from its parts, the way vLLM's and SGLang's DeepSeek MTP modules run it:

    x_i     = eh_proj([enorm(embed(t_(i+1))) ; hnorm(h_i)])    h_i: the main model's last hidden
                                                                state after its final norm
    logits_i = head(shared_head.norm(decoder_layer(x_i)))      at RoPE position i, causal over 0..i

The decoder layer is a real transformers layer: a one-layer model of the same class (its one layer
MoE, as the MTP layer is), fed `inputs_embeds = x`, with its final norm = shared_head.norm and its
head = the main model's lm_head. The checkpoint stores the layer as layer n = num_hidden_layers
(eh_proj, enorm, hnorm, shared_head.norm, shared_head.head and embed_tokens beside the decoder
layer's tensors, as the published checkpoints name them; the head and embedding are copies of the
main model's, as they are there).

Each case starts from an existing fixture (tests/fixtures/<base>/hf, the same seeds' weights) and
adds the layer's weights from a seeded generator (matrices N(0, 0.15^2), norms 1 + 0.3 N(0, 1),
as make_fixtures.py initialises). Output: tests/fixtures/<case>/{hf/, mtp_reference.npz} (not
reference.npz: a directory with one is a case of the model suite) with input_ids [T], hidden_f32
[T, d] (the main model's h) and mtp_logits_f32 [T - 1, vocab] (position i drafts token i + 2 from
token i + 1). Needs torch and transformers (tools only):
    python tools/make_mtp_fixtures.py
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import save_npz_deterministic  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
CASES = {"deepseekv3_mtp": ("deepseekv3_a", 7101), "glm4moe_mtp": ("glm4moe_a", 7102)}


def one_layer_model(cls, config):
    """A model of `cls` with one MoE decoder layer: the MTP layer's shapes."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = 1
    cfg.first_k_dense_replace = 0
    cfg.num_nextn_predict_layers = 0
    return cls(cfg).eval()


def make(case: str, base: str, seed: int) -> None:
    import transformers

    src = FIXTURES / base
    out = FIXTURES / case
    shutil.rmtree(out, ignore_errors=True)
    (out / "hf").mkdir(parents=True)
    for name in ("config.json", "generation_config.json"):
        if (src / "hf" / name).exists():
            shutil.copy(src / "hf" / name, out / "hf" / name)
    config = transformers.AutoConfig.from_pretrained(src / "hf")
    config._attn_implementation = "eager"
    cls = getattr(transformers, config.architectures[0])
    main = cls.from_pretrained(src / "hf", dtype=torch.float32, attn_implementation="eager").eval()
    mtp = one_layer_model(cls, config)
    g = torch.Generator().manual_seed(seed)
    d = config.hidden_size
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
            elif "bias" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
        mtp.lm_head.weight.copy_(main.lm_head.weight)
        mtp.model.embed_tokens.weight.copy_(main.model.embed_tokens.weight)
        eh_proj = torch.randn((d, 2 * d), generator=g) * (0.15 / np.sqrt(2))
        enorm = 1 + 0.3 * torch.randn(d, generator=g)
        hnorm = 1 + 0.3 * torch.randn(d, generator=g)

    n = config.num_hidden_layers
    tensors = load_file(src / "hf" / "model.safetensors")
    layer = {k[len("model.layers.0.") :]: v for k, v in mtp.state_dict().items() if k.startswith("model.layers.0.")}
    for k, v in layer.items():
        tensors[f"model.layers.{n}.{k}"] = v.contiguous()
    tensors[f"model.layers.{n}.eh_proj.weight"] = eh_proj.contiguous()
    tensors[f"model.layers.{n}.enorm.weight"] = enorm.contiguous()
    tensors[f"model.layers.{n}.hnorm.weight"] = hnorm.contiguous()
    tensors[f"model.layers.{n}.shared_head.norm.weight"] = mtp.model.norm.weight.detach().clone()
    tensors[f"model.layers.{n}.shared_head.head.weight"] = main.lm_head.weight.detach().clone()
    tensors[f"model.layers.{n}.embed_tokens.weight"] = main.model.embed_tokens.weight.detach().clone()
    save_file(tensors, out / "hf" / "model.safetensors", metadata={"format": "pt"})

    ref = np.load(src / "reference.npz")
    ids = torch.tensor(ref["input_ids"][None].astype(np.int64))
    torch.set_num_threads(1)
    with torch.no_grad():
        hidden = main.model(input_ids=ids).last_hidden_state  # [1, T, d], after the final norm
        emb = main.model.embed_tokens(ids[:, 1:])
        eps = config.rms_norm_eps

        def rms(x, w):
            return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

        x = torch.cat([rms(emb, enorm), rms(hidden[:, :-1], hnorm)], -1) @ eh_proj.T
        logits = mtp(inputs_embeds=x).logits[0]
    save_npz_deterministic(
        out / "mtp_reference.npz",
        input_ids=ref["input_ids"],
        hidden_f32=hidden[0].numpy().astype(np.float32),
        mtp_logits_f32=logits.numpy().astype(np.float32),
    )
    (out / "case.json").write_text(
        json.dumps(
            {
                "case": case,
                "base": base,
                "seed": seed,
                "transformers": transformers.__version__,
                "torch": torch.__version__,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"{case}: {len(tensors)} tensors, mtp logits {tuple(logits.shape)}")


if __name__ == "__main__":
    for case, (base, seed) in CASES.items():
        make(case, base, seed)
