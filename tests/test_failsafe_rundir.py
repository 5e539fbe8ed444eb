"""Fail closed on the run directory, on real 3-rank gloo jobs (tiny GPT, checkpoints every 5).

Each failure of the fail-safe issue's "trust" and run-directory parts is set up as a careless or
hostile user would leave it, then a real guarded job starts on it. One launch runs many cases one
after another (spawning is the slow part); a module fixture runs the launches once and each test
checks its own cases. Permission cases run as uid 65534: root reads and writes anything.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rundir_workers import CONFIG, chown_tree, fault_config, make_template, run_cases

from slurm_guard.local.launch import RankOutcome, run_local
from slurm_guard.protocol import ALARM_SCHEMA
from slurm_guard.rundir.layout import RunDir

pytestmark = pytest.mark.distributed

NODES = ["node1", "node2", "node3"]
SETTLE = {"checkpoint_every": 5, "config": CONFIG}


def per_case(outcomes: list[RankOutcome]) -> list[list[dict[str, Any]]]:
    """results[case][rank], after checking that every rank finished its worker."""
    assert all(o.status == "ok" for o in outcomes), [(o.status, o.value) for o in outcomes]
    return [list(case) for case in zip(*(o.value for o in outcomes), strict=True)]


def same_error(ranks: list[dict[str, Any]], *words: str) -> str:
    """Every rank raised the same GuardError, containing all `words`."""
    errors = [r.get("error") for r in ranks]
    assert errors[0] is not None, f"no error: {ranks[0]}"
    assert len(set(errors)) == 1, errors
    for word in words:
        assert word in errors[0], (word, errors[0])
    return str(errors[0])


def started_at(ranks: list[dict[str, Any]]) -> int:
    assert all("error" not in r for r in ranks), ranks[0].get("error")
    starts = {r["start"] for r in ranks}
    assert len(starts) == 1, starts
    return int(starts.pop())


# --------------------------------------------------------------------------- alarms, repeated runs


def test_three_runs_outside_slurm_record_every_alarm_and_never_resume_after_the_onset(
    tmp_path: Path,
) -> None:
    """No SLURM_JOB_ID, a persistent fault on node2 from step 7, three starts on one run dir.

    Before: the second start's alarm had the first's id, was not written, and the third start
    resumed from step 10, a checkpoint saved after the onset.
    """
    case = {"run_dir": str(tmp_path), "steps": 12, "checkpoint_every": 5, "config": fault_config()}
    results = per_case(run_local(run_cases, 3, args=([case, case, case],), nodes=NODES))
    ids = []
    for run, ranks in enumerate(results):
        alarm = ranks[0]["alarm"]
        assert alarm is not None and alarm["step"] == 10, f"run {run + 1}: {ranks[0]}"
        assert all(r["alarm"] == alarm for r in ranks)
        ids.append(alarm["alarm_id"])
    assert len(set(ids)) == 3, ids
    on_disk = sorted(p.stem for p in (tmp_path / "alarms").glob("*.json"))
    assert on_disk == sorted(ids)
    # checkpoint step-10 was saved after step 9, past the onset: never a resume point
    assert [started_at(r) for r in results[1:]] == [0, 0]
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["attempt"] in ids[2]


# --------------------------------------------------------------------------- the launches


def _alarm_json(schema: int = 1) -> dict[str, Any]:
    return {
        "alarm_id": "x",
        "job_id": None,
        "restart_count": 0,
        "step": 12,
        "check": "replay",
        "verdict": "sdc",
        "suspect_ranks": [1],
        "suspect_nodes": ["node2"],
        "suspect_hosts": ["h"],
        "last_verified_step": 10,
        "trusted_checkpoint": "step-00000005",
        "update_applied": False,
        "evidence": {},
        "message": "m",
        "world_size": 3,
        "created": 1.0,
        "schema": schema,
    }


def _write_lock(run_dir: Path, host: str, pid: int, mtime: float) -> None:
    lock = run_dir / "guard.lock"
    lock.unlink(missing_ok=True)
    holder = {"job_id": "99", "restart_count": 0, "attempt": "feedfeedfeed", "host": host}
    lock.write_text(json.dumps({**holder, "pid": pid}))
    os.utime(lock, (mtime, mtime))


@pytest.fixture(scope="module")
def launched() -> Iterator[dict[str, Any]]:
    """Build a clean template run, damage copies of it, and start a guarded job on each."""
    base = Path(tempfile.mkdtemp(prefix="sg-failsafe-"))
    base.chmod(0o755)
    template = base / "template"
    template.mkdir()
    outcomes = run_local(make_template, 3, args=(str(template), 12), nodes=NODES)
    assert all(o.status == "ok" for o in outcomes), [o.value for o in outcomes]
    assert sorted(p.name for p in (template / "checkpoints").iterdir()) == [
        "step-00000005",
        "step-00000010",
    ]

    def copy(name: str) -> Path:
        target = base / name
        shutil.copytree(template, target, symlinks=True)
        return target

    cases: dict[str, dict[str, Any]] = {}

    def case(name: str, run_dir: Path | str, steps: int = 12, **kw: Any) -> None:
        cases[name] = {"run_dir": str(run_dir), "steps": steps, **SETTLE, **kw}

    d = copy("schema2")
    (d / "alarms" / "newer.json").write_text(
        json.dumps({**_alarm_json(ALARM_SCHEMA + 1), "alarm_id": "newer"})
    )
    case("schema2", d)

    d = copy("truncated")
    (d / "alarms" / "torn.json").write_text(json.dumps({**_alarm_json(), "alarm_id": "torn"}))
    (d / "alarms" / "torn.json").write_bytes((d / "alarms" / "torn.json").read_bytes()[:200])
    case("truncated", d)

    d = copy("fingerprint")
    meta = d / "checkpoints" / "step-00000010" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "weight_fingerprint": "0" * 16}))
    case("fingerprint", d, steps=10)

    for name in ("all-damaged", "all-damaged-fresh"):
        d = copy(name)
        for step in ("step-00000005", "step-00000010"):
            model = d / "checkpoints" / step / "model.pt"
            model.write_bytes(model.read_bytes()[:100])
        case(name, d, steps=0)
    cases["all-damaged-fresh"]["env"] = {"SLURM_GUARD_RESUME": "fresh"}

    d = copy("identity-lost")
    (d / "identity.json").unlink()
    case("identity-lost", d)

    # rank 0 killed after sealing the staging dir of step 10, before the rename (old name)
    d = copy("stale-staging")
    os.replace(d / "checkpoints" / "step-00000010", d / "checkpoints" / ".staging-00000010-r0")
    case("stale-staging-save", d)
    cases["stale-staging-resume"] = {**cases["stale-staging-save"], "steps": 10}

    sleeper = subprocess.Popen(["sleep", "600"])
    d = copy("live-lock")
    _write_lock(d, socket.gethostname(), sleeper.pid, time.time())
    case("live-lock", d, steps=10)
    d = copy("busy-lock-other-node")
    _write_lock(d, "othernode", 1, time.time() + 3600)  # heartbeat fresh at any launch speed
    case("busy-lock-other-node", d, steps=10)
    d = copy("stale-lock-other-node")
    _write_lock(d, "othernode", 1, time.time() - 1000)
    case("stale-lock-other-node", d, steps=10)

    for rank in range(3):
        (base / "node-local" / str(rank)).mkdir(parents=True)
    case("node-local", base / "node-local" / "{rank}")

    (base / "vanish").mkdir()
    case("vanish", base / "vanish", vanish_at=7)

    names = list(cases)
    try:
        root = per_case(run_local(run_cases, 3, args=([cases[n] for n in names],), nodes=NODES))
    finally:
        sleeper.kill()
        sleeper.wait()

    # As an unprivileged user (uid 65534).
    nobody: dict[str, dict[str, Any]] = {}

    def nobody_case(name: str, run_dir: Path, steps: int = 12, **kw: Any) -> None:
        nobody[name] = {"run_dir": str(run_dir), "steps": steps, **SETTLE, **kw}

    for name, mode in (("ckpt-0300", 0o300), ("ckpt-000", 0o000)):
        d = copy(name)
        chown_tree(d)
        (d / "checkpoints").chmod(mode)
        nobody_case(name, d)
    d = copy("unreadable-step-dir")
    chown_tree(d)
    (d / "checkpoints" / "step-00000010").chmod(0)
    nobody_case("unreadable-step-dir", d, steps=10)
    d = copy("unreadable-model")
    chown_tree(d)
    (d / "checkpoints" / "step-00000010" / "model.pt").chmod(0)
    nobody_case("unreadable-model", d, steps=10)
    d = base / "lost-alarm"
    (d / "alarms").mkdir(parents=True)
    os.chown(d, 65534, 65534)  # alarms/ stays root's 0755: the alarm cannot be written
    nobody_case("lost-alarm-run", d, config=fault_config())
    nobody_case("lost-alarm-restart", d, steps=10, config=CONFIG)
    (base / "warm-up").mkdir()
    cache = base / "cache"
    cache.mkdir(mode=0o777)
    cache.chmod(0o777)
    names_nobody = list(nobody)
    as_nobody = per_case(
        run_local(
            run_cases,
            3,
            args=([nobody[n] for n in names_nobody], str(base / "warm-up")),
            nodes=NODES,
            extra_env={"SLURM_GUARD_CACHE": str(cache)},
        )
    )
    results = dict(zip(names, root, strict=True)) | dict(zip(names_nobody, as_nobody, strict=True))
    yield {"base": base, "results": results}
    for d in base.rglob("*"):
        if d.is_dir() and not d.is_symlink():
            d.chmod(0o755)
    shutil.rmtree(base, ignore_errors=True)


# --------------------------------------------------------------------------- unreadable alarms


@pytest.mark.parametrize("name", ["schema2", "truncated"])
def test_an_unusable_alarm_stops_the_resume_on_every_rank(
    launched: dict[str, Any], name: str
) -> None:
    """Before: `ignoring unreadable alarm file` and a resume from step 10."""
    ranks = launched["results"][name]
    same_error(ranks, "alarm file", "SLURM_GUARD_RESUME=fresh")
    if name == "schema2":
        same_error(ranks, "newer")


# --------------------------------------------------------------------------- damaged checkpoints


def test_a_checkpoint_that_misses_its_fingerprint_falls_back_to_the_older_one(
    launched: dict[str, Any],
) -> None:
    """Before: GuardError on every rank instead of the fallback formats.md describes."""
    assert started_at(launched["results"]["fingerprint"]) == 5


def test_every_checkpoint_damaged_is_an_error_not_a_silent_restart(
    launched: dict[str, Any],
) -> None:
    """Before: warnings only, and training restarted from step 0."""
    same_error(launched["results"]["all-damaged"], "damaged", "SLURM_GUARD_RESUME=fresh")


def test_a_requested_fresh_start_loads_nothing_and_moves_old_checkpoints_aside(
    launched: dict[str, Any],
) -> None:
    assert started_at(launched["results"]["all-damaged-fresh"]) == 0
    run_dir = launched["base"] / "all-damaged-fresh"
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-")]
    moved = [p.name for p in (run_dir / "quarantine").glob("fresh-start-*/*")]
    assert sorted(moved) == ["step-00000005", "step-00000010"]


@pytest.mark.parametrize("name", ["unreadable-step-dir", "unreadable-model"])
def test_an_unreadable_checkpoint_is_skipped_for_the_older_one(
    launched: dict[str, Any], name: str
) -> None:
    """Before: a raw PermissionError traceback (as uid 65534)."""
    assert started_at(launched["results"][name]) == 5


@pytest.mark.parametrize("name", ["ckpt-0300", "ckpt-000"])
def test_an_unlistable_checkpoints_dir_stops_the_start(launched: dict[str, Any], name: str) -> None:
    """Before: resume() returned 0 with no warning and the run overwrote the checkpoints."""
    same_error(launched["results"][name], "cannot be listed", "checkpoints")


# --------------------------------------------------------------------------- identity, sharing


def test_a_run_dir_whose_identity_vanished_is_refused(launched: dict[str, Any]) -> None:
    same_error(launched["results"]["identity-lost"], "identity.json", "SLURM_GUARD_RESUME=fresh")


def test_a_node_local_run_dir_is_caught_at_start_on_every_rank(launched: dict[str, Any]) -> None:
    """Before: not noticed until resume() crashed with a bare StopIteration."""
    same_error(launched["results"]["node-local"], "every node", "rank 1 (node2)")


def test_a_run_dir_removed_mid_run_is_not_silently_recreated(launched: dict[str, Any]) -> None:
    """Before: the next save recreated checkpoints/ in whatever directory had the path."""
    same_error(launched["results"]["vanish"], "checkpoint at step 10 not saved")
    assert not (launched["base"] / "vanish" / "checkpoints").exists()


# --------------------------------------------------------------------------- lost alarms


def test_an_alarm_that_cannot_be_written_marks_the_run_dir_and_limits_the_resume(
    launched: dict[str, Any],
) -> None:
    results = launched["results"]
    alarm = results["lost-alarm-run"][0]["alarm"]
    assert alarm is not None and alarm["step"] == 10
    run_dir = launched["base"] / "lost-alarm"
    marks = [p.name for p in run_dir.iterdir() if p.name.startswith("lost-alarm.")]
    # trust_replays=2: the passing replays at 0 and 5 leave step 0 as the newest trusted step
    assert marks == [f"lost-alarm.{alarm['alarm_id']}.upto-0"]
    # step-10 was saved after the onset (step 7) and must not be loaded
    assert started_at(results["lost-alarm-restart"]) == 0
    assert (run_dir / "handled" / f"{alarm['alarm_id']}.json").is_file()


# --------------------------------------------------------------------------- staging, lock


def test_a_stale_sealed_staging_dir_does_not_poison_the_next_save(
    launched: dict[str, Any],
) -> None:
    """Before: the save reused the stale dir and hashed its meta.json; step 10 became corrupt."""
    results = launched["results"]
    assert started_at(results["stale-staging-save"]) == 5
    assert started_at(results["stale-staging-resume"]) == 10
    checkpoints = launched["base"] / "stale-staging" / "checkpoints"
    assert not [p.name for p in checkpoints.iterdir() if p.name.startswith(".staging-")]


def test_a_second_job_on_a_run_dir_in_use_is_refused(launched: dict[str, Any]) -> None:
    """Before: no lock; the second job resumed the first's checkpoints."""
    results = launched["results"]
    same_error(results["live-lock"], "is in use by job 99", "host")
    same_error(results["busy-lock-other-node"], "othernode", "guard.lock")


def test_the_lock_of_a_dead_job_on_another_node_is_taken_over(launched: dict[str, Any]) -> None:
    assert started_at(launched["results"]["stale-lock-other-node"]) == 10
    lock = RunDir(launched["base"] / "stale-lock-other-node").lock_file
    # taken over, then removed when the job's processes exited normally
    assert not lock.exists() or "othernode" not in lock.read_text()


def test_rank_zero_creates_a_missing_run_dir_but_never_a_missing_parent(tmp_path: Path) -> None:
    """Scripts create their output directory on rank 0 alone, with no barrier before the
    Guard (nanoGPT's `out_dir`): rank 0 creates the last part of the path. A missing parent (a
    typo) is still refused, and so is a directory that only rank 0 can see (node-local disk,
    posed here as a path per rank), on every rank alike."""
    cases = [
        {"run_dir": str(tmp_path / "new"), "steps": 2},
        {"run_dir": str(tmp_path / "typo" / "run"), "steps": 2},
        {"run_dir": str(tmp_path / "local-disk-{rank}"), "steps": 2},
    ]
    created, typo, local = per_case(run_local(run_cases, 3, args=(cases,), nodes=NODES))
    assert all(r.get("error") is None for r in created), created
    assert (tmp_path / "new" / "run.json").is_file()
    assert not (tmp_path / "typo").exists()
    same_error(
        typo, "run directory check failed on rank 0", "does not exist", "(also on rank(s) 1, 2)"
    )
    same_error(local, "run directory check failed on rank 1 (node2)", "(also on rank(s) 2)")
    assert (tmp_path / "local-disk-0").is_dir() and not (tmp_path / "local-disk-1").exists()
