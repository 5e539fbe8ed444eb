"""The README's demo: `slurm-guard drill --local` passes and ends bit-identical to the clean run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_guard.cli import main
from slurm_guard.examples.train import read_result

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_local_drill_passes_every_stage(tmp_path: Path) -> None:
    """Run as a user runs it, with the ranks' own lines (stderr) in the same stream: each
    stage's lines come before the next run's, and the last line says what to look at."""
    args = ["-m", "slurm_guard.cli", "drill", "--local", "--work-dir", str(tmp_path), "--json"]
    done = subprocess.run(
        [sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output = done.stdout
    assert done.returncode == 0, output
    assert "drill PASSED" in output
    report = json.loads(output[output.index("{\n") :])
    names = [s["name"] for s in report["stages"]]
    assert all(s["passed"] for s in report["stages"]), report
    assert any("bit-identical" in n for n in names)
    assert any("controller decision" in n for n in names)
    assert "would drain node2: slurm-guard: job 1001 step 20 check replay" in output
    assert "would let job 1001 start 2 s from now (StartTime=now+2)" in output
    lines = output[: output.index("{\n")].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("[PASS] 1. clean run"))
    alarm = next(i for i, line in enumerate(lines) if line.startswith("alarm job1001-"))
    second = next(i for i, line in enumerate(lines) if line.startswith("[PASS] 2. guard stops"))
    assert first < alarm < second, "\n".join(lines)
    assert any(line.startswith("  ... clean run: ") for line in lines[:first])  # progress
    assert lines[-1] == (
        f"next: slurm-guard status {tmp_path}/faulty   "
        f"slurm-guard report {tmp_path}/faulty -o {tmp_path}/faulty/report.html"
    )

    clean, faulty = read_result(tmp_path / "clean"), read_result(tmp_path / "faulty")
    assert clean is not None and faulty is not None
    assert faulty["weight_sha256"] == clean["weight_sha256"]
    assert (faulty["resumed_from"], faulty["final_step"]) == (10, 30)
    assert "node2" not in faulty["nodes"]


def test_sharded_local_drill_drains_the_faulty_node_and_resumes_from_dcp(tmp_path: Path) -> None:
    """HSDP 2x2 under ShardedGuard: the fault on rank 3's node (node4) is named by the replay,
    the dry-run controller drains node4 alone, and the run resumed from the sealed DCP
    checkpoint of step 10 on the other nodes ends bit-identical to the clean run."""
    args = ["drill", "--local", "--sharded", "--work-dir", str(tmp_path), "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "HSDP 2x2, ShardedGuard" in result.output
    report = json.loads(result.output[result.output.index("{\n") :])
    assert len(report["stages"]) == 5 and all(s["passed"] for s in report["stages"]), report
    assert "would drain node4: slurm-guard: job 1001 step 20 check replay" in result.output
    assert "would drain node2" not in result.output

    clean, faulty = read_result(tmp_path / "clean"), read_result(tmp_path / "faulty")
    assert clean is not None and faulty is not None
    assert faulty["weight_sha256"] == clean["weight_sha256"]
    assert (faulty["resumed_from"], faulty["final_step"]) == (10, 30)
    assert faulty["nodes"] == ["node1", "node2", "node3", "node5"]
    meta = json.loads((tmp_path / "faulty/checkpoints/step-00000010/meta.json").read_text())
    assert len(meta["shard_fingerprints"]) == 4 and "__3_0.distcp" in meta["files"]
    # the step-20 checkpoint carried the faulty updates of steps 17-19: moved aside
    (alarm,) = (tmp_path / "faulty" / "quarantine").iterdir()
    assert (alarm / "step-00000020" / "meta.json").exists()


def test_sharded_drill_refuses_an_odd_number_of_ranks() -> None:
    result = CliRunner().invoke(main, ["drill", "--local", "--sharded", "--nodes", "5"])
    assert result.exit_code == 1 and "even --nodes >= 4" in result.output


def test_drill_refuses_too_few_nodes() -> None:
    result = CliRunner().invoke(main, ["drill", "--local", "--nodes", "2"])
    assert result.exit_code == 2 and "--nodes" in result.output


def test_a_failure_in_the_faulty_run_is_reported_against_that_stage() -> None:
    """A rank that crashed in the second scenario fails the faulty-run stage, not the clean one
    (the first-run report blamed the clean run for a numpy error in the faulty one)."""
    from slurm_guard.drill.local import _scenario
    from slurm_guard.drill.stages import StageFailed

    clean = {"result": {"final_step": 30}, "alarm": None, "seconds": 1.0}
    per_rank = [[clean, {"error": "RuntimeError: boom", "seconds": 0.0}], [clean]]
    assert _scenario(per_rank, 0, "the clean run") == [clean, clean]
    with pytest.raises(StageFailed, match="the faulty run: rank 0 failed: RuntimeError: boom"):
        _scenario(per_rank, 1, "the faulty run")
    with pytest.raises(StageFailed, match="rank 1 did not get to it"):
        _scenario([[clean, clean], [clean]], 1, "the faulty run")
