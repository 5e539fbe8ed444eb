"""The evidence about one node an admin decides on: its alarms over time and its diagnoses.

`review` shows it per drained node; `review return` refuses a node it speaks against unless
forced. The records themselves (diagnoses, golden results) are
`slurm_guard.diagnose.evidence`'s; this module joins them with the journal and the policy,
which only the controller knows.
"""

from __future__ import annotations

import time
from typing import Any

from slurm_guard.controller.policy import Policy, PolicyError
from slurm_guard.controller.state import Journal, StateStore
from slurm_guard.diagnose.evidence import latest_diagnosis
from slurm_guard.diagnose.history import (
    confirmed_since,
    diagnosis_summary,
    node_history,
    return_blockers,
)


def node_evidence(
    store: StateStore,
    node: str,
    *,
    journal: Journal | None = None,
    policy: Policy | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """`history` (alarms naming the node, across jobs, oldest first), `diagnosis` (the latest
    `slurm-guard diagnose`, or None), `confirmed_recent` (confirmed alarms in the policy's
    retire window) and `return_blockers` (why `review return` refuses it)."""
    journal = journal if journal is not None else store.read()
    if policy is None:
        try:
            policy = Policy.load(store.root)
        except PolicyError:  # `review` must still show the evidence; the engine reports this
            policy = Policy()
    now = time.time() if now is None else now
    history = node_history(list(journal.alarms.values()), journal.approvals, node)
    return {
        "history": history,
        "diagnosis": diagnosis_summary(latest_diagnosis(store.root, node)),
        "confirmed_recent": confirmed_since(history, now - policy.retire_days * 86400.0),
        "return_blockers": return_blockers(
            store.root,
            node,
            history,
            retire_after=policy.retire_after,
            retire_days=policy.retire_days,
            now=now,
        ),
    }
