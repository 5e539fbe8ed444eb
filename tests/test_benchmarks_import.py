"""Every benchmark script still imports and parses its arguments after a refactor.

Benchmarks are not run by the test suite (they are slow and their figures meaningless on a
loaded machine), so a renamed function or moved module breaks them silently until someone
needs a figure. `--help` imports the script and everything it imports at the top, and exits
before measuring anything: a cheap smoke test. It does not catch names imported lazily inside
the worker functions (those fail only when the benchmark runs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for p in (REPO / "benchmarks").glob("*.py") if not p.name.startswith("_"))


def test_benchmarks_found() -> None:
    assert SCRIPTS, f"no benchmark scripts under {REPO / 'benchmarks'}"


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_help_exits_zero(script: Path) -> None:
    # A script without an argument parser would run its whole benchmark on --help: refuse to.
    source = script.read_text(encoding="utf-8")
    assert "ArgumentParser(" in source, (
        f"benchmarks/{script.name} has no --help (no argparse.ArgumentParser): give it one so "
        "that this smoke test can import it without running the benchmark"
    )
    env = dict(os.environ)
    # this tree's slurm_guard, whatever is installed
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(script.relative_to(REPO)), "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, (
        f"`python benchmarks/{script.name} --help` exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    )
    assert "usage:" in proc.stdout, (
        f"`python benchmarks/{script.name} --help` exited 0 without printing a usage line; "
        f"did it run the benchmark instead?\n{proc.stdout[-2000:]}"
    )


@pytest.mark.distributed
@pytest.mark.slow
def test_step_overhead_measures_a_users_model_from_its_factory(tmp_path: Path) -> None:
    """`--model package.module:factory` runs plain DDP, per-step checks and the default guard on
    the factory's model side by side (2 gloo ranks, 1 round); the figures are not checked,
    only that every variant ran and was reported."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), str(REPO / "tests"), env.get("PYTHONPATH")])
    )
    out = tmp_path / "overhead.json"
    args = ["--model", "bench_factory:factory", "--world", "2", "--rounds", "1", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, "benchmarks/step_overhead.py", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "your model (bench_factory:factory)" in proc.stdout
    report = json.loads(out.read_text())
    variants = {r["variant"] for r in report["results"] if r["model"] == "bench_factory:factory"}
    assert variants == {"plain DDP", "per-step checks", "default"}
    assert report["summary"]["bench_factory:factory"]["replay_fwd_bwd_s"] > 0
    bad = subprocess.run(
        [sys.executable, "benchmarks/step_overhead.py", "--model", "bench_factory:nope"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert bad.returncode != 0 and "bench_factory:nope" in bad.stderr
