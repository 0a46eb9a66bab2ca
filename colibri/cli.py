"""`python -m colibri`: run, chat, serve, tokenizer, convert, relayout, info, verify, eval,
calibrate, bench.

Every command that only reads a model (DEMO_COMMANDS: run, chat, serve, info, verify, eval,
calibrate, bench) takes the bundled demo model when --model-dir is not given; `tokenizer`, which
writes into the model directory, and `relayout`, which writes its --output-dir from it, need it,
so nothing is ever written into the installed package. `convert` reads a checkpoint (--hf-dir or
--gguf), not a model directory.

Every mistake a user can make ends as one line on stderr and exit status 2 (1 for a failed
`verify`, 130 for Ctrl-C); never a traceback. Multi-word options also take the underscore
spelling of the original C engine (`--model_dir`, `--max_new_tokens`, `--hf_dir`, `--output_dir`,
...) as an alias.
"""

from __future__ import annotations

import argparse
import json
import signal
import os
import sys
import time
from pathlib import Path

from . import _end_startup_guard
from . import names, speculate
from .errors import ColibriError
from .interrupts import signals_deferred

LAYOUT_CHOICES = names.LAYOUTS

DEMO_DIR = Path(__file__).parent / "data" / "demo"
DEMO_COMMANDS = ("run", "chat", "serve", "info", "verify", "bench", "eval", "calibrate")  # --model-dir optional
DEMO_HELP = " (default: the bundled demo model)"
EXIT_USAGE = 2
EXIT_VERIFY_FAILED = 1
EXIT_INTERRUPTED = 130


class _ShowDefaults(argparse.HelpFormatter):
    """An option's help ends with its default, from the parser itself (so the text cannot drift),
    unless the help already says what the default is (a default of None means "decided later")."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            "default" in text
            or not action.option_strings
            or action.default in (None, argparse.SUPPRESS)
            or isinstance(action.default, bool)
            or action.default == []
        ):
            return text
        return f"{text} (default: {action.default})".lstrip()


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _ShowDefaults)
        super().__init__(*args, **kwargs)

    def error(self, message):  # one line, not usage + message
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _positive_int(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _token_list(text):
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--tokens is empty")
    return ids


QUANTIZE_CHOICES = names.FORMATS
QUANTIZE_ALIASES = {"fp32": "f32", "fp16": "f16", "4bit": "int4", "8bit": "int8"}  # the original C engine's


def _quantize_choice(text):
    value = QUANTIZE_ALIASES.get(text, text)
    if value not in QUANTIZE_CHOICES:
        raise argparse.ArgumentTypeError(
            f"choose one of {', '.join(QUANTIZE_CHOICES)} (or {', '.join(QUANTIZE_ALIASES)}), got {text!r}"
        )
    return value


def _role_choice(text):
    role, sep, fmt = text.partition("=")
    if not sep or not role or not fmt:
        raise argparse.ArgumentTypeError(f"expected ROLE=FORMAT (e.g. attention=int8), got {text!r}")
    return role, _quantize_choice(fmt)


def _number(text):
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _cache_ram(text):
    if text == "auto":
        return text
    v = _number(text)
    if not 0 <= v < 1e12:
        raise argparse.ArgumentTypeError(f"expected 'auto' or megabytes >= 0, got {text!r}")
    return v


def _draft_options(p, default: str) -> None:
    """Speculative decoding's options (colibri.speculate) of `run`, `chat`, `serve` and `bench`."""
    p.add_argument(
        "--draft",
        choices=speculate.DRAFT_SOURCES,
        default=default,
        help="speculative decoding: drafted tokens verified together, the tokens unchanged; ngram: "
        "looked up in the prompt and the reply so far; auto: ngram, and the prediction first where "
        f"one is given; none under an expert budget unless asked (default: {default})",
    )
    p.add_argument(
        "--draft-max",
        "--draft_max",
        dest="draft_max",
        type=_positive_int,
        default=None,
        help=f"drafted tokens one engine call verifies at most (default {speculate.DEFAULT_DRAFT_MAX})",
    )


def _store_options(p, default_ram) -> None:
    """The prefix store's options (colibri.kvstore) of `run`, `chat` and `serve`."""
    p.add_argument(
        "--cache-ram",
        "--cache_ram",
        dest="cache_ram",
        type=_cache_ram,
        default=default_ram,
        metavar="MB",
        help="megabytes of KV cache of earlier prompts and replies kept in RAM, restored into any "
        "place whose prompt starts with their exact tokens; 'auto': a quarter of the memory left "
        "free, at most 8 GiB; 0: none (default: " + (default_ram or "none, or auto with --kv-store") + ")",
    )
    p.add_argument(
        "--kv-store",
        "--kv_store",
        dest="kv_store",
        metavar="DIR",
        default=None,
        help="keep those prompts in DIR across restarts (one checksummed file per block of "
        "tokens, under a subdirectory per model and KV cache format)",
    )


def _memory_options(p) -> None:
    """The memory cap and the expert budget (the engine's options, and eval's)."""
    p.add_argument(
        "--memory-limit-mb",
        "--memory_limit_mb",
        dest="memory_limit_mb",
        type=float,
        default=None,
        help="stay under this many MB, page cache of the model's files included (default: the "
        "cgroup's or job's limit, else the available RAM); a model larger than it keeps "
        "the experts in use and drops the rest",
    )
    p.add_argument(
        "--expert-cache-mb",
        "--expert_cache_mb",
        dest="expert_cache_mb",
        type=float,
        default=None,
        help="keep at most this many MB of experts in memory (default: what --memory-limit-mb leaves)",
    )


def _lossy_options(p) -> None:
    """The opt-in modes that read fewer bytes under an expert budget and change the tokens."""
    p.add_argument(
        "--cache-routing",
        "--cache_routing",
        dest="cache_routing",
        type=float,
        default=None,
        metavar="LAMBDA",
        help="lossy, under an expert budget: a decoded token's router favours the experts in memory, "
        "their logits raised by LAMBDA times the logits' range (0 < LAMBDA <= 1; default off)",
    )
    p.add_argument(
        "--skip-missed",
        "--skip_missed",
        dest="skip_missed",
        type=float,
        default=None,
        metavar="F",
        help="lossy, under an expert budget: a decoded token leaves out a chosen expert that is not "
        "in memory, not its heaviest and below F / top-k of its chosen weights (0 < F <= 1; default off)",
    )


def _engine_options(p) -> None:
    """The engine's load options `run`, `chat`, `serve` and `bench` share: memory, the KV cache, the
    kernels' arithmetic, the prefill chunk and where the threads run (colibri.placement)."""
    p.add_argument(
        "--cpu-mask",
        "--cpu_mask",
        dest="cpu_mask",
        metavar="CPUS",
        default=None,
        help="run on these CPUs only, as a CPU list (0-7,16-23); the default --threads follows it",
    )
    p.add_argument(
        "--numa",
        choices=("interleave", "bind"),
        default=None,
        help="Linux: interleave the memory over the NUMA nodes of the --cpu-mask CPUs (all nodes "
        "without one), or bind it to them (one replica per node: --cpu-mask with that node's CPUs)",
    )
    _memory_options(p)
    p.add_argument(
        "--prefetch",
        choices=names.PREFETCH_MODES,
        default=None,
        help="routed: readers fetch a missing chosen expert in parallel pieces; predict: also the "
        "next layer's predicted experts (default: routed under an expert budget, else none)",
    )
    p.add_argument(
        "--eviction",
        choices=names.EVICTION_POLICIES,
        default=None,
        help=f"which expert leaves first under a budget (default: {names.DEFAULT_EVICTION})",
    )
    p.add_argument(
        "--kv-cache",
        "--kv_cache",
        dest="kv_cache",
        choices=names.KV_CACHE_TYPES,
        default="f32",
        help="the KV cache's elements: f16 halves its bytes (long contexts; keys and values rounded "
        "to f16 as they are stored, attention in f32); q8 takes about a quarter (int8 codes and "
        "one f32 scale per KV head and position) (default: f32)",
    )
    p.add_argument(
        "--bf16-products",
        "--bf16_products",
        dest="bf16_products",
        choices=names.BF16_PRODUCTS,
        default="auto",
        help="bf16 weights: bf16 rounds the activations to bf16 for AVX512_BF16's vdpbf16ps (as "
        "llama.cpp), f32 multiplies exactly in f32 (default: auto, bf16 where the CPU has it)",
    )
    p.add_argument(
        "--prefill-chunk",
        "--prefill_chunk",
        dest="prefill_chunk",
        type=_positive_int,
        default=None,
        help=f"prompt tokens run together (default {names.DEFAULT_PREFILL_CHUNK}, lowered to fit a memory "
        "limit; a value given here is kept): each expert then multiplies its share of them in one "
        "pass over its weights; the prefill scratch grows with it",
    )
    _lossy_options(p)


def _model_dir_option(p, help: str = "a converted model directory") -> None:
    """--model-dir of a command that only reads the model: the bundled demo when not given
    (_demo_default, before the command runs)."""
    p.add_argument("--model-dir", "--model_dir", dest="model_dir", default=None, help=help + DEMO_HELP)


def _model_options(p) -> None:
    """The load options `run`, `chat` and `serve` share."""
    _model_dir_option(p)
    p.add_argument(
        "--threads", type=_positive_int, default=None, help="default: the physical cores this process may use"
    )
    p.add_argument(
        "--n-ctx",
        "--n_ctx",
        dest="n_ctx",
        type=_positive_int,
        default=None,
        help="context length (default: the model's, up to 4096)",
    )
    sm = p.add_mutually_exclusive_group()
    sm.add_argument(
        "--exact-softmax",
        "--exact_softmax",
        dest="softmax_lut",
        action="store_false",
        help="routing weights from the float softmax (the default)",
    )
    sm.add_argument(
        "--softmax-lut",
        "--softmax_lut",
        dest="softmax_lut",
        action="store_true",
        help="routing weights from the uint8 softmax lookup table of the original design",
    )
    # the group's first option (a store_false) would otherwise make its dest default to True: the table
    p.set_defaults(softmax_lut=False)
    p.add_argument(
        "--no-mmap",
        action="store_true",
        help="read the weights into memory instead of mapping the files (network shares)",
    )
    _engine_options(p)
    p.add_argument("--mlock", action="store_true", help="pin the dense weights in RAM")
    p.add_argument("--warmup", action="store_true", help="read every expert once at load")
    p.add_argument("--quiet", action="store_true", help="no [INFO] lines: the generated text only")
    p.add_argument("--stats", action="store_true", help="print memory and routing counters at the end (stderr)")


def _generation_options(p, default_max: int) -> None:
    """The sampling and stopping options `run` and `chat` share. Unset sampling values take the
    checkpoint's generation_config.json defaults, then greedy."""
    p.add_argument(
        "--max-new-tokens",
        "--max_new_tokens",
        "-n",
        dest="max_new_tokens",
        type=_positive_int,
        default=default_max,
        help="the most tokens a reply may have",
    )
    p.add_argument(
        "--temperature", type=_number, default=None, help="0 = greedy (default: generation_config.json's, else 0)"
    )
    p.add_argument("--top-k", "--top_k", dest="top_k", type=int, default=None, help="0 = off")
    p.add_argument(
        "--top-p",
        "--top_p",
        dest="top_p",
        type=_number,
        default=None,
        help="1 = off (default: generation_config.json's, else 1)",
    )
    p.add_argument(
        "--min-p",
        "--min_p",
        dest="min_p",
        type=_number,
        default=None,
        help="0 = off (default: generation_config.json's, else 0)",
    )
    p.add_argument(
        "--repetition-penalty",
        "--repetition_penalty",
        "--repeat-penalty",
        dest="repetition_penalty",
        type=_number,
        default=None,
        help="transformers' repetition_penalty (1 = off)",
    )
    p.add_argument(
        "--presence-penalty",
        "--presence_penalty",
        dest="presence_penalty",
        type=_number,
        default=0.0,
        help="subtracted from the logit of every token already generated, in [-2, 2]",
    )
    p.add_argument(
        "--frequency-penalty",
        "--frequency_penalty",
        dest="frequency_penalty",
        type=_number,
        default=0.0,
        help="subtracted once per earlier occurrence of the token, in [-2, 2]",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="the sampler's random seed: the same seed, settings and prompt give the same text "
        "(default: a fresh seed each run, shown in the [INFO] Sampling line)",
    )
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable): the text ends before it")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token(s)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="colibri", description="CPU inference for Mixture-of-Experts language models")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="generate from a prompt or from token ids")
    _model_options(run)
    src = run.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text prompt ('-': read it from stdin; needs a tokenizer in the model directory)")
    src.add_argument("--prompt-file", "--prompt_file", dest="prompt_file", help="read the prompt from a UTF-8 file")
    src.add_argument("--tokens", type=_token_list, help="prompt as comma-separated token ids, e.g. 1,15,27")
    run.add_argument(
        "--chat",
        action="store_true",
        help="apply the model's chat template to the prompt (one user turn) before generating",
    )
    run.add_argument("--system", help="with --chat: a system message before the prompt")
    _generation_options(run, default_max=64)
    _store_options(run, None)
    _draft_options(run, speculate.DEFAULT_DRAFT)
    run.add_argument(
        "--prediction-file",
        "--prediction_file",
        dest="prediction_file",
        metavar="FILE",
        help="the reply expected (a file being edited, UTF-8): its tokens are drafted first",
    )
    constrain = run.add_mutually_exclusive_group()
    constrain.add_argument(
        "--json-schema",
        "--json_schema",
        dest="json_schema",
        metavar="FILE",
        help="the output is JSON that follows this JSON Schema (a UTF-8 JSON file; needs llguidance)",
    )
    constrain.add_argument(
        "--grammar",
        metavar="FILE",
        help="the output follows this Lark grammar (a UTF-8 file in llguidance's syntax: "
        "https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md)",
    )
    run.add_argument("--ids", action="store_true", help="print generated token ids instead of text")
    run.add_argument(
        "--verbose",
        action="store_true",
        help="print every layer's routing decision and each expert file's first use (stderr)",
    )

    chat = sub.add_parser("chat", help="an interactive conversation (/exit to leave, /reset to start again)")
    _model_options(chat)
    chat.add_argument("--system", help="a system message at the start of the conversation")
    _generation_options(chat, default_max=512)
    _store_options(chat, None)
    _draft_options(chat, speculate.DEFAULT_DRAFT)

    srv = sub.add_parser(
        "serve", help=f'an OpenAI-compatible HTTP server (needs the extra: pip install "{names.DISTRIBUTION}[serve]")'
    )
    _model_options(srv)
    _store_options(srv, "auto")
    _draft_options(srv, speculate.DEFAULT_DRAFT)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    srv.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    srv.add_argument(
        "--api-key",
        "--api_key",
        dest="api_key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 requests",
    )
    srv.add_argument(
        "--model-name",
        "--model_name",
        dest="model_name",
        default=None,
        help="the model id clients pass (default: the directory's name)",
    )
    srv.add_argument(
        "--max-queue",
        "--max_queue",
        dest="max_queue",
        type=_positive_int,
        default=16,
        help="requests that may wait for the engine; beyond: 503 with Retry-After",
    )
    srv.add_argument(
        "--queue-timeout",
        "--queue_timeout",
        dest="queue_timeout",
        type=_number,
        default=600.0,
        help="seconds a request may wait for the engine before a 503",
    )
    srv.add_argument(
        "--parallel",
        type=_positive_int,
        default=1,
        help="requests generated at once, their tokens decoded together in one pass over the "
        "weights (more tokens/s in all, each token later); each has its own --n-ctx of KV "
        "cache (default: 1)",
    )
    srv.add_argument(
        "--step-tokens",
        "--step_tokens",
        dest="step_tokens",
        type=_positive_int,
        default=None,
        help="with --parallel: tokens one pass runs at most, the running requests' one each and "
        "pieces of new prompts; fewer keep the running requests' tokens coming sooner, more "
        f"finish a prompt sooner (default: {names.DEFAULT_STEP_TOKENS}, at most the prefill chunk)",
    )

    tok = sub.add_parser(
        "tokenizer", help="add or replace the tokenizer, chat template and generation config files of a model directory"
    )
    tok.add_argument(
        "--model-dir",
        "--model_dir",
        dest="model_dir",
        required=True,
        help="the model directory to write the text files into",
    )
    tok.add_argument(
        "--from",
        dest="source",
        required=True,
        help="a directory holding tokenizer.json / tokenizer.model / tokenizer_config.json / "
        "chat_template.jinja / generation_config.json ... (e.g. the HF checkpoint)",
    )

    conv = sub.add_parser(
        "convert", help="convert a Hugging Face checkpoint or a GGUF file into a Colibri model directory"
    )
    source = conv.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf-dir", "--hf_dir", dest="hf_dir", help="a Hugging Face checkpoint directory")
    source.add_argument(
        "--gguf",
        help="a llama.cpp GGUF model file (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss, DeepSeek-V3/Kimi K2, "
        "Gemma 4; needs the "
        f"gguf package: pip install '{names.DISTRIBUTION}[gguf]'); its Q8_0/Q4_0/MXFP4 blocks are kept as "
        "int8/int4/mxfp4, its tokenizer and chat template are made into the directory's files",
    )
    conv.add_argument(
        "--output-dir",
        "--output_dir",
        dest="output_dir",
        required=True,
        help="the model directory to write (it must not exist, unless --force)",
    )
    conv.add_argument(
        "--quantize",
        type=_quantize_choice,
        default=None,
        help="storage of the weight matrices: f32, f16, bf16, int8, int4, nl4 (4-bit, a non-linear "
        "codebook with a scale per 16 weights: less error than int4 in the same bytes) or int6 "
        "(6.5 bits a weight: e.g. --role head=int6 beside 4-bit experts), or mxfp4 (the routed experts in mxfp4 -- kept as they are "
        "from a gpt-oss mxfp4 checkpoint --, the other matrices in bf16); norms, biases and "
        "routers stay f32; the original engine's fp16 and 4bit are accepted (default: f32 for --hf-dir; for --gguf the format closest to the "
        "file's: int8 for Q8_0, int4 for Q4_0 and the 4-bit K/IQ types, f16/bf16/f32 as they are)",
    )
    conv.add_argument(
        "--role",
        action="append",
        default=[],
        metavar="ROLE=FORMAT",
        type=_role_choice,
        help="store the matrices of one role in another format than --quantize (repeatable): "
        "roles experts, shared (shared experts), dense (dense layers' MLPs), attention, head "
        "(the output head, or the tied embedding), embedding (an untied one); e.g. --quantize "
        "nl4 --role attention=int6 --role head=int6. The log gives the bytes a decoded token "
        "reads, by role",
    )
    conv.add_argument(
        "--importance",
        default=None,
        metavar="FILE",
        help="a file made by `calibrate` (the same checkpoint, any format): int8/int4/nl4/int6 scales "
        "(and nl4's codes) are chosen to minimise the rounding error weighted by each input's "
        "mean square",
    )
    conv.add_argument(
        "--ln-quant",
        "--ln_quant",
        dest="ln_quant",
        choices=("int16",),
        default=None,
        help="store norm weights as int16 with a float scale (default: f32)",
    )
    conv.add_argument(
        "--expert-layout",
        "--expert_layout",
        dest="expert_layout",
        choices=LAYOUT_CHOICES,
        default=None,
        help="storage order of the experts' matrices: rows [out, in], transposed [in, out] or "
        "interleaved (groups of 8 outputs, 4 inputs at a time); each format has some of "
        "them (docs/format.md: nl4 and int6 only interleaved, mxfp4 no transposed, f32 "
        "and f16 no interleaved) (default: the faster for the format)",
    )
    conv.add_argument(
        "--layout",
        choices=LAYOUT_CHOICES,
        default=None,
        help="the same for the other weight matrices (attention, dense MLPs, lm_head, a tied "
        "embedding); an untied embedding is always rows",
    )
    conv.add_argument(
        "--force",
        action="store_true",
        help="replace an existing Colibri model directory (never another directory, the input, or through a symlink)",
    )

    rel = sub.add_parser("relayout", help="rewrite a model directory's weights in other layouts (no HF checkpoint)")
    rel.add_argument("--model-dir", "--model_dir", dest="model_dir", required=True, help="the model directory to read")
    rel.add_argument(
        "--output-dir", "--output_dir", dest="output_dir", required=True, help="the model directory to write"
    )
    rel.add_argument(
        "--expert-layout",
        "--expert_layout",
        dest="expert_layout",
        choices=LAYOUT_CHOICES,
        default=None,
        help="as for convert (default: the faster for the format)",
    )
    rel.add_argument("--layout", choices=LAYOUT_CHOICES, default=None, help="as for convert")
    rel.add_argument(
        "--force",
        action="store_true",
        help="replace an existing Colibri model directory (never another directory, the input, or through a symlink)",
    )

    info = sub.add_parser("info", help="describe a model directory")
    _model_dir_option(info)

    ver = sub.add_parser("verify", help="check every file of a model directory against its sha256")
    _model_dir_option(ver)
    ev = sub.add_parser("eval", help="perplexity of a text; KL divergence against a reference directory")
    _model_dir_option(ev)
    ev.add_argument("--text", required=True, help="a UTF-8 text file")
    ev.add_argument("--ctx", type=_positive_int, default=256, help="tokens per chunk (default 256)")
    ev.add_argument(
        "--reference-dir",
        "--reference_dir",
        dest="reference_dir",
        help="the same model in another format: report KL divergence, top-1 agreement, RMS delta p",
    )
    ev.add_argument(
        "--threads", type=_positive_int, default=None, help="default: the physical cores this process may use"
    )
    ev.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    ev.add_argument(
        "--one-token-steps",
        "--one_token_steps",
        dest="one_token_steps",
        action="store_true",
        help="run the model one token an engine call, as decoding does (a decode-only mode acts there)",
    )
    _memory_options(ev)
    _lossy_options(ev)

    cal = sub.add_parser("calibrate", help="activation statistics of a text, for convert --importance")
    _model_dir_option(cal, help="a conversion of the checkpoint (f32, bf16 or int8 is best)")
    cal.add_argument("--text", required=True, help="a UTF-8 text file, representative of the use")
    cal.add_argument("--output", required=True, help="the importance file to write (.npz)")
    cal.add_argument("--ctx", type=_positive_int, default=512, help="tokens per chunk (default 512)")
    cal.add_argument(
        "--max-tokens",
        "--max_tokens",
        dest="max_tokens",
        type=_positive_int,
        default=None,
        help="use at most this many tokens of the text",
    )
    cal.add_argument(
        "--threads", type=_positive_int, default=None, help="default: the physical cores this process may use"
    )
    cal.add_argument(
        "--second-moments",
        "--second_moments",
        dest="second_moments",
        default="auto",
        choices=("auto", "diag", "dense", "all"),
        help="which matrices also collect their input's whole second moment, with which convert "
        "compensates each rounding error (GPTQ): dense = all but the routed experts, all = "
        "the experts too (small models), diag = none; auto (default): dense as far as it "
        "fits 4 GB, the head first",
    )

    bench = sub.add_parser("bench", help="measure load time, prefill and decode speed, latency, peak RSS")
    _model_dir_option(bench)
    bench.add_argument(
        "--prompt-len",
        "--prompt_len",
        dest="prompt_len",
        type=_positive_int,
        default=128,
        help="prompt tokens per repetition",
    )
    bench.add_argument("--gen", type=_positive_int, default=64, help="tokens to decode per repetition")
    bench.add_argument(
        "--repeat", type=_positive_int, default=5, help="how many times the prompt and the decode are timed"
    )
    bench.add_argument("--threads", type=_positive_int, default=None, help="default: all cores")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    bench.add_argument(
        "--n-ctx",
        "--n_ctx",
        dest="n_ctx",
        type=_positive_int,
        default=None,
        help="context length (default: prompt + gen, at least the model's up to 4096)",
    )
    bench.add_argument(
        "--read-bandwidth",
        "--read_bandwidth",
        dest="read_bandwidth",
        action="store_true",
        help="also time a plain read of a buffer past the last-level cache (512 MB or more) by the "
        "same threads, before and after the runs, and report decode's memory read against it",
    )
    _engine_options(bench)
    _draft_options(bench, "none")
    return p


def main(argv=None) -> int:
    args = None
    try:
        _end_startup_guard()  # Ctrl-C is a KeyboardInterrupt from here on (colibri/__init__.py)
        _note_interrupts()
        args = build_parser().parse_args(argv)
        _demo_default(args)
        if hasattr(args, "cpu_mask"):
            from .placement import place

            placed = place(args.cpu_mask, args.numa)  # before any thread of the engine starts
            if placed and not getattr(args, "quiet", False):
                print(f"[INFO] Placement: {placed}", file=sys.stderr)
        return {
            "run": cmd_run,
            "chat": cmd_chat,
            "serve": cmd_serve,
            "tokenizer": cmd_tokenizer,
            "convert": cmd_convert,
            "relayout": cmd_relayout,
            "info": cmd_info,
            "verify": cmd_verify,
            "bench": cmd_bench,
            "eval": cmd_eval,
            "calibrate": cmd_calibrate,
        }[args.command](args)
    except ColibriError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\n[INFO] Interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ImportError as e:
        # Ctrl-C inside an import that C code runs (numpy's extension importing datetime) comes
        # back as that module's ImportError, the KeyboardInterrupt as its cause
        if _interrupted or _caused_by(e, KeyboardInterrupt):
            print("\n[INFO] Interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        raise
    except (MemoryError, OverflowError, RecursionError, ValueError) as e:
        # an input so large or deep that a step failed before its own check: still one line
        # (isinstance, not the exact type: numpy's "Unable to allocate" is a MemoryError subclass)
        what = (
            "out of memory"
            if isinstance(e, MemoryError)
            else "input nested too deeply"
            if isinstance(e, RecursionError)
            else type(e).__name__
        )
        command = args.command if args is not None else "the command line"
        print(
            f"error: {what}: {' '.join(str(e).split())[:300] or 'no details'} (while running {command}; check "
            f"the sizes in the model's config.json and the flags)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    except BaseException as e:
        from .tokenizer import is_panic

        if not is_panic(e):
            raise
        # a Rust panic in `tokenizers` outside Tokenizer's own calls (which make it a ColibriError)
        print(f"error: the tokenizers library failed: {' '.join(str(e).split())[:300]}", file=sys.stderr)
        return EXIT_USAGE


_interrupted = False  # a SIGINT has arrived (an import that C code runs may swallow its KeyboardInterrupt)


def _interrupt(signum, frame):
    global _interrupted
    _interrupted = True
    signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt


def _note_interrupts() -> None:
    """SIGINT keeps raising KeyboardInterrupt, and also records that it came (_interrupted)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where it is ignored
        signal.signal(signal.SIGINT, _interrupt)


def _caused_by(e: BaseException, kind: type) -> bool:
    """Whether `kind` is somewhere in e's chain of causes and contexts."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _describe(m) -> str:
    c = m.config
    return (
        f"{c.architecture}, {c.num_hidden_layers} layers, {c.num_experts} experts, "
        f"top-{c.num_experts_per_tok}, {m.weight_dtype}"
    )


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _info(args, text: str) -> None:
    """An [INFO] line: always on stderr, never between the generated text's pieces; --quiet drops it."""
    if not getattr(args, "quiet", False):
        print(f"[INFO] {text}", file=sys.stderr, flush=True)


def _demo_default(args) -> None:
    """A command of DEMO_COMMANDS given no --model-dir reads the bundled demo model; args.model_note
    says which ("the bundled demo model" or "model", for the Loaded line)."""
    args.model_note = "model"
    if args.command in DEMO_COMMANDS and args.model_dir is None:
        if not (DEMO_DIR / "config.json").is_file():
            raise ColibriError(
                "no --model-dir given and this installation has no bundled demo model; "
                "pass --model-dir D (make one with: python -m colibri convert)"
            )
        args.model_dir, args.model_note = str(DEMO_DIR), "the bundled demo model"


def _load(args):
    from .model import load

    m = load(
        args.model_dir,
        threads=args.threads,
        n_ctx=args.n_ctx,
        mmap=not args.no_mmap,
        exact_softmax=not args.softmax_lut,
        prefetch=args.prefetch,
        expert_cache_mb=args.expert_cache_mb,
        mlock=args.mlock,
        warmup=args.warmup,
        memory_limit_mb=args.memory_limit_mb,
        eviction=args.eviction,
        kv_cache=args.kv_cache,
        bf16_products=args.bf16_products,
        parallel=getattr(args, "parallel", 1),
        prefill_chunk=args.prefill_chunk,
        cache_ram_mb=getattr(args, "cache_ram", None),
        kv_store=getattr(args, "kv_store", None),
        skip_missed=args.skip_missed,
        cache_routing=args.cache_routing,
    )
    m.cli_note = args.model_note
    return m


def _loaded_note(args, m) -> None:
    """Printed once the request has passed its checks (an error stays the only line on stderr)."""
    _info(
        args,
        f"Loaded {m.cli_note} from {m.path} ({_describe(m)}) in {m.stats['load_seconds'] * 1000:.0f} ms, "
        f"{m.threads} threads",
    )
    for name in m.unlisted_text_files:
        _err(
            f"[WARN] {m.path}/{name} is not in config.json's file table and is ignored; add it with: "
            f"python -m colibri tokenizer --model-dir {m.path} --from DIR_WITH_{name}"
        )


def _generation_kwargs(args) -> dict:
    draft = {"draft": None if args.draft == speculate.DEFAULT_DRAFT else args.draft, "draft_max": args.draft_max}
    return dict(
        **draft,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop_at_eos=not args.ignore_eos,
    )


def _read_option_file(option: str, name: str) -> str:
    """The text of a file an option names (UTF-8), or one line naming the option and the file."""
    path = Path(name)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ColibriError(f"{option} {path}: {e.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ColibriError(
            f"{option} {path} is not valid UTF-8 (byte {e.start}: {data[e.start : e.start + 4]!r})"
        ) from None


def _constraint_kwargs(args) -> dict:
    """run's --json-schema FILE (the parsed JSON) / --grammar FILE (its text), as generate()'s keywords."""
    if args.json_schema is not None:
        text = _read_option_file("--json-schema", args.json_schema)
        try:
            schema = json.loads(text)
        except ValueError as e:
            where = f" (line {e.lineno}, column {e.colno}: {e.msg})" if isinstance(e, json.JSONDecodeError) else ""
            raise ColibriError(f"--json-schema {args.json_schema} is not JSON{where}") from None
        if not isinstance(schema, dict):
            raise ColibriError(
                f"--json-schema {args.json_schema}: expected a JSON object (a JSON Schema), got {type(schema).__name__}"
            )
        return {"json_schema": schema}
    if args.grammar is not None:
        return {"grammar": _read_option_file("--grammar", args.grammar)}
    return {}


def _read_prompt(args) -> str | None:
    """--prompt TEXT, --prompt - (stdin) or --prompt-file F, as text (None: --tokens)."""
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ColibriError(f"--prompt-file {path}: {e.strerror}") from None
        where = str(path)
    elif args.prompt == "-":
        data, where = sys.stdin.buffer.read(), "the prompt on stdin"
    elif args.prompt is not None:
        return args.prompt
    else:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ColibriError(f"{where} is not valid UTF-8 (byte {e.start}: {data[e.start : e.start + 4]!r})") from None


def _speed_line(m) -> str:
    st = m.stats
    rate = lambda n, t: f"{n / t:.1f} tok/s" if t > 0 and n else "-"  # noqa: E731
    reused = f", {st['reused_tokens']} reused from the cache" if st.get("reused_tokens") else ""
    return (
        f"Prompt: {st['prefill_tokens']} tokens in {st['prefill_seconds'] * 1000:.0f} ms "
        f"({rate(st['prefill_tokens'], st['prefill_seconds'])}){reused}; generated "
        f"{len(m.last_generation.tokens)} tokens in {st['decode_seconds'] * 1000:.0f} ms "
        f"({rate(st['decode_tokens'], st['decode_seconds'])}){_speculation_note(m.last_generation.speculation)}"
    )


def _speculation_note(spec) -> str:
    if spec is None or not spec.drafted:
        return ""
    return f"; {spec.accepted} of {spec.drafted} drafted tokens accepted in {spec.chunks} verifications"


def _sampling_note(args, m) -> None:
    g = m.last_generation
    taken = g.from_generation_config
    note = g.sampler.describe()
    if taken:
        note += f" ({', '.join(taken)} from {Path(m.generation_defaults.source).name}; flags override)"
    if args.seed is None and g.sampler.temperature != 0.0:  # greedy needs no seed
        seed = g.sampler.seed
        if f"seed {seed}" not in note:
            note += f", seed {seed}"
        note += f" (drawn for this run; --seed {seed} repeats it)"
    _info(args, f"Sampling: {note}")


def cmd_run(args) -> int:
    if args.system is not None and not args.chat:
        raise ColibriError("--system needs --chat")
    text = _read_prompt(args)
    constraint = _constraint_kwargs(args)
    m = _load(args)
    if text is not None and m.tokenizer is None:
        raise ColibriError(
            f"{m.path} has no tokenizer (tokenizer.json or tokenizer.model): pass the prompt as "
            f"--tokens 1,2,3, or add one with: python -m colibri tokenizer --model-dir {m.path} --from HF_DIR"
        )
    if args.chat:
        if text is None:
            raise ColibriError("--chat needs a text prompt (--prompt or --prompt-file)")
        messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + [
            {"role": "user", "content": text}
        ]
        ids = m.apply_chat_template(messages, add_generation_prompt=True)
    else:
        ids = m.encode(text) if text is not None else args.tokens
    as_text = m.tokenizer is not None and not args.ids
    if args.stop and not as_text:
        raise ColibriError("--stop needs text output (a tokenizer, and no --ids)")
    on_step = _verbose_printer(m) if args.verbose else None
    kwargs = {**_generation_kwargs(args), **constraint}
    if args.prediction_file is not None:
        kwargs["prediction"] = _read_option_file("--prediction-file", args.prediction_file)
    if as_text:
        pieces = m.stream(ids, args.max_new_tokens, stop=args.stop, on_step=on_step, **kwargs)
    else:
        pieces = (
            ("" if i == 0 else " ") + str(t)
            for i, t in enumerate(m.generate(ids, args.max_new_tokens, on_step=on_step, **kwargs))
        )
    _loaded_note(args, m)
    _sampling_note(args, m)
    written = 0  # --ids: the token ids printed (a text piece may hold several or none)
    try:
        for piece in pieces:
            with signals_deferred((signal.SIGINT,)):
                sys.stdout.write(piece)
                sys.stdout.flush()
                written += 1
    except KeyboardInterrupt:
        print(flush=True)
        g = m.last_generation
        # a Ctrl-C between a token's sampling and its printing: say what the user saw (--ids)
        count = (len(g.tokens) if g else 0) if as_text else written
        _info(args, f"Interrupted after {count} tokens")
        return EXIT_INTERRUPTED
    print(flush=True)
    _info(args, _speed_line(m))
    if args.stats:
        _print_stats(m)
    return 0


def cmd_chat(args) -> int:
    m = _load(args)
    if m.tokenizer is None or m.chat_template is None:
        what = "tokenizer" if m.tokenizer is None else "chat template"
        raise ColibriError(
            f"{m.path} has no {what}: chat needs one (add it with: python -m colibri tokenizer "
            f"--model-dir {m.path} --from HF_DIR)"
        )
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    history = list(system)
    kwargs = _generation_kwargs(args)
    _loaded_note(args, m)
    _info(args, "Chat: type a message and Enter; /reset starts again, /exit (or Ctrl-D) leaves, Ctrl-C stops a reply")
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        try:
            line = sys.stdin.buffer.readline()
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 0
        if not line:
            return 0
        try:
            user = line.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as e:
            print(f"error: the message is not valid UTF-8 (byte {e.start}); type it again", file=sys.stderr)
            continue
        if user.strip() in ("/exit", "/quit"):
            return 0
        if user.strip() == "/reset":
            history = list(system)
            _info(args, "Conversation reset")
            continue
        if not user.strip():
            continue
        history.append({"role": "user", "content": user})
        reply = []
        try:
            ids = m.apply_chat_template(history, add_generation_prompt=True)
            room = m.n_ctx - len(ids)
            if room < 1:
                history.pop()
                print(
                    f"error: the conversation ({len(ids)} tokens) fills the context of {m.n_ctx}; /reset to "
                    f"start again (or --n-ctx)",
                    file=sys.stderr,
                )
                continue
            pieces = m.stream(ids, min(args.max_new_tokens, room), stop=args.stop, **kwargs)
            first = True
            try:
                for piece in pieces:
                    if first:
                        _sampling_note(args, m)
                        first = False
                    with signals_deferred((signal.SIGINT,)):  # the history keeps what was shown
                        sys.stdout.write(piece)
                        sys.stdout.flush()
                        reply.append(piece)
            except KeyboardInterrupt:
                pieces.close()
                _info(args, "(reply stopped)")
        except ColibriError as e:
            history.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        print(flush=True)
        history.append({"role": "assistant", "content": "".join(reply)})
        _info(args, _speed_line(m))
        if args.stats:
            _print_stats(m)


def cmd_serve(args) -> int:
    from .modeldir import ModelDir
    from .serve.app import _need_stack, serve

    _need_stack()
    if not 0 <= args.port <= 65535:
        raise ColibriError(f"--port must be in 0..65535, got {args.port}")
    if not args.queue_timeout > 0:
        raise ColibriError(f"--queue-timeout must be a positive number of seconds, got {args.queue_timeout}")
    ModelDir(args.model_dir)  # a bad directory fails now, not in the background
    if args.kv_store is not None:  # so do the prefix store's options (the load checks them again)
        if args.cache_ram == 0:
            raise ColibriError(f"--kv-store {args.kv_store} needs a prefix store: --cache-ram is 0")
        if os.path.exists(args.kv_store) and not os.path.isdir(args.kv_store):
            raise ColibriError(f"--kv-store {args.kv_store} is not a directory")

    def load():
        m = _load(args)
        if m.tokenizer is None:
            raise ColibriError(f"{m.path} has no tokenizer: the server needs one")
        _loaded_note(args, m)
        return m

    name = args.model_name or Path(args.model_dir).resolve().name
    if args.parallel > names.MAX_PARALLEL:
        raise ColibriError(f"--parallel must be in 1..{names.MAX_PARALLEL}, got {args.parallel}")
    if getattr(args, "draft", None) == "mtp" and args.parallel > 1:
        raise ColibriError(
            "--draft mtp drafts for one sequence at a time (the multi-token-prediction block's KV cache "
            "holds one): serve it with --parallel 1, or use --draft ngram / auto"
        )
    if args.step_tokens is not None and args.parallel == 1:
        raise ColibriError(
            "--step-tokens sets how a --parallel server's passes mix requests: give --parallel N (N > 1) too"
        )
    if args.prefill_chunk is not None and args.parallel > args.prefill_chunk:
        raise ColibriError(
            f"--parallel {args.parallel} exceeds --prefill-chunk {args.prefill_chunk} (a pass's tokens "
            f"hold one of each sequence decoded together)"
        )
    serve(
        load,
        name,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_queue=args.max_queue,
        queue_timeout=args.queue_timeout,
        log=lambda line: _info(args, line[len("[INFO] ") :]),
        parallel=args.parallel,
        step_tokens=args.step_tokens,
        draft={
            k: v
            for k, v in (
                ("draft", None if args.draft == speculate.DEFAULT_DRAFT else args.draft),
                ("draft_max", args.draft_max),
            )
            if v is not None
        },
    )
    return 0


def cmd_tokenizer(args) -> int:
    from .textfiles import import_text_files

    import_text_files(args.model_dir, args.source, log=lambda line: print(line, file=sys.stderr))
    return 0


def _print_stats(m) -> None:
    st = m.memory_stats()
    mb = lambda b: "-" if b is None else f"{b / 1e6:.1f} MB"  # noqa: E731
    hit = st["prediction_hit_rate"]
    per = st["prefetched_per_used_byte"]
    _err(f"[STATS] experts used per layer: {' '.join(map(str, st['experts_used_per_layer']))}")
    _err(f"[STATS] {m.residency.plan.describe()}")
    _err(
        f"[STATS] resident experts: {mb(st['resident_expert_bytes'])} (peak {mb(st['peak_resident_expert_bytes'])}, "
        f"budget {mb(st['expert_budget_bytes'])}, released {st['experts_released']}); "
        f"in memory by the OS's count: {mb(st['expert_bytes_in_memory'])}"
    )
    rate = st["cache_hit_rate"]
    if rate is not None:
        _err(
            f"[STATS] expert cache: hit rate {100 * rate:.1f} % ({st['cache_hits']} hits, {st['cache_misses']} "
            f"misses), {st['prefetches']} prefetched ({st['prefetch_hits']} used), {st['experts_dropped']} dropped"
        )
    if m.skip_missed is not None:
        _err(f"[STATS] --skip-missed {m.skip_missed}: {st['experts_skipped']} expert uses left out (lossy)")
    if m.cache_routing is not None:
        _err(f"[STATS] --cache-routing {m.cache_routing}: {st['experts_rerouted']} expert choices changed (lossy)")
    if st["bytes_read_from_storage"] is not None:
        _err(
            f"[STATS] read from storage since load: {mb(st['bytes_read_from_storage'])}"
            + (
                ""
                if st["cgroup_peak_bytes"] is None
                else f"; cgroup usage {mb(st['cgroup_usage_bytes'])}, peak {mb(st['cgroup_peak_bytes'])}"
            )
        )
    _err(
        f"[STATS] prefetch: {st['prefetch_calls']} calls, {mb(st['prefetch_bytes'])}"
        f"{'' if per is None else f', {per:.2f} bytes per byte used'}"
        f"{'' if hit is None else f', prediction hit rate {100 * hit:.1f} %'}"
    )
    _err(
        f"[STATS] page faults: {st['minor_page_faults']} minor, {st['major_page_faults']} major; "
        f"RSS {mb(st['rss_bytes'])}, peak {mb(st['peak_rss_bytes'])}"
    )
    if m.prefix_store is not None:
        _err(
            f"[STATS] prefix store: {mb(st['prefix_store_bytes'])} of {mb(st['prefix_store_budget_bytes'])}, "
            f"{st['prefix_store_restored_tokens']} prompt tokens restored ({st['prefix_store_hits']} hits, "
            f"{st['prefix_store_misses']} misses), {st['prefix_store_stored_blocks']} blocks stored, "
            f"{st['prefix_store_evicted_blocks']} evicted"
        )


def _verbose_printer(m):
    """on_step callback: routing of every MoE layer, and each expert file's first use."""
    touched = set()
    step = [0]

    def on_step(model):
        experts, weights = model.routing
        for layer in range(model.config.num_hidden_layers):
            if not model.config.moe_layers[layer]:
                continue
            picks = ", ".join(f"expert_{int(e)} ({w:.2f})" for e, w in zip(experts[layer], weights[layer]))
            print(f"Routing: token {step[0]} layer {layer}: {picks}", file=sys.stderr)
            for e in experts[layer]:
                if (layer, int(e)) not in touched:
                    touched.add((layer, int(e)))
                    print(f"[INFO] First use of layers/{layer:02d}/expert_{int(e):03d}.bin", file=sys.stderr)
        step[0] += 1

    return on_step


def cmd_convert(args) -> int:
    from .convert import convert

    convert(
        args.hf_dir,
        args.output_dir,
        quantize=args.quantize,
        force=args.force,
        ln_quant=args.ln_quant,
        expert_layout=args.expert_layout,
        layout=args.layout,
        gguf=args.gguf,
        roles=dict(args.role),
        importance=args.importance,
        progress=True,
    )
    return 0


def cmd_relayout(args) -> int:
    from .convert import relayout

    relayout(args.model_dir, args.output_dir, expert_layout=args.expert_layout, layout=args.layout, force=args.force)
    return 0


def cmd_eval(args) -> int:
    from .evaluate import run_eval

    return run_eval(args)


def cmd_calibrate(args) -> int:
    from .calibrate import calibrate, save
    from .evaluate import read_text

    text = read_text(args.text)
    out = Path(args.output)
    if not out.parent.is_dir():
        raise ColibriError(f"--output {out}: its directory does not exist")
    from contextlib import ExitStack

    from .progress import progress

    t0 = time.perf_counter()
    with ExitStack() as stack:
        bar = []  # opened as the first chunk ends (the model's load lines come before it), from there on

        def chunk_done(i, n):
            if not bar:
                bar.append(stack.enter_context(progress(n, "calibrate", unit="chunk", initial=i)))
            bar[0].at(i)

        result = calibrate(
            args.model_dir,
            text,
            ctx=args.ctx,
            max_tokens=args.max_tokens,
            threads=args.threads,
            progress=chunk_done,
            second_moments=args.second_moments,
            log=_err,
        )
    save(result, out)
    reached = sum(1 for _, count in result["tensors"].values() if count)
    _err(
        f"[INFO] {result['meta']['tokens']} tokens, {reached} of {len(result['tensors'])} matrices reached "
        f"({len(result['grams'])} with their whole second moment), "
        f"{time.perf_counter() - t0:.1f} s -> {out}; use it with: convert ... --importance {out}"
    )
    return 0


def cmd_bench(args) -> int:
    from .bench import run_bench

    return run_bench(args)


def cmd_info(args) -> int:
    from .modeldir import ROLES, ModelDir, tensor_role

    md = ModelDir(args.model_dir)
    c = md.config
    total = sum(f["size"] for f in md.files.values())
    moe = sum(c.moe_layers)
    per_token = md.bytes_per_token()
    active = sum(per_token.values())
    print(f"model:        {md.root}")
    print(f"architecture: {c.architecture} (from {md.raw.get('source', {}).get('hf_architecture', '?')})")
    print(
        f"layers:       {c.num_hidden_layers} ({moe} MoE, {c.num_hidden_layers - moe} dense"
        + (
            f"; every MoE block has a dense MLP ({c.intermediate_size}) beside it)"
            if c.moe_block == "parallel"
            else ")"
        )
    )
    print(
        f"experts:      {c.num_experts}, top-{c.num_experts_per_tok}"
        + (f", shared expert {c.shared_expert_intermediate_size}" if c.shared_expert_intermediate_size else "")
    )
    print(
        f"dimensions:   hidden {c.hidden_size}, heads {c.num_attention_heads}/{c.num_key_value_heads} kv, "
        f"head_dim {c.head_dim}, expert ffn {c.moe_intermediate_size}, vocab {c.vocab_size}"
    )
    formats = {}
    for n, t in md.tensors.items():
        role = tensor_role(n)
        if role in ROLES:
            formats.setdefault(role, set()).add(t["dtype"])
    print(
        f"weights:      {md.weight_dtype}, {len(md.files)} files, {total / 1e6:.1f} MB "
        f"({active / 1e6:.1f} MB read per decoded token: "
        + ", ".join(
            f"{r} {per_token[r] / 1e6:.1f} in {'/'.join(sorted(formats[r]))}"
            for r in ROLES
            if r in formats and per_token.get(r, 0) >= 0.05e6
        )
        + ")"
    )

    def layouts(names):
        return " and ".join(sorted({md.tensors[n].get("layout", "rows") for n in names})) or "rows"

    experts = {n for n in md.tensors if ".experts." in n}
    others = [
        n
        for n, t in md.tensors.items()
        if n not in experts
        and len(t["shape"]) == 2
        and (n != "embedding" or c.tie_word_embeddings)
        and not n.endswith("router")
    ]
    print(f"layout:       experts {layouts(experts)}, other matrices {layouts(others)}")
    print(f"context:      {c.max_position_embeddings} positions, rope theta {c.rope_theta:g}")
    sliding = sum(t == "sliding_attention" for t in c.layer_types)
    if sliding or c.layer_head_dims or c.layer_kv_heads:
        full = [i for i, t in enumerate(c.layer_types) if t == "full_attention"]
        geo = sorted({(c.layer_head_dim(i), c.layer_kv_heads_of(i), c.layer_rope(i)) for i in full})
        print(
            f"attention:    {sliding} sliding-window layers (window {c.sliding_window}), {len(full)} full"
            + "".join(
                f"; full: head_dim {hd}, {kv} kv heads, rope theta {th:g}"
                + (f" on {fr:g} of the pairs" if fr != 1.0 else "")
                for hd, kv, (th, fr) in geo
            )
        )
    features = [
        f"attention sinks ({c.num_attention_heads} logits a layer)" if c.attention_sinks else "",
        "router bias" if c.router_logit_bias else "",
        "expert biases" if c.expert_bias else "",
        f"clamped SwiGLU (alpha {c.swiglu_alpha:g}, limit {c.swiglu_limit:g})"
        if c.hidden_act == "swiglu_clamped"
        else "",
        f"YaRN x{c.yarn_factor:g} over {c.yarn_original_max_position_embeddings} positions" if c.yarn_factor else "",
        f"sigmoid router, {c.n_group} groups (best {c.topk_group})" if c.router_score == "sigmoid" else "",
    ]
    if any(features):
        print(f"features:     {', '.join(f for f in features if f)}")
    if c.mla:
        print(
            f"attention:    multi-head latent: a latent of {c.kv_lora_rank} + a shared RoPE key of {c.rotary_dim} "
            f"a token are cached; {c.num_attention_heads} heads of {c.qk_nope_head_dim} + {c.rotary_dim} (query) "
            f"and {c.v_head_dim} (value), absorbed" + (f"; low-rank query {c.q_lora_rank}" if c.q_lora_rank else "")
        )
    kv_bytes = sum(
        (1 if c.mla else 2) * c.layer_kv_heads_of(i) * c.layer_head_dim(i) * 4 for i in range(c.num_hidden_layers)
    )
    print(
        f"KV cache:     {kv_bytes} bytes a token (float32 keys and values"
        + (f"; sliding layers hold at most {c.sliding_window} + a prefill chunk)" if sliding else ")")
    )
    from .textfiles import TextSide, unlisted

    text = TextSide.load(md.root, md.files, c.vocab_size)
    print(f"tokenizer:    {text.tokenizer.describe() if text.tokenizer else 'none (raw token ids)'}")
    print(f"chat:         {'template from ' + Path(text.template.where).name if text.template else 'no chat template'}")
    stops = text.stop_token_ids(c.eos_token_id)
    names = [f"{i} {text.tokenizer.decode([i])!r}" if text.tokenizer else str(i) for i in stops]
    print(f"stop tokens:  {', '.join(names) or 'none'}")
    print(
        f"sampling:     {text.generation.describe()}"
        + (f" (from {Path(text.generation.source).name})" if text.generation.source else "")
    )
    for name in unlisted(md.root, md.files):
        print(
            f"[WARN] {md.root / name} is not in config.json's file table and is ignored; add it with: "
            f"python -m colibri tokenizer --model-dir {md.root} --from DIR",
            file=sys.stderr,
        )
    from . import _kernels

    feats = [name for name, on in _kernels.cpu_features().items() if on and not name.startswith("os_")]
    print(
        f"kernels:      {_kernels.isa()} (available: {', '.join(_kernels.available_isas())}; "
        f"CPU: {' '.join(feats) or 'no SIMD extensions'}; force one with COLIBRI_ISA)"
    )
    off = "".join(
        f"; {name} off: it failed the self-test's check {check}" for name, check in _kernels.failed_int_steps().items()
    )
    print(
        f"int8/int4:    {_kernels.int_step()} step in the interleaved and transposed kernels (decode and prefill){off}"
    )
    if _kernels.has_bf16_products():
        order = _kernels.bf16_order()
        print(
            "bf16:         bf16 products on vdpbf16ps (order seq)"
            if order == "seq"
            else f"bf16:         bf16 products in order {order}: widened FMAs, each lane's even and odd sums apart "
            f"every 64 inputs (the AMX unit's order)"
        )
    print(f"amx:          {_kernels.amx_status()}")
    return 0


def cmd_verify(args) -> int:
    import itertools

    from .modeldir import CONFIG_NAME, NEXTN_DIR, ModelDir
    from .progress import progress

    md = ModelDir(args.model_dir)
    if (md.root / NEXTN_DIR / CONFIG_NAME).is_file():  # the multi-token-prediction block: checked first
        block = cmd_verify(argparse.Namespace(model_dir=md.root / NEXTN_DIR))
        if block:
            return block
    names = sorted(md.files)  # the order verify hashes them in
    before = [0, *itertools.accumulate(md.files[rel]["size"] for rel in names)]  # bytes before each file
    with progress(before[-1], "verify", unit="B") as bar:
        # verify's callback names each file as it begins: the ones before it are hashed
        bad = md.verify(lambda i, n, rel: bar.at(before[i]), files=names)
        bar.at(before[-1])
    for rel, problem in bad:
        print(f"BAD {md.root / rel}: {problem}", file=sys.stderr)
    if bad:
        print(
            f"error: {len(bad)} of {len(md.files)} files failed verification; re-copy or re-convert the model",
            file=sys.stderr,
        )
        return EXIT_VERIFY_FAILED
    print(f"[INFO] OK: {len(md.files)} files match their sha256 in {md.root / 'config.json'}")
    return 0
