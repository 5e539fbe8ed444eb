"""The drill on a real cluster: submitit or the sbatch template, a real controller."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_guard.drill.stages import (
    DrillError,
    DrillReport,
    Echo,
    Recorder,
    StageFailed,
    check,
    drill_fault,
    make_work_dir,
    next_steps,
    short_digest,
)
from slurm_guard.protocol import DEFAULT_STATE_DIR
from slurm_guard.slurm.polling import poll

SHARDED_TASKS = 4


@dataclass(frozen=True)
class SlurmDrillOptions:
    """How the Slurm drill submits and who plays the controller.

    Args:
        via: "submitit" (slurm_guard.slurm.launch) or "sbatch" (the template).
        controller: "in-job" (`slurm-guard recover` after srun) or "epilog" (the site's
            EpilogSlurmctld, already installed; the drill only watches).
        state_dir: the controller's state directory; share the epilog's.
        keep_drained: leave the drained node drained (default: return it to service).
        sharded: the tiny Llama under HSDP and ShardedGuard (4 tasks on `nodes` nodes).
        spares: spare nodes in the job's allocation: the step restarts on one inside the job
            (`slurm-guard supervise`) instead of the job being requeued.
    """

    nodes: int = 3
    steps: int = 30
    sharded: bool = False
    via: str = "submitit"
    controller: str = "in-job"
    state_dir: Path = DEFAULT_STATE_DIR
    timeout: float = 300.0
    keep_drained: bool = False
    sbatch_options: tuple[tuple[str, str], ...] = ()
    spares: int = 0


def usable_node(node: Any) -> bool:
    return not node.out_of_service and node.responding  # 24.11 keeps resumed nodes' reasons


def _submit(opts: SlurmDrillOptions, settings: Any, run_dir: Path, client: Any) -> str:
    from slurm_guard.examples.train import slurm_task
    from slurm_guard.slurm.launch import default_train_command, launch, render_sbatch

    in_job = opts.controller == "in-job"
    # Sharded: 4 tasks (2 replica groups x 2 shards) on 3 or 4 nodes; Slurm's block layout puts
    # ranks 0 and 1 together on 3 nodes, so rank 3, where the fault goes, is alone on its node.
    # The total alone, never with --ntasks-per-node: see launch.task_layout.
    tasks = SHARDED_TASKS if opts.sharded else None
    if opts.via == "submitit":
        job = launch(
            slurm_task,
            settings,
            nodes=opts.nodes,
            tasks=tasks,
            run_dir=run_dir,
            in_job_recovery=in_job,
            state_dir=str(opts.state_dir),
            spares=opts.spares,
            job_name=f"sg-drill-{run_dir.name}",
            time=30,
            additional_parameters={"requeue": True, **dict(opts.sbatch_options)},
        )
        return str(job.job_id)
    args = ["--run-dir", str(run_dir), "--steps", str(settings.steps)]
    if settings.inject:
        args += ["--inject", settings.inject]
    if settings.sharded:
        args.append("--sharded")
    script = render_sbatch(
        run_dir=run_dir,
        nodes=opts.nodes,
        tasks=tasks,
        spares=opts.spares,
        train_command=default_train_command(args),
        job_name=f"sg-drill-{run_dir.name}",
        state_dir=str(opts.state_dir),
        sbatch_options={"time": "30", **dict(opts.sbatch_options)},
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "job.sbatch"
    path.write_text(script)
    return str(client.submit(path))


def _job_done(client: Any, job_id: str, run_dir: Path) -> Any:
    from slurm_guard.examples.train import read_result

    info = client.job(job_id)
    if info is None:
        return {"state": "GONE"} if read_result(run_dir) is not None else None
    if info.state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
        return info
    return None


def _restarted_in_place(client: Any, job: str, fault_node: str, opts: SlurmDrillOptions) -> str:
    """The journal's in-job restart of `job`, checked: the faulty node left, a spare joined,
    and Slurm never requeued the job."""
    from slurm_guard.controller.state import StateStore

    store = StateStore(opts.state_dir)

    def restarted() -> dict[str, Any] | None:
        rows = [e for e in store.read().in_job_restarts if e.get("job_id") == job]
        return rows[0] if rows else None

    row: dict[str, Any] = poll(
        restarted, opts.timeout, f"job {job}'s restart inside its allocation"
    )
    check(row["left"] == [fault_node], f"left {row['left']}, fault on {fault_node}")
    info = client.job(job)
    check(info is not None and info.restart_count == 0, f"job {job} was requeued: {info}")
    return (
        f"{fault_node} left, {','.join(row['joined'])} joined; resumes from step "
        f"{row['resume_step']} ({row['resume_source']}); job {job} not requeued (Restarts=0)"
    )


def run_slurm_drill(
    work_dir: Path,
    opts: SlurmDrillOptions,
    *,
    client: Any | None = None,
    echo: Echo = print,
) -> DrillReport:
    """The drill on a real cluster (see the module docstring). `work_dir` must be shared."""
    from slurm_guard.controller import open_engine
    from slurm_guard.examples.train import (
        FAULT_FILE,
        TrainSettings,
        read_events,
        read_result,
    )
    from slurm_guard.protocol import REASON_PREFIX
    from slurm_guard.rundir.layout import RunDir
    from slurm_guard.rundir.records import read_json_file

    if opts.via not in ("submitit", "sbatch"):
        raise DrillError(f"--via {opts.via!r}: use submitit or sbatch")
    if opts.controller not in ("in-job", "epilog"):
        raise DrillError(f"--controller {opts.controller!r}: use in-job or epilog")
    if opts.via == "sbatch" and opts.controller == "epilog":
        raise DrillError(
            "the sbatch template always runs the in-job recovery step (it shares the journal "
            "with the epilog); use --controller in-job with --via sbatch"
        )
    if opts.nodes < 3:
        raise DrillError("the drill needs --nodes >= 3: attributing a fault takes two witnesses")
    if opts.spares and (opts.sharded or opts.controller != "in-job"):
        raise DrillError(
            "--spares needs the in-job controller (the supervisor restarts the step) and a DDP "
            "drill (the sharded drill gives a total task count)"
        )
    if opts.sharded and opts.nodes > SHARDED_TASKS:
        raise DrillError(
            f"the sharded drill runs {SHARDED_TASKS} tasks: give --nodes 3 or {SHARDED_TASKS}"
        )
    if client is None:
        from slurm_guard.slurm.client import default_client

        client = default_client()
    work = make_work_dir(work_dir, "slurm-guard-drill-")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    what = f", HSDP 2x2 ({SHARDED_TASKS} tasks), ShardedGuard" if opts.sharded else ""
    spare = f" + {opts.spares} spare(s)" if opts.spares else ""
    report = DrillReport(
        f"slurm-guard drill: {opts.nodes}-node job{spare}{what} via {opts.via}, "
        f"controller {opts.controller}",
        work,
    )
    need = opts.nodes + max(opts.spares, 1)
    echo(report.title)
    echo(f"work dir: {work} (must be on storage shared by all nodes and the controller)")
    rec = Recorder(report, echo)
    began = time.monotonic()
    clean_dir, faulty_dir = work / f"clean-{stamp}", work / f"faulty-{stamp}"
    fault_spec, _ = drill_fault(opts.sharded)
    clean = TrainSettings(run_dir=str(clean_dir), steps=opts.steps, sharded=opts.sharded)
    faulty = TrainSettings(
        run_dir=str(faulty_dir), steps=opts.steps, inject=fault_spec, sharded=opts.sharded
    )
    try:
        with rec.stage("cluster has room for the drill") as d:

            def enough() -> list[Any] | None:
                # A node just returned to service shows `idle*` for about a second.
                found = client.nodes()
                return found if sum(map(usable_node, found)) >= need else None

            try:
                nodes = poll(enough, min(opts.timeout, 15.0), "free nodes")
            except TimeoutError:
                nodes = client.nodes()
            usable = sorted(n.name for n in nodes if usable_node(n))
            check(
                len(usable) >= need,
                f"{len(usable)} usable node(s) ({', '.join(usable) or '-'}); the drill needs "
                f"{need}: {opts.nodes} for the job and one spare to come back without "
                "the faulty one. Free nodes or pass a smaller --nodes",
            )
            before = {n.name: n.reason for n in nodes}
            d.append(f"usable nodes: {', '.join(usable)}")
        with rec.stage(f"clean run via {opts.via}") as d:
            job = _submit(opts, clean, clean_dir, client)
            info = poll(
                lambda: _job_done(client, job, clean_dir), opts.timeout, f"job {job} to end"
            )
            result = read_result(clean_dir)
            check(
                result is not None,
                f"job {job} ended ({getattr(info, 'state', info)}) "
                f"without {clean_dir}/result.json; see {clean_dir} for its logs",
            )
            assert result is not None
            check(result["final_step"] == opts.steps, f"stopped at {result['final_step']}")
            d.append(
                f"job {job} on {','.join(result['nodes'])}: {opts.steps} steps, weights "
                f"sha256 {short_digest(result['weight_sha256'])}"
            )
            report.facts["clean"] = result
        with rec.stage("guard stops the faulty run") as d:
            job = _submit(opts, faulty, faulty_dir, client)
            report.facts["job_id"] = job
            rd = RunDir(faulty_dir)
            poll(lambda: list(rd.alarms_dir.glob("*.json")), opts.timeout, f"job {job}'s alarm")
            alarms, errors = rd.alarms()
            check(not errors and len(alarms) == 1, f"alarms {alarms}, errors {errors}")
            alarm = alarms[0]
            injected = read_json_file(faulty_dir / FAULT_FILE)
            fault_node = str(injected["spec"]).split("node=")[1].split(",")[0]
            placed = list(injected.get("nodes") or [])
            check(
                not opts.sharded or placed.count(fault_node) == 1,
                f"ranks on nodes {placed}: rank 3 shares {fault_node} with another rank (the "
                "site's task layout is not Slurm's block default?), so the fault hits a whole "
                "replica group and cannot be attributed; the sharded drill needs rank 3 alone",
            )
            check(alarm.verdict == "sdc", f"verdict {alarm.verdict}")
            check(
                list(alarm.suspect_nodes) == [fault_node],
                f"suspects {alarm.suspect_nodes}, fault injected on {fault_node}",
            )
            check(alarm.job_id == job, f"alarm names job {alarm.job_id}")
            d.append(alarm.message)
            d.append(
                f"fault injected on {fault_node}; suspects {','.join(alarm.suspect_nodes)}; "
                f"trusted checkpoint {alarm.trusted_checkpoint}"
            )
            report.facts.update(alarm=alarm.to_json(), fault_node=fault_node)
        with rec.stage(f"controller ({opts.controller}) drains exactly {fault_node}") as d:
            reason = poll(
                lambda: (
                    (client.node(fault_node).reason or "").startswith(REASON_PREFIX)
                    and client.node(fault_node).reason
                ),
                opts.timeout,
                f"{fault_node} drained by slurm-guard",
            )
            check(
                f"job {job}" in reason and f"alarm {alarm.alarm_id}" in reason,
                f"reason {reason!r} does not name the job and the alarm",
            )
            after = {n.name: n.reason for n in client.nodes()}
            others = [
                n
                for n, r in after.items()
                if n != fault_node and (r or "").startswith(REASON_PREFIX) and r != before.get(n)
            ]
            check(not others, f"also drained: {others}")
            d.append(f"{fault_node}: {reason}")
        if opts.spares:
            with rec.stage(f"step restarts on a spare without {fault_node}, no requeue") as d:
                d.append(_restarted_in_place(client, job, fault_node, opts))
        else:
            with rec.stage(f"job comes back without {fault_node}") as d:

                def rerunning() -> Any:
                    i = client.job(job)
                    if (
                        i is not None
                        and i.restart_count >= 1
                        and i.state in ("RUNNING", "COMPLETED")
                    ):
                        return i
                    return None

                info = poll(rerunning, opts.timeout, f"job {job} running again")
                seen = time.time()
                check(fault_node not in info.nodes, f"rerun on {info.nodes}")
                check(fault_node in info.excluded_nodes, f"ExcNodeList {info.excluded_nodes}")
                events = read_events(faulty_dir)
                stop = next((e for e in events if e["event"] == "alarm"), None)
                check(stop is not None, "no alarm event in train-events.jsonl")
                assert stop is not None
                d.append(
                    f"restart {info.restart_count} on {','.join(info.nodes)} "
                    f"(excluded {','.join(info.excluded_nodes)}); seen RUNNING "
                    f"{seen - float(stop['time']):.1f} s after the guard stopped the first run"
                )
        with rec.stage("the run resumes from the trusted checkpoint and finishes") as d:
            poll(lambda: _job_done(client, job, faulty_dir), opts.timeout, f"job {job} to end")
            result = read_result(faulty_dir)
            check(result is not None, f"no {faulty_dir}/result.json; see its slurm-*.out logs")
            assert result is not None
            expected = int(str(alarm.trusted_checkpoint).split("-")[-1])
            check(
                result["resumed_from"] == expected,
                f"resumed from {result['resumed_from']}, expected {expected}",
            )
            check(result["final_step"] == opts.steps, f"stopped at {result['final_step']}")
            restarts = result["restart_count"]
            check(
                restarts == 0 if opts.spares else restarts >= 1, f"Slurm restart count {restarts}"
            )
            events = read_events(faulty_dir)
            stop = next(e for e in events if e["event"] == "alarm")
            starts = [e for e in events if e["event"] == "start"]
            gap = float(starts[-1]["time"]) - float(stop["time"])
            d.append(
                f"resumed from step {expected} on {','.join(result['nodes'])}, finished step "
                f"{result['final_step']}; training restarted {gap:.1f} s after the stop"
            )
            report.facts.update(faulty=result, stop_to_restart_s=gap)
        with rec.stage("final weights bit-identical to the clean run") as d:
            a = report.facts["clean"]["weight_sha256"]
            b = report.facts["faulty"]["weight_sha256"]
            check(a == b, f"clean {short_digest(a)} != resumed {short_digest(b)}")
            d.append(f"sha256 {a}")
        if not opts.keep_drained:
            with rec.stage(f"return {fault_node} to service (review return)") as d:
                engine = open_engine(opts.state_dir, client)
                d.append(
                    engine.return_node(
                        fault_node,
                        "slurm-guard drill: the fault was injected, hardware is fine",
                        os.environ.get("USER", "drill"),
                    )
                )
    except StageFailed:
        pass
    report.seconds = time.monotonic() - began
    echo(f"drill {'PASSED' if report.ok else 'FAILED'} in {report.seconds:.1f} s")
    echo(next_steps(faulty_dir, Path(opts.state_dir)))
    return report
