"""Shared helpers for the benchmarks: median, JSON output next to a Markdown table."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
# The local Slurm cluster is test infrastructure (tests/support), not part of the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def environment() -> dict[str, Any]:
    """What the figures depend on, recorded beside them."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except OSError:
        commit = ""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    return {
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cpu": cpu,
        "cpus": os.cpu_count(),
    }


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table; floats printed with 3 significant decimals."""

    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(name: str, payload: dict[str, Any], out: str | None) -> Path:
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "environment": environment(), **payload}
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path
