"""slurm-guard inside training loops it does not own: the HF Trainer and PyTorch Lightning.

Each integration lives in its own module and imports its framework only when that module is
imported (`pip install 'slurm-guard[hf]'` or `'slurm-guard[lightning]'`); importing this
package, `slurm_guard` or `slurm_guard.core` loads neither. The names below resolve lazily:

- `GuardedTrainer` (`integrations.hf`): a drop-in `transformers.Trainer`;
- `GuardCallback` (`integrations.lightning`): a `lightning.pytorch` callback.

Both are built on the core's public step calls (`GuardCore.capture` / `check` /
`after_update`) and tie the framework's own checkpoints to the guard's trust decision
(`integrations._frameworks`). For a hand-written
Accelerate loop see docs/integrations/.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "GuardedTrainer": "slurm_guard.integrations.hf",
    "GuardCallback": "slurm_guard.integrations.lightning",
}

__all__ = ["GuardCallback", "GuardedTrainer"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
