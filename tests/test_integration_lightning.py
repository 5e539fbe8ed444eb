"""GuardCallback on the real Lightning Trainer: 3 gloo ranks posing as 3 nodes, a small MLP.

Skipped when lightning is not installed, unless SLURM_GUARD_REQUIRE_INTEGRATIONS=1 (CI), where
its absence fails. Each test spawns real processes (tests/lightning_workers.py).
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

HAVE = importlib.util.find_spec("lightning") is not None
if not HAVE and os.environ.get("SLURM_GUARD_REQUIRE_INTEGRATIONS") == "1":
    raise RuntimeError("SLURM_GUARD_REQUIRE_INTEGRATIONS=1 but lightning is missing")
pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(not HAVE, reason="needs the [lightning] extra"),
]

NODES = ["node1", "node2", "node3"]


def _run(fn: Any, root: Path) -> list[Any]:
    return run_local(fn, 3, (str(root),), nodes=NODES, timeout=900)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import lightning_workers

    root = tmp_path_factory.mktemp("lightning")
    outs = _run(lightning_workers.clean_and_nan, root)
    assert all(o.status == "ok" for o in outs), [o.value for o in outs]
    return {"root": root, "ranks": [o.value for o in outs]}


def test_clean_run_with_accumulation_and_clipping_raises_no_alarm(clean: dict[str, Any]) -> None:

    ranks = clean["ranks"]
    assert len({r["clean"]["sha"] for r in ranks}) == 1
    assert ranks[0]["clean"]["global_step"] == 9
    assert alarms(str(clean["root"] / "clean-run")) == []
    # the norm before Lightning's clip is the run's without the guard, up to the last bits
    # (the guard's comm hook sums in its own order); clipping had work to do
    norms, plain = ranks[0]["clean"]["grad_norms"], ranks[0]["plain"]["grad_norms"]
    assert len(norms) == len(plain) == 9 and max(norms) > 1.0
    assert norms == pytest.approx(plain, rel=1e-5)
    assert ranks[0]["clean"]["lr"] == ranks[0]["plain"]["lr"]  # the scheduler stepped 9 times
    sealed = list((clean["root"] / "clean-out" / "checkpoints").glob("*.slurm-guard.json"))
    assert len(sealed) >= 3  # step 3, 6, 9 and last.ckpt
    # the data check: rank 0's batch fingerprints of the replayed steps, read at saves and at
    # the end of fit
    batches = (clean["root"] / "clean-run" / "batches.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in batches] == [0, 3, 6]
    # a second ModelCheckpoint keeps only the newest .ckpt: the seals of the deleted ones go too
    top1 = clean["root"] / "clean-out" / "top1"
    assert {p.name for p in top1.iterdir()} == {
        "epoch=2-step=9.ckpt",
        "epoch=2-step=9.ckpt.slurm-guard.json",
    }


def test_a_nan_sample_stops_as_numerical(clean: dict[str, Any]) -> None:
    alarm = clean["ranks"][0]["nan"]
    # the NaN row is in rank 1's second microbatch of step 0: served, and caught there
    assert alarm is not None and alarm["verdict"] == "numerical" and alarm["step"] == 0
    assert alarm["evidence"]["nonfinite_ranks"] == [1] and alarm["suspect_nodes"] == []


def test_persistent_fault_caught_on_its_node_exits_86_and_resume_skips_later_checkpoints(
    clean: dict[str, Any], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    import lightning_workers

    outs = _run(lightning_workers.faulty, tmp_path)
    assert all(o.status == "ok" and o.value["exit_code"] == 86 for o in outs), [
        o.value for o in outs
    ]
    (alarm,) = alarms(str(tmp_path / "fault-run"))
    assert alarm["verdict"] == "sdc" and alarm["suspect_nodes"] == ["node3"]
    written = lightning_workers.checkpoints(str(tmp_path / "fault-out"))
    assert "checkpoints/epoch=1-step=6.ckpt" in written  # after the onset, before the catch
    capfd.readouterr()
    outs = _run(lightning_workers.resumed, tmp_path)
    assert all(o.status == "ok" for o in outs), [o.value for o in outs]
    value = outs[0].value
    assert value["resumed_from"] == 3 and value["global_step"] == 9
    quarantined = tmp_path / "fault-out" / "slurm-guard-quarantine" / alarm["alarm_id"]
    # rank 0 says it once: the .ckpt loaded, where the newer ones went
    err = capfd.readouterr().err
    (line,) = [x for x in err.splitlines() if "slurm-guard: resumed" in x]
    loaded = tmp_path / "fault-out" / "checkpoints" / "epoch=0-step=3.ckpt"
    assert line.startswith(f"slurm-guard: resumed at step 3 from checkpoint {loaded}; "), line
    assert f"moved aside to {quarantined}/: " in line and "last.ckpt" in line, line
    # the run ended cleanly: rank 0 says once that the ride-along factor=1 fault did nothing
    spec = "kind=grad-scale,node=node2,step=5,factor=1"
    warning = f"slurm-guard: injected fault {spec} changed no value on node2 (step 5): factor=1"
    assert err.count(warning) == 1, err
    assert {p.name for p in quarantined.glob("*.ckpt")} == {"epoch=1-step=6.ckpt", "last.ckpt"}
    # after the resume ModelCheckpoint saves again inside step 3 (after its first microbatch):
    # that .ckpt lacks the accumulated gradient, so it is left unsealed, never resumed from
    folder = tmp_path / "fault-out" / "checkpoints"
    sealed = {p.name.removesuffix(".slurm-guard.json") for p in folder.glob("*.slurm-guard.json")}
    assert (folder / "epoch=1-step=3.ckpt").is_file()
    assert sealed == {
        "epoch=0-step=3.ckpt",
        "epoch=1-step=6.ckpt",
        "epoch=2-step=9.ckpt",
        "last.ckpt",
    }
    # bit-identical to the uninterrupted clean run
    assert value["sha"] == clean["ranks"][0]["clean"]["sha"]


def test_defaults_keep_the_trusted_ckpt_and_the_rerun_finds_it_in_version_0(
    clean: dict[str, Any], tmp_path: Path
) -> None:
    """Lightning's defaults: top-k (1) deleted step 3's .ckpt at the next save, and the rerun
    (logger version_1) looked only in version_1: it started from step 0. Status showed no
    trusted checkpoint, the alarm `"trusted_checkpoint": null`."""
    import lightning_workers

    outs = _run(lightning_workers.defaults_faulty, tmp_path)
    assert all(o.status == "ok" and o.value["exit_code"] == 86 for o in outs), [
        o.value for o in outs
    ]
    (alarm,) = alarms(str(tmp_path / "def-run"))
    assert (alarm["step"], alarm["suspect_nodes"]) == (6, ["node3"])
    version_0 = tmp_path / "def-out" / "lightning_logs" / "version_0" / "checkpoints"
    trusted = str(version_0 / "epoch=0-step=3.ckpt")
    assert alarm["trusted_checkpoint"] == trusted
    # top-k keeps the newest; the trusted one is held back from it
    assert {p.name for p in version_0.glob("*.ckpt")} == {
        "epoch=0-step=3.ckpt",
        "epoch=1-step=6.ckpt",
    }
    view = status_json(tmp_path / "def-run", tmp_path / "state")
    assert (view["trusted_checkpoint"], view["trusted_checkpoint_path"]) == (3, trusted)
    outs = _run(lightning_workers.defaults_resumed, tmp_path)
    assert all(o.status == "ok" for o in outs), [o.value for o in outs]
    assert {(o.value["resumed_from"], o.value["resumed_path"]) for o in outs} == {(3, trusted)}
    assert outs[0].value["global_step"] == 9
    assert (tmp_path / "def-out" / "lightning_logs" / "version_1").is_dir()
    record = tmp_path / "def-run" / "handled" / f"{alarm['alarm_id']}.json"
    moved = tmp_path / "def-out" / "slurm-guard-quarantine" / alarm["alarm_id"]
    assert json.loads(record.read_text())["quarantined"] == [str(moved / "epoch=1-step=6.ckpt")]
    assert outs[0].value["sha"] == clean["ranks"][0]["clean"]["sha"]


def test_what_a_resume_may_not_load_stops_every_rank_in_lightnings_words(
    tmp_path: Path,
) -> None:
    """Two GuardCallbacks failed on torch's comm-hook RuntimeError; a ckpt_path the guard
    does not trust was refused in HF's words; another run's seals and damaged .ckpt files
    were moved aside and the run started from step 0."""
    import lightning_workers

    outs = _run(lightning_workers.refused, tmp_path)
    assert all(o.status == "ok" for o in outs), [o.value for o in outs]
    for out in (o.value for o in outs):
        assert "2 GuardCallbacks" in out["two_guards"]
        assert "ckpt_path=" in out["ckpt_path"] and "resume_from_checkpoint" not in out["ckpt_path"]
        assert "trainer.fit without ckpt_path" in out["ckpt_path"]
        assert "sealed by run" in out["foreign"] and "SLURM_GUARD_RESUME=fresh" in out["foreign"]
        assert "unusable" in out["damaged"] and "changed since it was sealed" in out["damaged"]
        assert "SLURM_GUARD_RESUME=fresh" in out["damaged"]
        assert out["left"] == [
            "checkpoints/epoch=0-step=3.ckpt",
            "checkpoints/epoch=1-step=6.ckpt",
            "checkpoints/last.ckpt",
        ]
