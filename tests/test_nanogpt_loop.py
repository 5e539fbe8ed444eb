"""Issue 23's done-means: one nanoGPT-style loop with every feature at once (nanogpt_loop.py),
on 3 ranks through the real `slurm-guard local -n 3 -- python script.py` launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parent / "nanogpt_loop.py"
ITERS = 12  # eval and save at 3, 6, 9
FAULT = "kind=grad-scale,node=node2,step=7,persistent=1,param=3"


def _launch(
    run_dir: Path, results: Path, *extra: str, inject: str | None = None, keep_loop: bool = False
) -> int:
    env = dict(os.environ)
    env.pop("SLURM_GUARD_INJECT", None)
    env["NANOGPT_KEEP_LOOP"] = "1" if keep_loop else "0"
    if inject is not None:
        env["SLURM_GUARD_INJECT"] = inject
    cmd = [sys.executable, "-m", "slurm_guard.cli", "local", "-n", "3", "--grace", "60", "--"]
    cmd += [sys.executable, str(SCRIPT), str(run_dir), str(results), str(ITERS), *extra]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    # kept beside the run directory: when an assertion on the alarm fails, the ranks' logs say why
    (run_dir.parent / f"{run_dir.name}-launcher.log").write_text(out.stdout + out.stderr)
    if out.returncode not in (0, 86):
        pytest.fail(f"launcher exited {out.returncode}:\n{out.stderr[-4000:]}")
    return out.returncode


def _results(results: Path) -> list[dict[str, Any]]:
    return [torch.load(results / f"rank-{r}.pt", weights_only=True) for r in range(3)]


def _alarm(run_dir: Path) -> dict[str, Any]:
    (path,) = (run_dir / "alarms").glob("*.json")
    alarm: dict[str, Any] = json.loads(path.read_text())
    return alarm


@pytest.mark.parametrize("keep_loop", [False, True], ids=["guard-step", "own-loop"])
def test_a_persistent_fault_is_caught_on_node2_and_the_resume_is_bit_identical(
    tmp_path: Path, keep_loop: bool
) -> None:
    """guard-step: the loop through `guard.step`; own-loop: nanoGPT's loop kept, the guard
    called around it (capture / check / after_update), its own clipping and scaler step."""
    assert _launch(tmp_path / "clean", tmp_path / "clean-out", keep_loop=keep_loop) == 0
    clean = _results(tmp_path / "clean-out")
    assert max(clean[0]["grad_norms"].values()) > 1.0, "max_grad_norm=1.0 never clipped"

    hit = tmp_path / "hit"
    assert _launch(hit, tmp_path / "hit-out", inject=FAULT, keep_loop=keep_loop) == 86
    alarm = _alarm(hit)
    assert alarm["verdict"] == "sdc" and alarm["step"] >= 7, alarm["message"]
    assert (alarm["suspect_ranks"], alarm["suspect_nodes"]) == ([1], ["node2"])
    assert not alarm["update_applied"]

    assert _launch(hit, tmp_path / "resumed-out", keep_loop=keep_loop) == 0
    resumed = _results(tmp_path / "resumed-out")
    start = min(resumed[0]["losses"])
    assert 0 < start <= 7, start
    for a, b in zip(clean, resumed, strict=True):
        assert sorted(b["losses"]) == list(range(start, ITERS))
        assert {s: a["losses"][s] for s in b["losses"]} == b["losses"]
        assert {s: a["grad_norms"][s] for s in b["grad_norms"]} == b["grad_norms"]
        assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"], strict=True))
        assert (a["lr"], a["best"]) == (b["lr"], b["best"])  # the LambdaLR and best_val_loss


def test_a_nan_sample_stops_the_run_as_numerical_without_applying_it(tmp_path: Path) -> None:
    assert _launch(tmp_path / "run", tmp_path / "out", "4", "1") == 86  # NaN: rank 1, step 4
    alarm = _alarm(tmp_path / "run")
    assert (alarm["verdict"], alarm["step"], alarm["update_applied"]) == ("numerical", 4, False)
    for r in _results(tmp_path / "out"):
        assert r["alarm"] == "numerical"
        assert r["unchanged"], "the NaN step's update was applied"
        assert all(bool(torch.isfinite(w).all()) for w in r["weights"])
