"""What the guard checks and how often: validated once, before training starts."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from slurm_guard.errors import GuardError

if TYPE_CHECKING:
    from slurm_guard.faults.injection import Fault


class ConfigError(GuardError, ValueError):
    """A configuration value is out of range; the message names the field and the fix."""


# the float settings, each checked to be a finite number
NUMBERS = (
    "tolerance_margin",
    "initial_tolerance",
    "watchdog_seconds",
    "abft_margin",
    "triage_seconds",
)


@dataclass(frozen=True)
class GuardConfig:
    """Guard settings.

    Args:
        replay_every: ring replay on every step with step % replay_every == 0. The cost is one
            extra forward+backward per rank every `replay_every` steps; a persistent fault is
            caught within that many steps.
        vote_every: weight-fingerprint vote after the update of every step with
            (step + 1) % vote_every == 0, and always before a checkpoint.
        finite_check: NaN/Inf check of local and averaged gradients in the DDP comm hook.
        seed: fingerprint seed; None draws one per run (kept in run.json across restarts).
        faults: software faults to inject (testing and drills); SLURM_GUARD_INJECT adds more.
        settle_buckets: run one discarded forward/backward before the first step so DDP's
            gradient buckets have their final layout from the first real step on (all-reduced
            even inside a framework's `no_sync()`). Needed for bit-exact resume; costs one
            extra forward/backward per process start.
        schedule: "fixed" replays every `replay_every`-th step; "random" replays each step with
            probability 1/replay_every, decided from the run's seed so every rank agrees. Same
            expected cost, but a one-off fault can no longer hide between predictable
            verification steps: each step is verified with probability 1/replay_every.
        deterministic: True compares replays bit for bit (loss bits and an exact gradient
            fingerprint): right on CPU and with deterministic GPU kernels. False compares the loss
            and a per-parameter gradient sketch within a tolerance calibrated from the run's own
            clean replays, for default (non-deterministic) GPU kernels.
        calibration_replays: with deterministic=False, the first this many verification steps
            calibrate the tolerance (checked against `initial_tolerance` meanwhile); after them
            the tolerance is `tolerance_margin` x the largest discrepancy they showed.
        trust_replays: after an alarm, resume only from a checkpoint that this many passing
            replays followed. 1 is the published rule (at or before the last passing replay);
            the default 2 also covers a fault that hides from one replay (e.g. when dropout
            zeroes the corrupted value in both computations), at the price of rolling back up to
            one more replay interval.
        on_numerical: what a reproducible NaN/Inf (a bad sample or an unstable model, not the
            hardware) does: "stop" raises SilentDataCorruption with verdict "numerical" (the
            controller drains nothing), "skip" skips that update and goes on.
        watchdog_seconds: how long a guard round (the start of each step, a verification's
            verdicts, save_checkpoint, resume) waits for every rank before it raises
            `RanksMissing` on the ranks that are there, naming the missing ones. Must exceed the
            longest legitimate gap between two ranks reaching a step (data loading skew, a slow
            checkpoint write). 0 turns the check off: a missing rank is then only caught by the
            backend's own timeout (init_process_group(timeout=...), NCCL's watchdog).
        abft: check every GEMM of every nn.Linear, HuggingFace Conv1D and attention projection
            on every step, forward and backward, with block checksums (`slurm_guard.abft`): a
            wrong value there is caught on the step it happens, on the rank that computed it,
            even on steps that are not replayed. Off by default (see docs/coverage.md for cost).
        abft_margin: the checks' threshold, lambda in lambda * sqrt(sum of squared rounding
            terms); a clean GEMM exceeds it with probability <= 2 exp(-lambda^2 / 2).
        abft_block: rows per checksum block. Smaller blocks detect smaller errors and cost a
            larger checksum GEMM (1/abft_block of the one checked). float16/bfloat16 products
            (autocast) use at most 32: there the bound grows as sqrt(block) (docs/coverage.md).
        triage_seconds: at an `sdc` alarm from a replay comparison or a checked GEMM, the
            suspect rank repeats the failing microbatch (up to 3 times) for at most this many
            seconds (and at most half of `watchdog_seconds`), a rank on another node once, and
            the alarm records how many repeats reproduced the wrong result (`evidence.triage`):
            persistent or transient. The other ranks wait meanwhile. 0 turns it off.
        fast_path_world: from this world size on, a step without replay is judged from two
            all-reduces of a few values (O(log W) latency on tree algorithms) instead of a
            gather of every rank's row (O(W) latency and O(W) Python per step, ~80 ms at 8,192
            ranks); the rows are gathered only when the fast path finds something, to attribute
            it. The vote likewise: one MAX all-reduce of the fingerprint's lanes and their
            complements shows whether every replica agrees, and only a disagreement gathers the
            fingerprints. Below it the gather is cheaper: on gloo at 2-8 ranks two tiny
            all-reduces cost more than one gather (benchmarks/README.md, Scaling). 1 always
            uses the fast path.
        max_grad_norm: clip the averaged gradients to this total 2-norm (as
            `torch.nn.utils.clip_grad_norm_`) after the checks passed and the GradScaler
            unscaled them, before the optimizer step; `guard.last_grad_norm` is the norm before
            clipping, a 0-dim tensor on the device. None: no clipping.
        snapshots: after every passing weight vote, copy the verified state (model, optimizer,
            RNG, `stateful`, scaler) to node-local memory, off the step's path; a restart on the
            same nodes resumes from the newest snapshot the resume rule allows instead of an
            older checkpoint (docs/user-guide.md, "Snapshots"). Costs host memory: two copies
            of the model and optimizer per node. Off by default.
        snapshot_dir: where snapshots live; None: $SLURM_GUARD_SNAPSHOT_DIR, else
            /dev/shm/slurm-guard-{uid}. Node-local memory or disk, never the shared filesystem.
            It must be the user's own (made 0700 if missing, every directory above it checked;
            docs/admin-guide.md, "What slurm-guard keeps on a node"). `{uid}` in it becomes the
            user's id, `{node}` the node's name (for "nodes" that share one machine).
        update_check: ShardedGuard without replica groups (FSDP2, FSDP2 + TP, two or more
            data-parallel indices): on every vote step, a rank on another node recomputes each
            rank's optimizer update of its shard from the same parameters, gradients (after
            clipping), optimizer state and hyperparameters, and the shard fingerprints are
            compared. No vote can catch a wrong update there: no other rank holds that shard.
            Costs, per vote step, one copy of the shard's update inputs over the network, one
            optimizer step and one fingerprint (docs/integrations/fsdp.md), and memory on the
            backend's device from the update to the check: the owner keeps a copy of its
            inputs (for a settling round) and the checker holds the one it received (each
            4x the parameter shard under Adam: parameters, gradients, two moments).
            Optimizers it cannot recompute (not torch.optim's own, step hooks, objects in
            param_groups) are skipped with a warning. Checked where the guard makes the
            optimizer step (`step()`, `update()`), not after the framework's own. No effect
            under DDP or HSDP: their vote compares true copies. Off by default: that memory
            (8x the parameter shard at once under Adam, on the device) would run a job whose
            batch was sized to fill its GPUs out of memory at its first vote step; turn it on
            where the headroom is there (the start line says it is off).
    """

    replay_every: int = 10
    vote_every: int = 10
    finite_check: bool = True
    seed: int | None = None
    faults: tuple[Fault, ...] = field(default_factory=tuple)
    settle_buckets: bool = True
    on_numerical: str = "stop"
    schedule: str = "fixed"
    deterministic: bool = True
    calibration_replays: int = 5
    tolerance_margin: float = 8.0
    initial_tolerance: float = 1e-3
    trust_replays: int = 2
    watchdog_seconds: float = 300.0
    abft: bool = False
    abft_margin: float = 10.0
    abft_block: int = 64
    triage_seconds: float = 20.0
    fast_path_world: int = 32
    max_grad_norm: float | None = None
    snapshots: bool = False
    snapshot_dir: str | None = None
    update_check: bool = False

    def __post_init__(self) -> None:
        self._check_types()
        for name in ("replay_every", "vote_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1_000_000:
                raise ConfigError(
                    f"GuardConfig.{name}={value!r}: must be an integer from 1 to 1000000 "
                    f"(1 checks every step, 10 is the default)"
                )
        if not 1 <= self.fast_path_world <= 1 << 30:
            raise ConfigError(
                f"GuardConfig.fast_path_world={self.fast_path_world!r}: must be a world size "
                "from 1 (always the fast path) up; the default 32 suits most clusters"
            )
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed < 2**62
        ):
            raise ConfigError(
                f"GuardConfig.seed={self.seed!r}: must be None or an int in [0, 2^62)"
            )
        if self.on_numerical not in ("stop", "skip"):
            raise ConfigError(
                f"GuardConfig.on_numerical={self.on_numerical!r}: must be 'stop' (raise, no "
                "drain) or 'skip' (skip the update and go on)"
            )
        if not 1 <= self.calibration_replays <= 10_000:
            raise ConfigError("GuardConfig.calibration_replays must be from 1 to 10000")
        if not (self.tolerance_margin >= 1.0 and 0.0 < self.initial_tolerance < 1.0):
            raise ConfigError(
                "GuardConfig: tolerance_margin must be >= 1 and initial_tolerance in (0, 1)"
            )
        if isinstance(self.trust_replays, bool) or not 1 <= self.trust_replays <= 100:
            raise ConfigError(
                f"GuardConfig.trust_replays={self.trust_replays!r}: must be from 1 to 100"
            )
        if self.schedule not in ("fixed", "random"):
            raise ConfigError(
                f"GuardConfig.schedule={self.schedule!r}: must be 'fixed' or 'random'"
            )
        if not 0 <= self.watchdog_seconds <= 86_400:
            raise ConfigError(
                f"GuardConfig.watchdog_seconds={self.watchdog_seconds!r}: must be from 0 (off) "
                "to 86400; the default 300 suits most jobs"
            )
        if not (1.0 <= self.abft_margin <= 1000.0 and 1 <= self.abft_block <= 4096):
            raise ConfigError(
                f"GuardConfig: abft_margin={self.abft_margin!r} must be from 1 to 1000 (the "
                f"default 10 means a false alarm needs a 10-sigma rounding error) and "
                f"abft_block={self.abft_block!r} from 1 to 4096 rows (default 64)"
            )
        if not 0 <= self.triage_seconds <= 3600:
            raise ConfigError(
                f"GuardConfig.triage_seconds={self.triage_seconds!r}: must be from 0 (off) to "
                "3600; the default 20 repeats a tiny step 3 times and a large one at least once"
            )
        norm = self.max_grad_norm
        if norm is not None and (
            isinstance(norm, bool) or not isinstance(norm, (int, float)) or not norm > 0
        ):
            raise ConfigError(
                f"GuardConfig.max_grad_norm={norm!r}: must be None (no clipping) or a positive "
                "number (1.0 in most LLM recipes)"
            )
        if self.snapshot_dir is not None and not isinstance(self.snapshot_dir, str):
            raise ConfigError(
                f"GuardConfig.snapshot_dir={self.snapshot_dir!r}: must be None or a path string "
                "on node-local memory (the default is /dev/shm/slurm-guard-{uid})"
            )
        object.__setattr__(self, "faults", tuple(self.faults))

    def _check_types(self) -> None:
        """Reject values of the wrong type before they are used as truth values or numbers.

        `deterministic="false"` would otherwise be truthy (exact comparison on GPU: false
        alarms, drains) and `trust_replays=1.5` would pass the range check.
        """
        for name in (
            "finite_check",
            "settle_buckets",
            "deterministic",
            "abft",
            "snapshots",
            "update_check",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(
                    f"GuardConfig.{name}={value!r}: must be True or False (a bool, not "
                    f"{type(value).__name__})"
                )
        for name in ("calibration_replays", "trust_replays", "abft_block", "fast_path_world"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(
                    f"GuardConfig.{name}={value!r}: must be an integer, not {type(value).__name__}"
                )
        for name in NUMBERS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(
                    f"GuardConfig.{name}={value!r}: must be a number, not {type(value).__name__}"
                )
        for name in (*NUMBERS, "max_grad_norm"):
            value = getattr(self, name)
            if isinstance(value, float) and not math.isfinite(value):
                # inf passes `> 0` and `>= 1` and would reach run.json as `Infinity`, which
                # is not JSON; no setting means "unbounded" by inf
                raise ConfigError(
                    f"GuardConfig.{name}={value!r}: must be a finite number"
                    + (" (None turns clipping off)" if name == "max_grad_norm" else "")
                )
        for name in ("on_numerical", "schedule"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ConfigError(
                    f"GuardConfig.{name}={value!r}: must be a string, not {type(value).__name__}"
                )
        faults = self.faults
        if isinstance(faults, (str, bytes)) or not isinstance(faults, (tuple, list)):
            raise ConfigError(
                f"GuardConfig.faults={faults!r}: must be a tuple of Fault objects, e.g. "
                "(Fault('nan', rank=1, step=5),); for a 'kind=nan,...' string use "
                "slurm_guard.faults.injection.parse_faults or SLURM_GUARD_INJECT"
            )
        if not faults:
            return
        from slurm_guard.faults.injection import Fault  # imports torch: only when faults are given

        for fault in faults:
            if not isinstance(fault, Fault):
                raise ConfigError(
                    f"GuardConfig.faults contains {fault!r}: every entry must be a Fault"
                )

    def is_replay_step(self, step: int, seed: int = 0) -> bool:
        if self.schedule == "fixed":
            return step % self.replay_every == 0
        # A keyed hash of the step: identical on every rank, unpredictable without the seed.
        digest = hashlib.blake2b(step.to_bytes(8, "little"), key=seed.to_bytes(8, "little"))
        draw = int.from_bytes(digest.digest()[:8], "little")
        return draw % self.replay_every == 0

    def is_vote_step(self, step: int) -> bool:
        return (step + 1) % self.vote_every == 0

    def summary(self) -> dict[str, object]:
        """The settings `slurm-guard status` shows as 'checks configured'."""
        return {
            "replay_every": self.replay_every,
            "vote_every": self.vote_every,
            "finite_check": self.finite_check,
            "settle_buckets": self.settle_buckets,
            "on_numerical": self.on_numerical,
            "schedule": self.schedule,
            "deterministic": self.deterministic,
            "trust_replays": self.trust_replays,
            "watchdog_seconds": self.watchdog_seconds,
            "abft": self.abft,
            "abft_margin": self.abft_margin,
            "abft_block": self.abft_block,
            "triage_seconds": self.triage_seconds,
            "fast_path_world": self.fast_path_world,
            "max_grad_norm": self.max_grad_norm,
            "faults": [f.describe() for f in self.faults],
            "snapshots": self.snapshots,
            "update_check": self.update_check,
        }
