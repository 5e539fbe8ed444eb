"""The drill: the whole loop, end to end, with a fault injected on purpose.

What an admin needs to see before trusting slurm-guard with a real job: a short guarded job
with a persistent fault on one node is stopped by the guard, the controller drains exactly that
node with a readable reason, the job comes back without it, resumes from the checkpoint saved
before the fault, finishes, and its final weights are bit-identical to a fault-free run of the
same job.

Two settings:

* `run_local_drill`: no Slurm. Ranks are local processes posing as nodes (`SLURMD_NODENAME`),
  the controller runs in dry-run mode against a simulated Slurm, and the "requeue" is a new
  set of processes on other node names. This is the README's demo.
* `run_slurm_drill`: a real cluster. The job goes through submitit or the sbatch template, the
  controller is the site's EpilogSlurmctld or the in-job `slurm-guard recover` step, and the
  drill only watches and checks. It drains a real node; by default it returns the node to
  service afterwards (through the same review command an admin uses).

Each stage prints PASS/FAIL with its wall time; the report is OK only if all stages pass.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from slurm_guard.errors import GuardError

Echo = Callable[[str], None]
T = TypeVar("T")

LOCAL_JOB_ID = "1001"
CLEAN_JOB_ID = "1000"
FAULT_SPEC = "kind=grad-scale,node=@rank1,step=17,persistent=1,param=10"
"""A persistent wrong gradient on rank 1's node from step 17: between the replays at 15 and 20,
so the alarm comes at 20, the last verified step is 15 and the trusted checkpoint is step 10."""


class DrillError(GuardError):
    """The drill could not run (not a failed check: that is a FAIL stage)."""


@dataclass
class Stage:
    name: str
    passed: bool
    seconds: float
    details: list[str] = field(default_factory=list)


@dataclass
class DrillReport:
    """Stages in order; `ok` only if there is at least one and all passed."""

    title: str
    work_dir: Path
    stages: list[Stage] = field(default_factory=list)
    seconds: float = 0.0
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return bool(self.stages) and all(s.passed for s in self.stages)


class _StageFailed(Exception):
    pass


class _Recorder:
    """Runs stages, prints each as it ends, stops at the first failure."""

    def __init__(self, report: DrillReport, echo: Echo) -> None:
        self.report = report
        self.echo = echo

    @contextmanager
    def stage(self, name: str, seconds: float | None = None) -> Iterator[list[str]]:
        """A stage; `seconds` replaces the measured time when the work ran earlier."""
        details: list[str] = []
        began = time.monotonic()
        passed = False
        try:
            yield details
            passed = True
        except _StageFailed as exc:
            details.append(f"FAILED: {exc}")
        except (GuardError, OSError, TimeoutError) as exc:
            details.append(f"FAILED: {type(exc).__name__}: {exc}")
        finally:
            took = time.monotonic() - began if seconds is None else seconds
            stage = Stage(name, passed, took, details)
            self.report.stages.append(stage)
            number = len(self.report.stages)
            mark = "PASS" if passed else "FAIL"
            self.echo(f"[{mark}] {number}. {name} ({stage.seconds:.1f} s)")
            for line in details:
                self.echo(f"         {line}")
        if not passed:
            raise _StageFailed(name)


def check(condition: bool, message: str) -> None:
    """Fail the current stage with `message` unless `condition` holds."""
    if not condition:
        raise _StageFailed(message)


def poll(predicate: Callable[[], T | None], timeout: float, what: str, interval: float = 0.2) -> T:
    """Call `predicate` until it returns something truthy; TimeoutError names `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        time.sleep(interval)


def _work_dir(work_dir: Path | None, prefix: str) -> Path:
    if work_dir is None:
        return Path(tempfile.mkdtemp(prefix=prefix)).resolve()
    work_dir = work_dir.resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    return work_dir


def _short(digest: str) -> str:
    return digest[:16]


# ----------------------------------------------------------------------------- local drill


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
        out[-1]["seconds"] = time.monotonic() - began
        dist.barrier()
    return out


def _ranks_ok(outcomes: Sequence[Any], what: str) -> list[list[dict[str, Any]]]:
    bad = [o for o in outcomes if o.status != "ok"]
    if bad:
        first = bad[0]
        raise _StageFailed(f"{what}: rank {first.rank} {first.status}: {str(first.value)[-800:]}")
    return [o.value for o in outcomes]


class _SimulatedSlurm:
    """Just enough of a SlurmClient for a dry-run controller: the job and its nodes.

    The drill's local job ended with the guard's exit code on `nodes`; every node is idle
    with no reason. Anything that would change the cluster raises: a dry run must not try.
    """

    def __init__(self, job_id: str, nodes: Sequence[str]) -> None:
        from slurm_guard.slurm_parsers import JobInfo, NodeInfo

        self._job = JobInfo(
            job_id=job_id,
            state="FAILED",
            reason="NonZeroExitCode",
            nodes=tuple(nodes),
            user=os.environ.get("USER", "user"),
            user_id=os.getuid(),
            restart_count=0,
            exit_code=86,
            exit_signal=0,
            excluded_nodes=(),
            work_dir=os.getcwd(),
            name="drill",
            requeue=True,
            held=False,
        )
        self._nodes = {
            n: NodeInfo(n, frozenset({"IDLE"}), None, None, "127.0.0.1", "localhost") for n in nodes
        }

    def job(self, job_id: str) -> Any:
        return self._job if job_id == self._job.job_id else None

    def node(self, name: str) -> Any:
        return self._nodes[name]

    def nodes(self) -> list[Any]:
        return list(self._nodes.values())

    def expand_hostlist(self, expression: str) -> list[str]:
        from slurm_guard.slurm_parsers import expand_hostlist

        return expand_hostlist(expression)

    def _refuse(self, *_args: Any) -> None:
        raise DrillError("the local drill's controller is a dry run; it changes nothing")

    def drain(self, node: str, reason: str) -> None:
        self._refuse(node, reason)

    def resume(self, node: str) -> None:
        self._refuse(node)

    def fail(self, node: str, reason: str) -> None:
        self._refuse(node, reason)

    def requeue_hold(self, job_id: str) -> None:
        self._refuse(job_id)

    def set_excluded_nodes(self, job_id: str, nodes: Sequence[str]) -> None:
        self._refuse(job_id, nodes)

    def release(self, job_id: str) -> None:
        self._refuse(job_id)

    def set_start_time(self, job_id: str, when: str) -> None:
        self._refuse(job_id, when)

    def submit(self, script: Path, args: Sequence[str] = ()) -> str:
        self._refuse(script, args)
        return ""


def run_local_drill(
    work_dir: Path | None = None,
    *,
    nodes: int = 3,
    steps: int = 30,
    echo: Echo = print,
    timeout: float = 300.0,
) -> DrillReport:
    """The demo: clean run, faulty run, dry-run controller decision, resume, bit-for-bit check.

    `nodes` local processes pose as node1..nodeN (N >= 3: one suspect needs two witnesses);
    the resumed run uses node1, node3..node{N+1}, i.e. without the suspect node2.
    """
    from slurm_guard.controller.engine import Engine
    from slurm_guard.controller.policy import REASON_PREFIX, Policy
    from slurm_guard.controller.state import StateStore
    from slurm_guard.examples.train import TrainSettings, read_result
    from slurm_guard.local_launch import run_local
    from slurm_guard.records import read_alarm
    from slurm_guard.rundir import RunDir

    if nodes < 3:
        raise DrillError("the drill needs --nodes >= 3: attributing a fault takes two witnesses")
    if steps < 25:
        raise DrillError("the drill needs --steps >= 25 (the fault starts at step 17)")
    work = _work_dir(work_dir, "slurm-guard-drill-")
    names = [f"node{i}" for i in range(1, nodes + 1)]
    report = DrillReport(
        f"slurm-guard drill --local: {nodes} local processes as nodes {names[0]}..{names[-1]}, "
        "no Slurm, dry-run controller",
        work,
    )
    echo(report.title)
    echo(f"work dir: {work}")
    echo(f"fault: {FAULT_SPEC} (a GPU on rank 1's node returns wrong gradients from step 17)")
    rec = _Recorder(report, echo)
    began = time.monotonic()
    clean_dir, faulty_dir = work / "clean", work / "faulty"
    clean = TrainSettings(run_dir=str(clean_dir), steps=steps)
    faulty = TrainSettings(run_dir=str(faulty_dir), steps=steps, inject=FAULT_SPEC)
    try:
        spawn = time.monotonic()
        outcomes = run_local(
            _local_worker,
            nodes,
            args=(
                [
                    {"settings": clean, "env": {"SLURM_JOB_ID": CLEAN_JOB_ID}},
                    {"settings": faulty, "env": {"SLURM_JOB_ID": LOCAL_JOB_ID}},
                ],
            ),
            nodes=names,
            timeout=timeout,
        )
        spawn_s = time.monotonic() - spawn
        times = [
            o.value[i]["seconds"] if o.status == "ok" else 0.0 for o in outcomes[:1] for i in (0, 1)
        ] or [0.0, 0.0]
        with rec.stage("clean run (no fault)", spawn_s - times[1]) as d:
            per_rank = _ranks_ok(outcomes, "clean and faulty runs")
            first = per_rank[0][0]
            check(first["alarm"] is None, f"the clean run raised an alarm: {first['alarm']}")
            result = first["result"]
            check(result["final_step"] == steps, f"stopped at step {result['final_step']}")
            d.append(
                f"{steps} steps on {nodes} ranks in {first['seconds']:.1f} s "
                f"(+{spawn_s - first['seconds'] - per_rank[0][1]['seconds']:.1f} s process "
                f"start); final weights sha256 {_short(result['weight_sha256'])}"
            )
            report.facts["clean_sha256"] = result["weight_sha256"]
        with rec.stage("guard stops the faulty run", times[1]) as d:
            runs = [r[1] for r in per_rank]
            alarm = runs[0]["alarm"]
            check(alarm is not None, "the faulty run finished without an alarm")
            check(all(r["alarm"] == alarm for r in runs), "ranks disagree on the alarm")
            check(alarm["verdict"] == "sdc", f"verdict {alarm['verdict']}, expected sdc")
            check(alarm["suspect_nodes"] == ["node2"], f"suspects {alarm['suspect_nodes']}")
            check(not alarm["update_applied"], "the suspect update was applied")
            files = list(RunDir(faulty_dir).alarms_dir.glob("*.json"))
            check(len(files) == 1, f"{len(files)} alarm files, expected 1")
            check(read_alarm(files[0]).alarm_id == alarm["alarm_id"], "alarm file differs")
            d.append(f"after {runs[0]['seconds']:.1f} s: {alarm['message']}")
            d.append(
                f"suspect node2 (rank {alarm['suspect_ranks'][0]}), update not applied; "
                f"last verified step {alarm['last_verified_step']}, trusted checkpoint "
                f"{alarm['trusted_checkpoint']}; alarm file {files[0]}"
            )
            report.facts["alarm"] = alarm
        with rec.stage("controller decision (dry run)") as d:
            store = StateStore(work / "controller-state")
            engine = Engine(_SimulatedSlurm(LOCAL_JOB_ID, names), store, Policy(), dry_run=True)
            job_report = engine.process_job(LOCAL_JOB_ID, faulty_dir, allocation=tuple(names))
            decision = job_report.decisions.get(alarm["alarm_id"])
            check(decision is not None, f"no decision for the alarm: {job_report.lines()}")
            assert decision is not None
            check(decision[0] == "act", f"decision {decision}")
            drains = [a for a in job_report.actions if a.startswith("would drain ")]
            check(len(drains) == 1, f"drains {drains}, expected exactly one")
            check(drains[0].startswith(f"would drain node2 {REASON_PREFIX}"), drains[0])
            check(
                any(
                    a.startswith(f"would exclude {LOCAL_JOB_ID} 0 node2")
                    for a in job_report.actions
                ),
                f"no exclusion of node2 in {job_report.actions}",
            )
            d.append(f"decision: {decision[1]}")
            d += job_report.actions
        resumed_names = [names[0], *names[2:], f"node{nodes + 1}"]
        with rec.stage(f"requeued run on {','.join(resumed_names)} resumes and finishes") as d:
            again = run_local(
                _local_worker,
                nodes,
                args=(
                    [
                        {
                            "settings": faulty,
                            "env": {"SLURM_JOB_ID": LOCAL_JOB_ID, "SLURM_RESTART_COUNT": "1"},
                        }
                    ],
                ),
                nodes=resumed_names,
                timeout=timeout,
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
            check("node2" not in result["nodes"], f"ran on {result['nodes']}")
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
            check(a == b, f"clean {_short(a)} != resumed {_short(b)}")
            d.append(f"sha256 {a} (parameters, buffers, optimizer state)")
    except _StageFailed:
        pass
    report.seconds = time.monotonic() - began
    echo(f"drill {'PASSED' if report.ok else 'FAILED'} in {report.seconds:.1f} s")
    return report


# ----------------------------------------------------------------------------- Slurm drill


@dataclass(frozen=True)
class SlurmDrillOptions:
    """How the Slurm drill submits and who plays the controller.

    Args:
        via: "submitit" (slurm_guard.launch) or "sbatch" (the template).
        controller: "in-job" (`slurm-guard recover` after srun) or "epilog" (the site's
            EpilogSlurmctld, already installed; the drill only watches).
        state_dir: the controller's state directory; share the epilog's.
        keep_drained: leave the drained node drained (default: return it to service).
    """

    nodes: int = 3
    steps: int = 30
    via: str = "submitit"
    controller: str = "in-job"
    state_dir: Path = Path("/var/lib/slurm-guard")
    timeout: float = 300.0
    keep_drained: bool = False
    sbatch_options: tuple[tuple[str, str], ...] = ()


def _usable(node: Any) -> bool:
    return not (node.drained or node.failed or node.down) and node.responding and not node.reason


def _submit(opts: SlurmDrillOptions, settings: Any, run_dir: Path, client: Any) -> str:
    from slurm_guard.examples.train import slurm_task
    from slurm_guard.launch import default_train_command, launch, render_sbatch

    in_job = opts.controller == "in-job"
    if opts.via == "submitit":
        job = launch(
            slurm_task,
            settings,
            nodes=opts.nodes,
            run_dir=run_dir,
            in_job_recovery=in_job,
            state_dir=str(opts.state_dir),
            job_name=f"sg-drill-{run_dir.name}",
            time=30,
            additional_parameters={"requeue": True, **dict(opts.sbatch_options)},
        )
        return str(job.job_id)
    args = ["--run-dir", str(run_dir), "--steps", str(settings.steps)]
    if settings.inject:
        args += ["--inject", settings.inject]
    script = render_sbatch(
        run_dir=run_dir,
        nodes=opts.nodes,
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


def run_slurm_drill(
    work_dir: Path,
    opts: SlurmDrillOptions,
    *,
    client: Any | None = None,
    echo: Echo = print,
) -> DrillReport:
    """The drill on a real cluster (see the module docstring). `work_dir` must be shared."""
    from slurm_guard.controller.engine import Engine
    from slurm_guard.controller.policy import REASON_PREFIX, Policy
    from slurm_guard.controller.state import StateStore
    from slurm_guard.examples.train import (
        FAULT_FILE,
        TrainSettings,
        read_events,
        read_result,
    )
    from slurm_guard.records import read_json_file
    from slurm_guard.rundir import RunDir

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
    if client is None:
        from slurm_guard.slurm_client import default_client

        client = default_client()
    work = _work_dir(work_dir, "slurm-guard-drill-")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    report = DrillReport(
        f"slurm-guard drill: {opts.nodes}-node job via {opts.via}, controller {opts.controller}",
        work,
    )
    echo(report.title)
    echo(f"work dir: {work} (must be on storage shared by all nodes and the controller)")
    rec = _Recorder(report, echo)
    began = time.monotonic()
    clean_dir, faulty_dir = work / f"clean-{stamp}", work / f"faulty-{stamp}"
    clean = TrainSettings(run_dir=str(clean_dir), steps=opts.steps)
    faulty = TrainSettings(run_dir=str(faulty_dir), steps=opts.steps, inject=FAULT_SPEC)
    try:
        with rec.stage("cluster has room for the drill") as d:

            def enough() -> list[Any] | None:
                # A node just returned to service shows `idle*` for about a second.
                found = client.nodes()
                return found if sum(map(_usable, found)) > opts.nodes else None

            try:
                nodes = poll(enough, min(opts.timeout, 15.0), "free nodes")
            except TimeoutError:
                nodes = client.nodes()
            usable = sorted(n.name for n in nodes if _usable(n))
            check(
                len(usable) >= opts.nodes + 1,
                f"{len(usable)} usable node(s) ({', '.join(usable) or '-'}); the drill needs "
                f"{opts.nodes + 1}: {opts.nodes} for the job and one spare to come back without "
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
                f"sha256 {_short(result['weight_sha256'])}"
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
            fault_node = str(read_json_file(faulty_dir / FAULT_FILE)["spec"]).split("node=")[1]
            fault_node = fault_node.split(",")[0]
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
        with rec.stage(f"job comes back without {fault_node}") as d:

            def rerunning() -> Any:
                i = client.job(job)
                if i is not None and i.restart_count >= 1 and i.state in ("RUNNING", "COMPLETED"):
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
        with rec.stage("requeued run resumes from the trusted checkpoint and finishes") as d:
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
            check(result["restart_count"] >= 1, f"restart count {result['restart_count']}")
            events = read_events(faulty_dir)
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
            check(a == b, f"clean {_short(a)} != resumed {_short(b)}")
            d.append(f"sha256 {a}")
        if not opts.keep_drained:
            with rec.stage(f"return {fault_node} to service (review return)") as d:
                engine = Engine(client, StateStore(opts.state_dir), Policy.load(opts.state_dir))
                d.append(
                    engine.return_node(
                        fault_node,
                        "slurm-guard drill: the fault was injected, hardware is fine",
                        os.environ.get("USER", "drill"),
                    )
                )
        echo(f"see the history: slurm-guard status {faulty_dir} --state-dir {opts.state_dir}")
    except _StageFailed:
        pass
    report.seconds = time.monotonic() - began
    echo(f"drill {'PASSED' if report.ok else 'FAILED'} in {report.seconds:.1f} s")
    return report
