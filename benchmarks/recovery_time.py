"""Recovery time on a real local Slurm cluster: from the end of the failed run to the requeued
job running again, and to its first training step after resume.

Starts its own 4-node LocalCluster (free port range, no accounting; stopped at the end) with the
project's EpilogSlurmctld (`epilog/slurm-guard-epilog.sh`) as the controller, as in
`tests/test_controller_slurm.py`. Each repetition submits a 3-node guarded training
(`slurm_guard.examples.train`, small model) with the drill's persistent fault on the node of
rank 1 (`drill.FAULT_SPEC`): the guard stops the run at step 20 (exit 86), the epilog drains
node2 and requeues the job without it (requeue-hold, exclude, release, StartTime=now+2), and
the rerun resumes from the trusted checkpoint (step 10) on node1, node3, node4 and finishes.

Timestamps (one machine, one clock):
  stop      the guard raised the alarm (rank 0, `train-events.jsonl`)
  end       the failed run's batch script ended (after srun returned; = "end of the failed run")
  running   the requeued batch script's first line ran (the job is running again)
  resumed   the rerun's ranks joined, built the Guard and loaded the checkpoint (`start` event)
  step      the rerun's first step after resume returned (rank 0)

    python benchmarks/recovery_time.py            # 5 repetitions
    python benchmarks/recovery_time.py --quick    # 2 repetitions
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import median, table, write_json

REPO = Path(__file__).resolve().parent.parent
EPILOG_SCRIPT = REPO / "epilog" / "slurm-guard-epilog.sh"
STEPS = 21  # the fault starts at 17, the replay at 20 catches it; the rerun resumes from 10
GOAL_RUNNING_S = 5.0
FIRST_STEP_FILE = "first-step-after-start.jsonl"

JOB_SCRIPT = """#!/bin/bash
RUN={run}
RC=${{SLURM_RESTART_COUNT:-0}}
[ "$RC" != 0 ] && date +%s.%N > "$RUN/running-$RC"
export SLURM_GUARD_MASTER_PORT=$(( {port} + RC ))
srun --kill-on-bad-exit=1 {python} {me} task --run-dir "$RUN" --steps {steps} --inject {inject}
rc=$?
date +%s.%N > "$RUN/end-$RC"
exit $rc
"""


# ----------------------------------------------------------------------------- in the job


def _process_start_time() -> float:
    """When this process was created, 10 ms resolution: its age (/proc/uptime minus its start
    ticks) subtracted from the clock now. Not /proc/stat's btime, which is whole seconds and put
    this mark up to a second off (a negative "batch script -> process created" interval)."""
    now = time.time()
    with open("/proc/uptime", encoding="utf-8") as f:
        uptime = float(f.read().split()[0])
    with open("/proc/self/stat", encoding="utf-8") as f:
        ticks = float(f.read().rsplit(")", 1)[1].split()[19])
    return now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def task(argv: list[str]) -> int:
    """Runs in each Slurm task: the example training, with rank 0 noting when it got where."""
    import torch.distributed as dist

    from slurm_guard.examples import train
    from slurm_guard.guard import Guard

    marks: dict[str, float] = {"process": _process_start_time(), "imported": time.time()}
    original_step, original_init = Guard.step, train._init_process_group

    def init() -> None:
        original_init()
        marks["joined"] = time.time()

    def step(self: Guard, batch: Any) -> float:
        loss = original_step(self, batch)
        if "step" not in marks and dist.get_rank() == 0:
            marks["step"] = time.time()
            line = {"rc": self.restart_count, "first_step": self.step_count - 1, **marks}
            with open(Path(self.run_dir.root) / FIRST_STEP_FILE, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
        return loss

    Guard.step = step  # type: ignore[method-assign]
    train._init_process_group = init
    return train.main(argv)


# ----------------------------------------------------------------------------- the benchmark


def _read_time(path: Path) -> float:
    return float(path.read_text().strip())


def one_repetition(
    cluster: Any, client: Any, work: Path, rep: int, port: int, timeout: float
) -> dict[str, Any]:
    from slurm_guard.controller import Engine, Policy, StateStore
    from slurm_guard.drill.slurm import usable_node
    from slurm_guard.drill.stages import FAULT_SPEC
    from slurm_guard.examples.train import read_events, read_result
    from slurm_guard.slurm.polling import poll

    rep_dir = work / f"rep{rep}"
    run, state = rep_dir / "run", rep_dir / "state"
    run.mkdir(parents=True)
    defaults = rep_dir / "defaults"
    entry = Path(sys.prefix) / "bin" / "slurm-guard"
    defaults.write_text(
        f"SLURM_GUARD={shlex.quote(str(entry))}\n"
        f"SLURM_GUARD_STATE_DIR={shlex.quote(str(state))}\n"
        f"SLURM_GUARD_LOG={shlex.quote(str(rep_dir / 'epilog.log'))}\n"
    )
    # a fresh state dir per repetition: the circuit breaker allows 3 drains per window
    cluster.write_epilog(["env", f"SLURM_GUARD_DEFAULTS={defaults}", "bash", str(EPILOG_SCRIPT)])
    script = rep_dir / "job.sh"
    script.write_text(
        JOB_SCRIPT.format(
            run=shlex.quote(str(run)),
            port=port,
            python=shlex.quote(sys.executable),
            me=shlex.quote(str(Path(__file__).resolve())),
            steps=STEPS,
            inject=shlex.quote(FAULT_SPEC),
        )
    )
    job_id = client.submit(
        script,
        [
            "--requeue",
            "--nodes=3",
            "--ntasks-per-node=1",
            f"--output={rep_dir}/slurm-%j.out",
            f"--comment=slurm-guard:run_dir={run}",
        ],
    )

    def finished() -> dict[str, Any] | None:
        return read_result(run)

    def failed_early() -> None:
        info = client.job(job_id)
        if info is not None and info.state in ("FAILED", "CANCELLED") and info.restart_count >= 1:
            raise RuntimeError(f"job {job_id} ended {info.state}; see {rep_dir}")

    def done_or_fail() -> dict[str, Any] | None:
        failed_early()
        return finished()

    result = poll(done_or_fail, timeout, f"job {job_id} to resume and finish", interval=0.1)
    events = read_events(run)
    stop = next(e for e in events if e["event"] == "alarm")
    resumed = next(e for e in events if e["event"] == "start" and e["restart_count"] >= 1)
    first_steps = [
        json.loads(line) for line in (run / FIRST_STEP_FILE).read_text().splitlines() if line
    ]
    first_step = next(s for s in first_steps if s["rc"] >= 1)
    end = _read_time(run / "end-0")
    running = _read_time(run / "running-1")
    info = client.job(job_id)
    problems = []
    if result["resumed_from"] != 10:
        problems.append(f"resumed from {result['resumed_from']}, expected 10")
    if "node2" in result["nodes"]:
        problems.append(f"rerun on {result['nodes']}")
    if info is None or "node2" not in info.excluded_nodes:
        problems.append("node2 not excluded")
    if problems:
        raise RuntimeError(f"job {job_id}: " + "; ".join(problems) + f"; see {rep_dir}")
    # let the rerun end (process group teardown) before the next repetition starts
    poll(
        lambda: (i := client.job(job_id)) is None or i.state not in ("RUNNING", "COMPLETING"),
        30,
        f"job {job_id} to end",
        interval=0.1,
    )
    # return node2 to service for the next repetition, as an admin would after diagnostics
    engine = Engine(client, StateStore(state), Policy())
    engine.return_node("node2", "recovery benchmark: the fault was injected", "benchmark")
    poll(
        lambda: sum(map(usable_node, client.nodes())) >= 4 or None,
        30,
        "4 usable nodes",
        interval=0.1,
    )
    return {
        "job_id": job_id,
        "nodes_rerun": result["nodes"],
        "running_to_process_s": first_step["process"] - running,
        "process_to_imported_s": first_step["imported"] - first_step["process"],
        "imported_to_joined_s": first_step["joined"] - first_step["imported"],
        "joined_to_resumed_s": float(resumed["time"]) - first_step["joined"],
        "resumed_to_first_step_s": first_step["step"] - float(resumed["time"]),
        "stop_to_end_s": end - float(stop["time"]),
        "end_to_running_s": running - end,
        "end_to_resumed_s": float(resumed["time"]) - end,
        "end_to_first_step_s": first_step["step"] - end,
        "running_to_first_step_s": first_step["step"] - running,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repetitions")
    parser.add_argument("--repeat", type=int, default=None, help="repetitions (default 5)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per repetition")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--json", default=None, help="output path (default benchmarks/results/)")
    args = parser.parse_args()
    repeat = args.repeat or (2 if args.quick else 5)

    from support.local_cluster import LocalCluster, find_free_port_base, missing_binaries

    from slurm_guard.local.launch import free_port
    from slurm_guard.slurm.client import CommandSlurmClient

    missing = missing_binaries(accounting=False)
    if missing:
        sys.exit(f"Slurm is not installed (missing {', '.join(missing)}); see SLURM-LOCAL.md")
    # short path: Unix socket paths must stay under 108 bytes
    work = Path(tempfile.mkdtemp(prefix="sg-rec-", dir="/tmp"))
    cluster = LocalCluster(
        work / "c", nodes=4, port_base=find_free_port_base(4, accounting=False), accounting=False
    )
    reps: list[dict[str, Any]] = []
    began = time.monotonic()
    try:
        cluster.start()
        client = CommandSlurmClient(env=cluster.env())
        os.environ.update(cluster.env())  # the job inherits SLURM_CONF from the submitter
        for rep in range(repeat):
            # rendezvous ports: first run port, rerun port + 1; both free now
            port = free_port()
            reps.append(one_repetition(cluster, client, work, rep, port, args.timeout))
            r = reps[-1]
            print(
                f"rep {rep + 1}/{repeat} (job {r['job_id']}): running again "
                f"{r['end_to_running_s']:.2f} s, first step {r['end_to_first_step_s']:.2f} s "
                "after the end of the failed run",
                file=sys.stderr,
            )
    finally:
        cluster.write_epilog(None)
        cluster.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    keys = {
        "guard stop -> failed run ended": "stop_to_end_s",
        "failed run ended -> requeued job running": "end_to_running_s",
        "failed run ended -> training resumed (checkpoint loaded)": "end_to_resumed_s",
        "failed run ended -> first step after resume": "end_to_first_step_s",
        "requeued job running -> first step": "running_to_first_step_s",
        "  of which: batch script -> rank 0 process created (srun)": "running_to_process_s",
        "  process created -> torch + slurm_guard imported": "process_to_imported_s",
        "  imported -> process group joined (rendezvous)": "imported_to_joined_s",
        "  joined -> Guard built, checkpoint loaded and verified": "joined_to_resumed_s",
        "  resumed -> first step done (incl. bucket settling)": "resumed_to_first_step_s",
    }
    rows = []
    summary: dict[str, dict[str, float]] = {}
    for label, key in keys.items():
        values = [r[key] for r in reps]
        summary[key] = {"median": median(values), "min": min(values), "max": max(values)}
        rows.append([label, summary[key]["median"], summary[key]["min"], summary[key]["max"]])
    goal = summary["end_to_running_s"]["median"] < GOAL_RUNNING_S
    print(
        f"\nRecovery on a local Slurm cluster (4 nodes, EpilogSlurmctld controller), 3-node "
        f"guarded job, {repeat} repetitions, seconds\n"
    )
    print(table(["interval", "median (s)", "min (s)", "max (s)"], rows))
    print(
        f"\ngoal: running again < {GOAL_RUNNING_S:.0f} s after the failed run ended: "
        f"{'met' if goal else 'missed'} (median {summary['end_to_running_s']['median']:.2f} s, "
        f"max {summary['end_to_running_s']['max']:.2f} s)"
    )
    print(f"done in {time.monotonic() - began:.0f} s")
    path = write_json(
        "recovery_time",
        {
            "repetitions": repeat,
            "steps": STEPS,
            "summary": summary,
            "goal_running_lt_5s": goal,
            "runs": reps,
        },
        args.json,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "task":
        sys.exit(task(sys.argv[2:]))
    main()
