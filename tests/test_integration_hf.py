"""GuardedTrainer on the real HF Trainer: 3 gloo ranks posing as 3 nodes, a tiny GPT-2.

Skipped when transformers/accelerate are not installed, unless SLURM_GUARD_REQUIRE_INTEGRATIONS=1
(CI), where their absence fails. Each test spawns real processes (tests/hf_workers.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
from framework_results import alarms, status_json

from slurm_guard.local import run_local
from slurm_guard.report import write_report

HAVE = all(importlib.util.find_spec(m) is not None for m in ("transformers", "accelerate"))
if not HAVE and os.environ.get("SLURM_GUARD_REQUIRE_INTEGRATIONS") == "1":
    raise RuntimeError("SLURM_GUARD_REQUIRE_INTEGRATIONS=1 but transformers/accelerate are missing")
pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(not HAVE, reason="needs the [hf] extra (transformers, accelerate)"),
]

NODES = ["node1", "node2", "node3"]


def _run(fn: Any, root: Path) -> list[Any]:
    outs = run_local(fn, 3, (str(root),), nodes=NODES, timeout=900)
    return outs


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import hf_workers

    root = tmp_path_factory.mktemp("hf")
    outs = _run(hf_workers.clean_and_nan, root)
    assert all(o.status == "ok" for o in outs), [o.value for o in outs]
    return {"root": root, "ranks": [o.value for o in outs]}


def test_clean_run_with_accumulation_raises_no_alarm_and_matches_the_plain_trainer(
    clean: dict[str, Any],
) -> None:
    ranks = clean["ranks"]
    shas = {r["clean"]["sha"] for r in ranks}
    assert len(shas) == 1 and ranks[0]["clean"]["global_step"] == 8
    # the Trainer logs the true pre-clip norm (the guard clipped), not 0: the plain Trainer's
    # up to the last bits (the guard's comm hook divides and sums in its own order)
    norms, plain = ranks[0]["clean"]["grad_norms"], ranks[0]["plain"]["grad_norms"]
    assert len(norms) == len(plain) == 8 and max(norms) > 1.0  # clipping had work to do
    assert norms == pytest.approx(plain, rel=1e-3)
    alarms = list((clean["root"] / "clean-run" / "alarms").glob("*.json"))
    assert alarms == []
    ledger = (clean["root"] / "clean-run" / "ledger.jsonl").read_text().splitlines()
    replays = [json.loads(x) for x in ledger if '"replay"' in x]
    assert [e["step"] for e in replays if e["passed"]] == [0, 3, 6]
    # the data check: rank 0's batch fingerprints of the replayed steps, read at train()'s end
    batches = (clean["root"] / "clean-run" / "batches.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in batches] == [0, 3, 6]


def test_a_nan_sample_stops_as_numerical(clean: dict[str, Any]) -> None:
    alarms = [r["nan"] for r in clean["ranks"]]
    assert all(a is not None for a in alarms), alarms
    alarm = alarms[0]
    assert alarm["verdict"] == "numerical" and alarm["step"] <= 3
    assert alarm["suspect_nodes"] == []  # the data's fault: no node is drained
    assert alarm["evidence"]["nonfinite_ranks"] == [2]  # the rank that was served the NaN row


def test_persistent_fault_caught_on_its_node_and_resume_skips_later_checkpoints(
    clean: dict[str, Any], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    import hf_workers

    root = tmp_path
    outs = _run(hf_workers.faulty, root)
    assert all(o.status == "alarm" for o in outs), [o.value for o in outs]
    alarm = outs[0].value
    assert alarm["verdict"] == "sdc" and alarm["suspect_nodes"] == ["node3"]
    written = hf_workers.checkpoints(str(root / "fault-out"))
    assert "checkpoint-5" in written  # saved after the onset, before the replay caught it
    capfd.readouterr()
    outs = _run(hf_workers.resumed, root)
    assert all(o.status == "ok" for o in outs), [o.value for o in outs]
    value = outs[0].value
    assert value["resumed_from"] == 3  # the newest checkpoint the replays vouch for
    # rank 0 says it once: the Trainer's checkpoint loaded, where the newer ones went
    aside = root / "fault-out" / "slurm-guard-quarantine" / alarm["alarm_id"]
    err = capfd.readouterr().err
    (line,) = [x for x in err.splitlines() if "slurm-guard: resumed" in x]
    loaded = root / "fault-out" / "checkpoint-3"
    assert line.startswith(f"slurm-guard: resumed at step 3 from checkpoint {loaded}; "), line
    assert f"moved aside to {aside}/: " in line and "checkpoint-6" in line, line
    # the run ended cleanly: rank 0 says once that the ride-along factor=1 fault did nothing
    spec = "kind=grad-scale,node=node2,step=5,factor=1"
    warning = f"slurm-guard: injected fault {spec} changed no value on node2 (step 5): factor=1"
    assert err.count(warning) == 1, err
    left = [p for p in hf_workers.checkpoints(str(root / "fault-out")) if "quarantine" not in p]
    assert all(int(p.split("-")[1]) <= 8 for p in left)
    quarantined = (root / "fault-out" / "slurm-guard-quarantine" / alarm["alarm_id"]).iterdir()
    assert {p.name for p in quarantined} == {"checkpoint-4", "checkpoint-5", "checkpoint-6"}
    # bit-identical to the uninterrupted clean run
    assert value["sha"] == clean["ranks"][0]["clean"]["sha"]


def test_rotation_keeps_the_trusted_checkpoint_and_status_names_what_the_rerun_loads(
    clean: dict[str, Any], tmp_path: Path
) -> None:
    """save_total_limit=2 with a checkpoint every step would have deleted checkpoint-2, the
    only one the trust rule allows after the alarm at step 6: the rerun started from step 0."""
    import hf_workers

    outs = _run(hf_workers.rotated_faulty, tmp_path)
    assert all(o.status == "alarm" for o in outs), [o.value for o in outs]
    (alarm,) = alarms(str(tmp_path / "rot-run"))
    assert (alarm["step"], alarm["last_verified_step"], alarm["suspect_nodes"]) == (
        6,
        4,
        ["node2"],
    )
    trusted = str(tmp_path / "rot-out" / "checkpoint-2")
    assert alarm["trusted_checkpoint"] == trusted
    # held back: 2 (trusted now) and 4 (trusted after the next pass); 5 and 6 by the limit
    assert hf_workers.checkpoints(str(tmp_path / "rot-out")) == [
        f"checkpoint-{n}" for n in (2, 4, 5, 6)
    ]
    view = status_json(tmp_path / "rot-run", tmp_path / "state")
    assert (view["trusted_checkpoint"], view["trusted_checkpoint_path"]) == (2, trusted)
    write_report(tmp_path / "rot-run", tmp_path / "report.html")
    assert f"trusted (rollback target) ({trusted})" in (tmp_path / "report.html").read_text()
    outs = _run(hf_workers.rotated_resumed, tmp_path)
    assert all(o.status == "ok" for o in outs), [o.value for o in outs]
    assert {(o.value["resumed_from"], o.value["resumed_path"]) for o in outs} == {(2, trusted)}
    record = tmp_path / "rot-run" / "handled" / f"{alarm['alarm_id']}.json"
    handled = json.loads(record.read_text())
    moved = tmp_path / "rot-out" / "slurm-guard-quarantine" / alarm["alarm_id"]
    assert sorted(handled["quarantined"]) == [str(moved / f"checkpoint-{n}") for n in (4, 5, 6)]
    assert outs[0].value["sha"] == clean["ranks"][0]["clean"]["sha"]


def test_checkpoints_a_resume_may_not_load_stop_every_rank_naming_the_override(
    tmp_path: Path,
) -> None:
    """Another run's seals (same output_dir, new guard_run_dir) and damaged checkpoints were
    moved aside with a warning, and the Trainer started again from step 0."""
    import hf_workers

    outs = _run(hf_workers.refused_resumes, tmp_path)
    assert all(o.status == "ok" for o in outs), [o.value for o in outs]
    for out in (o.value for o in outs):
        assert "sealed by run" in out["foreign"] and "SLURM_GUARD_RESUME=fresh" in out["foreign"]
        assert "checkpoint-3" in out["foreign"]
        assert "unusable" in out["damaged"] and "changed since it was sealed" in out["damaged"]
        assert "SLURM_GUARD_RESUME=fresh" in out["damaged"]
        assert out["left"] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]  # none moved
