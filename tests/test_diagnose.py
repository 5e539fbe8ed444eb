"""`slurm-guard diagnose`: the known-answer burn-in, its golden results and its evidence records.

Runs the real burn-in on the CPU (small matrices, no extra time): the same code path a GPU node
takes, minus the device. Faults are injected through SLURM_GUARD_INJECT exactly as an admin
would for a drill.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

from slurm_guard.cli import main
from slurm_guard.cli.evidence import EXIT_DIAGNOSIS_FAILED
from slurm_guard.diagnose.burn_in import DiagnoseConfig, faults_for_diagnose, run_diagnosis
from slurm_guard.diagnose.evidence import (
    GOLDEN_MATCH,
    GOLDEN_MISMATCH,
    GOLDEN_RECORDED,
    latest_diagnosis,
    parse_diagnosis,
    read_diagnoses,
)
from slurm_guard.diagnose.history import (
    confirmed_since,
    diagnosis_summary,
    node_history,
    return_blockers,
)
from slurm_guard.errors import GuardError
from slurm_guard.faults.injection import parse_faults
from slurm_guard.rundir.records import RecordError

SMALL = ["--size", "48", "--seeds", "1", "--duration", "0", "--threads", "1"]
PERSISTENT = "kind=diagnose-gemm,node=node2,step=0,persistent=1"


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def diagnose(state: Path, node: str, *args: str, inject: str = "") -> Result:
    env = {"SLURM_GUARD_INJECT": inject}
    return CliRunner().invoke(
        main,
        ["diagnose", *SMALL, "--node", node, "--state-dir", str(state), "--json", *args],
        env=env,
    )


def as_json(result: Result) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(result.output)
    return out


def test_a_healthy_node_passes_and_its_result_becomes_the_golden_one(tmp_path: Path) -> None:
    first = diagnose(tmp_path, "node1")
    assert first.exit_code == 0, first.output
    d = as_json(first)
    assert d["passed"] and d["golden"] == GOLDEN_RECORDED
    assert {c["precision"] for c in d["cases"]} == {"fp32", "bf16", "fp16"}
    assert all(c["repeats"] >= 2 and c["mismatches"] == 0 for c in d["cases"])
    assert all(0 < c["checksum_excess"] <= 1 for c in d["cases"])
    again = diagnose(tmp_path, "node3")
    assert again.exit_code == 0, again.output
    assert as_json(again)["golden"] == GOLDEN_MATCH
    # one record per run, kept as the node's evidence
    assert [x.passed for x in read_diagnoses(tmp_path, "node1")] == [True]
    assert Path(as_json(again)["recorded"]).parent == tmp_path / "diagnoses" / "node3"


def test_a_persistent_gemm_fault_fails_against_the_golden_result(tmp_path: Path) -> None:
    assert diagnose(tmp_path, "node1").exit_code == 0
    bad = diagnose(tmp_path, "node2", inject=PERSISTENT)
    assert bad.exit_code == EXIT_DIAGNOSIS_FAILED, bad.output
    d = as_json(bad)
    assert not d["passed"] and d["golden"] == GOLDEN_MISMATCH
    # wrong every time in the same way: repeats agree, only the golden result tells
    assert all(c["mismatches"] == 0 for c in d["cases"])
    assert all(c["golden"] == GOLDEN_MISMATCH for c in d["cases"])
    assert any("recorded by node1" in f for f in d["failures"])
    assert d["faults"] == ["diagnose-gemm on node node2, persistent from step 0"]
    latest = latest_diagnosis(tmp_path, "node2")
    assert latest is not None and not latest.passed
    # node1 is untouched by node2's run
    assert diagnose(tmp_path, "node1").exit_code == 0


def test_a_faulty_first_node_never_becomes_the_golden_reference(tmp_path: Path) -> None:
    bad = diagnose(tmp_path, "node2", inject=PERSISTENT)
    assert bad.exit_code == EXIT_DIAGNOSIS_FAILED
    d = as_json(bad)
    # the column checksum catches a gross error without any golden result
    fp32 = next(c for c in d["cases"] if c["precision"] == "fp32")
    assert not fp32["checksum_ok"] and fp32["checksum_excess"] > 1
    assert not (tmp_path / "golden").exists()
    good = diagnose(tmp_path, "node1")
    assert good.exit_code == 0 and as_json(good)["golden"] == GOLDEN_RECORDED


def test_an_intermittent_fault_breaks_repeatability(tmp_path: Path) -> None:
    # the 5th GEMM overall: a repeat of the second case, not its first result
    one_off = "kind=diagnose-gemm,node=node2,step=4,element=3"
    bad = diagnose(tmp_path, "node2", inject=one_off)
    assert bad.exit_code == EXIT_DIAGNOSIS_FAILED, bad.output
    d = as_json(bad)
    hit = [c for c in d["cases"] if c["mismatches"]]
    assert len(hit) == 1 and hit[0]["mismatches"] == 1
    assert hit[0]["first_mismatch"]["first_index"] == 3
    assert hit[0]["first_mismatch"]["elements_differing"] == 1
    assert not (tmp_path / "golden").exists()


def test_a_fault_on_another_node_or_device_is_ignored(tmp_path: Path) -> None:
    assert diagnose(tmp_path, "node1", inject=PERSISTENT).exit_code == 0
    on_gpu3 = "kind=diagnose-gemm,rank=3,step=0,persistent=1"
    assert diagnose(tmp_path, "node1", inject=on_gpu3).exit_code == 0
    on_device0 = "kind=diagnose-gemm,rank=0,step=0,persistent=1"
    assert diagnose(tmp_path, "node1", inject=on_device0).exit_code == EXIT_DIAGNOSIS_FAILED


def test_a_node_without_the_state_dir_runs_there_and_is_imported_here(tmp_path: Path) -> None:
    missing = tmp_path / "not-here"
    refused = diagnose(missing, "node2")
    assert refused.exit_code == 1
    assert "--no-record --json" in refused.output and "--import" in refused.output
    remote = diagnose(missing, "node2", "--no-record")
    assert remote.exit_code == 0 and as_json(remote)["recorded"] is None
    assert not missing.exists()
    record = tmp_path / "node2.json"
    record.write_text(remote.output)
    state = tmp_path / "state"
    state.mkdir()
    imported = CliRunner().invoke(
        main, ["diagnose", "--import", str(record), "--state-dir", str(state), "--json"]
    )
    assert imported.exit_code == 0, imported.output
    assert as_json(imported)["golden"] == GOLDEN_RECORDED
    assert latest_diagnosis(state, "node2") is not None
    wrong_node = CliRunner().invoke(
        main, ["diagnose", "--import", str(record), "--node", "node7", "--state-dir", str(state)]
    )
    assert wrong_node.exit_code == 1 and "not node7" in wrong_node.output


def test_a_failed_import_is_recorded_as_failed(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    remote = diagnose(tmp_path, "node2", "--no-record", inject=PERSISTENT)
    assert remote.exit_code == EXIT_DIAGNOSIS_FAILED
    record = tmp_path / "node2.json"
    record.write_text(remote.output)
    imported = CliRunner().invoke(
        main, ["diagnose", "--import", str(record), "--state-dir", str(state)]
    )
    assert imported.exit_code == EXIT_DIAGNOSIS_FAILED
    assert "FAILED" in imported.output and "column sums" in imported.output
    latest = latest_diagnosis(state, "node2")
    assert latest is not None and not latest.passed


def test_human_output_names_the_node_and_the_problem(tmp_path: Path) -> None:
    assert diagnose(tmp_path, "node1").exit_code == 0
    out = CliRunner().invoke(
        main,
        ["diagnose", *SMALL, "--node", "node2", "--state-dir", str(tmp_path)],
        env={"SLURM_GUARD_INJECT": PERSISTENT},
    )
    assert out.exit_code == EXIT_DIAGNOSIS_FAILED
    assert out.output.startswith("node2: FAILED")
    assert "result differs from the golden result recorded by node1" in out.output
    assert "recorded as evidence for node2" in out.output


def test_records_are_validated(tmp_path: Path) -> None:
    d = run_diagnosis(DiagnoseConfig(node="n1", size=8, seeds=1, duration_s=0, threads=1))
    obj = d.to_json()
    assert parse_diagnosis(json.loads(json.dumps(obj))) == d
    with pytest.raises(RecordError, match="newer"):
        parse_diagnosis({**obj, "schema": 99})
    with pytest.raises(RecordError, match="cannot name a file"):
        parse_diagnosis({**obj, "node": "../etc"})
    with pytest.raises(RecordError, match="checksum_ok"):
        parse_diagnosis({**obj, "cases": [{**obj["cases"][0], "checksum_ok": "yes"}]})


def test_options_are_checked() -> None:
    with pytest.raises(GuardError, match="precision"):
        DiagnoseConfig(node="n", precisions=("fp8",))
    with pytest.raises(GuardError, match="no tf32"):
        run_diagnosis(DiagnoseConfig(node="n", precisions=("tf32",), device="cpu", size=8))
    assert faults_for_diagnose({"SLURM_GUARD_INJECT": "kind=nan,rank=1,step=2"}) == ()
    assert faults_for_diagnose({"SLURM_GUARD_INJECT": PERSISTENT}) == parse_faults(PERSISTENT)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_burn_in_is_repeatable_and_within_the_checksum_bound(tmp_path: Path) -> None:
    d = run_diagnosis(DiagnoseConfig(node="gpu", size=1024, seeds=1, duration_s=2))
    assert d.passed, d.failures()
    assert {"fp32", "fp16"} <= {c.precision for c in d.cases}
    assert d.device["kind"] == "cuda" and d.device["driver"] != "unknown"


def _entry(alarm_id: str, node: str, t: float, **kw: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "type": "alarm",
        "alarm_id": alarm_id,
        "job_id": "1",
        "suspect_nodes": [node],
        "verdict": "sdc",
        "check": "replay",
        "outcome": "act",
        "step": 5,
        "time": t,
        "evidence": {},
    }
    values.update(kw)
    return values


def test_node_history_counts_confirmed_alarms_across_jobs() -> None:
    entries = [
        _entry("a3", "node2", 300.0, job_id="9", evidence={"triage": {"reproduced": [3, 3]}}),
        _entry("a1", "node2", 100.0),
        _entry("a2", "node2", 200.0, outcome="await_approval"),
        _entry("a4", "node2", 250.0, outcome="hold", verdict="ambiguous"),
        _entry("a5", "node3", 260.0),
        _entry("a6", "node2", 270.0, verdict="numerical", outcome="no_action"),
    ]
    history = node_history(entries, {"a2": {}}, "node2")
    assert [a["alarm_id"] for a in history] == ["a1", "a2", "a4", "a6", "a3"]
    assert [a["confirmed"] for a in history] == [True, True, False, False, True]
    assert history[-1]["triage"] == {"reproduced": [3, 3]}
    assert confirmed_since(history, 150.0) == 2


def test_return_blockers_name_a_failed_diagnosis_and_the_retire_rule(tmp_path: Path) -> None:
    entries = [_entry("a1", "node2", 100.0), _entry("a2", "node2", 200.0)]
    history = node_history(entries, {}, "node2")
    later = 200.0 + 86400 * 2
    old = return_blockers(tmp_path, "node2", history, retire_after=2, retire_days=1, now=later)
    assert old == []
    rule = return_blockers(tmp_path, "node2", history, retire_after=2, retire_days=1, now=250.0)
    assert rule == ["2 confirmed alarm(s) in the last 1 day(s); the policy retires a node after 2"]
    assert return_blockers(tmp_path, "node2", history, retire_after=None, retire_days=1) == []
    assert diagnose(tmp_path, "node2", inject=PERSISTENT).exit_code == EXIT_DIAGNOSIS_FAILED
    failed = return_blockers(tmp_path, "node2", [], retire_after=None, retire_days=1)
    assert len(failed) == 1 and "latest `slurm-guard diagnose`" in failed[0]
    assert "column sums" in failed[0]
    summary = diagnosis_summary(latest_diagnosis(tmp_path, "node2"))
    assert summary is not None and summary["passed"] is False
    assert diagnose(tmp_path, "node2").exit_code == 0  # the latest one counts
    assert return_blockers(tmp_path, "node2", [], retire_after=None, retire_days=1) == []


REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slurm
def test_on_the_cluster_a_faulty_node_fails_and_return_needs_force(
    idle_slurm_cluster: Any, tmp_path: Path
) -> None:
    """srun the burn-in on two nodes of the real cluster, a GEMM fault injected on node2; the
    controller then refuses to return node2 without --force, and journals the forced return."""
    from slurm_guard.controller.state import StateStore
    from slurm_guard.slurm.client import CommandSlurmClient

    cluster = idle_slurm_cluster
    state = tmp_path / "state"
    state.mkdir()
    env = {**os.environ, **cluster.env(), "SLURM_GUARD_INJECT": PERSISTENT}

    def srun(node: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "slurm_guard.cli", "diagnose", *SMALL]
        return subprocess.run(
            ["srun", "-N1", "-w", node, *command, "--state-dir", str(state), "--json"],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )

    good = srun("node1")
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["node"] == "node1"  # SLURMD_NODENAME names the node
    bad = srun("node2")
    assert bad.returncode == EXIT_DIAGNOSIS_FAILED, bad.stderr
    assert json.loads(bad.stdout)["golden"] == GOLDEN_MISMATCH

    client = CommandSlurmClient(env=cluster.env())
    client.drain("node2", "slurm-guard: job 1 step 20 check replay alarm a1")

    def review(*args: str) -> Result:
        return CliRunner().invoke(
            main, ["review", "--state-dir", str(state), *args], obj={"slurm_client": client}
        )

    listed = review("--json")
    assert listed.exit_code == 0, listed.output
    node2 = next(n for n in json.loads(listed.output)["nodes"] if n["node"] == "node2")
    assert node2["diagnosis"]["passed"] is False and node2["return_blockers"]
    refused = review("return", "node2", "--reason", "looks fine to me")
    assert refused.exit_code == 1 and "slurm-guard diagnose" in refused.output
    assert "--force" in refused.output
    assert client.node("node2").drained
    forced = review("return", "node2", "--reason", "GPU swapped, rerun pending", "--force")
    assert forced.exit_code == 0, forced.output
    assert not client.node("node2").drained
    returns = [e for e in StateStore(state).read().entries if e.get("op") == "return"]
    assert returns and returns[-1]["forced"] is True and returns[-1]["overrode"]


def test_review_shows_the_evidence_and_return_needs_force(tmp_path: Path) -> None:
    """Against the unit tests' in-memory Slurm: the review listing, the refusal, the override."""
    from test_controller_unit import ALLOC, FakeSlurm, make_alarm, write_alarm

    from slurm_guard.controller.engine import Engine
    from slurm_guard.controller.policy import Policy
    from slurm_guard.controller.state import StateStore

    slurm = FakeSlurm()
    store = StateStore(tmp_path / "state")
    store.ensure()
    Policy(retire_after=2, retire_days=30).save(store.root)
    for job in ("100", "101"):
        slurm.add_job(job, ALLOC, user_id=os.getuid())
        run = tmp_path / f"run{job}"
        write_alarm(run, make_alarm(job, f"a{job}", evidence={"triage": {"reproduced": "3 of 3"}}))
        Engine(slurm, store).process_job(job, run)
    assert slurm.count("drain") == 1  # the second alarm finds node2 drained already
    assert diagnose(store.root, "node2", inject=PERSISTENT).exit_code == EXIT_DIAGNOSIS_FAILED

    def cli(*args: str) -> Result:
        return CliRunner().invoke(
            main, ["review", "--state-dir", str(store.root), *args], obj={"slurm_client": slurm}
        )

    listing = cli()
    assert listing.exit_code == 0, listing.output
    assert "node2: 2 alarm(s) since" in listing.output and "2 confirmed" in listing.output
    assert 'triage: {"reproduced": "3 of 3"}' in listing.output
    assert "node2: latest diagnosis" in listing.output and "FAILED" in listing.output
    assert "the policy retires a node after 2" in listing.output
    refused = cli("return", "node2", "--reason", "reseated")
    assert refused.exit_code == 1 and "--force" in refused.output
    assert "latest `slurm-guard diagnose`" in refused.output
    assert slurm.count("resume") == 0
    forced = cli("return", "node2", "--reason", "reseated, RMA refused", "--force")
    assert forced.exit_code == 0, forced.output
    assert slurm.count("resume") == 1
    entry = [e for e in store.read().entries if e.get("op") == "return"][-1]
    assert entry["forced"] is True and len(entry["overrode"]) == 2
    assert entry["admin"] and entry["reason"] == "reseated, RMA refused"
