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

from slurm_guard.drill.local import run_local_drill
from slurm_guard.drill.slurm import SlurmDrillOptions, run_slurm_drill
from slurm_guard.drill.stages import DrillError, DrillReport, Stage
from slurm_guard.slurm.polling import poll

__all__ = [
    "DrillError",
    "DrillReport",
    "SlurmDrillOptions",
    "Stage",
    "poll",
    "run_local_drill",
    "run_slurm_drill",
]
