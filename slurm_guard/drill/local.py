"""The local drill: no Slurm; local processes pose as nodes and the controller runs dry."""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slurm_guard.drill.stages import (
    CLEAN_JOB_ID,
    LOCAL_JOB_ID,
    DrillError,
    DrillReport,
    Echo,
    Recorder,
    StageFailed,
    check,
    drill_fault,
    make_work_dir,
    next_steps,
    progress,
    short_digest,
)
from slurm_guard.protocol import EXIT_SDC
from slurm_guard.slurm.dry_run import DryRunSlurm
from slurm_guard.slurm.parsers import JobInfo, NodeInfo


def _local_worker(scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs in each local rank: several guarded trainings, one after the other."""
    import torch.distributed as dist

    from slurm_guard.errors import SilentDataCorruption
    from slurm_guard.examples.train import run_training

    out: list[dict[str, Any]] = []
    for sc in scenarios:
        os.environ.update(sc["env"])
        began = time.monotonic()
        try:
            out.append({"result": run_training(sc["settings"]), "alarm": None})
        except SilentDataCorruption as exc:
            out.append({"result": None, "alarm": exc.alarm.to_json()})
        except Exception:
            # Recorded against this scenario, so the report names the stage that failed; the
            # later scenarios cannot run on a process group in an unknown state.
            out.append({"error": traceback.format_exc()[-800:], "seconds": 0.0})
            break
        out[-1]["seconds"] = time.monotonic() - began
        dist.barrier()
    return out


def _scenario(
    per_rank: Sequence[list[dict[str, Any]]], index: int, what: str
) -> list[dict[str, Any]]:
    """Every rank's outcome of scenario `index`; the stage fails if a rank did not finish it."""
    runs = []
    for rank, scenarios in enumerate(per_rank):
        if len(scenarios) <= index:
            raise StageFailed(f"{what}: rank {rank} did not get to it (an earlier run failed)")
        if "error" in scenarios[index]:
            raise StageFailed(f"{what}: rank {rank} failed: {scenarios[index]['error']}")
        runs.append(scenarios[index])
    return runs


def _ranks_ok(outcomes: Sequence[Any], what: str) -> list[list[dict[str, Any]]]:
    bad = [o for o in outcomes if o.status != "ok"]
    if bad:
        first = bad[0]
        raise StageFailed(f"{what}: rank {first.rank} {first.status}: {str(first.value)[-800:]}")
    return [o.value for o in outcomes]


def _local_slurm(job_id: str, nodes: Sequence[str]) -> DryRunSlurm:
    """What Slurm would say after the faulty local run: the job ended with the guard's exit
    code on `nodes`, every node idle with no reason. A DryRunSlurm with these facts and no
    cluster behind it: the controller decides for real and changes nothing."""
    job = JobInfo(
        job_id=job_id,
        state="FAILED",
        reason="NonZeroExitCode",
        nodes=tuple(nodes),
        user=os.environ.get("USER", "user"),
        user_id=os.getuid(),
        restart_count=0,
        exit_code=EXIT_SDC,
        exit_signal=0,
        excluded_nodes=(),
        work_dir=os.getcwd(),
        name="drill",
        requeue=True,
        held=False,
    )
    idle = [NodeInfo(n, frozenset({"IDLE"}), None, None, "127.0.0.1", "localhost") for n in nodes]
    return DryRunSlurm(None, jobs=[job], nodes=idle)


def run_local_drill(
    work_dir: Path | None = None,
    *,
    nodes: int = 3,
    steps: int = 30,
    echo: Echo = print,
    timeout: float = 300.0,
    sharded: bool = False,
    tp: int = 1,
) -> DrillReport:
    """The demo: clean run, faulty run, dry-run controller decision, resume, bit-for-bit check.

    `nodes` local processes pose as node1..nodeN (N >= 3: one suspect needs two witnesses);
    the resumed run uses the same names without the suspect (node2; node4 with `sharded`)
    and with node{N+1} in its place. `sharded`: the tiny Llama under HSDP (2 replica groups x
    N/2 shards) and ShardedGuard instead of DDP and Guard; N must be even. `tp` > 1 (with
    `sharded`): FSDP2 over N data-parallel indices x TP `tp`, `tp` ranks on each node (a TP
    group), as `srun --ntasks-per-node=tp` places them; the fault is on node2's whole TP group.
    """
    from slurm_guard.controller import handle_job
    from slurm_guard.examples.train import TrainSettings, read_result
    from slurm_guard.local.launch import run_local
    from slurm_guard.protocol import REASON_PREFIX
    from slurm_guard.rundir.layout import RunDir
    from slurm_guard.rundir.records import read_alarm

    if nodes < 3:
        raise DrillError("the drill needs --nodes >= 3: attributing a fault takes two witnesses")
    if tp > 1 and not sharded:
        raise DrillError("--tp is for the sharded drill: give --sharded too")
    if sharded and tp == 1 and (nodes < 4 or nodes % 2):
        raise DrillError("the sharded drill needs an even --nodes >= 4 (2 replica groups)")
    if steps < 25:
        raise DrillError("the drill needs --steps >= 25 (the fault starts at step 17)")
    fault_spec, fault_rank = drill_fault(sharded, tp)
    work = make_work_dir(work_dir, "slurm-guard-drill-")
    names = [f"node{i}" for i in range(1, nodes + 1)]
    placed = [n for n in names for _ in range(tp)]  # rank r runs on placed[r]
    suspect = placed[fault_rank]
    what = f"HSDP 2x{nodes // 2}, ShardedGuard" if sharded else "DDP"
    if tp > 1:
        what = f"FSDP2 {nodes} x TP {tp} ({tp} ranks a node), ShardedGuard"
    report = DrillReport(
        f"slurm-guard drill --local: {len(placed)} local processes as nodes "
        f"{names[0]}..{names[-1]}, {what}, no Slurm, dry-run controller",
        work,
    )
    echo(report.title)
    echo(f"work dir: {work}")
    echo(
        f"fault: {fault_spec} (a GPU on rank {fault_rank}'s node returns wrong gradients "
        "from step 17)"
    )
    rec = Recorder(report, echo)
    began = time.monotonic()
    clean_dir, faulty_dir = work / "clean", work / "faulty"
    clean = TrainSettings(run_dir=str(clean_dir), steps=steps, sharded=sharded, tp=tp)
    faulty = TrainSettings(
        run_dir=str(faulty_dir), steps=steps, inject=fault_spec, sharded=sharded, tp=tp
    )

    def launch(what: str, settings: TrainSettings, env: dict[str, str], on: list[str]) -> Any:
        """One set of local processes for one run, with progress lines while it runs: the
        runs go one after the other, so each stage's lines come before the next run's."""
        with progress(echo, what, Path(settings.run_dir)):
            started = time.monotonic()
            outcomes = run_local(
                _local_worker,
                len(on),
                args=([{"settings": settings, "env": env}],),
                nodes=on,
                timeout=timeout,
            )
            return outcomes, time.monotonic() - started

    try:
        with rec.stage("clean run (no fault)") as d:
            outcomes, wall = launch("clean run", clean, {"SLURM_JOB_ID": CLEAN_JOB_ID}, placed)
            first = _scenario(_ranks_ok(outcomes, "the clean run"), 0, "the clean run")[0]
            check(first["alarm"] is None, f"the clean run raised an alarm: {first['alarm']}")
            result = first["result"]
            check(result["final_step"] == steps, f"stopped at step {result['final_step']}")
            d.append(
                f"{steps} steps on {len(placed)} ranks: {first['seconds']:.1f} s of training after "
                f"{wall - first['seconds']:.1f} s of process start; final weights sha256 "
                f"{short_digest(result['weight_sha256'])}"
            )
            report.facts["clean_sha256"] = result["weight_sha256"]
        with rec.stage("guard stops the faulty run") as d:
            outcomes, wall = launch("faulty run", faulty, {"SLURM_JOB_ID": LOCAL_JOB_ID}, placed)
            runs = _scenario(_ranks_ok(outcomes, "the faulty run"), 0, "the faulty run")
            alarm = runs[0]["alarm"]
            check(alarm is not None, "the faulty run finished without an alarm")
            check(all(r["alarm"] == alarm for r in runs), "ranks disagree on the alarm")
            check(alarm["verdict"] == "sdc", f"verdict {alarm['verdict']}, expected sdc")
            check(alarm["suspect_nodes"] == [suspect], f"suspects {alarm['suspect_nodes']}")
            check(not alarm["update_applied"], "the suspect update was applied")
            files = list(RunDir(faulty_dir).alarms_dir.glob("*.json"))
            check(len(files) == 1, f"{len(files)} alarm files, expected 1")
            check(read_alarm(files[0]).alarm_id == alarm["alarm_id"], "alarm file differs")
            d.append(
                f"stopped at step {alarm['step']}, {runs[0]['seconds']:.1f} s into training "
                f"(after {wall - runs[0]['seconds']:.1f} s of process start): {alarm['message']}"
            )
            d.append(
                f"suspect {suspect} (rank {alarm['suspect_ranks'][0]}), update not applied; "
                f"last verified step {alarm['last_verified_step']}, trusted checkpoint "
                f"{alarm['trusted_checkpoint']}; alarm file {files[0]}"
            )
            report.facts["alarm"] = alarm
        with rec.stage("controller decision (dry run)") as d:
            job_report = handle_job(
                LOCAL_JOB_ID,
                faulty_dir,
                state_dir=work / "controller-state",
                client=_local_slurm(LOCAL_JOB_ID, names),
                allocation=tuple(names),
                dry_run=True,
            )
            decision = job_report.decisions.get(alarm["alarm_id"])
            check(decision is not None, f"no decision for the alarm: {job_report.lines()}")
            assert decision is not None
            check(decision[0] == "act", f"decision {decision}")
            drains = [a for a in job_report.actions if a.startswith("would drain ")]
            check(len(drains) == 1, f"drains {drains}, expected exactly one")
            check(drains[0].startswith(f"would drain {suspect}: {REASON_PREFIX}"), drains[0])
            check(
                f"would exclude {suspect} from job {LOCAL_JOB_ID}" in job_report.actions,
                f"no exclusion of {suspect} in {job_report.actions}",
            )
            d.append(f"decision: {decision[1]}")
            d += job_report.actions
        resumed_names = [n for n in names if n != suspect] + [f"node{nodes + 1}"]
        with rec.stage(f"requeued run on {','.join(resumed_names)} resumes and finishes") as d:
            env = {"SLURM_JOB_ID": LOCAL_JOB_ID, "SLURM_RESTART_COUNT": "1"}
            again, _ = launch(
                "requeued run", faulty, env, [n for n in resumed_names for _ in range(tp)]
            )
            rerun = _ranks_ok(again, "requeued run")[0][0]
            check(rerun["alarm"] is None, f"the requeued run raised an alarm: {rerun['alarm']}")
            result = rerun["result"]
            expected = int(str(alarm["trusted_checkpoint"]).split("-")[-1])
            check(
                result["resumed_from"] == expected,
                f"resumed from step {result['resumed_from']}, expected {expected}",
            )
            check(result["final_step"] == steps, f"stopped at step {result['final_step']}")
            check(suspect not in result["nodes"], f"ran on {result['nodes']}")
            on_disk = read_result(faulty_dir)
            check(
                on_disk is not None and on_disk["weight_sha256"] == result["weight_sha256"],
                "result.json differs from the ranks' result",
            )
            d.append(
                f"resumed from checkpoint step {expected} (the newest saved before the last "
                f"verified step {alarm['last_verified_step']}), finished step {steps}"
            )
            quarantined = sorted(
                p.name for p in (faulty_dir / "quarantine" / alarm["alarm_id"]).glob("*")
            )
            d.append(f"checkpoints after the fault moved aside: {', '.join(quarantined) or '-'}")
            report.facts["resumed_sha256"] = result["weight_sha256"]
        with rec.stage("final weights bit-identical to the clean run") as d:
            a, b = report.facts["clean_sha256"], report.facts["resumed_sha256"]
            check(a == b, f"clean {short_digest(a)} != resumed {short_digest(b)}")
            d.append(f"sha256 {a} (parameters, buffers, optimizer state)")
    except StageFailed:
        pass
    report.seconds = time.monotonic() - began
    echo(f"drill {'PASSED' if report.ok else 'FAILED'} in {report.seconds:.1f} s")
    echo(next_steps(faulty_dir, None))
    return report
