"""Bad input gets a clear error before training starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import slurm_guard as sg
from slurm_guard.checks.replay import Captured, any_nonfinite, pack, unpack
from slurm_guard.core.setup import check_run_dir
from slurm_guard.faults.injection import parse_faults


@pytest.mark.parametrize(
    "kwargs",
    [
        {"replay_every": 0},
        {"vote_every": -1},
        {"replay_every": 2.5},
        {"seed": -3},
        {"on_numerical": "ignore"},
        {"replay_every": True},
    ],
)
def test_config_out_of_range(kwargs: dict[str, object]) -> None:
    with pytest.raises(sg.ConfigError, match="GuardConfig"):
        sg.GuardConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name",
    ["max_grad_norm", "tolerance_margin", "watchdog_seconds", "abft_margin", "triage_seconds"],
)
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_an_infinite_or_nan_setting_is_refused_by_name(name: str, value: float) -> None:
    # max_grad_norm=inf passed `> 0` and run.json got `Infinity`, which is not JSON
    with pytest.raises(sg.ConfigError, match=f"GuardConfig.{name}="):
        sg.GuardConfig(**{name: value})  # type: ignore[arg-type]


def test_every_accepted_setting_is_valid_json() -> None:
    summary = sg.GuardConfig(max_grad_norm=1e308, tolerance_margin=1e300).summary()
    json.loads(json.dumps(summary, allow_nan=False))


def test_model_must_be_ddp(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(sg.GuardError, match="DistributedDataParallel"):
        sg.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b), tmp_path)


def test_missing_run_dir(tmp_path: Path) -> None:
    with pytest.raises(sg.GuardError, match="does not exist"):
        check_run_dir(tmp_path / "nope")


def test_read_only_run_dir() -> None:
    """As an unprivileged user (root writes anywhere), in a child process."""
    parent = Path(tempfile.mkdtemp())
    parent.chmod(0o755)
    ro = parent / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    code = (
        "import os, sys\n"
        "from slurm_guard.core.setup import check_run_dir\n"
        "os.setgid(65534); os.setuid(65534)\n"
        f"check_run_dir(__import__('pathlib').Path({str(ro)!r}))\n"
    )
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    assert "not writable" in out.stderr
    shutil.rmtree(parent)


def test_fault_spec_parsing() -> None:
    faults = parse_faults("kind=grad-scale,node=node2,step=12,persistent=1; kind=nan,rank=0,step=3")
    assert faults[0] == sg.Fault("grad-scale", node="node2", step=12, persistent=True)
    assert faults[1] == sg.Fault("nan", rank=0, step=3)
    for bad, words in [
        ("kind=zap,rank=1,step=1", "unknown fault kind"),
        ("kind=nan,step=1", "exactly one of rank"),
        ("kind=nan,rank=x,step=1", "not a number"),
        ("kind=nan,rank", "not key=value"),
        ("kind=nan,rank=1", "needs at least"),
    ]:
        with pytest.raises(sg.GuardError, match=words):
            parse_faults(bad)


def test_batch_travels_bit_for_bit() -> None:
    batch = {
        "x": torch.randn(3, 4),
        "meta": [torch.arange(5), (torch.tensor([True]), 7, "s")],
        "half": torch.randn(2).bfloat16(),
        "empty": torch.empty(0, 3),
    }
    cap = Captured(batch=batch, cpu_rng=torch.get_rng_state(), cuda_rng=None)
    back = unpack(pack(cap), torch.device("cpu"))
    assert torch.equal(back.cpu_rng, cap.cpu_rng)
    assert torch.equal(back.batch["x"], batch["x"])
    assert torch.equal(back.batch["half"], batch["half"])
    assert back.batch["half"].dtype == torch.bfloat16
    assert torch.equal(back.batch["meta"][0], batch["meta"][0])
    assert back.batch["meta"][1][1:] == (7, "s") and isinstance(back.batch["meta"][1], tuple)
    assert back.batch["empty"].shape == (0, 3)


def test_unsupported_batch_leaf_is_refused() -> None:
    with pytest.raises(sg.GuardError, match="tensors, numbers and strings"):
        pack(Captured(batch={"x": object()}, cpu_rng=torch.get_rng_state(), cuda_rng=None))


def test_random_schedule_has_the_same_expected_cost_and_depends_on_the_seed() -> None:
    config = sg.GuardConfig(replay_every=10, schedule="random")
    steps = range(20_000)
    picked = [s for s in steps if config.is_replay_step(s, seed=42)]
    assert 1800 < len(picked) < 2200  # 1/10 of the steps, give or take 5 sigma
    assert picked != [s for s in steps if s % 10 == 0]
    assert picked != [s for s in steps if config.is_replay_step(s, seed=43)]
    assert picked == [s for s in steps if config.is_replay_step(s, seed=42)]  # every rank agrees


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_replay_nonfinite_flag_sees_one_element_and_only_that(dtype: torch.dtype) -> None:
    """The replay's finite check: one NaN or Inf anywhere (past the first chunk, in a later
    tensor) or in the loss; large finite values whose float32 sum would overflow are finite
    (float64 gradients: up to where their float64 sum overflows, as in the hook's flag)."""
    loss = torch.tensor(1.5)
    big = 1e300 if dtype == torch.float64 else torch.finfo(dtype).max
    grads = [torch.randn(3, 5).to(dtype), torch.full((9000,), big, dtype=dtype)]
    assert not any_nonfinite(loss, grads)
    for bad in (float("nan"), float("inf"), -float("inf")):
        grads[1][7777] = bad
        assert any_nonfinite(loss, grads)
        grads[1][7777] = big
    assert any_nonfinite(torch.tensor([float("nan")]), grads)
    assert not any_nonfinite(loss, [])
