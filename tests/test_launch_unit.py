"""Launch without Slurm: Slurm environment -> rank, rendezvous, port, and the sbatch template."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from slurm_guard.local_launch import free_port
from slurm_guard.slurm.launch import (
    PORT_BASE,
    PORT_ENV,
    PORT_SPAN,
    LaunchError,
    check_run_dir,
    init_distributed_from_slurm,
    port_for_job,
    recovery_lines,
    render_sbatch,
    rendezvous_address,
    task_from_env,
)
from slurm_guard.slurm.parsers import NodeInfo

DATA = Path(__file__).resolve().parent / "data"
WEIRD_RUN_DIR = "/shared/we$ird;(run)&%x"

TASK_ENV = {
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "6",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_NODELIST": "gpu-[07-09]",
    "SLURM_JOB_NODELIST": "gpu-[01-09]",
    "SLURM_JOB_ID": "4242",
    "SLURM_RESTART_COUNT": "2",
    "SLURMD_NODENAME": "gpu-08",
}


class FakeClient:
    """Answers `node()` only; records what was asked."""

    def __init__(self, addresses: dict[str, str]) -> None:
        self.addresses = addresses
        self.asked: list[str] = []

    def node(self, name: str) -> NodeInfo:
        self.asked.append(name)
        return NodeInfo(name, frozenset({"ALLOCATED"}), None, None, self.addresses[name], name)


def test_task_comes_from_the_step_environment() -> None:
    task = task_from_env(TASK_ENV)
    assert (task.rank, task.world_size, task.local_rank, task.node_rank) == (3, 6, 1, 1)
    assert task.nodes == ("gpu-07", "gpu-08", "gpu-09")  # the step's nodes, not the job's
    assert task.first_node == "gpu-07"
    assert (task.job_id, task.restart_count, task.node) == ("4242", 2, "gpu-08")


def test_first_run_has_restart_count_zero() -> None:
    env = {k: v for k, v in TASK_ENV.items() if k != "SLURM_RESTART_COUNT"}
    assert task_from_env(env).restart_count == 0


def test_outside_slurm_the_error_says_to_use_srun() -> None:
    with pytest.raises(LaunchError, match="srun"):
        task_from_env({})
    with pytest.raises(LaunchError, match="SLURM_PROCID=7"):
        task_from_env({**TASK_ENV, "SLURM_PROCID": "7"})


def test_port_is_per_job_and_per_restart_and_in_range() -> None:
    ports = {port_for_job(str(j), r) for j in range(1, 200) for r in range(3)}
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)
    assert port_for_job("4242") == port_for_job("4242")
    assert port_for_job("4242", 1) != port_for_job("4242", 0)
    assert port_for_job("4242") != port_for_job("4243")


def test_rendezvous_is_the_node_addr_never_the_node_name() -> None:
    client = FakeClient({"gpu-07": "10.1.2.7"})
    assert rendezvous_address("gpu-07", client) == "10.1.2.7"  # type: ignore[arg-type]
    assert client.asked == ["gpu-07"]


def test_init_joins_a_gloo_group_from_slurm_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        **TASK_ENV,
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_NODEID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_NODELIST": "node-that-does-not-resolve",
        "SLURMD_NODENAME": "node-that-does-not-resolve",
        PORT_ENV: str(free_port()),
    }
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    client = FakeClient({"node-that-does-not-resolve": "127.0.0.1"})
    try:
        task = init_distributed_from_slurm(client, env)  # type: ignore[arg-type]
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
        assert task.node == "node-that-does-not-resolve"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("runs/x", "relative"),
        ("/a b", "' '"),
        ("/a,b", "','"),
        ("/a/../b", "'..'"),
        ("/a'b", '"\'"'),
    ],
)
def test_run_dir_the_comment_cannot_carry_is_refused(path: str, problem: str) -> None:
    with pytest.raises(LaunchError, match=problem):
        check_run_dir(path)


def golden_render(**kw: Any) -> str:
    return render_sbatch(
        run_dir=WEIRD_RUN_DIR,
        nodes=3,
        gpus_per_node=8,
        train_command=["/opt/venv/bin/python", "train.py", "--name", "it's $HOME"],
        job_name="golden",
        state_dir="/var/lib/slurm guard",
        slurm_guard="/opt/venv/bin/slurm-guard",
        sbatch_options={"partition": "gpu", "exclusive": True},
        **kw,
    )


def test_template_renders_the_golden_file_with_a_weird_path() -> None:
    assert golden_render() == (DATA / "guarded_ddp.golden.sbatch").read_text()


def test_rendered_script_is_valid_bash_and_quotes_the_weird_path(tmp_path: Path) -> None:
    script = tmp_path / "job.sbatch"
    script.write_text(golden_render())
    subprocess.run(["bash", "-n", str(script)], check=True)
    # Run the part before srun: the variables must hold the exact strings, nothing executed.
    head = script.read_text().split("srun ")[0]
    out = subprocess.run(
        ["bash", "-c", head + 'printf "%s\\n%s\\n" "$SLURM_GUARD_RUN_DIR" "$STATE_DIR"'],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin"},
    ).stdout
    assert out.splitlines() == [WEIRD_RUN_DIR, "/var/lib/slurm guard"]


def test_cpu_job_asks_for_no_gpus_and_one_task_per_node() -> None:
    text = render_sbatch(run_dir="/shared/run", nodes=3)
    assert "--gpus-per-node" not in text
    assert "#SBATCH --ntasks-per-node=1\n" in text
    assert "#SBATCH --requeue\n" in text
    assert "#SBATCH --comment=slurm-guard:run_dir=/shared/run\n" in text
    assert not re.search(r"@[A-Z_]+@", text)


def test_bad_sbatch_option_is_refused() -> None:
    with pytest.raises(LaunchError, match="cannot quote"):
        render_sbatch(run_dir="/r", nodes=3, sbatch_options={"comment": "a b"})
    with pytest.raises(LaunchError, match="long name"):
        render_sbatch(run_dir="/r", nodes=3, sbatch_options={"--time": "5"})


def test_in_job_recovery_lines_keep_srun_status() -> None:
    lines = recovery_lines(Path("/r"), "/state", slurm_guard="/bin/slurm-guard")
    assert lines[0] == "sg_rc=$?"
    assert "/bin/slurm-guard recover --run-dir /r --state-dir /state" in lines[1]
    assert lines[-1] == 'exit "$sg_rc"'
