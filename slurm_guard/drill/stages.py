"""What every drill shares: stages that print PASS/FAIL, checks, the work dir.

The drills wait with `slurm_guard.slurm.polling.poll` (re-exported as `slurm_guard.drill.poll`).
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_guard.errors import GuardError
from slurm_guard.rundir.records import read_ledger

Echo = Callable[[str], None]

LOCAL_JOB_ID = "1001"
CLEAN_JOB_ID = "1000"
FAULT_SPEC = "kind=grad-scale,node=@rank1,step=17,persistent=1,param=10"
"""A persistent wrong gradient on rank 1's node from step 17: between the replays at 15 and 20,
so the alarm comes at 20, the last verified step is 15 and the trusted checkpoint is step 10."""

SHARDED_FAULT_SPEC = "kind=grad-scale,node=@rank3,step=17,persistent=1,param=0"
"""The same schedule for the sharded drill (HSDP, 2 replica groups x 2 shards). `param` counts
the reduce-scatters of a backward (0: the first, the last block's). Rank 3 is the one alone on
its node when Slurm puts 4 tasks on 3 nodes (block layout: ranks 0 and 1 share the first), so
the fault is one GPU's and its node can be named."""


TP_FAULT_SPEC = "kind=grad-scale,node=@rank2,step=17,persistent=1,param=0"
"""The same schedule for the FSDP2 + TP drill (TP pairs, one per node): rank 2's node is node2,
both of whose ranks (one TP group, data-parallel index 1) then compute wrong gradients."""


def drill_fault(sharded: bool, tp: int = 1) -> tuple[str, int]:
    """The fault the drill injects and the rank whose node it is on (first start)."""
    if tp > 1:
        return TP_FAULT_SPEC, 2
    return (SHARDED_FAULT_SPEC, 3) if sharded else (FAULT_SPEC, 1)


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


class StageFailed(Exception):
    pass


class Recorder:
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
        except StageFailed as exc:
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
            raise StageFailed(name)


def check(condition: bool, message: str) -> None:
    """Fail the current stage with `message` unless `condition` holds."""
    if not condition:
        raise StageFailed(message)


def make_work_dir(work_dir: Path | None, prefix: str) -> Path:
    if work_dir is None:
        return Path(tempfile.mkdtemp(prefix=prefix)).resolve()
    work_dir = work_dir.resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    return work_dir


def short_digest(digest: str) -> str:
    return digest[:16]


PROGRESS_FIRST_S = 3.0
PROGRESS_EVERY_S = 10.0


@contextmanager
def progress(echo: Echo, what: str, run_dir: Path) -> Iterator[None]:
    """A line after 3 s, then every 10 s, while a run goes on, saying how far it got (the
    newest step the run's ledger verified since it began, or that it finished and its
    processes are exiting), so a long wait never looks like a hang."""
    stop = threading.Event()
    began, wall = time.monotonic(), time.time()

    def where() -> str:
        result = run_dir / "result.json"
        if result.exists() and result.stat().st_mtime >= wall:
            return "training finished; the processes are exiting"
        steps = [e.step for e in read_ledger(run_dir / "ledger.jsonl") if e.time >= wall]
        if steps:
            return f"verified up to step {max(steps)}"
        return "starting the processes (importing torch, joining the process group)"

    def tick() -> None:
        wait = PROGRESS_FIRST_S
        while not stop.wait(wait):
            echo(f"  ... {what}: {where()} ({time.monotonic() - began:.0f} s)")
            wait = PROGRESS_EVERY_S

    thread = threading.Thread(target=tick, name="drill-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def next_steps(run_dir: Path, state_dir: Path | None) -> str:
    """The drill's last line: what to look at in the directory it keeps (`state_dir`: the
    controller's, when a real one journaled the run; the local drill's dry run journals
    nothing)."""
    state = f" --state-dir {state_dir}" if state_dir is not None else ""
    return (
        f"next: slurm-guard status {run_dir}{state}   "
        f"slurm-guard report {run_dir} -o {run_dir}/report.html"
    )
