"""`slurm-guard local -n 3 -- python script.py`: real processes, real gloo, the real exit codes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_guard.local.script import exit_code

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parent / "local_train.py"


LAUNCHER = [sys.executable, "-m", "slurm_guard.cli", "local"]


def _launch(run_dir: Path, inject: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("SLURM_GUARD_INJECT", None)
    if inject is not None:
        env["SLURM_GUARD_INJECT"] = inject
    cmd = [sys.executable, "-m", "slurm_guard.cli", "local", "-n", "3", "--grace", "60"]
    cmd += ["--", sys.executable, str(SCRIPT), str(run_dir), "6"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_a_clean_run_exits_0(tmp_path: Path) -> None:
    out = _launch(tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "run.json").is_file()


def test_a_persistent_fault_on_node2_makes_the_launcher_exit_86(tmp_path: Path) -> None:
    out = _launch(tmp_path, "kind=grad-scale,node=node2,step=1,persistent=1,param=3")
    assert out.returncode == 86, out.stderr[-3000:]
    assert list((tmp_path / "alarms").glob("*.json")), "no alarm record"


def test_the_exit_code_keeps_86_and_the_first_failure() -> None:
    assert exit_code([0, 86, 1]) == 86
    assert exit_code([0, 3, 1]) == 3
    assert exit_code([0, -15, 0]) == 128 + 15
    assert exit_code([0, 0, 0]) == 0


def test_a_missing_command_is_a_clean_error() -> None:
    out = subprocess.run(
        [*LAUNCHER, "-n", "2", "--", "/nonexistent/train"], capture_output=True, text=True
    )
    assert out.returncode == 1
    assert "cannot run '/nonexistent/train'" in out.stderr
    assert "Traceback" not in out.stderr


# rank 1 exits 3 at once; the others would sleep for a minute
FAILS_ON_RANK_1 = (
    "import os, sys, time\nsys.exit(3) if os.environ['RANK'] == '1' else time.sleep(60)"
)


def test_the_launcher_exits_with_the_failing_ranks_code_not_its_own_signal() -> None:
    cmd = [*LAUNCHER, "-n", "3", "--grace", "1", "--", sys.executable, "-c", FAILS_ON_RANK_1]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stderr[-2000:]  # not 143: ranks 0 and 2 got its SIGTERM


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# every rank writes its pid, then sleeps
WRITES_ITS_PID = (
    "import os, sys, time\n"
    "open(os.path.join(sys.argv[1], os.environ['RANK']), 'w').write(str(os.getpid()))\n"
    "time.sleep(120)"
)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_to_the_launcher_stops_every_rank(tmp_path: Path, signum: int) -> None:
    cmd = [*LAUNCHER, "-n", "3", "--", sys.executable, "-c", WRITES_ITS_PID, str(tmp_path)]
    launcher = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(pids) < 3 and time.monotonic() < deadline:
            files = [tmp_path / str(r) for r in range(3)]
            if all(f.is_file() and f.read_text() for f in files):
                pids = [int(f.read_text()) for f in files]
            time.sleep(0.1)
        assert len(pids) == 3, "the ranks did not start"
        launcher.send_signal(signum)
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 128 + signum, err[-2000:]
        assert [pid for pid in pids if _alive(pid)] == []  # no rank outlived the launcher
    finally:
        launcher.kill()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_rank_that_dies_leaves_the_others_time_to_raise_the_named_error(tmp_path: Path) -> None:
    # rank 1 raises at step 3; ranks 0 and 2 wait in the step's all-reduce until the guard's
    # watchdog (40 s here, 300 s by default) names rank 1 as missing. The default --grace must
    # let them get there, rather than SIGTERM them first.
    cmd = [*LAUNCHER, "-n", "3", "--", sys.executable, str(SCRIPT), str(tmp_path)]
    cmd += ["6", "1", "raise-at-3", "40"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert out.returncode == 1, out.stderr[-3000:]  # rank 1's own code
    # ranks 0 and 2 stop on the same named error; rank 0 says it once (issue 43: no per-rank
    # repeats), with no traceback
    named = [line for line in out.stderr.splitlines() if "RanksMissing" in line]
    assert len(named) == 1 and "stopped by slurm-guard" in named[0], out.stderr[-3000:]
