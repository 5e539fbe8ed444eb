"""The torch range: the DDP path runs without FSDP, the sharded guard refuses a torch without it.

A torch that lacks FSDP2's private comm interface is made here, not installed: a
`sitecustomize` on PYTHONPATH makes every import of `torch.distributed.fsdp` fail in every
process of the run (the launcher and each rank), which is what an older or a reorganised torch
does. The DDP training job must still run to the end on it, and `ShardedGuard` must stop with
the error that names the torch version and the API.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slurm_guard.comm.torch_support import (
    TESTED_TORCH,
    UnsupportedTorch,
    missing_methods,
    require_api,
    torch_version,
)

BLOCKER = '''
import importlib.abc, sys

class _NoFSDP(importlib.abc.MetaPathFinder):
    """A torch without FSDP: importing it fails as a missing module does."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch.distributed.fsdp" or name.startswith("torch.distributed.fsdp."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None

sys.meta_path.insert(0, _NoFSDP())
'''


def _without_fsdp(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    return env


def test_versions_are_read_from_torch_s_version_strings() -> None:
    assert torch_version("2.14.1+cu130") == (2, 14, 1)
    assert torch_version("2.13") == (2, 13, 0)
    assert torch_version("2.16.0.dev20270101") == (2, 16, 0)
    assert torch_version("nonsense") == (0, 0, 0)
    assert torch_version()[:2] >= (2, 13)


def test_pyproject_s_floor_is_the_oldest_torch_ci_tests() -> None:
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    oldest = min(TESTED_TORCH, key=torch_version)
    major, minor, _ = torch_version(oldest)
    assert f'"torch>={major}.{minor}"' in pyproject
    assert "torch<" not in pyproject.replace(" ", ""), "no cap below a released torch"


def test_a_class_without_the_methods_named_is_refused_by_name() -> None:
    class Module:
        def present(self) -> None: ...

    assert missing_methods(Module, ("present", "gone")) == ["gone"]
    with pytest.raises(UnsupportedTorch) as raised:
        require_api("The feature", Module, ("present", "gone"))
    message = str(raised.value)
    assert "Module.gone" in message and torch.__version__ in message
    assert all(version in message for version in TESTED_TORCH)


@pytest.mark.distributed
@pytest.mark.slow
def test_the_ddp_job_trains_on_a_torch_without_fsdp(tmp_path: Path) -> None:
    env = _without_fsdp(tmp_path)
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "slurm_guard.cli", "local", "-n", "2", "--",
         sys.executable, "-m", "slurm_guard.examples.train", "--run-dir", str(run_dir),
         "--steps", "6", "--replay-every", "2", "--vote-every", "2", "--checkpoint-every", "3"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["final_step"] == 6
    probe = subprocess.run(
        [sys.executable, "-c", "import torch.distributed.fsdp"], env=env, capture_output=True
    )
    assert probe.returncode != 0, "the blocker must really hide FSDP"


def test_the_sharded_guard_refuses_a_torch_without_fsdp_by_name(tmp_path: Path) -> None:
    script = (
        "import slurm_guard as sg\n"
        "try:\n"
        "    sg.ShardedGuard\n"
        "except sg.GuardError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=_without_fsdp(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("UnsupportedTorch ShardedGuard needs"), done.stdout
    assert f"torch {torch.__version__} does not have" in done.stdout
    assert "DefaultReduceScatter" in done.stdout
