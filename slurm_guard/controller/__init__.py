"""The controller: turns a finished job's alarms into drains and requeues, safely and once.

Modules: `policy` decides (pure), `intake` reads untrusted run-dir files, `state` keeps the
journal and the lock, `engine` is the decision loop, `actions` (one handler per operation) and
`admin` (approve/return/retire) the only code that changes the cluster, `report` what
callers get back, `watch` the long-running scanner, `views` what `status` and `review` print.

Code outside the controller (the drill, scripts) uses `open_engine` / `handle_job` and the
reports, not the journal or the lock directly. A dry run is `dry_run=True`, or a
`slurm_guard.slurm.dry_run.DryRunSlurm` holding the facts where there is no cluster.
"""

from slurm_guard.controller.engine import Engine, handle_job, open_engine
from slurm_guard.controller.policy import Outcome, Policy, PolicyError
from slurm_guard.controller.report import EngineError, JobReport, RetryLater, summarize
from slurm_guard.controller.state import StateError, StateStore
from slurm_guard.protocol import DEFAULT_STATE_DIR, REASON_PREFIX

__all__ = [
    "DEFAULT_STATE_DIR",
    "REASON_PREFIX",
    "Engine",
    "EngineError",
    "JobReport",
    "Outcome",
    "Policy",
    "PolicyError",
    "RetryLater",
    "StateError",
    "StateStore",
    "handle_job",
    "open_engine",
    "summarize",
]
