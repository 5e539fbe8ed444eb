"""The named errors of the guard's collectives: what every rank raises when a round fails.

Each one is raised on every rank with the same text, so a job's logs agree on why it stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from slurm_guard.errors import GuardError

logger = logging.getLogger("slurm_guard.comm")

LISTED = 8  # ranks named in a message before "and N more"

LOGGED: set[str] = set()
"""Messages of this process's stops already logged, so that a stop is said once."""


def say_once(rank: int, error: GuardError) -> None:
    """Rank 0 logs a stop that every rank raises (once per message); the others say nothing:
    the hang watch's thread says it even while rank 0's own code is stuck elsewhere."""
    if rank == 0 and str(error) not in LOGGED:
        LOGGED.add(str(error))
        logger.error("stopped by slurm-guard: %s: %s", type(error).__name__, error)


class CollectiveError(GuardError):
    """A guard round could not complete on every rank; every rank that sees it stops."""


class RankFailed(CollectiveError):
    """A guard step failed on some rank; every rank raises this same error instead of hanging.

    Attributes:
        what: the guard step that failed ("checkpoint files", "resume: load checkpoint", ...).
        rank: the first failing rank (group rank); `ranks` lists all of them.
        node: the failing rank's node.
        cause: the failing rank's exception as text.
    """

    def __init__(self, what: str, ranks: Sequence[int], node: str, cause: str) -> None:
        self.what = what
        self.ranks = tuple(ranks)
        self.rank = self.ranks[0]
        self.node = node
        self.cause = cause
        more = f" (also on rank(s) {listed(self.ranks[1:])})" if len(self.ranks) > 1 else ""
        super().__init__(
            f"{what} failed on rank {self.rank} ({node}): {cause}{more}; every rank stopped "
            "here instead of waiting for it. See that rank's log for the full traceback."
        )


class RanksMissing(CollectiveError):
    """Some rank did not reach a guard round within `GuardConfig.watchdog_seconds`."""


class CollectiveMismatch(CollectiveError):
    """Ranks reached the same guard round through different guard calls."""


class DeviceCheckError(GuardError):
    """A tensor on the wrong device was about to be handed to a collective."""


def listed(ranks: Sequence[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:LISTED])
    return shown + (f" and {len(ranks) - LISTED} more" if len(ranks) > LISTED else "")
