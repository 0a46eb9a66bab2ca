"""`python -m colibri` end to end, in subprocesses: run, convert, info, verify and every error path.

The contract under test (colibri/cli.py): a user's mistake is one line on stderr and exit status 2
(1 for a failed `verify`), never a traceback, and the line names the offending value or file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from colibri.cli import DEMO_DIR
from colibri import _kernels
from conftest import FIXTURES, colibri, ids_arg, one_line_error, reference

DEMO_CONFIG = DEMO_DIR / "config.json"


@pytest.fixture(scope="module")
def mixtral(converted):
    return converted("mixtral_a", "f32")


@pytest.fixture(scope="module")
def ref():
    return reference("mixtral_a")


# ---- run ---------------------------------------------------------------------------------------

SPEED_LINE = re.compile(
    r"\[INFO\] Prompt: (\d+) tokens in \d+ ms \((\d+(\.\d+)?|-) tok/s\)(, \d+ reused from the cache)?; "
    r"generated (\d+) tokens in \d+ ms \((\d+(\.\d+)?|-) tok/s\)"
)


def test_run_tokens_greedy_matches_reference(mixtral, ref):
    p = colibri(
        "run",
        "--model-dir",
        mixtral,
        "--tokens",
        ids_arg(ref["input_ids"]),
        "--max-new-tokens",
        12,
        "--ignore-eos",
        "--ids",
    )
    assert p.returncode == 0, p.stderr
    # stdout is the generated ids alone; every [INFO] line is on stderr
    assert [int(t) for t in p.stdout.split()] == ref["greedy_ids"].tolist()
    lines = p.stderr.splitlines()
    assert lines[0].startswith(f"[INFO] Loaded model from {mixtral} (mixtral, 2 layers, 4 experts, top-2, f32)")
    assert "[INFO] Sampling: greedy" in lines
    m = SPEED_LINE.fullmatch(lines[-1])
    assert m and m.group(1) == str(len(ref["input_ids"])) and m.group(5) == "12", lines[-1]


@pytest.mark.parametrize("chunk", ["1", "3", "16"])
def test_run_prefill_chunk_splits_the_prompt_alike(mixtral, ref, chunk):
    """--prefill-chunk: the prompt run in pieces of that many tokens gives the same greedy ids (a
    token's logits do not depend on how the prompt was split)."""
    assert len(ref["input_ids"]) > int(chunk)
    p = colibri(
        "run",
        "--model-dir",
        mixtral,
        "--tokens",
        ids_arg(ref["input_ids"]),
        "--max-new-tokens",
        6,
        "--ignore-eos",
        "--ids",
        "--quiet",
        "--prefill-chunk",
        chunk,
    )
    assert p.returncode == 0, p.stderr
    assert [int(t) for t in p.stdout.split()] == ref["greedy_ids"][:6].tolist()


def test_a_bad_prefill_chunk_is_one_line(mixtral):
    """A chunk that is not a positive integer, or (serve) smaller than --parallel, is one clear line
    and exit 2, before anything loads."""
    bad = colibri("run", "--model-dir", mixtral, "--tokens", "1 2", "--prefill-chunk", "0")
    assert bad.returncode == 2 and "--prefill-chunk" in bad.stderr and "Traceback" not in bad.stderr
    bad = colibri("serve", "--model-dir", mixtral, "--parallel", "4", "--prefill-chunk", "2", "--port", "0")
    assert bad.returncode == 2 and "--parallel 4 exceeds --prefill-chunk 2" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr


def test_run_quiet_prints_only_the_output(mixtral, ref):
    p = colibri(
        "run",
        "--model-dir",
        mixtral,
        "--tokens",
        ids_arg(ref["input_ids"]),
        "--max-new-tokens",
        3,
        "--ignore-eos",
        "--ids",
        "--quiet",
    )
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert [int(t) for t in p.stdout.split()] == ref["greedy_ids"][:3].tolist()


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_run_describes_weight_dtype(converted, dtype, ref):
    d = converted("mixtral_a", dtype)
    p = colibri("run", "--model-dir", d, "--tokens", ids_arg(ref["input_ids"][:4]), "--max-new-tokens", 2, "--ids")
    assert p.returncode == 0, p.stderr
    assert f"(mixtral, 2 layers, 4 experts, top-2, {dtype})" in p.stderr.splitlines()[0]


def test_run_underscore_aliases(mixtral, ref):
    p = colibri(
        "run",
        "--model_dir",
        mixtral,
        "--tokens",
        ids_arg(ref["input_ids"]),
        "--max_new_tokens",
        5,
        "--ignore-eos",
        "--ids",
    )
    assert p.returncode == 0, p.stderr
    assert [int(t) for t in p.stdout.split()] == ref["greedy_ids"][:5].tolist()
    assert "generated 5 tokens" in p.stderr


def test_run_prompt_with_tokenizer(mixtral):
    p = colibri("run", "--model-dir", mixtral, "--prompt", "hello world", "--max-new-tokens", 6, "--ignore-eos")
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    assert "[INFO]" not in p.stdout and p.stdout.endswith("\n")
    assert "generated 6 tokens" in p.stderr


def test_run_verbose_routing(mixtral, ref):
    p = colibri(
        "run",
        "--model-dir",
        mixtral,
        "--tokens",
        ids_arg(ref["input_ids"]),
        "--max-new-tokens",
        3,
        "--ignore-eos",
        "--ids",
        "--verbose",
    )
    assert p.returncode == 0, p.stderr
    routing = re.findall(
        r"Routing: token (\d+) layer (\d+): expert_(\d+) \((0\.\d\d|1\.00)\), "
        r"expert_(\d+) \((0\.\d\d|1\.00)\)",
        p.stderr,
    )
    # 3 steps (prefill + 2 decode steps) x 2 MoE layers
    assert len(routing) == 6, p.stderr
    assert any(r[1] == "0" for r in routing)
    for tok, layer, e1, w1, e2, w2 in routing:
        assert e1 != e2 and 0 <= int(e1) < 4 and 0 <= int(e2) < 4
        assert float(w1) >= float(w2)
        assert abs(float(w1) + float(w2) - 1.0) <= 0.011  # Mixtral renormalises the top-2
    # token 0 is the routing of the last prompt position: compare with the reference router logits
    r = ref["router_logits_f32"][:, -1].astype(np.float64)
    probs = np.exp(r - r.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    for tok, layer, e1, w1, e2, w2 in routing:
        if tok != "0":
            continue
        top = np.argsort(-probs[int(layer)], kind="stable")[:2]
        assert [int(e1), int(e2)] == top.tolist()
        norm = probs[int(layer)][top] / probs[int(layer)][top].sum()
        assert abs(float(w1) - norm[0]) <= 0.006 and abs(float(w2) - norm[1]) <= 0.006
    first = re.findall(r"First use of (layers/(\d\d)/expert_(\d{3})\.bin)", p.stderr)
    assert any(layer == "00" for _, layer, _ in first)
    assert len(first) == len(set(first)), "an expert file was reported as first used twice"
    used = {(int(layer), int(e1)) for _, layer, e1, *_ in routing} | {
        (int(layer), int(e2)) for _, layer, _, _, e2, _ in routing
    }
    assert {(int(layer), int(e)) for _, layer, e in first} == used
    for rel, _, _ in first:
        assert (mixtral / rel).is_file()


# ---- convert -----------------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", [("--hf_dir", "--output_dir"), ("--hf-dir", "--output-dir")])
def test_convert_spellings(tmp_path, spelling):
    out = tmp_path / "out"
    p = colibri("convert", spelling[0], FIXTURES / "mixtral_a" / "hf", spelling[1], out)
    assert p.returncode == 0, p.stderr
    assert (out / "config.json").is_file() and (out / "layers" / "01" / "expert_003.bin").is_file()
    assert json.loads((out / "config.json").read_text())["format"] == "colibri"
    v = colibri("verify", "--model-dir", out)
    assert v.returncode == 0, v.stderr


def test_convert_refuses_non_empty_output_without_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    p = colibri("convert", "--hf-dir", FIXTURES / "mixtral_a" / "hf", "--output-dir", out)
    one_line_error(p, out)
    assert sorted(x.name for x in out.iterdir()) == ["precious.txt"]
    assert (out / "precious.txt").read_text() == "keep me"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out"], "conversion left temporary files behind"

    p = colibri("convert", "--hf-dir", FIXTURES / "mixtral_a" / "hf", "--output-dir", out, "--force")
    one_line_error(p, out)  # --force replaces only a Colibri model directory
    assert (out / "precious.txt").read_text() == "keep me"

    (out / "precious.txt").unlink()
    assert colibri("convert", "--hf-dir", FIXTURES / "mixtral_a" / "hf", "--output-dir", out).returncode == 0
    (out / "precious.txt").write_text("stray")
    p = colibri("convert", "--hf-dir", FIXTURES / "mixtral_a" / "hf", "--output-dir", out, "--force")
    assert p.returncode == 0, p.stderr
    assert not (out / "precious.txt").exists()
    assert (out / "config.json").is_file()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out"], "conversion left temporary files behind"


def test_convert_unknown_architecture(tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / "mixtral_a" / "hf", hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["architectures"] = ["FrobnicatorForCausalLM"]
    (hf / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    p = colibri("convert", "--hf-dir", hf, "--output-dir", out)
    one_line_error(p, "FrobnicatorForCausalLM")
    assert not out.exists()


def test_relayout_and_its_errors(converted, tmp_path):
    src = converted("mixtral_a", "int8", "rows")
    out = tmp_path / "t"
    p = colibri("relayout", "--model_dir", src, "--output_dir", out, "--expert-layout", "transposed")
    assert p.returncode == 0, p.stderr
    assert "experts transposed" in colibri("info", "--model-dir", out).stdout
    one_line_error(colibri("relayout", "--model-dir", tmp_path / "missing", "--output-dir", tmp_path / "o"), "missing")
    one_line_error(colibri("relayout", "--model-dir", src, "--output-dir", out), out)  # not empty
    one_line_error(colibri("relayout", "--model-dir", src, "--output-dir", src), "itself")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["t"], "relayout left temporary files behind"


# ---- info / verify -----------------------------------------------------------------------------


def test_info(mixtral, converted):
    p = colibri("info", "--model-dir", mixtral)
    assert p.returncode == 0, p.stderr
    assert "architecture: mixtral (from MixtralForCausalLM)" in p.stdout
    assert "layers:       2 (2 MoE, 0 dense)" in p.stdout
    assert "tokenizer:    tokenizer.model (" in p.stdout
    assert f"int8/int4:    {_kernels.int_step()} step in the interleaved and transposed kernels" in p.stdout
    if _kernels.has_bf16_products():  # (on an AMX-BF16 host the unit's order, found at import)
        order = _kernels.bf16_order()
        assert (
            "bf16:         bf16 products on vdpbf16ps (order seq)"
            if order == "seq"
            else f"bf16:         bf16 products in order {order}: widened FMAs"
        ) in p.stdout
    else:
        assert "bf16:  " not in p.stdout
    q = colibri("info", "--model-dir", converted("qwen3moe_a", "f32"))
    assert q.returncode == 0, q.stderr
    assert "architecture: qwen3_moe (from Qwen3MoeForCausalLM)" in q.stdout
    assert "tokenizer:    none" in q.stdout


def test_verify_ok_then_detects_flipped_byte(mixtral, tmp_path):
    p = colibri("verify", "--model-dir", mixtral)
    assert p.returncode == 0, p.stderr
    assert "OK" in p.stdout
    d = tmp_path / "m"
    shutil.copytree(mixtral, d)
    victim = d / "layers" / "01" / "expert_002.bin"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    p = colibri("verify", "--model-dir", d)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    bad = [ln for ln in p.stderr.splitlines() if ln.startswith("BAD")]
    assert len(bad) == 1 and "layers/01/expert_002.bin" in bad[0]
    assert "OK" not in p.stdout


# ---- errors: one line, exit 2, naming the culprit ------------------------------------------------


def test_error_missing_model_dir(tmp_path):
    missing = tmp_path / "no_such_model"
    one_line_error(colibri("run", "--model-dir", missing, "--tokens", "1,2"), missing)


def test_error_dir_without_config(tmp_path):
    one_line_error(colibri("run", "--model-dir", tmp_path, "--tokens", "1,2"), tmp_path / "config.json")


def test_error_config_not_json(mixtral, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(mixtral, d)
    (d / "config.json").write_text('{"format": "colibri", oops')
    line = one_line_error(colibri("run", "--model-dir", d, "--tokens", "1,2"), d / "config.json")
    assert "JSON" in line


def test_error_config_json_list(mixtral, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(mixtral, d)
    (d / "config.json").write_text("[1, 2, 3]")
    one_line_error(colibri("info", "--model-dir", d), d / "config.json")
    one_line_error(colibri("run", "--model-dir", d, "--tokens", "1,2"), d / "config.json")


def test_error_truncated_bin(mixtral, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(mixtral, d)
    victim = d / "layers" / "00" / "expert_001.bin"
    os.truncate(victim, victim.stat().st_size - 1)
    one_line_error(colibri("run", "--model-dir", d, "--tokens", "1,2"), victim)
    one_line_error(colibri("verify", "--model-dir", d), victim)


def test_error_token_outside_vocab(mixtral):
    one_line_error(colibri("run", "--model-dir", mixtral, "--tokens", "1,999999"), "999999")


def test_error_prompt_longer_than_context(mixtral):
    line = one_line_error(
        colibri("run", "--model-dir", mixtral, "--n-ctx", 16, "--tokens", "1,2,3", "--max-new-tokens", 20), "16", "20"
    )
    assert "context" in line


def test_error_prompt_without_tokenizer(converted):
    d = converted("qwen3moe_a", "f32")
    one_line_error(colibri("run", "--model-dir", d, "--prompt", "hello"), "tokenizer.json or tokenizer.model")


@pytest.mark.parametrize(
    "args, named",
    [
        (["--max-new-tokens", "0"], "'0'"),
        (["--max-new-tokens", "-3"], "'-3'"),
        (["--tokens", "a,b"], "a,b"),
        (["--no-such-flag"], "--no-such-flag"),
        (["--temperature", "warm"], "warm"),
        (["--temperature", "nan"], "nan"),
        (["--temperature", "-1"], "-1"),
        (["--top-p", "0"], "top_p"),
        (["--n-ctx", "0"], "'0'"),
    ],
)
def test_error_bad_flag_values(mixtral, args, named):
    argv = ["run", "--model-dir", mixtral, *args]
    if "--tokens" not in args:
        argv += ["--tokens", "1,2"]
    one_line_error(colibri(*argv), named)


def test_error_no_subcommand_and_no_source(mixtral):
    one_line_error(colibri())
    one_line_error(colibri("run", "--model-dir", mixtral), "--tokens")


def test_run_without_model_dir():
    assert DEMO_CONFIG.is_file()  # the package bundles its demo model
    p = colibri("run", "--tokens", "1,2", "--max-new-tokens", 1)
    assert p.returncode == 0, p.stderr
    assert "Loaded the bundled demo model" in p.stderr


def test_the_clis_choice_lists_are_the_kernels_tables():
    """cli.py spells the layouts and formats out (its --help imports no numpy); they must be the
    compiled modules' tables, defined once from the C enums."""
    from colibri import _kernels, cli

    assert cli.LAYOUT_CHOICES == tuple(_kernels.LAYOUT_CODES)
    assert cli.QUANTIZE_CHOICES == tuple(_kernels.DTYPE_CODES)


@pytest.mark.parametrize(
    "command", [["run", "--tokens", "1"], ["chat", "--model-dir", "m"], ["serve", "--model-dir", "m"]]
)
def test_routing_weights_are_exact_unless_the_table_is_asked_for(command):
    """The float softmax is the default of every command that loads a model, as of load() (a
    mutually exclusive pair of flags on one dest once made the table the silent default)."""
    from colibri.cli import build_parser

    assert build_parser().parse_args(command).softmax_lut is False
    assert build_parser().parse_args(command + ["--softmax-lut"]).softmax_lut is True
    assert build_parser().parse_args(command + ["--exact-softmax"]).softmax_lut is False


# ---- the bundled demo as every reading command's default ----------------------------------------


def test_commands_that_read_a_model_default_to_the_demo():
    """Every command that only reads a model takes the bundled demo without --model-dir, and says so
    in its help; those that write into a model directory still need one (never the package)."""
    from colibri.cli import DEMO_COMMANDS, DEMO_HELP, build_parser

    parser = build_parser()
    need = {"run": ["--tokens", "1"], "eval": ["--text", "t"], "calibrate": ["--text", "t", "--output", "o"]}
    for command in DEMO_COMMANDS:
        assert parser.parse_args([command, *need.get(command, [])]).model_dir is None
        sub = parser._subparsers._group_actions[0].choices[command]
        assert DEMO_HELP.strip(" ()") in " ".join(sub.format_help().split()), command
    assert set(DEMO_COMMANDS) == {"run", "chat", "serve", "info", "verify", "bench", "eval", "calibrate"}
    one_line_error(colibri("tokenizer", "--from", DEMO_DIR), "--model-dir")
    one_line_error(colibri("relayout", "--output-dir", "nowhere"), "--model-dir")


def test_info_and_verify_without_model_dir_describe_the_demo():
    info = colibri("info")
    assert info.returncode == 0, info.stderr
    assert f"model:        {DEMO_DIR}" in info.stdout
    assert "chat:         template from chat_template.jinja" in info.stdout
    assert "[WARN]" not in info.stderr
    ver = colibri("verify")
    assert ver.returncode == 0, ver.stderr
    n = len(json.loads(DEMO_CONFIG.read_text())["files"])
    assert f"[INFO] OK: {n} files match their sha256 in {DEMO_CONFIG}" in ver.stdout


# ---- seeds: a fresh one per run unless --seed -----------------------------------------------------

SEED_NOTE = re.compile(r"\[INFO\] Sampling: temperature 1, seed (\d+) \(drawn for this run; --seed (\d+) repeats it\)")
DEMO_PROMPT = "And the LORD said unto Moses"


def _sampled(*args):
    p = colibri("run", "--prompt", DEMO_PROMPT, "--temperature", "1", "--max-new-tokens", 16, "--ignore-eos", *args)
    assert p.returncode == 0, p.stderr
    return p


def test_run_without_seed_draws_one_and_reports_it():
    """No --seed: each run samples with a fresh seed, named in the Sampling line; given back as
    --seed it gives the same text again. (Needs Model.generate(seed=None): a random seed, kept in
    last_generation.sampler.seed.)"""
    first, second = _sampled(), _sampled()
    seeds = []
    for p in (first, second):
        m = SEED_NOTE.search(p.stderr)
        assert m and m.group(1) == m.group(2), p.stderr
        seeds.append(m.group(1))
    assert seeds[0] != seeds[1]
    again = _sampled("--seed", seeds[0])
    assert again.stdout == first.stdout
    assert f"[INFO] Sampling: temperature 1, seed {seeds[0]}\n" in again.stderr and "drawn" not in again.stderr


def test_run_with_seed_is_deterministic_and_greedy_names_no_seed():
    a, b = _sampled("--seed", 7), _sampled("--seed", 7)
    assert a.stdout == b.stdout
    assert "[INFO] Sampling: temperature 1, seed 7\n" in a.stderr
    g = colibri("run", "--prompt", DEMO_PROMPT, "--max-new-tokens", 4)
    assert g.returncode == 0, g.stderr
    assert "[INFO] Sampling: greedy\n" in g.stderr and "seed" not in g.stderr


# ---- run --json-schema / --grammar -------------------------------------------------------------


def test_json_schema_and_grammar_files_errors_are_one_line(tmp_path):
    """A constraint file that is missing, not UTF-8, not JSON or not a JSON object is one line that
    names the option and the file, exit 2, before the model loads."""
    run = ("run", "--prompt", DEMO_PROMPT)
    missing = tmp_path / "missing.json"
    one_line_error(colibri(*run, "--json-schema", missing), "--json-schema", missing)
    binary = tmp_path / "binary.json"
    binary.write_bytes(b'{"type": "\xff"}')
    one_line_error(colibri(*run, "--json-schema", binary), "--json-schema", binary, "UTF-8")
    broken = tmp_path / "broken.json"
    broken.write_text('{"type": ')
    one_line_error(colibri(*run, "--json-schema", broken), "--json-schema", broken, "not JSON", "line 1")
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    one_line_error(colibri(*run, "--json-schema", listed), "--json-schema", listed, "JSON object")
    one_line_error(colibri(*run, "--grammar", tmp_path / "missing.lark"), "--grammar", tmp_path / "missing.lark")
    one_line_error(colibri(*run, "--grammar", tmp_path), "--grammar", tmp_path)
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object"}')
    one_line_error(colibri(*run, "--json-schema", schema, "--grammar", schema), "--grammar", "--json-schema")


def test_run_grammar_constrains_the_demos_output(tmp_path):
    """--grammar FILE reaches the model's generate(grammar=<text>): the output is one of the
    grammar's strings."""
    pytest.importorskip("llguidance")
    grammar = tmp_path / "answer.lark"
    grammar.write_text('start: "yes" | "no"\n')
    p = colibri("run", "--prompt", DEMO_PROMPT, "--grammar", grammar, "--max-new-tokens", 8)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() in ("yes", "no"), p.stdout


def test_constraint_files_become_generate_keywords(tmp_path):
    """--json-schema FILE is passed as json_schema=<the parsed JSON>, --grammar FILE as grammar=<its text>."""
    from colibri.cli import _constraint_kwargs, build_parser

    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object", "properties": {"name": {"type": "string"}}}', encoding="utf-8")
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "amen"\n', encoding="utf-8")
    parse = build_parser().parse_args
    assert _constraint_kwargs(parse(["run", "--prompt", "x", "--json-schema", str(schema)])) == {
        "json_schema": {"type": "object", "properties": {"name": {"type": "string"}}}
    }
    assert _constraint_kwargs(parse(["run", "--prompt", "x", "--grammar", str(grammar)])) == {
        "grammar": 'start: "amen"\n'
    }
    assert _constraint_kwargs(parse(["run", "--prompt", "x"])) == {}


def test_every_option_has_help_that_states_its_default():
    """--help cannot drift from the code: an option with a default shows the parser's own value
    (or says in words what it is), and no option goes without a help text."""
    import argparse
    from colibri import cli

    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, sub in commands.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if (
                not action.option_strings
                or isinstance(action, argparse._HelpAction)
                or action.help == argparse.SUPPRESS
            ):
                continue
            assert action.help, f"{name} {action.option_strings[0]} has no help"
            shown = formatter._get_help_string(action)
            default = action.default
            if default is None or isinstance(default, bool) or default == []:
                continue
            assert f"(default: {default})" in shown or "default" in action.help, (name, action.option_strings[0], shown)
    eviction = next(a for a in commands["run"]._actions if "--eviction" in a.option_strings)
    from colibri.names import DEFAULT_EVICTION

    assert f"default: {DEFAULT_EVICTION}" in eviction.help


def test_a_directory_named_colibri_in_the_way_is_one_line(tmp_path):
    """`python -m colibri` where the current directory holds a `colibri/` that is not the package
    (a clone's root): one line naming it, status 2 — where the package is an editable install (a
    regular install on sys.path wins over the directory, and there is nothing to report)."""
    import os

    (tmp_path / "colibri").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run(
        [sys.executable, "-m", "colibri", "info"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    if p.returncode == 0:
        pytest.skip("the installed colibri is a regular package: the directory does not shadow it")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert str(tmp_path / "colibri") in p.stderr and len(p.stderr.strip().splitlines()) == 1
