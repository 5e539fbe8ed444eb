"""The frameworks' private hooks the integrations stand on, proven present before training.

Each is private to its framework and was tested on the releases named here (docs/architecture.md,
"Torch versions"). A release that moved one is refused by name at start, never run with the
check it carries quietly gone.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from slurm_guard.comm.torch_support import unsupported_release

__all__ = ["check_skip_flag", "restore_hook"]

ACCELERATE_TESTED = "1.16"
LIGHTNING_TESTED = "2.6"


def check_skip_flag(optimizer: Any) -> None:
    """A vetoed step must reach the LR scheduler as skipped, or the schedule runs ahead.

    accelerate's `AcceleratedOptimizer.step_was_skipped` returns the private `_is_overflow`
    (accelerate 1.10-1.16), which GuardedTrainer sets when the guard vetoes an update. Proven on
    the real optimizer before the first step.
    """
    before = getattr(optimizer, "_is_overflow", None)
    try:
        works = []
        for value in (True, False):
            optimizer._is_overflow = value
            works.append(getattr(optimizer, "step_was_skipped", None) is value)
    finally:
        optimizer._is_overflow = before if before is not None else False
    if not all(works):
        raise unsupported_release(
            "accelerate",
            metadata.version("accelerate"),
            ACCELERATE_TESTED,
            "GuardedTrainer",
            "AcceleratedOptimizer.step_was_skipped reporting _is_overflow",
        )


def restore_hook(trainer: Any) -> tuple[Any, Any]:
    """Lightning's checkpoint connector and the method that restores a checkpoint's modules.

    GuardCallback chooses the checkpoint Lightning restores by wrapping this private method
    (Lightning 2.5-2.6): without it the trust rule would not decide what is loaded.
    """
    connector = getattr(trainer, "_checkpoint_connector", None)
    original = getattr(connector, "_restore_modules_and_callbacks", None)
    if not callable(original):
        raise unsupported_release(
            "lightning",
            metadata.version("lightning"),
            LIGHTNING_TESTED,
            "GuardCallback",
            "Trainer._checkpoint_connector._restore_modules_and_callbacks",
        )
    return connector, original
