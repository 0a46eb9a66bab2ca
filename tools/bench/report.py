#!/usr/bin/env python3
"""docs/performance.md from tools/bench/results/*.json: the current figures, one section a question.

    python tools/bench/report.py                  # rewrite docs/performance.md
    python tools/bench/report.py --check          # exit 1 if docs/performance.md is not what it would write
    python tools/bench/report.py --results DIR --out FILE

How results are chosen
----------------------
- Every ``*.json`` under the results directory is read. Its *shape* says which tool wrote it:
  run_bench.py (a dict with ``model`` and ``rows``), long_context.py (a list of
  ``{engine, depth, rep, pp, tg}``), serve_load.py (a list of ``{target, rate, ttft_p50, ...}``),
  memcap.py (a dict ``"<engine> <cap>" -> [runs]``), tools/bench_constraint.py (a dict with
  ``mask`` and ``decode``), prefix_store.py (a dict with ``settings`` and ``runs`` keyed
  ``"<engine> returning|shared|restart"``), speculation.py (a dict with ``settings`` and
  ``speculation``). Any other shape, or a file that does not parse, is listed under
  "Other results" (file name and its ``command``) and nothing else is read from it.
- Each question groups its files by a key (peers: host kind and model; long context: host kind,
  model and depth; memory cap: model and format; serving and constrained decoding: one group).
  In each group only the NEWEST files count: the greatest ``date`` (compared as the recorded ISO
  string, so a date with a time of day is later than the bare day); when several files share it,
  all of them are shown, in file-name order, each row naming its source.
- Provenance (date, host, commit, command) comes from the file itself (``date``, ``host``,
  ``git_commit`` / ``commit``, ``command``); for run_bench.py and serve_load.py files, from the
  Markdown file of the same name they write beside the JSON; for files whose tool recorded none of
  it, from ``JOURNAL`` below (copied from the retired BENCHMARKS.md journal, marked as such); the
  date otherwise from the file name's ``YYYY-MM-DD-`` prefix. What none of these has is printed as
  "not recorded".
- The host kind (AVX-512 / AVX2 / AMX) is what the run used: Colibri's ``kernels`` tier and
  ``int step`` in run_bench.py's Markdown, else the host strings, else the file name
  (``avx2``/``zen3`` -> AVX2, ``amx`` -> AMX, ``zen4``/``zen5`` -> AVX-512).
- Figures are medians over a file's repetitions with (min–max); ratios are Colibri's median over the
  peer's. No figure is written that is not read from a results file. The output is deterministic
  (sorted, no time stamp), so ``--check`` can hold docs/performance.md to the results.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "tools" / "bench" / "results"
OUT = REPO / "docs" / "performance.md"

LONG_DEPTH_MIN = 16384  # the long-context section shows depths from here on
MODELS = (
    "qwen3-moe-4l",
    "mixtral-mini",
    "olmoe-1b-7b-8l",
    "olmoe-1b-7b",
    "gpt-oss-20b-4l",
    "deepseek-v3-3l",
    "demo-padded",
)
KINDS = ("AVX-512", "AVX2", "AMX")

# Provenance of results files whose tool did not record it, copied from the retired dated journal
# (BENCHMARKS.md, removed in git; `git log -- BENCHMARKS.md`). Metadata only: no figure comes from here.
_LC = (
    "python tools/bench/long_context.py --model-dir /work/bench_cache/colibri/qwen3-moe-4l-int4 "
    "--gguf /work/bench_cache/gguf/qwen3-moe-4l-q4_0.gguf --llama-bench {llama} --ik-bench {ik} "
    "--depths {depths} --reps 2 --skip '{skip}'"
)
_SKIP_PEER = "llama.cpp fa,colibri kv f32,colibri kv f16,ik_llama.cpp -rtr fa off,ik_llama.cpp -rtr fa on$"
_ZEN4 = "AMD EPYC Zen 4, 2 vCPUs (AVX-512 + VNNI + BF16, no AMX)"
_AVX2_ON_ZEN4 = (
    "AMD EPYC Zen 4, 2 vCPUs, both engines on AVX2 code "
    "(COLIBRI_ISA=avx2 COLIBRI_INT_STEP=avx2, the peers' AVX2 builds)"
)
_MEMCAP = (
    "python tools/bench/memcap.py --model-dir /work/bench_cache/colibri/{model} --gguf "
    "/work/bench_cache/gguf/{gguf} --llama-bench /work/bench_cache/llama.cpp-build/bin/llama-bench "
    "--caps none,100,75,50,25 --runs 2{extra}"
)
JOURNAL: dict[str, dict] = {
    "2026-12-05-long-context-qwen3-moe-4l-zen4-32k.json": dict(
        host=_ZEN4,
        kind="AVX-512",
        commit="d3b6258",
        command=_LC.format(
            llama="/work/bench_cache/llama.cpp-build-avx2/bin/llama-bench",
            ik="/work/bench_cache/ik-build/bin/llama-bench",
            depths=32768,
            skip=_SKIP_PEER,
        ),
    ),
    "2026-12-05-long-context-qwen3-moe-4l-avx2-only-zen4-32k.json": dict(
        host=_AVX2_ON_ZEN4,
        kind="AVX2",
        commit="d3b6258",
        command="COLIBRI_ISA=avx2 COLIBRI_INT_STEP=avx2 "
        + _LC.format(
            llama="/work/bench_cache/llama.cpp-build-avx2/bin/llama-bench",
            ik="/work/bench_cache/ik-build-avx2/bin/llama-bench",
            depths=32768,
            skip=_SKIP_PEER,
        ),
    ),
    "2026-12-05-long-context-qwen3-moe-4l-avx2-only-zen4-16k.json": dict(
        host=_AVX2_ON_ZEN4,
        kind="AVX2",
        commit="9d51059",
        command="COLIBRI_ISA=avx2 COLIBRI_INT_STEP=avx2 "
        + _LC.format(
            llama="/work/bench_cache/llama.cpp-build-avx2/bin/llama-bench",
            ik="/work/bench_cache/ik-build-avx2/bin/llama-bench",
            depths=16384,
            skip="llama.cpp fa,colibri kv f32,ik_llama.cpp -rtr fa off",
        ),
    ),
    "2026-12-05-long-context-qwen3-moe-4l-avx2-only-zen4-16k-after.json": dict(
        host=_AVX2_ON_ZEN4,
        kind="AVX2",
        command="COLIBRI_ISA=avx2 COLIBRI_INT_STEP=avx2 "
        + _LC.format(
            llama="/work/bench_cache/llama.cpp-build-avx2/bin/llama-bench",
            ik="/work/bench_cache/ik-build-avx2/bin/llama-bench",
            depths=16384,
            skip=_SKIP_PEER,
        ),
    ),
    "2026-12-04-long-context-qwen3-moe-4l-zen4-16k-prefetch.json": dict(
        host=_ZEN4,
        kind="AVX-512",
        commit="a605fb9",
        command=_LC.format(llama="...", ik="...", depths=16384, skip=_SKIP_PEER),
    ),
    "2026-12-04-long-context-qwen3-moe-4l-zen4-16k-prefetch-2.json": dict(
        host=_ZEN4,
        kind="AVX-512",
        commit="a605fb9",
        command=_LC.format(llama="...", ik="...", depths=16384, skip=_SKIP_PEER),
    ),
    "2026-12-04-long-context-qwen3-moe-4l-zen4-16k.json": dict(host=_ZEN4, kind="AVX-512"),
    "2026-12-02-long-context-qwen3-moe-4l-16k.json": dict(host=_ZEN4, kind="AVX-512"),
    "2026-12-02-long-context-qwen3-moe-4l-short.json": dict(host=_ZEN4, kind="AVX-512"),
    "2026-12-04-long-context-qwen3-moe-4l-zen4-32k.json": dict(host=_ZEN4, kind="AVX-512"),
    "2026-12-01-memcap-demo-padded-int8.json": dict(
        host="AMD EPYC, 2 vCPUs (AVX-512 + VNNI); cgroup v1, storage read 1.1 GB/s",
        command="python tools/bench/memcap.py --model-dir /work/bench_cache/colibri/demo-padded/int8 "
        "--caps none,100,75,50,25 --runs 2 --text tests/fixtures/demo/heldout_head.txt",
    ),
    "2026-12-01-memcap-mixtral-mini-int8.json": dict(
        host="AMD EPYC, 2 vCPUs (AVX-512 + VNNI); cgroup v1, storage read 1.1 GB/s",
        command=_MEMCAP.format(model="mixtral-mini-int8", gguf="mixtral-mini-q8_0.gguf", extra=""),
    ),
    "2026-12-01-memcap-mixtral-mini-int4.json": dict(
        host="AMD EPYC, 2 vCPUs (AVX-512 + VNNI); cgroup v1, storage read 1.1 GB/s",
        command=_MEMCAP.format(model="mixtral-mini-int4", gguf="mixtral-mini-q4_0.gguf", extra=" --timeout 150"),
    ),
    "2026-12-04-serve-parallel-int8-zen4.json": dict(host=_ZEN4),
    "2026-12-04-serve-parallel-peers-int8-zen4.json": dict(host=_ZEN4, commit="679f36d"),
    "2026-12-04-serve-step-tokens-int8-zen4.json": dict(host=_ZEN4),
}

NOT_RECORDED = "not recorded"


# ---------------------------------------------------------------------------------------- loading


@dataclass
class Result:
    name: str  # the file name, e.g. 2026-12-05-mixtral-mini-zen4.json
    shape: str | None  # "run_bench", "long_context", "serve_load", "memcap", "constraint", "decode_phases", ...
    data: object
    meta: dict = field(default_factory=dict)  # date, host, commit, command, kind, model, journal


def shape_of(data) -> str | None:
    """Which tool wrote `data`, by its shape; None for a shape this report does not know."""
    if isinstance(data, dict):
        if isinstance(data.get("rows"), list) and "model" in data:
            return "run_bench"
        if isinstance(data.get("mask"), dict) and isinstance(data.get("decode"), list):
            return "constraint"
        if (
            isinstance(data.get("settings"), dict)
            and isinstance(data.get("runs"), dict)
            and any(k.endswith((" returning", " shared")) for k in data["runs"])
        ):
            return "prefix_store"
        if isinstance(data.get("settings"), dict) and isinstance(data.get("speculation"), dict):
            return "speculation"
        if (
            isinstance(data.get("summary"), dict)
            and isinstance(data["summary"].get("by_outcome"), dict)
            and isinstance(data["summary"].get("latency_by_minute"), dict)
        ):
            return "soak"
        if (
            isinstance(data.get("summary"), dict)
            and "active_bytes" in data
            and all(isinstance(v, dict) and "phase_ms" in v for v in data["summary"].values())
        ):
            return "decode_phases"
        if isinstance(data.get("summary"), list) and all(
            isinstance(r, dict) and {"memory", "threads", "way", "median_gbs"} <= r.keys() for r in data["summary"]
        ):
            return "read_roofline"
        if (
            isinstance(data.get("runs"), dict)
            and all(isinstance(v, dict) and all(isinstance(x, list) for x in v.values()) for v in data["runs"].values())
            and any("decode_read_gb_s" in r for v in data["runs"].values() for x in v.values() for r in x)
        ):
            return "decode_roofline"
        if (
            data
            and all(isinstance(v, list) and re.fullmatch(r"\S+ \S+", k) for k, v in data.items())
            and any(isinstance(r, dict) and ("decode_tok_s" in r or "error" in r) for v in data.values() for r in v)
        ):
            return "memcap"
        return None
    if isinstance(data, list) and data and all(isinstance(r, dict) for r in data):
        if all({"engine", "depth", "pp", "tg"} <= r.keys() for r in data):
            return "long_context"
        if all({"target", "rate", "throughput"} <= r.keys() for r in data):
            return "serve_load"
    return None


def _md_meta(md: Path) -> dict:
    """run_bench.py's / serve_load.py's Markdown beside a JSON: its title date, machine, commit, command."""
    meta: dict = {}
    if not md.is_file():
        return meta
    text = md.read_text(encoding="utf-8", errors="replace")
    if m := re.search(r"^# .*?(\d{4}-\d{2}-\d{2})\s*$", text, re.M):
        meta["date"] = m.group(1)
    if m := re.search(r"^- Machine: (.+)$", text, re.M):
        meta["host"] = m.group(1).split(";")[0].strip()
    if m := re.search(r"^- Colibri: git ([0-9a-f]{7,40}( \+ uncommitted changes)?), (.+?) \(", text, re.M):
        meta["commit"] = m.group(1)
        meta["tier"] = m.group(3)  # "kernels avx512, int step avx512-vnni"
    if m := re.search(r"^Command: `(.+)`\s*$", text, re.M) or re.match(r"`(python [^`]+)`", text):
        meta["command"] = m.group(1)
    return meta


def _host_str(host) -> str:
    if isinstance(host, dict):
        parts = [str(host.get("cpu", "")).strip()]
        if host.get("cores"):
            parts.append(f"{host['cores']} cores")
        if host.get("note"):
            parts.append(str(host["note"]))
        return ", ".join(p for p in parts if p)
    return str(host)


def host_kind(meta: dict, name: str) -> str:
    """AVX-512 / AVX2 / AMX: the code the run used, as its strings say (module docstring)."""
    if meta.get("kind") in KINDS:
        return meta["kind"]
    tier = meta.get("tier", "").lower()
    if "int step amx" in tier:
        return "AMX"
    if "kernels avx512" in tier:
        return "AVX-512"
    if "kernels avx2" in tier:
        return "AVX2"
    host = re.sub(r"no (amx|avx-?vnni)", "", meta.get("host", "").lower())
    for pat, kind in ((r"\bamx\b", "AMX"), (r"avx-?512", "AVX-512"), (r"\bavx2\b", "AVX2")):
        if re.search(pat, host):
            return kind
    for pat, kind in ((r"avx2|zen3", "AVX2"), (r"amx", "AMX"), (r"zen4|zen5|avx512", "AVX-512")):
        if re.search(pat, name):
            return kind
    return "host kind not recorded"


def _model_from_name(name: str) -> str:
    for model in sorted(MODELS, key=len, reverse=True):
        if f"-{model}-" in name or f"-{model}." in name:
            return model
    return "model not recorded"


def load(results_dir: Path) -> list[Result]:
    out = []
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            out.append(Result(path.name, None, None, {"command": "(does not parse as JSON)"}))
            continue
        shape = shape_of(data)
        meta: dict = {}
        if isinstance(data, dict):
            for key, src in (
                ("date", "date"),
                ("command", "command"),
                ("commit", "git_commit"),
                ("commit", "commit"),
                ("commit", "commit_b"),
            ):
                if data.get(src) and key not in meta:
                    meta[key] = str(data[src])
            if data.get("host"):
                meta["host"] = _host_str(data["host"])
        for k, v in _md_meta(path.with_suffix(".md")).items():
            meta.setdefault(k, v)
        journal = JOURNAL.get(path.name, {})
        for k, v in journal.items():
            if k not in meta:
                meta[k] = v
                meta.setdefault("journal", []).append(k)
        if "date" not in meta and (m := re.match(r"(\d{4}-\d{2}-\d{2})-", path.name)):
            meta["date"] = m.group(1)
        if isinstance(data, dict) and isinstance(data.get("model"), str) and shape == "run_bench":
            meta["model"] = data["model"]
        else:
            meta.setdefault("model", _model_from_name(path.name))
        meta["kind"] = host_kind(meta, path.name)
        out.append(Result(path.name, shape, data, meta))
    return out


def newest(results: list[Result]) -> list[Result]:
    """The files of the greatest date among `results`, in file-name order."""
    if not results:
        return []
    top = max(r.meta.get("date", "") for r in results)
    return sorted((r for r in results if r.meta.get("date", "") == top), key=lambda r: r.name)


def _day_number(date: str) -> int:
    """A sortable integer of a date's day (0 when it has none): newest-first orders."""
    m = re.match(r"(\d{4})-(\d{2})-(\d{2})", date)
    return int("".join(m.groups())) if m else 0


def newest_by(results: list[Result], key) -> dict:
    groups: dict = {}
    for r in results:
        groups.setdefault(key(r), []).append(r)
    return {k: newest(v) for k, v in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0])))}


# ---------------------------------------------------------------------------------------- formatting


def num(x, digits=None) -> str:
    if x is None:
        return "–"
    if digits is None:
        digits = 1 if abs(x) >= 100 else 2
    return f"{x:.{digits}f}"


def med(values, digits=None, spread=True) -> str:
    vals = [v for v in values if isinstance(v, (int, float))]
    if not vals:
        return "–"
    m = statistics.median(vals)
    if spread and len(vals) > 1:
        return f"{num(m, digits)} ({num(min(vals), digits)}–{num(max(vals), digits)})"
    return num(m, digits)


def median_or_none(values):
    vals = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(vals) if vals else None


def ratio(a, b) -> str:
    return f"{a / b:.2f}" if a is not None and b else "–"


def table(header: list[str], rows: list[list[str]], align: str = "") -> list[str]:
    align = align or "l" * len(header)
    sep = ["---:" if a == "r" else "---" for a in align]
    return [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join(sep) + " |",
        *("| " + " | ".join(str(c) for c in row) + " |" for row in rows),
    ]


def provenance(files: list[Result]) -> list[str]:
    """One line per file: results file, date, host, commit, command (the brief's four, always named)."""
    lines = []
    for i, r in enumerate(files, 1):
        m = r.meta
        jr = [k for k in ("host", "commit", "command") if k in m.get("journal", [])]
        tag = f"[{i}] " if len(files) > 1 else ""
        host = m.get("host") or NOT_RECORDED
        if m.get("tier"):
            host += f" (Colibri {m['tier']})"
        cmd = f"`{m['command']}`" if m.get("command") else NOT_RECORDED
        note = f" ({', '.join(jr)} from the retired journal, not the file)" if jr else ""
        lines.append(
            f"- {tag}`{r.name}` — date: {m.get('date', NOT_RECORDED)}; host: {host}; "
            f"commit: {m.get('commit') or NOT_RECORDED}; command: {cmd}{note}"
        )
    return lines


def _src(files: list[Result], r: Result) -> list[str]:
    return [f"[{files.index(r) + 1}]"] if len(files) > 1 else []


# ---------------------------------------------------------------------------------------- questions


def section_peers(results: list[Result]) -> list[str]:
    out = [
        "## Decode and prefill against llama.cpp and ik_llama.cpp",
        "",
        "Per host kind (the code each engine ran) and model: prefill (pp, the whole prompt) and decode "
        "(tg, one token at a time) in tokens/s, median (min–max) of the repetitions, 2 threads unless "
        "the row says otherwise; the last column is Colibri's median over that engine's, on the "
        "matching format (Colibri int8 / GGUF q8_0, int4 / q4_0, bf16 / bf16, mxfp4 / mxfp4). "
        "Models are random-weight checkpoints in the real models' shapes (tools/bench/README.md).",
        "",
    ]
    mine = [r for r in results if r.shape == "run_bench"]
    if not mine:
        return out + [
            "No measurement yet: run `python tools/bench/run_bench.py --models mixtral-mini "
            "--ik-bench PATH/TO/ik_llama.cpp/build/bin/llama-bench`.",
            "",
        ]
    groups = newest_by(mine, lambda r: (r.meta["kind"], r.meta["model"]))
    unknown = sorted({k for k, _ in groups} - set(KINDS))
    for kind in (*KINDS, *unknown):
        # the models of this host kind, the most recently measured first
        keyed = sorted(
            ((m, fs) for (k, m), fs in groups.items() if k == kind),
            key=lambda mf: (-_day_number(mf[1][0].meta.get("date", "")), mf[0]),
        )
        out += [f"### {kind} host" if kind in KINDS else f"### {kind[0].upper() + kind[1:]}", ""]
        if not keyed:
            out += [
                f"No measurement yet on an {kind} host: run `python tools/bench/run_bench.py "
                "--models mixtral-mini --ik-bench PATH` there"
                + (
                    " (or `python tools/bench/amx_engine.py --build --out DIR --llama-bench PATH "
                    "--ik-bench PATH` on a lent machine)"
                    if kind == "AMX"
                    else ""
                )
                + ".",
                "",
            ]
            continue
        for model, files in keyed:
            out += [f"#### {model}, {files[0].meta.get('date', NOT_RECORDED)[:10]}", ""]
            rows = []
            for r in files:
                colibri = None
                for row in r.data["rows"]:
                    if not isinstance(row, dict):
                        continue
                    runs = [x for x in row.get("runs") or [] if isinstance(x, dict)]
                    pp = median_or_none(x.get("pp") for x in runs)
                    tg = median_or_none(x.get("tg") for x in runs)
                    engine = str(row.get("engine", "?"))
                    if engine == "colibri":
                        colibri = (pp, tg)
                        rel = ""
                    elif colibri and runs:
                        rel = f"{ratio(colibri[0], pp)} / {ratio(colibri[1], tg)}"
                    else:
                        rel = "–"
                    if not runs:
                        pp_s = tg_s = "did not run" + (f": {row['error']}" if row.get("error") else "")
                    else:
                        pp_s = med(x.get("pp") for x in runs)
                        tg_s = med(x.get("tg") for x in runs)
                    name = "**Colibri**" if engine == "colibri" else engine
                    thr = row.get("threads")
                    if thr not in (2, None):
                        name += f" ({thr} threads)"
                    rows.append([str(row.get("format", "?")), name, pp_s, tg_s, rel, *_src(files, r)])
            hdr = ["format", "engine", "prefill tok/s", "decode tok/s", "Colibri ÷ it (prefill / decode)"]
            out += table(hdr + (["source"] if len(files) > 1 else []), rows, "llrrr" + "l" * (len(files) > 1))
            out += [""] + provenance(files) + [""]
    return out


def section_long_context(results: list[Result]) -> list[str]:
    out = [
        "## Long context",
        "",
        f"A prompt of D tokens (prefill, pp) and tokens decoded after it (decode, tg), tokens/s, median "
        f"(min–max) of the repetitions; depths from {LONG_DEPTH_MIN:,} on. Each engine row is a "
        "configuration (KV-cache type, flash attention, run-time repacking). The ratio is Colibri's "
        "best configuration over the best peer's at that depth.",
        "",
    ]
    mine = [r for r in results if r.shape == "long_context"]
    keyed: dict = {}
    for r in mine:
        for d in sorted({row["depth"] for row in r.data if isinstance(row.get("depth"), int)}):
            if d >= LONG_DEPTH_MIN:
                keyed.setdefault((r.meta["kind"], r.meta["model"], d), []).append(r)
    if not keyed:
        return out + [
            "No measurement yet: run `python tools/bench/long_context.py --model-dir DIR --gguf FILE "
            "--llama-bench PATH --ik-bench PATH --depths 16384,32768 --out FILE.json`.",
            "",
        ]
    by_table: dict = {}
    for (kind, model, depth), files in keyed.items():
        by_table.setdefault((kind, model), []).append((depth, newest(files)))
    order = {k: i for i, k in enumerate(KINDS)}
    for kind, model in sorted(by_table, key=lambda k: (order.get(k[0], 9), k[1])):
        entries = sorted(by_table[(kind, model)])
        files = sorted({r.name: r for _, fs in entries for r in fs}.values(), key=lambda r: r.name)
        title = f"{kind} host" if kind in KINDS else kind[0].upper() + kind[1:]
        out += [f"### {title}, {model}", ""]
        rows = []
        for depth, fs in entries:
            for r in fs:
                engines: dict = {}
                for row in r.data:
                    if row.get("depth") == depth:
                        engines.setdefault(str(row["engine"]), []).append(row)
                best = {"colibri": [None, None], "peer": [None, None]}
                for eng, rs in engines.items():
                    side = "colibri" if eng.startswith("colibri") else "peer"
                    for i, k in enumerate(("pp", "tg")):
                        m = median_or_none(x.get(k) for x in rs)
                        if m is not None and (best[side][i] is None or m > best[side][i]):
                            best[side][i] = m
                for eng in sorted(engines, key=lambda e: (not e.startswith("colibri"), e)):
                    rs = engines[eng]
                    name = f"**{eng}**" if eng.startswith("colibri") else eng
                    rows.append(
                        [
                            f"{depth:,}",
                            name,
                            med(x.get("pp") for x in rs),
                            med(x.get("tg") for x in rs),
                            "",
                            *_src(files, r),
                        ]
                    )
                rows.append(
                    [
                        f"{depth:,}",
                        "Colibri ÷ best peer",
                        ratio(best["colibri"][0], best["peer"][0]),
                        ratio(best["colibri"][1], best["peer"][1]),
                        "",
                        *_src(files, r),
                    ]
                )
        rows = [row[:4] + row[5:] for row in rows]
        hdr = ["depth", "engine", "prefill tok/s", "decode tok/s"] + (["source"] if len(files) > 1 else [])
        out += table(hdr, rows, "rlrr" + "l" * (len(files) > 1))
        out += [""] + provenance(files) + [""]
    return out


def _cap_key(key: str):
    engine, cap = key.rsplit(" ", 1)
    try:
        c = float(cap)
    except ValueError:
        c = float("inf")  # "None": no cap, first
    return (-c, engine != "colibri", engine)


def section_memcap(results: list[Result]) -> list[str]:
    out = [
        "## Under a memory cap (models larger than RAM)",
        "",
        "Each row a fresh process in a fresh cgroup whose memory limit is the cap (a percentage of the "
        "model's bytes; page cache included), every model file evicted first (cold start). Medians of "
        "the runs. Colibri plans its expert cache from the limit; llama.cpp relies on the kernel's reclaim.",
        "",
    ]
    mine = [r for r in results if r.shape == "memcap"]
    if not mine:
        return out + [
            "No measurement yet: run `python tools/bench/memcap.py --model-dir DIR --gguf FILE "
            "--llama-bench PATH --caps none,100,75,50,25 --out FILE.json`.",
            "",
        ]
    groups = newest_by(
        mine, lambda r: (r.name.split("memcap-", 1)[-1].rsplit(".", 1)[0] if "memcap-" in r.name else r.meta["model"],)
    )
    for (what,), files in groups.items():
        out += [f"### {what}", ""]
        rows = []
        for r in files:
            for key in sorted(r.data, key=_cap_key):
                engine, cap = key.rsplit(" ", 1)
                runs = [x for x in r.data[key] if isinstance(x, dict)]
                ok = [x for x in runs if "error" not in x]
                cap_s = "none" if cap == "None" else f"{float(cap):g} %"
                if not ok:
                    err = sorted({str(x.get("error", "")).split(":")[0] for x in runs})
                    oom = max((x.get("oom_kills") or 0 for x in runs), default=0)
                    peak = median_or_none(x.get("peak_mb") for x in runs)
                    rows.append(
                        [
                            cap_s,
                            "**Colibri**" if engine == "colibri" else engine,
                            f"failed ({', '.join(err)})",
                            "–",
                            "–",
                            "–",
                            "–",
                            num(peak, 0),
                            str(oom),
                            *_src(files, r),
                        ]
                    )
                    continue
                hit = median_or_none(x.get("cache_hit_rate") for x in ok)
                rows.append(
                    [
                        cap_s,
                        "**Colibri**" if engine == "colibri" else engine,
                        med((x.get("decode_tok_s") for x in ok), spread=False),
                        med((x.get("prefill_tok_s") for x in ok), spread=False),
                        med((x.get("ttft_ms") for x in ok), 0, spread=False),
                        med((x.get("read_mb_per_token") for x in ok), spread=False),
                        f"{hit * 100:.1f} %" if hit is not None else "–",
                        med((x.get("peak_mb") for x in ok), 0, spread=False),
                        str(max((x.get("oom_kills") or 0 for x in ok), default=0)),
                        *_src(files, r),
                    ]
                )
        hdr = [
            "cap",
            "engine",
            "decode tok/s",
            "prefill tok/s",
            "TTFT ms",
            "read MB/token",
            "expert hit rate",
            "cgroup peak MB",
            "OOM kills",
        ] + (["source"] if len(files) > 1 else [])
        out += table(hdr, rows, "ll" + "r" * 7 + "l" * (len(files) > 1))
        out += [""] + provenance(files) + [""]
    return out


def section_serving(results: list[Result]) -> list[str]:
    out = [
        "## Serving under load",
        "",
        "Open-loop Poisson arrivals at each rate against OpenAI-compatible servers (Colibri's `serve`, "
        "llama-server, ik_llama.cpp's server), targets alternated per rate: time to first token (TTFT), "
        "inter-token latency (ITL) and end-to-end latency at P50 / P99, and the generated tokens/s. "
        "`colibri-pN` is `serve --parallel N`, `llama-npN` llama-server `-np N`, `-sN` `--step-tokens N`.",
        "",
    ]
    mine = [r for r in results if r.shape == "serve_load"]
    if not mine:
        return out + [
            "No measurement yet: run `python tools/bench/serve_load.py --model-dir DIR "
            "--target llama=http://127.0.0.1:8080 --rates 0.5,1,2,4 --out FILE.md`.",
            "",
        ]
    for files in newest_by(mine, lambda r: ("serving",)).values():
        for r in files:
            rows = []
            for row in r.data:  # the order the tool ran them

                def ms(k, d=0):
                    return num(row[k] * 1000, d) if isinstance(row.get(k), (int, float)) else "–"

                def s(k):
                    return num(row[k], 2) if isinstance(row.get(k), (int, float)) else "–"

                rows.append(
                    [
                        f"{row['target']}",
                        f"{row['rate']:g}",
                        f"{row.get('ok', '?')}/{row.get('requests', '?')}",
                        f"{ms('ttft_p50')} / {ms('ttft_p99')}",
                        f"{ms('itl_p50', 1)} / {ms('itl_p99', 1)}",
                        f"{s('e2e_p50')} / {s('e2e_p99')}",
                        num(row.get("throughput"), 1),
                    ]
                )
            out += [f"### `{r.name}`", ""]
            out += table(
                ["target", "rate req/s", "ok", "TTFT P50 / P99 ms", "ITL P50 / P99 ms", "E2E P50 / P99 s", "tok/s"],
                rows,
                "lrrrrrr",
            )
            out += [""] + provenance([r]) + [""]
    return out


def section_prefix_store(results: list[Result]) -> list[str]:
    out = [
        "## Prompts computed once: the prefix store",
        "",
        "Time to first token (a completion of one token, random token ids) of a prompt the server "
        "computed before, against a cold prompt of the same length on the same server. *returning*: a "
        "conversation, three others that take the only place, then the first one with a few new tokens "
        "(Colibri `serve` with its default prefix store; llama-server `--cache-ram`); *restart*: the "
        "conversation served, the server restarted with `--kv-store`, then its return; *shared*: requests "
        "sharing a system prompt sent at once to 4 places, the wall time until all are answered and the "
        "prompt tokens the engine ran (from `/metrics`) against one system prompt plus the unique parts.",
        "",
    ]
    mine = [r for r in results if r.shape == "prefix_store"]
    if not mine:
        return out + [
            "No measurement yet: run `python tools/bench/prefix_store.py --model-dir DIR --reps 3 --out FILE.json`.",
            "",
        ]
    for files in newest_by(mine, lambda r: ("prefix_store",)).values():
        for r in files:
            st = r.data.get("settings", {})
            rows, shared = [], []
            for name, runs in r.data["runs"].items():
                engine, _, scenario = name.rpartition(" ")
                if scenario in ("returning", "restart"):
                    rows.append(
                        [
                            engine,
                            scenario,
                            med([x["returning"] * 1000 for x in runs], 0),
                            med([x["cold"] * 1000 for x in runs], 0),
                            med([x["ratio"] for x in runs], 3),
                        ]
                    )
                elif scenario == "shared":
                    computed = [x["computed_tokens"] for x in runs if "computed_tokens" in x]
                    shared.append(
                        [
                            engine,
                            med([x["wall"] for x in runs], 2),
                            med(computed, 0) if computed else "not reported",
                            str(runs[0]["ideal_tokens"]) if runs else "–",
                        ]
                    )
            out += [f"### `{r.name}`", ""]
            out += [
                f"Conversation {st.get('conversation')} tokens, others {st.get('others')}, new turn "
                f"{st.get('turn')}; system prompt {st.get('system')} tokens + {st.get('unique')} each, "
                f"{st.get('requests')} requests in {st.get('places')} places; {st.get('threads')} threads; "
                f"medians of {st.get('reps')} (min–max).",
                "",
            ]
            out += table(
                ["engine", "scenario", "TTFT ms", "cold TTFT ms", "÷ cold"],
                rows,
                "llrrr",
            )
            out += [""]
            out += table(["engine", "shared: wall s", "prompt tokens run", "one system prompt + parts"], shared, "lrrr")
            out += [""] + provenance([r]) + [""]
    return out


def section_speculation(results: list[Result]) -> list[str]:
    out = [
        "## Speculative decoding",
        "",
        "Decode tokens/s with drafts over plain decoding, the same model and prompt back to back, the "
        "tokens checked equal (greedy). *edit*: OpenAI's `prediction` holding the model's reply with one "
        "token in 20 changed (an edit that keeps most of a file); *quote*: a prompt that holds a passage "
        "twice and begins it a third time, n-gram drafts; *free*: free generation with the default "
        "drafts (auto). Medians of the repetitions (min–max); acceptance: accepted / drafted tokens.",
        "",
    ]
    mine = [r for r in results if r.shape == "speculation"]
    if not mine:
        return out + ["No measurement yet: run `python tools/bench/speculation.py --reps 5 --out FILE.json`.", ""]
    for files in newest_by(mine, lambda r: (r.data.get("settings", {}).get("model_dir"),)).values():
        for r in files:
            rows = []
            for name, runs in r.data["speculation"].items():
                rows.append(
                    [
                        name,
                        med([x["plain_tok_s"] for x in runs], 1),
                        med([x["drafted_tok_s"] for x in runs], 1),
                        med([x["ratio"] for x in runs], 2),
                        med(
                            [
                                x["accepted_tokens"] / x["drafted_tokens"] if x.get("drafted_tokens") else 0.0
                                for x in runs
                            ],
                            2,
                        ),
                    ]
                )
            st = r.data.get("settings", {})
            out += [
                f"### `{r.name}`",
                "",
                f"Model `{st.get('model_dir')}`, {st.get('threads')} threads, {st.get('gen')} tokens.",
                "",
            ]
            out += table(["scenario", "plain tok/s", "drafted tok/s", "× plain", "acceptance"], rows, "lrrrr")
            peers = r.data.get("peers") or {}
            if peers:  # the quote scenario on each peer's llama-server, interleaved with Colibri's runs
                quote = r.data["speculation"].get("quote", [])
                prow = [
                    [
                        f"{name} `--spec-type {st.get('peer_spec')}`",
                        med([x["plain_tok_s"] for x in runs], 1),
                        med([x["drafted_tok_s"] for x in runs], 1),
                        med([x["drafted_tok_s"] / x["plain_tok_s"] for x in runs], 2),
                        med(
                            [x["accepted_tokens"] / x["drafted_tokens"] if x["drafted_tokens"] else 0.0 for x in runs],
                            2,
                        ),
                        med([c["drafted_tok_s"] / x["drafted_tok_s"] for c, x in zip(quote, runs)], 2),
                    ]
                    for name, runs in peers.items()
                ]
                out += [
                    "",
                    f"The quote scenario on the peers' llama-server (GGUF `{st.get('gguf')}`, the same prompt "
                    f"ids, greedy), each repetition between Colibri's:",
                    "",
                ]
                out += table(
                    ["engine", "plain tok/s", "drafted tok/s", "× plain", "acceptance", "Colibri's drafted / its"],
                    prow,
                    "lrrrrr",
                )
            out += [""] + provenance([r]) + [""]
    return out


def section_soak(results: list[Result]) -> list[str]:
    out = [
        "## Under load and abuse",
        "",
        "tools/bench/soak.py against `serve --parallel N` at its saturating rate: closed-loop clients "
        "sending every API's requests whole and streamed (tools, JSON schemas), dropping streams and "
        "prefills, reading slowly, sending bad, oversized and non-HTTP bytes; then a signal stops the "
        "server under running streams. 5xx on valid requests must be 0, RSS and descriptors flat after "
        "the first minute, `/metrics` equal to the requests sent.",
        "",
    ]
    mine = [r for r in results if r.shape == "soak"]
    if not mine:
        return out + ["No measurement yet: run `python tools/bench/soak.py --parallel 2 --out FILE.json`.", ""]
    r = newest(mine)[-1]
    s = r.data["summary"]
    rss, fds, m = s["rss_mb"], s["fds"], s["metrics"]
    outcomes = ", ".join(f"{k} {v:,}" for k, v in sorted(s["by_outcome"].items()))
    out += table(
        ["", ""],
        [
            ["requests", f"{s['requests']:,} in {s['seconds'] / 60:.0f} min ({outcomes})"],
            ["5xx on valid requests (all)", f"{s['five_xx_valid']} ({s['five_xx_all']})"],
            ["RSS MB: after 1 min → last (max)", f"{rss['after_1_min']:.1f} → {rss['last']:.1f} ({rss['max']:.1f})"],
            ["open descriptors: after 1 min → last (max)", f"{fds['after_1_min']} → {fds['last']} ({fds['max']})"],
            ["`/metrics` requests counted / sent", f"{m['counted']:,} / {m['sent']:,}"],
            [
                "stop",
                f"SIG{s['drain']['signal'].upper()} under running streams ("
                + ", ".join(f"{n} {how}" for how, n in s["drain"]["streams"].items())
                + f"), exit {s['drain']['exit_code']} in {s['drain']['seconds_to_exit']} s",
            ],
        ],
        "ll",
    )
    lat = s["latency_by_minute"]
    p50 = [v["p50"] for v in lat.values()]
    p99 = [v["p99"] for v in lat.values()]
    out += [
        "",
        f"Latency of the 200s by minute (seconds): p50 {min(p50):.3f}–{max(p50):.3f}, "
        f"p99 {min(p99):.2f}–{max(p99):.2f} over the {len(lat)} minutes.",
        "",
    ]
    return out + provenance([r]) + [""]


def section_quality(results: list[Result]) -> list[str]:
    return [
        "## Quality per byte",
        "",
        "The formats' error (KL divergence from the full-precision model) at their bytes per token, "
        "against llama.cpp's quants on the same checkpoint and text.",
        "",
        "No measurement yet: run `python tools/bench/quant_vs_llama.py --hf-dir HF_DIR --text HELDOUT.txt "
        "--calib CALIB.txt --llama-bin LLAMA_BIN_DIR --work WORK_DIR` (it prints its table; it does not "
        "write a results file yet).",
        "",
    ]


def section_constraint(results: list[Result]) -> list[str]:
    out = [
        "## Constrained decoding cost",
        "",
        "Decode with a JSON-schema constraint against plain decode on the same model and prompt (ms per "
        "token, medians of the repetitions), and the constraint's work per token by kind of constraint "
        "(µs, median / P99): the critical path when the model's pick is allowed (check + consume) and "
        "when it is refused (check + mask + apply + consume).",
        "",
    ]
    mine = [r for r in results if r.shape == "constraint"]
    if not mine:
        return out + ["No measurement yet: run `python tools/bench_constraint.py --out FILE.json`.", ""]
    for files in newest_by(mine, lambda r: ("constraint",)).values():
        for r in files:
            d = r.data
            rows = []
            for dec in d["decode"]:
                if not isinstance(dec, dict):
                    continue
                mpt = dec.get("median_ms_per_token") or {}
                share = dec.get("critical_path_share_json_schema")
                rows.append(
                    [
                        str(dec.get("threads", "?")),
                        num(mpt.get("plain")),
                        num(mpt.get("json_schema")),
                        num(mpt.get("json_schema, mask inline")),
                        f"{share * 100:.1f} %" if isinstance(share, (int, float)) else "–",
                        {True: "yes", False: "no"}.get(dec.get("target_met"), "–"),
                    ]
                )
            out += [f"Target: {d.get('target', NOT_RECORDED)}.", ""]
            out += table(
                [
                    "threads",
                    "plain ms/token",
                    "json_schema ms/token",
                    "json_schema, mask inline ms/token",
                    "constraint's share of the critical path",
                    "target met",
                ],
                rows,
                "rrrrrl",
            )
            out += [""]
            rows = []
            for case, c in sorted((d["mask"].get("cases") or {}).items()):

                def mp(k):
                    v = c.get(k) or {}
                    return f"{num(v.get('median_us'), 1)} / {num(v.get('p99_us'), 1)}" if v else "–"

                rows.append(
                    [
                        case,
                        mp("critical_path, pick allowed (allows + consume)"),
                        mp("critical_path, pick refused (allows + mask + apply + consume)"),
                        mp("mask"),
                        num(c.get("compile_ms")),
                    ]
                )
            out += table(
                ["constraint", "pick allowed µs", "pick refused µs", "mask alone µs", "compile ms"], rows, "lrrrr"
            )
            out += [""] + provenance([r]) + [""]
    return out


def section_roofline(results: list[Result]) -> list[str]:
    out = [
        "## Decode against the memory's read rate",
        "",
        "A decoded token reads every active weight once, so decode is held to the rate the machine can "
        "read memory at. First the read roofline: threads streaming a buffer far past the last-level "
        "cache, the plain loop `python -m colibri bench --read-bandwidth` times and the best of the other "
        "ways of reading (wide loads, several streams per thread, software prefetch), per kind of memory "
        "(GB/s, medians). Then decode's own read rate (tokens/s x the bytes a token reads) against the "
        "plain loop timed just before and after it.",
        "",
    ]
    roof = [r for r in results if r.shape == "read_roofline"]
    dec = [r for r in results if r.shape == "decode_roofline"]
    phases = [r for r in results if r.shape == "decode_phases"]
    if not roof and not dec and not phases:
        return out + [
            "No measurement yet: run `tools/bench/read_roofline.c` (its header says how) and "
            "`python -m colibri bench --read-bandwidth --json`.",
            "",
        ]
    for files in newest_by(roof, lambda r: ("roof",)).values():
        for r in files:
            cells = {}
            for row in r.data["summary"]:
                cells.setdefault((row["memory"], row["threads"]), {})[row["way"]] = row["median_gbs"]
            rows = []
            for (memory, threads), ways in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])):
                best = max((w for w in ways if w != "plain"), key=lambda w: ways[w], default=None)
                rows.append(
                    [
                        memory,
                        str(threads),
                        num(ways.get("plain"), 1),
                        f"{num(ways[best], 1)} ({best})" if best else "–",
                        ratio(ways[best], ways["plain"]) if best and ways.get("plain") else "–",
                    ]
                )
            out += table(["memory", "threads", "plain loop GB/s", "best other way GB/s", "best ÷ plain"], rows, "lrrrr")
            if r.data.get("note"):
                out += ["", r.data["note"]]
            out += [""] + provenance([r]) + [""]
    for files in newest_by(dec, lambda r: ("dec",)).values():
        for r in files:
            rows = []
            for threads, formats in sorted(r.data["runs"].items()):
                for fmt, runs in sorted(formats.items()):
                    read = [x["decode_read_gb_s"] for x in runs]
                    loop = [statistics.median(x["read_loop_gb_s"]) for x in runs if x.get("read_loop_gb_s")]
                    tok = [x["decode_tok_s"] for x in runs if "decode_tok_s" in x]
                    rows.append(
                        [
                            fmt,
                            threads.removeprefix("threads "),
                            med(tok, 1),
                            med(read, 1),
                            med(loop, 1),
                            ratio(statistics.median(read), statistics.median(loop)) if loop else "–",
                        ]
                    )
            out += [f"Model: {r.data.get('model', NOT_RECORDED)}.", ""]
            out += table(
                ["format", "threads", "decode tok/s", "decode reads GB/s", "read loop GB/s", "decode ÷ loop"],
                rows,
                "llrrrr",
            )
            out += [""] + provenance([r]) + [""]
    if phases:
        out += [
            "### Where a decoded token's time goes",
            "",
            "Each engine's decode sampled by `perf` (decode only: attached after the load), its samples "
            "bucketed by phase, in ms a token (medians); the weight products' read rate is the bytes a token "
            "reads over the time in the products, beside the read loop timed in the same run.",
            "",
        ]
    for files in newest_by(phases, lambda r: (r.data.get("model"), r.data.get("format"))).values():
        for r in files:
            names = [p for p in next(iter(r.data["summary"].values()))["phase_ms"]]
            shown = [p for p in names if any(v["phase_ms"][p] >= 0.05 for v in r.data["summary"].values())]
            rows = []
            for engine, v in r.data["summary"].items():
                rows.append(
                    [engine, num(v["tok_s"], 1), num(v["ms_per_token"], 2)]
                    + [num(v["phase_ms"][p], 2) for p in shown]
                    + [num(v.get("products_gbs"), 1)]
                )
            bw = statistics.median(r.data["bandwidth_gbs"]) if r.data.get("bandwidth_gbs") else None
            out += [
                f"{r.data['model']} {r.data['format']}, {r.data['threads']} threads: "
                f"{r.data['active_bytes'] / 1e6:.1f} MB of weights a token; read loop {num(bw, 1)} GB/s.",
                "",
            ]
            out += table(
                ["engine", "decode tok/s", "ms/token", *shown, "products GB/s"], rows, "l" + "r" * (len(shown) + 3)
            )
            out += [""] + provenance([r]) + [""]
    return out


def section_other(results: list[Result]) -> list[str]:
    other = [r for r in results if r.shape is None]
    older = [r for r in results if r.shape is not None]
    out = ["## Other results", "", "Results files of shapes this page does not read (file, command):", ""]
    for r in other:
        cmd = r.meta.get("command", "no command recorded")
        out.append(f"- `{r.name}` — " + (f"`{cmd}`" if cmd.startswith(("python", "COLIBRI")) else cmd))
    if not other:
        out.append("- none")
    out += [
        "",
        f"The other {len(older)} results files of the kinds above hold older runs (superseded "
        "by the newer ones shown); they stay in tools/bench/results/, and git holds their history.",
        "",
    ]
    return out


INTRO = """# Performance

The current figures, organised by question. Every figure on this page is read from a results file
in `tools/bench/results/` (the raw JSON a benchmark tool writes); each table names the file(s) it
came from with the date, the host, the Colibri commit and the command that produced them. Only the
newest run of each kind is shown; older runs stay in the results directory and in git.

How to read it: the hosts are small shared cloud VMs (2 vCPUs), whose memory bandwidth moves with
their neighbours, so absolute tokens/s move from run to run; compare engines within one table
(they ran interleaved, in the same sitting), not across tables. "AVX-512", "AVX2" and "AMX" name
the code the engines ran (an AVX2 row may be AVX2 builds on an AVX-512 machine: the host line says).

To regenerate after a new run (the run's JSON goes to `tools/bench/results/`):

```sh
python tools/bench/report.py            # rewrites docs/performance.md
python tools/bench/report.py --check    # exit 1 if this page is out of date
```

How each benchmark is built and run: `tools/bench/README.md`.
"""


def render(results_dir: Path = RESULTS) -> str:
    results = load(results_dir)
    lines = [INTRO]
    for section in (
        section_peers,
        section_roofline,
        section_long_context,
        section_memcap,
        section_serving,
        section_prefix_store,
        section_speculation,
        section_soak,
        section_quality,
        section_constraint,
        section_other,
    ):
        lines += section(results)
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip("\n") + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="the results directory (*.json)")
    ap.add_argument("--out", type=Path, default=OUT, help="the page to write or check")
    ap.add_argument("--check", action="store_true", help="exit 1 if --out differs from what would be written")
    a = ap.parse_args(argv)
    text = render(a.results)
    if a.check:
        current = a.out.read_text(encoding="utf-8") if a.out.is_file() else ""
        if current != text:
            diff = sum(
                1
                for ln in difflib.unified_diff(current.splitlines(), text.splitlines(), n=0)
                if ln[:1] in "+-" and not ln.startswith(("+++", "---"))
            )
            print(f"{a.out} is out of date ({diff} lines differ): run python tools/bench/report.py")
            return 1
        return 0
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
