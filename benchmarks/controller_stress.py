"""The controller under stress on a real local Slurm cluster: a burst of job ends, crashes,
a slurmctld restart, and two controllers seeing the same alarms.

Starts its own 4-node LocalCluster (free port range, no accounting; stopped at the end) with
the project's `epilog/slurm-guard-epilog.sh` as EpilogSlurmctld, and a `slurm-guard controller
--watch` beside it, both on one state dir with a circuit breaker (`max_drains`, default 3).

N one-CPU jobs (`--requeue`, comment `slurm-guard:run_dir=<own run dir>`) start, wait on a shared
flock, and are released at once; each ends 0-3 s later. Kinds (the job writes its alarm, naming
`$SLURMD_NODENAME`, and exits 86; a rerun exits 0 at once):

  sdc        sdc verdict on its own node       -> act (drain + requeue) or breaker-held
  ambiguous  ambiguous verdict on its own node -> hold (requeue-held, nothing drained)
  numerical  numerical verdict                 -> no action
  outside    sdc naming a node NOT in its job  -> rejected
  late       exits 86 without an alarm; the benchmark writes an ambiguous alarm after the
             job's epilog has looked: only the watcher can find it -> hold
  clean      exits 0, no alarm

Faults injected while the controllers act (through an `scontrol` shim on the controllers' PATH;
the shim runs the real command first, so Slurm has done the action but the journal has only the
intent -- the hardest crash for a rerun to finish):
  * the first controller process (epilog or watcher) to drain a node is SIGKILLed right after
    the drain (its intent is in the journal, its result is not);
  * the watcher is SIGKILLed right after its first cluster-changing command, and restarted;
  * slurmctld is stopped (SIGTERM) once a third of the in-job alarms are decided, kept down
    for `--outage` seconds, and started again with the same slurm.conf and state.

Then, from the journal and from Slurm: every alarm decided exactly once and as its kind expects
(nothing lost), every action with exactly one result, every plan finished, no job requeued twice
(restart count), the held jobs still held, the circuit breaker held (drains in the journal and
nodes drained in Slurm <= max_drains), elapsed time and per-job decision latency. Drained nodes
are returned with `slurm-guard review return`, and the cluster is stopped.

    python benchmarks/controller_stress.py            # 100 jobs, ~70 s on 2 cores
    python benchmarks/controller_stress.py --quick    # 40 jobs, ~45 s
    python benchmarks/controller_stress.py --repro-completing   # bug reproducer, ~20 s
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this working tree's slurm_guard, also for the epilog wrapper

from _common import table, write_json  # noqa: E402

from slurm_guard.controller import Policy, StateStore  # noqa: E402
from slurm_guard.rundir.records import Alarm  # noqa: E402
from slurm_guard.slurm.client import SlurmUnavailable  # noqa: E402

EPILOG_SCRIPT = REPO / "epilog" / "slurm-guard-epilog.sh"
NODES = 4
FINISHED = {"FAILED", "COMPLETED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED"}
EXPECTED = {
    "sdc": {"act", "await_approval"},
    "ambiguous": {"hold"},
    "numerical": {"no_action"},
    "outside": {"rejected"},
    "late": {"hold"},
}
IN_JOB_KINDS = ("sdc", "ambiguous", "numerical", "outside")

JOB_SCRIPT = r"""#!/bin/bash
RUN=$1; KIND=$2; GO=$3; TPL=$4
NODE=${SLURMD_NODENAME:-$SLURM_JOB_NODELIST}
if [ "${SLURM_RESTART_COUNT:-0}" != 0 ]; then
    echo "$NODE $(date +%s.%N)" > "$RUN/rerun-$SLURM_RESTART_COUNT"
    exit 0
fi
echo "$NODE" > "$RUN/node"
flock -s "$GO" true                       # every job waits here until the benchmark lets go
sleep "$((RANDOM % 3)).$((RANDOM % 10))"  # end within 0-3 s of each other
case "$KIND" in
    clean) date +%s.%N > "$RUN/end"; exit 0 ;;
    late) date +%s.%N > "$RUN/end"; exit 86 ;;
    outside) if [ "$NODE" = node1 ]; then NAMED=node2; else NAMED=node1; fi ;;
    *) NAMED=$NODE ;;
esac
sed -e "s/__JOB__/$SLURM_JOB_ID/g" -e "s/__NODE__/$NAMED/g" "$TPL" > "$RUN/alarms/.tmp"
mv "$RUN/alarms/.tmp" "$RUN/alarms/a-$SLURM_JOB_ID.json"
date +%s.%N > "$RUN/end"
exit 86
"""

# Runs every controller process (epilog and watcher): this tree's slurm_guard, the shim first.
WRAPPER = """#!/bin/sh
export PYTHONPATH={repo}
export PATH={shim}:$PATH
{python} -c 'from slurm_guard.cli import main; main()' "$@"
rc=$?
echo "sg-bench: $1 end job=${{SLURM_JOB_ID:-?}} rc=$rc t=$(date +%s.%N)"
exit $rc
"""

# scontrol shim: one-shot SIGKILL of the calling controller right after a cluster change.
SHIM = r"""#!/bin/bash
REAL={real}
CRASH={crash}
PARENT=$(tr '\0' ' ' < /proc/$PPID/cmdline 2>/dev/null)
victim=""
case "$*" in
    *State=DRAIN*)
        mkdir "$CRASH/first-drain" 2>/dev/null && victim=first-drain ;;
esac
if [ -z "$victim" ] && [ ! -e "$CRASH/watcher-disarmed" ]; then
    case "$PARENT" in *" controller "*)
        case "$*" in update*|requeuehold*|release*)
            mkdir "$CRASH/watcher" 2>/dev/null && victim=watcher ;;
        esac ;;
    esac
fi
"$REAL" "$@"
rc=$?
if [ -n "$victim" ]; then
    printf '%s\n' "$(date +%s.%N)" "$*" "$PPID" "$PARENT" > "$CRASH/$victim/info"
    kill -KILL "$PPID"
fi
exit $rc
"""


def alarm_template(kind: str) -> str:
    verdict = {"sdc": "sdc", "outside": "sdc", "ambiguous": "ambiguous", "numerical": "numerical"}
    alarm = Alarm(
        alarm_id="a-__JOB__",
        job_id="__JOB__",
        restart_count=0,
        step=340,
        check="replay",
        verdict=verdict.get(kind, "ambiguous"),
        suspect_ranks=(0,),
        suspect_nodes=("__NODE__",),
        suspect_hosts=("localhost",),
        last_verified_step=330,
        trusted_checkpoint=None,
        update_applied=False,
        evidence={"loss_owner": 2.25, "loss_replay": 2.5},
        message=f"controller stress benchmark: {kind}",
        world_size=1,
    )
    return json.dumps(alarm.to_json())


def job_kinds(n: int) -> list[str]:
    """About 25% of the jobs raise an alarm, spread over the submission order."""
    scale = n / 100
    counts = {
        "sdc": max(4, round(12 * scale)),
        "ambiguous": max(2, round(4 * scale)),
        "numerical": max(1, round(3 * scale)),
        "outside": max(1, round(3 * scale)),
        "late": max(2, round(3 * scale)),
    }
    kinds = [k for k, c in counts.items() for _ in range(c)]
    kinds += ["clean"] * (n - len(kinds))
    step = n / len([k for k in kinds if k != "clean"])
    ordered = ["clean"] * n
    special = [k for k in kinds if k != "clean"]
    for i, k in enumerate(special):
        ordered[min(n - 1, int(i * step))] = k
    return ordered


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        from support.local_cluster import LocalCluster, find_free_port_base

        self.args = args
        self.work = work
        self.n = args.jobs
        self.cluster = LocalCluster(
            work / "c",
            nodes=NODES,
            port_base=find_free_port_base(NODES, accounting=False),
            accounting=False,
            cpus_per_node=self.n // NODES + 2,  # every job runs at once
        )
        self.state = work / "state"
        self.runs = work / "runs"
        self.shim = work / "shim"
        self.crash = work / "crash"
        self.wrapper = work / "slurm-guard"
        self.epilog_log = work / "epilog.log"
        self.watcher_log = work / "watcher.log"
        self.watcher: subprocess.Popen[bytes] | None = None
        self.watcher_starts: list[float] = []
        self.watcher_exits: list[tuple[float, int]] = []
        self.events: dict[str, float] = {}
        self.jobs: dict[str, dict[str, Any]] = {}  # job id -> kind, run dir

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        for d in (self.state, self.runs, self.shim, self.crash):
            d.mkdir(parents=True)
        Policy(max_drains=self.args.max_drains, window_s=3600.0).save(self.state)
        real = shutil.which("scontrol")
        if real is None:
            sys.exit("scontrol not found")
        (self.shim / "scontrol").write_text(
            SHIM.format(real=shlex.quote(real), crash=shlex.quote(str(self.crash)))
        )
        self.wrapper.write_text(
            WRAPPER.format(
                repo=shlex.quote(str(REPO)),
                shim=shlex.quote(str(self.shim)),
                python=shlex.quote(sys.executable),
            )
        )
        for p in (self.shim / "scontrol", self.wrapper):
            p.chmod(0o755)
        defaults = self.work / "defaults"
        defaults.write_text(
            f"SLURM_GUARD={shlex.quote(str(self.wrapper))}\n"
            f"SLURM_GUARD_STATE_DIR={shlex.quote(str(self.state))}\n"
            f"SLURM_GUARD_LOG={shlex.quote(str(self.epilog_log))}\n"
        )
        self.cluster.epilog_command = (
            "env",
            f"SLURM_GUARD_DEFAULTS={defaults}",
            "bash",
            str(EPILOG_SCRIPT),
        )
        t = time.monotonic()
        self.cluster.start()
        self.events["cluster_start_s"] = time.monotonic() - t
        from slurm_guard.slurm.client import CommandSlurmClient

        self.client = CommandSlurmClient(env=self.cluster.env())
        self.store = StateStore(self.state)

    def start_watcher(self) -> None:
        env = {**os.environ, **self.cluster.env()}
        env["PATH"] = f"{self.shim}:{env['PATH']}"
        env["PYTHONPATH"] = str(REPO)
        with open(self.watcher_log, "ab") as out:
            self.watcher = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from slurm_guard.cli import main; main()",
                    "controller",
                    "--watch",
                    "--interval",
                    str(self.args.interval),
                    "--runs-root",
                    str(self.runs),
                    "--state-dir",
                    str(self.state),
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.watcher_starts.append(time.time())

    def check_watcher(self) -> None:
        """Restart the watcher if it died (the SIGKILL injected by the shim)."""
        if self.watcher is not None and self.watcher.poll() is not None:
            self.watcher_exits.append((time.time(), self.watcher.returncode))
            self.start_watcher()

    def stop_watcher(self) -> None:
        if self.watcher is not None and self.watcher.poll() is None:
            self.watcher.terminate()
            try:
                self.watcher.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.watcher.kill()
                self.watcher.wait()

    # ------------------------------------------------------------------ slurmctld restart

    def restart_slurmctld(self) -> None:
        from support.local_cluster import _pid_alive, _poll

        c = self.cluster
        pids = c._state_pids()
        pid = pids["slurmctld"]
        self.events["slurmctld_stop"] = time.time()
        os.kill(pid, signal.SIGTERM)
        if not _poll(lambda: not _pid_alive(pid), 30):
            os.kill(pid, signal.SIGKILL)
            _poll(lambda: not _pid_alive(pid), 10)
        self.events["slurmctld_down"] = time.time()
        time.sleep(self.args.outage)
        # same slurm.conf and StateSaveLocation: jobs and node states are recovered
        c._run_forking(["slurmctld", "-f", str(c.conf_path)], "slurmctld.out", "slurmctld")
        pid_file = c.root / "run" / "slurmctld.pid"
        _poll(lambda: c._read_pid(pid_file) not in (None, pid), 30)
        pids["slurmctld"] = c._wait_pid_file(pid_file, "slurmctld", c.log_dir / "x", 30)
        c._save_state(pids)
        self.events["slurmctld_start"] = time.time()
        ok = _poll(lambda: self._ping(), 30, interval=0.2)
        self.events["slurmctld_up"] = time.time()
        if not ok:
            raise RuntimeError("slurmctld did not come back")

    def _ping(self) -> bool:
        r = subprocess.run(
            ["scontrol", "ping"],
            env={**os.environ, **self.cluster.env()},
            capture_output=True,
            text=True,
            check=False,
        )
        return "UP" in r.stdout

    # ------------------------------------------------------------------ the run

    def submit_all(self) -> None:
        script = self.work / "job.sh"
        script.write_text(JOB_SCRIPT)
        go = self.work / "go"
        go.touch()
        self.go_fd = os.open(go, os.O_RDWR)
        fcntl.flock(self.go_fd, fcntl.LOCK_EX)
        tpl = self.work / "templates"
        tpl.mkdir()
        for kind in (*IN_JOB_KINDS, "late"):
            (tpl / f"{kind}.json").write_text(alarm_template(kind) + "\n")
        t = time.monotonic()
        for i, kind in enumerate(job_kinds(self.n)):
            run = self.runs / f"r{i:03d}"
            (run / "alarms").mkdir(parents=True)
            argv = [
                "sbatch",
                "--parsable",
                "--requeue",
                "--ntasks=1",
                "--output=/dev/null",
                f"--comment=slurm-guard:run_dir={run}",
                str(script),
                str(run),
                kind,
                str(go),
                str(tpl / f"{kind}.json"),
            ]
            job_id = self.client.run(argv, timeout=60).stdout.strip().split(";")[0]
            self.jobs[job_id] = {"kind": kind, "run": run}
        self.events["submit_s"] = time.monotonic() - t

    def wait_all_waiting(self) -> None:
        t = time.monotonic()
        deadline = t + self.args.timeout
        while time.monotonic() < deadline:
            self.check_watcher()
            if all((j["run"] / "node").exists() for j in self.jobs.values()):
                self.events["all_running_s"] = time.monotonic() - t
                return
            time.sleep(0.5)
        missing = [k for k, j in self.jobs.items() if not (j["run"] / "node").exists()]
        raise RuntimeError(f"jobs {missing[:10]} never started")

    def alarm_ids(self) -> dict[str, str]:
        """alarm id -> job id of every alarm the run has produced so far."""
        out = {}
        for job_id, j in self.jobs.items():
            if (j["run"] / "alarms" / f"a-{job_id}.json").exists():
                out[f"a-{job_id}"] = job_id
        return out

    def write_late_alarm(self, job_id: str) -> None:
        j = self.jobs[job_id]
        node = (j["run"] / "node").read_text().strip()
        text = alarm_template("late").replace("__JOB__", job_id).replace("__NODE__", node)
        tmp = j["run"] / "alarms" / ".tmp"
        tmp.write_text(text + "\n")
        tmp.rename(j["run"] / "alarms" / f"a-{job_id}.json")
        j["late_written"] = time.time()

    def settled(self) -> tuple[bool, str]:
        if any(j["kind"] == "late" and "late_written" not in j for j in self.jobs.values()):
            return False, "late alarms not written yet"
        journal = self.store.read()
        undecided = set(self.alarm_ids()) - set(journal.alarms)
        if undecided:
            return False, f"{len(undecided)} alarms undecided"
        if journal.unfinished_plans():
            return False, f"{len(journal.unfinished_plans())} plans unfinished"
        if self.store.pending():
            return False, f"{len(self.store.pending())} jobs pending"
        for job_id, j in self.jobs.items():
            e = journal.alarms.get(f"a-{job_id}")
            if e is not None and e["outcome"] == "act" and not (j["run"] / "rerun-1").exists():
                return False, f"job {job_id} not rerun yet"
        return True, ""

    def run(self) -> None:
        self.setup()
        self.start_watcher()
        self.submit_all()
        print(f"submitted {self.n} jobs in {self.events['submit_s']:.1f} s", file=sys.stderr)
        self.wait_all_waiting()
        print(f"all waiting after {self.events['all_running_s']:.1f} s; go", file=sys.stderr)
        self.events["go"] = time.time()
        fcntl.flock(self.go_fd, fcntl.LOCK_UN)
        os.close(self.go_fd)
        in_job = sum(1 for j in self.jobs.values() if j["kind"] in IN_JOB_KINDS)
        restart_after = max(1, in_job // 3)
        restarted = False
        deadline = time.monotonic() + self.args.timeout
        why = ""
        while time.monotonic() < deadline:
            self.check_watcher()
            journal = self.store.read()
            if not restarted and len(journal.alarms) >= restart_after:
                self.events["restart_after_decisions"] = len(journal.alarms)
                print(
                    f"{len(journal.alarms)} alarms decided: restarting slurmctld",
                    file=sys.stderr,
                )
                self.restart_slurmctld()
                restarted = True
                continue
            for job_id, j in self.jobs.items():
                if j["kind"] != "late" or "late_written" in j or not (j["run"] / "end").exists():
                    continue
                # once the job's EpilogSlurmctld is over (COMPLETING -> FAILED): only the
                # watcher can see this alarm
                try:
                    info = self.client.job(job_id)
                except SlurmUnavailable:
                    continue
                if info is not None and info.state in FINISHED:
                    self.write_late_alarm(job_id)
            ok, why = self.settled()
            if ok and restarted:
                self.events["settled"] = time.time()
                break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"not settled after {self.args.timeout:.0f} s: {why}")
        # one more watcher pass and a second of quiet: nothing may act again
        time.sleep(max(2.0, 2 * self.args.interval))
        self.check_watcher()
        self.stop_watcher()

    # ------------------------------------------------------------------ checks

    def verify(self) -> dict[str, Any]:
        journal = self.store.read()
        entries = journal.entries
        problems: list[str] = []
        alarm_entries = Counter(e["alarm_id"] for e in entries if e["type"] == "alarm")
        results = Counter(e["key"] for e in entries if e["type"] in ("done", "skipped", "failed"))
        intents = Counter(e["key"] for e in entries if e["type"] == "intent")
        alarms = self.alarm_ids()

        # every alarm decided exactly once, as its kind expects
        outcomes: Counter[str] = Counter()
        for alarm_id, job_id in alarms.items():
            kind = self.jobs[job_id]["kind"]
            n = alarm_entries.get(alarm_id, 0)
            if n != 1:
                problems.append(f"alarm {alarm_id} ({kind}) decided {n} times")
                continue
            outcome = journal.alarms[alarm_id]["outcome"]
            outcomes[f"{kind}: {outcome}"] += 1
            if outcome not in EXPECTED[kind]:
                problems.append(f"alarm {alarm_id} ({kind}): {outcome}, expected {EXPECTED[kind]}")
            reason = journal.alarms[alarm_id]["reason"]
            if outcome == "await_approval" and "circuit breaker" not in reason:
                problems.append(f"alarm {alarm_id}: await_approval but not the breaker: {reason}")
        for job_id, j in self.jobs.items():
            if j["kind"] != "clean" and f"a-{job_id}" not in alarms:
                problems.append(f"job {job_id} ({j['kind']}) has no alarm file")

        # every action exactly one result, every plan finished
        plans = list(journal.plans.values())
        for plan in plans:
            for a in plan.actions:
                if results.get(a.key, 0) != 1:
                    problems.append(f"action {a.key}: {results.get(a.key, 0)} results")
        failed = [e for e in entries if e["type"] == "failed"]
        for e in failed:
            problems.append(f"action {e['key']} failed: {e.get('detail')}")
        plans_per_job = Counter(p.job_id for p in plans)
        for job_id, n in plans_per_job.items():
            if n != 1:
                problems.append(f"job {job_id} has {n} plans")
        re_intents = sorted(k for k, n in intents.items() if n > 1)
        drain_results = [
            e for e in entries if e["type"] in ("done", "skipped") and e.get("op") == "drain"
        ]
        drained_journal = sorted({e["target"] for e in drain_results if e["type"] == "done"})
        drains_done = sum(1 for e in drain_results if e["type"] == "done")
        if drains_done > self.args.max_drains:
            problems.append(
                f"circuit breaker: {drains_done} drains done in the journal, "
                f"limit {self.args.max_drains}"
            )

        # Slurm: drained nodes, restart counts, held jobs, reruns away from the drained node
        nodes = {n.name: n for n in self.client.nodes()}
        drained_slurm = sorted(
            name for name, n in nodes.items() if (n.reason or "").startswith("slurm-guard:")
        )
        if len(drained_slurm) > self.args.max_drains:
            problems.append(f"circuit breaker: {len(drained_slurm)} nodes drained in Slurm")
        if drained_slurm != drained_journal:
            problems.append(f"drained in Slurm {drained_slurm} != journal {drained_journal}")
        restarts: Counter[str] = Counter()
        for job_id, j in self.jobs.items():
            info = self.client.job(job_id)
            if info is None:
                problems.append(f"job {job_id} forgotten by Slurm before the check")
                continue
            e = journal.alarms.get(f"a-{job_id}")
            outcome = e["outcome"] if e else "none"
            want = 1 if outcome in ("act", "hold") else 0
            restarts[f"{outcome}: restart {info.restart_count}"] += 1
            if info.restart_count != want:
                problems.append(
                    f"job {job_id} ({j['kind']}, {outcome}): restart count "
                    f"{info.restart_count}, expected {want}"
                )
            if outcome == "hold" and not (info.held and info.state == "PENDING"):
                problems.append(f"job {job_id} held by the controller is {info.state}")
            if outcome == "act":
                node = (j["run"] / "node").read_text().strip()
                rerun = (j["run"] / "rerun-1").read_text().split()[0]
                if rerun == node or node not in info.excluded_nodes:
                    problems.append(f"job {job_id}: rerun on {rerun}, first run on {node}")
            if (j["run"] / "rerun-2").exists():
                problems.append(f"job {job_id} ran a third time")

        # crashes and who decided what (the killed processes' reports never print)
        crashes = {}
        for victim in ("first-drain", "watcher"):
            info_file = self.crash / victim / "info"
            if info_file.exists():
                t, cmd, pid, parent = (info_file.read_text().splitlines() + [""] * 4)[:4]
                crashes[victim] = {"time": float(t), "command": cmd, "pid": int(pid)}
                crashes[victim]["process"] = "watcher" if " controller " in parent else "epilog"
            else:
                crashes[victim] = None
        epilog_text = self.epilog_log.read_text(errors="replace")
        watcher_text = self.watcher_log.read_text(errors="replace")
        by: Counter[str] = Counter()
        for alarm_id in alarms:
            line = f"alarm {alarm_id}: "
            who = [w for w, t in (("epilog", epilog_text), ("watcher", watcher_text)) if line in t]
            by["+".join(who) or "killed process (no report)"] += 1
        epilog_runs = epilog_text.count("sg-bench: epilog end job=")
        started: dict[str, float] = {}
        durations: list[float] = []
        for ln in epilog_text.splitlines():
            if ln.startswith("20") and " job=" in ln and " restart=" in ln:
                stamp, rest = ln[:19], ln[20:]
                key = rest.split()[0] + rest.split()[1]
                started[key] = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S"))
            elif ln.startswith("sg-bench: epilog end job="):
                job = ln.split("job=")[1].split()[0]
                t_end = float(ln.split("t=")[1])
                cands = [v for k, v in started.items() if k.startswith(f"job={job}restart=")]
                if cands:
                    durations.append(t_end - max(c for c in cands if c <= t_end + 1))
        lock_timeouts = (epilog_text + watcher_text).count("held by another slurm-guard process")
        no_alloc = sorted(
            a
            for a in alarms
            if "no allocation any more" in journal.alarms.get(a, {}).get("reason", "")
        )
        epilog_rc = Counter(
            ln.split("rc=")[1].split()[0] for ln in epilog_text.splitlines() if "sg-bench:" in ln
        )

        # latency: job end (or late alarm written) -> decision; -> last action of its plan
        decision_lat: dict[str, list[float]] = {"epilog path": [], "late (watcher)": []}
        plan_lat: list[float] = []
        last_result = {e["key"]: float(e["time"]) for e in entries if e.get("key") in results}
        for alarm_id, job_id in alarms.items():
            j = self.jobs[job_id]
            if alarm_id not in journal.alarms:
                continue
            start = j.get("late_written") or float((j["run"] / "end").read_text())
            decided = float(journal.alarms[alarm_id]["time"])
            decision_lat["late (watcher)" if j["kind"] == "late" else "epilog path"].append(
                decided - start
            )
            for p in plans:
                if p.job_id == job_id:
                    plan_lat.append(max(last_result[a.key] for a in p.actions) - start)
        ends = [float((j["run"] / "end").read_text()) for j in self.jobs.values()]
        lat_rows = {
            k: {
                "n": len(v),
                "median": statistics.median(v) if v else float("nan"),
                "p95": pct(v, 0.95),
                "max": max(v) if v else float("nan"),
            }
            for k, v in {**decision_lat, "plan finished": plan_lat}.items()
        }
        ev = self.events
        return {
            "problems": problems,
            "jobs": self.n,
            "kinds": dict(Counter(j["kind"] for j in self.jobs.values())),
            "alarms": len(alarms),
            "outcomes": dict(sorted(outcomes.items())),
            "decided_by": dict(by),
            "slurm_restart_counts": dict(sorted(restarts.items())),
            "plans": len(plans),
            "actions": sum(len(p.actions) for p in plans),
            "results": dict(Counter(e["type"] for e in entries if e.get("key") in results)),
            "actions_with_repeated_intent": re_intents,
            "drains_done_journal": drains_done,
            "drain_results": [
                {"key": e["key"], "type": e["type"], "detail": e.get("detail")}
                for e in drain_results
            ],
            "drained_nodes_slurm": drained_slurm,
            "max_drains": self.args.max_drains,
            "crashes": crashes,
            "watcher_exits": self.watcher_exits,
            "epilog_runs_completed": epilog_runs,
            "epilog_exit_codes": dict(epilog_rc),
            "epilog_duration_s": {
                "median": statistics.median(durations) if durations else float("nan"),
                "max": max(durations) if durations else float("nan"),
            },
            "lock_timeouts_logged": lock_timeouts,
            "rejected_no_allocation": no_alloc,
            "ends_spread_s": max(ends) - min(ends),
            "slurmctld": {
                "stopped_after_s": ev["slurmctld_stop"] - ev["go"],
                "after_decisions": ev["restart_after_decisions"],
                "down_s": ev["slurmctld_start"] - ev["slurmctld_down"],
                "unreachable_s": ev["slurmctld_up"] - ev["slurmctld_stop"],
            },
            "elapsed": {
                "cluster_start_s": ev["cluster_start_s"],
                "submit_s": ev["submit_s"],
                "all_running_s": ev["all_running_s"],
                "go_to_last_end_s": max(ends) - ev["go"],
                "go_to_settled_s": ev["settled"] - ev["go"],
                "last_end_to_settled_s": ev["settled"] - max(ends),
            },
            "latency_s": lat_rows,
        }

    def return_nodes(self, nodes: list[str]) -> list[str]:
        """Return every node the run drained, as an admin would: `slurm-guard review return`."""
        out = []
        env = {**os.environ, **self.cluster.env(), "PYTHONPATH": str(REPO)}
        for node in nodes:
            r = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "from slurm_guard.cli import main; main()",
                    "review",
                    "--state-dir",
                    str(self.state),
                    "return",
                    node,
                    "--reason",
                    "controller stress benchmark: the alarm was synthetic",
                ],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            out.append(f"{node}: rc={r.returncode} {r.stdout.strip()} {r.stderr.strip()}")
        return out


def report(res: dict[str, Any]) -> None:
    lat = res["latency_s"]
    print(f"\nController under stress: {res['jobs']} jobs on a 4-node local Slurm cluster\n")
    rows = [
        ["jobs / alarms", f"{res['jobs']} / {res['alarms']}"],
        ["kinds", ", ".join(f"{k} {v}" for k, v in res["kinds"].items())],
        ["decisions (kind: outcome)", ", ".join(f"{k} {v}" for k, v in res["outcomes"].items())],
        [
            "decided by (from the reports)",
            ", ".join(f"{k} {v}" for k, v in res["decided_by"].items()),
        ],
        [
            "plans / actions / results",
            f"{res['plans']} / {res['actions']} / "
            + ", ".join(f"{k} {v}" for k, v in res["results"].items()),
        ],
        [
            "drains done (journal) / nodes drained (Slurm) / limit",
            f"{res['drains_done_journal']} / {len(res['drained_nodes_slurm'])} "
            f"{res['drained_nodes_slurm']} / {res['max_drains']}",
        ],
        [
            "SIGKILLed controllers",
            "; ".join(
                f"{k}: {v['process']} after `scontrol {v['command']}`" if v else f"{k}: not hit"
                for k, v in res["crashes"].items()
            ),
        ],
        ["actions finished after a crash (intent twice)", len(res["actions_with_repeated_intent"])],
        [
            "slurmctld restart",
            f"stopped {res['slurmctld']['stopped_after_s']:.1f} s after go "
            f"({res['slurmctld']['after_decisions']} decisions), unreachable "
            f"{res['slurmctld']['unreachable_s']:.1f} s",
        ],
        [
            "epilog runs completed / exit codes",
            f"{res['epilog_runs_completed']} / {res['epilog_exit_codes']}",
        ],
        [
            "epilog run time median / max (s, 1 s resolution)",
            f"{res['epilog_duration_s']['median']:.0f} / {res['epilog_duration_s']['max']:.0f}",
        ],
        ["lock timeouts (30 s) logged", res["lock_timeouts_logged"]],
        [
            "valid alarms rejected 'no allocation any more'",
            len(res["rejected_no_allocation"]),
        ],
        ["job ends spread over (s)", f"{res['ends_spread_s']:.1f}"],
        [
            "go -> every alarm decided, every plan done (s)",
            f"{res['elapsed']['go_to_settled_s']:.1f}",
        ],
        ["last job end -> settled (s)", f"{res['elapsed']['last_end_to_settled_s']:.1f}"],
        ["problems", len(res["problems"])],
    ]
    print(table(["figure", "value"], rows))
    print()
    print(
        table(
            ["latency (s)", "n", "median", "p95", "max"],
            [[k, v["n"], v["median"], v["p95"], v["max"]] for k, v in lat.items()],
        )
    )
    for p in res["problems"]:
        print(f"PROBLEM: {p}")


def repro_completing() -> int:
    """Reproducer: a valid sdc alarm, decided by the watcher while the job's EpilogSlurmctld
    still runs (job COMPLETING, `scontrol show job` lists no nodes), is rejected for good.

    The EpilogSlurmctld here is `sleep 8`, standing for a slurm-guard epilog that is slow or
    waits for the state lock (16-29 s per epilog in the 100-job run)."""
    from support.local_cluster import LocalCluster, _poll, find_free_port_base

    from slurm_guard.slurm.client import CommandSlurmClient

    work = Path(tempfile.mkdtemp(prefix="sg-rp-", dir="/tmp"))
    cluster = LocalCluster(
        work / "c",
        nodes=NODES,
        port_base=find_free_port_base(NODES, accounting=False),
        accounting=False,
        epilog_command=["sleep", "8"],
    )
    try:
        cluster.start()
        client = CommandSlurmClient(env=cluster.env())
        run, state = work / "runs" / "r0", work / "state"
        (run / "alarms").mkdir(parents=True)
        (work / "job.sh").write_text(JOB_SCRIPT)
        (work / "go").touch()
        (work / "sdc.json").write_text(alarm_template("sdc") + "\n")
        argv = ["sbatch", "--parsable", "--requeue", "--output=/dev/null"]
        argv += [f"--comment=slurm-guard:run_dir={run}", str(work / "job.sh"), str(run), "sdc"]
        argv += [str(work / "go"), str(work / "sdc.json")]
        job_id = client.run(argv, timeout=60).stdout.strip().split(";")[0]
        _poll(lambda: (i := client.job(job_id)) is not None and i.state == "COMPLETING", 30)
        info = client.job(job_id)
        node = (run / "node").read_text().strip()
        state_now = f"{info.state}, nodes {info.nodes}" if info else "?"
        print(f"job {job_id} ran on {node}; now {state_now}")
        env = {**os.environ, **cluster.env(), "PYTHONPATH": str(REPO)}
        cmd = [sys.executable, "-c", "from slurm_guard.cli import main; main()", "controller"]
        cmd += ["--runs-root", str(work / "runs"), "--state-dir", str(state)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        print("$ slurm-guard controller --runs-root RUNS --state-dir STATE\n" + out.stdout)
        entry = StateStore(state).read().alarms.get(f"a-{job_id}")
        outcome = entry["outcome"] if entry else "undecided"
        print(
            f"decision: {outcome}"
            + (" -- BUG: a valid alarm on the job's own node" if outcome == "rejected" else "")
        )
        return 1 if outcome == "rejected" else 0
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="40 jobs instead of 100")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--max-drains", type=int, default=3, help="circuit breaker limit")
    parser.add_argument("--interval", type=float, default=1.0, help="watcher scan interval")
    parser.add_argument("--outage", type=float, default=3.0, help="seconds slurmctld stays down")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per phase")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--json", default=None, help="output path (default benchmarks/results/)")
    parser.add_argument(
        "--repro-completing",
        action="store_true",
        help="only run the reproducer of the COMPLETING rejection (1 job, ~20 s)",
    )
    args = parser.parse_args()
    if args.repro_completing:
        sys.exit(repro_completing())
    args.jobs = args.jobs or (40 if args.quick else 100)

    from support.local_cluster import missing_binaries

    missing = missing_binaries(accounting=False)
    if missing or shutil.which("flock") is None:
        sys.exit(f"Slurm is not installed (missing {', '.join(missing) or 'flock'})")
    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="sg-st-", dir="/tmp"))  # short: socket paths
    bench = Bench(args, work)
    res: dict[str, Any] | None = None
    try:
        bench.run()
        res = bench.verify()
        res["returned"] = bench.return_nodes(res["drained_nodes_slurm"])
        left = [n.name for n in bench.client.nodes() if (n.reason or "").startswith("slurm-guard:")]
        if left:
            res["problems"].append(f"nodes still drained after review return: {left}")
    finally:
        bench.stop_watcher()
        bench.cluster.write_epilog(None)
        bench.cluster.stop()
        if args.keep or res is None or res["problems"]:
            print(f"work directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    res["wall_s"] = time.monotonic() - began
    report(res)
    print(f"\ndone in {res['wall_s']:.0f} s")
    path = write_json("controller_stress", res, args.json)
    print(f"wrote {path}")
    if res["problems"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
