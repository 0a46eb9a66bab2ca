"""Shared test fixtures: the transformers fixture cases, converted once per session.

`converted(case, dtype[, layout])` converts tests/fixtures/<case>/hf into a temporary Colibri model
directory (cached for the session) and returns its path; `reference(case)` loads the reference
outputs that tools/make_fixtures.py wrote with transformers.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import colibri as colibri_package

from colibri import _kernels, _probes

# The test steps (the VNNI step emulated in AVX2, the AMX tiles emulated in C: csrc/test_steps.h) are
# built in the probes and installed here, so every kernel test runs them beside the production steps.
_probes.install_test_steps()

FIXTURES = Path(__file__).parent / "fixtures"
CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "reference.npz").is_file() and (p / "hf").is_dir())
ARCH_OF_CASE = {c: c.rsplit("_", 1)[0] for c in CASES}

F32_UNIT_ROUNDOFF = 2.0**-24
REPO = Path(__file__).resolve().parents[1]
PACKAGE_ROOT = Path(colibri_package.__file__).resolve().parents[1]  # the directory that holds colibri/


def tier_report() -> str:
    """The tiers this run tests (the `isa` fixture runs the kernel tests on each), the int steps
    of the best one, and the CPU features they come from: what a log says about its host."""
    feats = [name for name, on in _kernels.cpu_features().items() if on and not name.startswith("os_")]
    return (
        f"colibri tiers tested: {', '.join(_kernels.available_isas())} (default {_kernels.isa()}, int steps "
        f"{', '.join(_kernels.available_int_steps())}); CPU features: {' '.join(feats) or 'none'}; "
        f"{_kernels.amx_status()}"
    )


def pytest_report_header(config):
    return [tier_report()]


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(tier_report())  # also under -q, where the header is not printed


def float32_dot_bound(abs_dot, n_ops):
    """The error bound of a float32 dot product (Higham, Accuracy and Stability of Numerical
    Algorithms, 3.1): |computed - exact| <= gamma(n) * sum_i |w_i x_i|, gamma(n) = n u / (1 - n u),
    u = 2^-24, whatever the order of the sum (sequential, in SIMD lanes, in a tree), n = the
    roundings on the longest path from a product to the result: cols + 1 for a float dot of
    length cols (the products round too); at most that for the block formats (exact integer block
    sums, two roundings per block). A constant relative tolerance is not a bound: 1.0 plus n halves
    of its ulp sums to 1.0 in float32, a relative error of n * 2^-24 (hypothesis found n = 170)."""
    gamma = n_ops * F32_UNIT_ROUNDOFF / (1 - n_ops * F32_UNIT_ROUNDOFF)
    return gamma * abs_dot + 1e-30


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    from colibri.convert import convert

    cache = {}

    def get(case: str, dtype: str = "f32", layout: str | None = None) -> Path:
        """layout None: the converter's default layouts; "rows" / "transposed" / "interleaved"
        (int8/int4): every matrix but the embedding in that layout."""
        key = (case, dtype, layout)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{case}_{dtype}_{layout or 'default'}") / "model"
            convert(
                FIXTURES / case / "hf", out, quantize=dtype, log=lambda *a: None, expert_layout=layout, layout=layout
            )
            cache[key] = out
        return cache[key]

    return get


@pytest.fixture(params=_kernels.available_isas())
def isa(request):
    """Run the test on every kernel tier this CPU has, then restore the default tier."""
    before = _kernels.isa()
    _kernels.select_isa(request.param)
    yield request.param
    _kernels.select_isa(before)


def reference(case: str) -> dict:
    with np.load(FIXTURES / case / "reference.npz") as z:
        return {k: z[k] for k in z.files}


# ---- helpers shared by the test modules (none imports another) ----------------------------------


def kl_mean(ref_logits, logits) -> float:
    """Mean over positions of KL(softmax(ref) || softmax(logits)), in float64."""

    def logp(x):
        x = x.astype(np.float64) - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    p, q = logp(ref_logits), logp(logits)
    return float((np.exp(p) * (p - q)).sum(-1).mean())


# ---- an address-space limit for the error paths (RLIMIT_AS) ------------------------------------
#
# Every error path runs under one, so that an attempted huge allocation fails the test (a
# MemoryError, a failed mmap) instead of swapping the machine. 2 GiB is several times what the
# test models need (the demo model with 64 threads maps 0.3 GB; a thread's stack counts whole).
# Where the OS has no RLIMIT_AS (Windows) the helpers change nothing.

AS_LIMIT = 2 << 30


def _set_address_space(limit: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def as_limit(limit: int = AS_LIMIT, then=None) -> dict:
    """subprocess.run / Popen keyword arguments: the child runs under RLIMIT_AS `limit`; `then`:
    another preexec function to run after it (e.g. one that sets RLIMIT_FSIZE)."""
    if os.name != "posix":
        return {}

    def preexec():
        _set_address_space(limit)
        if then is not None:
            then()

    return {"preexec_fn": preexec}


def _mapped_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


@contextlib.contextmanager
def address_space_headroom(extra: int = AS_LIMIT):
    """In-process: the soft RLIMIT_AS at what this process maps now + `extra` for the block, then
    back; a huge allocation inside raises MemoryError instead of swapping. Nothing where there is
    no RLIMIT_AS or no /proc/self/statm."""
    try:
        import resource
    except ImportError:
        yield None
        return
    now = _mapped_bytes()
    if now is None:
        yield None
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = now + extra
    for bound in (soft, hard):
        if bound != resource.RLIM_INFINITY:
            cap = min(cap, bound)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield cap
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def colibri(*args, timeout=180, limit=None):
    """`python -m colibri ARGS` in a subprocess; limit: an RLIMIT_AS for it in bytes (AS_LIMIT for an
    error path), None for none."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(PACKAGE_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run(
        [sys.executable, "-m", "colibri", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=str(REPO),
        **(as_limit(limit) if limit else {}),
    )


def one_line_error(proc, *must_contain, status=2):
    """Assert the user-error contract and return the single stderr line."""
    assert proc.returncode == status, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"expected exactly one stderr line, got {proc.stderr!r}"
    for text in must_contain:
        assert str(text) in lines[0], f"{text!r} not named in {lines[0]!r}"
    return lines[0]


def ids_arg(ids) -> str:
    return ",".join(str(int(i)) for i in ids)


def write_safetensors(path: Path, tensors: dict) -> None:
    """Minimal safetensors writer for tests: {name: float32 array} -> F32 tensors."""
    header, blobs, offset = {}, [], 0
    for name, arr in tensors.items():
        data = np.ascontiguousarray(arr, "<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * ((-len(raw)) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


ENV = dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT))  # subprocesses import this colibri


def big_checkpoint(root: Path) -> Path:
    """An OLMoE-shaped f32 checkpoint of ~50 MB: converting it to int4 takes a while."""
    cfg = json.loads((FIXTURES / "olmoe_a" / "hf" / "config.json").read_text())
    cfg.update(
        hidden_size=256,
        intermediate_size=512,
        num_experts=16,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=2,
        vocab_size=512,
    )
    rng = np.random.default_rng(0)
    d, f, t = 256, 512, {}
    t["model.embed_tokens.weight"] = rng.standard_normal((512, d), np.float32)
    t["lm_head.weight"] = rng.standard_normal((512, d), np.float32)
    t["model.norm.weight"] = np.ones(d, np.float32)
    for layer in range(2):
        p = f"model.layers.{layer}."
        for n in ("input_layernorm", "post_attention_layernorm"):
            t[p + n + ".weight"] = np.ones(d, np.float32)
        for n in "qkvo":
            t[p + f"self_attn.{n}_proj.weight"] = rng.standard_normal((d, d), np.float32)
        t[p + "self_attn.q_norm.weight"] = np.ones(d, np.float32)
        t[p + "self_attn.k_norm.weight"] = np.ones(d, np.float32)
        t[p + "mlp.gate.weight"] = rng.standard_normal((16, d), np.float32)
        for e in range(16):
            t[p + f"mlp.experts.{e}.gate_proj.weight"] = rng.standard_normal((f, d), np.float32)
            t[p + f"mlp.experts.{e}.up_proj.weight"] = rng.standard_normal((f, d), np.float32)
            t[p + f"mlp.experts.{e}.down_proj.weight"] = rng.standard_normal((d, f), np.float32)
    root.mkdir()
    (root / "config.json").write_text(json.dumps(cfg))
    write_safetensors(root / "model.safetensors", t)
    return root


def convert_cmd(hf, out, *extra):
    return [sys.executable, "-m", "colibri", "convert", "--hf-dir", str(hf), "--output-dir", str(out), *extra]


# ---- a model that speaks text: qwen3moe_a with a small BPE tokenizer.json and a ChatML template ----

CHATML = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)
SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello colibri",
    "café déjà vu naïve",
    "numbers 0123456789 and symbols !?.,;:()[]{}",
    "mixture of experts on a cpu",
    "unto the LORD",
] * 20
SMALL_VOCAB = 200


def small_tokenizer_json(path):
    """A BPE tokenizer.json with Metaspace spacing and ChatML specials, SMALL_VOCAB ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=SMALL_VOCAB, special_tokens=SPECIALS))
    tok.save(str(path))


@pytest.fixture(scope="session")
def chat_hf(tmp_path_factory):
    """qwen3moe_a's checkpoint with a tokenizer.json, a ChatML template and two EOS ids."""
    hf = tmp_path_factory.mktemp("chat") / "hf"
    shutil.copytree(FIXTURES / "qwen3moe_a" / "hf", hf)
    small_tokenizer_json(hf / "tokenizer.json")
    (hf / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False})
    )
    end, eot = SPECIALS.index("<|im_end|>"), SPECIALS.index("<|endoftext|>")  # trainer ids: in order
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "eos_token_id": end}))
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [end, eot]}))
    return hf


@pytest.fixture(scope="session")
def chat_model_dir(chat_hf):
    from colibri.convert import convert

    out = chat_hf.parent / "model"
    convert(chat_hf, out, log=lambda *a: None)
    return out


def render_on_the_fixture_day(monkeypatch, spec: dict) -> None:
    """A chat fixture rendered on a given day (gpt-oss's strftime_now writes today's date): the
    template's clock reads spec["rendered_on"], where set."""
    if "rendered_on" not in spec:
        return
    import datetime
    import colibri.chat

    day = datetime.date.fromisoformat(spec["rendered_on"])

    class RenderDay(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(day.year, day.month, day.day)

    monkeypatch.setattr(colibri.chat, "datetime", RenderDay)


def sse_events(url: str, body: dict, headers=None, timeout: float = 120) -> list:
    """POST body to url and read its server-sent events: the data documents in order, each
    checked to name its own `event:` line's type (Anthropic's and the Responses API's streams)."""
    import httpx

    events, name = [], None
    with httpx.stream("POST", url, json=body, headers=headers or {}, timeout=timeout) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                doc = json.loads(line[6:])
                assert doc["type"] == name
                events.append(doc)
    return events
