"""The controller: turns a finished job's alarms into drains and requeues, safely and once.

Modules: `policy` decides (pure), `intake` reads untrusted run-dir files, `state` keeps the
journal and the lock, `engine` is the only code that changes the cluster, `watch` is the
long-running scanner, `views` builds what `status` and `review` print.
"""

from slurm_guard.controller.policy import Outcome, Policy, PolicyError
from slurm_guard.controller.state import StateError, StateStore
from slurm_guard.protocol import DEFAULT_STATE_DIR, REASON_PREFIX

__all__ = [
    "DEFAULT_STATE_DIR",
    "REASON_PREFIX",
    "Outcome",
    "Policy",
    "PolicyError",
    "StateError",
    "StateStore",
]
