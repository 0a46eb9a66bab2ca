"""Train Colibri's small demo model: a ~10M-parameter Mixtral on the King James Bible.

Design
======
Why this corpus
    Debian's ``bible-kjv-text`` package: the Authorized (King James) Version, which is in the public
    domain (see /usr/share/doc/bible-kjv-text/copyright), about 4.4 MB / 31,102 verses of English
    prose, installable from the ordinary Debian archive (``apt-get install -y bible-kjv-text``; it
    pulls in ``bible-kjv``, whose ``bible`` program decompresses the text). No network download of
    a data set, no licence questions, and stylistically uniform enough that a 10M-parameter model
    trained for half an hour on one CPU core writes recognisable English.

Corpus and normalisation
    The package ships the text compressed (``/usr/lib/bible.data``, found via ``dpkg -L
    bible-kjv-text``); ``bible -f -p DIR Gen1:1-Rev22:21`` dumps one verse per line as
    ``Ge1:1 In the beginning ...``. The reference prefix is stripped (it is the only place digits
    occur), runs of whitespace are collapsed, and verses are grouped into their 1,189 chapters. A
    chapter is one *document*: its verses joined by a single space (plain prose, no numbers, no
    markup). The token stream is, per document, ``[BOS] + sp.encode(text) + [EOS]``, matching how
    ``python -m colibri run --prompt`` encodes a prompt (BOS + pieces, no EOS).

Held-out slice
    Every 50th chapter in canonical order (0-based chapter index i with i % 50 == 49): 23 chapters,
    from Genesis 50 through James 4 (Ge50 Lev10 Num33 Josh13 1Sm14 1Ki9 1Chr12 2Chr33 Job14 Psa22
    Psa72 Psa122 Prv22 Isa21 Jer5 Lam3 Eze48 Mic7 Mat21 John3 Rom4 Eph3 Jas4), 86,123 characters.
    Spread over the whole book, so it measures generalisation over all styles (law, narrative,
    poetry, prophecy, epistles). Written to ``heldout.txt``, one chapter per line, exactly the text
    that is tokenized for evaluation. The tokenizer and the model see only the other 1,166 chapters.

Tokenizer
    sentencepiece unigram, vocab 4096, trained on the training verses only (one verse per line),
    character_coverage 1.0, pad 0 / bos 1 / eos 2 / unk 3, default nmt_nfkc normalisation, no byte
    fallback (the corpus is plain ASCII; a character never seen maps to unk), input_sentence_size
    bounded at 1,000,000 (above the 30,5xx training verses, so no sampling), shuffling off,
    num_threads=1: deterministic.

Model
    transformers.MixtralForCausalLM(MixtralConfig(vocab 4096, hidden 256, 4 layers, 4 heads /
    2 KV heads (head_dim 64), expert FFN 320, 8 experts top-2, 512 positions, tied embeddings,
    rope_theta 10000, router_aux_loss_coef 0.01, output_router_logits, bos 1 / eos 2 / pad 0)):
    9,709,824 parameters (19.4 MB in bf16). Training uses sdpa attention and the "eager" experts
    implementation: measured at one thread on this machine, batch 16 x 256 tokens, one
    forward+backward+AdamW step took ~1.65 s with "eager", ~2.5 s with "grouped_mm" (CPU fallback)
    and ~30 s (batch 4!) with "batched_mm", which gathers each token's expert weights.

Training
    AdamW (betas 0.9/0.95, eps 1e-8), peak lr 3e-3, linear warmup over 100 steps then cosine decay
    to 3e-4 at the last step; weight decay 0.1 on matrices (ndim >= 2) only, none on norms; gradient
    clipping at 1.0; loss = next-token cross-entropy + 0.01 * Mixtral load-balancing loss. Each
    step is a batch of 16 windows of 257 tokens (256 inputs, 256 targets) at uniformly random
    offsets into the concatenated training stream (torch.Generator seeded). Fixed STEPS = 1250:
    a 20-step smoke run at torch.set_num_threads(1) measured 1.64 s/step (with another process
    busy on the machine's other core) and ~15 s for everything else (corpus, tokenizer, evaluation,
    saving, reference data), so 1250 steps ~ 34-35 min wall. 1250 x 16 x 256 = 5.1M tokens, ~5.2
    passes over the 981,612 training tokens. The step count is a constant, not a time budget, so a rerun is the
    same computation (seeded python/numpy/torch RNGs, torch.use_deterministic_algorithms(True),
    one thread). Every 50 steps the mean training loss of the last 50 steps is logged to stdout
    and OUT/train_progress.log; every 300 steps and at the end the held-out perplexity.

Evaluation
    Held-out perplexity: the held-out token stream cut into consecutive non-overlapping 256-token
    chunks (the final partial chunk included if it has >= 2 tokens); each chunk is run on its own
    (fresh context) and predicts its tokens 1..n-1; perplexity = exp(mean cross-entropy over all
    predicted tokens). The same measure on the first 80 chunks of the training stream is reported
    as train_eval_perplexity, to show the train/held-out gap.

Chat template
    The model knows only its training text, so its chat template (CHAT_TEMPLATE below, written as
    hf/chat_template.jinja, which `convert` carries into the model directory) renders a conversation
    as that text would tell one: the system message a passage, each user turn "And one came and
    asked him, saying, ..." ("And he asked him again, saying, ..." after the first), each reply
    "And he answered and said, ...", and the generation prompt that last phrase. The reply is then
    what the Bible would say next: plausible text, where any chat markup the model never saw would
    give garbage. The template's own comment has the details.

Outputs (OUT defaults to /work/demo_build)
    hf/                    save_pretrained, float32 safetensors, config.json, generation_config.json,
                           plus tokenizer.model and chat_template.jinja
    tokenizer.model        the same sentencepiece model
    heldout.txt            held-out chapters, one per line
    train_report.json      corpus, hyperparameters, step count, wall times, losses, perplexities
    train_progress.log     the training log
    demo_reference.npz     test reference data (np.savez_compressed), computed with eager
                           attention + eager experts in float32:
      input_ids            int64 [3, 32]: [BOS] + the first 31 tokens of held-out chapters 0, 11, 22
                           (Genesis 50, Proverbs 22, James 4)
      logits_f32_as_f16    float16 [3, 32, 4096]: f32 logits of the f32 model, stored as float16
                           (to keep the file under 2 MB: |error| <= ~0.01 for logits of size ~20)
      logits_bf16_as_f16   float16 [3, 32, 4096]: the same after rounding every parameter with
                           ndim >= 2 except the routers (mlp.gate.weight, the MixtralTopKRouter
                           modules) to bfloat16 and back -- what `convert --quantize bf16` stores
      positions            int64 [2] = (0, 31)
      logits_f32_at        float32 [3, 2, 4096]: exact f32 logits at `positions`
      logits_bf16_at       float32 [3, 2, 4096]: exact bf16-model logits at `positions`
      greedy_ids           int64 [3, 16]: the f32 model's greedy continuation of each input_ids row
                           (generate, do_sample=False, EOS disabled: exactly 16 new tokens; checked
                           against a plain argmax loop over full forwards)
      greedy_ids_bf16      int64 [3, 16]: the same for the bf16-rounded model

Packaging
    The bundled demo (int8, rows layout) is made from OUT/hf by `convert`; the model directory's
    file table then lists tokenizer.model and chat_template.jinja beside the weights, and
    `python -m colibri verify` checks them all:
      python -m colibri convert --hf-dir OUT/hf --output-dir colibri/data/demo --quantize int8 --expert-layout rows --layout rows --force

Usage
    python tools/train_demo.py                        # full run, ~35-41 min on one core
    python tools/train_demo.py --steps 20 --out /tmp/x  # smoke test
    python tools/train_demo.py --out /work/demo2_build --seed 4321 --tokenizer bpe --expert-ffn 512 --steps 800
                                                      # the second model of the nl4-against-llama.cpp comparison

Results (full run, 2026-11-29, from OUT/train_report.json)
    1250 steps in 2429 s of training (1.94 s/step: slower than the 1.64 s measured, because other
    jobs were compiling on the machine during the run), 2444 s = 40.7 min wall in all.
    Training loss (mean of the last 50 steps) 3.008; held-out perplexity 29.83 (loss 3.396) over
    20,848 predicted tokens; train-slice perplexity 18.69. Held-out perplexity by step: 300: 60.16,
    600: 41.16, 900: 33.00, 1200: 30.00, 1250: 29.83. Router aux loss ~2.0 throughout (2.0 = perfectly
    balanced for top-2 of 8).
    Greedy from "[BOS] In the beginning": "In the beginning of the LORD is in the midst of the earth,
    and in the midst of the earth. And the LORD said unto Moses, Go, take up the ark of the LORD, ..."
    Colibri (`convert --quantize f32` / `bf16`) reproduces logits_*_at to < 1e-5 and greedy_ids /
    greedy_ids_bf16 exactly; the smallest top-1/top-2 logit gap along the reference greedy paths is
    0.017. tokenizer.model md5 e6c3c15c9272c561cecf6841d1190f38 (identical across runs).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

SEED = 1234
STEPS = 1250
BATCH = 16
CONTEXT = 256
PEAK_LR = 3e-3
MIN_LR = 3e-4
WARMUP = 100
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
GRAD_CLIP = 1.0
LOG_EVERY = 50
EVAL_EVERY = 300
HELDOUT_EVERY = 50  # chapter i is held out iff i % HELDOUT_EVERY == HELDOUT_EVERY - 1
VOCAB = 4096
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
REF_CHAPTERS = (0, 11, 22)  # indices into the held-out chapters for demo_reference.npz
REF_LEN = 32
REF_NEW = 16
REF_POSITIONS = (0, 31)
TRAIN_EVAL_CHUNKS = 80

MODEL_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=320,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    rope_theta=10000.0,
    router_aux_loss_coef=0.01,
    output_router_logits=True,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
)

# the demo's chat template, as colibri/data/demo/chat_template.jinja holds it (tests/test_demo.py
# checks that the two agree): see "Chat template" above and the template's own comment
CHAT_TEMPLATE = """\
{#- The chat template of Colibri's demo model (tools/train_demo.py writes this file).

The model knows one text: the King James Bible, a chapter a document ([BOS] verses [EOS]): no
newlines, digits or quotation marks, no "User:"/"Assistant:" markers, no chat turns of any kind.
It can only continue that text. So a conversation is rendered as the Bible tells one, with the
separators between speakers it learned ("asked him, saying, ..." / "And he answered and said, ..."):

  <s>{system message, as the passage the story starts from}
  And one came and asked him, saying, {the user's words}
  And he answered and said, {the reply}
  And he asked him again, saying, {the next user's words}
  And he answered and said,               <- add_generation_prompt: the model goes on from here

A turn's words get a full stop when they end without punctuation, so the next phrase starts a
sentence. Developer messages are passages like the system's; tool results and any other role are
plain text lines. The line breaks are for the reader: the tokenizer turns a newline into a space,
as in the training text. The reply is the text that follows, in the Bible's voice: plausible words, not an
assistant's answer.
-#}
{%- macro text_of(content) -%}
{%- if content is string -%}
{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}
{%- if part is mapping and part.type == 'text' -%}{{ part.text }} {% endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- macro sentence(content) -%}
{%- set text = text_of(content) | trim -%}
{{ text }}{% if text and text[-1] not in '.?!:;,' %}.{% endif %}
{%- endmacro -%}
{%- set ns = namespace(asked=false) -%}
{{ bos_token }}
{%- for message in messages %}
{%- if message.role == 'user' %}
{{ 'And he asked him again, saying, ' if ns.asked else 'And one came and asked him, saying, ' }}{{ sentence(message.content) }}
{%- set ns.asked = true %}
{%- elif message.role == 'assistant' %}
And he answered and said, {{ sentence(message.content) }}
{%- else %}
{{ sentence(message.content) }}
{%- endif %}
{%- if not loop.last or add_generation_prompt %}

{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
And he answered and said,
{%- endif %}
"""

_REF_RE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+)$")


# ----------------------------------------------------------------------------------------- corpus


def read_kjv():
    """[(book, chapter, [verse, ...]), ...] in canonical order, from the bible-kjv-text package."""
    try:
        files = subprocess.run(
            ["dpkg", "-L", "bible-kjv-text"], check=True, capture_output=True, text=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        sys.exit("bible-kjv-text is not installed: apt-get update && apt-get install -y bible-kjv-text")
    data = [f for f in files if f.endswith("/bible.data")]
    if not data or shutil.which("bible") is None:
        sys.exit("bible.data or the `bible` program (package bible-kjv) not found")
    data = Path(data[0])
    # -f turns pretty-printing off: one verse per line, prefixed by its reference.
    raw = subprocess.run(
        ["bible", "-f", "-p", str(data.parent), "-d", data.name, "Gen1:1-Rev22:21"],
        check=True,
        capture_output=True,
        cwd="/",
    ).stdout.decode("ascii")
    chapters = []
    for line in raw.splitlines():
        ref, _, text = line.partition(" ")
        m = _REF_RE.match(ref)
        if not m:
            raise ValueError(f"unexpected line in bible output: {line[:80]!r}")
        book, chap = m.group(1), int(m.group(2))
        text = " ".join(text.split())
        if not chapters or chapters[-1][:2] != (book, chap):
            chapters.append((book, chap, []))
        chapters[-1][2].append(text)
    n_verses = sum(len(c[2]) for c in chapters)
    if n_verses != 31102 or len(chapters) != 1189:
        raise ValueError(f"expected 31102 verses in 1189 chapters, got {n_verses} in {len(chapters)}")
    return chapters


def chapter_text(ch) -> str:
    return " ".join(ch[2])


# -------------------------------------------------------------------------------------- tokenizer


def train_tokenizer(verses, path: Path, kind: str = "unigram"):
    """kind "unigram" (the demo's), or "bpe": sentencepiece BPE with byte fallback, which llama.cpp's
    tokenizer reproduces id for id (its llama vocabulary type), for side-by-side quality runs."""
    import io

    import sentencepiece as spm

    # model_writer instead of model_prefix: the prefix (an output path) would be stored in the
    # model's trainer_spec, making tokenizer.model depend on --out.
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(verses),
        model_writer=buf,
        model_type=kind,
        byte_fallback=kind == "bpe",
        vocab_size=VOCAB,
        character_coverage=1.0,
        pad_id=PAD_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        unk_id=UNK_ID,
        input_sentence_size=1_000_000,
        shuffle_input_sentence=False,
        max_sentence_length=4096,
        num_threads=1,
        minloglevel=2,
    )
    path.write_bytes(buf.getvalue())
    sp = spm.SentencePieceProcessor()
    sp.Load(str(path))
    return sp


def encode_docs(sp, texts):
    out = []
    for t in texts:
        out.append(BOS_ID)
        out.extend(sp.EncodeAsIds(t))
        out.append(EOS_ID)
    return out


# ------------------------------------------------------------------------------------------ model


def build_model(experts="eager", attn="sdpa"):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(**MODEL_CONFIG)
    return MixtralForCausalLM._from_config(cfg, attn_implementation=attn, experts_implementation=experts)


def lr_at(step, steps):
    warm = min(WARMUP, max(1, steps // 10))
    if step < warm:
        return PEAK_LR * (step + 1) / warm
    frac = (step - warm) / max(1, steps - 1 - warm)
    return MIN_LR + 0.5 * (PEAK_LR - MIN_LR) * (1 + math.cos(math.pi * min(1.0, frac)))


def perplexity(model, stream, max_chunks=None):
    import torch
    import torch.nn.functional as F

    model.eval()
    total, count = 0.0, 0
    chunks = [stream[i : i + CONTEXT] for i in range(0, len(stream), CONTEXT)]
    chunks = [c for c in chunks if len(c) >= 2][:max_chunks]
    with torch.no_grad():
        for c in chunks:
            x = torch.tensor([c], dtype=torch.long)
            logits = model(input_ids=x, output_router_logits=False).logits[0, :-1].float()
            total += F.cross_entropy(logits, x[0, 1:], reduction="sum").item()
            count += len(c) - 1
    model.train()
    return math.exp(total / count), count


# ------------------------------------------------------------------------------------- reference


def bf16_round_(model):
    """Round every parameter with ndim >= 2 except the routers to bfloat16 and back, in place."""
    import torch

    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    routers = {id(m.weight) for m in model.modules() if isinstance(m, MixtralTopKRouter)}
    rounded = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and id(p) not in routers:
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
                rounded.append(name)
    return rounded


def greedy(model, ids, n):
    """generate() with EOS disabled, checked against a plain argmax loop over full forwards."""
    import torch

    gc = model.generation_config
    gen = model.generate(
        ids,
        generation_config=type(gc)(
            max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=PAD_ID, bos_token_id=BOS_ID
        ),
    )
    new = gen[:, ids.shape[1] :]
    assert new.shape == (ids.shape[0], n), new.shape
    seq = ids.clone()
    with torch.no_grad():
        for _ in range(n):
            nxt = model(input_ids=seq, output_router_logits=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    if not torch.equal(seq[:, ids.shape[1] :], new):
        print("WARNING: generate() and the argmax loop disagree; storing the argmax loop", flush=True)
        return seq[:, ids.shape[1] :]
    return new


def write_reference(hf_dir: Path, heldout_docs_tokens, path: Path):
    import numpy as np
    import torch
    from transformers import MixtralForCausalLM

    ids = torch.tensor([([BOS_ID] + heldout_docs_tokens[i])[:REF_LEN] for i in REF_CHAPTERS], dtype=torch.long)
    model = MixtralForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    model.eval()
    with torch.no_grad():
        lf32 = model(input_ids=ids, output_router_logits=False).logits.float().numpy()
    g32 = greedy(model, ids, REF_NEW).numpy()
    rounded = bf16_round_(model)
    with torch.no_grad():
        lbf16 = model(input_ids=ids, output_router_logits=False).logits.float().numpy()
    gbf16 = greedy(model, ids, REF_NEW).numpy()
    pos = np.array(REF_POSITIONS, dtype=np.int64)
    np.savez_compressed(
        path,
        input_ids=ids.numpy().astype(np.int64),
        logits_f32_as_f16=lf32.astype(np.float16),
        logits_bf16_as_f16=lbf16.astype(np.float16),
        positions=pos,
        logits_f32_at=lf32[:, pos].astype(np.float32),
        logits_bf16_at=lbf16[:, pos].astype(np.float32),
        greedy_ids=g32.astype(np.int64),
        greedy_ids_bf16=gbf16.astype(np.int64),
    )
    return dict(
        bf16_rounded_parameters=len(rounded),
        max_abs_logit=float(np.abs(lf32).max()),
        max_abs_f32_vs_bf16=float(np.abs(lf32 - lbf16).max()),
        greedy_ids=g32.tolist(),
        greedy_ids_bf16=gbf16.tolist(),
    )


# ------------------------------------------------------------------------------------------- main


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--out", default="/work/demo_build")
    ap.add_argument("--seed", type=int, default=SEED, help="a second model: another seed")
    ap.add_argument(
        "--tokenizer",
        choices=("unigram", "bpe"),
        default="unigram",
        help="bpe: sentencepiece BPE with byte fallback (what llama.cpp tokenizes exactly)",
    )
    ap.add_argument(
        "--expert-ffn",
        type=int,
        default=MODEL_CONFIG["intermediate_size"],
        help="the experts' intermediate size (512: whole 256-blocks for llama.cpp's k-quants)",
    )
    args = ap.parse_args(argv)
    MODEL_CONFIG["intermediate_size"] = args.expert_ffn
    t_start = time.perf_counter()

    import numpy as np
    import torch
    import torch.nn.functional as F

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_f = open(out / "train_progress.log", "w")

    def log(msg):
        print(msg, flush=True)
        log_f.write(msg + "\n")
        log_f.flush()

    # corpus
    chapters = read_kjv()
    held = [c for i, c in enumerate(chapters) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    train = [c for i, c in enumerate(chapters) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    held_texts = [chapter_text(c) for c in held]
    train_texts = [chapter_text(c) for c in train]
    (out / "heldout.txt").write_text("".join(t + "\n" for t in held_texts))
    log(
        f"corpus: {len(chapters)} chapters; train {len(train)} chapters / {sum(map(len, train_texts))} chars; "
        f"held out {len(held)} chapters / {sum(len(t) + 1 for t in held_texts)} chars"
    )

    # tokenizer
    sp = train_tokenizer([v for c in train for v in c[2]], out / "tokenizer.model", args.tokenizer)
    train_stream = encode_docs(sp, train_texts)
    held_doc_tokens = [sp.EncodeAsIds(t) for t in held_texts]
    held_stream = encode_docs(sp, held_texts)
    log(
        f"tokenizer: {args.tokenizer} {sp.GetPieceSize()} pieces; train {len(train_stream)} tokens "
        f"({sum(map(len, train_texts)) / len(train_stream):.2f} chars/token), held out {len(held_stream)} tokens"
    )

    # model
    model = build_model()
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"model: {n_params} parameters, experts={model.config._experts_implementation}, "
        f"attn={model.config._attn_implementation}"
    )
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=PEAK_LR,
        betas=BETAS,
        eps=1e-8,
    )
    data = torch.tensor(train_stream, dtype=torch.long)
    gen = torch.Generator().manual_seed(args.seed)
    aux_coef = model.config.router_aux_loss_coef

    model.train()
    t_train = time.perf_counter()
    window, history, evals = [], [], []
    for step in range(args.steps):
        lr = lr_at(step, args.steps)
        for g in opt.param_groups:
            g["lr"] = lr
        offs = torch.randint(0, len(data) - CONTEXT - 1, (BATCH,), generator=gen)
        batch = torch.stack([data[o : o + CONTEXT + 1] for o in offs.tolist()])
        outp = model(input_ids=batch[:, :-1], output_router_logits=True)
        ce = F.cross_entropy(outp.logits.reshape(-1, VOCAB).float(), batch[:, 1:].reshape(-1))
        loss = ce + aux_coef * outp.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP).item()
        opt.step()
        window.append(ce.item())
        last = step + 1 == args.steps
        if (step + 1) % LOG_EVERY == 0 or last:
            el = time.perf_counter() - t_train
            mean = sum(window) / len(window)
            history.append(dict(step=step + 1, train_loss=round(mean, 4), lr=lr, seconds=round(el, 1)))
            log(
                f"step {step + 1:5d}/{args.steps}  loss {mean:.4f}  aux {outp.aux_loss.item():.3f}  "
                f"lr {lr:.2e}  gnorm {gnorm:.2f}  {el / (step + 1):.2f} s/step  elapsed {el:.0f}s"
            )
            window = []
        if (step + 1) % EVAL_EVERY == 0 and not last:
            ppl, _ = perplexity(model, held_stream)
            evals.append(dict(step=step + 1, heldout_ppl=round(ppl, 3)))
            log(f"step {step + 1:5d}  held-out perplexity {ppl:.3f}")
    train_seconds = time.perf_counter() - t_train

    # evaluation
    ppl, n_tok = perplexity(model, held_stream)
    tr_ppl, _ = perplexity(model, train_stream, max_chunks=TRAIN_EVAL_CHUNKS)
    evals.append(dict(step=args.steps, heldout_ppl=round(ppl, 3)))
    log(
        f"final: held-out perplexity {ppl:.3f} over {n_tok} predicted tokens "
        f"(loss {math.log(ppl):.4f}); train-slice perplexity {tr_ppl:.3f}"
    )

    # save
    hf = out / "hf"
    if hf.exists():
        shutil.rmtree(hf)
    model.save_pretrained(hf)
    shutil.copy(out / "tokenizer.model", hf / "tokenizer.model")
    (hf / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    ref = write_reference(hf, held_doc_tokens, out / "demo_reference.npz")
    total_seconds = time.perf_counter() - t_start
    report = dict(
        corpus=dict(
            source="Debian package bible-kjv-text (King James Version, public domain)",
            chapters=len(chapters),
            train_chapters=len(train),
            heldout_chapters=len(held),
            heldout_rule=f"0-based chapter index i with i % {HELDOUT_EVERY} == {HELDOUT_EVERY - 1}",
            heldout=[f"{c[0]} {c[1]}" for c in held],
            train_chars=sum(map(len, train_texts)),
            heldout_chars=sum(len(t) + 1 for t in held_texts),
            train_tokens=len(train_stream),
            heldout_tokens=len(held_stream),
        ),
        tokenizer=dict(
            type=f"sentencepiece {args.tokenizer}",
            vocab_size=sp.GetPieceSize(),
            pad_id=PAD_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            unk_id=UNK_ID,
        ),
        model=dict(
            MODEL_CONFIG, parameters=n_params, experts_implementation="eager", attn_implementation_training="sdpa"
        ),
        training=dict(
            steps=args.steps,
            batch=BATCH,
            context=CONTEXT,
            tokens_seen=args.steps * BATCH * CONTEXT,
            optimizer="AdamW",
            peak_lr=PEAK_LR,
            min_lr=MIN_LR,
            warmup=min(WARMUP, max(1, args.steps // 10)),
            weight_decay=WEIGHT_DECAY,
            betas=list(BETAS),
            grad_clip=GRAD_CLIP,
            seed=args.seed,
            threads=1,
            torch=torch.__version__,
        ),
        results=dict(
            final_train_loss=history[-1]["train_loss"] if history else None,
            final_train_loss_note=f"mean cross-entropy of the last <= {LOG_EVERY} training steps",
            heldout_perplexity=round(ppl, 4),
            heldout_loss=round(math.log(ppl), 4),
            heldout_predicted_tokens=n_tok,
            train_eval_perplexity=round(tr_ppl, 4),
            train_seconds=round(train_seconds, 1),
            seconds_per_step=round(train_seconds / max(1, args.steps), 3),
            total_wall_seconds=round(total_seconds, 1),
        ),
        history=history,
        heldout_evals=evals,
        reference=ref,
    )
    (out / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"done in {total_seconds:.0f}s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
