"""What a results file records about its run (command, host, date, commit), and writing it: the
fields report.py reads (tools/bench/results/*.json), defined once for the tools that use them."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def write_results(out, args, **figures) -> None:
    """Print figures["summary"]; with `out`, write a results file: command, host, date, commit,
    the tool's settings (its argparse namespace less `out`) and `figures`."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    doc = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "host": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs {cpu_model()}",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git_commit": commit,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        **figures,
    }
    print(json.dumps(figures.get("summary"), indent=2))
    if out:
        Path(out).write_text(json.dumps(doc, indent=1) + "\n")
