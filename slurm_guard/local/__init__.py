"""Running a guarded job on one machine, each process posing as its own node.

For the drill, the tests, the benchmarks and a first try of the guard on a laptop: every rank
gets its own `SLURMD_NODENAME`, so the checks attribute a fault to a "node" as they would on a
cluster.
"""

from __future__ import annotations

from slurm_guard.local.launch import RankOutcome, free_port, run_local

__all__ = ["RankOutcome", "free_port", "run_local"]
