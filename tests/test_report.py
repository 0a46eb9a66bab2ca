"""tools/bench/report.py: docs/performance.md is what the results files say, and only the newest of them."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "bench" / "report.py"

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # hypothesis is optional here
    given = None


def _report():
    spec = importlib.util.spec_from_file_location("bench_report", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


report = _report()


def _long_context(pp: float, tg: float) -> list:
    """A long_context.py result: Colibri and one peer at 16,384 positions, two repetitions each."""
    return [
        {"engine": e, "depth": 16384, "rep": rep, "pp": p + rep, "tg": t + rep}
        for rep in (0, 1)
        for e, p, t in (("colibri kv q8", pp, tg), ("ik_llama.cpp -rtr fa on kv q8_0", 100.0, 10.0))
    ]


def _constraint(date: str, plain: float) -> dict:
    case = {"tokens": 10, "compile_ms": 1.0, "mask": {"median_us": 5.0, "p99_us": 9.0, "n": 10}}
    return {
        "command": f"python tools/bench_constraint.py --out x-{date}.json",
        "date": date,
        "git_commit": "abc1234",
        "host": {"cpu": "Test CPU", "cores": 2},
        "target": "t",
        "mask": {"cases": {"json_schema": case}},
        "decode": [
            {
                "threads": 2,
                "median_ms_per_token": {"plain": plain, "json_schema": plain + 1},
                "critical_path_share_json_schema": 0.01,
                "target_met": True,
            }
        ],
    }


def _write(d: Path, name: str, data) -> None:
    (d / name).write_text(json.dumps(data), encoding="utf-8")


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=REPO, timeout=120
    )


def test_committed_page_is_generated():
    """(a) docs/performance.md is exactly what the results files give (the CI check)."""
    r = _cli("--check")
    assert r.returncode == 0, r.stdout + r.stderr


def test_check_fails_on_a_stale_page(tmp_path):
    _write(tmp_path, "2026-01-01-long-context-qwen3-moe-4l-zen4-16k.json", _long_context(200.0, 50.0))
    out = tmp_path / "perf.md"
    out.write_text("stale\n")
    r = _cli("--results", tmp_path, "--out", out, "--check")
    assert r.returncode == 1 and len(r.stdout.strip().splitlines()) == 1
    assert _cli("--results", tmp_path, "--out", out).returncode == 0
    assert _cli("--results", tmp_path, "--out", out, "--check").returncode == 0


def test_newest_result_wins(tmp_path):
    """(b) of two results of one kind, the newer one's figures appear and the older one's do not."""
    _write(tmp_path, "2026-01-02-long-context-qwen3-moe-4l-zen4-16k.json", _long_context(777.0, 88.0))
    _write(tmp_path, "2026-01-01-long-context-qwen3-moe-4l-zen4-16k-b.json", _long_context(333.0, 44.0))
    _write(tmp_path, "a-constraint-new.json", _constraint("2026-02-03T10:00:00", 12.5))
    _write(tmp_path, "z-constraint-old.json", _constraint("2026-02-03T09:00:00", 97.5))
    text = report.render(tmp_path)
    assert "777.5" in text and "88.50" in text  # medians of 777/778 and 88/89
    assert "333.5" not in text and "44.50" not in text
    assert "12.50" in text and "97.50" not in text
    assert "2026-01-01-long-context" not in text.split("## Other results")[0]


def test_unknown_shape_is_listed_not_read(tmp_path):
    """(c) a file of a shape the report does not know lands under "Other results"; so does broken JSON."""
    _write(tmp_path, "2026-03-01-mystery.json", {"command": "python tools/mystery.py --x", "figures": [1, 2]})
    _write(tmp_path, "2026-03-02-list.json", [1, 2, 3])
    (tmp_path / "2026-03-03-broken.json").write_text("{not json")
    text = report.render(tmp_path)
    other = text.split("## Other results", 1)[1]
    assert "`2026-03-01-mystery.json` — `python tools/mystery.py --x`" in other
    assert "`2026-03-02-list.json` — no command recorded" in other
    assert "`2026-03-03-broken.json`" in other
    for question in (
        "## Decode and prefill",
        "## Long context",
        "## Under a memory cap",
        "## Serving under load",
        "## Quality per byte",
        "## Constrained decoding cost",
    ):
        assert question in text
    assert text.count("No measurement yet") >= 5  # every question says so, none invents figures


def _sections(text: str) -> dict:
    parts = re.split(r"^## ", text, flags=re.M)[1:]
    return {p.splitlines()[0]: p for p in parts}


def test_every_section_names_its_provenance():
    """(d) every section that shows figures names the command, date, host and commit of its files."""
    sections = _sections(report.render())
    shown = 0
    for title, body in sections.items():
        if title == "Other results" or "|" not in body:
            assert "No measurement yet" in body or title == "Other results", title
            continue
        shown += 1
        for block in re.split(r"^###+ ", body, flags=re.M)[1:] or [body]:
            if "|" not in block:
                continue
            prov = [ln for ln in block.splitlines() if ln.startswith("- ") and ".json`" in ln]
            assert prov, (title, block[:80])
            for ln in prov:
                for label in ("date: ", "host: ", "commit: ", "command: "):
                    assert label in ln, (title, ln)
    assert shown >= 4


def test_page_is_deterministic():
    """No time stamp, the same text twice: the page changes only when a results file does."""
    page = (REPO / "docs" / "performance.md").read_text(encoding="utf-8")
    assert "## Decode and prefill against llama.cpp and ik_llama.cpp" in page
    assert "## Other results" in page
    assert "generated at" not in page.lower()
    assert report.render() == report.render()


if given is not None:

    @settings(max_examples=15, deadline=None)
    @given(st.lists(st.integers(min_value=1, max_value=28), min_size=2, max_size=5, unique=True))
    def test_newest_of_any_order(tmp_path_factory, days):
        """Whatever the order the files are named in, the greatest date is the one shown."""
        d = tmp_path_factory.mktemp("r")
        for i, day in enumerate(days):
            _write(d, f"{i:02d}-constraint.json", _constraint(f"2026-04-{day:02d}", 1000.0 + day))
        text = report.render(d)
        top = max(days)
        assert f"{1000.0 + top:.1f}" in text
        for day in days:
            if day != top:
                assert f"{1000.0 + day:.1f}" not in text
else:  # pragma: no cover

    def test_newest_of_any_order():
        pytest.skip("hypothesis not installed")


def test_decode_against_the_read_roofline(tmp_path):
    """The roofline section reads read_roofline.c's summary (the best way against the plain loop)
    and bench's decode read rate against its loop, as ratios of the medians, with provenance."""
    meta = {
        "command": "python x",
        "date": "2026-12-07T10:00:00",
        "host": {"cpu": "EPYC", "cores": 2},
        "git_commit": "abc1234",
    }
    (tmp_path / "2026-12-07-read-roofline-x.json").write_text(
        json.dumps(
            {
                **meta,
                "summary": [
                    {"memory": "anon-2m", "threads": 2, "way": "plain", "median_gbs": 30.0, "best_gbs": 31.0},
                    {"memory": "anon-2m", "threads": 2, "way": "pf256", "median_gbs": 33.0, "best_gbs": 34.0},
                    {"memory": "anon-2m", "threads": 2, "way": "streams2", "median_gbs": 20.0, "best_gbs": 21.0},
                ],
            }
        )
    )
    (tmp_path / "2026-12-07-decode-vs-loop-x.json").write_text(
        json.dumps(
            {
                **meta,
                "model": "toy",
                "runs": {
                    "threads 2": {
                        "int4": [
                            {"decode_tok_s": 100.0, "decode_read_gb_s": 24.0, "read_loop_gb_s": [29.0, 31.0]},
                            {"decode_tok_s": 110.0, "decode_read_gb_s": 26.0, "read_loop_gb_s": [30.0, 30.0]},
                        ]
                    }
                },
            }
        )
    )
    text = report.render(tmp_path)
    section = text.split("## Decode against the memory's read rate")[1].split("\n## ")[0]
    assert "| anon-2m | 2 | 30.0 | 33.0 (pf256) | 1.10 |" in section
    assert "| int4 | 2 | 105.0 (100.0–110.0) | 25.0 (24.0–26.0) | 30.0 (30.0–30.0) | 0.83 |" in section
    assert section.count("commit: abc1234") == 2 and "Other results" not in section


def test_the_prefix_store_section_reads_its_medians(tmp_path):
    """prefix_store.py's file: TTFT medians (min–max) and their ratio to a cold prompt per engine and
    scenario, and the shared system prompt's tokens run against the ideal."""
    runs = {
        "colibri returning": [
            {"first": 2.0, "returning": r, "cold": 2.0, "ratio": r / 2.0} for r in (0.10, 0.12, 0.30)
        ],
        "colibri shared": [{"wall": w, "ideal_tokens": 2012, "computed_tokens": 2040} for w in (3.0, 3.2, 3.1)],
        "llama-server returning": [{"first": 6.0, "returning": 0.5, "cold": 6.0, "ratio": 0.5 / 6.0}],
        "llama-server shared": [{"wall": 20.0, "ideal_tokens": 2012}],
        "colibri restart": [{"first": 2.0, "returning": 0.2, "cold": 2.0, "ratio": 0.1}],
    }
    doc = {
        "command": "prefix_store.py --reps 3",
        "host": "h",
        "date": "2026-12-07T20:00:00Z",
        "git_commit": "abc",
        "settings": {"reps": 3, "conversation": 2000},
        "summary": {},
        "runs": runs,
    }
    _write(tmp_path, "2026-12-07-prefix-store-zen5.json", doc)
    text = _sections(report.render(tmp_path))["Prompts computed once: the prefix store"]
    assert "| colibri | returning | 120 (100–300) | 2000 (2000–2000) | 0.060 (0.050–0.150) |" in text
    assert "| colibri | restart | 200 | 2000 | 0.100 |" in text
    assert "| colibri | 3.10 (3.00–3.20) | 2040 (2040–2040) | 2012 |" in text
    assert "| llama-server | 20.00 | not reported | 2012 |" in text
    assert "`2026-12-07-prefix-store-zen5.json` — date: 2026-12-07T20:00:00Z; host: h; commit: abc" in text


def test_the_speculation_section_reads_its_medians(tmp_path):
    runs = {
        "edit": [
            {"plain_tok_s": p, "drafted_tok_s": d, "ratio": d / p, "drafted_tokens": 50, "accepted_tokens": 45}
            for p, d in ((100.0, 200.0), (110.0, 198.0), (90.0, 150.0))
        ],
        "free": [{"plain_tok_s": 100.0, "drafted_tok_s": 99.0, "ratio": 0.99}],
    }
    doc = {"command": "speculation.py", "host": "h", "date": "2026-12-07", "git_commit": "abc"}
    _write(
        tmp_path, "2026-12-07-speculation-demo.json", {**doc, "settings": {"model_dir": "demo"}, "speculation": runs}
    )
    text = _sections(report.render(tmp_path))["Speculative decoding"]
    assert "| edit | 100.0 (90.0–110.0) | 198.0 (150.0–200.0) | 1.80 (1.67–2.00) | 0.90 (0.90–0.90) |" in text
    assert "| free | 100.0 | 99.0 | 0.99 | 0.00 |" in text
