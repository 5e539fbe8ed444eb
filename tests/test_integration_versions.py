"""The frameworks' private hooks are proven present before training, on the real packages.

A release that moved one must be refused by name (package, version, API), not trained with the
check it carries gone. "Moved" is made here by handing the check an object without the hook.
Skipped without accelerate or lightning, unless SLURM_GUARD_REQUIRE_INTEGRATIONS=1 (CI).
"""

from __future__ import annotations

import importlib.util
import os
from importlib import metadata

import pytest
import torch

from slurm_guard.comm.torch_support import UnsupportedVersion

NEEDED = ("accelerate", "lightning")
HAVE = all(importlib.util.find_spec(m) is not None for m in NEEDED)
if not HAVE and os.environ.get("SLURM_GUARD_REQUIRE_INTEGRATIONS") == "1":
    raise RuntimeError("SLURM_GUARD_REQUIRE_INTEGRATIONS=1 but accelerate/lightning are missing")
pytestmark = pytest.mark.skipif(not HAVE, reason="needs the [hf] and [lightning] extras")


def test_accelerate_s_skip_flag_is_proven_on_its_real_optimizer() -> None:
    from accelerate import Accelerator

    from slurm_guard.integrations._versions import check_skip_flag

    model = torch.nn.Linear(2, 2)
    optimizer = Accelerator(cpu=True).prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    check_skip_flag(optimizer)
    assert optimizer.step_was_skipped is False  # left as found

    with pytest.raises(UnsupportedVersion) as raised:
        check_skip_flag(torch.optim.SGD(model.parameters(), lr=0.1))  # no step_was_skipped
    message = str(raised.value)
    assert f"accelerate {metadata.version('accelerate')}" in message
    assert "step_was_skipped" in message and "GuardedTrainer" in message


def test_lightning_s_restore_hook_is_found_on_a_real_trainer() -> None:
    import lightning.pytorch as pl

    from slurm_guard.integrations._versions import restore_hook

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    connector, original = restore_hook(trainer)
    assert connector is trainer._checkpoint_connector and callable(original)

    trainer._checkpoint_connector = object()  # a release without the private method
    with pytest.raises(UnsupportedVersion) as raised:
        restore_hook(trainer)
    message = str(raised.value)
    assert f"lightning {metadata.version('lightning')}" in message
    assert "_restore_modules_and_callbacks" in message and "GuardCallback" in message
